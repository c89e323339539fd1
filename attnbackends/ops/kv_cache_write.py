"""Write new tokens' keys and values into the standard paged KV cache (optionally quantising to fp8; the formats
whose scales sit beside their pages go through :mod:`.kv_cache_write_quant`).

Cache layout: ``kv_cache`` ``[num_blocks, 2, block_size, num_kv_heads, head_size]``; slot ``s`` is block
``s // block_size``, offset ``s % block_size``; slot ``-1`` marks a padding token and is skipped.
fp8: stored = saturate(x / scale) in the cache's fp8 dtype.

On CUDA (and on the CPU under ``TRITON_INTERPRET=1``) a Triton kernel does the write with no host-device sync;
elsewhere an equivalent torch implementation is used. :func:`gather_kv_torch` reads one request's keys and values
back (dequantised), the torch read every pure-torch path shares.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from .kv_cache_write_quant import gather_kv_quant_torch, reshape_and_cache_quant, reshape_and_cache_quant_torch
from .launch import DirectLauncher
from ..platform import is_triton_interpreted
from ..spec import KVCacheFormat
from ..validation import check_tensor
from .launch_math import cdiv, next_power_of_2
from .page_guard import FAULT_SLOT, check_slots_host, fault_record, raise_pending_faults, record_fault
from .quant import (
    FP8_DTYPES,
    dequantize_from_cache,
    fp8_grid,
    load_kv_scales,
    quantize_for_cache,
    saturate_to_fp8,
)

__all__ = [
    "check_reshape_and_cache_args",
    "finish_cache_write",
    "gather_kv_torch",
    "reshape_and_cache",
    "reshape_and_cache_torch",
]

Scale = Union[float, torch.Tensor]


@triton.jit(do_not_specialize=["num_tokens", "num_slots", "num_covered"],
            do_not_specialize_on_alignment=["slot_mapping_ptr", "k_scale", "v_scale", "fault_ptr", "fault_flag_ptr",
                                            "todo_ptr"])
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_kv_heads, num_tokens, num_slots, fault_ptr, fault_flag_ptr, todo_ptr, num_covered,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, SCALES_ARE_PTRS: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr, FP8_MIN_EXP: tl.constexpr, INTERPRET: tl.constexpr, ONLY_TODO: tl.constexpr,
):
    """Grid: (cdiv(num_tokens, TOKENS_PER_PROGRAM), cdiv(num_kv_heads, HEADS_PER_PROGRAM)). Each program moves
    ``[TOKENS_PER_PROGRAM, HEADS_PER_PROGRAM, HEAD_PAD]`` of keys and of values; the slots and the rows are loaded
    together (no load waits for another). A slot outside ``[-1, num_slots)`` is skipped and recorded as a fault
    (reported by :func:`attnbackends.ops.page_guard.raise_pending_faults`).

    ``ONLY_TODO``: of the first ``num_covered`` tokens (those another kernel wrote) only the ones flagged in
    ``todo_ptr`` (int8) are written, and their flags cleared; every token from ``num_covered`` on is written."""
    toks = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    in_batch = toks < num_tokens
    if ONLY_TODO:
        covered = in_batch & (toks < num_covered)
        flagged = tl.load(todo_ptr + toks, mask=covered, other=0) != 0
        in_batch = in_batch & (flagged | (toks >= num_covered))
        tl.debug_barrier()  # every thread holding a copy of a flag has read it before any clears it
        tl.store(todo_ptr + toks, tl.zeros_like(toks).to(tl.int8), mask=flagged)
    if tl.max(in_batch.to(tl.int32), 0) > 0:  # most programs after a kernel's own write have nothing left
        _write_tokens(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_scale, v_scale, stride_kt, stride_kh,
                      stride_vt, stride_vh, stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, num_tokens,
                      num_slots, fault_ptr, fault_flag_ptr, toks, in_batch, HEAD_SIZE, HEAD_PAD, HEADS_PER_PROGRAM,
                      BLOCK_SIZE, FP8, FP8_MAX, SCALES_ARE_PTRS, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)


@triton.jit
def _write_tokens(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_scale, v_scale, stride_kt, stride_kh, stride_vt,
                  stride_vh, stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, num_tokens, num_slots,
                  fault_ptr, fault_flag_ptr, toks, in_batch, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                  HEADS_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr, SCALES_ARE_PTRS: tl.constexpr, FP8_MANT_BITS: tl.constexpr,
                  FP8_MIN_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """The write of tokens ``toks`` [T] where ``in_batch``, heads of this program (see the kernel)."""
    slots = tl.load(slot_mapping_ptr + toks, mask=in_batch, other=-1)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_d = tl.arange(0, HEAD_PAD)
    row_mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_SIZE)  # [H, D]
    load_mask = in_batch[:, None, None] & row_mask[None, :, :]
    row = heads[None, :, None] * stride_kh + offs_d[None, None, :]
    k = tl.load(key_ptr + toks[:, None, None] * stride_kt + row, mask=load_mask)
    v = tl.load(value_ptr + toks[:, None, None] * stride_vt + heads[None, :, None] * stride_vh
                + offs_d[None, None, :], mask=load_mask)
    bad = (slots < -1) | (slots >= num_slots)
    if tl.program_id(1) == 0:
        if tl.max(bad.to(tl.int32), 0) > 0:
            first = tl.min(tl.where(bad, toks, num_tokens), 0)
            record_fault(fault_ptr, fault_flag_ptr, FAULT_SLOT, first,
                         tl.sum(tl.where(toks == first, slots, 0), 0), num_slots)
    if FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALES_ARE_PTRS)
        k = saturate_to_fp8(k, ks, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)
        v = saturate_to_fp8(v, vs, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP, INTERPRET)
    write = (slots >= 0) & (slots < num_slots)
    safe = tl.where(write, slots, 0)
    dst = (cache_ptr + (safe // BLOCK_SIZE)[:, None, None] * stride_cb + (safe % BLOCK_SIZE)[:, None, None] * stride_cs
           + heads[None, :, None] * stride_ch + offs_d[None, None, :])
    store_mask = write[:, None, None] & row_mask[None, :, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=store_mask)


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or is_triton_interpreted()


def check_reshape_and_cache_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0,
                                 kv_format: Optional[KVCacheFormat] = None) -> None:
    """Raise ValueError naming the argument when the inputs of :func:`reshape_and_cache` do not fit together."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_size], got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    _, _, _, num_kv_heads, head_size = kv_cache.shape
    quantised = kv_format is not None and kv_format.scales_in_pages
    if quantised:
        head_size = head_size * 2 if kv_format.packed else head_size
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, shape=(None, num_kv_heads, head_size), names=("num_tokens", "num_kv_heads", "head_size"))
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} must equal key dtype {key.dtype}")
    if not quantised and kv_cache.dtype not in FP8_DTYPES and key.dtype != kv_cache.dtype:
        raise ValueError(f"key dtype {key.dtype} must equal kv_cache dtype {kv_cache.dtype} (or the cache is fp8)")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key ({key.shape[0]}) and value ({value.shape[0]}) token counts differ")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping must be a 1-D int64 tensor of at most num_tokens={key.shape[0]} entries, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, kv_cache on {kv_cache.device}")
    if slot_mapping.shape[0] > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous (the write kernel reads it with unit stride), got stride "
                         f"{slot_mapping.stride(0)}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor):
            if s.numel() != 1 or s.dtype != torch.float32 or s.device != kv_cache.device:
                raise ValueError(f"{name} must be a python float or a 1-element float32 tensor on kv_cache's device")
        elif not isinstance(s, (float, int)) or isinstance(s, bool) or not s > 0:
            raise ValueError(f"{name} must be a positive python float or a 1-element float32 tensor, got {s!r}")
    if isinstance(k_scale, torch.Tensor) != isinstance(v_scale, torch.Tensor):
        raise ValueError("k_scale and v_scale must both be floats or both be tensors")


