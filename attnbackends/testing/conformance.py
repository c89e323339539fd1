"""A conformance suite any backend (ours or a third party's) can run against the oracle.

    import pytest
    import torch
    from attnbackends.testing import conformance_cases, check_backend_case

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

    @pytest.mark.parametrize("case", conformance_cases("bfloat16", 128, 16), ids=str)
    def test_my_backend(case):
        check_backend_case(MyBackend, case, device=DEVICE)

A case the backend declines (its ``not_supported_reasons`` for the case's spec, or ``CaseNotSupported`` raised by
the backend itself) is skipped with the backend's reasons under pytest (:func:`check_backend_case`); outside pytest
it raises ``CaseNotSupported`` (:func:`check_backend_case_or_raise`, :func:`sweep`). Every other mismatch is an
AssertionError. Draft steps (:mod:`attnbackends.speculative.draft_steps`, the metadata of every step built at once) have their
own cases and check: :func:`draft_step_cases`, :func:`check_backend_draft_case`. Outputs are judged against the
oracle elementwise and as a whole (relative Frobenius error, see
:class:`~attnbackends.testing.tolerances.Tolerance`); fp8 cases against the oracle on the dequantised cache values,
so a 1% scale error fails them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..interface import AttentionBackend
from ..ops.quant import dequantize_from_cache
from ..platform import DeviceInfo
from ..spec import AttentionSpec, dtype_name
from ..speculative.tree_mask import chain_parents
from ..validation import check_device_available
from .cases import (
    CaseNotSupported,
    EAGLE_TREE_8, RandomBatch, SequenceShape, make_random_batch, random_sequence_shapes, random_tree_parents,
)
from .draft_steps import DraftStepCase, check_backend_draft_case, check_backend_draft_steps, draft_step_cases
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = [
    "check_backend_on_batches",
    "CaseNotSupported",
    "ConformanceCase",
    "conformance_cases",
    "speculative_cases",
    "run_backend_on_batch",
    "check_backend_on_batch",
    "check_backend_case",
    "check_backend_case_or_raise",
    "DraftStepCase",
    "draft_step_cases",
    "check_backend_draft_case",
    "check_backend_draft_steps",
]


@dataclass(frozen=True)
class ConformanceCase:
    """A named spec and batch recipe."""

    name: str
    spec_kwargs: dict[str, Any]
    shapes: Optional[tuple[SequenceShape, ...]] = None  # None: random shapes from the seed
    seed: int = 0
    num_seqs: int = 4
    pad_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name

    def spec(self) -> AttentionSpec:
        return AttentionSpec(**self.spec_kwargs)

    def batch(self, device: "torch.device | str" = "cpu") -> RandomBatch:
        spec = self.spec()
        shapes = self.shapes
        if shapes is None:
            kinds = ("prefill",) if not spec.attn_type.uses_kv_cache else ("decode", "prefill", "chunked_prefill")
            shapes = random_sequence_shapes(random.Random(self.seed), self.num_seqs, spec.block_size, kinds=kinds)
        return make_random_batch(spec, shapes, seed=self.seed, device=device, pad_tokens=self.pad_tokens, **self.extra)


def conformance_cases(
    dtype: "str | torch.dtype" = "float16", head_size: int = 64, block_size: int = 16
) -> list[ConformanceCase]:
    """The standard cases, one feature each plus mixed batches, for the given dtype (a name such as ``"bfloat16"``
    or a torch dtype), head size and block size."""
    dtype = dtype_name(dtype)
    base = dict(num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=block_size)
    mixed = tuple(
        [SequenceShape(1, 0), SequenceShape(1, block_size), SequenceShape(1, 3 * block_size + 5)]
        + [SequenceShape(block_size + 1, 0), SequenceShape(7, 2 * block_size - 1)]
    )
    cases = [
        ConformanceCase("decode", base, tuple(SequenceShape(1, c) for c in (1, block_size - 1, block_size, 70))),
        ConformanceCase("prefill", base, (SequenceShape(1, 0), SequenceShape(block_size + 1, 0), SequenceShape(40, 0))),
        ConformanceCase("chunked_prefill", base, (SequenceShape(9, block_size), SequenceShape(block_size, 33))),
        ConformanceCase("mixed", base, mixed),
        ConformanceCase("mixed_padded", base, mixed, pad_tokens=3),
        ConformanceCase("random_mix", base, None, seed=7, num_seqs=6),
        ConformanceCase("mqa", {**base, "num_kv_heads": 1}, mixed),
        ConformanceCase("mha", {**base, "num_kv_heads": 4}, mixed),
        ConformanceCase("sliding_window", {**base, "sliding_window": 11}, mixed),
        ConformanceCase("alibi", {**base, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}, mixed),
        ConformanceCase("soft_cap", {**base, "logits_soft_cap": 5.0}, mixed, extra={"logit_magnitude": 4.0}),
        ConformanceCase("sinks", {**base, "has_sinks": True}, mixed),
        ConformanceCase("fp8_e4m3", {**base, "kv_cache_dtype": "fp8_e4m3"}, mixed),
        ConformanceCase("fp8_e5m2", {**base, "kv_cache_dtype": "fp8_e5m2"}, mixed),
        ConformanceCase(
            "encoder_only",
            {**base, "attn_type": "encoder_only"},
            (SequenceShape(5, 0), SequenceShape(block_size + 3, 0), SequenceShape(1, 0)),
        ),
    ]
    cases += speculative_cases(base, block_size)
    suffix = f"-{dtype}-h{head_size}-b{block_size}"
    return [dataclasses.replace(case, name=case.name + suffix) for case in cases]


def speculative_cases(base: dict[str, Any], block_size: int) -> list[ConformanceCase]:
    """Speculative decoding: uniform multi-token decodes and tree verification (chains, EAGLE-like and random trees
    up to 64 draft tokens, with windows, soft-cap, sinks and fp8 KV). The specs ask for the speculation
    (``num_speculative_tokens``, ``speculative_tree``), so a backend that does not declare it skips with its reason."""
    rng = random.Random(16)
    multi = {**base, "num_speculative_tokens": 3}
    tree = {**base, "num_speculative_tokens": 7, "speculative_tree": True}
    contexts = (1, block_size - 1, block_size, 3 * block_size + 5)
    verify = tuple(SequenceShape(8, c) for c in contexts)
    eagle = {"tree_parents": [list(EAGLE_TREE_8)] * len(contexts)}
    mixed_trees = {"tree_parents": [list(EAGLE_TREE_8), chain_parents(8), random_tree_parents(rng, 8), None, None, None]}
    mixed = verify + (SequenceShape(1, 2 * block_size), SequenceShape(block_size + 3, 5))
    deep = {**base, "num_speculative_tokens": 63, "speculative_tree": True}
    return [
        ConformanceCase("multi_token_decode", multi, tuple(SequenceShape(4, c) for c in contexts)),
        ConformanceCase("multi_token_decode_varlen", multi, tuple(SequenceShape(q, c) for q, c in zip((4, 2, 1, 3), contexts))),
        ConformanceCase("tree_verify_chain", tree, verify, extra={"tree_parents": [chain_parents(8)] * len(contexts)}),
        ConformanceCase("tree_verify", tree, verify, extra=eagle),
        ConformanceCase("tree_verify_mixed", tree, mixed, extra=mixed_trees),
        ConformanceCase("tree_verify_64", deep, (SequenceShape(64, 70), SequenceShape(64, 1)),
                        extra={"tree_parents": [random_tree_parents(rng, 64), random_tree_parents(rng, 64)]}),
        ConformanceCase("tree_verify_window_soft_cap", {**tree, "sliding_window": 11, "logits_soft_cap": 5.0}, verify,
                        extra={**eagle, "logit_magnitude": 4.0}),
        ConformanceCase("tree_verify_sinks", {**tree, "has_sinks": True}, verify, extra=eagle),
        ConformanceCase("tree_verify_fp8", {**tree, "kv_cache_dtype": "fp8_e4m3"}, verify, extra=eagle),
    ]


def _device_info(device: torch.device) -> DeviceInfo:
    return DeviceInfo.current(device)


def run_backend_on_batch(
    backend_cls: type[AttentionBackend], batch: RandomBatch, *, check_support: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run one forward of ``batch`` through the backend; returns (output, kv_cache after the step)."""
    spec = batch.spec
    device = batch.query.device
    if check_support:
        reasons = backend_cls.not_supported_reasons(spec, _device_info(device))
        if reasons:
            raise CaseNotSupported(reasons)
    builder = backend_cls.get_builder_cls()(spec, device)
    metadata = builder.build(batch.common)
    impl = backend_cls.get_impl_cls()(spec, sinks=batch.sinks, k_scale=batch.k_scale, v_scale=batch.v_scale)
    kv_cache = batch.kv_cache.clone() if batch.kv_cache is not None else None
    output = batch.new_output()
    returned = impl.forward(batch.query, batch.key, batch.value, kv_cache, metadata, output)
    if returned is not output:
        raise AssertionError("forward must return the caller's output tensor")
    return output, kv_cache


