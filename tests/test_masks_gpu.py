"""Layer mask kinds on the GPU (`pytest -m gpu`): every backend that claims a kind against the float64 oracle at
realistic shapes (head 128, GQA 32/8, pages of 16, bf16 and fp8 pages), and Triton decodes with spans, a
non-causal mask and custom bit masks replayed from a CUDA graph with new lengths, spans and bits."""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.masks import with_custom_masks, with_spans
from attnbackends.selection.registry import get_backend_class as get_backend
from attnbackends.spec import AttentionMask
from attnbackends.testing import SequenceShape, make_random_batch
from attnbackends.testing.masks import check_backend_on_masked_batch, expected_visibility, make_masked_batch
from attnbackends.testing.oracle import oracle_attention
from attnbackends.testing.tolerances import assert_close_to_oracle, tolerance_for
from attnbackends.testing.cuda_graphs import capture_forward

pytestmark = pytest.mark.gpu

MASKS = {
    "non_causal": AttentionMask(kind="non_causal"),
    "non_causal_window": AttentionMask(kind="non_causal", window=(127, 64)),
    "block_causal": AttentionMask(kind="block_causal", block_len=32),
    "causal_spans": AttentionMask(kind="causal_spans"),
    "causal_spans_window": AttentionMask(kind="causal_spans", window=(255, 40)),
    "custom": AttentionMask(kind="custom"),
}
# decodes on long context, a chunk that splits spans, a fresh prompt with an image span
SHAPES = [SequenceShape(1, 900), SequenceShape(1, 333), SequenceShape(257, 700), SequenceShape(300, 0)]
SPANS = [[(100, 356), (880, 901)], [(300, 334)], [(600, 856), (900, 1100)], [(20, 276)]]


def _spec(mask, kv_cache_dtype="auto"):
    return AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16",
                         kv_cache_dtype=kv_cache_dtype, mask=mask)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flash_attn"])
def test_backends_serve_the_kinds_they_claim(backend, name, kv):
    spec = _spec(MASKS[name], kv)
    cls = get_backend(backend)
    reasons = cls.not_supported_reasons(spec, DeviceInfo.current(torch.device("cuda")))
    if reasons:
        pytest.skip(f"{backend} declines: {'; '.join(reasons)}")
    masked = make_masked_batch(spec, SHAPES, seed=7, device="cuda", spans=SPANS if "spans" in name else None)
    check_backend_on_masked_batch(cls, masked)


@pytest.mark.parametrize("name", ["causal_spans", "non_causal"])
def test_triton_masked_decodes_replay_from_a_cuda_graph(name):
    spec = _spec(MASKS[name])
    cls = get_backend("triton")
    shapes = [SequenceShape(1, c) for c in (700, 64, 2000, 15)]
    spans = [[(600, 701)], [(10, 40)], [(1990, 2010)], []] if name == "causal_spans" else None
    first = make_masked_batch(spec, shapes, seed=1, device="cuda", spans=spans, num_blocks=400).batch
    builder = cls.get_builder_cls()(spec, "cuda", max_num_reqs=len(shapes))
    impl = cls.get_impl_cls()(spec)
    static = first.common
    static = dataclasses.replace(static, query_start_loc=static.query_start_loc.clone(),
                                 seq_lens=static.seq_lens.clone(), block_table=static.block_table.clone(),
                                 slot_mapping=static.slot_mapping.clone())
    if spans is not None:
        static = with_spans(static, spans)
    query, key, value, kv_cache = (t.clone() for t in (first.query, first.key, first.value, first.kv_cache))
    output = first.new_output()
    meta = builder.build_for_cudagraph_capture(static)
    graph = capture_forward(lambda: impl.forward(query, key, value, kv_cache, meta, output))
    for seed, contexts in enumerate([(900, 30, 1500, 200), (120, 700, 40, 1800)], start=2):
        shapes = [SequenceShape(1, c) for c in contexts]
        new_spans = [[(max(0, c - 50), c + 1)] for c in contexts] if spans is not None else None
        batch = make_random_batch(spec, shapes, seed=seed, device="cuda", num_blocks=400)
        new = batch.common if new_spans is None else with_spans(batch.common, new_spans)
        for dst, src in ((query, batch.query), (key, batch.key), (value, batch.value), (kv_cache, batch.kv_cache),
                         (static.query_start_loc, new.query_start_loc), (static.seq_lens, new.seq_lens),
                         (static.block_table[:, : new.block_table.shape[1]], new.block_table),
                         (static.slot_mapping, new.slot_mapping)):
            dst.copy_(src)
        if new_spans is not None:
            static.masks.span_key_end.copy_(new.masks.span_key_end)
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        allowed = [expected_visibility(spec, s, new_spans[i] if new_spans else ()) for i, s in enumerate(shapes)]
        assert_close_to_oracle(output[: batch.num_actual_tokens], oracle_attention(batch, allowed),
                               tolerance_for(spec.torch_dtype, spec.kv_cache_dtype), what=f"graph replay {seed}")


