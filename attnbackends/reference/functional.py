"""Dense attention of one sequence in plain torch, with every feature of the shared semantics (DESIGN.md)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["sequence_attention"]


def sequence_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    tree_mask: Optional[torch.Tensor] = None,
    visible: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's queries over its keys 0..L-1.

    Parameters
    ----------
    query : [Q, Hq, D]
    key : [L, Hkv, D]; Hq must be a multiple of Hkv (GQA/MQA)
    value : [L, Hkv, Dv]
    query_positions : [Q] int, the position of each query in the sequence
    alibi_slopes : [Hq] or None; sinks : [Hq] sink logits or None
    tree_mask : [n, n] bool or None: the last n queries and the last n keys are a draft segment in which query a
        sees key b only where ``tree_mask[a, b]`` (tree verification)
    visible : [Q, L] bool or None: keys each query may see, on top of ``causal`` and ``sliding_window`` (a layer's
        mask kind: :func:`attnbackends.masks.dense_visibility`)

    Returns
    -------
    output : [Q, Hq, Dv] in ``compute_dtype``
    lse : [Hq, Q] float log-sum-exp of the (scaled, capped, biased) logits over visible keys (sinks included);
        -inf for a query that sees nothing.
    """
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_q_heads // num_kv_heads
    q = query.to(compute_dtype).transpose(0, 1)  # [Hq, Q, D]
    k = key.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
    v = value.to(compute_dtype).transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, Dv]
    logits = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, Q, L]
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    key_positions = torch.arange(key.shape[0], device=query.device)
    distance = key_positions[None, :] - query_positions.to(query.device)[:, None]  # [Q, L], j - p
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.to(compute_dtype)[:, None, None] * distance.to(compute_dtype)[None]
    visible_all = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        visible_all &= distance <= 0
    if sliding_window is not None:
        visible_all &= distance > -sliding_window
    if visible is not None:
        visible_all &= visible.to(visible_all.device)
    if tree_mask is not None:
        n = tree_mask.shape[0]
        visible_all[visible_all.shape[0] - n :, visible_all.shape[1] - n :] &= tree_mask.to(visible_all.device)
    logits = logits.masked_fill(~visible_all[None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(compute_dtype)[:, None, None].expand(num_q_heads, logits.shape[1], 1)
        logits = torch.cat([logits, sink_col], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, Q]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse[..., None])
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, v)  # [Hq, Q, Dv]
    return out.transpose(0, 1), lse
