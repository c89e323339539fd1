"""Triton unified attention vs FlashInfer, side by side in one process, on the PERF.md shapes.

    python -m benchmarks.triton_vs_flashinfer [--out results.json] [--sweep] [--no-peer] [--cases decode,prefill,...]

Times are ``triton.testing.do_bench`` medians (µs) on random bf16 data with pages in random order. Each row also
checks the Triton output against FlashInfer's (max abs difference). ``--sweep`` times several tile configs per
case and reports the best next to the default one (used to pick the defaults in launch.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch
import triton

from attnbackends.triton.heuristics import KernelConfig, choose_num_kv_splits
from attnbackends.triton.launch import SplitKVWorkspace, unified_attention

HQ, HKV, D, PAGE = 32, 8, 128, 16
DECODE_SHAPES = [(1, 1024), (1, 16384), (16, 4096), (64, 1024), (64, 4096), (128, 8192), (256, 2048)]
PREFILL_SHAPES = [(1, 8192), (4, 4096), (16, 1024)]
SCALE = 1.0 / math.sqrt(D)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def bench_graph(fn) -> float:
    """Time replays of a CUDA graph of ``fn``: how an engine runs decode, and free of Python launch overhead
    (which dominates eager timings of the ~15 µs B=1 kernels)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


class Batch:
    """A paged batch: seqs of (query_len, context_len), pages shuffled."""

    def __init__(self, shapes, kv_dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.shapes = shapes
        q_lens = [q for q, _ in shapes]
        seq_lens = [q + c for q, c in shapes]
        pages = [triton.cdiv(s, PAGE) for s in seq_lens]
        total_pages = sum(pages)
        self.num_tokens = sum(q_lens)
        self.kv = torch.randn(total_pages, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.kv_scale = 1.0
        if kv_dtype != torch.bfloat16:
            self.kv_scale = float(self.kv.abs().amax()) / 240.0
            self.kv = (self.kv.float() / self.kv_scale).to(kv_dtype)
        perm = torch.randperm(total_pages, device="cuda", generator=g).to(torch.int32)
        self.max_blocks = max(pages)
        self.block_table = torch.zeros(len(shapes), self.max_blocks, dtype=torch.int32, device="cuda")
        at = 0
        indptr = [0]
        for i, n in enumerate(pages):
            self.block_table[i, :n] = perm[at:at + n]
            at += n
            indptr.append(at)
        self.kv_indices = perm
        self.kv_indptr = torch.tensor(indptr, dtype=torch.int32, device="cuda")
        self.last_page_len = torch.tensor([(s - 1) % PAGE + 1 for s in seq_lens], dtype=torch.int32, device="cuda")
        self.qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        self.query = torch.randn(self.num_tokens, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        self.out = torch.empty_like(self.query)
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(seq_lens)
        self.kv_bytes = sum(seq_lens) * HKV * D * 2 * self.kv.element_size()
        # causal FLOPs: 2 matmuls x 2 flops x Hq x D x (visible keys summed over queries)
        visible = sum(sum(c + i + 1 for i in range(q)) if q > 1 else c + 1 for q, c in shapes)
        self.flops = 4.0 * HQ * D * visible

    def triton_fn(self, num_decodes=None, config=None, num_kv_splits=None):
        ks = torch.tensor([self.kv_scale], dtype=torch.float32, device="cuda")
        # Split-KV only pays for decode-sized batches; a prefill-sized workspace would be gigabytes.
        ws = SplitKVWorkspace.allocate(self.num_tokens, HQ, D, 32, device="cuda") if self.num_tokens <= 256 else None

        def fn():
            unified_attention(self.query, self.kv[:, 0], self.kv[:, 1], self.out, self.qsl, self.seq_lens,
                              self.block_table, self.max_query_len, self.max_seq_len, SCALE, k_scale=ks, v_scale=ks,
                              workspace=ws, num_decodes=num_decodes, num_kv_splits=num_kv_splits, validate=False,
                              config=config)
        return fn


def flashinfer_decode(batch: Batch, ws_buf):
    import flashinfer

    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws_buf, "NHD", use_tensor_cores=True)
    w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, D, PAGE, pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16, kv_data_type=batch.kv.dtype, sm_scale=SCALE)
    out = torch.empty_like(batch.query)
    kw = {}
    if batch.kv.dtype != torch.bfloat16:
        kw = dict(k_scale=batch.kv_scale, v_scale=batch.kv_scale)
    return (lambda: w.run(batch.query, batch.kv, out=out, **kw)), out


def flashinfer_prefill(batch: Batch, ws_buf):
    import flashinfer

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_buf, "NHD")
    w.plan(batch.qsl, batch.kv_indptr, batch.kv_indices, batch.last_page_len, HQ, HKV, D, PAGE, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=batch.kv.dtype, sm_scale=SCALE)
    out = torch.empty_like(batch.query)
    return (lambda: w.run(batch.query, batch.kv, out=out)), out


