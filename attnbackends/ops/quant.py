"""KV-cache dtype conversion: the fp8 semantics every backend shares, in torch and as ``@triton.jit`` helpers for
the kernels that write or read a cache.

stored = saturate(x / scale) in the fp8 dtype; read = stored * scale. Non-fp8 cache dtypes are plain casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "FP8_DTYPES", "fp8_grid", "fp8_max", "quantize_for_cache", "dequantize_from_cache", "load_kv_scales",
    "round_to_bf16_grid", "round_to_fp8_grid", "saturate_to_fp8",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_grid(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, smallest normal exponent) of an fp8 dtype: :func:`round_to_fp8_grid`'s constants."""
    return (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)


def quantize_for_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` in the cache dtype: fp8 divides by ``scale`` and saturates; other dtypes are cast."""
    if cache_dtype in FP8_DTYPES:
        limit = fp8_max(cache_dtype)
        return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Cache contents as ``dtype``: fp8 values are multiplied by ``scale``; other dtypes are cast."""
    if x.dtype in FP8_DTYPES:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


@triton.jit
def load_kv_scales(k_scale, v_scale, SCALES_ARE_PTRS: tl.constexpr):
    """(k_scale, v_scale) in float32: loaded from 1-element tensors when SCALES_ARE_PTRS, else the floats given."""
    if SCALES_ARE_PTRS:
        ks = tl.load(k_scale).to(tl.float32)
        vs = tl.load(v_scale).to(tl.float32)
    else:
        ks = k_scale
        vs = v_scale
    return ks, vs


@triton.jit
def round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round-to-nearest-even onto the fp8 grid in float32. Only for the interpreter, whose float32 -> fp8 cast
    does not round to nearest even like the GPU's (and torch's); afterwards the cast is exact."""
    e = tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30)))
    ulp = tl.exp2(tl.maximum(e, MIN_EXP) - MANT_BITS)
    r = x / ulp
    f = tl.floor(r)
    d = r - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return (f + tl.where(up, 1.0, 0.0)) * ulp


@triton.jit
def round_to_bf16_grid(x):
    """float32 rounded to nearest even onto bfloat16's grid (finite values). Only for the interpreter, whose
    float32 -> bfloat16 cast truncates; afterwards the cast is exact."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def saturate_to_fp8(x, scale, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """saturate(x / scale) in float32, ready for the cast to the cache's fp8 dtype (``fp8_max`` and
    :func:`fp8_grid` of that dtype); rounded onto its grid under the interpreter."""
    y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    if INTERPRET:
        y = round_to_fp8_grid(y, MANT_BITS, MIN_EXP)
    return y
