"""Conformance of draft steps (:mod:`attnbackends.speculative.draft_steps`): a backend builds the metadata of every step at
once (:meth:`~attnbackends.interface.AttentionMetadataBuilder.build_draft_steps`), then runs the steps one after
another, each row's output checked against the float64 oracle over the keys that row sees (its request's prefix
and its branch's draft tokens so far).

    from attnbackends.testing.conformance import draft_step_cases, check_backend_draft_case

    @pytest.mark.parametrize("case", draft_step_cases("bfloat16", 128, 16), ids=str)
    def test_my_backend_draft_steps(case):
        check_backend_draft_case(MyBackend, case, device="cuda")
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..speculative.draft_steps import DraftSteps, draft_pages_needed, draft_steps_metadata
from ..interface import AttentionBackend
from ..ops.quant import dequantize_from_cache, quantize_for_cache
from ..platform import DeviceInfo
from ..spec import AttentionSpec, dtype_name
from ..validation import check_device_available
from .cases import CaseNotSupported, RandomBatch, SequenceShape
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = ["DraftStepCase", "check_backend_draft_case", "check_backend_draft_steps", "draft_step_cases"]


@dataclass(frozen=True)
class DraftStepCase:
    """A spec and a draft-step recipe: one request per entry of ``contexts`` (its prefix length), ``topk`` branches
    each, ``num_steps`` steps; ``in_place``: branch 0 of each request writes into the prefix's partial last page
    (the others get copies)."""

    name: str
    spec_kwargs: dict[str, Any]
    contexts: tuple[int, ...]
    topk: int
    num_steps: int
    in_place: bool = False
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.name

    def spec(self) -> AttentionSpec:
        return AttentionSpec(**self.spec_kwargs)


def draft_step_cases(dtype: "str | torch.dtype" = "float16", head_size: int = 64,
                     block_size: int = 16) -> list[DraftStepCase]:
    """Draft-step cases: prefixes ending inside a page and on a page edge, one branch or several (EAGLE's topk
    4), more steps than a page holds, in-place and copied partial pages, GQA and a window."""
    dtype = dtype_name(dtype)
    base = dict(num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=block_size)
    contexts = (1, block_size - 1, block_size, 3 * block_size + 5)
    cases = [
        DraftStepCase("draft_chain", base, contexts, topk=1, num_steps=3, in_place=True),
        DraftStepCase("draft_topk4", base, contexts, topk=4, num_steps=5, seed=1),
        DraftStepCase("draft_topk2_in_place", base, contexts, topk=2, num_steps=block_size + 2, in_place=True, seed=2),
        DraftStepCase("draft_mqa_window", {**base, "num_kv_heads": 1, "sliding_window": block_size}, contexts, topk=3,
                      num_steps=4, seed=3),
        DraftStepCase("draft_fp8", {**base, "kv_cache_dtype": "fp8_e4m3"}, contexts, topk=2, num_steps=3, seed=4),
    ]
    suffix = f"-{dtype}-h{head_size}-b{block_size}"
    return [DraftStepCase(c.name + suffix, c.spec_kwargs, c.contexts, c.topk, c.num_steps, c.in_place, c.seed,
                          c.extra) for c in cases]


def _layout(contexts, topk, num_steps, block_size, in_place, rng) -> tuple[list[list[int]], list, int]:
    """Random pages: each request's prefix pages, each branch's own pages; returns (tables, branch pages, pages)."""
    prefix = [-(-c // block_size) for c in contexts]
    own = [draft_pages_needed(c, block_size, num_steps) for c in contexts]
    total = sum(prefix) + sum(n * topk for n in own)
    num_blocks = total + max(2, total // 4)
    pool = rng.sample(range(num_blocks), total)
    tables, branches = [], []
    for c, n_prefix, n_own in zip(contexts, prefix, own):
        table, pool = pool[:n_prefix], pool[n_prefix:]
        tables.append(table)
        per_branch = []
        for k in range(topk):
            if in_place and k == 0 and c % block_size:
                pages, pool = [table[-1]] + pool[: n_own - 1], pool[n_own - 1 :]
            else:
                pages, pool = pool[:n_own], pool[n_own:]
            per_branch.append(pages)
        branches.append(per_branch)
    return tables, branches, num_blocks


def check_backend_draft_steps(backend_cls: type[AttentionBackend], case: DraftStepCase,
                              device: "torch.device | str" = "cpu") -> Optional[list[str]]:
    """Run the case's draft steps through the backend and check every step against the oracle; returns the
    backend's reasons (without running anything) when it declines the spec."""
    device = check_device_available(device)
    spec = case.spec()
    reasons = backend_cls.not_supported_reasons(spec, DeviceInfo.current(device))
    if reasons:
        return reasons
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = spec.block_size, spec.num_kv_heads, spec.head_size
    tables, branches, num_blocks = _layout(case.contexts, case.topk, case.num_steps, bs, case.in_place, rng)
    cache_dtype = spec.kv_cache_torch_dtype
    k_scale, v_scale = (0.05, 0.04) if spec.is_fp8_kv_cache else (1.0, 1.0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
        return dequantize_from_cache(quantize_for_cache(x.to(spec.torch_dtype), cache_dtype, scale), torch.float64, scale)

    cache = torch.stack([quantize_for_cache(randn(num_blocks, bs, hkv, d), cache_dtype, s) for s in (k_scale, v_scale)], 1)
    prefix_k, prefix_v = [], []
    for ctx, table in zip(case.contexts, tables):
        k, v = randn(ctx, hkv, d), randn(ctx, hkv, d)
        for pos in range(ctx):
            cache[table[pos // bs], 0, pos % bs] = quantize_for_cache(k[pos].to(spec.torch_dtype), cache_dtype, k_scale)
            cache[table[pos // bs], 1, pos % bs] = quantize_for_cache(v[pos].to(spec.torch_dtype), cache_dtype, v_scale)
        prefix_k.append(round_trip(k, k_scale))
        prefix_v.append(round_trip(v, v_scale))
    kv_cache = cache.to(device)
    sinks = randn(spec.num_heads).to(device) if spec.has_sinks else None

    draft: DraftSteps = draft_steps_metadata(case.contexts, tables, branches, bs, topk=case.topk,
                                             num_steps=case.num_steps, device=device)
    num_rows = len(case.contexts) * case.topk
    builder = backend_cls.get_builder_cls()(spec, device, max_num_reqs=max(num_rows, 1))
    metadata = builder.build_draft_steps(draft)  # every step before any runs: no step may clobber another's plan
    if len(metadata) != case.num_steps:
        raise AssertionError(f"{backend_cls.name}.build_draft_steps returned {len(metadata)} metadata for "
                             f"{case.num_steps} steps")
    impl = backend_cls.get_impl_cls()(spec, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    draft.copy_prefix_pages(kv_cache)
    drafted_k: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
    drafted_v: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
    tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
    for step, meta in enumerate(metadata):
        q, k, v = randn(num_rows, spec.num_heads, d), randn(num_rows, hkv, d), randn(num_rows, hkv, d)
        q, k, v = (x.to(spec.torch_dtype) for x in (q, k, v))
        for r in range(num_rows):
            drafted_k[r].append(round_trip(k[r : r + 1], k_scale))
            drafted_v[r].append(round_trip(v[r : r + 1], v_scale))
        output = torch.full((num_rows, spec.num_heads, d), float("nan"), dtype=spec.torch_dtype, device=device)
        impl.forward(q.to(device), k.to(device), v.to(device), kv_cache, meta, output)
        rows = [r // case.topk for r in range(num_rows)]
        expected = oracle_attention(RandomBatch(
            spec=spec, shapes=[SequenceShape(1, case.contexts[b] + step) for b in rows], query=q, key=k, value=v,
            kv_cache=None, common=draft.steps[step], sinks=sinks.cpu() if sinks is not None else None,
            k_scale=k_scale, v_scale=v_scale,
            dense_keys=[torch.cat([prefix_k[b]] + drafted_k[r]) for r, b in enumerate(rows)],
            dense_values=[torch.cat([prefix_v[b]] + drafted_v[r]) for r, b in enumerate(rows)],
        ))
        assert_close_to_oracle(output, expected, tol, what=f"{backend_cls.name} draft step {step} of {case.name}")
    return None


def check_backend_draft_case(backend_cls: type[AttentionBackend], case: DraftStepCase,
                             device: "torch.device | str" = "cpu") -> None:
    """:func:`check_backend_draft_steps`; a case the backend declines is skipped with its reasons under pytest
    (raises :class:`~attnbackends.testing.cases.CaseNotSupported` without pytest)."""

    reasons = check_backend_draft_steps(backend_cls, case, device)
    if reasons:
        try:
            import pytest
        except ImportError:
            raise CaseNotSupported(reasons) from None
        pytest.skip(f"{backend_cls.name} declines {case.name}: {'; '.join(reasons)}")
