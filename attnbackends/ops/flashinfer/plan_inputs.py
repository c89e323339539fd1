"""CommonAttentionMetadata -> the page-table arrays FlashInfer's ``plan()`` takes, with numpy on the host.

No flashinfer import: this runs (and is tested) on the CPU. The per-request quantities come from the CPU copies
(``query_start_loc_cpu``, ``seq_lens_cpu``); only ``paged_kv_indices`` needs the block table. It is gathered on the
host from the table's host copy when the batch has few pages, else on the table's device by one kernel, so nothing
waits for the GPU and the host work stays O(batch) for large batches. The arrays' definition and the kernels are
:mod:`.page_ids`'s.

FlashInfer's page table ("CSR" layout) for requests ``0..B-1``:

- ``qo_indptr[B + 1]``: query rows of request i are ``qo_indptr[i]:qo_indptr[i + 1]``;
- ``kv_indptr[B + 1]``: request i uses pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, in order;
- ``kv_last_page_len[B]``: tokens in the last page of request i, in ``[1, page_size]``;
- request i's KV length is ``(kv_indptr[i + 1] - kv_indptr[i] - 1) * page_size + kv_last_page_len[i]``.

The host arrays of a whole batch live in one (pinned) host buffer, in this order: ``kv_indptr`` [B + 1],
``kv_last_page_len`` [B], one spare element, ``qo_indptr`` [B + 1], then, when gathered on the host, ``kv_indices``.
``host_buffer[:3 * (B + 1) + pages]`` is the whole page table in one piece, which :class:`DevicePlanBuffer` copies to
the GPU with one copy.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from ..page_guard import contain_page_ids
from .page_ids import csr_page_table, decode_page_table, gather_page_ids, gather_page_ids_on_host

__all__ = [
    "DEFAULT_HOST_GATHER_MAX_PAGES", "DevicePlanBuffer", "PagedKVPlanInputs", "PlanArrays", "paged_kv_plan_inputs",
    "shared_prefix_blocks",
]

#: Up to this many pages in a batch, page ids are gathered on the host (numpy, copied with the rest of the page
#: table); above it, on the device (one kernel launch, a fixed host cost); see benchmarks/NOTES.md.
DEFAULT_HOST_GATHER_MAX_PAGES = 4096


class PlanArrays(NamedTuple):
    """FlashInfer's four page-table arrays, on one device (int32)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_indices: torch.Tensor


