"""Decode context parallelism on 2 GPUs: one decode step's attention on 1 rank vs 2 ranks (issue 8).

Default shape: batch 8, context 131072, 32 query / 8 KV heads, head 128, bf16, pages of 16. Every rank builds the
same random cache (same seed, one page-id space) and attends only over the pages it owns
(``build_local_metadata``), so rank 0 can also run the single-rank step over the whole cache and check the
context-parallel output against it.

Timed on each rank with CUDA events over a fixed number of iterations (collectives forbid per-rank adaptive
repetition counts); the reported time is the slowest rank's median:

- ``1 rank``      : ``unified_attention`` over the full cache (rank 0 alone, the others wait).
- ``2 ranks local``: ``unified_attention(return_lse=...)`` over the local half, no exchange.
- ``2 ranks all_gather`` / ``all_reduce``: the whole context-parallel step (local attention, NCCL exchange, merge).

Run on a host with >= 2 GPUs:

    python -m benchmarks.run --suite cp_decode                      # the default shape, results kept
    python -m benchmarks.cp_decode [--batch 8] [--context 131072] [--out results.json]
    torchrun --nproc-per-node 2 benchmarks/cp_decode.py        # the same, launched by torchrun

NVLink multicast (NVLS / symmetric-memory multicast) stays off on the GPU hosts: the script sets
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before any process group exists.
"""

from __future__ import annotations

import os

# Before torch.distributed / NCCL initialise, in the parent and (inherited) in every spawned rank.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from attnbackends import AttentionSpec, build_common_metadata  # noqa: E402
from attnbackends.parallel import ContextParallelLayout, build_local_metadata, exchange_and_merge  # noqa: E402
from attnbackends.triton.launch import SplitKVWorkspace, unified_attention  # noqa: E402


def _time(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # us
    return times


def _slowest_median(times: list[float], device) -> float:
    t = torch.tensor([statistics.median(times)], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run(rank: int, world: int, args) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                                device_id=device)
    spec = AttentionSpec(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                         dtype="bfloat16", block_size=args.block_size)
    bs, batch, context = spec.block_size, args.batch, args.context
    pages_per_seq = math.ceil((context + 1) / bs)
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = batch * pages_per_seq
    kv_cache = torch.randn(num_blocks, 2, bs, spec.num_kv_heads, spec.head_size, generator=gen, device=device,
                           dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen, device=device).cpu()
    tables = perm.view(batch, pages_per_seq).tolist()
    common = build_common_metadata([1] * batch, [context] * batch, tables, bs, device)
    query = torch.randn(batch, spec.num_heads, spec.head_size, generator=gen, device=device, dtype=torch.bfloat16)
    scale = spec.softmax_scale
    workspace = SplitKVWorkspace.allocate(batch, spec.num_heads, spec.head_size, device=device)

    layout = ContextParallelLayout(world, rank, bs, args.interleave)
    local = build_local_metadata(common, layout)
    out_local = torch.empty(batch, spec.num_heads, spec.head_size, dtype=torch.float32, device=device)
    lse_local = torch.empty(spec.num_heads, batch, dtype=torch.float32, device=device)
    merged = torch.empty(batch, spec.num_heads, spec.head_size, dtype=torch.bfloat16, device=device)

    def local_step():
        unified_attention(query, kv_cache[:, 0], kv_cache[:, 1], out_local, local.query_start_loc, local.seq_lens,
                          local.block_table, 1, local.max_seq_len, scale, causal=False, workspace=workspace,
                          num_decodes=batch, validate=False, return_lse=lse_local)

    def cp_step(method):
        local_step()
        exchange_and_merge(out_local, lse_local, method=method, output=merged)

    full_out = torch.empty_like(query)

    def single_step():
        unified_attention(query, kv_cache[:, 0], kv_cache[:, 1], full_out, common.query_start_loc, common.seq_lens,
                          common.block_table, 1, common.max_seq_len, scale, workspace=workspace, num_decodes=batch,
                          validate=False)

    results = {"gpu": torch.cuda.get_device_name(device), "world_size": world, "batch": batch,
               "context": context, "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
               "head_size": spec.head_size, "block_size": bs, "interleave": args.interleave,
               "kv_bytes_total": kv_cache.numel() * kv_cache.element_size(),
               "torch": torch.__version__}
    # the single-rank reference (rank 0 alone; the others idle at the barrier)
    if rank == 0:
        results["1_rank_us"] = statistics.median(_time(single_step, args.iters, args.warmup))
    dist.barrier()
    results[f"{world}_ranks_local_only_us"] = _slowest_median(_time(local_step, args.iters, args.warmup), device)
    for method in ("all_gather", "all_reduce"):
        results[f"{world}_ranks_{method}_us"] = _slowest_median(_time(lambda: cp_step(method), args.iters, args.warmup),
                                                          device)
        # correctness against the single-rank step
        cp_step(method)
        if rank == 0:
            single_step()
            err = (merged.float() - full_out.float()).abs().max().item()
            results[f"max_abs_err_{method}"] = err
    if rank == 0:
        for method in ("all_gather", "all_reduce"):
            results[f"speedup_{method}"] = results["1_rank_us"] / results[f"{world}_ranks_{method}_us"]
        print(json.dumps(results, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**results, "rows": result_rows(results)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


def result_rows(results: dict) -> list[dict]:
    """PERF.md rows of one run: the context-parallel step (local attention only, then with each exchange) against
    the single-rank step over the whole cache."""
    world = results["world_size"]
    base = {"case": "cp_decode", "backend": "triton", "peer": "triton_1_rank", "B": results["batch"],
            "L": results["context"], "dtype": "bfloat16", "kv_dtype": "auto", "ranks": world}
    one = results["1_rank_us"]
    rows = []
    for exchange, key in (("none", f"{world}_ranks_local_only_us"), ("all_gather", f"{world}_ranks_all_gather_us"),
                          ("all_reduce", f"{world}_ranks_all_reduce_us")):
        us = results[key]
        row = {**base, "exchange": exchange, "us": round(us, 2), "peer_us": round(one, 2), "ratio": round(us / one, 4)}
        if f"max_abs_err_{exchange}" in results:
            row["max_abs_diff"] = results[f"max_abs_err_{exchange}"]
        rows.append(row)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))))
        run(rank, world, args)
        return 0
    if torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    args.port = _free_port()
    mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
