"""The Triton decode's two schedules side by side on one GPU: ``decode_schedule="uniform"`` (every decode the same
number of KV segments) against ``"balanced"`` (work units of near-equal size, :mod:`attnbackends.triton.decode_schedule`),
with ``"auto"``'s choice, and FlashInfer's decode wrapper as an engine drives it (``use_tensor_cores=True``, planned
once) where flashinfer is installed.

    python -m benchmarks.decode_schedule_ab [--out rows.json] [--graph] [--waves 2 4 8] [--rows NAME ...]

Llama-3-8B layer (32 query / 8 KV heads, head 128, bf16, pages of 16), one build per batch, the attention alone
timed (``forward(q, None, None, kv_cache, metadata, out)``, the cache already holding every key) with
``triton.testing.do_bench`` (median); ``--graph`` also times the forward replayed from a CUDA graph (captured with
``build_for_cudagraph_capture``). Each row: µs, effective TB/s (K and V bytes of every visible key / time), the
ratio to the uniform schedule and to FlashInfer, the schedule in words, the host time of ``build()`` and the largest
difference from the uniform output. ``--waves`` adds balanced rows with other target programs per SM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from attnbackends.testing.cuda_graphs import capture_forward
from attnbackends.triton.backend import TritonMetadataBuilder
from attnbackends.triton.decode_schedule import BalancedParams

from .triton_api import Batch, do_bench_us, flashinfer_decode, host_us


def lognormal(n: int, median: float, sigma: float, cap: int = 1 << 30, seed: int = 0) -> list[int]:
    """``n`` sequence lengths, lognormal (seeded), at least 1 and at most ``cap``."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), 1, cap).tolist()


#: name -> (sequence lengths, KV cache dtype)
ROWS = {
    "lognormal_128x1500": (lognormal(128, 1500, 0.9, seed=1), "auto"),
    "lognormal_32x12k": (lognormal(32, 12000, 0.9, 32768, seed=2), "auto"),
    "two_mode_96x600_8x24k": ([600] * 96 + [24000] * 8, "auto"),
    "uniform_128x8192": ([8192] * 128, "auto"),
    "b1_16384": ([16384], "auto"),
    "two_mode_fp8_96x600_8x24k": ([600] * 96 + [24000] * 8, "fp8"),
    "uniform_16x4096": ([4096] * 16, "auto"),
}


def graph_us(batch: Batch, builder: TritonMetadataBuilder) -> float:
    """The forward replayed from a CUDA graph captured on ``builder``'s capture-time metadata of the batch."""
    meta = builder.build_for_cudagraph_capture(batch.common)
    out = torch.empty_like(batch.query)
    fwd = lambda: batch.impl.forward(batch.query, None, None, batch.kv, meta, out)  # noqa: E731
    graph = capture_forward(fwd)
    builder.build(batch.common)  # a later step's build rewrites the captured schedule (as an engine's would)
    return do_bench_us(graph.replay)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    ap.add_argument("--rows", nargs="*", default=None, help=f"rows to run (of {', '.join(ROWS)}); default: all")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument("--waves", nargs="*", type=int, default=[],
                    help="extra balanced rows with these target programs per SM (BalancedParams.waves)")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer peer")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"),
                                                  "command": " ".join(sys.argv), "rows": rows}, indent=1))

    for name in args.rows or list(ROWS):
        lens, kv_dtype = ROWS[name]
        batch = Batch([(1, n - 1) for n in lens], kv_cache_dtype=kv_dtype, decode_schedule="uniform")
        keys = sum(lens)
        peer = None
        if not args.no_flashinfer:
            try:
                fi, fi_out = flashinfer_decode(batch)
                fi()
                peer = do_bench_us(fi)
            except Exception as exc:  # flashinfer missing or unable to serve the batch: rows without the peer
                print(f"# flashinfer: {type(exc).__name__}: {exc}", file=sys.stderr)
        variants = [("uniform", None), ("balanced", None), ("auto", None)]
        variants += [("balanced", BalancedParams(waves=w)) for w in args.waves]
        reference, uniform_us = None, None
        for mode, params in variants:
            builder = TritonMetadataBuilder(batch.spec, "cuda", max_num_reqs=max(256, len(lens)),
                                            decode_schedule=mode)
            if params is not None:
                builder.decode_scheduler.params = params
            meta = builder.build(batch.common)
            out = torch.full_like(batch.query, float("nan"))
            fwd = lambda: batch.impl.forward(batch.query, None, None, batch.kv, meta, out)  # noqa: E731
            fwd()
            torch.cuda.synchronize()
            if reference is None:
                reference = out.clone()
            us = do_bench_us(fwd)
            uniform_us = uniform_us if uniform_us is not None else us
            build_us = host_us(lambda: builder.build(batch.common), n=100, rounds=5)[0]
            row = {
                "case": name, "mode": mode, "waves": (params or BalancedParams()).waves, "B": len(lens),
                "kv_tokens": keys, "max_len": max(lens), "kv_dtype": kv_dtype, "us": round(us, 2),
                "tb_s": round(batch.kv_bytes / us / 1e6, 3), "vs_uniform": round(us / uniform_us, 4),
                "flashinfer_us": round(peer, 2) if peer else None,
                "vs_flashinfer": round(us / peer, 4) if peer else None,
                "build_us": round(build_us, 2), "schedule": meta.decode_schedule_note,
                "max_diff_vs_uniform": float((out.float() - reference.float()).abs().max()),
            }
            if args.graph:
                row["graph_us"] = round(graph_us(batch, builder), 2)
            emit(row)
        del batch
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
