"""The Triton backend through its public API, as an engine calls it, side by side with FlashInfer and torch SDPA.

    python -m benchmarks.run --suite triton_api [-- --quick]     # results kept in benchmarks/results/
    python -m benchmarks.triton_api --out rows.json [--quick]

``builder.build(common)`` once per batch, then ``impl.forward`` timed: decodes as ``forward(q, None, None,
kv_cache, metadata, out)`` (the cache already holds every key); prefill and mixed batches as an engine runs them,
``forward(q, k, v, kv_cache, metadata, out)`` with the step's new keys and values (written to the cache inside the
timed call; ``prefill_kv_in_cache`` rows time the call without them), against raw FlashInfer wrappers planned once
on the same cache tensor (``run()`` timed) and torch SDPA for prefill. Rows use the names of PERF.md:

- ``host_overhead``: host (thread CPU) time of one call with the GPU idle: B=1 decode at L=16; ours (attention
  only, and with the KV write: ``triton_with_write``) vs FlashInfer ``run()``, and one torch op as the yardstick.
- ``decode_eager``: B=1 L=1024, B=1 L=16384, B=16 L=4096, eager (no CUDA graph), do_bench medians and
  back-to-back wall time per call.
- ``decode`` (bf16 and fp8 e4m3 KV), ``prefill`` (TFLOP/s vs FlashInfer and SDPA; every token new, so on an H100
  the Gluon Hopper prefill kernel runs: ``prefill_kernel`` names the kernel). Ours is the forward with the
  step's keys and values, cache write included; the peers' rows are the attention alone (FlashInfer on a cache
  that already holds the keys): ``kv_write_us`` is the write as its own launch, ``attention_only_us`` the Gluon
  kernel's launch alone; ``kernel_writes_cache``: the Gluon kernel writes the cache itself (the default for
  batches of fresh prefills only; ``finish_write_us``: the write kernel's pass after it, timed alone), and
  ``prefill_write_beside`` / ``prefill_write_first`` rows time the same batch
  with the separate write beside the kernel (the builder's rule) and first. ``prefill_triton_kernel``: the same
  batches on the Triton prefill kernel
  (``hopper_prefill=False``), ``mixed`` (with the builder's own choice between
  one unified launch and the prefill kernel for its prefills, and ``mixed_other_split``: the other choice, forced).

``--prefill-sweep`` times the prefill kernel's tile configs on the prefill shapes instead; ``--write-sweep`` the
cache write instead: ``kv_write`` rows (the write kernel alone at each tokens-per-program, against torch copying
the same keys and values) and ``prefill_write_sms`` rows (the prefill forward with the Gluon kernel leaving each
number of SMs to the cache write beside it; 0: the write first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.ops.kv_cache_write import finish_cache_write, reshape_and_cache
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadata
from attnbackends.triton.prefill_hopper import HopperPrefillPlan, launch_hopper_prefill

HQ, HKV, D, PAGE = 32, 8, 128, 16
SCALE = 1.0 / math.sqrt(D)
DEV = "cuda"
PREFILL_KERNEL = None  # the Triton builder's prefill_kernel option: None its default, True forced, False off
HOPPER_PREFILL = True  # the Triton builder's hopper_prefill option (the Gluon kernel for fresh prefills)
PREFILL_SHAPES = [(1, 8192), (4, 4096), (16, 1024)]


def prefill_kernel_name(metadata: TritonMetadata) -> str:
    """Which kernel runs a batch's prefills when the forward brings the step's keys and values."""
    if metadata.prefill_split is None:
        return "unified"
    return "gluon_hopper" if isinstance(metadata.prefill_split[1], HopperPrefillPlan) else "triton_prefill"


def do_bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def wall_us(fn, n: int = 200) -> float:
    """Back-to-back wall time per call, GPU drained at both ends."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_us(*fns, n: int = 300, rounds: int = 9) -> list[float]:
    """Per function, the median over ``rounds`` rounds of the calling thread's CPU time per call, the functions'
    rounds interleaved (so a slow start-up or a noisy stretch of the host falls on all of them alike; the GPU
    drained between rounds)."""
    for fn in fns:
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times):
            t0 = time.thread_time_ns()
            for _ in range(n):
                fn()
            t.append((time.thread_time_ns() - t0) / n / 1e3)
            torch.cuda.synchronize()
    return [sorted(t)[rounds // 2] for t in times]


class Batch:
    """One batch on one random cache (pages shuffled), through the public API and as FlashInfer's page table."""

    def __init__(self, shapes, kv_cache_dtype="auto", seed=0, max_num_reqs=256, head_size=D, num_heads=HQ,
                 num_kv_heads=HKV, layer=None, **builder_kw):
        """``layer``: further AttentionSpec fields (a window, a soft-cap, sinks: random sink logits)."""
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.shapes = shapes
        q_lens = [q for q, _ in shapes]
        c_lens = [c for _, c in shapes]
        seq_lens = [q + c for q, c in shapes]
        pages = [triton.cdiv(s, PAGE) for s in seq_lens]
        total = sum(pages)
        self.spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype="bfloat16",
                                  kv_cache_dtype=kv_cache_dtype, block_size=PAGE, **(layer or {}))
        cache = TritonAttentionBackend.allocate_kv_cache(total, self.spec, DEV)
        dense = torch.randn(cache.shape, device=DEV, dtype=torch.bfloat16, generator=g)
        self.kv_scale = 1.0
        if cache.dtype != torch.bfloat16:
            self.kv_scale = float(dense.abs().amax()) / 240.0
            dense = dense.float() / self.kv_scale
        cache.copy_(dense.to(cache.dtype))
        self.kv = cache
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        tables, at = [], 0
        for n in pages:
            tables.append(perm[at:at + n])
            at += n
        self.common = build_common_metadata(q_lens, c_lens, tables, PAGE, DEV)
        self.kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0)), dtype=torch.int32, device=DEV)
        self.kv_indices = torch.tensor(perm, dtype=torch.int32, device=DEV)
        self.last_page_len = torch.tensor([(s - 1) % PAGE + 1 for s in seq_lens], dtype=torch.int32, device=DEV)
        self.num_tokens = sum(q_lens)
        self.query = torch.randn(self.num_tokens, num_heads, head_size, device=DEV, dtype=torch.bfloat16, generator=g)
        self.new_k = torch.randn(self.num_tokens, num_kv_heads, head_size, device=DEV, dtype=torch.bfloat16,
                                 generator=g)
        self.new_v = torch.randn_like(self.new_k)
        self.kv_bytes = sum(seq_lens) * num_kv_heads * head_size * 2 * cache.element_size()
        visible = sum(sum(c + i + 1 for i in range(q)) for q, c in shapes)
        if self.spec.sliding_window:
            visible = _visible_keys(shapes, self.spec.sliding_window)
        self.flops = 4.0 * num_heads * head_size * visible
        self.builder = TritonAttentionBackend.get_builder_cls()(
            self.spec, DEV, max_num_reqs=max(max_num_reqs, len(shapes)), max_num_tokens=max(self.num_tokens, 8192),
            num_blocks=self.kv.shape[0], prefill_kernel=PREFILL_KERNEL, hopper_prefill=HOPPER_PREFILL, **builder_kw)
        sinks = torch.randn(num_heads, device=DEV, generator=g) if self.spec.has_sinks else None
        self.impl = TritonAttentionBackend.get_impl_cls()(self.spec, k_scale=self.kv_scale, v_scale=self.kv_scale,
                                                          sinks=sinks)
        self.metadata = self.builder.build(self.common)
        self.out = torch.full_like(self.query, float("nan"))

    def triton(self, write: bool = False):
        k, v = (self.new_k, self.new_v) if write else (None, None)
        return lambda: self.impl.forward(self.query, k, v, self.kv, self.metadata, self.out)

    def sub(self, lo, hi):
        """FlashInfer's page table of requests lo..hi-1 (same cache)."""
        ptr = self.kv_indptr
        indices = self.kv_indices[int(ptr[lo]):int(ptr[hi])]
        indptr = ptr[lo:hi + 1] - ptr[lo]
        qsl = self.common.query_start_loc[lo:hi + 1] - self.common.query_start_loc[lo]
        t0, t1 = int(self.common.query_start_loc_cpu[lo]), int(self.common.query_start_loc_cpu[hi])
        return indptr, indices, self.last_page_len[lo:hi], qsl, self.query[t0:t1]


