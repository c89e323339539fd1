"""Edge cases every backend that runs here gets right: reference and triton (interpreted), reference_mla and
triton_mla (interpreted), each checked against its oracle (attnbackends.testing / attnbackends.testing.mla).

Fully masked rows: in a causal layer a query at position p always sees key p (itself), and a sliding window of W >= 1
keys includes self, so no causal row is ever empty; non-causal rows see their whole sequence (seq_len >= 1). The one
place a backend meets an empty key set is the merge of partial results over disjoint key sets (split-KV, MLA's
context chunks, cascade), where a side with no keys has lse = -inf: tested directly on merge_attn_states and through
MLA requests without context in a batch with chunked context.
"""

import math

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.ops.merge_attn_states import merge_attn_states
from attnbackends.ops.quant import dequantize_from_cache, fp8_max
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import (
    CaseNotSupported,
    SequenceShape as S,
    assert_close_to_oracle,
    check_backend_on_batch,
    make_random_batch,
    oracle_attention,
    run_backend_on_batch,
    tolerance_for,
)
from attnbackends.triton.backend import TritonAttentionBackend

BS = 16
STANDARD = [pytest.param(ReferenceBackend, id="reference"), pytest.param(TritonAttentionBackend, id="triton")]
MLA = [pytest.param(ReferenceMLABackend, id="reference_mla"), pytest.param(TritonMLABackend, id="triton_mla")]


def spec_of(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=BS)
    return AttentionSpec(**{**base, **kw})


def mla_spec(dtype="float16", kv_cache_dtype="auto"):
    return AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                             dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=BS)


def check(backend, batch):
    try:
        check_backend_on_batch(backend, batch)
    except CaseNotSupported as exc:
        pytest.skip(f"{backend.name}: {exc}")


def check_mla(backend, batch, **kw):
    out, cache = run_mla_backend(backend, batch, **kw)
    n = batch.num_actual_tokens
    assert torch.isfinite(out[:n].float()).all(), f"{backend.name}: non-finite output"
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    assert_close_to_oracle(out[:n], mla_oracle(batch), tol, what=backend.name)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    return out, cache


