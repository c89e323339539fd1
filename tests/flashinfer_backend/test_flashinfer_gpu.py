"""The FlashInfer backend on a GPU, against the float64 oracle (`pytest -m gpu`; skipped without CUDA or flashinfer).

FlashInfer JIT-compiles a kernel module per (dtypes, head size, window on/off, soft-cap on/off, fa2/fa3), each
tens of seconds, so the configs here are few and share modules; a module-scoped fixture builds them all first in one
parallel build (:func:`attnbackends.flashinfer.precompile`):

- bf16, head 128 (fa2 decode + fa3 prefill: the H100 production path and the benchmark's config): decode, prefill,
  chunked prefill, mixed, padded, random, MQA, cascade, CUDA-graph capture/replay, no-sync;
- fp16, head 64, fp8 e4m3 cache (fa2 for both parts): the conformance fp8 case, a large mixed batch, CUDA graphs;
- fp16, head 64, fp8 e5m2 cache with sliding window and soft-cap (fa2): mixed batches through both parts;
- fp16, head 64, 4 query heads on 4 KV heads (no grouping: FlashInfer's CUDA-core decode kernel): mixed batches.

Each of these also re-plans a run of decode batches with :mod:`attnbackends.ops.flashinfer.fast_plan` and checks the
result bit for bit against a builder that calls ``plan()`` every time.
"""

import dataclasses
import logging
import time

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.flashinfer import FlashInferBackend, FlashInferMetadataBuilder, paged_kv_plan_inputs, precompile
from attnbackends.compat import flashinfer_installed
from attnbackends.flashinfer.cascade import CascadePolicy
from attnbackends.ops.quant import dequantize_from_cache
from attnbackends.testing import (
    SequenceShape,
    assert_close_to_oracle,
    check_backend_on_batch,
    conformance_cases,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed"),
]

logger = logging.getLogger(__name__)
DEVICE = "cuda"
H64 = dict(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16)
H128 = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
MIXED = (
    SequenceShape(1, 0), SequenceShape(1, 16), SequenceShape(1, 53), SequenceShape(1, 300),
    SequenceShape(17, 0), SequenceShape(7, 31), SequenceShape(40, 100),
)
SPECS = {
    "h128": AttentionSpec(**H128),
    "fp8_e4m3": AttentionSpec(**H64, kv_cache_dtype="fp8_e4m3"),
    "fp8_e5m2_window_softcap": AttentionSpec(**H64, kv_cache_dtype="fp8_e5m2", sliding_window=11, logits_soft_cap=5.0),
    "h64_mha": AttentionSpec(**{**H64, "num_kv_heads": 4}),
}


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    if not (torch.cuda.is_available() and flashinfer_installed()):
        return
    t0 = time.perf_counter()
    try:
        names = precompile(SPECS.values(), builder_cls=FlashInferMetadataBuilder, cascade=True)
    except Exception as exc:  # the kernels then compile (and fail, if they must) in the tests that use them
        print(f"\nflashinfer precompile failed: {type(exc).__name__}: {exc}")
        return
    print(f"\nflashinfer precompile: {len(names)} modules in {time.perf_counter() - t0:.0f} s")


def test_device_reports_supported():
    for spec in SPECS.values():
        assert FlashInferBackend.not_supported_reasons(spec, DeviceInfo.current()) == []


H128_CASES = [
    c for c in conformance_cases("bfloat16", 128, 16)
    if c.name.split("-")[0] in ("decode", "prefill", "chunked_prefill", "mixed", "mixed_padded", "random_mix", "mqa")
]
FP8_CASES = [c for c in conformance_cases("float16", 64, 16) if c.name.split("-")[0] == "fp8_e4m3"]


@pytest.mark.parametrize("case", H128_CASES + FP8_CASES, ids=str)
def test_conformance(case):
    check_backend_on_batch(FlashInferBackend, case.batch(DEVICE))