def flashinfer_decode(batch: Batch, lo=0, hi=None):
    import flashinfer

    hi = len(batch.shapes) if hi is None else hi
    indptr, indices, last, _, query = batch.sub(lo, hi)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=DEV), "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
           kv_data_type=batch.kv.dtype, sm_scale=SCALE)
    out = torch.empty_like(query)
    kw = dict(k_scale=batch.kv_scale, v_scale=batch.kv_scale) if batch.kv.dtype != torch.bfloat16 else {}
    return (lambda: w.run(query, batch.kv, out=out, **kw)), out


def flashinfer_prefill(batch: Batch, lo=0, hi=None):
    import flashinfer

    hi = len(batch.shapes) if hi is None else hi
    indptr, indices, last, qsl, query = batch.sub(lo, hi)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=DEV), "NHD")
    w.plan(qsl, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=batch.kv.dtype, sm_scale=SCALE)
    out = torch.empty_like(query)
    return (lambda: w.run(query, batch.kv, out=out)), out


def sdpa_prefill(B, L):
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(B, HQ, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, L, D, device=DEV, dtype=torch.bfloat16, generator=g)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    return fn


def profile_forward(n: int = 3000) -> None:
    """cProfile of ``n`` attention-only forwards of a tiny decode (host-bound), top functions by own time."""
    import cProfile
    import pstats

    b = Batch([(1, 15)])
    fn = b.triton()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        fn()
        if i % 500 == 0:
            torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON rows to write (PERF.md format)")
    ap.add_argument("--quick", action="store_true", help="host overhead and eager decode rows only")
    ap.add_argument("--mixed", action="store_true", help="the mixed-step rows only")
    ap.add_argument("--split-sweep", action="store_true", help="small eager decodes at each split-KV count")
    ap.add_argument("--profile", action="store_true", help="print where the host time of one forward goes")
    ap.add_argument("--prefill-sweep", action="store_true", help="time the prefill kernel's tile configs only")
    ap.add_argument("--paged-rows", action="store_true",
                    help="the paged Gluon prefill's rows only (prefill_chunk, prefill_cached, prefill, prefill_shape)")
    ap.add_argument("--paged-shapes", nargs="*", default=None,
                    help=f"with --paged-rows: only these prefill_shape rows (of {', '.join(SHAPE_ROWS)}); default: "
                         "every paged row")
    ap.add_argument("--write-sweep", action="store_true",
                    help="time the cache write alone (tokens per program) and beside the prefill (SMs left to it)")
    ap.add_argument("--no-prefill-kernel", action="store_true",
                    help="build with prefill_kernel=False (prefills on the unified kernel)")
    ap.add_argument("--force-prefill-kernel", action="store_true",
                    help="build with prefill_kernel=True (every batch with prefills on the prefill kernel)")
    ap.add_argument("--no-hopper-prefill", action="store_true",
                    help="build with hopper_prefill=False (fresh prefills on the Triton prefill kernel)")
    args = ap.parse_args(argv)
    global PREFILL_KERNEL, HOPPER_PREFILL
    PREFILL_KERNEL = False if args.no_prefill_kernel else (True if args.force_prefill_kernel else None)
    HOPPER_PREFILL = not args.no_hopper_prefill
    if args.profile:
        profile_forward()
    rows = []
    gpu = torch.cuda.get_device_name()

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"),
                                                  "command": " ".join(sys.argv), "rows": rows}, indent=1))

    def row(case, B, L, us, peer_us, peer="flashinfer", backend="triton", kv_dtype="auto", **extra):
        r = {"case": case, "backend": backend, "peer": peer, "B": B, "L": L, "dtype": "bfloat16",
             "kv_dtype": kv_dtype, "us": round(us, 2), "peer_us": round(peer_us, 2) if peer_us else None,
             "ratio": round(us / peer_us, 4) if peer_us else None}
        r.update(extra)
        emit(r)

    def diff(a, b):
        return float((a.float() - b.float()).abs().max())

    if args.prefill_sweep:
        return prefill_sweep(row, diff)
    if args.paged_rows:
        return paged_rows(row, diff, args.paged_shapes)
    if args.write_sweep:
        return write_sweep(row, diff)
    if args.mixed:
        return mixed_rows(row, diff)
    if args.split_sweep:
        return split_sweep(row, diff)

    # Host time per call, GPU idle (tiny decode).
    b = Batch([(1, 15)])
    fi, fi_out = flashinfer_decode(b)
    x, y, z = (torch.randn(1024, device=DEV) for _ in range(3))
    torch_op, fi_host, ours, ours_write = host_us(lambda: torch.add(x, y, out=z), fi, b.triton(),
                                                  b.triton(write=True))
    row("host_overhead", 1, 16, ours, fi_host, torch_op_us=round(torch_op, 2))
    row("host_overhead", 1, 16, ours_write, fi_host, backend="triton_with_write", torch_op_us=round(torch_op, 2))

    # Eager decode, small batches (host-bound) and bandwidth-bound ones.
    decode_shapes = [(1, 1024), (1, 16384), (16, 4096)]
    if not args.quick:
        decode_shapes += [(64, 4096), (128, 8192)]
    for B, L in decode_shapes:
        b = Batch([(1, L - 1)] * B)
        fi, fi_out = flashinfer_decode(b)
        fn = b.triton()
        fn()
        fi()
        d = diff(b.out, fi_out)
        us, peer = do_bench_us(fn), do_bench_us(fi)
        case = "decode_eager" if B <= 16 else "decode"
        row(case, B, L, us, peer, wall_us=round(wall_us(fn), 2), peer_wall_us=round(wall_us(fi), 2),
            GBps=round(b.kv_bytes / us / 1e3, 1), max_abs_diff=d)
        del b
    if args.quick:
        return 0
    b = Batch([(1, 4095)] * 64, kv_cache_dtype="fp8_e4m3")
    fi, fi_out = flashinfer_decode(b)
    fn = b.triton()
    fn()
    fi()
    us, peer = do_bench_us(fn), do_bench_us(fi)
    row("decode", 64, 4096, us, peer, kv_dtype="fp8_e4m3", max_abs_diff=diff(b.out, fi_out))
    del b

    # Head size 512 decode (no FlashInfer peer): against the device-copy roof of PERF.md.
    b = Batch([(1, 4095)] * 64, head_size=512, num_heads=16, num_kv_heads=2)
    fn = b.triton()
    us = do_bench_us(fn)
    gbps = b.kv_bytes / us / 1e3
    row("decode_h512", 64, 4096, us, None, peer="copy_roof_3024GBps", GBps=round(gbps, 1),
        fraction_of_copy_roof=round(gbps / 3024, 3), heads="16q/2kv")
    del b

    # Causal prefill, every token new.
    for B, L in PREFILL_SHAPES:
        b = Batch([(L, 0)] * B)
        fi, fi_out = flashinfer_prefill(b)
        fn = b.triton(write=True)
        fn()
        fi()
        d = diff(b.out, fi_out)
        us, peer = do_bench_us(fn), do_bench_us(fi)
        sd = do_bench_us(sdpa_prefill(B, L))
        tf = lambda t: round(b.flops / t / 1e6, 1)  # noqa: E731
        kernel = prefill_kernel_name(b.metadata)
        write_us = round(do_bench_us(lambda: b.impl.update_kv_cache(b.new_k, b.new_v, b.kv, b.common.slot_mapping)),
                         2)
        split = b.metadata.prefill_split
        extra = dict(prefill_kernel=kernel, kv_write_us=write_us, cache_write_sms=b.metadata.cache_write_sms,
                     kernel_writes_cache=bool(split and getattr(split[1], "writes_cache", False)))
        if extra["kernel_writes_cache"]:  # the write kernel's pass over the tokens the prefill left (none here)
            todo = b.metadata.write_todo
            extra["finish_write_us"] = round(do_bench_us(lambda: finish_cache_write(
                b.new_k, b.new_v, b.kv, b.common.slot_mapping, todo, b.num_tokens)), 2)
        if kernel == "gluon_hopper":  # the attention alone on every SM, as the peers' rows are timed
            plan = b.builder.__class__(b.spec, DEV, max_num_reqs=256, max_num_tokens=b.num_tokens,
                                       num_blocks=b.kv.shape[0], hopper_cache_write=False,
                                       cache_write_sms=0).build(b.common).prefill_split[1]
            attn_us = do_bench_us(lambda: launch_hopper_prefill(plan, b.query, b.new_k, b.new_v, b.out,
                                                                b.common.query_start_loc, SCALE))
            extra.update(attention_only_us=round(attn_us, 2), attention_only_TFLOPs=tf(attn_us))
        row("prefill", B, L, us, peer, TFLOPs=tf(us), peer_TFLOPs=tf(peer), max_abs_diff=d, **extra)
        row("prefill", B, L, us, sd, peer="sdpa", TFLOPs=tf(us), peer_TFLOPs=tf(sd), **extra)
        if kernel == "gluon_hopper":  # the other ways to write the cache, in the same run
            for case, opts in (("prefill_write_beside", dict(hopper_cache_write=False)),
                               ("prefill_write_first", dict(hopper_cache_write=False, cache_write_sms=0))):
                meta = b.builder.__class__(b.spec, DEV, max_num_reqs=256, max_num_tokens=b.num_tokens,
                                           num_blocks=b.kv.shape[0], **opts).build(b.common)
                other = lambda: b.impl.forward(b.query, b.new_k, b.new_v, b.kv, meta, b.out)  # noqa: E731
                other()
                o_us = do_bench_us(other)
                row(case, B, L, o_us, sd, peer="sdpa", TFLOPs=tf(o_us), peer_TFLOPs=tf(sd),
                    cache_write_sms=meta.cache_write_sms, max_abs_diff=diff(b.out, fi_out))
        cached = do_bench_us(b.triton())
        row("prefill_kv_in_cache", B, L, cached, peer, TFLOPs=tf(cached), peer_TFLOPs=tf(peer))
        if kernel == "gluon_hopper":  # the same batch on the Triton prefill kernel: what the Gluon kernel gains
            b.metadata = TritonAttentionBackend.get_builder_cls()(
                b.spec, DEV, max_num_reqs=256, max_num_tokens=b.num_tokens, num_blocks=b.kv.shape[0],
                prefill_kernel=PREFILL_KERNEL, hopper_prefill=False).build(b.common)
            other = b.triton(write=True)
            b.out.fill_(float("nan"))
            other()
            t_us = do_bench_us(other)
            row("prefill_triton_kernel", B, L, t_us, peer, TFLOPs=tf(t_us), peer_TFLOPs=tf(peer),
                max_abs_diff=diff(b.out, fi_out), prefill_kernel=prefill_kernel_name(b.metadata))
        del b

    return mixed_rows(row, diff)