def sub_batch(batch: Batch, lo: int, hi: int) -> Batch:
    """Requests lo..hi-1 of ``batch`` as their own Batch sharing the cache (for the peer's two wrappers)."""
    b = Batch.__new__(Batch)
    b.__dict__.update(batch.__dict__)
    q0, q1 = int(batch.qsl[lo]), int(batch.qsl[hi])
    b.query = batch.query[q0:q1]
    b.qsl = batch.qsl[lo:hi + 1] - q0
    p0 = int(batch.kv_indptr[lo])
    b.kv_indptr = batch.kv_indptr[lo:hi + 1] - p0
    b.kv_indices = batch.kv_indices[p0:int(batch.kv_indptr[hi])]
    b.last_page_len = batch.last_page_len[lo:hi]
    return b


def row(case, B, L, batch, us, peer_us, kv_dtype="auto", diff=None, extra=None):
    r = {"case": case, "backend": "triton", "peer": "flashinfer", "B": B, "L": L, "dtype": "bfloat16",
         "kv_dtype": kv_dtype, "us": round(us, 2), "peer_us": round(peer_us, 2) if peer_us else None,
         "ratio": round(us / peer_us, 3) if peer_us else None,
         "GBps": round(batch.kv_bytes / us / 1e3, 1), "TFLOPs": round(batch.flops / us / 1e6, 1),
         "max_abs_diff_vs_peer": diff}
    if extra:
        r.update(extra)
    return r


DECODE_SWEEP = [
    KernelConfig(decode_tile_n=128, num_warps=4, num_stages=3),
    KernelConfig(decode_tile_n=128, num_warps=4, num_stages=4),
    KernelConfig(decode_tile_n=256, num_warps=4, num_stages=3),
    KernelConfig(decode_tile_n=64, num_warps=4, num_stages=3),
    KernelConfig(decode_tile_n=128, num_warps=8, num_stages=3),
]
PREFILL_SWEEP = [
    KernelConfig(block_m=128, tile_n=128, num_warps=8, num_stages=3),
    KernelConfig(block_m=128, tile_n=32, num_warps=4, num_stages=3),
    KernelConfig(block_m=128, tile_n=64, num_warps=4, num_stages=3),
    KernelConfig(block_m=128, tile_n=128, num_warps=8, num_stages=2),
    KernelConfig(block_m=128, tile_n=64, num_warps=8, num_stages=3),
]
MIXED_SWEEP = [
    KernelConfig(decode_tile_n=128, block_m=128, tile_n=128, num_warps=8, num_stages=3),
    KernelConfig(decode_tile_n=128, block_m=128, tile_n=64, num_warps=8, num_stages=3),
    KernelConfig(decode_tile_n=64, block_m=128, tile_n=64, num_warps=8, num_stages=3),
    KernelConfig(decode_tile_n=128, block_m=128, tile_n=32, num_warps=4, num_stages=3),
]


