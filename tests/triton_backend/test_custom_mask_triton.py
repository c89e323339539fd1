"""Custom bit masks (kind ``custom``) on the Triton unified kernel against the float64 oracle (interpreted on the
CPU at tiny shapes): random masks with GQA and pages of 16 on decodes over cached context, a chunk on cached context
and a fresh prompt, a two-sided window over them, split-KV decodes; a cleared bit must change the row it belongs to;
and the kernels that decline custom masks (prefill kernels, the balanced decode schedule) with their reasons."""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.masks import with_custom_masks
from attnbackends.platform import DeviceInfo
from attnbackends.spec import AttentionMask
from attnbackends.testing import SequenceShape
from attnbackends.testing.masks import MaskedBatch, check_backend_on_masked_batch, make_masked_batch
from attnbackends.testing.oracle import oracle_attention
from attnbackends.testing.tolerances import assert_close_to_oracle, tolerance_for
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadataBuilder
from attnbackends.triton.choices import MaskPath, PagedPrefill, PrefillSplit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# decodes first (over 37 and 20 cached keys), then a chunk of 20 on 30 cached keys and a fresh prompt of 18: rows
# of 37..50 bits, so rows start mid-byte
SHAPES = [SequenceShape(1, 37), SequenceShape(1, 20), SequenceShape(20, 30), SequenceShape(18, 0)]
FIRST_TOKEN = [sum(s.query_len for s in SHAPES[:i]) for i in range(len(SHAPES))]


def spec_for(mask=AttentionMask(kind="custom"), **kw):
    kw.setdefault("dtype", "float16")
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, block_size=16, mask=mask, **kw)


@pytest.mark.parametrize("window", [None, (9, 5)])
def test_triton_serves_random_custom_masks(window):
    spec = spec_for(AttentionMask(kind="custom", window=window))
    assert not TritonAttentionBackend.spec_reasons(spec)
    masked = make_masked_batch(spec, SHAPES, seed=13, device=DEVICE, pad_tokens=2, custom_density=0.5)
    output = check_backend_on_masked_batch(TritonAttentionBackend, masked)
    n = masked.batch.num_actual_tokens
    assert bool(torch.isnan(output[n:].float()).all()), "padding rows were written"


def test_split_kv_decodes_with_custom_masks():
    """Decodes split over KV segments (merged in the launch): every segment reads its own tiles' bits."""
    spec = spec_for()
    shapes = [SequenceShape(1, 260), SequenceShape(1, 150), SequenceShape(1, 7)]
    masked = make_masked_batch(spec, shapes, seed=4, device=DEVICE, custom_density=0.4)
    builder = TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced")  # a workspace for the partials
    assert builder.decode_scheduler is None  # custom masks decline the balanced schedule
    builder.num_sms = 64  # as many SMs as a GPU: the decodes split
    meta = builder.build(masked.batch.common)
    assert meta.plan.num_kv_splits > 1, meta.plan.grid
    impl = TritonAttentionBackend.get_impl_cls()(spec)
    batch = masked.batch
    output = batch.new_output()
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, output)
    assert_close_to_oracle(output[: batch.num_actual_tokens], oracle_attention(batch, masked.allowed),
                           tolerance_for(spec.torch_dtype, spec.kv_cache_dtype), what="split-KV custom decodes")


def _with_bit_cleared(masked: MaskedBatch, request: int, row: int, key: int) -> MaskedBatch:
    customs = [a.clone() for a in masked.allowed]  # no window: the written-out visibility is the custom mask itself
    assert customs[request][row, key]
    customs[request][row, key] = False
    batch = dataclasses.replace(masked.batch, common=with_custom_masks(masked.batch.common, customs))
    return MaskedBatch(batch, customs)


@pytest.mark.parametrize("request_idx, row, key", [(0, 0, 21), (2, 13, 33)])
def test_a_cleared_bit_changes_its_row(request_idx, row, key):
    """Clearing one visible bit (a decode row; a chunk row, in a tile below its diagonal) changes the oracle's row
    beyond the tolerance, and Triton follows it: a kernel that ignored the bit would fail."""
    spec = spec_for()
    base = make_masked_batch(spec, SHAPES, seed=21, device=DEVICE, custom_density=0.3)
    if not bool(base.allowed[request_idx][row, key]):
        base.allowed[request_idx][row, key] = True
        base = MaskedBatch(dataclasses.replace(base.batch, common=with_custom_masks(base.batch.common, base.allowed)),
                           base.allowed)
    cleared = _with_bit_cleared(base, request_idx, row, key)
    token = FIRST_TOKEN[request_idx] + row
    tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
    before = oracle_attention(base.batch, base.allowed)[token]
    after = oracle_attention(cleared.batch, cleared.allowed)[token]
    assert float((before - after).abs().max()) > 10 * tol.atol, "the cleared bit must matter to its row"
    output = check_backend_on_masked_batch(TritonAttentionBackend, cleared)
    assert float((output[token].double().cpu() - before).abs().max()) > 5 * tol.atol


def test_tiles_without_set_bits_and_rows_without_keys():
    """Document masks leave whole key tiles without a set bit (skipped before their keys are loaded) beside tiles
    that need them; a row whose bits are all clear has output 0, as in the oracle."""
    spec = spec_for()
    shapes = [SequenceShape(1, 200), SequenceShape(12, 180), SequenceShape(10, 0)]
    masked = make_masked_batch(spec, shapes, seed=8, device=DEVICE)
    decode = torch.zeros(1, 201, dtype=torch.bool)
    decode[0, :10] = True
    decode[0, 190:] = True
    chunk = torch.zeros(12, 192, dtype=torch.bool)
    for t in range(12):
        chunk[t, 100 : 181 + t] = True
    chunk[5] = False
    fresh = masked.allowed[2]
    customs = [decode, chunk, fresh]
    batch = dataclasses.replace(masked.batch, common=with_custom_masks(masked.batch.common, customs))
    output = check_backend_on_masked_batch(TritonAttentionBackend, MaskedBatch(batch, customs))
    assert float(output[1 + 5].abs().max()) == 0.0


def test_custom_mask_batch_with_a_tree_mask_is_refused():
    spec = spec_for(num_speculative_tokens=2)
    shapes = [SequenceShape(3, 20)]
    masked = make_masked_batch(spec, shapes, seed=3, device=DEVICE, tree_parents=[[-1, 0, 0]])
    with pytest.raises(ValueError, match="tree mask"):
        TritonMetadataBuilder(spec, DEVICE).build(masked.batch.common)


def test_custom_masks_decline_the_prefill_kernels_and_the_schedule_with_reasons(fake_h100):
    spec = spec_for(dtype="bfloat16")
    assert not TritonAttentionBackend.spec_reasons(spec)
    choices = TritonMetadataBuilder(spec, "cpu").choices
    assert choices.mask.kernel is MaskPath.UNIFIED_ONLY and "custom" in choices.mask.reason
    assert choices.prefill_split.kernel is PrefillSplit.OFF and "unified kernel only" in choices.prefill_split.reason
    assert choices.paged_prefill.kernel is PagedPrefill.OFF and "unified kernel only" in choices.paged_prefill.reason
    notes = " ".join(TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(9, 0)))
    assert "custom" in notes

