"""Dequantising pages of a cache with page scales into a 16-bit paged cache: the scratch the 16-bit prefill kernels
read for a quantised layer (:mod:`.dequant_prefill` plans it).

:func:`dequantise_pages` copies pages ``pages[0] .. pages[P - 1]`` of a cache of any format with page scales
(:mod:`attnbackends.ops.kv_layout`) to pages ``0 .. P - 1`` of a ``[P, 2, block_size, num_kv_heads, head_size]``
float16 / bfloat16 cache, every key and value as a reader sees it (:func:`.kv_load.read_kv_tile`: the format's exact
read of :mod:`attnbackends.ops.kv_quant`, rounded once to the scratch's dtype). :func:`dequantise_pages_torch` is
the same in torch (:func:`attnbackends.ops.kv_quant.dequantize_token_heads` over the scale views).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.kv_layout import kv_scale_views
from ..ops.kv_quant import dequantize_token_heads
from ..ops.launch import DirectLauncher
from ..ops.launch_math import next_power_of_2
from ..platform import is_triton_interpreted
from ..spec import KVCacheFormat
from .kv_load import kernel_kv_format, read_kv_tile

__all__ = ["DequantConfig", "dequant_config", "dequantise_pages", "dequantise_pages_torch"]


@triton.jit(do_not_specialize=["k_global", "v_global"])
def _dequant_pages_kernel(
    key_ptr, value_ptr, pages_ptr, out_ptr, k_global, v_global,
    stride_kb, stride_ks, stride_kh, stride_vh, stride_ob, stride_okv, stride_os, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """Grid (P, num_kv_heads): program (p, h) reads page ``pages_ptr[p]``'s keys and values of KV head h (the
    cache's key / value views ``key_ptr`` / ``value_ptr``, strides in storage elements) and writes them, read, to
    page p of ``out_ptr`` ([P, 2, BLOCK_SIZE, num_kv_heads, HEAD_SIZE], strides page / K-V / slot / head)."""
    p = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.arange(0, BLOCK_SIZE)
    blk = tl.load(pages_ptr + p + slot * 0)  # [BLOCK_SIZE], the page id in every lane
    k_off = blk.to(tl.int64) * stride_kb + slot * stride_ks
    offs_d = tl.arange(0, HEAD_PAD)
    k, v = read_kv_tile(key_ptr, value_ptr, k_off, k_off, blk, slot, kv_head, slot < BLOCK_SIZE, offs_d, stride_kb,
                        stride_ks, stride_kh, stride_vh, k_global, v_global, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                        BLOCK_SIZE, False, KV_FORMAT)
    dst = out_ptr + p.to(tl.int64) * stride_ob + kv_head * stride_oh
    d_ok = offs_d < HEAD_SIZE
    k_dst = dst + slot[None, :] * stride_os + offs_d[:, None]  # [HEAD_PAD, BLOCK_SIZE]
    v_dst = dst + stride_okv + slot[:, None] * stride_os + offs_d[None, :]  # [BLOCK_SIZE, HEAD_PAD]
    tl.store(k_dst, k.to(out_ptr.dtype.element_ty), mask=d_ok[:, None])
    tl.store(v_dst, v.to(out_ptr.dtype.element_ty), mask=d_ok[None, :])


_launcher = DirectLauncher(_dequant_pages_kernel, ("HEAD_SIZE", "HEAD_PAD", "BLOCK_SIZE", "KV_FORMAT"))


@dataclass(frozen=True)
class DequantConfig:
    """The kernel's constexprs (HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, KV_FORMAT) and warps for one layer's cache."""

    constexprs: tuple[int, int, int, int]
    num_warps: int


def dequant_config(fmt: KVCacheFormat, head_size: int, block_size: int) -> DequantConfig:
    """The launch config for a cache of ``fmt`` (with page scales) of ``head_size`` and pages of ``block_size``
    tokens (a power of two: a page is one tile)."""
    if not fmt.scales_in_pages:
        raise ValueError(f"dequantise_pages reads formats with page scales, got {fmt.value}")
    if block_size & (block_size - 1):
        raise ValueError(f"dequantise_pages needs pages of a power-of-two number of tokens, got {block_size}")
    head_pad = max(next_power_of_2(head_size), 16)
    warps = 4 if block_size * head_pad >= 2048 else 2
    return DequantConfig((head_size, head_pad, block_size, kernel_kv_format(fmt)), warps)


def dequantise_pages(config: DequantConfig, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     pages: torch.Tensor, out: torch.Tensor, k_global: float = 1.0, v_global: float = 1.0) -> None:
    """Write pages ``pages`` of a quantised cache, read, to ``out`` (no checks).

    Parameters
    ----------
    config : :func:`dequant_config` of the cache.
    key_cache, value_cache : the cache's key and value views ``kv_cache[:, 0]``, ``kv_cache[:, 1]``
        ([num_blocks, block_size, num_kv_heads, head_size or head_size // 2] in the format's storage dtype; the
        scales beside the pages).
    pages : [P] int32, the pages to read (ids within the cache).
    out : [>= P, 2, block_size, num_kv_heads, head_size] float16 / bfloat16, unit stride in the head dimension.
    k_global, v_global : NVFP4's global scales (the impl's ``k_scale`` / ``v_scale``); the other formats ignore them.
    """
    num_pages = pages.shape[0]
    if num_pages == 0:
        return
    ks, vs = key_cache.stride(), value_cache.stride()
    os_ = out.stride()
    args = (key_cache, value_cache, pages, out, float(k_global), float(v_global), ks[0], ks[1], ks[2], vs[2],
            os_[0], os_[1], os_[2], os_[3])
    key = (config.constexprs, key_cache.dtype, out.dtype, ks, os_, is_triton_interpreted())
    _launcher(key, (num_pages, key_cache.shape[2], 1), args, config.constexprs, config.num_warps, 2)


def dequantise_pages_torch(kv_cache: torch.Tensor, layout, pages: torch.Tensor, dtype: torch.dtype,
                           k_global: float = 1.0, v_global: float = 1.0) -> torch.Tensor:
    """Torch :func:`dequantise_pages`: pages ``pages`` ([P] integer) of ``kv_cache`` (page layout ``layout``,
    :func:`attnbackends.ops.kv_layout.kv_page_layout`) read, as a new [P, 2, block_size, num_kv_heads, head_size]
    tensor of ``dtype``."""
    k_sc, v_sc = kv_scale_views(kv_cache, layout)
    pages = pages.long()
    fmt = layout.format
    k = dequantize_token_heads(kv_cache[pages, 0], k_sc[pages], fmt, k_global, dtype)
    v = dequantize_token_heads(kv_cache[pages, 1], v_sc[pages], fmt, v_global, dtype)
    return torch.stack((k, v), dim=1)