@pytest.mark.parametrize("name", ["h128", "fp8_e4m3", "fp8_e5m2_window_softcap", "h64_mha"])
def test_large_mixed_batch(name):
    spec = SPECS[name]
    batch = make_random_batch(spec, MIXED, seed=3, device=DEVICE, pad_tokens=5, logit_magnitude=3.0)
    check_backend_on_batch(FlashInferBackend, batch)


# Decode batches of changing size and length, a mixed batch in between (its decode part is re-planned too).
REPLAN_STEPS = (
    ((1, 5), (1, 40), (1, 17), (1, 100)),
    ((1, 300), (1, 1), (1, 64)),
    ((1, 0), (1, 16), (1, 700), (1, 33), (1, 2), (1, 90), (1, 15)),
    tuple((s.query_len, s.context_len) for s in MIXED),
    ((1, 1000),),
    ((1, 5), (1, 40), (1, 17), (1, 100)),
)


@pytest.mark.parametrize("name", list(SPECS))
def test_replanned_decode_equals_plan_bit_for_bit(name):
    """A builder that re-plans its decode wrapper (fast_plan), the same gathering page ids on the GPU
    (host_gather_max_pages=0) and one that calls plan() every step: the same plan info from FlashInfer's scheduler
    and bitwise equal outputs, batch after batch; all close to the oracle."""
    spec = SPECS[name]
    fast = FlashInferMetadataBuilder(spec, DEVICE)
    device_gather = FlashInferMetadataBuilder(spec, DEVICE, host_gather_max_pages=0)
    slow = FlashInferMetadataBuilder(spec, DEVICE, fast_plan=False)
    for step, shapes in enumerate(REPLAN_STEPS):
        batch = make_random_batch(spec, [SequenceShape(q, c) for q, c in shapes], seed=40 + step, device=DEVICE)
        impl = FlashInferBackend.get_impl_cls()(spec, k_scale=batch.k_scale, v_scale=batch.v_scale)
        outputs, plan_infos = [], []
        for builder in (fast, device_gather, slow):
            meta = builder.build(batch.common)
            out = batch.new_output()  # NaN-poisoned
            impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, out)
            outputs.append(out)
            plan_infos.append(list(meta.decode_wrapper._plan_info))
        for i in (1, 2):
            assert plan_infos[0] == plan_infos[i], f"step {step}: plan info differs (builder {i})"
            assert torch.equal(outputs[0], outputs[i]), f"step {step}: outputs differ (builder {i})"
        n = batch.num_actual_tokens
        tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
        assert_close_to_oracle(outputs[0][:n], oracle_attention(batch), tol, what=f"re-planned step {step}")
    assert fast.decode_replan_status == {"eager": "replanned"}, fast.decode_replan_status
    assert device_gather.decode_replan_status == {"eager": "replanned"}
    assert slow.decode_replan_status == {"eager": "disabled (fast_plan=False)"}


