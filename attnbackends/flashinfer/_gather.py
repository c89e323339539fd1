"""The page-index gather of :mod:`.plan_inputs` as one Triton kernel (used for CUDA block tables)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gather_page_indices"]

_BLOCK = 256


@triton.jit
def _gather_page_indices_kernel(table_ptr, table_stride, kv_indptr_ptr, out_ptr, skip_pages, BLOCK: tl.constexpr):
    """Grid: (num_reqs, cdiv(max pages per request, BLOCK)). Program (r, c) copies chunk c of
    table[r, skip_pages : skip_pages + n_r] to out[kv_indptr[r] : kv_indptr[r + 1]]."""
    req = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + req)
    count = tl.load(kv_indptr_ptr + req + 1) - start
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    row = table_ptr + req.to(tl.int64) * table_stride + skip_pages
    tl.store(out_ptr + start + offs, tl.load(row + offs, mask=mask), mask=mask)


def gather_page_indices(
    table: torch.Tensor, kv_indptr: torch.Tensor, out: torch.Tensor, max_pages: int, skip_pages: int = 0
) -> None:
    """out[kv_indptr[r]:kv_indptr[r + 1]] = table[r, skip_pages:skip_pages + kv_indptr[r + 1] - kv_indptr[r]].

    table : [B, W] int32 (last dim contiguous); kv_indptr : [B + 1] int32; out : [kv_indptr[-1]] int32; all on one
    device. max_pages : an upper bound of kv_indptr[r + 1] - kv_indptr[r] (known on the host).
    """
    num_reqs = table.shape[0]
    if num_reqs == 0 or out.numel() == 0:
        return
    if table.stride(1) != 1:
        table = table.contiguous()
    grid = (num_reqs, triton.cdiv(max_pages, _BLOCK))
    _gather_page_indices_kernel[grid](table, table.stride(0), kv_indptr, out, skip_pages, BLOCK=_BLOCK)
