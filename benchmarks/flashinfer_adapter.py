"""The FlashInfer adapter's cost over raw FlashInfer wrapper calls, on the same inputs in one process.

Decode, 32 query / 8 KV heads, head 128, page 16, bf16, pages in random order. Per batch size, two steps:

- ``run``: one layer's attention: ``FlashInferImpl.forward`` (cache already holding the tokens) vs
  ``BatchDecodeWithPagedKVCacheWrapper.run`` on a wrapper planned identically;
- ``plan+run``: a whole step of one layer: ``FlashInferMetadataBuilder.build`` (page-table translation + plan) and
  ``forward`` vs ``plan`` (page table already at hand) and ``run``. Twice: with the builder's default re-planning
  (:mod:`attnbackends.ops.flashinfer.fast_plan`, ``fast_plan: true`` in the row) and with ``plan()`` every step.

Times: ``us`` / ``peer_us`` are ``triton.testing.do_bench`` medians (GPU-event time per call, an L2 flush before
each); ``wall_us`` / ``peer_wall_us`` are back-to-back loop times per call, the median of 7 rounds that alternate
ours and the peer (what a step costs an engine when the host is the bottleneck). Also the host time of ``build()`` at
B=64 and B=256, context 4096: CPU time of the thread (judged), wall clock and back to back.

A B=1 decode step is host-bound (a 15 us kernel, 100+ us of Python), and there the do_bench time is not the step's
cost: it is the GPU-event span from the end of the flush to the step's last kernel, so it depends on how much of the
step's host work comes before its first GPU operation (hidden behind the flush for the raw wrapper, whose plan()
starts with its copies; not for the adapter, which translates the page table first). The B=1 per-step overhead is
therefore judged by the wall times (``wall_overhead_us``), the B=64 one (GPU-bound) by the do_bench ratio; both
are recorded. ``python -m benchmarks.flashinfer_adapter --trace DIR`` writes the timelines that show this.

    python -m benchmarks.run --suite flashinfer_adapter      # results kept in benchmarks/results/
    python -m benchmarks.flashinfer_adapter --out rows.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.flashinfer import FlashInferBackend, FlashInferMetadataBuilder

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)


def _decode_batch(batch: int, seq_len: int, device: str = "cuda", seed: int = 0):
    """Common metadata, cache and query for ``batch`` decodes of ``seq_len`` tokens (pages in random order)."""
    gen = torch.Generator().manual_seed(seed)
    bs = SPEC.block_size
    pages = math.ceil(seq_len / bs)
    num_blocks = batch * pages + 8
    tables = torch.randperm(num_blocks, generator=gen)[: batch * pages].reshape(batch, pages)
    common = build_common_metadata([1] * batch, [seq_len - 1] * batch, tables.tolist(), bs, device)
    cache = torch.randn(num_blocks, 2, bs, SPEC.num_kv_heads, SPEC.head_size, dtype=torch.bfloat16, device=device)
    query = torch.randn(batch, SPEC.num_heads, SPEC.head_size, dtype=torch.bfloat16, device=device)
    return common, cache, query


def _raw_decode_peer(inputs):
    """The peer: FlashInfer's decode wrapper (tensor cores, as the adapter uses for 32 query / 8 KV heads) on its own
    workspace, and its ``plan()`` call with the page table at hand (host indptr / last-page arrays, page ids on the
    device; copies, so later builds cannot change them). Returns (wrapper, plan)."""
    import flashinfer

    indptr, last_page_len = inputs.kv_indptr.clone(), inputs.kv_last_page_len.clone()
    indices = inputs.kv_indices.to("cuda")
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True
    )

    def raw_plan():
        raw.plan(
            indptr, indices, last_page_len, SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_size, SPEC.block_size,
            pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16, sm_scale=SPEC.softmax_scale, non_blocking=True,
        )

    return raw, raw_plan


def _wall_us_pair(ours, peer, rounds: int = 7, iters: int = 200) -> tuple[float, float]:
    """Back-to-back loop time per call of ``ours`` and ``peer``: the median over ``rounds`` rounds that alternate the
    two, so that drift in the host's speed affects both alike."""
    ours_times, peer_times = [], []
    for _ in range(rounds):
        ours_times.append(_wall_us(ours, iters))
        peer_times.append(_wall_us(peer, iters))
    return statistics.median(ours_times), statistics.median(peer_times)