def check_backend_on_batch(backend_cls: type[AttentionBackend], batch: RandomBatch) -> None:
    """Run the batch and check: output against the oracle, padding rows untouched, new K/V in their slots."""
    output, kv_cache = run_backend_on_batch(backend_cls, batch)
    n = batch.num_actual_tokens
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    assert_close_to_oracle(output[:n], oracle_attention(batch), tol, what=f"{backend_cls.name} output")
    if output.shape[0] > n and not bool(torch.isnan(output[n:].float()).all()):
        raise AssertionError(f"{backend_cls.name} wrote into padding rows past num_actual_tokens={n}")
    if kv_cache is not None:
        _check_cache_writes(backend_cls.name, batch, kv_cache)


def check_backend_on_batches(backend_cls: type[AttentionBackend], batches: Sequence[RandomBatch]) -> None:
    """Run ``batches`` one after another through one builder and one impl, as an engine's steps run, and check each
    as :func:`check_backend_on_batch` does: state a builder keeps between steps (planned wrappers, kernel choices
    cached per batch kind) must not carry one step's kind into the next. The batches share one spec, sinks and
    scales (the first batch's); build them on one ``num_blocks`` when the builder learns the cache size."""
    if not batches:
        raise ValueError("check_backend_on_batches needs at least one batch")
    first = batches[0]
    device = first.query.device
    reasons = backend_cls.not_supported_reasons(first.spec, _device_info(device))
    if reasons:
        raise CaseNotSupported(reasons)
    builder = backend_cls.get_builder_cls()(first.spec, device)
    impl = backend_cls.get_impl_cls()(first.spec, sinks=first.sinks, k_scale=first.k_scale, v_scale=first.v_scale)
    tol = tolerance_for(first.spec.torch_dtype, first.spec.kv_cache_dtype)
    for index, batch in enumerate(batches):
        if batch.spec != first.spec:
            raise ValueError(f"batch {index} has a different spec from batch 0: one builder serves one spec")
        kv_cache = batch.kv_cache.clone() if batch.kv_cache is not None else None
        output = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, kv_cache, builder.build(batch.common), output)
        n = batch.num_actual_tokens
        assert_close_to_oracle(output[:n], oracle_attention(batch), tol,
                               what=f"{backend_cls.name} output of batch {index}")


