"""Layer mask kinds (non-causal over a cache, block-causal, causal plus bidirectional spans, two-sided windows,
custom masks): the spec and batch checks, and the reference backend against the float64 oracle under each kind's
visibility written out position by position."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnbackends import AttentionSpec
from attnbackends.masks import check_spans, dense_visibility, with_spans
from attnbackends.metadata import build_common_metadata
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.spec import AttentionMask
from attnbackends.testing import SequenceShape
from attnbackends.testing.masks import check_backend_on_masked_batch, expected_visibility, make_masked_batch

# decode on context, a chunk on context, a fresh prompt: pages of 4 tokens, so windows and spans cross pages
SHAPES = [SequenceShape(1, 13), SequenceShape(7, 10), SequenceShape(9, 0)]
# per request: a span in the cached context reaching into the chunk, a span the chunk splits (ends past seq_len),
# a span inside the fresh prompt
SPANS = [[(2, 6), (9, 14)], [(3, 12), (15, 22)], [(2, 5), (6, 9)]]

MASKS = {
    "non_causal": AttentionMask(kind="non_causal"),
    "non_causal_window": AttentionMask(kind="non_causal", window=(3, 2)),
    "block_causal": AttentionMask(kind="block_causal", block_len=3),
    "block_causal_window": AttentionMask(kind="block_causal", block_len=4, window=(5, 1)),
    "causal_spans": AttentionMask(kind="causal_spans"),
    "causal_spans_window": AttentionMask(kind="causal_spans", window=(4, 3)),
    "causal_window": AttentionMask(window=(2, 0)),
    "custom": AttentionMask(kind="custom"),
}


def spec_for(mask, dtype="float32", **kw):
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4, dtype=dtype, mask=mask, **kw)


@pytest.mark.parametrize("name", list(MASKS))
def test_reference_serves_every_kind_against_the_oracle(name):
    spec = spec_for(MASKS[name])
    masked = make_masked_batch(spec, SHAPES, seed=3, spans=SPANS if "spans" in name else None)
    check_backend_on_masked_batch(ReferenceBackend, masked)


@pytest.mark.parametrize("name", list(MASKS))
def test_dense_visibility_matches_the_definition_in_words(name):
    spec = spec_for(MASKS[name])
    for i, shape in enumerate(SHAPES):
        spans = SPANS[i] if "spans" in name else ()
        custom = torch.rand(shape.query_len, shape.seq_len) < 0.5 if name == "custom" else None
        got = dense_visibility(spec, torch.arange(shape.context_len, shape.seq_len), shape.seq_len, spans=spans,
                               custom=custom)
        assert torch.equal(got, expected_visibility(spec, shape, spans, custom))


def test_each_kind_differs_from_causal_on_these_shapes():
    """The cases can fail: every kind's visibility differs from the causal one somewhere."""
    causal = spec_for(AttentionMask())
    for name, mask in MASKS.items():
        if name in ("custom",):
            continue
        spec = spec_for(mask)
        assert any(not torch.equal(expected_visibility(spec, s, SPANS[i] if "spans" in name else ()),
                                   expected_visibility(causal, s)) for i, s in enumerate(SHAPES)), name


def test_a_causal_layer_sees_a_window_as_sliding_window():
    assert spec_for(AttentionMask(window=(4, 0))).window == AttentionSpec(
        num_heads=4, num_kv_heads=2, head_size=16, sliding_window=5).window


@pytest.mark.parametrize("mask, match", [
    (dict(kind="block_causal"), "block_len"),
    (dict(kind="non_causal", block_len=4), "block_len"),
    (dict(window=(-1, 0)), "window"),
    (dict(kind="non_causal", window=(2, -3)), "window"),
    (dict(window=(2, 3)), "causal"),
    (dict(kind="diagonal"), "kind"),
])
def test_bad_masks_are_value_errors_naming_the_field(mask, match):
    with pytest.raises(ValueError, match=match):
        AttentionMask(**mask)


def test_mask_on_an_encoder_or_beside_sliding_window_is_refused():
    with pytest.raises(ValueError, match="decoder"):
        AttentionSpec(num_heads=2, num_kv_heads=2, head_size=16, attn_type="encoder_only",
                      mask=AttentionMask(kind="non_causal"))
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSpec(num_heads=2, num_kv_heads=2, head_size=16, sliding_window=8, mask=AttentionMask(window=(3, 0)))