def reshape_and_cache_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0,
                            kv_format: Optional[KVCacheFormat] = None) -> None:
    """Pure-torch :func:`reshape_and_cache` (syncs the host: for CPUs and tests). Shapes as there; slots past
    ``key.shape[0]`` are ignored."""
    if kv_format is not None and kv_format.scales_in_pages:
        reshape_and_cache_quant_torch(key, value, kv_cache, slot_mapping, kv_format, k_scale, v_scale)
        return
    block_size = kv_cache.shape[2]
    slot_mapping = slot_mapping[: key.shape[0]]
    n = slot_mapping.shape[0]
    check_slots_host(slot_mapping, kv_cache.shape[0] * block_size)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blk, off = slots // block_size, slots % block_size
    for i, (x, scale) in enumerate(((key[:n][valid], k_scale), (value[:n][valid], v_scale))):
        if isinstance(scale, torch.Tensor):
            scale = scale.to(x.device)
        kv_cache[blk, i, off] = quantize_for_cache(x, kv_cache.dtype, scale)


def gather_kv_torch(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, k_scale: Scale = 1.0,
                    v_scale: Scale = 1.0, dtype: torch.dtype = torch.float32,
                    kv_format: Optional[KVCacheFormat] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one request, dequantised to ``dtype`` (``kv_format``: the
    cache's format where its scales sit beside its pages; None: 16-bit or fp8 per tensor).

    Parameters
    ----------
    kv_cache : [num_blocks, 2, block_size, num_kv_heads, head_size]
    block_row : [>= ceil(seq_len / block_size)] the request's block-table row (page ids).

    Returns
    -------
    key, value : [seq_len, num_kv_heads, head_size] each, in ``dtype``.
    """
    if kv_format is not None and kv_format.scales_in_pages:
        return gather_kv_quant_torch(kv_cache, block_row, seq_len, kv_format, k_scale, v_scale, dtype)
    block_size = kv_cache.shape[2]
    pages = kv_cache[block_row[: -(-seq_len // block_size)].long()]  # [P, 2, bs, Hkv, D]
    key = pages[:, 0].reshape(-1, *pages.shape[3:])[:seq_len]
    value = pages[:, 1].reshape(-1, *pages.shape[3:])[:seq_len]
    return dequantize_from_cache(key, dtype, k_scale), dequantize_from_cache(value, dtype, v_scale)


#: Batches of at least this many tokens move :data:`WIDE_TOKENS_PER_PROGRAM` tokens per program (fewer, larger
#: programs keep more bytes in flight per thread); smaller ones one token per program (as many programs as tokens).
WIDE_WRITE_MIN_TOKENS = 1024
WIDE_TOKENS_PER_PROGRAM = 2


def write_tokens_per_program(num_tokens: int) -> int:
    """Tokens one program of the write kernel moves for a batch of ``num_tokens``."""
    return WIDE_TOKENS_PER_PROGRAM if num_tokens >= WIDE_WRITE_MIN_TOKENS else 1


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: Scale = 1.0, v_scale: Scale = 1.0, *, validate: bool = True,
                      tokens_per_program: Optional[int] = None, kv_format: Optional[KVCacheFormat] = None) -> None:
    """Write the new tokens' keys and values into the paged cache.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_size]`` float16 / bfloat16 / float32, last dim contiguous (strided views
        of a fused QKV projection are fine).
    kv_cache : torch.Tensor
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` in the key dtype or float8_e4m3fn / float8_e5m2;
        updated in place.
    slot_mapping : torch.Tensor
        ``[n <= num_tokens]`` int64; slot of each token, ``-1`` to skip (padding). Tokens past ``n`` are skipped.
    k_scale, v_scale : float or torch.Tensor
        fp8 quantisation scales (python floats or 1-element float32 tensors); ignored for a non-fp8 cache.
    validate : bool
        Check the arguments first (:func:`check_reshape_and_cache_args`).
    tokens_per_program : int, optional
        Tokens each program of the write kernel moves (a power of two); None: :func:`write_tokens_per_program`.
    kv_format : KVCacheFormat, optional
        The cache's format where its scales sit beside its pages (per token and head, NVFP4): each token-head is
        quantised with its own scale and written with it (:mod:`.kv_cache_write_quant`); ``k_scale``/``v_scale``
        are then NVFP4's global scales. None: 16-bit or fp8 per tensor, from the cache's dtype.
    """
    if validate:
        check_reshape_and_cache_args(key, value, kv_cache, slot_mapping, k_scale, v_scale, kv_format)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if kv_format is not None and kv_format.scales_in_pages:
        reshape_and_cache_quant(key, value, kv_cache, slot_mapping, kv_format, k_scale, v_scale,
                                use_triton=_use_triton(kv_cache.device))
        return
    if not _use_triton(kv_cache.device):
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return
    if tokens_per_program is None:
        tokens_per_program = write_tokens_per_program(num_tokens)
    elif tokens_per_program < 1 or tokens_per_program & (tokens_per_program - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {tokens_per_program}")
    _launch_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, tokens_per_program, None, 0)


def finish_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       todo: torch.Tensor, num_covered: int) -> None:
    """The rest of a write that another kernel did for the first ``num_covered`` tokens (CUDA, 16-bit cache; no
    checks): those of them flagged in ``todo`` (its flags cleared again), and every token from ``num_covered`` on.
    Shapes as in :func:`reshape_and_cache`; ``todo`` [>= num_covered] int8."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens:
        _launch_write(key, value, kv_cache, slot_mapping, 1.0, 1.0, TODO_TOKENS_PER_PROGRAM, todo, num_covered)


#: Tokens per program of :func:`finish_cache_write` (most of them are skipped after one flag load).
TODO_TOKENS_PER_PROGRAM = 16


def _launch_write(key, value, kv_cache, slot_mapping, k_scale, v_scale, tokens_per_program: int,
                  todo: Optional[torch.Tensor], num_covered: int) -> None:
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    scales_are_ptrs = isinstance(k_scale, torch.Tensor)
    constexprs, heads_per_program, num_warps = _write_config(head_size, num_kv_heads, block_size, kv_cache.dtype,
                                                             scales_are_ptrs, tokens_per_program, todo is not None)
    grid = (cdiv(num_tokens, tokens_per_program), cdiv(num_kv_heads, heads_per_program), 1)
    faults = fault_record(kv_cache.device)
    strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kv_cache.stride()[:4])
    args = (
        key, value, kv_cache, slot_mapping,
        k_scale if scales_are_ptrs else float(k_scale), v_scale if scales_are_ptrs else float(v_scale),
        *strides, num_kv_heads, num_tokens, kv_cache.shape[0] * block_size, faults.record, faults.host_flag,
        todo if todo is not None else slot_mapping, int(num_covered),
    )
    launch_key = (constexprs, key.dtype, kv_cache.dtype, strides, num_kv_heads, key.data_ptr() % 16,
                  value.data_ptr() % 16, kv_cache.data_ptr() % 16)
    _write_launcher(launch_key, grid, args, constexprs, num_warps, 3)
    if not kv_cache.is_cuda:  # interpreted: the fault record is already written, and reading it costs no sync
        raise_pending_faults(kv_cache.device)


@lru_cache(maxsize=None)
def _write_config(head_size: int, num_kv_heads: int, block_size: int, cache_dtype: torch.dtype,
                  scales_are_ptrs: bool, tokens_per_program: int, only_todo: bool) -> tuple[tuple, int, int]:
    """(constexprs, heads per program, num_warps) of the write kernel for one cache layout."""
    head_pad = next_power_of_2(head_size)
    heads_per_program = min(next_power_of_2(num_kv_heads), max(1, 2048 // head_pad))
    fp8 = cache_dtype in FP8_DTYPES
    constexprs = (
        head_size, head_pad, heads_per_program, block_size, tokens_per_program, fp8,
        float(torch.finfo(cache_dtype).max) if fp8 else 0.0, scales_are_ptrs, *fp8_grid(cache_dtype),
        is_triton_interpreted(), only_todo,
    )
    elements = tokens_per_program * heads_per_program * head_pad
    return constexprs, heads_per_program, 8 if elements >= 8192 else 4 if elements >= 1024 else 2


_write_launcher = DirectLauncher(_reshape_and_cache_kernel, (
    "HEAD_SIZE", "HEAD_PAD", "HEADS_PER_PROGRAM", "BLOCK_SIZE", "TOKENS_PER_PROGRAM", "FP8", "FP8_MAX",
    "SCALES_ARE_PTRS", "FP8_MANT_BITS", "FP8_MIN_EXP", "INTERPRET", "ONLY_TODO"))
