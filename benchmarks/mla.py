"""MLA benchmarks on one GPU: what an engine calls, every backend side by side in one process (../shared/PERF.md).

DeepSeek-V3 layer (128 heads, latent 512 + rope 64, nope 128, v 128, page 64, bf16, pages in random order). Both
``triton_mla`` and ``flashinfer_mla`` impls are built from the same spec and ``kv_b_proj``, so both include the
same cache write, query absorption and up-projection; ``build()`` runs once per step, outside the timings.

Rows (``case``):

- ``mla_forward`` (field ``mode``): ``impl.forward`` end to end per layer, ``eager`` (back-to-back calls over
  several layers' caches, timed by CUDA events: whichever of host and GPU is slower sets the pace, as in an engine)
  and ``graph`` (the same calls captured in one CUDA graph and replayed). Extra fields: ``host_us`` /
  ``peer_host_us`` (host time per call with the GPU kept busy, so nothing waits for it), ``kernel_us`` (our decode
  launch alone), ``flashinfer_raw_us`` (FlashInfer's ``BatchMLAPagedAttentionWrapper.run`` alone),
  ``max_abs_diff_vs_peer``.
- ``mla_host``: host time per ``forward`` at B=1 (the GPU kept busy), ours against ``flashinfer_mla``'s, as an
  engine spends it: per step one ``build()`` then ``forward`` for each of ``ENGINE_LAYERS`` layers, each with its
  own impl and cache, the metadata tensors the same every step (``build_us`` beside); ``repeat_us``: one layer's
  ``forward`` repeated on one metadata.
- ``mla_fp8``: ``triton_mla`` over fp8 e4m3 latent pages against our bf16 pages (``us``: graph replay; ``eager_us``
  and ``peer_eager_us`` beside).
- ``mla_prefill`` (``--prefill``): the MLA prefill with each installed prefill kernel at 4 x 4096 new tokens on
  8192 cached tokens.

    python -m benchmarks.mla --out benchmarks/results/<gpu>-mla-<date>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import triton

from attnbackends import DeviceInfo
from attnbackends.compat import cuda_sleep
from attnbackends.metadata import build_common_metadata
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend, TritonMLAMetadataBuilder
from attnbackends.mla.decode_kernel import default_decode_config
from attnbackends.mla.decode_launch import (
    launch_mla_absorb, launch_mla_absorb_and_write, launch_mla_decode, launch_mla_up_projection,
)
from attnbackends.mla.decode_plan import UpProjection
from attnbackends.mla.prefill import available_prefill_kernels
from attnbackends.platform import package_available
from attnbackends.spec import AttentionSpec

H, LKV, R, P, V, PAGE = 128, 512, 64, 128, 128, 64
#: (B, L, query tokens per request): the decode shapes of the MLA targets.
FORWARD_SHAPES = ((64, 4096, 1), (128, 8192, 1), (1, 32768, 1), (4, 32768, 1), (8, 32768, 1), (16, 8192, 1),
                  (64, 4096, 4))
FP8_SHAPES = ((64, 4096), (128, 8192))
HOST_SHAPE = (1, 4096)
#: Layers per engine step in the host-time row (each its own impl, weights and cache).
ENGINE_LAYERS = 8
#: Layers' caches cycled through per timing: at least this many bytes, so that L2 does not keep a cache warm.
ROTATE_BYTES = 160 * 1024 * 1024


class Rows(list):
    """The result rows, written to ``path`` (and as markdown to ``md_path``) after every row: a run cut short
    keeps what it measured."""

    def __init__(self, path: str, md_path: Optional[str], log: Callable[[str], None]) -> None:
        super().__init__()
        self.path, self.md_path, self.log = path, md_path, log

    def append(self, row: dict) -> None:
        super().append(row)
        self.log(json.dumps(row))
        self.save()

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": list(self)}, f, indent=1)
        if self.md_path:
            with open(self.md_path, "w") as f:
                f.write(markdown(self))


def event_time(fn: Callable[[], Any], calls: int, reps: int = 5) -> float:
    """Microseconds per call of ``fn`` run ``calls`` times back to back (median of ``reps`` timings)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def host_time(fn: Callable[[], Any], calls: int = 40, reps: int = 5) -> float:
    """Host microseconds per call of ``fn``, the GPU kept busy by a sleep kernel queued first (so the host never
    waits for it and the launch queue never fills)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        cuda_sleep(100_000_000)  # ~60 ms at 1.7 GHz: longer than the calls' host time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def graph_time(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return event_time(graph.replay, 1, reps=7) / calls


@dataclass
class Step:
    """One decode step of a layer stack: the batch's metadata, the inputs, and ``layers`` caches."""

    spec: AttentionSpec
    common: Any
    caches: list[torch.Tensor]
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_b_proj: torch.Tensor
    out: torch.Tensor

    @property
    def layers(self) -> int:
        return len(self.caches)