SPLIT_SWEEP_SHAPES = [(1, 1024), (1, 4096), (4, 1024), (1, 16384), (2, 8192), (8, 4096), (16, 4096), (32, 2048)]
SPLIT_SWEEP = [1, 2, 4, 8, 16, 32]


def split_sweep(row, diff) -> int:
    """Small eager decodes at each split-KV count (the builder's choice replaced; one launch, the merge in it),
    against FlashInfer's decode on the same cache: ``decode_split_sweep`` rows (``chosen``: the builder's own)."""
    from unittest import mock

    from attnbackends.triton import backend as triton_backend

    for B, L in SPLIT_SWEEP_SHAPES:
        b = Batch([(1, L - 1)] * B)
        fi, fi_out = flashinfer_decode(b)
        fi()
        peer = do_bench_us(fi)
        chosen = b.metadata.plan.grid[2]
        for splits in SPLIT_SWEEP:
            with mock.patch.object(triton_backend, "choose_num_kv_splits", lambda *a, _s=splits, **k: _s):
                b.metadata = b.builder.build(b.common)
            fn = b.triton()
            b.out.fill_(float("nan"))
            fn()
            row("decode_split_sweep", B, L, do_bench_us(fn), peer, splits=b.metadata.plan.grid[2], chosen=chosen,
                fused_merge=b.metadata.plan.fused_reduce, max_abs_diff=diff(b.out, fi_out))
        del b
    return 0


