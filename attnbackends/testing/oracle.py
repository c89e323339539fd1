"""The test oracle: dense float64 attention per request, from the batch's own dense K/V (never from the paged
cache), written independently of the reference backend."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .cases import RandomBatch

__all__ = ["draft_visibility", "oracle_attention"]


def draft_visibility(parents: list[int], query_len: int, seq_len: int) -> torch.Tensor:
    """[Q, L] bool for a request of Q query tokens and L keys whose last ``len(parents)`` tokens are a draft tree
    (``parents[i]``: the parent of draft token i, -1 for a root): False where a draft token would see a draft token
    that is not itself or an ancestor (causality is the caller's)."""
    n = len(parents)
    allowed = torch.ones(query_len, seq_len, dtype=torch.bool)
    for a in range(n):
        ancestors, node = set(), a
        while node >= 0:
            ancestors.add(node)
            node = parents[node]
        for b in range(n):
            if b not in ancestors:
                allowed[query_len - n + a, seq_len - n + b] = False
    return allowed


_draft_visibility = draft_visibility  # the name older tests import


def oracle_attention(batch: RandomBatch, allowed: "Optional[Sequence[torch.Tensor]]" = None) -> torch.Tensor:
    """The exact answer for ``batch``: [num_actual_tokens, num_heads, value_head_size] float64 on the CPU.

    ``allowed``: per request a [query_len, seq_len] bool mask that replaces the spec's causal / sliding-window rule
    (a layer mask kind the caller wrote out; draft trees still apply)."""
    spec = batch.spec
    hq, hkv = spec.num_heads, spec.num_kv_heads
    group = hq // hkv
    scale = spec.softmax_scale
    slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float64) if spec.alibi_slopes is not None else None
    sinks = batch.sinks.double().cpu() if batch.sinks is not None else None
    query = batch.query.double().cpu()
    outputs = []
    start = 0
    trees = batch.tree_parents or [None] * len(batch.shapes)
    masks = list(allowed) if allowed is not None else [None] * len(batch.shapes)
    for shape, keys, values, parents, given in zip(batch.shapes, batch.dense_keys, batch.dense_values, trees, masks):
        q = query[start : start + shape.query_len]  # [Q, Hq, D]
        start += shape.query_len
        q = q.reshape(shape.query_len, hkv, group, -1).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
        k = keys.permute(1, 0, 2)[:, None]  # [Hkv, 1, L, D]
        v = values.permute(1, 0, 2)[:, None]  # [Hkv, 1, L, Dv]
        s = (q @ k.transpose(-1, -2)) * scale  # [Hkv, G, Q, L]
        if spec.logits_soft_cap is not None:
            s = torch.tanh(s / spec.logits_soft_cap) * spec.logits_soft_cap
        p_pos = torch.arange(shape.context_len, shape.seq_len, dtype=torch.float64)[:, None]  # [Q, 1]
        k_pos = torch.arange(shape.seq_len, dtype=torch.float64)[None, :]  # [1, L]
        if slopes is not None:
            s = s + slopes.reshape(hkv, group, 1, 1) * (k_pos - p_pos)
        allowed = torch.ones(shape.query_len, shape.seq_len, dtype=torch.bool)
        if given is not None:
            allowed &= given.to(torch.bool).cpu()
        else:
            if spec.causal:
                allowed &= k_pos <= p_pos
            if spec.sliding_window is not None:
                allowed &= k_pos > p_pos - spec.sliding_window
        if parents:
            allowed &= draft_visibility(parents, shape.query_len, shape.seq_len)
        s = torch.where(allowed, s, torch.full_like(s, -torch.inf))
        row_max = s.amax(dim=-1, keepdim=True)
        if sinks is not None:
            row_max = torch.maximum(row_max, sinks.reshape(hkv, group, 1, 1))
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(s - row_max)
        denom = weights.sum(dim=-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks.reshape(hkv, group, 1, 1) - row_max)
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = (weights / denom) @ v  # [Hkv, G, Q, Dv]
        outputs.append(o.permute(2, 0, 1, 3).reshape(shape.query_len, hq, -1))
    return torch.cat(outputs)
