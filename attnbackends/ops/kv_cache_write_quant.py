"""Writing and reading the KV-cache formats whose scales are computed on write and stored beside their pages
(per-token-head fp8 / int8 / int4, NVFP4): the arithmetic is :mod:`.kv_quant`'s, the layout :mod:`.kv_layout`'s.

:func:`reshape_and_cache_quant` quantises each new token-head (its scale from its own values) and writes values and
scales together: a Triton kernel on CUDA (and under ``TRITON_INTERPRET=1``) that computes the same bits as the torch
path (:func:`reshape_and_cache_quant_torch`). Slot -1 is padding (skipped); a slot outside the cache is skipped and
recorded as a fault, as for every other cache write. :func:`gather_kv_quant_torch` reads one request back.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Union

import torch
import triton
import triton.language as tl

from ..platform import is_triton_interpreted
from ..spec import KVCacheFormat
from .kv_layout import KVPageLayout, kv_scale_views
from .kv_quant import FORMAT_QMAX, dequantize_token_heads, quantize_nvfp4, quantize_per_token_head, quantize_token_heads
from .launch import DirectLauncher
from .launch_math import cdiv, next_power_of_2
from .page_guard import FAULT_SLOT, check_slots_host, fault_record, raise_pending_faults, record_fault

__all__ = ["gather_kv_quant_torch", "reshape_and_cache_quant", "reshape_and_cache_quant_torch"]

Scale = Union[float, torch.Tensor]

_FP8, _INT8, _INT4, _NVFP4 = 1, 2, 3, 4
_WRITE_FORMATS = {
    KVCacheFormat.FP8_PER_TOKEN_HEAD: _FP8,
    KVCacheFormat.INT8_PER_TOKEN_HEAD: _INT8,
    KVCacheFormat.INT4_PER_TOKEN_HEAD: _INT4,
    KVCacheFormat.NVFP4: _NVFP4,
}


def _layout_of(kv_cache: torch.Tensor, fmt: KVCacheFormat) -> KVPageLayout:
    num_blocks, _, block_size, num_kv_heads, stored = kv_cache.shape
    head_size = stored * 2 if fmt.packed else stored
    value_bytes = stored
    scale_bytes = head_size // 16 if fmt is KVCacheFormat.NVFP4 else 4
    return KVPageLayout(fmt, block_size, num_kv_heads, head_size, value_bytes, scale_bytes, kv_cache.stride(0))


def _as_float(scale: Scale) -> float:
    return float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)


def reshape_and_cache_quant_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, fmt: KVCacheFormat, k_scale: Scale = 1.0,
                                  v_scale: Scale = 1.0) -> None:
    """Pure-torch :func:`reshape_and_cache_quant` (syncs the host: for CPUs and tests)."""
    layout = _layout_of(kv_cache, fmt)
    block_size = layout.block_size
    slot_mapping = slot_mapping[: key.shape[0]]
    n = slot_mapping.shape[0]
    check_slots_host(slot_mapping, kv_cache.shape[0] * block_size)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk, off = slots // block_size, slots % block_size
    scale_views = kv_scale_views(kv_cache, layout)
    raw = kv_cache.view(torch.uint8)
    for i, (x, g) in enumerate(((key[:n][valid], k_scale), (value[:n][valid], v_scale))):
        values, scales = quantize_token_heads(x, fmt, _as_float(g))
        raw[blk, i, off] = values.view(torch.uint8)
        scale_views[i].view(torch.uint8)[blk, off] = scales.view(torch.uint8)


def gather_kv_quant_torch(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, fmt: KVCacheFormat,
                          k_scale: Scale = 1.0, v_scale: Scale = 1.0, dtype: torch.dtype = torch.float32
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one request, read exactly (:mod:`.kv_quant`).

    kv_cache : a cache of format ``fmt`` (``allocate_kv_cache``'s view); block_row : the request's page ids.
    Returns key, value : [seq_len, num_kv_heads, head_size] each, in ``dtype``."""
    layout = _layout_of(kv_cache, fmt)
    pages = block_row[: -(-seq_len // layout.block_size)].long()
    out = []
    for i, (scales, g) in enumerate(zip(kv_scale_views(kv_cache, layout), (k_scale, v_scale))):
        values = kv_cache[pages, i].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, stored]
        sc = scales[pages].flatten(0, 1)[:seq_len]
        out.append(dequantize_token_heads(values, sc, fmt, _as_float(g), dtype))
    return out[0], out[1]


@triton.jit(do_not_specialize=["num_tokens", "num_slots"],
            do_not_specialize_on_alignment=["slot_mapping_ptr", "fault_ptr", "fault_flag_ptr", "k_sc_ptr", "v_sc_ptr"])
def _quant_write_kernel(
    key_ptr, value_ptr, cache_ptr, k_sc_ptr, v_sc_ptr, slot_mapping_ptr, k_global, v_global,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv, stride_cs, stride_ch,
    stride_sb, stride_ss, stride_sh, num_kv_heads, num_tokens, num_slots, fault_ptr, fault_flag_ptr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr, FORMAT: tl.constexpr, QMAX: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid: (cdiv(num_tokens, TOKENS_PER_PROGRAM), cdiv(num_kv_heads, HEADS_PER_PROGRAM)). Each program quantises
    ``[TOKENS_PER_PROGRAM, HEADS_PER_PROGRAM, HEAD_PAD]`` keys and values and writes them with their scales
    (``k_sc_ptr``/``v_sc_ptr``: the scale views of :func:`attnbackends.ops.kv_layout.kv_scale_views`, strides
    page / slot / head). FORMAT: 1 fp8, 2 int8, 3 int4 (per token and head), 4 NVFP4 (``k_global``/``v_global``)."""
    toks = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    in_batch = toks < num_tokens
    slots = tl.load(slot_mapping_ptr + toks, mask=in_batch, other=-1)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_d = tl.arange(0, HEAD_PAD)
    row_mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_SIZE)  # [H, D]
    load_mask = in_batch[:, None, None] & row_mask[None, :, :]
    k = tl.load(key_ptr + toks[:, None, None] * stride_kt + heads[None, :, None] * stride_kh + offs_d[None, None, :],
                mask=load_mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + toks[:, None, None] * stride_vt + heads[None, :, None] * stride_vh
                + offs_d[None, None, :], mask=load_mask, other=0.0).to(tl.float32)
    bad = (slots < -1) | (slots >= num_slots)
    if tl.program_id(1) == 0:
        if tl.max(bad.to(tl.int32), 0) > 0:
            first = tl.min(tl.where(bad, toks, num_tokens), 0)
            record_fault(fault_ptr, fault_flag_ptr, FAULT_SLOT, first,
                         tl.sum(tl.where(toks == first, slots, 0), 0), num_slots)
    write = (slots >= 0) & (slots < num_slots)
    safe = tl.where(write, slots, 0)
    page = (safe // BLOCK_SIZE).to(tl.int64)
    slot = safe % BLOCK_SIZE
    head_ok = heads < num_kv_heads
    if FORMAT == 4 or FORMAT == 3:
        STORED: tl.constexpr = HEAD_PAD // 2
    else:
        STORED: tl.constexpr = HEAD_PAD
    offs_s = tl.arange(0, STORED)
    dst = (cache_ptr + page[:, None, None] * stride_cb + slot[:, None, None] * stride_cs
           + heads[None, :, None] * stride_ch + offs_s[None, None, :])
    store_mask = write[:, None, None] & head_ok[None, :, None] & (offs_s[None, None, :] < HEAD_SIZE // (HEAD_PAD // STORED))
    sc_row = page[:, None] * stride_sb + slot[:, None] * stride_ss + heads[None, :] * stride_sh  # [T, H]
    if FORMAT == 4:
        kq, ksc = quantize_nvfp4(k, k_global, HEAD_PAD // 16, INTERPRET)
        vq, vsc = quantize_nvfp4(v, v_global, HEAD_PAD // 16, INTERPRET)
        offs_g = tl.arange(0, HEAD_PAD // 16)
        sc_ptrs = sc_row[:, :, None] + offs_g[None, None, :]
        sc_mask = write[:, None, None] & head_ok[None, :, None] & (offs_g[None, None, :] < HEAD_SIZE // 16)
        tl.store(k_sc_ptr + sc_ptrs, ksc, mask=sc_mask)
        tl.store(v_sc_ptr + sc_ptrs, vsc, mask=sc_mask)
    else:
        kq, ksc = quantize_per_token_head(k, QMAX, FORMAT == 1, FORMAT == 3, INTERPRET)
        vq, vsc = quantize_per_token_head(v, QMAX, FORMAT == 1, FORMAT == 3, INTERPRET)
        sc_mask = write[:, None] & head_ok[None, :]
        tl.store(k_sc_ptr + sc_row, ksc, mask=sc_mask)
        tl.store(v_sc_ptr + sc_row, vsc, mask=sc_mask)
    tl.store(dst, kq.to(cache_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dst + stride_ckv, vq.to(cache_ptr.dtype.element_ty), mask=store_mask)


@lru_cache(maxsize=None)
def _quant_write_config(fmt: KVCacheFormat, head_size: int, num_kv_heads: int, block_size: int,
                        tokens_per_program: int) -> tuple[tuple, int, int]:
    """(constexprs, heads per program, num_warps) of the quantising write for one cache layout."""
    head_pad = max(next_power_of_2(head_size), 16)
    heads_per_program = min(next_power_of_2(num_kv_heads), max(1, 2048 // head_pad))
    qmax = FORMAT_QMAX.get(fmt, 0.0)
    constexprs = (head_size, head_pad, heads_per_program, block_size, tokens_per_program, _WRITE_FORMATS[fmt],
                  qmax, is_triton_interpreted())
    elements = tokens_per_program * heads_per_program * head_pad
    return constexprs, heads_per_program, 8 if elements >= 8192 else 4 if elements >= 1024 else 2


_quant_write_launcher = DirectLauncher(_quant_write_kernel, (
    "HEAD_SIZE", "HEAD_PAD", "HEADS_PER_PROGRAM", "BLOCK_SIZE", "TOKENS_PER_PROGRAM", "FORMAT", "QMAX", "INTERPRET"))


def reshape_and_cache_quant(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, fmt: KVCacheFormat, k_scale: Scale = 1.0,
                            v_scale: Scale = 1.0, *, use_triton: bool = True) -> None:
    """Quantise and write the new tokens' keys and values with their scales (no argument checks: see
    :func:`attnbackends.ops.kv_cache_write.reshape_and_cache`, which checks and dispatches here).

    key, value : [num_tokens, num_kv_heads, head_size]; kv_cache : a cache of format ``fmt`` as
    ``allocate_kv_cache`` returns it; slot_mapping : [n <= num_tokens] int64 (-1: padding);
    k_scale, v_scale : NVFP4's global scales (ignored by the per-token-head formats).
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if not use_triton:
        reshape_and_cache_quant_torch(key, value, kv_cache, slot_mapping, fmt, k_scale, v_scale)
        return
    layout = _layout_of(kv_cache, fmt)
    tokens_per_program = 1 if num_tokens < 1024 else 2
    constexprs, heads_per_program, num_warps = _quant_write_config(fmt, layout.head_size, layout.num_kv_heads,
                                                                   layout.block_size, tokens_per_program)
    k_sc, v_sc = kv_scale_views(kv_cache, layout)
    grid = (cdiv(num_tokens, tokens_per_program), cdiv(layout.num_kv_heads, heads_per_program), 1)
    faults = fault_record(kv_cache.device)
    strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv_cache.stride()[:4],
               *k_sc.stride()[:3])
    args = (key, value, kv_cache, k_sc, v_sc, slot_mapping, _as_float(k_scale), _as_float(v_scale), *strides,
            layout.num_kv_heads, num_tokens, kv_cache.shape[0] * layout.block_size, faults.record, faults.host_flag)
    launch_key = (constexprs, key.dtype, kv_cache.dtype, strides, key.data_ptr() % 16, value.data_ptr() % 16,
                  kv_cache.data_ptr() % 16)
    _quant_write_launcher(launch_key, grid, args, constexprs, num_warps, 3)
    if not kv_cache.is_cuda:
        raise_pending_faults(kv_cache.device)
