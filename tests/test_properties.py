"""Property tests (hypothesis): over random specs and batch compositions, every backend that accepts the spec on this
device (``not_supported_reasons`` empty; Triton under the interpreter) agrees with the oracle, leaves padding rows
untouched and writes the new tokens' K/V to their slots. The number of cases run is printed at the end of the run
(tests/conftest.py)."""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import SequenceShape, assert_close_to_oracle, check_backend_on_batch, make_random_batch
from attnbackends.testing import tolerance_for
from attnbackends.triton.backend import TritonAttentionBackend

CPU = DeviceInfo.current(torch.device("cpu"))
COMMON = dict(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def shapes(draw, block_size: int, with_context: bool = True, max_seqs: int = 4):
    """1..max_seqs requests, decodes first; lengths drawn from the page edges or at random."""
    n = draw(st.integers(1, max_seqs))
    out = []
    for _ in range(n):
        q = draw(st.sampled_from([1, 1, 2, block_size - 1, block_size, block_size + 1]) | st.integers(1, 24))
        c = draw(st.sampled_from([0, 1, block_size - 1, block_size, 2 * block_size]) | st.integers(0, 48)) if with_context else 0
        out.append(SequenceShape(q, c))
    return sorted(out, key=lambda s: s.query_len > 1)


@st.composite
def standard_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * group
    encoder = draw(st.sampled_from([False, False, False, True]))  # encoder_only: no cache, non-causal
    kw = dict(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=draw(st.sampled_from([32, 64])),
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float16", "bfloat16", "float32"])),
        kv_cache_dtype="auto" if encoder else draw(st.sampled_from(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])),
        block_size=draw(st.sampled_from([16, 32])),
        attn_type="encoder_only" if encoder else "decoder",
    )
    if not encoder and draw(st.booleans()):
        kw["sliding_window"] = draw(st.integers(1, 40))
    feature = draw(st.sampled_from([None, None, "soft_cap", "alibi", "sinks"]))
    if feature == "soft_cap":
        kw["logits_soft_cap"] = draw(st.sampled_from([2.0, 10.0]))
    elif feature == "alibi":
        kw["alibi_slopes"] = tuple(2.0 ** -(i + 1) for i in range(heads))
    elif feature == "sinks":
        kw["has_sinks"] = True
    spec = AttentionSpec(**kw)
    batch_shapes = draw(shapes(spec.block_size, with_context=not encoder))
    pad = draw(st.sampled_from([0, 0, 3]))
    seed = draw(st.integers(0, 2**16))
    magnitude = 3.0 if feature == "soft_cap" else 1.0
    return spec, batch_shapes, pad, seed, magnitude


def _check_standard(backend, case, counter):
    spec, batch_shapes, pad, seed, magnitude = case
    assume(not backend.not_supported_reasons(spec, CPU))
    batch = make_random_batch(spec, batch_shapes, seed=seed, pad_tokens=pad, logit_magnitude=magnitude)
    check_backend_on_batch(backend, batch)
    counter[f"{backend.name} vs oracle"] += 1


@settings(max_examples=40, **COMMON)
@given(case=standard_cases())
def test_reference_agrees_with_oracle(case, case_counter):
    _check_standard(ReferenceBackend, case, case_counter)


@settings(max_examples=12, **COMMON)
@given(case=standard_cases())
def test_triton_agrees_with_oracle(case, case_counter):
    _check_standard(TritonAttentionBackend, case, case_counter)


@st.composite
def mla_cases(draw):
    spec = AttentionSpec.mla(
        draw(st.sampled_from([1, 2, 4])), kv_lora_rank=draw(st.sampled_from([32, 64])), qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, dtype=draw(st.sampled_from(["float16", "bfloat16"])),
        kv_cache_dtype=draw(st.sampled_from(["auto", "auto", "fp8_e4m3"])), block_size=draw(st.sampled_from([8, 16])),
    )
    return spec, draw(shapes(spec.block_size)), draw(st.sampled_from([0, 2])), draw(st.integers(0, 2**16)), \
        draw(st.sampled_from([8, 64, 4096]))


def _check_mla(backend, case, counter):
    spec, batch_shapes, pad, seed, workspace = case
    assume(not backend.not_supported_reasons(spec, CPU))
    batch = make_random_mla_batch(spec, batch_shapes, seed=seed, pad_tokens=pad)
    kw = dict(builder_kwargs=dict(workspace_tokens=workspace)) if backend is TritonMLABackend else {}
    out, _ = run_mla_backend(backend, batch, **kw)
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], mla_oracle(batch), tolerance_for(spec.torch_dtype, spec.kv_cache_dtype),
                           what=backend.name)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    counter[f"{backend.name} vs oracle"] += 1


@settings(max_examples=15, **COMMON)
@given(case=mla_cases())
def test_reference_mla_agrees_with_oracle(case, case_counter):
    _check_mla(ReferenceMLABackend, case, case_counter)


@settings(max_examples=10, **COMMON)
@given(case=mla_cases())
def test_triton_mla_agrees_with_oracle(case, case_counter):
    _check_mla(TritonMLABackend, case, case_counter)
