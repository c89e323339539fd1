"""Per-phase composition on the CPU: reference and Triton (interpreted) as the two phases against the oracle, one
build per step split on views, configuration through AttentionConfig and select(), and the reasons a pair is refused.
A GPU test captures the decode part in a CUDA graph."""

import pytest
import torch

from attnbackends import (
    AttentionConfig,
    AttentionSpec,
    BackendNotSupportedError,
    DeviceInfo,
    explain,
    register_backend,
    select,
    unregister_backend,
)
from attnbackends.selection import PhasedMetadata, parse_phased_name, phased_backend, phased_name
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import (
    SequenceShape,
    assert_close_to_oracle,
    check_backend_on_batch,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16)
MIXED = [SequenceShape(1, 0), SequenceShape(1, 17), SequenceShape(1, 40), SequenceShape(9, 0), SequenceShape(5, 21)]
CPU_TRITON = DeviceInfo.cpu(triton_interpreted=True)


@pytest.mark.parametrize("decode, prefill", [("reference", "triton"), ("triton", "reference")])
@pytest.mark.parametrize("shapes, pad", [
    (MIXED, 0), (MIXED, 3), (MIXED[:3], 2), (MIXED[3:], 0), ([SequenceShape(1, 30)] + MIXED[3:], 1),
], ids=["mixed", "mixed_padded", "decodes_only", "prefills_only", "one_decode"])
def test_two_phases_against_the_oracle(decode, prefill, shapes, pad):
    backend = phased_backend(decode, prefill)
    check_backend_on_batch(backend, make_random_batch(SPEC, shapes, seed=len(shapes) + pad, pad_tokens=pad))


def test_features_through_both_phases():
    spec = SPEC.model_copy(update={"sliding_window": 7, "logits_soft_cap": 4.0, "has_sinks": True})
    check_backend_on_batch(phased_backend("reference", "triton"), make_random_batch(spec, MIXED, seed=11))


def test_one_build_holds_both_parts_as_views():
    backend = phased_backend("reference", "triton")
    batch = make_random_batch(SPEC, MIXED, seed=1, pad_tokens=2)
    meta = backend.get_builder_cls()(SPEC).build(batch.common)
    assert isinstance(meta, PhasedMetadata) and meta.num_decode_tokens == 3 and meta.num_actual_tokens == 17
    common, dec, pre = batch.common, meta.decode.common, meta.prefill.common
    for part, whole in ((dec.seq_lens, common.seq_lens), (dec.block_table, common.block_table),
                        (dec.slot_mapping, common.slot_mapping), (pre.seq_lens, common.seq_lens),
                        (pre.block_table, common.block_table), (pre.slot_mapping, common.slot_mapping)):
        assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert dec.query_start_loc_cpu.tolist() == [0, 1, 2, 3] and pre.query_start_loc_cpu.tolist() == [0, 9, 14]
    assert pre.query_start_loc.tolist() == [0, 9, 14] and (dec.max_seq_len, pre.max_seq_len) == (41, 26)
    assert pre.slot_mapping.shape[0] == common.slot_mapping.shape[0] - 3


def test_capabilities_are_the_intersection():
    backend = phased_backend("reference", "triton")
    assert backend.supported_dtypes == frozenset({"float16", "bfloat16"})
    assert backend.block_size_multiple == 16 and backend.supports_alibi and backend.supports_sinks
    assert backend.name == phased_name("reference", "triton")
    assert parse_phased_name(backend.name) == ("reference", "triton")


def test_configured_per_phase_and_selected():
    config = AttentionConfig(decode_backend="reference", prefill_backend="triton")
    assert select(SPEC, CPU_TRITON, config) is phased_backend("reference", "triton")
    one = AttentionConfig(decode_backend="triton", prefill_backend="triton")
    assert select(SPEC, CPU_TRITON, one).name == "triton"


def test_unset_phase_takes_the_static_choice():
    config = AttentionConfig(prefill_backend="triton")
    result = explain(SPEC, CPU_TRITON, config)
    assert result.requested == phased_name("auto", "triton")
    assert result.chosen == phased_name("reference", "triton")