def _wall_us(fn, iters: int = 200, *, drain: bool = True) -> float:
    """Time per call of ``iters`` back-to-back calls (no synchronisation between them); ``drain``: the clock stops
    after the GPU has finished them, else when the host has enqueued the last one (host time alone)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if drain:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def _host_us(fn, iters: int = 100, clock=time.perf_counter_ns) -> float:
    """Median host time of one call in microseconds, the GPU drained before each (``clock``: nanoseconds)."""
    times = []
    for i in range(iters + 10):
        torch.cuda.synchronize()
        t0 = clock()
        fn()
        if i >= 10:
            times.append(clock() - t0)
    return statistics.median(times) / 1e3


def _host_cpu_us(fn, iters: int = 200) -> float:
    """Median CPU time of the calling thread in one call (``time.thread_time``), the GPU drained before each: the
    host work itself, without the time the thread spends descheduled (which makes wall-clock medians of ~100 us calls
    swing by 1.5x between runs on a shared host)."""
    return _host_us(fn, iters, clock=time.thread_time_ns)


def adapter_overhead_rows(batch_sizes=(1, 64), seq_len: int = 4096) -> list[dict]:
    """JSON rows: the adapter vs raw FlashInfer for decode steps (see the module docstring)."""
    from triton.testing import do_bench

    rows = []
    for batch in batch_sizes:
        common, cache, query = _decode_batch(batch, seq_len)
        out = torch.empty_like(query)
        builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0])
        planning_builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0], fast_plan=False)
        impl = FlashInferBackend.get_impl_cls()(SPEC)
        meta = builder.build(common)
        raw, raw_plan = _raw_decode_peer(meta.plan_inputs)
        raw_plan()
        torch.testing.assert_close(
            impl.forward(query, None, None, cache, meta, out.clone()), raw.run(query, cache), rtol=1e-2, atol=1e-2
        )

        def ours_run():
            impl.forward(query, None, None, cache, meta, out)

        def raw_run():
            raw.run(query, cache, out=out)

        def ours_step():
            impl.forward(query, None, None, cache, builder.build(common), out)

        def ours_step_planning():
            impl.forward(query, None, None, cache, planning_builder.build(common), out)

        def raw_step():
            raw_plan()
            raw.run(query, cache, out=out)

        ours_step()
        ours_step_planning()
        print(f"B={batch}: re-planning {builder.decode_replan_status}, plan() builder "
              f"{planning_builder.decode_replan_status}")
        variants = (("run", True, ours_run, raw_run), ("plan+run", True, ours_step, raw_step),
                    ("plan+run", False, ours_step_planning, raw_step))
        for step, fast_plan, ours, peer in variants:
            us = do_bench(ours, warmup=25, rep=200, return_mode="median") * 1e3
            peer_us = do_bench(peer, warmup=25, rep=200, return_mode="median") * 1e3
            wall, peer_wall = _wall_us_pair(ours, peer)
            rows.append({
                "case": "adapter_overhead", "backend": "flashinfer", "peer": "flashinfer_raw", "step": step,
                "fast_plan": fast_plan,
                "B": batch, "L": seq_len, "dtype": "bfloat16", "kv_dtype": "auto",
                "us": round(us, 2), "peer_us": round(peer_us, 2), "ratio": round(us / peer_us, 4),
                "wall_us": round(wall, 2), "peer_wall_us": round(peer_wall, 2),
                "wall_ratio": round(wall / peer_wall, 4), "wall_overhead_us": round(wall - peer_wall, 2),
            })
    return rows


def build_host_time_rows(batch_sizes=(64, 256), seq_len: int = 4096) -> list[dict]:
    """Host time of build() (translation + FlashInfer's plan) and of the raw plan() alone, per batch: ``us`` /
    ``peer_us`` are CPU time (the PERF.md target's measure); ``wall_us`` / ``peer_wall_us`` the wall-clock median with
    the GPU drained before each call, ``b2b_us`` / ``peer_b2b_us`` per call back to back."""

    rows = []
    for batch in batch_sizes:
        common, cache, _ = _decode_batch(batch, seq_len)
        builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0])
        planning_builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0], fast_plan=False)
        _, raw_plan = _raw_decode_peer(builder.build(common).plan_inputs)

        def build():
            builder.build(common)

        rows.append({
            "case": "build_host_time", "backend": "flashinfer", "peer": "flashinfer_raw_plan", "B": batch,
            "L": seq_len, "dtype": "bfloat16", "kv_dtype": "auto",
            "us": round(_host_cpu_us(build), 2), "peer_us": round(_host_cpu_us(raw_plan), 2),
            "wall_us": round(_host_us(build), 2), "peer_wall_us": round(_host_us(raw_plan), 2),
            "b2b_us": round(_wall_us(build, 300, drain=False), 2),
            "peer_b2b_us": round(_wall_us(raw_plan, 300, drain=False), 2),
            "translate_us": round(_host_cpu_us(lambda: builder._plan_inputs(common)), 2),
            "build_with_plan_us": round(_host_cpu_us(lambda: planning_builder.build(common)), 2),
        })
        rows[-1]["ratio"] = round(rows[-1]["us"] / rows[-1]["peer_us"], 4)
    return rows


def _host_us_behind_busy_gpu(fn, iters: int = 50, busy_us: float = 1000.0) -> float:
    """Median host time of one call enqueued behind ``busy_us`` of GPU work: close to ``busy_us`` or more when the
    call waits for the GPU (a hidden synchronisation), else the same as with the GPU idle."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * busy_us / (start.elapsed_time(end) * 1e3))
    times = []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _replan_pieces(builder: FlashInferMetadataBuilder, common, run_args) -> dict:
    """The parts of a re-planned decode build, each alone (reads the builder's private fields: a profiling aid)."""
    from attnbackends.flashinfer.backend import FlashInferMetadata
    from attnbackends.ops.flashinfer.page_ids import gather_page_ids

    wrapper = builder.wrappers.eager_decode
    replanner = builder.wrappers.replanner_for(wrapper)
    if replanner is None:
        return {}
    c = common
    inputs = builder._plan_inputs(c)
    b = c.num_reqs + 1
    args = (*replanner._workspaces, replanner._arange(b), inputs.host_kv_indptr(c.num_reqs), c.seq_lens_cpu,
            c.num_reqs, c.num_reqs, *replanner._fixed, *replanner._tail)
    raw, raw_plan = _raw_decode_peer(inputs)
    staged = builder._device_plan_buffer
    host = inputs.host_buffer
    on_device = inputs.on_device
    table = c.block_table

    return {
        "  raw plan()": raw_plan,
        "  raw plan()+run": lambda: (raw_plan(), raw.run(*run_args)),
        "  replan": lambda: replanner.replan(inputs, c.num_reqs, c.seq_lens_cpu),
        "  . scheduler (module.plan)": lambda: wrapper._cached_module.plan(*args),
        "  stage the small arrays (one H2D copy, cached views)": lambda: staged.stage(
            host, c.num_reqs, 0, host_gathered=True),
        "  decode table on the device (host kv_indptr + one kernel)": lambda: staged.decode_table(
            c.seq_lens_cpu, c.seq_lens, table, SPEC.block_size, c.max_seq_len),
        "  page-id gather kernel": lambda: gather_page_ids(table, on_device.kv_indptr, on_device.kv_indices),
        "  pinned host buffer (torch.empty, caching host allocator)": lambda: torch.empty(
            3 * b, dtype=torch.int32, pin_memory=True),
        "  one pinned H2D copy (copy_)": lambda: on_device.kv_indptr.copy_(host[:b], non_blocking=True),
        "  metadata object": lambda: FlashInferMetadata(
            plan_key=builder.plan_key, num_actual_tokens=c.num_actual_tokens, num_decodes=c.num_reqs,
            num_decode_tokens=c.num_reqs, num_prefills=0, slot_mapping=c.slot_mapping, common=c),
    }


def profile_build(batch_sizes=(1, 64, 256), seq_len: int = 4096, steps: int = 300) -> None:
    """Where a step's host time goes: cProfile of ``steps`` build + forward calls per batch size (top functions by
    own time), and the host time of each piece of the translation."""
    import cProfile
    import pstats

    for batch in batch_sizes:
        common, cache, query = _decode_batch(batch, seq_len)
        out = torch.empty_like(query)
        builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0])
        planning_builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0], fast_plan=False)
        impl = FlashInferBackend.get_impl_cls()(SPEC)
        impl.forward(query, None, None, cache, builder.build(common), out)
        planning_builder.build(common)
        host_gather = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0], host_gather_max_pages=1 << 30)
        device_gather = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0], host_gather_max_pages=0)
        pieces = {
            "translate+stage (host gather)": lambda: host_gather._plan_inputs(common),
            "translate+stage (device gather)": lambda: device_gather._plan_inputs(common),
            "build": lambda: builder.build(common),
            "build, plan() each step": lambda: planning_builder.build(common),
            "build+forward": lambda: impl.forward(query, None, None, cache, builder.build(common), out),
        }
        pieces.update(_replan_pieces(builder, common, (query, cache)))
        for name, fn in pieces.items():
            print(f"B={batch} {name}: {_host_us(fn):.1f} us host (median, GPU drained before each); "
                  f"{_host_us_behind_busy_gpu(fn):.1f} us with 1 ms of GPU work queued ahead; "
                  f"{_wall_us(fn, 300, drain=False):.1f} us per call back to back")
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(steps):
            impl.forward(query, None, None, cache, builder.build(common), out)
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- B={batch}: cProfile of {steps} build+forward steps (times are totals over the steps)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def trace_steps(out_dir: Path, batch: int = 1, seq_len: int = 4096, reps: int = 30) -> None:
    """Chrome traces (torch.profiler, CPU and CUDA) of ``reps`` do_bench-style steps (L2 flush, then the step) of
    the adapter and of the raw wrapper, to see where a step's GPU-timed span goes."""
    from torch.profiler import ProfilerActivity, profile

    common, cache, query = _decode_batch(batch, seq_len)
    out = torch.empty_like(query)
    builder = FlashInferMetadataBuilder(SPEC, "cuda", num_blocks=cache.shape[0])
    impl = FlashInferBackend.get_impl_cls()(SPEC)
    raw, raw_plan = _raw_decode_peer(builder.build(common).plan_inputs)

    def raw_step():
        raw_plan()
        raw.run(query, cache, out=out)

    def ours_step():
        impl.forward(query, None, None, cache, builder.build(common), out)

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for name, step in (("ours", ours_step), ("raw", raw_step)):
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for start, end in events:
                flush.zero_()
                start.record()
                step()
                end.record()
            torch.cuda.synchronize()
        spans = sorted(s.elapsed_time(e) * 1e3 for s, e in events)
        print(f"{name}: event-timed step median {spans[reps // 2]:.1f} us (min {spans[0]:.1f}, max {spans[-1]:.1f})")
        prof.export_chrome_trace(str(out_dir / f"trace-{name}-B{batch}.json"))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON rows here")
    parser.add_argument("--profile", action="store_true", help="print where build()'s host time goes, then exit")
    parser.add_argument("--trace", type=Path, help="write Chrome traces of do_bench-style steps here, then exit")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    reasons = FlashInferBackend.not_supported_reasons(SPEC, __import__("attnbackends").DeviceInfo.current())
    if reasons:
        print("flashinfer backend unavailable: " + "; ".join(reasons), file=sys.stderr)
        return 1
    if args.profile:
        profile_build()
        return 0
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
        trace_steps(args.trace)
        return 0
    rows = adapter_overhead_rows() + build_host_time_rows()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flashinfer {__import__('flashinfer').__version__}")
    print(f"{'case':<18}{'step':<18}{'B':>5}{'L':>6}{'us':>10}{'peer_us':>10}{'ratio':>8}{'wall_us':>10}{'peer_wall':>10}")
    for r in rows:
        step = r.get("step", "-") + ("/plan()" if r.get("fast_plan") is False else "")
        print(f"{r['case']:<18}{step:<18}{r['B']:>5}{r['L']:>6}{r['us']:>10.1f}{r['peer_us']:>10.1f}"
              f"{r['ratio']:>8.3f}{r.get('wall_us', float('nan')):>10.1f}{r.get('peer_wall_us', float('nan')):>10.1f}"
              + (f"   CPU time; translate {r['translate_us']:.1f} us, build with plan() {r['build_with_plan_us']:.1f} us,"
                 f" back to back {r['b2b_us']:.1f} vs {r['peer_b2b_us']:.1f} us" if "translate_us" in r else ""))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
