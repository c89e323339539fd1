"""CommonAttentionMetadata -> the page-table arrays FlashInfer's ``plan()`` takes, in vectorised torch.

Pure functions, no flashinfer import: they run (and are tested) on the CPU. The per-request quantities come from the
CPU copies (``query_start_loc_cpu``, ``seq_lens_cpu``); only ``paged_kv_indices`` needs the block table, and it is
gathered on the block table's own device with sizes known on the host, so nothing waits for the GPU.

FlashInfer's page table ("CSR" layout) for requests ``0..B-1``:

- ``qo_indptr[B + 1]``: query rows of request i are ``qo_indptr[i]:qo_indptr[i + 1]``;
- ``kv_indptr[B + 1]``: request i uses pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, in order;
- ``kv_last_page_len[B]``: tokens in the last page of request i, in ``[1, page_size]``;
- request i's KV length is ``(kv_indptr[i + 1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PagedKVPlanInputs", "paged_kv_plan_inputs", "shared_prefix_blocks"]


@dataclass(frozen=True)
class PagedKVPlanInputs:
    """The page-table arrays of a run of consecutive requests.

    Attributes
    ----------
    qo_indptr : [B + 1] int32, CPU
    kv_indptr : [B + 1] int32, CPU
    kv_last_page_len : [B] int32, CPU
    kv_indices : [kv_indptr[-1]] int32, on the block table's device
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_indices: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    def select(self, start: int, end: int) -> "PagedKVPlanInputs":
        """Requests ``start:end`` alone, with both indptrs rebased to 0 (CPU index reads only)."""
        if start == 0 and end == self.num_reqs:
            return self
        qo = self.qo_indptr[start : end + 1]
        kv = self.kv_indptr[start : end + 1]
        kv_begin, kv_end = int(kv[0]), int(kv[-1])
        if start:
            pin = qo.is_pinned()
            qo = torch.sub(qo, qo[0], out=torch.empty_like(qo, pin_memory=pin))
            kv = torch.sub(kv, kv_begin, out=torch.empty_like(kv, pin_memory=pin))
        return PagedKVPlanInputs(
            qo_indptr=qo,
            kv_indptr=kv,
            kv_last_page_len=self.kv_last_page_len[start:end],
            kv_indices=self.kv_indices[kv_begin:kv_end],
        )


def paged_kv_plan_inputs(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    skip_pages: int = 0,
    pin_memory: bool = False,
    host_buffer: Optional[torch.Tensor] = None,
) -> PagedKVPlanInputs:
    """FlashInfer's page-table arrays for a batch.

    Parameters
    ----------
    query_start_loc_cpu : [B + 1] int32 on the CPU.
    seq_lens_cpu : [B] int32 on the CPU; every entry >= 1.
    block_table : [B, max_blocks_per_req] int32 on any device; row i lists request i's pages in order.
    block_size : tokens per page.
    skip_pages : leave out each request's first ``skip_pages`` pages (the shared prefix that cascade attention
        serves from its own level); every request must keep at least one page.
    pin_memory : put the host arrays in pinned memory (on CUDA hosts) so plan()'s copies to the GPU are async.
    host_buffer : [4, >= B + 1] int32 CPU tensor to hold the host arrays (a builder's persistent pinned buffer);
        the caller must not reuse it while copies from it may be pending. Default: a new one.

    Returns
    -------
    PagedKVPlanInputs
        ``kv_indices`` is gathered on ``block_table.device`` (one Triton kernel on CUDA); its length is computed on
        the host, so there is no host-device synchronisation.
    """
    num_reqs = seq_lens_cpu.shape[0]
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, the batch has {num_reqs} requests")
    table = block_table[:num_reqs]
    seq_lens = seq_lens_cpu if seq_lens_cpu.dtype == torch.int32 else seq_lens_cpu.to(torch.int32)
    num_pages = (seq_lens + (block_size - 1)) // block_size  # [B] pages holding each request's tokens
    if skip_pages:
        num_pages -= skip_pages
        if num_reqs and int(num_pages.min()) < 1:
            raise ValueError(f"skip_pages={skip_pages} leaves a request without pages")

    # Rows: 0 kv_indptr, 1 index jumps (CPU gather), 2 kv_last_page_len, 3 qo_indptr (when a copy is needed).
    if host_buffer is None or host_buffer.shape[1] < num_reqs + 1:
        host_buffer = torch.empty((4, num_reqs + 1), dtype=torch.int32, pin_memory=pin_memory)
    kv_indptr, last_page_len = host_buffer[0, : num_reqs + 1], host_buffer[2, :num_reqs]
    kv_indptr[0] = 0
    torch.cumsum(num_pages, 0, dtype=torch.int32, out=kv_indptr[1:])
    torch.remainder(seq_lens - 1, block_size, out=last_page_len)
    last_page_len += 1
    total = int(kv_indptr[num_reqs])
    if query_start_loc_cpu.dtype == torch.int32 and (not pin_memory or query_start_loc_cpu.is_pinned()):
        qo_indptr = query_start_loc_cpu
    else:
        qo_indptr = host_buffer[3, : num_reqs + 1]
        qo_indptr.copy_(query_start_loc_cpu)

    if table.is_cuda:
        kv_indices = _gather_page_indices_cuda(table, kv_indptr, total, int(num_pages.max()), skip_pages)
    else:
        kv_indices = _gather_page_indices_torch(table, kv_indptr, num_pages, host_buffer[1], total, skip_pages)
    return PagedKVPlanInputs(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_last_page_len=last_page_len,
        kv_indices=kv_indices,
    )


