"""Whole-step wall time of 32 Llama-3-8B attention layers on ragged steps: ours eager and from a CUDA graph, against
FlashInfer's own wrappers driven directly, and our FlashInfer adapter beside.

    python -m benchmarks.run --suite step_wall                     # on the GPU host: results/ and RESULTS.md
    python -m benchmarks.step_wall --out rows.json                 # the rows alone (CUDA)
    python -m benchmarks.step_wall --cpu-smoke                     # no GPU: miniature steps, 2 layers, eager only

The steps (the decode suite's batches, :mod:`benchmarks.decode`): ``lognormal_1500`` (128 decodes, lognormal
lengths), ``mixed_chunks`` (96 decodes + 4 chunks of 512 on context), ``mixed_prompts`` (64 decodes + 32 short
prompts). A step is what an engine runs: one metadata build (or plan) for the step, then per layer the step's new
keys and values written to the cache and attention over it, with host and GPU together: the wall clock from a
synchronised start over ``--steps`` steps, divided by their number. The layers share one cache (hundreds of MB,
far beyond L2) and one query.

- ``triton``, mode ``eager``: ``build(common)`` + 32 x ``forward(q, k, v)``;
- ``triton``, mode ``graph``: the 32 forwards captured once in a CUDA graph from ``build_for_cudagraph_capture``
  (decode-only steps: the plan of ``build``; mixed steps: one unified launch fixed by the step's shape); a step is
  ``build(common)`` (an engine's per-step build: it rewrites a balanced schedule's unit table) + one replay.
  ``kernel_us``: the replay alone timed by ``triton.testing.do_bench`` (the GPU time of its kernels back to back),
  ``graph_overhead`` = us / kernel_us (target <= 1.05);
- ``flashinfer_adapter``, mode ``eager``: our FlashInfer backend as the triton rows;
- the peer ``flashinfer_wrappers``: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` for the decodes
  and ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for the rest, planned once per step, then per layer the
  cache write (the same write kernel ours runs, :func:`attnbackends.ops.kv_cache_write.reshape_and_cache`) and
  ``run()`` of each.

Rows: ``case`` step_wall, ``batch``, ``mode``, ``layers``, ``us`` (ms per step x 1000), ``peer_us``, ``ratio`` =
us / peer_us (target: eager <= 0.95).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from attnbackends import DeviceInfo
from attnbackends.ops.kv_cache_write import reshape_and_cache
from attnbackends.selection.registry import get_backend_class
from benchmarks.decode import (LLAMA3_8B, PEER, SMOKE_LAYER, ApiRunner, Case, WrapperPeer, _load_flashinfer,
                               batch_defs, torch_paged_wrappers)

from .report import write_rows

__all__ = ["BATCHES", "main", "measure"]

BATCHES = ("lognormal_1500", "mixed_chunks", "mixed_prompts")


def _wall_us(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Wall-clock µs per step over ``steps`` steps from a synchronised start (after two untimed steps)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps * 1e6


def _eager_step(runner: ApiRunner, layers: int) -> Callable[[], None]:
    case = runner.case

    def step() -> None:
        meta = runner.builder.build(case.common)
        for _ in range(layers):
            runner.impl.forward(case.query, case.new_k, case.new_v, case.kv, meta, runner.out)
    return step


def _graph_step(runner: ApiRunner, layers: int) -> tuple[Callable[[], None], torch.cuda.CUDAGraph]:
    """(a step: build + one replay, the graph of ``layers`` forwards)."""
    case = runner.case
    meta = runner.builder.build_for_cudagraph_capture(case.common)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner.impl.forward(case.query, case.new_k, case.new_v, case.kv, meta, runner.out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            runner.impl.forward(case.query, case.new_k, case.new_v, case.kv, meta, runner.out)

    def step() -> None:
        runner.builder.build(case.common)
        graph.replay()
    return step, graph


def _peer_step(peer: WrapperPeer, layers: int) -> Callable[[], None]:
    case = peer.case

    def step() -> None:
        peer.plan()
        for _ in range(layers):
            reshape_and_cache(case.new_k, case.new_v, case.kv, case.common.slot_mapping, case.kv_scale,
                              case.kv_scale, validate=False)
            peer.run()
    return step


def measure(device: torch.device, smoke: bool, layers: int, steps: int, ours_name: str, fi,
            adapter_name: Optional[str], names: Sequence[str] = BATCHES) -> list[dict]:
    """The rows of every step in ``names``."""
    layer = SMOKE_LAYER if smoke else LLAMA3_8B
    ours = get_backend_class(ours_name)
    adapter = get_backend_class(adapter_name) if adapter_name else None
    rows = []
    for bdef in batch_defs(0, smoke=smoke, names=list(names)):
        case = Case(bdef, layer, device)
        base = {"case": "step_wall", "peer": PEER if fi is not None else None, "layers": layers,
                "batch": bdef.name, "B": case.num_reqs, "num_decodes": case.num_decodes,
                "num_tokens": case.num_tokens, "L": max(case.seq_lens), "dtype": "bfloat16", "kv_dtype": "auto"}
        peer_us, peer_error = None, None
        if fi is not None:
            try:
                peer_us = _wall_us(_peer_step(WrapperPeer(fi, case), layers), steps, device)
            except Exception as exc:  # noqa: BLE001 - a failing peer is a row field, not the end of the suite
                peer_error = f"{type(exc).__name__}: {exc}"[:300]

        def row(backend: str, mode: str, us: Optional[float], **extra) -> dict:
            out = {**base, "backend": backend, "mode": mode, "us": None if us is None else round(us, 1),
                   "peer_us": None if peer_us is None else round(peer_us, 1),
                   "ratio": round(us / peer_us, 3) if us and peer_us else None, **extra}
            if peer_error:
                out["peer_error"] = peer_error
            return out

        runner = ApiRunner(ours, case)
        rows.append(row(ours.name, "eager", _wall_us(_eager_step(runner, layers), steps, device)))
        if device.type == "cuda":
            try:
                step, graph = _graph_step(ApiRunner(ours, case), layers)
                us = _wall_us(step, steps, device)
                from triton.testing import do_bench

                kernel_us = do_bench(graph.replay, warmup=25, rep=200) * 1e3
                rows.append(row(ours.name, "graph", us, kernel_us=round(kernel_us, 1),
                                graph_overhead=round(us / kernel_us, 3)))
            except Exception as exc:  # noqa: BLE001
                rows.append(row(ours.name, "graph", None, error=f"{type(exc).__name__}: {exc}"[:300]))
        if adapter is not None:
            label = "flashinfer_adapter" if adapter.name == "flashinfer" else f"{adapter.name}_as_adapter"
            try:
                rows.append(row(label, "eager", _wall_us(_eager_step(ApiRunner(adapter, case), layers), steps,
                                                         device)))
            except Exception as exc:  # noqa: BLE001
                rows.append(row(label, "eager", None, error=f"{type(exc).__name__}: {exc}"[:300]))
        del case, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_wall", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON rows to write (PERF.md format)")
    ap.add_argument("--layers", type=int, default=32, help="layers per step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--batches", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    ap.add_argument("--cpu-smoke", dest="cpu_smoke", action="store_true",
                    help="no GPU: miniature steps, 2 layers, the reference backend as ours and as the adapter, a "
                         "torch stand-in for FlashInfer's wrappers, eager rows only")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("the step_wall suite needs a CUDA GPU (use --cpu-smoke for a check of its code on the CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    if smoke:
        rows = measure(device, True, min(args.layers, 2), min(args.steps, 2), "reference", torch_paged_wrappers(),
                       "reference", args.batches)
    else:
        fi, fi_error = _load_flashinfer()
        if fi is None:
            print(f"FlashInfer unavailable ({fi_error}): rows without the peer", flush=True)
        adapter = "flashinfer"
        if get_backend_class(adapter).not_supported_reasons(LLAMA3_8B.spec(), DeviceInfo.current(device)):
            adapter = None
        rows = measure(device, False, args.layers, args.steps, "triton", fi, adapter, args.batches)
    if args.out:
        write_rows(args.out, rows)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("params",)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