def assert_cache_untouched_outside_slots(before, after, slots, block_size, slot_dim=1):
    """Every cache slot not in ``slots`` is bitwise unchanged (padding tokens, slot -1, write nothing)."""
    written = torch.zeros(before.shape[0] * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    written = written.view(before.shape[0], block_size)
    b, a = before.cpu(), after.cpu()
    if slot_dim == 1:  # standard [num_blocks, 2, block_size, ...]: compare per slot
        b, a = b.transpose(1, 2), a.transpose(1, 2)
    same = (b.view(torch.uint8) == a.view(torch.uint8)).reshape(*written.shape, -1).all(-1)
    bad = torch.nonzero(~same & ~written)
    assert bad.numel() == 0, f"cache slots {bad[:4].tolist()} changed though no real token maps there"


# -- batch compositions ---------------------------------------------------------------------------------------------
COMPOSITIONS = {
    "one_token": [S(1, 0)],
    "one_decode": [S(1, 37)],
    "no_decodes": [S(5, 0), S(9, 20)],
    "no_prefills": [S(1, 3), S(1, BS), S(1, 2 * BS - 1)],
    "seq_len_1": [S(1, 0), S(1, 0), S(3, 0)],
    "block_multiples": [S(1, BS - 1), S(1, 2 * BS - 1), S(BS, BS), S(BS, 0), S(2 * BS, 0)],
    "context_at_block_multiples": [S(1, BS), S(1, 2 * BS), S(3, BS), S(BS + 1, 2 * BS)],
}


@pytest.mark.parametrize("name", list(COMPOSITIONS))
@pytest.mark.parametrize("backend", STANDARD)
def test_batch_compositions(backend, name):
    check(backend, make_random_batch(spec_of(), COMPOSITIONS[name], seed=11))


@pytest.mark.parametrize("name", ["one_token", "one_decode", "no_decodes", "no_prefills", "context_at_block_multiples"])
@pytest.mark.parametrize("backend", MLA)
def test_mla_batch_compositions(backend, name):
    check_mla(backend, make_random_mla_batch(mla_spec(), COMPOSITIONS[name], seed=12))


# -- sliding window ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", STANDARD)
def test_sliding_window_wider_than_context_equals_no_window(backend):
    shapes = [S(1, 20), S(7, 33)]
    wide = make_random_batch(spec_of(sliding_window=1000), shapes, seed=3)
    check(backend, wide)
    plain = make_random_batch(spec_of(), shapes, seed=3)
    got, _ = run_backend_on_batch(backend, wide)
    want, _ = run_backend_on_batch(backend, plain)
    n = wide.num_actual_tokens
    torch.testing.assert_close(got[:n], want[:n], rtol=0, atol=2e-3)


@pytest.mark.parametrize("backend", STANDARD)
def test_window_of_one_sees_only_itself(backend):
    """W = 1: each row's only visible key is its own; the output is its own value (never an empty row)."""
    batch = make_random_batch(spec_of(sliding_window=1), [S(1, 20), S(6, 9)], seed=4)
    check(backend, batch)
    out, _ = run_backend_on_batch(backend, batch)
    n = batch.num_actual_tokens
    own_v = batch.value[:n].repeat_interleave(2, dim=1)  # 2 query heads per KV head
    torch.testing.assert_close(out[:n].float(), own_v.float(), rtol=0, atol=1e-3)


# -- empty key sets (lse = -inf) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_merge_with_minus_inf_lse_gives_no_nan(impl):
    t, h, d = 3, 2, 16
    g = torch.Generator().manual_seed(0)
    o_a, o_b = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    lse_a = torch.randn(h, t, generator=g)
    lse_b = torch.full((h, t), -math.inf)
    lse_b[:, 1] = 0.5  # token 1: both sides have keys
    lse_a[0, 2] = -math.inf  # token 2, head 0: neither side has keys
    out, out_lse = torch.empty(t, h, d), torch.empty(h, t)
    merge_attn_states(out, o_a, lse_a, o_b, lse_b, output_lse=out_lse, impl=impl)
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    torch.testing.assert_close(out[0], o_a[0])  # b empty: exactly a
    torch.testing.assert_close(out[2, 1], o_a[2, 1])
    assert torch.equal(out[2, 0], torch.zeros(d)) and out_lse[0, 2] == -math.inf  # both empty: 0, lse -inf


@pytest.mark.parametrize("backend", MLA)
def test_mla_request_without_context_next_to_chunked_context(backend):
    """The context-less request's context chunks are empty (lse -inf) and merge to its new-token result."""
    batch = make_random_mla_batch(mla_spec(), [S(1, 5), S(6, 0), S(4, 40)], seed=5, pad_tokens=2)
    kw = dict(builder_kwargs=dict(workspace_tokens=16)) if backend is TritonMLABackend else {}
    check_mla(backend, batch, **kw)


# -- large logits -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", STANDARD)
def test_fp16_large_logits(backend):
    """Queries scaled 300x: logits in the thousands (exp overflows fp16 and fp32 unless the max is subtracted)."""
    batch = make_random_batch(spec_of(), [S(1, 30), S(1, 0), S(8, 17)], seed=6, logit_magnitude=300.0)
    assert float(batch.query.float().abs().max()) < 65504
    check(backend, batch)
    out, _ = run_backend_on_batch(backend, batch)
    assert torch.isfinite(out[: batch.num_actual_tokens].float()).all()


@pytest.mark.parametrize("backend", MLA)
def test_mla_fp16_large_logits(backend):
    batch = make_random_mla_batch(mla_spec(), [S(1, 30), S(5, 0), S(4, 17)], seed=7)
    batch.q = (batch.q.float() * 20.0).to(batch.q.dtype)  # the oracle reads batch.q: it sees the same queries
    out, _ = run_mla_backend(backend, batch)
    n = batch.num_actual_tokens
    assert torch.isfinite(out[:n].float()).all()
    # absorbed decode rounds q_nope @ W_UK_T to fp16: with 20x logits its error grows with them
    tol = tolerance_for(torch.float16)
    assert_close_to_oracle(out[:n], mla_oracle(batch), type(tol)(atol=tol.atol * 10, rtol=tol.rtol * 10), what=backend.name)


# -- fp8 saturation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype,scale", [("fp8_e4m3", 3e-3), ("fp8_e5m2", 2e-5)])
@pytest.mark.parametrize("backend", STANDARD)
def test_fp8_saturation(backend, kv_cache_dtype, scale):
    """Scales so small that many values exceed the fp8 max: writes clamp (never inf/NaN), the oracle clamps too."""
    spec = spec_of(kv_cache_dtype=kv_cache_dtype)
    batch = make_random_batch(spec, [S(1, 20), S(9, 0), S(5, 18)], seed=8, fp8_scales=(scale, scale))
    check(backend, batch)
    _, cache = run_backend_on_batch(backend, batch)
    limit = fp8_max(cache.dtype)
    slots = batch.common.slot_mapping[: batch.num_actual_tokens]
    stored = cache[slots // BS, :, slots % BS].float()  # the new tokens, as written by the backend
    assert torch.isfinite(stored).all(), "fp8 writes overflowed instead of saturating"
    assert bool((stored.abs() == limit).any()), "the test data should saturate"
    assert float(stored.abs().max()) == limit


@pytest.mark.parametrize("backend", MLA)
def test_mla_fp8_saturation(backend):
    spec = mla_spec(kv_cache_dtype="fp8_e4m3")
    batch = make_random_mla_batch(spec, [S(1, 20), S(6, 0), S(4, 18)], seed=9, k_scale=3e-3)
    _, cache = check_mla(backend, batch)
    slots = batch.common.slot_mapping[: batch.num_actual_tokens]
    stored = dequantize_from_cache(cache[slots // BS, slots % BS], torch.float32, 1.0)
    assert torch.isfinite(stored).all() and float(stored.abs().max()) == fp8_max(cache.dtype)


# -- padding ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes", [[S(1, 5), S(1, 16), S(1, 40)], [S(1, 5), S(7, 9)]], ids=["decodes", "mixed"])
@pytest.mark.parametrize("backend", STANDARD)
def test_padding_tokens_leave_output_and_cache_untouched(backend, shapes):
    """A CUDA-graph-padded batch: 5 padding tokens (slot -1, random q/k/v) after the real ones."""
    batch = make_random_batch(spec_of(), shapes, seed=10, pad_tokens=5)
    check(backend, batch)  # includes: output rows past num_actual_tokens stay NaN
    _, cache = run_backend_on_batch(backend, batch)
    assert_cache_untouched_outside_slots(batch.kv_cache, cache, batch.common.slot_mapping, BS, slot_dim=1)


@pytest.mark.parametrize("backend", MLA)
def test_mla_padding_tokens_leave_output_and_cache_untouched(backend):
    batch = make_random_mla_batch(mla_spec(), [S(1, 5), S(1, 16), S(7, 9)], seed=13, pad_tokens=4)
    _, cache = check_mla(backend, batch)
    assert_cache_untouched_outside_slots(batch.kv_cache, cache, batch.common.slot_mapping, BS, slot_dim=0)
