"""Draft steps of speculative decoding (EAGLE-style): the draft model decodes ``topk`` branches per request for
``num_steps`` steps over the target's cached context, and the metadata of every step is built in one go.

Layout
------
B requests, each with ``context_lens[b]`` cached tokens (its prefix, in the pages of ``block_tables[b]``) that all
its branches share. Branch k of request b is row ``r = b * topk + k`` of every step (R = B * topk rows). Step s
(0-based) decodes one token per row at position ``context_lens[b] + s``; it sees the prefix and the branch's own
draft tokens of steps 0..s, so a row's seq_len at step s is ``context_lens[b] + s + 1``.

Pages: a branch writes its draft tokens into its own pages (``branch_pages[b][k]``), which continue the prefix's
block table: row r's block table is the prefix's full pages (``context_lens[b] // block_size`` of them, shared by
the branches) followed by the branch's pages, which cover positions ``(context_lens[b] // block_size) * block_size``
to ``context_lens[b] + num_steps - 1`` (:func:`draft_pages_needed` of them). When the prefix ends inside a page, that
page's cached tokens must also be in the branch's first page: a branch may name the prefix's partial page itself
(at most one branch per request, it then writes there in place), every other branch gets a copy of it, which
:meth:`DraftSteps.copy_prefix_pages` makes (once, before step 0).

Every tensor is made on the host and copied to the device once; the steps' metadata are views of them, so building
all steps (:meth:`attnbackends.interface.AttentionMetadataBuilder.build_draft_steps`) reads nothing back from the
device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..metadata import CommonAttentionMetadata

__all__ = ["DraftSteps", "draft_pages_needed", "draft_steps_metadata"]


def draft_pages_needed(context_len: int, block_size: int, num_steps: int) -> int:
    """Pages a branch owns for ``num_steps`` draft tokens after a prefix of ``context_len`` tokens (the prefix's
    partial last page included, see the module docstring)."""
    return -(-(context_len + num_steps) // block_size) - context_len // block_size


@dataclass
class DraftSteps:
    """The metadata of every draft step (module docstring: layout and pages).

    Attributes
    ----------
    steps : one :class:`CommonAttentionMetadata` per step, R = B * topk single-token requests each (row
        b * topk + k is branch k of request b); their tensors are views of the ones below.
    topk, num_steps : branches per request, steps.
    block_table : [R, W] int32 on the device (and ``block_table_cpu`` on the host), every step's block table.
    seq_lens : [num_steps, R] int32 on the device (``seq_lens_cpu`` on the host): context + s + 1 at step s.
    slot_mapping : [num_steps, R] int64 on the device: the cache slot of each row's token at each step.
    copy_src, copy_dst : [C] int64 on the device: pages to copy before step 0 (the prefix's partial last page into
        the first page of each branch that does not write in it).
    """

    steps: list[CommonAttentionMetadata]
    topk: int
    num_steps: int
    block_table: torch.Tensor
    block_table_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    slot_mapping: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor

    def copy_prefix_pages(self, kv_cache: torch.Tensor) -> None:
        """Copy the prefix's partial last page into each branch page that needs it, in one layer's cache (pages
        are dimension 0 of every layout: standard [num_blocks, 2, ...] and MLA [num_blocks, block_size, ...])."""
        if self.copy_src.numel():
            raw = kv_cache.view(torch.uint8)  # bytes: fp8 dtypes have no index_copy on every device
            raw.index_copy_(0, self.copy_dst, raw.index_select(0, self.copy_src))


def draft_steps_metadata(
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    branch_pages: Sequence[Sequence[Sequence[int]]],
    block_size: int,
    *,
    topk: int,
    num_steps: int,
    device: "torch.device | str" = "cpu",
) -> DraftSteps:
    """The metadata of ``num_steps`` draft steps with ``topk`` branches per request (see the module docstring).

    Parameters
    ----------
    context_lens : [B] the prefix length of each request (>= 1: the target has cached at least one token).
    block_tables : per request, the pages of its prefix (at least ceil(context / block_size)).
    branch_pages : per request, per branch (``topk`` lists), the branch's own pages, ``draft_pages_needed`` each;
        no page may serve two branches, and only the first page of a branch may be the prefix's partial page.
    block_size : tokens per page.

    Returns
    -------
    DraftSteps
    """
    num_reqs = len(context_lens)
    if topk < 1 or num_steps < 1:
        raise ValueError(f"topk and num_steps must be >= 1, got topk={topk}, num_steps={num_steps}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(block_tables) != num_reqs or len(branch_pages) != num_reqs:
        raise ValueError(f"context_lens, block_tables and branch_pages need one entry per request; got {num_reqs}, "
                         f"{len(block_tables)}, {len(branch_pages)}")
    rows, copies, owner = [], [], {}
    for b, (ctx, table, branches) in enumerate(zip(context_lens, block_tables, branch_pages)):
        if ctx < 1:
            raise ValueError(f"context_lens[{b}] = {ctx}: a draft step needs a cached prefix of >= 1 token")
        full, partial = divmod(ctx, block_size)
        if len(table) < full + (partial > 0):
            raise ValueError(f"block_tables[{b}] has {len(table)} pages; a prefix of {ctx} tokens needs "
                             f"{full + (partial > 0)}")
        if len(branches) != topk:
            raise ValueError(f"branch_pages[{b}] has {len(branches)} branches, topk is {topk}")
        need = draft_pages_needed(ctx, block_size, num_steps)
        shared = set(table[:full])
        partial_page = table[full] if partial else None
        for k, pages in enumerate(branches):
            pages = [int(p) for p in pages]
            if len(pages) != need:
                raise ValueError(f"branch_pages[{b}][{k}] has {len(pages)} pages; {num_steps} draft tokens after a "
                                 f"prefix of {ctx} tokens (block_size {block_size}) need {need}")
            for i, page in enumerate(pages):
                if page in shared or (page == partial_page and i > 0) or page in owner:
                    other = owner.get(page, "the prefix")
                    raise ValueError(f"branch_pages[{b}][{k}][{i}] = {page} is already used by {other}: each branch "
                                     "needs pages of its own")
                owner[page] = f"branch_pages[{b}][{k}]"
            if partial and pages[0] != partial_page:
                copies.append((partial_page, pages[0]))
            rows.append(list(table[:full]) + pages)
    num_rows = len(rows)
    width = max(len(r) for r in rows)
    table_cpu = torch.zeros(num_rows, width, dtype=torch.int32)
    for r, pages in enumerate(rows):
        table_cpu[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    ctx_rows = torch.tensor(context_lens, dtype=torch.int64).repeat_interleave(topk)  # [R]
    steps = torch.arange(num_steps, dtype=torch.int64)[:, None]  # [S, 1]
    pos = ctx_rows[None, :] + steps  # [S, R] position of each step's token
    page_col = (pos // block_size).clamp(max=width - 1)
    slots_cpu = (table_cpu.long().gather(1, page_col.T).T * block_size + pos % block_size).contiguous()  # [S, R]
    seq_lens_cpu = (pos + 1).to(torch.int32)
    qsl_cpu = torch.arange(num_rows + 1, dtype=torch.int32)
    device = torch.device(device)
    block_table = table_cpu.to(device)
    seq_lens = seq_lens_cpu.to(device)
    slot_mapping = slots_cpu.to(device)
    qsl = qsl_cpu.to(device)
    src = torch.tensor([c[0] for c in copies], dtype=torch.int64).to(device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.int64).to(device)
    max_ctx = max(context_lens)
    step_commons = [
        CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens[s], seq_lens_cpu=seq_lens_cpu[s],
            block_table=block_table, slot_mapping=slot_mapping[s], num_reqs=num_rows, num_actual_tokens=num_rows,
            max_query_len=1, max_seq_len=max_ctx + s + 1, block_table_cpu=table_cpu,
        )
        for s in range(num_steps)
    ]
    return DraftSteps(
        steps=step_commons, topk=topk, num_steps=num_steps, block_table=block_table, block_table_cpu=table_cpu,
        seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, slot_mapping=slot_mapping, copy_src=src, copy_dst=dst,
    )