def mixed_rows(row, diff) -> int:
    """The mixed step (60 decodes at 4096 + 4 x 512 new tokens on 2048 of context, one batch) against FlashInfer's
    decode and prefill wrappers run one after the other; then the same batch with the builder's split choice
    (``prefill_kernel_pays``) forced the other way (``mixed_other_split``)."""
    b = Batch([(1, 4095)] * 60 + [(512, 2048)] * 4)
    d_fn, d_out = flashinfer_decode(b, 0, 60)
    p_fn, p_out = flashinfer_prefill(b, 60, 64)
    both = lambda: (d_fn(), p_fn())  # noqa: E731
    fn = b.triton(write=True)
    fn()
    both()
    d = max(diff(b.out[:60], d_out), diff(b.out[60:], p_out))
    peer = do_bench_us(both)
    row("mixed", 64, 4096, do_bench_us(fn), peer, max_abs_diff=d,
        prefill_kernel=b.metadata.prefill_split is not None)
    # the same batch with the split forced the other way: what the builder's choice (prefill_kernel_pays) gained
    forced = not b.metadata.prefill_split
    builder = TritonAttentionBackend.get_builder_cls()(b.spec, DEV, max_num_reqs=256, max_num_tokens=8192,
                                                       num_blocks=b.kv.shape[0], prefill_kernel=forced)
    b.metadata = builder.build(b.common)
    if (b.metadata.prefill_split is not None) == forced:
        other = b.triton(write=True)
        b.out.fill_(float("nan"))
        other()
        row("mixed_other_split", 64, 4096, do_bench_us(other), peer, prefill_kernel=forced,
            max_abs_diff=max(diff(b.out[:60], d_out), diff(b.out[60:], p_out)))
    return 0


