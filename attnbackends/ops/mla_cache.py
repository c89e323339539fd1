"""The MLA latent cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], one latent "KV head" per token.

Each slot holds c = [kv_c (Lkv) ; k_pe (R)] in the cache dtype; fp8 caches store saturate(c / k_scale) and read
stored * k_scale (one per-tensor scale for the whole latent vector).

New tokens are written by :func:`write_latent_token`, one token per call, from :func:`concat_and_cache_mla`'s
kernel and from the query absorption's launch of a decode-only ``triton_mla`` batch
(:func:`~attnbackends.mla.projection_kernels._mla_absorb_write_kernel`), which saves that batch the separate write.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import torch
import triton
import triton.language as tl

from .launch import DirectLauncher
from .launch_math import cdiv, next_power_of_2
from .page_guard import (
    FAULT_SLOT, check_slots_host, fault_record, raise_pending_faults, record_fault, safe_page,
)
from .quant import (
    FP8_DTYPES, dequantize_from_cache, fp8_grid, fp8_max, quantize_for_cache, round_to_bf16_grid, saturate_to_fp8,
)
from ..platform import is_triton_interpreted

__all__ = [
    "MLA_KV_CACHE_LAYOUT",
    "mla_kv_cache_shape",
    "cache_dtype_constexprs",
    "concat_and_cache_mla",
    "concat_and_cache_mla_torch",
    "context_slots",
    "gather_mla_cache",
    "write_latent_token",
]

MLA_KV_CACHE_LAYOUT = "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]"


def mla_kv_cache_shape(num_blocks: int, block_size: int, head_size: int) -> tuple[int, int, int]:
    """Shape of one layer's latent cache."""
    return (num_blocks, block_size, head_size)


