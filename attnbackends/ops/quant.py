"""KV-cache dtype conversion in pure torch: the fp8 semantics every backend shares.

stored = saturate(x / scale) in the fp8 dtype; read = stored * scale. Non-fp8 cache dtypes are plain casts.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPES", "fp8_max", "quantize_for_cache", "dequantize_from_cache"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


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