WRITE_TOKENS_PER_PROGRAM = [1, 2, 4, 8, 16]
WRITE_SWEEP_SHAPES = PREFILL_SHAPES + [(8, 2048), (32, 512), (64, 256)]
WRITE_SMS_SWEEP = [0, 2, 4, 6, 8]


def write_sweep(row, diff) -> int:
    """The cache write alone at each tokens-per-program (``kv_write``, against ``torch.Tensor.copy_`` of the same
    keys and values into contiguous buffers), then each prefill forward with the Gluon kernel leaving each number
    of SMs to the write beside it (``prefill_write_sms``, against SDPA; ``chosen_sms``: the builder's own choice
    for the batch)."""
    for B, L in WRITE_SWEEP_SHAPES:
        b = Batch([(L, 0)] * B)
        if (B, L) in PREFILL_SHAPES:
            k_dst, v_dst = torch.empty_like(b.new_k), torch.empty_like(b.new_v)
            copy_us = do_bench_us(lambda: (k_dst.copy_(b.new_k), v_dst.copy_(b.new_v)))
            nbytes = 2 * 2 * b.new_k.numel() * b.new_k.element_size()
            for t in WRITE_TOKENS_PER_PROGRAM:
                us = do_bench_us(lambda: reshape_and_cache(b.new_k, b.new_v, b.kv, b.common.slot_mapping,
                                                           validate=False, tokens_per_program=t))
                row("kv_write", B, L, us, copy_us, peer="torch_copy", tokens_per_program=t,
                    GBps=round(nbytes / us / 1e3, 1), peer_GBps=round(nbytes / copy_us / 1e3, 1))
        fi, fi_out = flashinfer_prefill(b)
        fi()
        sd = do_bench_us(sdpa_prefill(B, L))
        tf = lambda t: round(b.flops / t / 1e6, 1)  # noqa: E731
        chosen = b.builder.__class__(b.spec, DEV, max_num_reqs=256, max_num_tokens=b.num_tokens,
                                     num_blocks=b.kv.shape[0], hopper_cache_write=False).build(b.common).cache_write_sms
        for k in WRITE_SMS_SWEEP:
            b.metadata = b.builder.__class__(b.spec, DEV, max_num_reqs=256, max_num_tokens=b.num_tokens,
                                             num_blocks=b.kv.shape[0], hopper_cache_write=False,
                                             cache_write_sms=k).build(b.common)
            fn = b.triton(write=True)
            b.out.fill_(float("nan"))
            fn()
            us = do_bench_us(fn)
            row("prefill_write_sms", B, L, us, sd, peer="sdpa", cache_write_sms=k, chosen_sms=chosen,
                TFLOPs=tf(us), peer_TFLOPs=tf(sd), max_abs_diff=diff(b.out, fi_out))
    return 0