@triton.jit
def write_latent_token(
    t, KV_C, K_PE, CACHE, SLOTS, stride_kvc_t, stride_kpe_t, stride_cache_blk, stride_cache_tok, scale, block_size,
    num_slots, fault_ptr, fault_flag_ptr,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Token ``t``'s latent vector [KV_C[t] (KV_LORA) ; K_PE[t] (ROPE)] into cache slot ``s = SLOTS[t]`` (page
    ``s // block_size``, row ``s % block_size``), as saturate(x / scale) in an fp8 cache (IS_FP8). ``s == -1`` is
    padding and skipped; a slot outside ``[-1, num_slots)`` is skipped and recorded in the fault record
    (:mod:`~attnbackends.ops.page_guard`). Every kernel that writes new latent tokens calls this."""
    slot = tl.load(SLOTS + t)
    if (slot < -1) | (slot >= num_slots):
        record_fault(fault_ptr, fault_flag_ptr, FAULT_SLOT, t, slot, num_slots)
    elif slot >= 0:
        base = CACHE + (slot // block_size) * stride_cache_blk + (slot % block_size) * stride_cache_tok
        offs_c = tl.arange(0, BLOCK_C)
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(KV_C + t * stride_kvc_t + offs_c, mask=offs_c < KV_LORA, other=0.0).to(tl.float32)
        r = tl.load(K_PE + t * stride_kpe_t + offs_r, mask=offs_r < ROPE, other=0.0).to(tl.float32)
        if IS_FP8:
            c = saturate_to_fp8(c, scale, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)
            r = saturate_to_fp8(r, scale, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)
        tl.store(base + offs_c, c.to(CACHE.dtype.element_ty), mask=offs_c < KV_LORA)
        tl.store(base + KV_LORA + offs_r, r.to(CACHE.dtype.element_ty), mask=offs_r < ROPE)


@triton.jit(do_not_specialize=["num_slots"])
def _concat_and_cache_mla_kernel(
    KV_C,
    K_PE,
    CACHE,
    SLOTS,
    stride_kvc_t,
    stride_kpe_t,
    stride_cache_blk,
    stride_cache_tok,
    scale,
    block_size,
    num_slots,
    fault_ptr,
    fault_flag_ptr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (T,): program t writes token t (:func:`write_latent_token`)."""
    write_latent_token(tl.program_id(0), KV_C, K_PE, CACHE, SLOTS, stride_kvc_t, stride_kpe_t, stride_cache_blk,
                       stride_cache_tok, scale, block_size, num_slots, fault_ptr, fault_flag_ptr, KV_LORA, ROPE,
                       BLOCK_C, BLOCK_R, IS_FP8, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)


def concat_and_cache_mla_torch(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0
) -> None:
    """Pure-torch :func:`concat_and_cache_mla` (boolean indexing: it syncs, so it is the CPU path)."""
    num_tokens = kv_c.shape[0]
    block_size = kv_cache.shape[1]
    slots = slot_mapping[:num_tokens]
    check_slots_host(slots, kv_cache.shape[0] * block_size)
    keep = slots >= 0
    slots = slots[keep]
    latent = torch.cat([kv_c[keep], k_pe[keep]], dim=-1)
    kv_cache[slots // block_size, slots % block_size] = quantize_for_cache(latent, kv_cache.dtype, k_scale)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    impl: Literal["auto", "triton", "torch"] = "auto",
) -> None:
    """Write new tokens' latent vectors into the cache.

    Parameters
    ----------
    kv_c : [T, Lkv] normalised latent KV of the new tokens (model dtype).
    k_pe : [T, R] their rotary key part (shared by all heads).
    kv_cache : [num_blocks, block_size, Lkv + R] in the cache dtype (model dtype or fp8).
    slot_mapping : [>= T] int64 slot (block * block_size + offset) per token; -1 is padding and is skipped.
    k_scale : fp8 scale (stored = saturate(x / k_scale)); ignored for other cache dtypes.
    impl : "triton" (CUDA, or the CPU under TRITON_INTERPRET=1), "torch", or "auto" (Triton on CUDA).
    """
    num_tokens, kv_lora = kv_c.shape
    rope = k_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != kv_lora + rope:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {kv_lora + rope}], got {tuple(kv_cache.shape)}")
    if k_pe.shape[0] != num_tokens:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens, kv_c has {num_tokens}")
    if num_tokens == 0:
        return
    use_triton = impl == "triton" or (impl == "auto" and kv_cache.is_cuda)
    if not use_triton:
        concat_and_cache_mla_torch(kv_c, k_pe, kv_cache, slot_mapping, k_scale)
        return
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("concat_and_cache_mla needs unit stride in the last dimension of kv_c, k_pe and kv_cache")
    constexprs = _write_constexprs(kv_lora, rope, kv_cache.dtype)
    faults = fault_record(kv_cache.device)
    strides = (kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    args = (kv_c, k_pe, kv_cache, slot_mapping, *strides, float(k_scale), kv_cache.shape[1],
            kv_cache.shape[0] * kv_cache.shape[1], faults.record, faults.host_flag)
    key = (constexprs, kv_c.dtype, kv_cache.dtype, strides, kv_cache.shape[1], kv_c.data_ptr() % 16,
           k_pe.data_ptr() % 16, kv_cache.data_ptr() % 16, slot_mapping.data_ptr() % 16)
    _WRITE(key, (num_tokens, 1, 1), args, constexprs, 4, 3)
    if constexprs[-1]:  # interpreted: the fault record is already written, and reading it costs no sync
        raise_pending_faults(kv_cache.device)


def cache_dtype_constexprs(cache_dtype: torch.dtype) -> tuple:
    """(IS_FP8, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP) of :func:`write_latent_token` for a cache of ``cache_dtype``."""
    is_fp8 = cache_dtype in FP8_DTYPES
    return (is_fp8, fp8_max(cache_dtype) if is_fp8 else 0.0, *fp8_grid(cache_dtype))


@lru_cache(maxsize=None)
def _write_constexprs(kv_lora: int, rope: int, cache_dtype: torch.dtype) -> tuple:
    """The write kernel's constexprs for one layer."""
    return (kv_lora, rope, next_power_of_2(kv_lora), next_power_of_2(rope), *cache_dtype_constexprs(cache_dtype),
            is_triton_interpreted())


_WRITE = DirectLauncher(_concat_and_cache_mla_kernel, (
    "KV_LORA", "ROPE", "BLOCK_C", "BLOCK_R", "IS_FP8", "FP8_MAX", "FP8_MANT_BITS", "FP8_MIN_EXP", "INTERPRET"))


def context_slots(
    block_table: torch.Tensor, cu_seq_lens: torch.Tensor, starts: torch.Tensor, total: int, block_size: int
) -> torch.Tensor:
    """Cache slots of a context chunk, computed on the device (no host sync).

    Parameters
    ----------
    block_table : [R, W] int32 page ids of the chunk's requests.
    cu_seq_lens : [R + 1] int32 cumulative token counts of the chunk per request (device).
    starts : [R] int32 first context position of the chunk per request (device).
    total : cu_seq_lens[-1], known on the host.

    Returns
    -------
    [total] int64 slots, request after request.
    """
    device = block_table.device
    counts = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=total)
    pos = torch.arange(total, device=device) - cu_seq_lens.long()[req] + starts.long()[req]
    pages = block_table.long()[req, pos // block_size]
    return pages * block_size + pos % block_size


_GATHER_TOKENS = 8  # tokens per program of the gather kernel


@triton.jit(do_not_specialize=["n"])
def _gather_mla_cache_kernel(
    CACHE, SLOTS, OUT, stride_cache_blk, stride_cache_tok, stride_out_t, n, num_blocks, block_size, scale,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, TOKENS: tl.constexpr, DEQUANT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Grid: (cdiv(n, TOKENS),). Tokens t of the program: the latent vector in cache slot ``SLOTS[t]`` (page
    ``floor(slot / block_size)``, offset ``slot mod block_size``) to ``OUT[t]`` (times ``scale`` when DEQUANT); a
    page outside ``[0, num_blocks)`` is read as page 0."""
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_mask = t < n
    slot = tl.load(SLOTS + t, mask=t_mask, other=0)
    off = slot % block_size
    off = tl.where(off < 0, off + block_size, off)  # a floor remainder for negative slots too
    page = safe_page((slot - off) // block_size, num_blocks)
    src = CACHE + page * stride_cache_blk + off * stride_cache_tok
    offs = tl.arange(0, BLOCK_W)
    mask = t_mask[:, None] & (offs < WIDTH)[None, :]
    x = tl.load(src[:, None] + offs[None, :], mask=mask)
    if DEQUANT:
        x = x.to(tl.float32) * scale
        if ROUND_BF16:
            x = round_to_bf16_grid(x)
    tl.store(OUT + t.to(tl.int64)[:, None] * stride_out_t + offs[None, :], x.to(OUT.dtype.element_ty), mask=mask)


_GATHER = DirectLauncher(_gather_mla_cache_kernel, ("WIDTH", "BLOCK_W", "TOKENS", "DEQUANT", "ROUND_BF16"))


def gather_mla_cache(
    kv_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, k_scale: float = 1.0
) -> torch.Tensor:
    """Gather cached latent vectors into a workspace, dequantized.

    kv_cache : [num_blocks, block_size, Lkv + R]; slots : [n] int64; out : [>= n, Lkv + R] in the compute dtype.
    Returns out[:n].

    On CUDA (and under the interpreter) one kernel reads a slot of a page outside the cache (from a bad block table:
    the page guard reports it) at the same offset of page 0, so it never reads outside the cache. The CPU's torch path
    raises an IndexError instead (its block tables are range-checked on the host before it runs).
    """
    n = slots.shape[0]
    dst = out[:n]
    if n == 0:
        return dst
    if kv_cache.is_cuda or is_triton_interpreted():
        if kv_cache.stride(-1) != 1 or out.stride(-1) != 1:
            raise ValueError("gather_mla_cache needs unit stride in the last dimension of kv_cache and out")
        num_blocks, block_size, width = kv_cache.shape
        constexprs = (width, next_power_of_2(width), _GATHER_TOKENS, kv_cache.dtype in FP8_DTYPES,
                      is_triton_interpreted() and out.dtype == torch.bfloat16)
        args = (kv_cache, slots, dst, kv_cache.stride(0), kv_cache.stride(1), dst.stride(0), n, num_blocks,
                block_size, float(k_scale))
        key = (constexprs, kv_cache.dtype, dst.dtype, kv_cache.stride(), dst.stride(0), kv_cache.data_ptr() % 16,
               dst.data_ptr() % 16, slots.data_ptr() % 16, num_blocks % 16 == 0, num_blocks == 1, block_size)
        _GATHER(key, (cdiv(n, _GATHER_TOKENS), 1, 1), args, constexprs, 4, 3)
        return dst
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_cache.dtype == out.dtype:
        torch.index_select(flat, 0, slots, out=dst)
    else:
        dst.copy_(dequantize_from_cache(flat.index_select(0, slots), out.dtype, k_scale))
    return dst
