"""The reference backend against the independent float64 oracle on random batches covering every feature."""

import random

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import (
    CaseNotSupported,
    check_backend_case,
    check_backend_case_or_raise,
    check_backend_on_batch,
    conformance_cases,
    make_random_batch,
    random_sequence_shapes,
    run_backend_on_batch,
)

NUM_RANDOM_BATCHES = 240


def random_spec(rng: random.Random) -> AttentionSpec:
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.choice([1, 2, 4])
    attn_type = rng.choice(["decoder"] * 6 + ["encoder_only", "encoder", "encoder_decoder"])
    causal = attn_type == "decoder"
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=rng.choice([16, 32, 64, 80]),
        dtype=rng.choice(["float32", "float16", "bfloat16"]),
        kv_cache_dtype=rng.choice(["auto", "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
        block_size=rng.choice([8, 16, 32]),
        attn_type=attn_type,
        sliding_window=rng.choice([None, None, 1, 7, 40]) if causal else None,
        logits_soft_cap=rng.choice([None, None, 3.0, 30.0]),
        alibi_slopes=tuple(2.0 ** -(i + 1) for i in range(num_heads)) if rng.random() < 0.25 else None,
        has_sinks=rng.random() < 0.25,
        scale=rng.choice([None, None, 0.05]),
    )


def random_case(seed: int):
    rng = random.Random(seed)
    spec = random_spec(rng)
    kinds = ("decode", "prefill", "chunked_prefill") if spec.attn_type.value == "decoder" else ("prefill",)
    if spec.attn_type.value == "encoder_decoder":
        kinds = ("decode", "prefill", "chunked_prefill")
    shapes = random_sequence_shapes(rng, rng.randint(1, 6), spec.block_size, kinds=kinds)
    return spec, shapes, rng.choice([0, 0, 3])


def test_random_cases_cover_every_feature():
    seen = {k: 0 for k in ("gqa", "mqa", "window", "alibi", "soft_cap", "sinks", "fp8_e4m3", "fp8_e5m2",
                           "non_causal", "decode", "prefill", "chunked", "padded", "fp16", "bf16", "fp32")}
    for seed in range(NUM_RANDOM_BATCHES):
        spec, shapes, pad = random_case(seed)
        seen["gqa"] += spec.num_heads > spec.num_kv_heads > 1
        seen["mqa"] += spec.num_kv_heads == 1 and spec.num_heads > 1
        seen["window"] += spec.sliding_window is not None
        seen["alibi"] += spec.alibi_slopes is not None
        seen["soft_cap"] += spec.logits_soft_cap is not None
        seen["sinks"] += spec.has_sinks
        seen["fp8_e4m3"] += spec.kv_cache_dtype in ("fp8", "fp8_e4m3")
        seen["fp8_e5m2"] += spec.kv_cache_dtype == "fp8_e5m2"
        seen["non_causal"] += not spec.causal
        seen["decode"] += any(s.query_len == 1 and s.context_len > 0 for s in shapes)
        seen["prefill"] += any(s.query_len > 1 and s.context_len == 0 for s in shapes)
        seen["chunked"] += any(s.query_len > 1 and s.context_len > 0 for s in shapes)
        seen["padded"] += pad > 0
        seen[{"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[spec.dtype]] += 1
    assert min(seen.values()) >= 10, seen


@pytest.mark.parametrize("seed", range(NUM_RANDOM_BATCHES))
def test_reference_matches_oracle_on_random_batch(seed):
    spec, shapes, pad = random_case(seed)
    batch = make_random_batch(spec, shapes, seed=seed, pad_tokens=pad, logit_magnitude=3.0 if spec.logits_soft_cap else 1.0)
    check_backend_on_batch(ReferenceBackend, batch)


@pytest.mark.parametrize(
    "case",
    conformance_cases("float16", 64, 16) + conformance_cases("bfloat16", 80, 32) + conformance_cases("float32", 128, 16),
    ids=str,
)
def test_reference_conformance(case):
    check_backend_case(ReferenceBackend, case)


def test_oracle_check_can_fail():
    """A backend that is subtly wrong (scale off by 1%) must fail the conformance check."""

    class WrongScaleImpl(ReferenceBackend.get_impl_cls()):
        def __init__(self, spec, **kwargs):
            super().__init__(spec, **kwargs)
            self.scale *= 1.01

    class WrongScale(ReferenceBackend):
        name = "wrong_scale"

        @classmethod
        def get_impl_cls(cls):
            return WrongScaleImpl

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float32")
    batch = make_random_batch(spec, random_sequence_shapes(random.Random(0), 4, 16), seed=0, logit_magnitude=3.0)
    with pytest.raises(AssertionError, match="outside"):
        check_backend_on_batch(WrongScale, batch)


def test_padding_rows_untouched_and_cache_written():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", kv_cache_dtype="fp8_e5m2")
    batch = make_random_batch(spec, random_sequence_shapes(random.Random(1), 3, 16), seed=1, pad_tokens=4)
    output, kv_cache = run_backend_on_batch(ReferenceBackend, batch)
    assert torch.isnan(output[batch.num_actual_tokens :]).all()
    assert not torch.isnan(output[: batch.num_actual_tokens]).any()
    assert kv_cache.dtype == torch.float8_e5m2


def test_unsupported_case_reports_reasons():
    class NoSinks(ReferenceBackend):
        name = "no_sinks"
        supports_sinks = False

    case = next(c for c in conformance_cases() if c.name.startswith("sinks"))
    with pytest.raises(CaseNotSupported, match="attention sinks not supported"):
        check_backend_case_or_raise(NoSinks, case)