def _check_cache_writes(name: str, batch: RandomBatch, kv_cache: torch.Tensor) -> None:
    slots = batch.common.slot_mapping[: batch.num_actual_tokens].cpu()
    block_size = kv_cache.shape[2]
    cache = kv_cache.cpu()
    stored_k = dequantize_from_cache(cache[slots // block_size, 0, slots % block_size], torch.float64, batch.k_scale)
    stored_v = dequantize_from_cache(cache[slots // block_size, 1, slots % block_size], torch.float64, batch.v_scale)
    want_k = torch.cat([k[s.context_len :] for k, s in zip(batch.dense_keys, batch.shapes)])
    want_v = torch.cat([v[s.context_len :] for v, s in zip(batch.dense_values, batch.shapes)])
    # fp8 conversions may round the last bit differently from torch's; other dtypes must match exactly.
    fp8 = batch.spec.is_fp8_kv_cache
    rtol = 0.13 if fp8 else 0.0
    atol = 1e-3 * max(batch.k_scale, batch.v_scale) if fp8 else 0.0
    for what, got, want in (("key", stored_k, want_k), ("value", stored_v, want_v)):
        if not torch.allclose(got, want, rtol=rtol, atol=atol):
            worst = float((got - want).abs().max())
            raise AssertionError(f"{name}: new {what}s were not written to their slots (max abs diff {worst:.3g})")


def check_backend_case_or_raise(
    backend_cls: type[AttentionBackend], case: ConformanceCase, device: "torch.device | str" = "cpu"
) -> None:
    """Build the case's batch on ``device`` and check the backend on it; CaseNotSupported if it declines."""
    device = check_device_available(device)
    reasons = backend_cls.not_supported_reasons(case.spec(), _device_info(device))
    if reasons:
        raise CaseNotSupported(reasons)
    check_backend_on_batch(backend_cls, case.batch(device))


def check_backend_case(backend_cls: type[AttentionBackend], case: ConformanceCase, device: "torch.device | str" = "cpu") -> None:
    """Build the case's batch on ``device`` and check the backend on it; a case the backend declines is skipped
    with its reasons (``pytest.skip``; without pytest installed, CaseNotSupported is raised)."""
    try:
        check_backend_case_or_raise(backend_cls, case, device)
    except CaseNotSupported as exc:
        try:
            import pytest
        except ImportError:
            raise exc from None
        pytest.skip(f"{backend_cls.name} declines {case.name}: {exc}")


def sweep(backend_cls: type[AttentionBackend], cases: Sequence[ConformanceCase], device: "torch.device | str" = "cpu") -> dict[str, str]:
    """Run many cases; returns {case name: "ok" | "unsupported: reasons" | "FAILED: message"}."""
    results = {}
    for case in cases:
        try:
            check_backend_case_or_raise(backend_cls, case, device)
            results[case.name] = "ok"
        except CaseNotSupported as exc:
            results[case.name] = f"unsupported: {exc}"
        except AssertionError as exc:
            results[case.name] = f"FAILED: {exc}"
    return results