@pytest.mark.parametrize("spans, match", [
    ([[(3, 2)]], "out of range"),
    ([[(-1, 2)]], "out of range"),
    ([[(0, 4), (3, 6)]], "overlaps"),
    ([[(5, 8), (0, 2)]], "overlaps"),
    ([[(0, 2)], [(1, 2)]], "requests"),
    ([[(0, 2.5)]], "int"),
])
def test_bad_spans_are_value_errors(spans, match):
    common = build_common_metadata([4], [2], [[0, 1]], 4)
    with pytest.raises(ValueError, match=match):
        with_spans(common, spans)


def test_batch_mask_data_must_fit_the_layer_kind():
    spec = spec_for(AttentionMask())
    masked = make_masked_batch(spec_for(MASKS["causal_spans"]), SHAPES, spans=SPANS)
    builder = ReferenceBackend.get_builder_cls()(spec, "cpu")
    with pytest.raises(ValueError, match="causal_spans"):
        builder.build(masked.batch.common)
    custom = spec_for(MASKS["custom"])
    plain = make_masked_batch(spec_for(MASKS["non_causal"]), SHAPES).batch.common
    with pytest.raises(ValueError, match="custom mask"):
        ReferenceBackend.get_builder_cls()(custom, "cpu").build(plain)


def test_causal_metadata_for_a_non_causal_layer_is_refused_with_the_fix():
    spec = spec_for(AttentionMask())
    common = build_common_metadata([4], [2], [[0, 1]], 4, causal=False)
    with pytest.raises(ValueError, match="kind='non_causal'"):
        ReferenceBackend.get_builder_cls()(spec, "cpu").build(common)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_spans_property_reference_equals_oracle(data):
    """Random chunk splits and spans: the reference equals the oracle, and a span's queries see its keys."""
    seed = data.draw(st.integers(0, 10_000))
    rng = random.Random(seed)
    shapes = [SequenceShape(rng.randint(1, 8), rng.randint(0, 12)) for _ in range(rng.randint(1, 3))]
    spans = [check_spans([random_spans_for(rng, s.seq_len)], 1)[0] for s in shapes]
    masked = make_masked_batch(spec_for(MASKS["causal_spans"]), shapes, seed=seed, spans=spans)
    check_backend_on_masked_batch(ReferenceBackend, masked)


def random_spans_for(rng, seq_len):
    from attnbackends.testing.masks import random_spans

    return random_spans(rng, seq_len, past_end=4)


def test_backends_declare_the_kinds_they_serve_and_explain_the_rest():
    from attnbackends.flash_attn.backend import FlashAttnBackend
    from attnbackends.flashinfer.backend import FlashInferBackend
    from attnbackends.mla.backends import TritonMLABackend

    def reasons(backend, mask):
        return " ".join(backend.mask_reasons(spec_for(mask)))

    assert not reasons(FlashInferBackend, MASKS["custom"]) and not reasons(FlashInferBackend, MASKS["non_causal"])
    assert "ignored" in reasons(FlashInferBackend, MASKS["non_causal_window"])  # window_right
    assert "block" in reasons(FlashInferBackend, MASKS["block_causal"])
    assert not reasons(FlashAttnBackend, MASKS["non_causal_window"])
    assert "flash-attn" in reasons(FlashAttnBackend, MASKS["causal_spans"])
    mla = AttentionSpec.mla(num_heads=4, mask=AttentionMask(kind="non_causal"))
    assert any("causal only" in r for r in TritonMLABackend.spec_reasons(mla))
    assert not ReferenceBackend.mask_reasons(spec_for(MASKS["custom"]))
    from attnbackends.triton.backend import TritonAttentionBackend

    assert not reasons(TritonAttentionBackend, MASKS["custom"])  # the unified kernel reads the packed bits


def test_explain_names_the_reason_a_backend_declines_a_mask():
    from attnbackends import explain

    text = str(explain(spec_for(MASKS["block_causal_window"], dtype="bfloat16")))
    assert "mask kind 'block_causal' not supported" in text and "FlashInfer has no block-causal mask" in text
