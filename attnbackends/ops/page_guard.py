"""Page-table safety: no page id or slot outside the cache is ever dereferenced, and every bad one is reported.

Detection, once per step where the builder was made with the cache's ``num_blocks`` (its ``build`` calls
:func:`guard_block_table`), else in every layer's ``forward`` (:func:`attnbackends.validation.check_forward_inputs`):

- When the block table has a host copy (``common.block_table_cpu``, or the table itself lives on the CPU), the used
  entries are range-checked on the host before any kernel runs: a :class:`PageTableError` (a ``ValueError``) names
  the request, the block-table slot and the page id. The table itself is checked where it lives on the CPU; a host
  copy stands for a GPU table only where one producer made both (``common.host_checked``: ``build_common_metadata``,
  ``PersistentBatch``); otherwise the device table is scanned as well, as below.
- Otherwise one small kernel scans the used entries on the device and records the first bad entry it meets in the
  device's :class:`FaultRecord` without a host-device sync. The next check point raises it: the next step's guard,
  a builder's ``build`` (:func:`raise_pending_faults`) or the engine calling :func:`raise_pending_faults` itself.

Containment, always: every kernel that turns a page id into a cache address replaces an id outside
``[0, num_blocks)`` by page 0 first (:func:`safe_page`: the Triton attention and MLA decode kernels, the MLA context
gather, the FlashInfer page-id builders, which also record it with :func:`record_first_bad_page`;
:func:`contain_page_ids` for page ids already gathered, e.g. FlashInfer MLA's planned ones), and the KV-cache writes skip a slot outside the cache and
record it in the same fault record. So a bad table can give one step of wrong output before its error is raised
(device detection only), but never an illegal memory access.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ..platform import is_triton_interpreted
from .launch_math import cdiv, next_power_of_2

logger = logging.getLogger(__name__)

__all__ = [
    "FaultRecord",
    "PageTableError",
    "fault_record",
    "guard_block_table",
    "check_slots_host",
    "contain_page_ids",
    "has_host_table",
    "raise_faults_before_gathering",
    "raise_pending_faults",
    "record_fault",
    "record_first_bad_page",
    "safe_page",
]

FAULT_PAGE = tl.constexpr(1)  # payload: request, block-table slot, page id
FAULT_SLOT = tl.constexpr(2)  # payload: token, slot, cache slots


class PageTableError(ValueError):
    """A page id in the block table or a slot in the slot mapping points outside the KV cache."""


@triton.jit
def safe_page(page, num_blocks):
    """``page`` where it lies in ``[0, num_blocks)``, else page 0 (any valid page: the step's error is reported by
    the guard; the load must stay inside the cache)."""
    return tl.where((page >= 0) & (page < num_blocks), page, 0)


@triton.jit
def record_fault(record_ptr, host_flag_ptr, kind, a, b, c):
    """Record one fault unless one is already recorded: ``record[1:5] = kind, a, b, c`` under the lock
    ``record[0]``, then raise the host-visible flag (a plain store into pinned host memory on CUDA)."""
    if tl.atomic_cas(record_ptr, tl.cast(0, tl.int64), tl.cast(1, tl.int64)) == 0:
        tl.store(record_ptr + 1, tl.cast(kind, tl.int64))
        tl.store(record_ptr + 2, tl.cast(a, tl.int64))
        tl.store(record_ptr + 3, tl.cast(b, tl.int64))
        tl.store(record_ptr + 4, tl.cast(c, tl.int64))
        tl.store(host_flag_ptr, 1)


@triton.jit
def record_first_bad_page(page, cols, used, num_blocks, req, record_ptr, host_flag_ptr):
    """Record the first of ``page`` [BLOCK] (block-table columns ``cols`` of request ``req``, where ``used``) that
    lies outside ``[0, num_blocks)``, unless one is already recorded; returns whether there was one."""
    bad = used & ((page < 0) | (page >= num_blocks))
    first = tl.min(tl.where(bad, cols, 2147483647), 0)
    found = first < 2147483647
    if found:
        bad_page = tl.sum(tl.where(cols == first, page, 0), 0)
        record_fault(record_ptr, host_flag_ptr, FAULT_PAGE, req, first, bad_page)
    return found


@triton.jit
def _scan_block_table_kernel(block_table_ptr, stride_bt, seq_lens_ptr, num_blocks, block_size, record_ptr,
                             host_flag_ptr, BLOCK: tl.constexpr):
    """Grid: (num_reqs,). Request r's used entries ``block_table[r, :cdiv(seq_lens[r], block_size)]``; records the
    first one outside ``[0, num_blocks)``."""
    req = tl.program_id(0)
    n_pages = (tl.load(seq_lens_ptr + req) + block_size - 1) // block_size
    row = block_table_ptr + req.to(tl.int64) * stride_bt
    start = 0
    while start < n_pages:
        cols = start + tl.arange(0, BLOCK)
        used = cols < n_pages
        page = tl.load(row + cols, mask=used, other=0)
        if record_first_bad_page(page, cols, used, num_blocks, req, record_ptr, host_flag_ptr):
            start = n_pages
        else:
            start += BLOCK


@triton.jit
def _contain_page_ids_kernel(page_ids_ptr, count, num_blocks, BLOCK: tl.constexpr):
    """Grid: (cdiv(count, BLOCK),). ``page_ids[:count]`` through :func:`safe_page`, in place."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    page = tl.load(page_ids_ptr + offs, mask=mask)
    tl.store(page_ids_ptr + offs, safe_page(page, num_blocks), mask=mask)