def _gather_page_indices_torch(
    table: torch.Tensor, kv_indptr: torch.Tensor, num_pages: torch.Tensor, jumps: torch.Tensor, total: int,
    skip_pages: int,
) -> torch.Tensor:
    """Page k of the concatenated kv_indices belongs to request r (kv_indptr[r] <= k < kv_indptr[r + 1]) and is
    element flat[k] = k + r * width + skip_pages - kv_indptr[r] of the flattened block table: a running sum of ones
    that jumps by width - num_pages[r - 1] at request r's first page (skip_pages - 1 at k = 0)."""
    num_reqs, width = table.shape
    jumps = jumps[:num_reqs]
    jumps[:1] = skip_pages - 1
    torch.sub(width, num_pages[:-1], out=jumps[1:])
    flat = torch.ones(total, dtype=torch.int32, device=table.device)
    flat.index_add_(0, kv_indptr[:num_reqs], jumps)
    return table.reshape(-1).index_select(0, torch.cumsum(flat, 0, dtype=torch.int32))


def _gather_page_indices_cuda(
    table: torch.Tensor, kv_indptr: torch.Tensor, total: int, max_pages: int, skip_pages: int
) -> torch.Tensor:
    """One kernel: programs (r, chunk) copy request r's pages into its kv_indptr slice."""
    from ._gather import gather_page_indices

    kv_indptr_dev = kv_indptr.to(table.device, non_blocking=True)
    out = torch.empty(total, dtype=torch.int32, device=table.device)
    gather_page_indices(table, kv_indptr_dev, out, max_pages, skip_pages)
    return out


def shared_prefix_blocks(
    block_table_cpu: torch.Tensor, context_lens_cpu: torch.Tensor, block_size: int
) -> int:
    """How many leading pages every request of a batch shares, counting only pages full of cached context.

    An engine that keeps its block tables on the host calls this (or knows the answer from its prefix cache) and
    passes ``common_prefix_len = blocks * block_size`` to the FlashInfer builder to allow cascade attention.

    block_table_cpu : [B, max_blocks_per_req] int32 on the CPU; context_lens_cpu : [B] tokens cached before this step.
    """
    if block_table_cpu.device.type != "cpu":
        raise ValueError("shared_prefix_blocks reads a CPU block table (reading a GPU one would synchronise)")
    num_reqs = context_lens_cpu.shape[0]
    if num_reqs == 0:
        return 0
    limit = min(int(context_lens_cpu.min()) // block_size, block_table_cpu.shape[1])
    if limit == 0:
        return 0
    table = block_table_cpu[:num_reqs, :limit]
    same = (table == table[:1]).all(dim=0)  # [limit]
    return int(torch.cumprod(same.to(torch.int32), 0).sum())
