"""FlashInfer's page table from a block table and the KV lengths: its definition on the host, and the kernels that
build it on the GPU.

For requests ``0..B-1`` with KV lengths ``seq_lens``, each request's first ``skip_pages`` pages left out (cascade
levels skip a shared prefix): request r has ``n_r = ceil(seq_lens[r] / page_size) - skip_pages`` pages,
``kv_indptr = [0, n_0, n_0 + n_1, ...]``, ``kv_last_page_len[r] = seq_lens[r] - (skip_pages + n_r - 1) * page_size``
and ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]] = block_table[r, skip_pages : skip_pages + n_r]``.

- :func:`csr_page_table` (``kv_indptr``, ``kv_last_page_len``) and :func:`gather_page_ids_on_host` (``kv_indices``):
  numpy on the host; every host path calls them (:mod:`.plan_inputs`, the kernels' CPU stand-ins).
- :func:`decode_page_table`: the whole table of a pure-decode batch, on the device from the device KV lengths (the
  host computes only the ``kv_indptr`` FlashInfer's scheduler reads).
- :func:`gather_page_ids`: ``kv_indices`` alone, on the device, from a ``kv_indptr`` the host computed.

The kernels do the O(pages) work in one launch: the host's cost is one launch whatever the number of pages
(benchmarks/NOTES.md). On CUDA (and on the CPU under ``TRITON_INTERPRET=1``) Triton runs them; other CPU tensors go
through the host functions.

Given the cache's page count ``num_blocks``, both kernels contain the page ids they copy
(:mod:`attnbackends.ops.page_guard`): an id outside ``[0, num_blocks)`` is written as page 0, so FlashInfer never reads
outside the cache, and the first one is recorded in the device's fault record (request, block-table column, page id),
raised as a PageTableError at the next check point. Without it (a block table with a host copy, which the guard
checks before any kernel) they copy the ids as they are.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ..launch import DirectLauncher
from ...platform import is_triton_interpreted
from ..launch_math import cdiv, next_power_of_2
from ..page_guard import contain_page_ids, fault_record, record_first_bad_page, safe_page

__all__ = [
    "DECODE_TABLE_MAX_REQS", "csr_page_table", "decode_page_table", "gather_page_ids", "gather_page_ids_on_host",
]

_BLOCK = 256  # page ids per program

#: Most requests :func:`decode_page_table` takes (each program sums the page counts of the requests before its own).
DECODE_TABLE_MAX_REQS = 4096


#: Column numbers 0, 1, 2, ... (read-only; sliced to a block table's width).
_COLUMNS = np.arange(1 << 16, dtype=np.int32)
_COLUMNS.setflags(write=False)


def csr_page_table(
    seq_lens: np.ndarray, page_size: int, kv_indptr: np.ndarray, kv_last_page_len: Optional[np.ndarray] = None, *,
    skip_pages: int = 0,
) -> np.ndarray:
    """Write ``kv_indptr`` [B + 1] int32 and, when given, ``kv_last_page_len`` [B] int32 of B requests from their KV
    lengths ``seq_lens`` [B] (integer, each >= 1), on the host (the module docstring's definition); return their page
    counts [B] (seq_lens' dtype), ``skip_pages`` left out (the caller checks that each request keeps one)."""
    num_pages = (seq_lens + (page_size - 1)) // page_size
    if skip_pages:
        num_pages -= skip_pages
    kv_indptr[0] = 0
    np.add.accumulate(num_pages, out=kv_indptr[1:])  # (np.cumsum, the same, costs twice the host time)
    if kv_last_page_len is not None:
        np.subtract(seq_lens, (num_pages + (skip_pages - 1)) * page_size, out=kv_last_page_len)
    return num_pages


def gather_page_ids_on_host(
    block_table: np.ndarray, num_pages: np.ndarray, out: np.ndarray, *, skip_pages: int = 0,
    width: Optional[int] = None,
) -> None:
    """Write the page ids of B requests to ``out`` [sum(num_pages)] int32, in request order, on the host: request r's
    ``num_pages[r]`` ([B] integer, as :func:`csr_page_table` returns them) from column ``skip_pages`` of its row of
    ``block_table`` [>= B, >= skip_pages + width] (integer; a wider dtype is narrowed). ``width``: ``max(num_pages)``
    or more, when the caller knows it."""
    if width is None:
        width = int(num_pages.max()) if num_pages.shape[0] else 0
    # Request r's pages are columns skip_pages .. skip_pages + num_pages[r] - 1 of its row: a boolean mask over the
    # table's first columns selects them, in row-major order, which is kv_indices' order.
    columns = _COLUMNS[:width] if width <= _COLUMNS.shape[0] else np.arange(width, dtype=np.int32)
    table = block_table[: num_pages.shape[0], skip_pages : skip_pages + width]
    out[:] = table[columns < num_pages[:, None]]


# Nothing is specialised on values or alignment, so one compiled kernel per (device, table dtype) serves every call
# and later calls can launch it directly (ops.launch.DirectLauncher).
@triton.jit
def _copy_page_ids(table_ptr, table_row_stride, req, skip_pages, out_ptr, start, count, num_blocks, fault_ptr,
                   fault_flag_ptr, BLOCK: tl.constexpr, CONTAIN: tl.constexpr):
    """Block ``tl.program_id(1)`` of request ``req``'s page ids: ``table[req, skip_pages + c]`` to
    ``out[start + c]`` for the columns ``c < count`` of that block; CONTAIN: ids outside ``[0, num_blocks)`` are
    recorded and written as page 0."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < count
    row = table_ptr + req.to(tl.int64) * table_row_stride + skip_pages
    page = tl.load(row + cols, mask=mask)
    if CONTAIN:
        record_first_bad_page(page, skip_pages + cols, mask, num_blocks, req, fault_ptr, fault_flag_ptr)
        page = safe_page(page, num_blocks)
    tl.store(out_ptr + start + cols, page, mask=mask)


@triton.jit(
    do_not_specialize=["table_row_stride", "skip_pages", "num_blocks"],
    do_not_specialize_on_alignment=["table_ptr", "kv_indptr_ptr", "out_ptr", "fault_ptr", "fault_flag_ptr"],
)
def _gather_page_ids_kernel(table_ptr, table_row_stride, kv_indptr_ptr, out_ptr, skip_pages, num_blocks, fault_ptr,
                            fault_flag_ptr, BLOCK: tl.constexpr, CONTAIN: tl.constexpr):
    """Grid: (num_reqs, cdiv(table columns, BLOCK)). Program (r, j) copies request r's page ids j*BLOCK.. (j+1)*BLOCK
    - 1, those that exist."""
    req = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + req)
    count = tl.load(kv_indptr_ptr + req + 1) - start
    _copy_page_ids(table_ptr, table_row_stride, req, skip_pages, out_ptr, start, count, num_blocks, fault_ptr,
                   fault_flag_ptr, BLOCK, CONTAIN)


def _fault_args(device: torch.device, num_blocks: Optional[int]) -> tuple:
    """The kernels' (num_blocks, fault record, host flag) arguments, then CONTAIN (whether ``num_blocks`` is
    given; without it the kernels read neither)."""
    rec = fault_record(device)
    return (0 if num_blocks is None else int(num_blocks)), rec.record, rec.host_flag, num_blocks is not None


def gather_page_ids(
    block_table: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor, *, skip_pages: int = 0,
    num_blocks: Optional[int] = None,
) -> torch.Tensor:
    """Fill ``out`` with the page ids of every request, in request order, and return it.

    Parameters
    ----------
    block_table : [>= B, width] int32 or int64; row r lists request r's pages (stride 1 along a row).
    kv_indptr : [B + 1] int32 on ``block_table``'s device; request r takes ``kv_indptr[r + 1] - kv_indptr[r]`` pages
        from column ``skip_pages`` on. The caller guarantees ``skip_pages + count <= width`` (the host checks it
        from its copy of the lengths: reading this device array back would synchronise).
    out : [kv_indptr[-1]] int32 on the same device; written, not read.
    num_blocks : pages of the KV cache the ids index: ids outside ``[0, num_blocks)`` are recorded and written as
        page 0 (module docstring). None: copied as they are.
    """
    if block_table.device != kv_indptr.device or out.device != kv_indptr.device:
        raise ValueError(
            f"block_table ({block_table.device}), kv_indptr ({kv_indptr.device}) and out ({out.device}) must share "
            "a device"
        )
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be 2-D with unit column stride, got shape {tuple(block_table.shape)}, "
                         f"strides {block_table.stride()}")
    if kv_indptr.dtype != torch.int32 or out.dtype != torch.int32:
        raise ValueError(f"kv_indptr and out must be int32, got {kv_indptr.dtype} and {out.dtype}")
    num_reqs = kv_indptr.shape[0] - 1
    if num_reqs > block_table.shape[0]:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, kv_indptr describes {num_reqs} requests")
    if num_reqs <= 0 or out.shape[0] == 0:
        return out
    if block_table.is_cuda or is_triton_interpreted():
        grid = (num_reqs, cdiv(max(block_table.shape[1] - skip_pages, 1), _BLOCK), 1)
        *fault_args, contain = _fault_args(block_table.device, num_blocks)
        args = (block_table, block_table.stride(0), kv_indptr, out, skip_pages, *fault_args)
        _gather_launcher.launch_on(block_table.device, (block_table.device.index, block_table.dtype, contain), grid,
                                   args, (_BLOCK, contain))
        return out
    indptr = kv_indptr.numpy()
    gather_page_ids_on_host(block_table.numpy(), indptr[1:] - indptr[:-1], out.numpy(), skip_pages=skip_pages)
    return out if num_blocks is None else contain_page_ids(out, num_blocks)


@triton.jit(
    do_not_specialize=["table_row_stride", "num_reqs", "page_size", "num_blocks"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "table_ptr", "kv_indptr_ptr", "last_page_len_ptr",
                                    "kv_indices_ptr", "fault_ptr", "fault_flag_ptr"],
)
def _decode_page_table_kernel(seq_lens_ptr, table_ptr, table_row_stride, kv_indptr_ptr, last_page_len_ptr,
                              kv_indices_ptr, num_reqs, page_size, num_blocks, fault_ptr, fault_flag_ptr,
                              BLOCK: tl.constexpr, REQS: tl.constexpr, CONTAIN: tl.constexpr):
    """Grid: (num_reqs, cdiv(table columns, BLOCK)). Program (r, j) finds request r's first page in the CSR layout
    (the pages of requests 0..r-1, summed over all REQS >= num_reqs lengths), writes kv_indptr[r + 1] and
    kv_last_page_len[r] (j == 0; kv_indptr[0] too for r == 0) and copies request r's page ids j*BLOCK ..."""
    req = tl.program_id(0)
    reqs = tl.arange(0, REQS)
    lens = tl.load(seq_lens_ptr + reqs, mask=reqs < num_reqs, other=0)
    start = tl.sum(tl.where(reqs < req, (lens + page_size - 1) // page_size, 0))
    seq_len = tl.load(seq_lens_ptr + req)
    count = (seq_len + page_size - 1) // page_size
    if tl.program_id(1) == 0:
        tl.store(kv_indptr_ptr + req + 1, start + count)
        tl.store(last_page_len_ptr + req, seq_len - (count - 1) * page_size)
        if req == 0:
            tl.store(kv_indptr_ptr, start)  # 0
    _copy_page_ids(table_ptr, table_row_stride, req, 0, kv_indices_ptr, start, count, num_blocks, fault_ptr,
                   fault_flag_ptr, BLOCK, CONTAIN)


def decode_page_table(
    seq_lens: torch.Tensor, block_table: torch.Tensor, page_size: int, kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor, kv_indices: torch.Tensor, *, num_blocks: Optional[int] = None,
) -> None:
    """FlashInfer's whole page table for B requests, built on their device by one kernel from the KV lengths.

    Parameters
    ----------
    seq_lens : [>= B] int32, request r's KV length in ``seq_lens[r]`` (>= 1; entries past B are ignored).
    block_table : [>= B, width] int32 or int64 (unit column stride); row r lists request r's pages.
    page_size : tokens per page.
    kv_indptr : [B + 1] int32, written: request r's pages are ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``.
    kv_last_page_len : [B] int32, written: tokens in request r's last page.
    kv_indices : [>= sum of pages] int32, written.
    num_blocks : as in :func:`gather_page_ids`.

    The caller checks on the host, from its copy of the lengths, that ``width`` columns hold every request's pages
    (reading ``seq_lens`` here would synchronise). Requests are one program row each, and every program sums the page
    counts of the requests before its own: fine for the batch sizes of a decode step (B <= DECODE_TABLE_MAX_REQS).
    """
    num_reqs = kv_last_page_len.shape[0]
    tensors = (("seq_lens", seq_lens), ("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len),
               ("kv_indices", kv_indices))
    for name, t in tensors:
        if t.dtype != torch.int32 or t.device != block_table.device:
            raise ValueError(f"{name} must be int32 on {block_table.device}, got {t.dtype} on {t.device}")
    if kv_indptr.shape[0] != num_reqs + 1 or seq_lens.shape[0] < num_reqs or block_table.shape[0] < num_reqs:
        raise ValueError(
            f"for {num_reqs} requests: kv_indptr needs {num_reqs + 1} entries (has {kv_indptr.shape[0]}), seq_lens "
            f"and block_table at least {num_reqs} (have {seq_lens.shape[0]}, {block_table.shape[0]})"
        )
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be 2-D with unit column stride, got shape {tuple(block_table.shape)}")
    if num_reqs > DECODE_TABLE_MAX_REQS:
        raise ValueError(f"decode_page_table takes at most {DECODE_TABLE_MAX_REQS} requests, got {num_reqs}")
    if num_reqs == 0:
        kv_indptr.zero_()
        return
    grid = (num_reqs, cdiv(block_table.shape[1], _BLOCK), 1)
    *fault_args, contain = _fault_args(block_table.device, num_blocks)
    args = (seq_lens, block_table, block_table.stride(0), kv_indptr, kv_last_page_len, kv_indices, num_reqs,
            page_size, *fault_args)
    constexprs = (_BLOCK, next_power_of_2(num_reqs), contain)
    if block_table.is_cuda or is_triton_interpreted():
        _decode_table_launcher.launch_on(block_table.device, (block_table.device.index, block_table.dtype, constexprs),
                                         grid, args, constexprs)
    else:
        csr_page_table(seq_lens[:num_reqs].numpy(), page_size, kv_indptr.numpy(), kv_last_page_len.numpy())
        total = int(kv_indptr[-1])
        gather_page_ids(block_table, kv_indptr, kv_indices[:total], num_blocks=num_blocks)


_gather_launcher = DirectLauncher(_gather_page_ids_kernel, ("BLOCK", "CONTAIN"))
_decode_table_launcher = DirectLauncher(_decode_page_table_kernel, ("BLOCK", "REQS", "CONTAIN"))
