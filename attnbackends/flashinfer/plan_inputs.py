"""CommonAttentionMetadata -> the page-table arrays FlashInfer's ``plan()`` takes, in vectorised torch.

Pure functions, no flashinfer import: they run (and are tested) on the CPU. The per-request quantities come from the
CPU copies (``query_start_loc_cpu``, ``seq_lens_cpu``) with numpy; only ``paged_kv_indices`` needs the block table, and
it is gathered on the block table's own device at positions computed on the host, so nothing waits for the GPU.

FlashInfer's page table ("CSR" layout) for requests ``0..B-1``:

- ``qo_indptr[B + 1]``: query rows of request i are ``qo_indptr[i]:qo_indptr[i + 1]``;
- ``kv_indptr[B + 1]``: request i uses pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, in order;
- ``kv_last_page_len[B]``: tokens in the last page of request i, in ``[1, page_size]``;
- request i's KV length is ``(kv_indptr[i + 1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = [
    "PagedKVPlanInputs", "flat_page_positions", "paged_kv_plan_inputs", "plan_host_buffer_size", "shared_prefix_blocks",
]


@dataclass(frozen=True)
class PagedKVPlanInputs:
    """The page-table arrays of a run of consecutive requests.

    Attributes
    ----------
    qo_indptr : [B + 1] int32, CPU
    kv_indptr : [B + 1] int32, CPU
    kv_last_page_len : [B] int32, CPU
    kv_indices : [kv_indptr[-1]] int32, on the block table's device
    host_buffer : the 1-D int32 CPU tensor the host arrays live in (see :func:`paged_kv_plan_inputs`), or None
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_indices: torch.Tensor
    host_buffer: Optional[torch.Tensor] = None

    @property
    def num_reqs(self) -> int:
        return self.kv_last_page_len.shape[0]

    def to_device(self, device: torch.device) -> "PagedKVPlanInputs":
        """The four arrays on ``device`` by one asynchronous copy of the host buffer (whole batches only: the result
        of :func:`paged_kv_plan_inputs`, not of :meth:`select`). A ``kv_indices`` already there is kept."""
        if self.host_buffer is None:
            raise ValueError("to_device needs the arrays in their host buffer (a whole batch, not a select())")
        b = self.num_reqs + 1
        host_indices = self.kv_indices.device.type == "cpu"
        total = self.kv_indices.shape[0] if host_indices else 0
        on_device = self.host_buffer[: 3 * b + total].to(device, non_blocking=True)
        kv_indptr, kv_last_page_len, _, qo_indptr, kv_indices = on_device.split_with_sizes((b, b - 1, 1, b, total))
        return PagedKVPlanInputs(
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_last_page_len=kv_last_page_len,
            kv_indices=kv_indices if host_indices else self.kv_indices,
        )

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


def plan_host_buffer_size(num_reqs: int, total_pages: int) -> int:
    """int32 elements of the host buffer :func:`paged_kv_plan_inputs` needs for a batch."""
    return 3 * (num_reqs + 1) + 2 * total_pages


#: Column numbers 0, 1, 2, ... (read-only; sliced to a block table's width).
_COLUMNS = np.arange(1 << 16, dtype=np.int32)
_COLUMNS.setflags(write=False)


def _columns(width: int) -> np.ndarray:
    return _COLUMNS[:width] if width <= _COLUMNS.shape[0] else np.arange(width, dtype=np.int32)


def flat_page_positions(row_stride: int, skip_pages: int, keep: np.ndarray) -> np.ndarray:
    """[total] positions in a block table's storage (row r starts at ``r * row_stride``) of the pages that ``keep``
    [B, width] selects from columns ``skip_pages ..``, in row-major order."""
    num_reqs, width = keep.shape
    row_start = np.arange(skip_pages, skip_pages + num_reqs * row_stride, row_stride, dtype=np.int64)
    return (row_start[:, None] + _columns(width))[keep]