class PagedKVPlanInputs:
    """The page table of a run of consecutive requests.

    Attributes
    ----------
    num_reqs : B.
    num_pages : kv_indptr[-1], the pages of all B requests.
    kv_indices : [num_pages] int32: on the device when ``on_device`` is set (its ``kv_indices``) or when gathered
        there, else on the host.
    host_buffer : the 1-D int32 CPU tensor of a whole batch (layout in the module docstring), or None after
        :meth:`select`.
    on_device : the four arrays on the GPU (a :class:`DevicePlanBuffer`'s views), or None.
    qo_indptr, kv_indptr : [B + 1] int32 on the CPU; kv_last_page_len : [B] int32 on the CPU (views made on use; a
        table built on the device by :meth:`DevicePlanBuffer.decode_table` keeps only ``host_kv_indptr``).
    """

    __slots__ = ("num_reqs", "num_pages", "kv_indices", "host_buffer", "on_device", "_host", "_host_kv_indptr")

    def __init__(
        self, num_reqs: int, num_pages: int, kv_indices: torch.Tensor, *, host_buffer: Optional[torch.Tensor] = None,
        on_device: Optional[PlanArrays] = None,
        host_arrays: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
        host_kv_indptr: Optional[torch.Tensor] = None,
    ) -> None:
        self.num_reqs = num_reqs
        self.num_pages = num_pages
        self.kv_indices = kv_indices
        self.host_buffer = host_buffer
        self.on_device = on_device
        self._host = host_arrays  # (qo_indptr, kv_indptr, kv_last_page_len), or None: views of host_buffer
        self._host_kv_indptr = host_kv_indptr  # the host kv_indptr alone (a table built on the device)

    def _host_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._host is None:
            if self.host_buffer is None:
                raise ValueError("this page table was built on the device (DevicePlanBuffer.decode_table): its host "
                                 "arrays are not kept, only kv_indptr (host_kv_indptr) and on_device")
            b = self.num_reqs + 1
            kv_indptr, last, _, qo = self.host_buffer[: 3 * b].split_with_sizes((b, b - 1, 1, b))
            self._host = (qo, kv_indptr, last)
        return self._host

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self._host_arrays()[0]

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self._host_arrays()[1]

    @property
    def kv_last_page_len(self) -> torch.Tensor:
        return self._host_arrays()[2]

    def host_kv_indptr(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs + 1] int32 CPU: the start of ``kv_indptr`` (requests ``0:num_reqs``), one view."""
        if self.host_buffer is not None:
            return self.host_buffer[: num_reqs + 1]
        kv_indptr = self._host_kv_indptr if self._host_kv_indptr is not None else self.kv_indptr
        return kv_indptr if kv_indptr.shape[0] == num_reqs + 1 else kv_indptr[: num_reqs + 1]

    def select(self, start: int, end: int) -> "PagedKVPlanInputs":
        """Requests ``start:end`` alone, with both indptrs rebased to 0 (CPU index reads only; the device arrays are
        not carried over)."""
        if start == 0 and end == self.num_reqs:
            return self
        qo_all, kv_all, last_all = self._host_arrays()
        qo = qo_all[start : end + 1]
        kv = kv_all[start : end + 1]
        kv_begin, kv_end = int(kv[0]), int(kv[-1])
        if start:
            pin = qo.is_pinned()
            qo = torch.sub(qo, qo[0], out=torch.empty_like(qo, pin_memory=pin))
            kv = torch.sub(kv, kv_begin, out=torch.empty_like(kv, pin_memory=pin))
        return PagedKVPlanInputs(
            end - start, kv_end - kv_begin, self.kv_indices[kv_begin:kv_end], host_arrays=(qo, kv, last_all[start:end])
        )


class DevicePlanBuffer:
    """One persistent int32 buffer on the GPU that receives each batch's page table by one asynchronous copy.

    Its arrays are overwritten by the next batch's copy, which is enqueued on the stream after every kernel of the
    previous batch (the FlashInfer wrappers hold one plan at a time anyway: build the next batch after the last layer
    of this one). The small arrays' views are made once per batch size. It grows when a batch needs more room.
    """

    def __init__(self, device: "torch.device | str", initial_elements: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self._buffer = torch.zeros(initial_elements, dtype=torch.int32, device=self.device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # decode_table: kv_indptr on the host (read synchronously by FlashInfer's scheduler, so one is reused), and
        # the decodes' qo_indptr 0, 1, ..., B here; by B + 1.
        self._host_indptr = torch.zeros(1, dtype=torch.int32)
        self._host_indptr_views: dict[int, torch.Tensor] = {}
        self._aranges: dict[int, torch.Tensor] = {}

    def _views_for(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        views = self._views.get(b)
        if views is None:
            kv_indptr, last, _, qo = self._buffer[: 3 * b].split_with_sizes((b, b - 1, 1, b))
            views = self._views[b] = (qo, kv_indptr, last)
        return views

    def _grow(self, elements: int) -> None:
        if elements > self._buffer.shape[0]:
            self._buffer = torch.zeros(max(elements, 2 * self._buffer.shape[0]), dtype=torch.int32, device=self.device)
            self._views.clear()

    def decode_table(
        self, seq_lens_cpu: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
        max_seq_len: int, num_blocks: Optional[int] = None,
    ) -> PagedKVPlanInputs:
        """The page table of a pure-decode batch (one query token per request), built here by one kernel
        (:func:`.page_ids.decode_page_table`) from the device copy of the KV lengths; the host computes only
        ``kv_indptr`` from ``seq_lens_cpu`` (FlashInfer's scheduler reads it there). Much less host work than
        :func:`paged_kv_plan_inputs` + :meth:`stage`; the result keeps no other host arrays, and its host
        ``kv_indptr`` is overwritten by the next call.

        seq_lens_cpu : [B] int32 CPU; seq_lens : the same on this device (entries past B ignored);
        block_table : [>= B, width] on this device; max_seq_len : max(seq_lens_cpu).
        num_blocks : the cache's pages: page ids outside them are contained (:func:`.page_ids.gather_page_ids`).
        """
        num_reqs = seq_lens_cpu.shape[0]
        b = num_reqs + 1
        width = (max_seq_len + block_size - 1) // block_size
        if width > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns, a request needs {width} pages")
        if block_table.shape[0] < num_reqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, the batch has {num_reqs} requests")
        host_indptr = self._host_indptr_views.get(b)
        if host_indptr is None:
            if b > self._host_indptr.shape[0]:
                self._host_indptr = torch.zeros(max(b, 2 * self._host_indptr.shape[0]), dtype=torch.int32)
                self._host_indptr_views.clear()
            host_indptr = self._host_indptr_views[b] = self._host_indptr[:b]
        csr_page_table(seq_lens_cpu.numpy(), block_size, host_indptr.numpy())
        total = int(host_indptr[num_reqs])
        self._grow(3 * b + total)
        _, kv_indptr, last = self._views_for(b)
        kv_indices = self._buffer[3 * b : 3 * b + total]
        decode_page_table(seq_lens, block_table, block_size, kv_indptr, last, kv_indices, num_blocks=num_blocks)
        qo_indptr = self._aranges.get(b)
        if qo_indptr is None:
            qo_indptr = self._aranges[b] = torch.arange(b, dtype=torch.int32, device=self.device)
        return PagedKVPlanInputs(num_reqs, total, kv_indices, host_kv_indptr=host_indptr,
                                 on_device=PlanArrays(qo_indptr, kv_indptr, last, kv_indices))

    def stage(
        self, host_buffer: torch.Tensor, num_reqs: int, num_pages: int, *, host_gathered: bool,
        block_table: Optional[torch.Tensor] = None, skip_pages: int = 0, num_blocks: Optional[int] = None,
    ) -> PlanArrays:
        """Copy a whole batch's host buffer (layout in the module docstring) here, and gather the page ids from
        ``block_table`` (on this device) when they were not gathered on the host, contained to ``num_blocks``
        pages when given. Returns views of this buffer."""
        b = num_reqs + 1
        self._grow(3 * b + num_pages)
        copied = 3 * b + num_pages if host_gathered else 3 * b
        self._buffer[:copied].copy_(host_buffer[:copied], non_blocking=True)
        qo, kv_indptr, last = self._views_for(b)
        kv_indices = self._buffer[3 * b : 3 * b + num_pages]
        if not host_gathered:
            gather_page_ids(block_table, kv_indptr, kv_indices, skip_pages=skip_pages, num_blocks=num_blocks)
        return PlanArrays(qo, kv_indptr, last, kv_indices)


def paged_kv_plan_inputs(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    skip_pages: int = 0,
    pin_memory: bool = False,
    block_table_cpu: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    device_buffer: Optional[DevicePlanBuffer] = None,
    host_gather_max_pages: int = DEFAULT_HOST_GATHER_MAX_PAGES,
    num_blocks: Optional[int] = None,
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
    pin_memory : put the host arrays in pinned memory (on CUDA hosts) so the copies to the GPU are asynchronous.
        The buffer comes from torch's caching host allocator, which does not hand it out again before the copies
        out of it have run.
    block_table_cpu : optional host copy of ``block_table`` (same values; see CommonAttentionMetadata).
    max_seq_len : ``max(seq_lens_cpu)`` when the caller knows it (CommonAttentionMetadata does); saves a reduction.
    device_buffer : when given, the page table is also copied there (``on_device`` of the result).
    host_gather_max_pages : with a GPU block table and its host copy, gather on the host up to this many pages.
    num_blocks : the cache's pages: page ids outside them are written as page 0 (on the device also recorded as a
        fault, :func:`.page_ids.gather_page_ids`). None: copied as they are (the page guard checks a host table
        before any kernel runs).

    Returns
    -------
    PagedKVPlanInputs
        Host arrays computed with numpy. ``kv_indices`` is gathered on the host when the block table is there (a
        CPU table, or its host copy for a batch of at most ``host_gather_max_pages`` pages), else by one kernel on
        the table's device. No host-device synchronisation.
    """
    num_reqs = seq_lens_cpu.shape[0]
    if block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, the batch has {num_reqs} requests")
    # Host time matters here (once per step, small batches): numpy on views of one buffer, few torch calls.
    # kv_indptr and kv_last_page_len first, in a scratch array laid out as the host buffer's start: the total pages
    # (kv_indptr's last entry) size that buffer.
    b = num_reqs + 1
    scratch = np.empty(2 * b, dtype=np.int32)
    num_pages = csr_page_table(seq_lens_cpu.numpy(), block_size, scratch[:b], scratch[b : 2 * b - 1],
                               skip_pages=skip_pages)
    if skip_pages and num_reqs and num_pages.min() < 1:
        raise ValueError(f"skip_pages={skip_pages} leaves a request without pages")
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
    total = int(scratch[num_reqs])
    if block_table_cpu is None and not block_table.is_cuda:
        block_table_cpu = block_table
    host_gather = block_table_cpu is not None and (total <= host_gather_max_pages or not block_table.is_cuda)
    if not host_gather and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    host_buffer = torch.empty(3 * b + (total if host_gather else 0), dtype=torch.int32, pin_memory=pin_memory)
    host = host_buffer.numpy()
    host[: 2 * b] = scratch
    host[2 * b : 3 * b] = query_start_loc_cpu.numpy()
    if host_gather:
        gather_page_ids_on_host(block_table_cpu.numpy(), num_pages, host[3 * b :], skip_pages=skip_pages,
                                width=width)
        if num_blocks is not None:
            contain_page_ids(host_buffer[3 * b :], num_blocks)
    on_device = None
    if device_buffer is not None:
        on_device = device_buffer.stage(host_buffer, num_reqs, total, host_gathered=host_gather,
                                        block_table=block_table, skip_pages=skip_pages, num_blocks=num_blocks)
        kv_indices = on_device.kv_indices
    elif host_gather:
        kv_indices = host_buffer[3 * b :]
    else:
        kv_indptr = host_buffer[:b].to(block_table.device, non_blocking=pin_memory)
        kv_indices = torch.empty(total, dtype=torch.int32, device=block_table.device)
        gather_page_ids(block_table, kv_indptr, kv_indices, skip_pages=skip_pages, num_blocks=num_blocks)
    return PagedKVPlanInputs(num_reqs, total, kv_indices, host_buffer=host_buffer, on_device=on_device)


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