@dataclass
class FaultRecord:
    """One device's fault record, written by kernels, read by :func:`raise_pending_faults`.

    Attributes
    ----------
    record : [5] int64 on the device: lock (0 free, 1 taken), kind, then three payload values.
    host_flag : [1] int32 the kernels set to 1 after recording; pinned host memory the device writes directly on
        CUDA (the host reads it without a sync), the same kind of tensor as ``record`` elsewhere.
    """

    record: torch.Tensor
    host_flag: torch.Tensor
    _flag_view: np.ndarray

    @classmethod
    def allocate(cls, device: torch.device) -> "FaultRecord":
        record = torch.zeros(5, dtype=torch.int64, device=device)
        if device.type == "cuda":
            host_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        else:
            host_flag = torch.zeros(1, dtype=torch.int32, device=device)
        return cls(record, host_flag, host_flag.numpy())

    @property
    def pending(self) -> bool:
        """A fault has been recorded and not yet raised (reads host memory only)."""
        return bool(self._flag_view[0])

    def take(self) -> tuple[int, int, int, int]:
        """(kind, a, b, c) of the recorded fault, and clear the record (synchronises the device: error path)."""
        if self.record.is_cuda:
            torch.cuda.synchronize(self.record.device)
        kind, a, b, c = (int(v) for v in self.record[1:].tolist())
        self.record.zero_()
        self._flag_view[0] = 0
        return kind, a, b, c


_records: dict[torch.device, FaultRecord] = {}


def fault_record(device: torch.device) -> FaultRecord:
    """The fault record of ``device`` (one per device, allocated on first use)."""
    rec = _records.get(device)
    if rec is None:
        if device.type == "cuda" and device.index is None:
            return fault_record(torch.device("cuda", torch.cuda.current_device()))
        rec = _records[device] = FaultRecord.allocate(device)
    return rec


def _page_message(req: int, slot: int, page: int, cache: str) -> str:
    return f"block_table[{req}, {slot}] = {page} is outside {cache} (request {req}, block-table slot {slot})"


def _fault_message(kind: int, a: int, b: int, c: int) -> str:
    if kind == FAULT_PAGE:
        return (_page_message(a, b, c, "the KV cache's pages")
                + "; a kernel that read it used page 0 in its place")
    return (f"slot_mapping[{a}] = {b} is outside the KV cache's {c} slots (and not -1, padding); "
            "that token's key and value were not written")