def paged_kv_plan_inputs(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    skip_pages: int = 0,
    pin_memory: bool = False,
    host_buffer: Optional[torch.Tensor] = None,
    block_table_cpu: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
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
    pin_memory : put the host arrays in pinned memory (on CUDA hosts) so the copies to the GPU are async.
    host_buffer : a 1-D int32 CPU tensor to hold the host arrays (a builder's persistent pinned buffer), used when
        it has :func:`plan_host_buffer_size` elements; the caller must not reuse it while copies from it may be
        pending. Otherwise a new one is allocated; either way the result's ``host_buffer`` names it.
    block_table_cpu : optional host copy of ``block_table`` (same values; see CommonAttentionMetadata).
    max_seq_len : ``max(seq_lens_cpu)`` when the caller knows it (CommonAttentionMetadata does); saves a reduction.

    Returns
    -------
    PagedKVPlanInputs
        The host arrays are computed with numpy. ``kv_indices`` is gathered on the host when the block table is
        there (``block_table_cpu``, or a CPU ``block_table``): a host array that FlashInfer's ``plan()`` copies to
        the GPU with its other arrays. Otherwise it is one ``index_select`` of the block table on its device at
        positions computed on the host (copied asynchronously from pinned memory). No host-device synchronisation.

        The host buffer holds, in this order, ``kv_indptr`` [B + 1], ``kv_last_page_len`` [B], one spare element,
        ``qo_indptr`` [B + 1], then (host gather) ``kv_indices``: ``host_buffer[:3 * (B + 1) + total_pages]`` is
        every host array of the plan in one piece, which :func:`.fast_plan` copies to the GPU with one copy.
    """
    num_reqs = seq_lens_cpu.shape[0]
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, the batch has {num_reqs} requests")
    # Host time matters here (once per step, small batches): numpy on views of one buffer, few torch calls.
    seq_lens = seq_lens_cpu.numpy()
    num_pages = (seq_lens + (block_size - 1)) // block_size  # [B] pages holding each request's tokens
    if skip_pages:
        num_pages -= skip_pages
        if num_reqs and num_pages.min() < 1:
            raise ValueError(f"skip_pages={skip_pages} leaves a request without pages")
    b = num_reqs + 1
    # kv_indptr first: its last entry is the total, which sizes the buffer (a small scratch array until then).
    indptr = np.empty(b, dtype=np.int32)
    indptr[0] = 0
    np.cumsum(num_pages, out=indptr[1:])
    total = int(indptr[-1])
    needed = plan_host_buffer_size(num_reqs, total)
    if host_buffer is None or host_buffer.shape[0] < needed:
        host_buffer = torch.empty(needed + needed // 4, dtype=torch.int32, pin_memory=pin_memory)
    host = host_buffer.numpy()
    host[:b] = indptr
    last_page_len = host[b : 2 * b - 1]  # seq_len - (pages - 1) * block_size, in [1, block_size]
    np.subtract(seq_lens, (num_pages + (skip_pages - 1)) * block_size, out=last_page_len)
    host[2 * b : 3 * b] = query_start_loc_cpu.numpy()

    # Request r's pages are columns skip_pages .. skip_pages + num_pages[r] - 1 of its row: a boolean mask over the
    # table's first columns selects them, in row-major order, which is kv_indices' order.
    if not num_reqs:
        width = 0
    elif max_seq_len is not None:
        width = (max_seq_len + block_size - 1) // block_size - skip_pages
    else:
        width = int(num_pages.max())
    if skip_pages + width > block_table.shape[1]:
        raise ValueError(
            f"block_table has {block_table.shape[1]} columns, a request needs {skip_pages + width} pages"
        )
    keep = _columns(width) < num_pages[:, None]  # [B, width]
    if block_table_cpu is None and not block_table.is_cuda:
        block_table_cpu = block_table
    # One split gives every host array: kv_indptr, kv_last_page_len, spare, qo_indptr, kv_indices, positions.
    parts = host_buffer[:needed].split_with_sizes((b, num_reqs, 1, b, total, total))
    if block_table_cpu is not None:  # gather on the host, into the pinned buffer that plan() copies from
        table = block_table_cpu.numpy()[:num_reqs, skip_pages : skip_pages + width]
        host[3 * b : 3 * b + total] = table[keep]  # (numpy casts a wider integer table)
        kv_indices = parts[4]
    else:  # gather on the device at flat positions of the table's storage
        table = block_table[:num_reqs]
        if table.stride(-1) != 1 or table.dtype != torch.int32:
            table = table.to(torch.int32).contiguous()
        host[3 * b + total : 3 * b + 2 * total] = flat_page_positions(table.stride(0), skip_pages, keep)
        storage = table.as_strided(((num_reqs - 1) * table.stride(0) + table.shape[1],) if num_reqs else (0,), (1,))
        kv_indices = storage.index_select(0, parts[5].to(table.device, non_blocking=pin_memory))
    return PagedKVPlanInputs(
        qo_indptr=parts[3],
        kv_indptr=parts[0],
        kv_last_page_len=parts[1],
        kv_indices=kv_indices,
        host_buffer=host_buffer,
    )


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