# (block_m, block_n, warps, stages, gqa_pack): the default (64x64, one warpgroup), the former default, then GQA-packed
# tiles (the query heads of a KV head in one program: each context tile gathered once for all of them), which the
# mixed-step case below also tries.
PREFILL_SWEEP = [(64, 64, 4, 3, 1), (128, 64, 8, 3, 1), (64, 64, 4, 3, 2), (64, 64, 4, 3, 4), (128, 64, 8, 3, 2),
                 (128, 64, 8, 3, 4), (128, 128, 8, 2, 4)]


def prefill_sweep(row, diff) -> int:
    """The prefill kernel's tile configs (block_m, block_n, warps, stages, gqa_pack) on the prefill rows' shapes,
    then on the mixed row's context-heavy step next to one unified launch (``mixed_sweep`` rows)."""
    import dataclasses

    from attnbackends.triton.heuristics import PrefillConfig
    from attnbackends.triton.prefill_launch import plan_prefill_new_kv
    from attnbackends.triton.step_plan import Launch, LaunchKind, make_step_plan

    for B, L in [(1, 8192), (4, 4096), (16, 1024)]:
        b = Batch([(L, 0)] * B)
        b.triton(write=True)()  # the new keys into the cache, for FlashInfer to read
        fi, fi_out = flashinfer_prefill(b)
        fi()
        peer = do_bench_us(fi)
        tf = lambda t: round(b.flops / t / 1e6, 1)  # noqa: E731
        for bm, bn, w, st, pack in PREFILL_SWEEP:
            plan = plan_prefill_new_kv(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=PAGE, num_seqs=B,
                                       first_seq=0, max_query_len=L, config=PrefillConfig(bm, bn, w, st, pack))
            step = make_step_plan(b.metadata.plan, prefill=Launch(LaunchKind.TRITON_PREFILL, plan))
            b.metadata = dataclasses.replace(b.metadata, step=step)
            fn = b.triton(write=True)
            try:
                b.out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not compile is a row, not the end of the sweep
                row("prefill_sweep", B, L, float("nan"), peer, config=[bm, bn, w, st, pack], error=str(exc)[:200])
                continue
            us = do_bench_us(fn)
            row("prefill_sweep", B, L, us, peer, config=[bm, bn, w, st, pack], TFLOPs=tf(us), peer_TFLOPs=tf(peer),
                max_abs_diff=diff(b.out, fi_out))
        del b

    # The context-heavy step: 60 decodes at 4096 + 4 x 512 new on 2048 cached; one unified launch, then the split
    # (decodes on the unified kernel, the chunks on the prefill kernel) with each config.
    b = Batch([(1, 4095)] * 60 + [(512, 2048)] * 4)
    b.triton(write=True)()  # the new keys into the cache, for FlashInfer to read
    d_fn, d_out = flashinfer_decode(b, 0, 60)
    p_fn, p_out = flashinfer_prefill(b, 60, 64)
    peer = do_bench_us(lambda: (d_fn(), p_fn()))

    def builder(prefill_kernel, overlap=False):
        return TritonAttentionBackend.get_builder_cls()(b.spec, DEV, max_num_reqs=256, max_num_tokens=8192,
                                                        num_blocks=b.kv.shape[0], prefill_kernel=prefill_kernel,
                                                        overlap_decodes=overlap)

    b.metadata = builder(False).build(b.common)
    row("mixed_sweep", 64, 4096, do_bench_us(b.triton(write=True)), peer, config="unified")
    forced = builder(True).build(b.common)
    overlapped = builder(True, overlap=True).build(b.common)
    for (bm, bn, w, st, pack), meta in itertools.product(PREFILL_SWEEP, (forced, overlapped)):
        plan = plan_prefill_new_kv(num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=PAGE, num_seqs=64,
                                   first_seq=60, max_query_len=512, config=PrefillConfig(bm, bn, w, st, pack))
        step = make_step_plan(meta.plan, decode=meta.step.decode_plan, prefill=Launch(LaunchKind.TRITON_PREFILL, plan),
                              overlap=meta.step.overlapped)
        b.metadata = dataclasses.replace(meta, step=step)
        fn = b.triton(write=True)
        try:
            b.out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            row("mixed_sweep", 64, 4096, float("nan"), peer, config=[bm, bn, w, st, pack],
                overlap_streams=meta.overlap_streams, error=str(exc)[:200])
            continue
        row("mixed_sweep", 64, 4096, do_bench_us(fn), peer, config=[bm, bn, w, st, pack],
            overlap_streams=meta.overlap_streams, max_abs_diff=max(diff(b.out[:60], d_out), diff(b.out[60:], p_out)))
    return 0