def check_slots_host(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise :class:`PageTableError` for the first slot outside ``[-1, num_slots)`` (a host read of the slots: the
    torch write paths' check)."""
    bad = torch.nonzero((slot_mapping < -1) | (slot_mapping >= num_slots))
    if bad.numel():
        i = int(bad[0])
        raise PageTableError(_fault_message(FAULT_SLOT, i, int(slot_mapping[i]), num_slots))


def raise_pending_faults(device: "torch.device | str") -> None:
    """Raise :class:`PageTableError` for a fault a kernel recorded on ``device`` since the last call (cheap when
    there is none: one read of host memory, no sync)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rec = _records.get(device)
    if rec is not None and rec.pending:
        raise PageTableError(_fault_message(*rec.take()))


def raise_faults_before_gathering(common) -> None:
    """For code that indexes the cache with the batch's page ids in torch (the reference backends): where the table
    lives on a GPU and :func:`guard_block_table` scanned it (no host copy, or a host copy no producer vouched for),
    the scan recorded faults without a sync, and torch's indexing would assert on the device on a bad id; wait for
    the scan and raise its fault first. Free for host tables and producer-made copies (checked before any
    kernel)."""
    device = common.block_table.device
    if device.type != "cpu" and (_host_table(common) is None or not common.host_checked):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        raise_pending_faults(device)


def _host_table(common) -> Optional[torch.Tensor]:
    """The table to check on the host: the kernels' own where it lives on the CPU, else its host copy."""
    if common.block_table.device.type == "cpu":
        return common.block_table
    return common.block_table_cpu


def has_host_table(common) -> bool:
    """Whether the batch's block table is on the host (a CPU table, or its host copy ``block_table_cpu``): then
    :func:`guard_block_table` checks it before any kernel runs, and page ids gathered from it need no containment."""
    return _host_table(common) is not None


def contain_page_ids(page_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Replace every page id of ``page_ids`` outside ``[0, num_blocks)`` by page 0, in place, and return it.

    For page ids gathered from a device-only block table before the cache size was known (the guard's scan of that
    table records the fault). One kernel on CUDA (and under the interpreter), no host sync.

    page_ids : [n] int32 or int64, contiguous.
    """
    count = page_ids.numel()
    if count == 0:
        return page_ids
    if page_ids.is_cuda or is_triton_interpreted():
        block = min(next_power_of_2(count), 1024)
        _contain_page_ids_kernel[(cdiv(count, block),)](page_ids, count, num_blocks, BLOCK=block)
    else:
        page_ids.masked_fill_((page_ids < 0) | (page_ids >= num_blocks), 0)
    return page_ids


def _check_host(table: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, num_blocks: int, block_size: int) -> None:
    pages = (seq_lens.numpy()[:num_reqs].astype(np.int64) + block_size - 1) // block_size
    width = int(pages.max())
    if width > table.shape[1]:
        i = int(np.argmax(pages > table.shape[1]))
        raise PageTableError(f"block_table has {table.shape[1]} columns; request {i} with seq_len "
                             f"{int(seq_lens[i])} needs {int(pages[i])} pages")
    used = table.numpy()[:num_reqs, :width]
    if used.size == 0 or (used.min() >= 0 and used.max() < num_blocks):
        return
    bad = ((used < 0) | (used >= num_blocks)) & (np.arange(width)[None, :] < pages[:, None])
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise PageTableError(_page_message(i, j, int(used[i, j]), f"[0, {num_blocks}), the KV cache's pages"))


def guard_block_table(common, num_blocks: int, block_size: int) -> None:
    """Range-check the block-table entries the batch uses against a cache of ``num_blocks`` pages; raises
    :class:`PageTableError` for a fault found now (a host table) or recorded by an earlier step. A device-only table
    is scanned by one kernel that records its first bad entry without a host-device sync (raised at the next check
    point); so is a device table whose host copy no producer made from the same source (``common.host_checked``
    unset: a hand-built batch), since the kernels read the device table. Reads ``common``, writes nothing to it:
    call it whenever the table may have changed (every build). A batch whose producer range-checked its pages
    against this cache size (``common.pages_checked_for``) is not scanned again.

    Parameters
    ----------
    common : the batch's :class:`~attnbackends.metadata.CommonAttentionMetadata`; request r uses
        ``block_table[r, :cdiv(seq_lens[r], block_size)]``.
    num_blocks : pages in the layer's KV cache (``kv_cache.shape[0]``).
    block_size : tokens per page.
    """
    device = common.block_table.device
    raise_pending_faults(device)
    if common.num_reqs and common.pages_checked_for != num_blocks:
        host = _host_table(common)
        if host is not None:
            _check_host(host, common.seq_lens_cpu, common.num_reqs, num_blocks, block_size)
        if host is None or (host is not common.block_table and not common.host_checked):
            # The kernels read the device table: where no producer made it and its host copy from one source,
            # the copy vouches for nothing, so the device table is scanned too.
            rec = fault_record(device)
            width = common.block_table.shape[1]
            _scan_block_table_kernel[(common.num_reqs,)](
                common.block_table, common.block_table.stride(0), common.seq_lens, num_blocks, block_size,
                rec.record, rec.host_flag, BLOCK=min(next_power_of_2(max(width, 1)), 1024),
            )