def test_triton_custom_mask_decodes_replay_from_a_cuda_graph():
    """The graph captures the custom mask's packed bits and byte offsets in persistent buffers; each replay's new
    masks (other lengths, so other offsets) are copied into them, as an engine would."""
    spec = _spec(MASKS["custom"])
    cls = get_backend("triton")
    shapes = [SequenceShape(1, c) for c in (700, 64, 2000, 15)]
    first = make_masked_batch(spec, shapes, seed=1, device="cuda", num_blocks=400, custom_density=0.3).batch
    builder = cls.get_builder_cls()(spec, "cuda", max_num_reqs=len(shapes))
    impl = cls.get_impl_cls()(spec)
    static = first.common
    bits = torch.zeros(4096, dtype=torch.uint8, device="cuda")  # room for any replay's masks below
    bits[: static.masks.custom_mask.numel()].copy_(static.masks.custom_mask)
    static = dataclasses.replace(
        static, query_start_loc=static.query_start_loc.clone(), seq_lens=static.seq_lens.clone(),
        block_table=static.block_table.clone(), slot_mapping=static.slot_mapping.clone(),
        masks=dataclasses.replace(static.masks, custom_mask=bits,
                                  custom_mask_indptr=static.masks.custom_mask_indptr.clone()))
    query, key, value, kv_cache = (t.clone() for t in (first.query, first.key, first.value, first.kv_cache))
    output = first.new_output()
    meta = builder.build_for_cudagraph_capture(static)
    graph = capture_forward(lambda: impl.forward(query, key, value, kv_cache, meta, output))
    for seed, contexts in enumerate([(900, 30, 1500, 200), (120, 700, 40, 1800)], start=2):
        shapes = [SequenceShape(1, c) for c in contexts]
        gen = torch.Generator().manual_seed(seed)
        customs = [torch.rand(1, s.seq_len, generator=gen) < 0.3 for s in shapes]
        for m in customs:
            m[0, -1] = True
        batch = make_random_batch(spec, shapes, seed=seed, device="cuda", num_blocks=400)
        new = with_custom_masks(batch.common, customs)
        for dst, src in ((query, batch.query), (key, batch.key), (value, batch.value), (kv_cache, batch.kv_cache),
                         (static.query_start_loc, new.query_start_loc), (static.seq_lens, new.seq_lens),
                         (static.block_table[:, : new.block_table.shape[1]], new.block_table),
                         (static.slot_mapping, new.slot_mapping),
                         (bits[: new.masks.custom_mask.numel()], new.masks.custom_mask),
                         (static.masks.custom_mask_indptr, new.masks.custom_mask_indptr)):
            dst.copy_(src)
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        allowed = [expected_visibility(spec, s, custom=customs[i]) for i, s in enumerate(shapes)]
        assert_close_to_oracle(output[: batch.num_actual_tokens], oracle_attention(batch, allowed),
                               tolerance_for(spec.torch_dtype, spec.kv_cache_dtype), what=f"graph replay {seed}")