def sweep(fn_for_config, configs, log):
    best = None
    for cfg in configs:
        try:
            us = bench(fn_for_config(cfg))
        except Exception as e:  # a config may not fit in shared memory
            log(f"    {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
            continue
        log(f"    {cfg}: {us:.1f} us")
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--cases", default="decode,fp8,mixed,prefill")
    ap.add_argument("--sweep-cases", default="decode,fp8,mixed,prefill")
    args = ap.parse_args(argv)
    cases = set(args.cases.split(","))
    swept = set(args.sweep_cases.split(",")) if args.sweep else set()

    def log(msg):
        print(msg, flush=True)

    peer = not args.no_peer
    if peer:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            log(f"flashinfer unavailable ({e}); timing triton alone")
            peer = False
    ws_buf = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    log(f"gpu: {torch.cuda.get_device_name()}  sms {num_sms}  torch {torch.__version__}  triton {triton.__version__}")

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "rows": rows}, f, indent=1)

    def run_case(case, B, L, batch, num_decodes=None, kv_dtype="auto", sweep_configs=None, peer_fn=None):
        t0 = time.time()
        fn = batch.triton_fn(num_decodes=num_decodes)
        us = bench(fn)
        ours = batch.out.clone()
        peer_us, diff = None, None
        if peer and peer_fn is not None:
            try:
                pfn, pout = peer_fn()
                peer_us = bench(pfn)
                diff = float((ours.float() - pout.float()).abs().max())
            except Exception as e:
                log(f"  peer failed: {type(e).__name__}: {str(e)[:200]}")
        extra = {}
        if sweep_configs:
            best = sweep(lambda cfg: batch.triton_fn(num_decodes=num_decodes, config=cfg), sweep_configs, log)
            if best:
                extra = {"best_us": round(best[0], 2), "best_config": asdict(best[1])}
        us_again = bench(fn)  # the same default config again: the spread between the two is noise
        extra["us_repeat"] = round(us_again, 2)
        if case == "decode":
            extra["us_graph"] = round(bench_graph(fn), 2)
        r = row(case, B, L, batch, us, peer_us, kv_dtype, diff, extra)
        rows.append(r)
        dump()
        log(f"  {case:8s} B={B:<4d} L={L:<6d} kv={kv_dtype:5s} triton {us:9.1f} us  flashinfer "
            f"{(peer_us or float('nan')):9.1f} us  ratio {r['ratio']}  {r['GBps']} GB/s  {r['TFLOPs']} TFLOP/s  "
            f"diff {diff}  repeat {us_again:.1f}  graph {extra.get('us_graph')}  best {extra.get('best_us')}  ({time.time() - t0:.0f}s)")

    if "decode" in cases:
        for B, L in DECODE_SHAPES:
            batch = Batch([(1, L - 1)] * B)
            splits = choose_num_kv_splits(B, HKV, HQ, num_sms, batch.max_seq_len)
            log(f"decode B={B} L={L}: heuristic splits {splits}")
            run_case("decode", B, L, batch, sweep_configs=DECODE_SWEEP if "decode" in swept else None,
                     peer_fn=lambda: flashinfer_decode(batch, ws_buf))
            if "decode" in swept:
                for s in sorted({max(1, splits // 2), splits * 2, 1} - {splits}):
                    if s <= 32:
                        us = bench(batch.triton_fn(num_kv_splits=s))
                        log(f"    splits {s}: {us:.1f} us")
            del batch
    if "fp8" in cases:
        for B, L in [(64, 4096)]:
            batch = Batch([(1, L - 1)] * B, kv_dtype=torch.float8_e4m3fn)
            run_case("decode", B, L, batch, kv_dtype="fp8", sweep_configs=DECODE_SWEEP if "fp8" in swept else None,
                     peer_fn=lambda: flashinfer_decode(batch, ws_buf))
            del batch
    if "mixed" in cases:
        shapes = [(1, 4095)] * 60 + [(512, 2048)] * 4
        batch = Batch(shapes)

        def mixed_peer():
            d_fn, d_out = flashinfer_decode(sub_batch(batch, 0, 60), ws_buf)
            ws2 = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
            p_fn, p_out = flashinfer_prefill(sub_batch(batch, 60, 64), ws2)

            def both():
                d_fn()
                p_fn()
            both()
            return both, torch.cat([d_out, p_out])

        run_case("mixed", 64, 4096, batch, num_decodes=60, sweep_configs=MIXED_SWEEP if "mixed" in swept else None,
                 peer_fn=mixed_peer)
        us_generic = bench(batch.triton_fn(num_decodes=0))
        log(f"    mixed without the decode path (num_decodes=0): {us_generic:.1f} us")
        rows[-1]["us_generic_path"] = round(us_generic, 2)

    if "prefill" in cases:
        for B, L in PREFILL_SHAPES:
            batch = Batch([(L, 0)] * B)
            run_case("prefill", B, L, batch, sweep_configs=PREFILL_SWEEP if "prefill" in swept else None,
                     peer_fn=lambda: flashinfer_prefill(batch, ws_buf))
            del batch
    log("\n| case | B | L | kv | triton µs | repeat µs | graph µs | flashinfer µs | ratio | GB/s | TFLOP/s | best sweep µs |")
    log("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        log(f"| {r['case']} | {r['B']} | {r['L']} | {r['kv_dtype']} | {r['us']} | {r.get('us_repeat')} | "
            f"{r.get('us_graph')} | {r['peer_us']} | {r['ratio']} | "
            f"{r['GBps']} | {r['TFLOPs']} | {r.get('best_us')} |")
    dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
