"""Quantised KV caches (per-token-head fp8 / int8 / int4, NVFP4, fp8 per tensor) against our bf16 cache.

    python -m benchmarks.run --suite kv_quant_decode      # decode time and bytes moved, per format
    python -m benchmarks.run --suite kv_quant_prefill     # a chunk on cached context over a quantised cache
    python -m benchmarks.run --suite kv_quant_accuracy    # output error against the bf16 cache, random and outlier data
    python -m benchmarks.kv_quant --mode decode --smoke   # tiny, on the CPU

Llama-3-8B layer (32 query / 8 KV heads of 128, page 16, bf16 model), pages in random order, the Triton backend
through the public API as an engine calls it: one ``build()`` per step and ``--layers`` layer forwards with the
step's keys and values (each layer its own cache; the new tokens are quantised on write inside ``forward``); times
are per layer (step time / layers). Rows (PERF.md):

- ``kv_quant_decode`` / ``triton`` / ``triton_bf16`` (field ``format``, ``batch`` uniform or ragged): ``ratio`` = time
  over the bf16 cache's on the same batch; ``GBps`` = cache bytes read (``bytes_per_token`` of the format, scales
  included, times the batch's tokens) over the time.
- ``kv_quant_prefill`` / ``triton`` / ``triton_bf16`` (field ``format``): ``TFLOPs`` of the chunk's causal attention.
- ``kv_quant_accuracy`` / ``triton`` / ``triton_bf16`` (fields ``format``, ``data``: random or outlier (two KV heads'
  keys and values 100x larger)): ``rel_err`` (relative Frobenius error of the output against the bf16 cache's; on
  outlier data the outlier heads' logits are so peaked that any rounding moves them), ``rel_err_ordinary_heads``
  (the other heads, which a per-tensor scale shares with the outliers), ``max_abs_err``.
- ``kv_quant_greedy`` / ``triton`` / ``triton_bf16`` (field ``format``; in ``--mode accuracy``): the demo model's
  greedy tokens with each quantised cache against its 16-bit cache, teacher-forced: ``token_agreement``,
  ``positions``, ``first_divergence`` (``benchmarks/kv_quant_greedy.py``; ``--greedy-prompts``,
  ``--greedy-new-tokens``; with ``--smoke`` the reference backend in float32 on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec, build_common_metadata  # noqa: E402
from attnbackends.ops.kv_layout import kv_cache_bytes_per_token  # noqa: E402
from attnbackends.selection.registry import get_backend_class  # noqa: E402
from benchmarks.kv_quant_greedy import greedy_rows  # noqa: E402

FORMATS = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4", "fp8")
#: NVFP4's global scale for unit-normal data (the largest block scale stays well inside e4m3's range).
NVFP4_GLOBAL = 6.0 / (448 * 6)


def _timer_us(fn, device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _spec(args, kv_cache_dtype: str) -> AttentionSpec:
    return AttentionSpec(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                         dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, block_size=args.block_size)


def _impl_scales(kv_cache_dtype: str) -> dict:
    if kv_cache_dtype == "nvfp4":
        return {"k_scale": NVFP4_GLOBAL, "v_scale": NVFP4_GLOBAL}
    if kv_cache_dtype == "fp8":  # calibrated for unit-normal data (|x| < 6)
        return {"k_scale": 6.0 / 448, "v_scale": 6.0 / 448}
    return {}


class Step:
    """One engine step of ``layers`` layers over a batch: ``build()`` plus every layer's ``forward``."""

    def __init__(self, args, kv_cache_dtype, query_lens, context_lens, device, outlier_heads=(), scales=None):
        self.spec = spec = _spec(args, kv_cache_dtype)
        backend = get_backend_class("triton")
        bs = spec.block_size
        pages = [-(-(q + c) // bs) for q, c in zip(query_lens, context_lens)]
        pool = list(range(sum(pages) + 1))
        random.Random(0).shuffle(pool)
        tables, at = [], 0
        for n in pages:
            tables.append(pool[at:at + n])
            at += n
        num_blocks = len(pool)
        self.common = build_common_metadata(query_lens, context_lens, tables, bs, device)
        fill = build_common_metadata([q + c for q, c in zip(query_lens, context_lens)], [0] * len(tables), tables, bs,
                                     device)
        self.builder = backend.get_builder_cls()(spec, device, max_num_reqs=len(tables),
                                                 max_num_tokens=max(sum(query_lens), 1), num_blocks=num_blocks)
        scales = _impl_scales(kv_cache_dtype) if scales is None else scales
        self.impls = [backend.get_impl_cls()(spec, **scales) for _ in range(args.layers)]
        gen = torch.Generator(device=device).manual_seed(1)
        total = sum(q + c for q, c in zip(query_lens, context_lens))
        hkv, d, dt = spec.num_kv_heads, spec.head_size, spec.torch_dtype
        self.caches = []
        for impl in self.impls:
            cache = backend.allocate_kv_cache(num_blocks, spec, device)
            keys = torch.randn(total, hkv, d, device=device, generator=gen, dtype=dt)
            values = torch.randn(total, hkv, d, device=device, generator=gen, dtype=dt)
            for h in outlier_heads:
                keys[:, h] *= 100
                values[:, h] *= 100
            impl.update_kv_cache(keys, values, cache, fill.slot_mapping)
            self.caches.append(cache)
            del keys, values
        n = self.common.num_actual_tokens
        self.query = torch.randn(n, spec.num_heads, d, device=device, generator=gen, dtype=dt)
        # the step's new keys and values: the ones already cached at the new tokens' slots, written again
        self.key = torch.randn(n, hkv, d, device=device, generator=gen, dtype=dt)
        self.value = torch.randn(n, hkv, d, device=device, generator=gen, dtype=dt)
        self.outputs = [torch.empty_like(self.query) for _ in self.impls]
        self.kv_tokens = total

    def __call__(self, with_keys: bool = True):
        meta = self.builder.build(self.common)
        k, v = (self.key, self.value) if with_keys else (None, None)
        for impl, cache, out in zip(self.impls, self.caches, self.outputs):
            impl.forward(self.query, k, v, cache, meta, out)
        return self.outputs


def _lognormal(n, median, sigma, cap, seed=0):
    rng = random.Random(seed)
    return [int(min(cap, max(1, round(math.exp(rng.gauss(math.log(median), sigma)))))) for _ in range(n)]


def _decode_batches(args):
    if args.smoke:
        return {"uniform": [40] * 3, "ragged": [5, 70, 20]}
    return {f"uniform_B{args.batch}_L{args.seq_len}": [args.seq_len] * args.batch,
            "uniform_B128_L8192": [8192] * 128,
            "ragged_B128_lognormal1500": _lognormal(128, 1500, 0.9, 32768)}


def _free():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_decode(args, device) -> list[dict]:
    rows = []
    for name, lens in _decode_batches(args).items():
        B = len(lens)
        q_lens, ctx = [1] * B, [n - 1 for n in lens]
        base = Step(args, "auto", q_lens, ctx, device)
        base_us = _timer_us(base, device) / args.layers
        bf16_bytes = kv_cache_bytes_per_token(base.spec)
        del base
        _free()
        for fmt in FORMATS:
            step = Step(args, fmt, q_lens, ctx, device)
            us = _timer_us(step, device) / args.layers
            bpt = kv_cache_bytes_per_token(step.spec)
            rows.append({"case": "kv_quant_decode", "backend": "triton", "peer": "triton_bf16", "format": fmt,
                         "batch": name, "B": B, "L": max(lens), "kv_tokens": step.kv_tokens, "dtype": args.dtype,
                         "kv_dtype": fmt, "us": us, "peer_us": base_us, "ratio": us / base_us,
                         "bytes_per_token": bpt, "bf16_bytes_per_token": bf16_bytes,
                         "GBps": step.kv_tokens * bpt / us / 1e3,
                         "peer_GBps": step.kv_tokens * bf16_bytes / base_us / 1e3})
            print(json.dumps(rows[-1]), flush=True)
            del step
            _free()
    return rows


def run_prefill(args, device) -> list[dict]:
    shapes = [(1, 16, 48)] if args.smoke else [(1, 2048, 14336), (4, 2048, 6144), (8, 512, 3584)]
    rows = []
    for B, chunk, ctx in shapes:
        q_lens, c_lens = [chunk] * B, [ctx] * B
        flops = sum(4.0 * args.num_heads * args.head_size * (chunk * ctx + chunk * (chunk + 1) / 2) for _ in range(B))
        base = Step(args, "auto", q_lens, c_lens, device)
        base_us = _timer_us(base, device) / args.layers
        del base
        _free()
        for fmt in FORMATS:
            step = Step(args, fmt, q_lens, c_lens, device)
            us = _timer_us(step, device) / args.layers
            rows.append({"case": "kv_quant_prefill", "backend": "triton", "peer": "triton_bf16", "format": fmt,
                         "B": B, "L": chunk, "ctx": ctx, "dtype": args.dtype, "kv_dtype": fmt, "us": us,
                         "peer_us": base_us, "ratio": us / base_us, "TFLOPs": flops / us / 1e6,
                         "peer_TFLOPs": flops / base_us / 1e6})
            print(json.dumps(rows[-1]), flush=True)
            del step
            _free()
    return rows


def run_accuracy(args, device) -> list[dict]:
    lens = [40, 9, 70] if args.smoke else _lognormal(16, 2048, 0.5, 8192, seed=3)
    q_lens, ctx = [1] * len(lens), [n - 1 for n in lens]
    rows = []
    for data, outliers in (("random", ()), ("outlier", (1,) if args.smoke else (1, 5))):
        base = Step(args, "auto", q_lens, ctx, device, outliers)
        want = base(with_keys=False)[0].float()
        del base
        for fmt in FORMATS:
            # fp8 per tensor on outlier data: calibrated on the whole cache, outliers (|x| up to ~600) included
            scales = {"k_scale": 600.0 / 448, "v_scale": 600.0 / 448} if fmt == "fp8" and outliers else None
            step = Step(args, fmt, q_lens, ctx, device, outliers, scales)
            got = step(with_keys=False)[0].float()
            err = ((got - want).norm() / want.norm()).item()
            qpk = step.spec.num_queries_per_kv
            ordinary = [h for h in range(step.spec.num_heads) if h // qpk not in outliers]
            err_ordinary = ((got[:, ordinary] - want[:, ordinary]).norm() / want[:, ordinary].norm()).item()
            rows.append({"case": "kv_quant_accuracy", "backend": "triton", "peer": "triton_bf16", "format": fmt,
                         "data": data, "B": len(lens), "L": max(lens), "dtype": args.dtype, "kv_dtype": fmt,
                         "rel_err": err, "rel_err_ordinary_heads": err_ordinary,
                         "max_abs_err": (got - want).abs().max().item(),
                         "bytes_per_token": kv_cache_bytes_per_token(step.spec)})
            print(json.dumps(rows[-1]), flush=True)
            del step
            _free()
    return rows + greedy_rows(FORMATS, device, args.smoke, args.greedy_prompts, args.greedy_new_tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("decode", "prefill", "accuracy"), required=True)
    ap.add_argument("--out", help="JSON rows to write (PERF.md format)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted) to check it")
    ap.add_argument("-B", "--batch", type=int, default=64)
    ap.add_argument("-L", "--seq-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--greedy-prompts", type=int, default=32, help="demo prompts of the kv_quant_greedy rows")
    ap.add_argument("--greedy-new-tokens", type=int, default=64, help="greedy tokens per prompt of those rows")
    args = ap.parse_args(argv)
    args.dtype = "bfloat16"
    if args.smoke:
        args.num_heads, args.num_kv_heads, args.head_size, args.layers, args.dtype = 4, 2, 32, 1, "float16"
        args.greedy_prompts, args.greedy_new_tokens = min(args.greedy_prompts, 3), min(args.greedy_new_tokens, 6)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("the full-size benchmark needs a GPU; use --smoke on the CPU")
    rows = {"decode": run_decode, "prefill": run_prefill, "accuracy": run_accuracy}[args.mode](args, device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