def make_step(batch: int, seq_len: int, q_len: int = 1, kv_cache_dtype: str = "auto", seed: int = 0) -> Step:
    spec = AttentionSpec.mla(H, dtype="bfloat16", block_size=PAGE, kv_cache_dtype=kv_cache_dtype,
                             num_speculative_tokens=q_len - 1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = math.ceil(seq_len / PAGE)
    num_pages = batch * pages_per
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).view(batch, pages_per)
    common = build_common_metadata([q_len] * batch, [seq_len - q_len] * batch, order.tolist(), PAGE, "cuda")
    cache_bytes = num_pages * PAGE * (LKV + R) * spec.kv_cache_torch_dtype.itemsize
    layers = max(1, math.ceil(ROTATE_BYTES / cache_bytes))
    caches = []
    for _ in range(layers):
        c = torch.randn(num_pages, PAGE, LKV + R, device="cuda", dtype=torch.bfloat16, generator=gen)
        caches.append(c.to(spec.kv_cache_torch_dtype))
    t = batch * q_len
    q = torch.randn(t, H, P + R, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv_c = torch.randn(t, LKV, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_pe = torch.randn(t, R, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(H * (P + V), LKV, device="cuda", generator=gen) / math.sqrt(LKV)).bfloat16()
    out = torch.empty(t, H, V, device="cuda", dtype=torch.bfloat16)
    return Step(spec, common, caches, q, kv_c, k_pe, w, out)


def backend_calls(backend_cls, step: Step, **builder_kwargs: Any):
    """(builder, metadata, impl, forward over the layers' caches in turn) for one backend."""
    builder = backend_cls.get_builder_cls()(step.spec, "cuda", num_blocks=step.caches[0].shape[0], **builder_kwargs)
    meta = builder.build(step.common)
    impl = backend_cls.get_impl_cls()(step.spec, kv_b_proj=step.kv_b_proj)
    impl.process_weights_after_loading()
    at = [0]

    def forward():
        cache = step.caches[at[0] % step.layers]
        at[0] += 1
        return impl.forward(step.q, step.kv_c, step.k_pe, cache, meta, step.out)

    return builder, meta, impl, forward


def flashinfer_raw(step: Step) -> Callable[[], Any]:
    """FlashInfer's MLA wrapper alone (planned once, ``run`` per layer) on the step's caches."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    common = step.common
    batch = common.num_reqs
    table = common.block_table[:batch]
    pages_per = table.shape[1]
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    wrapper.plan(common.query_start_loc_cpu.to(torch.int32), torch.arange(batch + 1, dtype=torch.int32) * pages_per,
                 table.flatten().to(torch.int32), common.seq_lens_cpu.to(torch.int32), H, LKV, R, PAGE,
                 common.max_query_len > 1, step.spec.softmax_scale, torch.bfloat16, torch.bfloat16)
    t = step.q.shape[0]
    ql = torch.randn(t, H, LKV, device="cuda", dtype=torch.bfloat16)
    qpe = step.q[..., P:].contiguous()
    out = torch.empty_like(ql)
    at = [0]

    def run():
        cache = step.caches[at[0] % step.layers]
        at[0] += 1
        wrapper.run(ql, qpe, cache[..., :LKV], cache[..., LKV:], out=out)

    return run


def triton_kernel_only(impl, meta, step: Step) -> Callable[[], Any]:
    """Our decode launch alone (the planned launch over the absorbed queries already in the plan's buffer)."""
    plan = meta.decode.plan
    at = [0]
    q_pe = step.q[..., P:]

    def run():
        cache = step.caches[at[0] % step.layers]
        at[0] += 1
        launch_mla_decode(plan.launch, plan.ql_t, q_pe, impl._caches.get(cache), impl._qk_scale_log2,
                          impl._v_scale, plan.ql_key)

    return run


def _try(log, what: str, fn: Callable[[], Any]) -> Optional[Any]:
    try:
        return fn()
    except Exception:
        log(f"{what} failed:\n{traceback.format_exc()}")
        return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def _r(x: Optional[float], nd: int = 1) -> Optional[float]:
    return round(x, nd) if x is not None else None


def run_forward(rows: list, log, shapes=FORWARD_SHAPES) -> None:
    have_fi = package_available("flashinfer")
    for batch, seq_len, q_len in shapes:
        step = make_step(batch, seq_len, q_len)
        calls = step.layers * max(1, 8 // step.layers)
        _, meta, impl, ours = backend_calls(TritonMLABackend, step)
        ours()
        torch.cuda.synchronize()
        ours_out = step.out.clone()
        res: dict[str, Any] = {
            "eager": _try(log, "triton_mla eager", lambda: event_time(ours, calls)),
            "host": _try(log, "triton_mla host", lambda: host_time(ours)),
            "graph": _try(log, "triton_mla graph", lambda: graph_time(ours, calls)),
            "kernel": _try(log, "triton_mla kernel", lambda: event_time(triton_kernel_only(impl, meta, step), calls)),
        }
        peer: dict[str, Any] = {}
        diff = None
        if have_fi:
            fi = _try(log, "flashinfer_mla build", lambda: backend_calls(FlashInferMLABackend, step))
            if fi is not None:
                theirs = fi[3]
                theirs()
                torch.cuda.synchronize()
                diff = float((step.out.float() - ours_out.float()).abs().max())
                peer = {
                    "eager": _try(log, "flashinfer_mla eager", lambda: event_time(theirs, calls)),
                    "host": _try(log, "flashinfer_mla host", lambda: host_time(theirs)),
                    "graph": _try(log, "flashinfer_mla graph", lambda: graph_time(theirs, calls)),
                    "raw": _try(log, "flashinfer raw", lambda: event_time(flashinfer_raw(step), calls)),
                }
        flops = 2 * batch * q_len * H * seq_len * (LKV + R + LKV)
        for mode in ("eager", "graph"):
            us, peer_us = res[mode], peer.get(mode)
            rows.append({
                "case": "mla_forward", "mode": mode, "backend": "triton_mla", "peer": "flashinfer_mla",
                "B": batch, "L": seq_len, "q_len": q_len, "H": H, "dtype": "bfloat16", "kv_dtype": "auto",
                "us": _r(us), "peer_us": _r(peer_us), "ratio": _ratio(us, peer_us),
                "TFLOPs": _r(flops / us / 1e6) if us else None,
                "host_us": _r(res["host"]), "peer_host_us": _r(peer.get("host")),
                "kernel_us": _r(res["kernel"]), "flashinfer_raw_us": _r(peer.get("raw")),
                "layers_cycled": step.layers, "max_abs_diff_vs_peer": diff,
            })
        del step, impl, meta
        torch.cuda.empty_cache()


def engine_host_time(backend_cls, step: Step, layers: int = ENGINE_LAYERS, steps: int = 25,
                     reps: int = 5) -> tuple[float, float]:
    """(host microseconds per ``forward``, per ``build()``) as an engine spends them: per step one ``build()``
    then ``forward`` of each of ``layers`` layers, each its own impl and cache, the step's metadata tensors the
    same every step (an engine's persistent input buffers). Each part is clocked on its own, the GPU kept busy by a
    sleep kernel queued first (a planner that synchronises waits for it once, inside its ``build()``); medians of
    ``reps`` runs of ``steps`` steps."""
    builder = backend_cls.get_builder_cls()(step.spec, "cuda", num_blocks=step.caches[0].shape[0])
    impls = []
    for _ in range(layers):
        impl = backend_cls.get_impl_cls()(step.spec, kv_b_proj=step.kv_b_proj.clone())
        impl.process_weights_after_loading()
        impls.append(impl)
    caches = [step.caches[i % step.layers] for i in range(layers)]
    clock = time.perf_counter

    def run_steps(count: int) -> tuple[float, float]:
        build_s = forward_s = 0.0
        for _ in range(count):
            t0 = clock()
            meta = builder.build(step.common)
            t1 = clock()
            for impl, cache in zip(impls, caches):
                impl.forward(step.q, step.kv_c, step.k_pe, cache, meta, step.out)
            forward_s += clock() - t1
            build_s += t1 - t0
        return forward_s * 1e6 / (count * layers), build_s * 1e6 / count

    run_steps(3)
    torch.cuda.synchronize()
    forward_us, build_us = [], []
    for _ in range(reps):
        cuda_sleep(100_000_000)
        f, b = run_steps(steps)
        torch.cuda.synchronize()
        forward_us.append(f)
        build_us.append(b)
    return statistics.median(forward_us), statistics.median(build_us)


def run_host(rows: list, log) -> None:
    """Row ``mla_host``: host time per ``forward`` as an engine spends it (:func:`engine_host_time`: per step one
    ``build()`` and ``ENGINE_LAYERS`` layers; ``build_us`` beside), and ``repeat_us``: one layer's ``forward``
    called again and again on one metadata."""
    batch, seq_len = HOST_SHAPE
    step = make_step(batch, seq_len)
    res: dict[str, dict[str, Optional[float]]] = {}
    backends = [("triton_mla", TritonMLABackend)]
    if package_available("flashinfer"):
        backends.append(("flashinfer_mla", FlashInferMLABackend))
    for name, cls in backends:
        both = _try(log, f"{name} engine step host", lambda: engine_host_time(cls, step))
        repeat = _try(log, f"{name} repeat host", lambda: host_time(backend_calls(cls, step)[3], calls=100))
        res[name] = {"us": both[0] if both else None, "build": both[1] if both else None, "repeat": repeat}
        log(f"{name}: host per forward {res[name]['us']} us in an engine step, build {res[name]['build']} us, "
            f"repeated forward {repeat} us")
    ours, peer = res["triton_mla"], res.get("flashinfer_mla", {})
    rows.append({"case": "mla_host", "backend": "triton_mla", "peer": "flashinfer_mla", "B": batch, "L": seq_len,
                 "H": H, "dtype": "bfloat16", "kv_dtype": "auto", "layers": ENGINE_LAYERS, "us": _r(ours["us"]),
                 "peer_us": _r(peer.get("us")), "ratio": _ratio(ours["us"], peer.get("us")),
                 "build_us": _r(ours["build"]), "peer_build_us": _r(peer.get("build")),
                 "repeat_us": _r(ours["repeat"]), "peer_repeat_us": _r(peer.get("repeat"))})


def run_host_parts(rows: list, log) -> None:
    """Where ``triton_mla.forward``'s host time goes at B=1 (each stage timed alone, the GPU kept busy): row
    ``mla_host_parts`` with one field per stage (microseconds per call), in the order ``forward`` runs them:
    ``check_inputs``, ``absorb_write_launch`` (the Triton absorption writing the new tokens into the cache, where
    the builder folded the write into it; else ``cache_write``, then ``absorb_launch``, the Triton absorption alone,
    or ``absorb_bmm``, its input view included, where the builder planned cuBLAS), ``decode_launch`` (the decode
    kernel, with the rotary queries' view after ``absorb_bmm``; the split reduction too when the up-projection is
    not fused),
    ``reduce_up_launch`` (the fused split reduction + up-projection; ``up_bmm``, its output view included, where
    the builder planned no fused launch). Beside them, for scale: ``cache_write`` and ``absorb_launch`` where the
    write is folded (what the folded launch replaces), ``cache_state_lookup``, ``up_bmm_unfused``
    (what the fused launch replaces: the reduction's launch is part of ``decode_launch`` on that path),
    ``as_strided_view`` and ``empty_torch_op``."""
    batch, seq_len = HOST_SHAPE
    step = make_step(batch, seq_len)
    _, meta, impl, forward = backend_calls(TritonMLABackend, step)
    forward()
    cache = step.caches[0]
    step_plan = meta.decode.plan
    q, out = step.q, step.out
    plan, ql, ql_t, ql_key, latent = step_plan.launch, step_plan.ql, step_plan.ql_t, step_plan.ql_key, step_plan.latent
    absorb = step_plan.absorb_launch
    up_fused = step_plan.up_projection is UpProjection.FUSED
    state = impl._caches.get(cache)
    qs_t, qs_n, qs_d = q.stride()
    os_t, os_n, os_d = out.stride()
    q_pe = lambda: q.as_strided(step_plan.q_pe_view, (qs_t, qs_n, qs_d), q.storage_offset() + P * qs_d)  # noqa: E731
    up_out = lambda: out.as_strided(step_plan.out_view, (os_n, os_t, os_d), out.storage_offset())  # noqa: E731
    parts = {
        "forward": forward,
        "check_inputs": lambda: impl.check_inputs(step.q, step.kv_c, step.k_pe, cache, meta, step.out),
        "cache_write": lambda: impl.update_kv_cache(step.kv_c, step.k_pe, cache, meta.slot_mapping),
    }
    if step_plan.writes_cache:
        parts["absorb_write_launch"] = lambda: launch_mla_absorb_and_write(
            absorb, q, impl.W_UK_T, impl._w_uk_state, step.kv_c, step.k_pe, state, impl.k_scale)
    if absorb is not None:
        parts["absorb_launch"] = lambda: launch_mla_absorb(absorb, q, impl.W_UK_T, impl._w_uk_state)
        parts["decode_launch"] = lambda: launch_mla_decode(plan, ql_t, step_plan.q_pe, state, impl._qk_scale_log2,
                                                           impl._v_scale, ql_key, step_plan.q_pe_key)
    else:
        parts["absorb_bmm"] = lambda: torch.bmm(
            q.as_strided(step_plan.q_nope_view, (qs_n, qs_t, qs_d), q.storage_offset()), impl.W_UK_T, out=ql)
        parts["decode_launch"] = lambda: launch_mla_decode(plan, ql_t, q_pe(), state, impl._qk_scale_log2,
                                                           impl._v_scale, ql_key)
    if up_fused:
        parts["reduce_up_launch"] = lambda: launch_mla_up_projection(plan, impl.W_UV, impl._w_uv_state, out)
    else:
        parts["up_bmm"] = lambda: torch.bmm(latent, impl.W_UV, out=up_out())
    parts.update({
        "cache_state_lookup": lambda: impl._caches.get(cache),
        "up_bmm_unfused": lambda: torch.bmm(latent, impl.W_UV, out=up_out()),
        "as_strided_view": up_out,
        "empty_torch_op": lambda: q[:, :, :P],
    })
    row = {"case": "mla_host_parts", "backend": "triton_mla", "peer": None, "B": batch, "L": seq_len, "H": H,
           "splits": plan.num_splits, "kernel": plan.kernel, "up_fused": up_fused,
           "triton_absorb": absorb is not None, "write_folded": step_plan.writes_cache}
    for name, fn in parts.items():
        row[name] = _r(_try(log, f"host part {name}", lambda: host_time(fn, calls=100)))
    rows.append(row)


#: ``mla_fp8`` rows per fp8 score-product mode (``MLADecodeConfig.fp8_scores``): what the row's ``products`` says.
FP8_PRODUCTS = {"16-bit": "16-bit (e4m3 pages widened in shared memory)",
                "e4m3": "e4m3 scores (queries quantised per row; P.V 16-bit on widened pages)"}


def run_fp8(rows: list, log, shapes=FP8_SHAPES) -> None:
    """Rows ``mla_fp8``: ``triton_mla`` over fp8 e4m3 pages against our bf16 pages (``us``: graph replay;
    ``eager_us`` beside), one row per score-product mode (:data:`FP8_PRODUCTS`)."""
    for batch, seq_len in shapes:
        res = {}
        for name, kv, scores in (("bf16", "auto", "16-bit"), ("16-bit", "fp8", "16-bit"), ("e4m3", "fp8", "e4m3")):
            step = make_step(batch, seq_len, kv_cache_dtype=kv)
            calls = step.layers * max(1, 8 // step.layers)
            config = dataclasses.replace(default_decode_config(H), fp8_scores=scores)
            fwd = backend_calls(TritonMLABackend, step, decode_config=config)[3]
            res[name] = (_try(log, f"triton_mla {name} graph", lambda: graph_time(fwd, calls)),
                         _try(log, f"triton_mla {name} eager", lambda: event_time(fwd, calls)))
            del step, fwd
            torch.cuda.empty_cache()
        for name in ("16-bit", "e4m3"):
            rows.append({"case": "mla_fp8", "backend": "triton_mla", "peer": "triton_mla_bf16", "B": batch,
                         "L": seq_len, "H": H, "dtype": "bfloat16", "kv_dtype": "fp8", "us": _r(res[name][0]),
                         "peer_us": _r(res["bf16"][0]), "ratio": _ratio(res[name][0], res["bf16"][0]),
                         "eager_us": _r(res[name][1]), "peer_eager_us": _r(res["bf16"][1]),
                         "products": FP8_PRODUCTS[name]})


def run_prefill(rows: list, log) -> None:
    spec = AttentionSpec.mla(H, dtype="bfloat16", block_size=PAGE)
    num_reqs, q_len, ctx = 4, 4096, 8192
    g = torch.Generator(device="cuda").manual_seed(1)
    pages_per = (q_len + ctx) // PAGE
    num_pages = num_reqs * pages_per
    tables = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).view(num_reqs, pages_per).tolist()
    common = build_common_metadata([q_len] * num_reqs, [ctx] * num_reqs, tables, PAGE, "cuda")
    cache = torch.randn(num_pages, PAGE, LKV + R, device="cuda", dtype=torch.bfloat16, generator=g)
    t = num_reqs * q_len
    q = torch.randn(t, H, P + R, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_c = torch.randn(t, LKV, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(t, R, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(H * (P + V), LKV, device="cuda", generator=g) / math.sqrt(LKV)).bfloat16()
    out = torch.empty(t, H, V, device="cuda", dtype=torch.bfloat16)
    flops = 2 * num_reqs * H * (P + R + V) * (q_len * ctx + q_len * (q_len + 1) / 2)
    times, outs = {}, {}
    for name in available_prefill_kernels(DeviceInfo.current(), torch.bfloat16):
        try:
            meta = TritonMLAMetadataBuilder(spec, "cuda", prefill_backend=name).build(common)
            impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=w)
            impl.process_weights_after_loading()
            fn = lambda: impl.forward(q, kv_c, k_pe, cache, meta, out)  # noqa: E731
            times[name] = event_time(fn, 3, reps=3)
            outs[name] = out.clone()
            log(f"prefill {name}: {times[name]:.0f} us ({flops / times[name] / 1e6:.0f} TFLOP/s attention)")
        except Exception:
            log(f"prefill {name} failed:\n{traceback.format_exc()}")
    peer = next((n for n in ("flash_attn", "flashinfer") if n in times), None)
    for name, us in times.items():
        rows.append({
            "case": "mla_prefill", "backend": f"mla_prefill[{name}]", "peer": f"mla_prefill[{peer}]" if peer else None,
            "B": num_reqs, "L": q_len, "context": ctx, "H": H, "dtype": "bfloat16", "kv_dtype": "auto",
            "us": _r(us), "peer_us": _r(times[peer]) if peer else None, "ratio": _ratio(us, times.get(peer)),
            "TFLOPs": _r(flops / us / 1e6),
            "max_abs_diff_vs_peer": float((outs[name].float() - outs[peer].float()).abs().max()) if peer else None,
        })


def markdown(rows: list) -> str:
    """A short table of the rows."""
    lines = ["| case | mode | B | L | q | kv | ours µs | peer µs | ratio | host µs | peer host µs |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r.get('mode', '')} | {r.get('B')} | {r.get('L')} | {r.get('q_len', '')} | "
                     f"{r.get('kv_dtype')} | {r.get('us')} | {r.get('peer_us')} | {r.get('ratio')} | "
                     f"{r.get('host_us', '')} | {r.get('peer_host_us', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the result rows")
    parser.add_argument("--markdown", help="also write the rows as a markdown table here")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: forward, host, host_parts, fp8")
    parser.add_argument("--shapes", help="forward shapes instead of the default: 'B,L,q;...'")
    parser.add_argument("--prefill", action="store_true", help="also time the MLA prefill per prefill kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))

    def log(msg):
        print(msg, flush=True)

    log(f"device: {DeviceInfo.current().describe()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = Rows(args.out, args.markdown, log)
    rows.save()
    shapes = (tuple(tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")) if args.shapes
              else FORWARD_SHAPES)
    parts = (("forward", lambda r, lg: run_forward(r, lg, shapes)), ("host", run_host), ("host_parts", run_host_parts), ("fp8", run_fp8))
    for name, part in parts:
        if name not in skip:
            _try(log, name, lambda: part(rows, log))
    if args.prefill:
        _try(log, "prefill", lambda: run_prefill(rows, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
