"""The engine's KV-cache format (``EngineConfig.kv_cache_dtype``): the option checked, carried into the layers'
specs, the per-tensor scales its impls take, and per-tensor scales calibrated on an unquantised engine's cache.

Per-token-head formats (fp8, int8, int4) compute their scales on write and need nothing here; fp8 per tensor and
NVFP4 take one ``k_scale`` and one ``v_scale`` per layer (docs/KV_FORMATS.md).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..ops.kv_quant import E2M1_VALUES
from ..ops.quant import fp8_max
from ..spec import KV_CACHE_DTYPES, AttentionSpec, KVCacheFormat, kv_cache_format, kv_cache_torch_dtype

__all__ = ["KVScales", "calibrated_kv_scales", "check_kv_cache_dtype", "check_kv_scales", "kv_scale_kwargs",
           "with_kv_cache_dtype"]

#: One ``(k_scale, v_scale)`` pair per layer, or one pair for every layer.
KVScales = tuple[tuple[float, float], ...]

_UNQUANTISED = (torch.float16, torch.bfloat16, torch.float32)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` if it names a KV-cache format; ValueError listing the allowed names otherwise."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def check_kv_scales(kv_scales: Optional[Sequence[Sequence[float]]], kv_cache_dtype: str) -> Optional[KVScales]:
    """``kv_scales`` as a tuple of ``(k_scale, v_scale)`` pairs (positive, finite), or None; ValueError for a
    malformed value, or for scales given with a format that computes its own (per token and head, 16-bit)."""
    if kv_scales is None:
        return None
    try:
        pairs = tuple((float(k), float(v)) for k, v in kv_scales)
    except (TypeError, ValueError):
        raise ValueError(f"kv_scales must be (k_scale, v_scale) pairs, one per layer or one for all, got "
                         f"{kv_scales!r}") from None
    if not pairs or any(not (s > 0 and math.isfinite(s)) for pair in pairs for s in pair):
        raise ValueError(f"kv_scales must hold at least one pair of positive finite numbers, got {kv_scales!r}")
    if kv_cache_dtype != "auto" and not kv_cache_format(kv_cache_dtype).uses_tensor_scale:
        raise ValueError(f"kv_scales given but kv_cache_dtype is {kv_cache_dtype!r}: per-tensor scales apply to "
                         f"fp8 per tensor ('fp8', 'fp8_e4m3', 'fp8_e5m2') and NVFP4's global scale ('nvfp4') only")
    return pairs


def with_kv_cache_dtype(spec: AttentionSpec, kv_cache_dtype: str) -> AttentionSpec:
    """``spec`` storing its cache as ``kv_cache_dtype``; "auto" leaves the model's choice (16 bits for the built-in
    models) unchanged."""
    if kv_cache_dtype == "auto" or kv_cache_dtype == spec.kv_cache_dtype:
        return spec
    return type(spec).model_validate({**spec.model_dump(), "kv_cache_dtype": kv_cache_dtype})


def kv_scale_kwargs(spec: AttentionSpec, kv_scales: Optional[KVScales], layer: int,
                    num_layers: int) -> dict[str, float]:
    """The impl arguments ``k_scale`` and ``v_scale`` of layer ``layer`` ({} where its spec takes no per-tensor
    scale or none were given: the impl's default 1.0 then applies)."""
    if kv_scales is None or not spec.kv_cache_format.uses_tensor_scale:
        return {}
    if len(kv_scales) not in (1, num_layers):
        raise ValueError(f"kv_scales holds {len(kv_scales)} pairs; give one per layer ({num_layers}) or one for all")
    k_scale, v_scale = kv_scales[layer if len(kv_scales) > 1 else 0]
    return {"k_scale": k_scale, "v_scale": v_scale}


def calibrated_kv_scales(kv_caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> KVScales:
    """Per-tensor scales for ``kv_cache_dtype`` (fp8 per tensor or NVFP4) from the keys and values an engine with an
    unquantised cache (``kv_cache_dtype`` "auto") has cached: per layer, (absmax of its keys, absmax of its values)
    over the largest magnitude the format stores.

    kv_caches : one cache per layer in the model dtype, [num_blocks, 2, block_size, num_kv_heads, head_size] (zeroed at
        allocation, so pages never written do not raise the absmax).
    """
    fmt = kv_cache_format(check_kv_cache_dtype(kv_cache_dtype))
    if not fmt.uses_tensor_scale:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} takes no per-tensor scales; calibrate 'fp8', "
                         f"'fp8_e4m3', 'fp8_e5m2' or 'nvfp4'")
    qmax = _stored_max(kv_cache_dtype)
    scales = []
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.dtype not in _UNQUANTISED:
            raise ValueError(f"kv_caches[{i}] is not an unquantised [num_blocks, 2, block_size, num_kv_heads, "
                             f"head_size] cache; calibrate on an engine whose kv_cache_dtype is 'auto'")
        amax = cache.abs().amax(dim=(0, 2, 3, 4)).float().cpu()  # [2]: keys, values
        scales.append(tuple(max(float(a), 1e-12) / qmax for a in amax))
    return tuple(scales)


def _stored_max(kv_cache_dtype: str) -> float:
    """The largest magnitude a per-tensor format stores: its fp8 dtype's largest finite value; NVFP4's largest e4m3
    block scale times e2m1's largest value."""
    if kv_cache_format(kv_cache_dtype) is KVCacheFormat.NVFP4:
        return fp8_max(torch.float8_e4m3fn) * max(E2M1_VALUES)
    return fp8_max(kv_cache_torch_dtype(kv_cache_dtype, "bfloat16"))
