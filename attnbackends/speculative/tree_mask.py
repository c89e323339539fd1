"""Speculative decoding inputs: the packed tree mask of a verify batch (see
:attr:`CommonAttentionMetadata.spec_tree_mask`), built from per-request parent arrays (EAGLE-style token trees) or
chains, and its expansion to a full per-request [query, key] mask for kernels that take one (FlashInfer).

A draft segment of n tokens is described by ``parents`` (n ints): ``parents[a]`` is the index of token a's parent
inside the segment, or -1 when token a hangs directly off the cached context (the root; a verify step feeds the last
accepted token as the root, parents ``[-1, 0, ...]``). Parents come before their children (``parents[a] < a``), so a
chain of n tokens is ``[-1, 0, 1, ..., n - 2]`` and its mask is the causal lower triangle.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..metadata import CommonAttentionMetadata

__all__ = [
    "chain_parents",
    "check_parents",
    "expand_tree_mask",
    "request_tree_mask",
    "tree_mask_from_parents",
    "with_tree_mask",
]


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of ``n`` tokens: ``[-1, 0, 1, ..., n - 2]``."""
    return list(range(-1, n - 1))


def check_parents(parents: Sequence[int], what: str = "parents") -> None:
    """ValueError unless every ``parents[a]`` lies in [-1, a)."""
    for a, p in enumerate(parents):
        if not -1 <= int(p) < a:
            raise ValueError(f"{what}[{a}] = {p}: a parent must come before its child (-1 <= parent < {a})")


def _ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: row a is True at a and at each of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, p in enumerate(parents):
        if p >= 0:
            mask[a] = mask[p]
        mask[a, a] = True
    return mask


def tree_mask_from_parents(
    parents_per_req: Sequence[Optional[Sequence[int]]], device: "torch.device | str" = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed tree mask of a batch.

    Parameters
    ----------
    parents_per_req : per request, its draft segment's parent array (see the module docstring), or None / empty
        for a request without a tree (ordinary causal attention).

    Returns
    -------
    mask : [sum_i n_i * n_i] bool on ``device``
    indptr : [num_reqs + 1] int32 on ``device``
    indptr_cpu : [num_reqs + 1] int32 on the CPU
    """
    parts, sizes = [], [0]
    for i, parents in enumerate(parents_per_req):
        parents = list(parents or ())
        check_parents(parents, f"parents_per_req[{i}]")
        parts.append(_ancestor_mask(parents).reshape(-1))
        sizes.append(len(parents) ** 2)
    indptr_cpu = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32)
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    device = torch.device(device)
    return mask.to(device), indptr_cpu.to(device), indptr_cpu


def with_tree_mask(
    common: CommonAttentionMetadata, parents_per_req: Sequence[Optional[Sequence[int]]]
) -> CommonAttentionMetadata:
    """A copy of ``common`` carrying the tree mask of ``parents_per_req`` (one entry per request; a request's draft
    segment is its last n_i query tokens, so n_i <= its query_len)."""
    if len(parents_per_req) != common.num_reqs:
        raise ValueError(f"parents_per_req has {len(parents_per_req)} entries for {common.num_reqs} requests")
    query_lens = common.query_lens_cpu.tolist()
    for i, parents in enumerate(parents_per_req):
        if parents is not None and len(parents) > query_lens[i]:
            raise ValueError(
                f"parents_per_req[{i}] has {len(parents)} draft tokens; request {i} has only {query_lens[i]} query tokens"
            )
    mask, indptr, indptr_cpu = tree_mask_from_parents(parents_per_req, common.device)
    return dataclasses.replace(
        common, spec_tree_mask=mask, spec_tree_mask_indptr=indptr, spec_tree_mask_indptr_cpu=indptr_cpu
    )


def request_tree_mask(common: CommonAttentionMetadata, i: int) -> Optional[torch.Tensor]:
    """Request ``i``'s [n, n] bool tree mask (a view on the device tensor), or None without one (host reads only)."""
    if common.spec_tree_mask is None:
        return None
    start, end = (int(v) for v in common.spec_tree_mask_indptr_cpu[i : i + 2])
    if end == start:
        return None
    n = int(round((end - start) ** 0.5))
    return common.spec_tree_mask[start:end].view(n, n)


def expand_tree_mask(common: CommonAttentionMetadata, first: int = 0, last: Optional[int] = None) -> torch.Tensor:
    """The full mask of requests ``first..last-1``: [sum_i query_len_i * seq_len_i] bool on the device, request i's
    [query_len_i, seq_len_i] block row-major (FlashInfer's ``custom_mask`` layout). Causal everywhere, the tree mask
    over each draft segment. Sizes come from the host copies; no host-device sync."""
    last = common.num_reqs if last is None else last
    qsl = common.query_start_loc_cpu[first : last + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = common.seq_lens_cpu[first:last].long()
    if common.spec_tree_mask_indptr_cpu is not None:
        tptr = common.spec_tree_mask_indptr_cpu[first : last + 1].long()
        n_lens = torch.sqrt((tptr[1:] - tptr[:-1]).double()).round().long()
    else:
        tptr = torch.zeros(last - first + 1, dtype=torch.long)
        n_lens = torch.zeros(last - first, dtype=torch.long)
    sizes = q_lens * seq_lens
    total = int(sizes.sum())
    device = common.device
    num = last - first
    # per request: (element offset, query len, seq len, context, draft start, draft len, tree offset)
    info = torch.stack([
        torch.cumsum(sizes, 0) - sizes, q_lens, seq_lens, seq_lens - q_lens, seq_lens - n_lens, n_lens, tptr[:-1],
    ], dim=1).to(device)
    req = torch.repeat_interleave(torch.arange(num, device=device), sizes.to(device), output_size=total)
    flat = torch.arange(total, device=device) - info[req, 0]
    row, col = flat // info[req, 2], flat % info[req, 2]
    pos = info[req, 3] + row  # the query's position in the cache
    visible = col <= pos
    draft_start, draft_len = info[req, 4], info[req, 5]
    in_tree = (col >= draft_start) & (pos >= draft_start) & (draft_len > 0)
    if common.spec_tree_mask is not None and total:
        a = (pos - draft_start).clamp_min(0)
        b = (col - draft_start).clamp_min(0)
        index = (info[req, 6] + a * draft_len + b).clamp(max=max(common.spec_tree_mask.numel() - 1, 0))
        tree = common.spec_tree_mask[index] if common.spec_tree_mask.numel() else torch.zeros_like(visible)
        visible = torch.where(in_tree, tree & visible, visible)
    return visible
