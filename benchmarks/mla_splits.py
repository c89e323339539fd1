"""MLA decode split-KV sweep: the backend's ``mla_decode`` at a range of KV split counts on each shape, with the
time of each kernel of the launch (decode and split reduction, from the CUDA profiler) and the split count
``choose_num_splits`` picks, next to FlashInfer MLA in the same process. It shows what the split policy costs and
where the decode kernel's time goes.

    python -m benchmarks.mla_splits --out benchmarks/results/h100-DATE-mla-splits.json
"""

from __future__ import annotations

import argparse
import json
import platform
from collections import defaultdict

import torch
import triton

from benchmarks.mla_explore import DEEPSEEK, DecodeBatch, bench_us, compare, flashinfer_launch, num_sms, reference

SHAPES = [(64, 4096), (128, 8192), (1, 32768), (2, 32768), (4, 32768), (8, 32768), (16, 8192), (32, 4096)]
SPLITS = [1, 2, 4, 8, 16, 32, 64]


def kernel_times_us(fn, calls: int = 20) -> dict[str, float]:
    """Mean device microseconds per call of each kernel ``fn`` launches (CUDA profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            totals[evt.key[:60]] += evt.device_time_total / calls
    return dict(totals)


def run_shape(batch: int, seq_len: int, q_len: int, splits_list: list[int], sms: int, fp8: bool) -> list[dict]:
    from attnbackends.mla.decode_kernel import (
        choose_num_splits,
        decode_descriptors,
        decode_kernel_name,
        default_decode_config,
        mla_decode,
    )

    b = DecodeBatch([seq_len] * batch, q_len, kv_fp8=fp8, dims=DEEPSEEK)
    ref_out, ref_lse = reference(b)
    cfg = default_decode_config(b.dims.heads)
    chosen = choose_num_splits(batch, b.dims.heads * q_len, seq_len, sms, cfg)
    query_start = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=b.device)
    kernel = decode_kernel_name(b.q_nope, b.q_pe, b.cache, cfg, tree=False)
    descriptors = decode_descriptors(kernel, b.cache, b.dims.lkv, cfg)
    rows = []
    for splits in sorted(set(splits_list) | {chosen}):
        if splits > 1 and seq_len / splits < 64:
            continue
        out, lse = b.new_output()
        B, H, lkv = b.q_nope.shape
        partials = None
        if splits > 1:
            partials = (torch.empty(B, H, splits, lkv, dtype=torch.float32, device=b.device),
                        torch.empty(B, H, splits, dtype=torch.float32, device=b.device))

        def fn(out=out, lse=lse, partials=partials, splits=splits):
            mla_decode(b.q_nope, b.q_pe, b.cache, b.block_table, b.seq_lens, out, scale=b.dims.scale,
                       k_scale=b.k_scale, num_splits=splits, config=cfg, lse=lse, partials=partials,
                       descriptors=descriptors, query_start_loc=query_start if q_len > 1 else None,
                       max_query_len=q_len)
        fn()
        torch.cuda.synchronize()
        err = compare(out, lse, ref_out, ref_lse)
        us, timer = bench_us(fn, "eager")
        graph_us, _ = bench_us(fn, "graph")
        row = {"B": batch, "L": seq_len, "q_len": q_len, "fp8": fp8, "kernel": kernel, "splits": splits,
               "chosen": splits == chosen, "us": us, "tflops": b.flops() / us / 1e6, "timer": timer,
               "graph_us": graph_us, "kernels_us": kernel_times_us(fn), **err}
        rows.append(row)
        print(f"{batch:4d}x{seq_len:<6d}q{q_len} {'fp8 ' if fp8 else ''}{kernel:7s} splits {splits:3d}"
              f"{'*' if row['chosen'] else ' '} {us:8.1f} us {row['tflops']:6.1f} TFLOP/s (graph {graph_us:7.1f} us)"
              f"  rel {err['rel']:.1e}  kernels "
              + ", ".join(f"{k[:28]} {v:.1f}" for k, v in row["kernels_us"].items()), flush=True)
    if not fp8:
        try:
            fi_fn, fi_out, backend = flashinfer_launch(b)
            us, timer = bench_us(fi_fn, "eager")
            graph_us, _ = bench_us(fi_fn, "graph")
            rows.append({"B": batch, "L": seq_len, "q_len": q_len, "fp8": fp8, "kernel": f"flashinfer-{backend}",
                         "us": us, "tflops": b.flops() / us / 1e6, "timer": timer, "graph_us": graph_us})
            print(f"{batch:4d}x{seq_len:<6d}q{q_len} (graph {graph_us:7.1f} us) flashinfer MLA ({backend}) {us:8.1f} us {b.flops() / us / 1e6:6.1f} TFLOP/s",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - no FlashInfer on this host: our rows stand alone
            print(f"flashinfer MLA unavailable: {type(e).__name__}: {str(e)[:200]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{b}x{L}" for b, L in SHAPES),
                    help="BxL or BxLxQ (Q query tokens per request), comma-separated")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--fp8", action="store_true", help="fp8 (e4m3) latent pages too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    sms = num_sms()
    splits_list = [int(s) for s in args.splits.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        batch, seq_len, q_len = ([int(x) for x in shape.lower().split("x")] + [1])[:3]
        for fp8 in ([False, True] if args.fp8 else [False]):
            rows += run_shape(batch, seq_len, q_len, splits_list, sms, fp8)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "sms": sms, "command": "python -m benchmarks.mla_splits"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