def _cpu_test_module():
    """tests/flashinfer_backend/test_flashinfer_cpu.py (its shared-prefix batch builder), loaded by path: the folder is
    not a package and is not always on sys.path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name("test_flashinfer_cpu.py")
    module_spec = importlib.util.spec_from_file_location("_flashinfer_cpu_tests", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_cascade():
    cpu_tests = _cpu_test_module()
    CASCADE_SHAPES, shared_prefix_batch = cpu_tests.CASCADE_SHAPES, cpu_tests.shared_prefix_batch

    spec = SPECS["h128"]
    batch = shared_prefix_batch(spec, CASCADE_SHAPES, shared_blocks=17, seed=6, device=DEVICE)
    builder = FlashInferMetadataBuilder(spec, DEVICE, cascade_policy=CascadePolicy(enabled=True))
    meta = builder.build(batch.common, common_prefix_len=17 * 16)
    assert meta.cascade_wrapper is not None and meta.cascade_shared_blocks == 17
    impl = FlashInferBackend.get_impl_cls()(spec)
    out = batch.new_output()
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, out)
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what="cascade")


@pytest.mark.parametrize("name", ["h128", "fp8_e4m3"])
def test_cuda_graph_capture_and_replay_with_new_seq_lens(name):
    spec = SPECS[name]
    num_blocks = 96
    builder = FlashInferMetadataBuilder(spec, DEVICE, max_num_reqs=8, max_model_len=1024)
    scales = (0.02, 0.03) if spec.is_fp8_kv_cache else (1.0, 1.0)  # fixed: the captured layer keeps its scales
    impl = FlashInferBackend.get_impl_cls()(spec, k_scale=scales[0], v_scale=scales[1])

    def batch_for(contexts, seed):
        return make_random_batch(spec, [SequenceShape(1, c) for c in contexts], seed=seed, device=DEVICE,
                                 num_blocks=num_blocks, fp8_scales=scales if spec.is_fp8_kv_cache else None)

    first = batch_for((5, 40, 17, 100), 20)
    # Static inputs: the graph replays on these addresses; each step copies its batch into them.
    query, key, value = first.query.clone(), first.key.clone(), first.value.clone()
    kv_cache, slots = first.kv_cache.clone(), first.common.slot_mapping.clone()
    output = first.new_output()
    meta = builder.build_for_cudagraph_capture(dataclasses.replace(first.common, slot_mapping=slots))
    assert meta.cuda_graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl.forward(query, key, value, kv_cache, meta, output)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, key, value, kv_cache, meta, output)

    for seed, contexts in ((21, (300, 1, 64, 31)), (22, (15, 16, 17, 700)), (23, (5, 40, 17, 100))):
        batch = batch_for(contexts, seed)
        query.copy_(batch.query)
        key.copy_(batch.key)
        value.copy_(batch.value)
        kv_cache.copy_(batch.kv_cache)
        slots.copy_(batch.common.slot_mapping)
        step = builder.build(dataclasses.replace(batch.common, slot_mapping=slots))
        assert step.cuda_graph and step.decode_wrapper is meta.decode_wrapper
        assert builder.decode_replan_status == {"graph 4": "replanned"}, builder.decode_replan_status
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        tol = tolerance_for(spec.torch_dtype)
        assert_close_to_oracle(output, oracle_attention(batch), tol, what=f"replay with contexts {contexts}")
        new_slots = batch.common.slot_mapping.cpu()
        stored = kv_cache.cpu()[new_slots // spec.block_size, 0, new_slots % spec.block_size]
        stored = dequantize_from_cache(stored, torch.float64, scales[0])
        fp8 = spec.is_fp8_kv_cache
        torch.testing.assert_close(stored, batch.key.cpu().double(), rtol=0.13 if fp8 else 0.0,
                                   atol=1e-3 * scales[0] if fp8 else 0.0, msg="the replay did not write the keys")


def test_no_host_device_sync_in_translation_and_forward():
    spec = SPECS["h128"]
    batch = make_random_batch(spec, MIXED, seed=4, device=DEVICE)
    builder = FlashInferMetadataBuilder(spec, DEVICE)
    device_gather = FlashInferMetadataBuilder(spec, DEVICE, host_gather_max_pages=0)
    impl = FlashInferBackend.get_impl_cls()(spec)
    meta = builder.build(batch.common)
    out = batch.new_output()
    cache = batch.kv_cache.clone()
    impl.forward(batch.query, batch.key, batch.value, cache, meta, out)  # first call validates arguments
    device_gather.build(batch.common)
    torch.cuda.synchronize()
    c = batch.common
    torch.cuda.set_sync_debug_mode("error")
    try:
        # the page ids gathered on the GPU (no host copy of the table), then by both builders
        paged_kv_plan_inputs(c.query_start_loc_cpu, c.seq_lens_cpu, c.block_table, spec.block_size, pin_memory=True)
        device_gather.build(batch.common)
        meta = builder.build(batch.common)  # re-planned (fast_plan)
        impl.forward(batch.query, batch.key, batch.value, cache, meta, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert_close_to_oracle(out[: c.num_actual_tokens], oracle_attention(batch), tolerance_for(spec.torch_dtype))