CHUNK_SHAPES = [(1, 2048, 14336), (4, 2048, 6144), (8, 512, 3584), (16, 256, 1792)]  # (B, new, cached)
#: name -> (B, new, cached, spec fields): the common layer shapes on a chunk-on-context step and a fresh one.
SHAPE_ROWS = {
    "h64_sinks_win128": (dict(num_heads=64, num_kv_heads=8, head_size=64, sliding_window=128, has_sinks=True)),
    "h256_win1024": (dict(num_heads=16, num_kv_heads=8, head_size=256, sliding_window=1024)),
    "win4096": (dict(num_heads=32, num_kv_heads=8, head_size=128, sliding_window=4096)),
    "softcap30": (dict(num_heads=32, num_kv_heads=8, head_size=128, logits_soft_cap=30.0)),
    "fp8_e4m3": (dict(num_heads=32, num_kv_heads=8, head_size=128, kv_cache_dtype="fp8_e4m3")),
}


def _visible_keys(shapes, window=0) -> int:
    """Query-key pairs a causal (windowed) prefill computes."""
    total = 0
    for q, c in shapes:
        for i in range(q):
            pos = c + i
            total += min(pos + 1, window) if window else pos + 1
    return total


def paged_rows(row, diff, shape_names=None) -> int:
    """The paged Gluon prefill (``hopper_paged_prefill=True``, the builder's default) through the public API,
    against the builder without it ("default_*" fields: ``hopper_paged_prefill=False``, the unified / Triton prefill
    kernels, or the fresh-prompt Gluon kernel) and
    FlashInfer's paged prefill on the same cache: ``prefill_chunk`` (a chunk on cached context, with its keys),
    ``prefill_cached`` (``forward(q, None, None)``, every key already in the cache), ``prefill`` (fresh prompts with
    keys: the default's fresh-prompt kernel and the paged one with the write first) and ``prefill_shape`` (the
    common layer shapes: head 64 with sinks and a 128-token window, head 256 with a 1024-token window, a 4096-token
    window, a soft-cap, an fp8 e4m3 cache; FlashInfer with the same window / soft-cap / fp8 pages where it serves
    the shape, none for sinks). ``shape_names``: only those ``prefill_shape`` rows."""
    import flashinfer

    def case(shapes, spec_kw=None, write=True, paged_kw=None):
        spec_kw = dict(spec_kw or {})
        hq, hkv, d = spec_kw.pop("num_heads", HQ), spec_kw.pop("num_kv_heads", HKV), spec_kw.pop("head_size", D)
        kv_dtype = spec_kw.pop("kv_cache_dtype", "auto")
        b = Batch(shapes, kv_cache_dtype=kv_dtype, head_size=d, num_heads=hq, num_kv_heads=hkv)
        if not write:
            b.triton(write=True)()  # the step's keys into the cache first
        b.spec = AttentionSpec(num_heads=hq, num_kv_heads=hkv, head_size=d, dtype="bfloat16", block_size=PAGE,
                               kv_cache_dtype=kv_dtype, **spec_kw)
        sinks = torch.randn(hq, device=DEV) if b.spec.has_sinks else None
        impl = TritonAttentionBackend.get_impl_cls()(b.spec, sinks=sinks, k_scale=b.kv_scale, v_scale=b.kv_scale)
        out = {}
        for name, paged in (("paged", True), ("default", False)):
            builder = TritonAttentionBackend.get_builder_cls()(b.spec, DEV, max_num_reqs=256,
                                                               max_num_tokens=max(b.num_tokens, 8192),
                                                               num_blocks=b.kv.shape[0], hopper_paged_prefill=paged,
                                                               **((paged_kw or {}) if paged else {}))
            meta = builder.build(b.common)
            o = torch.full_like(b.query, float("nan"))
            k, v = (b.new_k, b.new_v) if write else (None, None)
            fn = (lambda meta=meta, o=o, k=k, v=v: impl.forward(b.query, k, v, b.kv, meta, o))
            fn()
            torch.cuda.synchronize()
            fresh = write and meta.prefill_split is not None and isinstance(meta.prefill_split[1], HopperPrefillPlan)
            if meta.paged_prefill is not None and not fresh:
                kernel = "gluon_paged"
            else:
                kernel = prefill_kernel_name(meta) if write else "unified"
            out[name] = (do_bench_us(fn), o, kernel, str(builder.choices.paged_prefill))
        if write:
            b.triton(write=True)()  # FlashInfer reads the new keys from the cache
        indptr, indices, last, qsl, query = b.sub(0, len(shapes))
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=DEV),
                                                           "NHD")
        fi_kw = {}
        if b.spec.sliding_window:
            fi_kw["window_left"] = b.spec.sliding_window - 1
        if b.spec.logits_soft_cap:
            fi_kw["logits_soft_cap"] = b.spec.logits_soft_cap
        peer, fi_out = None, None
        if not b.spec.has_sinks:
            w.plan(qsl, indptr, indices, last, hq, hkv, d, PAGE, causal=True, q_data_type=torch.bfloat16,
                   kv_data_type=b.kv.dtype, sm_scale=1.0 / math.sqrt(d), **fi_kw)
            fi_out = torch.empty_like(query)
            scales = dict(k_scale=b.kv_scale, v_scale=b.kv_scale) if b.spec.is_fp8_kv_cache else {}
            fi = lambda: w.run(query, b.kv, out=fi_out, **scales)  # noqa: E731
            fi()
            peer = do_bench_us(fi)
        flops = 4.0 * hq * d * _visible_keys(shapes, b.spec.sliding_window or 0)
        return out, peer, fi_out, flops

    def emit_case(name, B, L, shapes, spec_kw=None, write=True, paged_kw=None, **extra):
        try:
            out, peer, fi_out, flops = case(shapes, spec_kw, write, paged_kw)
        except Exception as exc:  # a failure is a row, not the end of the rows
            row(name, B, L, float("nan"), None, error=repr(exc)[:300], **extra)
            return
        tf = lambda t: round(flops / t / 1e6, 1)  # noqa: E731
        (us, o, kernel, why), (base_us, base_o, base_kernel, _) = out["paged"], out["default"]
        row(name, B, L, us, peer, TFLOPs=tf(us), peer_TFLOPs=tf(peer) if peer else None,
            default_us=round(base_us, 2), default_TFLOPs=tf(base_us), default_kernel=base_kernel,
            prefill_kernel=kernel, paged_reason=why, ratio_vs_default=round(us / base_us, 4),
            max_abs_diff_vs_peer=diff(o, fi_out) if fi_out is not None else None,
            max_abs_diff_vs_default=diff(o, base_o), keys_in_forward=write, **extra)

    if shape_names is None:
        for B, new, cached in CHUNK_SHAPES:
            emit_case("prefill_chunk", B, new + cached, [(new, cached)] * B, new=new, cached=cached)
        for B, L in PREFILL_SHAPES:
            emit_case("prefill_cached", B, L, [(L, 0)] * B, write=False)
        for B, L in PREFILL_SHAPES:
            emit_case("prefill", B, L, [(L, 0)] * B)
            emit_case("prefill_paged_fresh", B, L, [(L, 0)] * B, paged_kw=dict(hopper_prefill=False))
    for name, kw in SHAPE_ROWS.items():
        if shape_names is not None and name not in shape_names:
            continue
        emit_case("prefill_shape", 4, 8192, [(2048, 6144)] * 4, kw, shape=name, new=2048, cached=6144)
        emit_case("prefill_shape", 4, 4096, [(4096, 0)] * 4, kw, shape=name, new=4096, cached=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
