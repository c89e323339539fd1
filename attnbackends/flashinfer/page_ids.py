"""Gather FlashInfer's ``paged_kv_indices`` from a block table on the GPU: one kernel launch, no host work per page.

For request ``r`` the page ids are ``block_table[r, skip_pages : skip_pages + n_r]`` with
``n_r = kv_indptr[r + 1] - kv_indptr[r]``, written to ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]``. The host
computes only ``kv_indptr`` (O(batch)); the O(pages) copy runs on the device, so a build of 256 decodes at context
4096 (65k pages) costs the host one launch instead of a 65k-element gather.

On CUDA (and on the CPU under ``TRITON_INTERPRET=1``) a Triton kernel does it; other CPU tensors use torch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ..platform import _triton_interpret_env

__all__ = ["gather_page_ids"]

_BLOCK = 256  # page ids per program


# Nothing is specialised on values or alignment, so one compiled kernel per (device, table dtype) serves every call
# and later calls can launch it directly (see _launch).
@triton.jit(
    do_not_specialize=["table_row_stride", "skip_pages"],
    do_not_specialize_on_alignment=["table_ptr", "kv_indptr_ptr", "out_ptr"],
)
def _gather_page_ids_kernel(table_ptr, table_row_stride, kv_indptr_ptr, out_ptr, skip_pages, BLOCK: tl.constexpr):
    """Grid: (num_reqs, cdiv(table columns, BLOCK)). Program (r, j) copies request r's page ids j*BLOCK.. (j+1)*BLOCK
    - 1, those that exist."""
    req = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + req)
    count = tl.load(kv_indptr_ptr + req + 1) - start
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < count
    row = table_ptr + req.to(tl.int64) * table_row_stride + skip_pages
    tl.store(out_ptr + start + cols, tl.load(row + cols, mask=mask), mask=mask)


def gather_page_ids(
    block_table: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor, *, skip_pages: int = 0
) -> torch.Tensor:
    """Fill ``out`` with the page ids of every request, in request order, and return it.

    Parameters
    ----------
    block_table : [>= B, width] int32 or int64; row r lists request r's pages (stride 1 along a row).
    kv_indptr : [B + 1] int32 on ``block_table``'s device; request r takes ``kv_indptr[r + 1] - kv_indptr[r]`` pages
        from column ``skip_pages`` on. The caller guarantees ``skip_pages + count <= width`` (the host checks it
        from its copy of the lengths: reading this device array back would synchronise).
    out : [kv_indptr[-1]] int32 on the same device; written, not read.
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
    if block_table.is_cuda:
        _launch(block_table, kv_indptr, out, skip_pages, num_reqs)
        return out
    if _triton_interpret_env():
        _gather_page_ids_kernel[_grid(block_table, skip_pages, num_reqs)](
            block_table, block_table.stride(0), kv_indptr, out, skip_pages, BLOCK=_BLOCK
        )
        return out
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(num_reqs), counts)
    cols = torch.arange(out.shape[0]) - kv_indptr[:-1].long()[rows] + skip_pages
    out.copy_(block_table[rows, cols])
    return out


def _grid(block_table: torch.Tensor, skip_pages: int, num_reqs: int) -> tuple[int, int, int]:
    return num_reqs, triton.cdiv(max(block_table.shape[1] - skip_pages, 1), _BLOCK), 1


#: The compiled kernel per (device index, table dtype), after its first launch through the JIT.
_compiled: dict[tuple[Optional[int], torch.dtype], Any] = {}


def _launch(block_table: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor, skip_pages: int,
            num_reqs: int) -> None:
    """Launch on the current stream. The first launch per (device, table dtype) goes through the JIT, which compiles
    and returns the kernel; later ones launch that kernel directly (``compiled[grid](*args)``, Triton's launcher for
    a compiled kernel), skipping the JIT's per-call argument binding and cache lookup: a few microseconds of host
    time instead of ~15 on a step that is host-bound. Valid because nothing is specialised (the decorator)."""
    index = block_table.device.index
    if index is not None and index != torch.cuda.current_device():  # Triton launches on the current device's stream
        with torch.cuda.device(index):
            return _launch(block_table, kv_indptr, out, skip_pages, num_reqs)
    grid = _grid(block_table, skip_pages, num_reqs)
    args = (block_table, block_table.stride(0), kv_indptr, out, skip_pages)
    key = (index, block_table.dtype)
    compiled = _compiled.get(key)
    if compiled is None:
        _compiled[key] = _gather_page_ids_kernel[grid](*args, BLOCK=_BLOCK)
    else:
        compiled[grid](*args, _BLOCK)
