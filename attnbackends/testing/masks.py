"""Test support for layer mask kinds: each kind's visibility written out position by position (independently of
:func:`attnbackends.masks.dense_visibility`), random masked batches, and a backend run checked against the float64
oracle."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch

from ..masks import with_custom_masks, with_spans
from ..spec import AttentionSpec, MaskKind
from .cases import RandomBatch, SequenceShape, make_random_batch
from .conformance import run_backend_on_batch
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = ["MaskedBatch", "check_backend_on_masked_batch", "expected_visibility", "make_masked_batch",
           "random_spans"]


def expected_visibility(spec: AttentionSpec, shape: SequenceShape, spans: Sequence[tuple[int, int]] = (),
                        custom: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[query_len, seq_len] bool: query t (position context + t) sees key j, from the kind's definition in words,
    one query row at a time."""
    mask = spec.mask
    window = spec.window
    j = torch.arange(shape.seq_len)
    out = torch.zeros(shape.query_len, shape.seq_len, dtype=torch.bool)
    for t in range(shape.query_len):
        p = shape.context_len + t
        if mask.kind is MaskKind.CAUSAL:
            row = j <= p
        elif mask.kind is MaskKind.NON_CAUSAL:
            row = torch.ones_like(j, dtype=torch.bool)
        elif mask.kind is MaskKind.BLOCK_CAUSAL:
            row = j // mask.block_len <= p // mask.block_len
        elif mask.kind is MaskKind.CAUSAL_SPANS:
            row = j <= p
            for s, e in spans:
                if s <= p < e:
                    row = row | ((j >= s) & (j < e))
        else:
            row = custom[t].clone()
        if window is not None:
            row = row & (j >= p - window[0]) & (j <= p + window[1])
        out[t] = row
    return out


def random_spans(rng: random.Random, seq_len: int, max_spans: int = 3, past_end: int = 0) -> list[tuple[int, int]]:
    """Sorted disjoint spans over [0, seq_len + past_end) (the last may end past seq_len: a split span)."""
    cuts = sorted(rng.sample(range(seq_len + past_end + 1), min(2 * max_spans, seq_len + past_end + 1)))
    spans = [(cuts[k], cuts[k + 1]) for k in range(0, len(cuts) - 1, 2) if cuts[k + 1] > cuts[k]]
    return [s for s in spans if s[0] < seq_len + past_end][: rng.randint(0, max_spans)]


class MaskedBatch:
    """A random batch for a masked layer, with each request's visibility written out (``allowed``)."""

    def __init__(self, batch: RandomBatch, allowed: list[torch.Tensor]) -> None:
        self.batch = batch
        self.allowed = allowed


def make_masked_batch(spec: AttentionSpec, shapes: Sequence[SequenceShape], *, seed: int = 0,
                      spans: Optional[Sequence[Sequence[tuple[int, int]]]] = None, device: "torch.device | str" = "cpu",
                      custom_density: float = 0.6, **kwargs) -> MaskedBatch:
    """A random batch of ``shapes`` for ``spec``; kind ``causal_spans`` takes ``spans`` (one list per request),
    kind ``custom`` gets random masks with every query seeing at least one key."""
    batch = make_random_batch(spec, shapes, seed=seed, device=device, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    customs: list[Optional[torch.Tensor]] = [None] * len(shapes)
    if spec.mask.kind is MaskKind.CAUSAL_SPANS and spans is not None:
        batch.common = with_spans(batch.common, spans)
    if spec.mask.kind is MaskKind.CUSTOM:
        customs = []
        for s in shapes:
            m = torch.rand(s.query_len, s.seq_len, generator=gen) < custom_density
            m[torch.arange(s.query_len), s.context_len + torch.arange(s.query_len)] = True
            customs.append(m)
        batch.common = with_custom_masks(batch.common, customs)
    allowed = [expected_visibility(spec, s, spans[i] if spans is not None else (), customs[i])
               for i, s in enumerate(shapes)]
    return MaskedBatch(batch, allowed)


def check_backend_on_masked_batch(backend_cls: type, masked: MaskedBatch, **builder_kwargs) -> torch.Tensor:
    """Run the batch on ``backend_cls`` (output poisoned first) and compare with the float64 oracle under the
    written-out visibility, at the dtype's tolerance; returns the output."""
    batch = masked.batch
    if builder_kwargs:
        spec, device = batch.spec, batch.query.device
        builder = backend_cls.get_builder_cls()(spec, device, **builder_kwargs)
        impl = backend_cls.get_impl_cls()(spec, sinks=batch.sinks, k_scale=batch.k_scale, v_scale=batch.v_scale)
        output = batch.new_output()
        kv_cache = batch.kv_cache.clone() if batch.kv_cache is not None else None
        impl.forward(batch.query, batch.key, batch.value, kv_cache, builder.build(batch.common), output)
    else:
        output, _ = run_backend_on_batch(backend_cls, batch)
    n = batch.num_actual_tokens
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    assert_close_to_oracle(output[:n], oracle_attention(batch, masked.allowed), tol,
                           what=f"{backend_cls.name} output ({batch.spec.mask.describe()})")
    return output
