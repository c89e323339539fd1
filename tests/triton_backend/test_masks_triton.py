"""Layer mask kinds on the Triton unified kernel against the float64 oracle (interpreted on the CPU at tiny
shapes): non-causal over the cache, block-causal, causal plus spans, two-sided windows, on decode and prefill rows,
with GQA, pages of 16 that windows and spans cross, chunks that split a span and spans in the cached context; and
the kernels that decline masks (prefill kernels, the balanced decode schedule) with their reasons. Custom masks:
test_custom_mask_triton.py."""

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.platform import DeviceInfo
from attnbackends.spec import AttentionMask
from attnbackends.testing import SequenceShape
from attnbackends.testing.masks import check_backend_on_masked_batch, make_masked_batch
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadataBuilder
from attnbackends.triton.choices import MaskPath, PagedPrefill, PrefillSplit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# decodes first (a decode on context, the decode path), then a chunk on context and a fresh prompt
SHAPES = [SequenceShape(1, 37), SequenceShape(1, 20), SequenceShape(20, 30), SequenceShape(18, 0)]
# a span wholly in the context, a span from the context into the decode token; a span the chunk splits (ends past
# seq_len) and one from the context into the chunk; spans inside the fresh prompt
SPANS = [[(3, 9), (30, 38)], [(5, 21)], [(10, 35), (40, 60)], [(2, 7), (9, 16)]]

MASKS = {
    "non_causal": AttentionMask(kind="non_causal"),
    "non_causal_window": AttentionMask(kind="non_causal", window=(9, 5)),
    "block_causal": AttentionMask(kind="block_causal", block_len=8),
    "block_causal_odd_window": AttentionMask(kind="block_causal", block_len=5, window=(20, 3)),
    "causal_spans": AttentionMask(kind="causal_spans"),
    "causal_spans_window": AttentionMask(kind="causal_spans", window=(12, 4)),
    "causal_window_as_mask": AttentionMask(window=(6, 0)),
}


def spec_for(mask, **kw):
    kw.setdefault("dtype", "float16")
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, mask=mask, **kw)


@pytest.mark.parametrize("name", list(MASKS))
def test_triton_serves_the_kind_against_the_oracle(name):
    spec = spec_for(MASKS[name])
    assert not TritonAttentionBackend.spec_reasons(spec)
    masked = make_masked_batch(spec, SHAPES, seed=11, device=DEVICE, spans=SPANS if "spans" in name else None,
                               pad_tokens=2)
    check_backend_on_masked_batch(TritonAttentionBackend, masked)


def test_spans_layer_with_a_batch_without_spans_is_causal():
    spec = spec_for(MASKS["causal_spans"])
    masked = make_masked_batch(spec, SHAPES, seed=5, device=DEVICE)
    check_backend_on_masked_batch(TritonAttentionBackend, masked)


def test_decode_only_split_kv_with_spans():
    """Decodes split over KV segments (the fused merge), each segment's keys bounded by the rows' intervals."""
    spec = spec_for(MASKS["causal_spans_window"])
    shapes = [SequenceShape(1, 70), SequenceShape(1, 45)]
    masked = make_masked_batch(spec, shapes, seed=2, device=DEVICE, spans=[[(40, 71)], [(10, 30)]])
    builder = TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced")
    assert builder.decode_scheduler is None  # masked layers decline the balanced schedule
    check_backend_on_masked_batch(TritonAttentionBackend, masked, decode_schedule="balanced")


def test_masked_layers_decline_the_prefill_kernels_and_the_schedule_with_reasons(fake_h100):
    spec = spec_for(MASKS["block_causal"], dtype="bfloat16")
    builder = TritonMetadataBuilder(spec, "cpu")
    choices = builder.choices
    assert choices.mask.kernel is MaskPath.UNIFIED_ONLY and "block_causal" in choices.mask.reason
    assert choices.prefill_split.kernel is PrefillSplit.OFF and "unified kernel only" in choices.prefill_split.reason
    assert choices.paged_prefill.kernel is PagedPrefill.OFF and "unified kernel only" in choices.paged_prefill.reason
    notes = " ".join(TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(9, 0)))
    assert "block_causal" in notes
    plain = TritonMetadataBuilder(spec_for(AttentionMask(), dtype="bfloat16"), "cpu").choices
    assert plain.mask.kernel is MaskPath.EVERY_KERNEL