def test_a_part_that_does_not_fit_is_refused_with_its_reasons():
    config = AttentionConfig(decode_backend="reference", prefill_backend="triton")
    with pytest.raises(BackendNotSupportedError, match=r"prefill \(triton\): needs a CUDA GPU"):
        select(SPEC, DeviceInfo.cpu(triton_interpreted=False), config)
    with pytest.raises(BackendNotSupportedError, match=r"prefill \(triton\): dtype float32 not supported"):
        select(SPEC.model_copy(update={"dtype": "float32"}), CPU_TRITON, config)


def test_layouts_must_agree():
    @register_backend("other_layout")
    class OtherLayout(ReferenceBackend):
        name = "other_layout"
        kv_cache_layout = "[num_blocks, block_size, 2, num_kv_heads, head_size]"

        @classmethod
        def kv_cache_shape(cls, num_blocks, spec):
            return (num_blocks, spec.block_size, 2, spec.num_kv_heads, spec.head_size)

    try:
        reasons = phased_backend("reference", "other_layout").not_supported_reasons(SPEC, CPU_TRITON)
        assert any("KV-cache layouts differ" in r for r in reasons), reasons
    finally:
        unregister_backend("other_layout")
        phased_backend.cache_clear()


@pytest.mark.parametrize("decode, prefill, match", [
    ("triton", "triton", "use that backend itself"),
    ("nope", "triton", "unknown backend 'nope'"),
])
def test_bad_pairs(decode, prefill, match):
    with pytest.raises(ValueError, match=match):
        phased_backend(decode, prefill)


def test_conflicting_config():
    with pytest.raises(ValueError, match="conflicts with decode_backend/prefill_backend"):
        AttentionConfig(backend="triton", prefill_backend="reference")


def test_engine_generates_the_same_tokens_per_phase_as_on_the_reference():
    from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig

    cfg = TinyLlamaConfig()
    prompts = [[3, 5, 7, 11, 13, 17, 19, 23, 29][:n] for n in (9, 2, 5)]
    runs = {}
    for name, config in (("reference", AttentionConfig(backend="reference")),
                         ("phased", AttentionConfig(decode_backend="reference", prefill_backend="reference_copy"))):
        if name == "phased":
            register_backend("reference_copy")(type("ReferenceCopy", (ReferenceBackend,), {"name": "reference_copy"}))
        try:
            engine = PagedEngine(TinyLlama(cfg, seed=0), EngineConfig(max_num_batched_tokens=8), attention_config=config)
            runs[name] = engine.generate(prompts, 4)
        finally:
            if name == "phased":
                unregister_backend("reference_copy")
                phased_backend.cache_clear()
    assert runs["phased"].backend == phased_name("reference", "reference_copy")
    assert runs["phased"].tokens == runs["reference"].tokens
    for a, b in zip(runs["phased"].logits, runs["reference"].logits):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_part_in_a_cuda_graph():
    """Capture a pure-decode step of triton-decode/reference-prefill, replay it on new lengths, compare with the oracle."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    backend = phased_backend("triton", "reference")
    builder = backend.get_builder_cls()(spec, "cuda")
    impl = backend.get_impl_cls()(spec)
    capture = make_random_batch(spec, [SequenceShape(1, c) for c in (900, 40, 300, 7)], seed=1, device="cuda",
                                num_blocks=400)
    kv_cache, out = capture.kv_cache.clone(), capture.new_output()
    q, k, v, common = capture.query.clone(), capture.key.clone(), capture.value.clone(), capture.common
    meta = builder.build_for_cudagraph_capture(common)
    impl.forward(q, k, v, kv_cache, meta, out)  # warm-up compiles outside the capture
    assert_close_to_oracle(out, oracle_attention(capture), tolerance_for(spec.torch_dtype), what="eager decode")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(q, k, v, kv_cache, meta, out)
    replay = make_random_batch(spec, [SequenceShape(1, c) for c in (15, 700, 64, 299)], seed=2, device="cuda",
                               num_blocks=400)
    kv_cache.copy_(replay.kv_cache)
    for dst, src in ((q, replay.query), (k, replay.key), (v, replay.value),
                     (common.slot_mapping, replay.common.slot_mapping)):
        dst.copy_(src)
    common.seq_lens.copy_(replay.common.seq_lens)
    common.block_table.zero_()
    common.block_table[:, : replay.common.block_table.shape[1]].copy_(replay.common.block_table)
    out.fill_(float("nan"))
    graph.replay()
    assert_close_to_oracle(out, oracle_attention(replay), tolerance_for(spec.torch_dtype), what="replayed decode")
