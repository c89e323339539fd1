"""Where a KV cache's values and scales live: the page layout of every :class:`~attnbackends.spec.KVCacheFormat`.

16-bit and fp8-per-tensor caches are one contiguous ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` tensor.
A format whose scales are written with the tokens keeps them beside their pages, so a page carries its own scales
(a page copied, swapped or shared moves with them). One page, in bytes::

    [ K values: block_size x num_kv_heads x value_bytes ][ V values: same ]
    [ K scales: block_size x num_kv_heads x scale_bytes ][ V scales: same ][ padding to 16 bytes ]

``value_bytes`` per token and head: head_size (fp8, int8) or head_size / 2 (int4, NVFP4: element ``2i`` in the low
nibble of byte ``i``, ``2i + 1`` in the high one). ``scale_bytes``: 4 (one float32 per token and head) or
head_size / 16 (NVFP4: one e4m3 scale per 16-element block, in element order). The cache tensor an engine holds
is the values' view ``[num_blocks, 2, block_size, num_kv_heads, head_size or head_size // 2]`` over those pages
(its block stride is the page), in the format's storage dtype (float8_e4m3fn, int8, uint8);
:func:`kv_scale_views` gives the scales' view of the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ..spec import AttentionSpec, KVCacheFormat, kv_cache_format

__all__ = [
    "KVPageLayout",
    "allocate_kv_cache_pages",
    "check_kv_cache_pages",
    "kv_cache_bytes_per_token",
    "kv_page_layout",
    "kv_scale_views",
]

#: Every page starts on this many bytes (vector loads of values and scales stay aligned).
PAGE_ALIGN = 16


@dataclass(frozen=True)
class KVPageLayout:
    """The byte layout of one page of a cache (see the module docstring).

    Attributes
    ----------
    format : the cache's format.
    block_size, num_kv_heads, head_size : the spec's.
    value_bytes : bytes of one token-head's values (head_size, or head_size // 2 packed).
    scale_bytes : bytes of one token-head's scales (0: none in the pages).
    page_bytes : bytes of one page, values and scales, padded to :data:`PAGE_ALIGN`.
    """

    format: KVCacheFormat
    block_size: int
    num_kv_heads: int
    head_size: int
    value_bytes: int
    scale_bytes: int
    page_bytes: int

    @property
    def values_bytes(self) -> int:
        """Bytes of a page's K values (V follows at this offset; the scales at twice it)."""
        return self.block_size * self.num_kv_heads * self.value_bytes

    @property
    def scales_bytes(self) -> int:
        """Bytes of a page's K scales (V's follow)."""
        return self.block_size * self.num_kv_heads * self.scale_bytes

    @property
    def storage_head_size(self) -> int:
        """The cache view's last dimension: values per token and head in storage elements."""
        return self.value_bytes if self.format.scales_in_pages else self.head_size


def kv_page_layout(spec: AttentionSpec) -> KVPageLayout:
    """The page layout of ``spec``'s cache. ValueError for a format the spec cannot take (MLA latent caches take
    16-bit and fp8 per tensor; packed formats need an even head size, NVFP4 a multiple of 16)."""
    fmt = spec.kv_cache_format
    hkv, d, bs = spec.num_kv_heads, spec.head_size, spec.block_size
    if not fmt.scales_in_pages:
        item = spec.kv_cache_torch_dtype.itemsize
        return KVPageLayout(fmt, bs, hkv, d, d * item, 0, 2 * bs * hkv * d * item)
    if spec.is_mla:
        raise ValueError(f"kv_cache_dtype {spec.kv_cache_dtype!r} is not offered for MLA latent caches (use auto or "
                         "fp8)")
    if spec.head_size_v is not None and spec.head_size_v != d:
        raise ValueError(f"kv_cache_dtype {spec.kv_cache_dtype!r} needs head_size_v equal to head_size")
    if fmt is KVCacheFormat.NVFP4 and d % 16:
        raise ValueError(f"kv_cache_dtype 'nvfp4' needs head_size a multiple of 16 (its scale blocks), got {d}")
    if fmt.packed and d % 2:
        raise ValueError(f"kv_cache_dtype {spec.kv_cache_dtype!r} packs two values a byte: head_size must be even, "
                         f"got {d}")
    value_bytes = d // 2 if fmt.packed else d
    scale_bytes = d // 16 if fmt is KVCacheFormat.NVFP4 else 4
    raw = 2 * bs * hkv * (value_bytes + scale_bytes)
    page = -(-raw // PAGE_ALIGN) * PAGE_ALIGN
    return KVPageLayout(fmt, bs, hkv, d, value_bytes, scale_bytes, page)


def kv_cache_bytes_per_token(spec: AttentionSpec) -> float:
    """Cache bytes one token takes in one layer (keys and values of every KV head, their scales and the page's
    padding shared out): what decides how many tokens fit. MLA: one latent per token."""
    if spec.is_mla:
        return float(spec.head_size * spec.kv_cache_torch_dtype.itemsize)
    layout = kv_page_layout(spec)
    return layout.page_bytes / layout.block_size


def allocate_kv_cache_pages(num_blocks: int, spec: AttentionSpec, device: Union[torch.device, str]) -> torch.Tensor:
    """An uninitialised cache of ``num_blocks`` pages in ``spec``'s format: the values' view
    ``[num_blocks, 2, block_size, num_kv_heads, storage_head_size]`` over pages that carry their scales (contiguous
    for formats without page scales)."""
    layout = kv_page_layout(spec)
    dtype = spec.kv_cache_torch_dtype
    shape = (num_blocks, 2, spec.block_size, spec.num_kv_heads, layout.storage_head_size)
    if not layout.format.scales_in_pages:
        return torch.empty(shape, dtype=dtype, device=device)
    pages = torch.empty(num_blocks, layout.page_bytes, dtype=torch.uint8, device=device)
    values = pages[:, : 2 * layout.values_bytes].view(dtype)  # [num_blocks, 2 * values_bytes]
    return values.view(num_blocks, *shape[1:])


def _expected_strides(layout: KVPageLayout) -> tuple[int, ...]:
    d = layout.storage_head_size
    return (layout.page_bytes, layout.values_bytes, layout.num_kv_heads * d, d, 1)


def check_kv_cache_pages(kv_cache: torch.Tensor, spec: AttentionSpec) -> None:
    """ValueError unless ``kv_cache`` is a cache of ``spec``'s format as :func:`allocate_kv_cache_pages` makes it
    (shape, dtype, the page strides, and memory behind every page's scales)."""
    layout = kv_page_layout(spec)
    want = (spec.block_size, spec.num_kv_heads, layout.storage_head_size)
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[2:]) != want:
        raise ValueError(f"kv_cache must be [num_blocks, 2, {', '.join(map(str, want))}] for kv_cache_dtype "
                         f"{spec.kv_cache_dtype!r}, got {tuple(kv_cache.shape)}")
    if kv_cache.dtype != spec.kv_cache_torch_dtype:
        raise ValueError(f"kv_cache must be {spec.kv_cache_torch_dtype} for kv_cache_dtype {spec.kv_cache_dtype!r}, "
                         f"got {kv_cache.dtype}")
    if not layout.format.scales_in_pages:
        return
    if kv_cache.stride() != _expected_strides(layout) or kv_cache.storage_offset() % PAGE_ALIGN:
        raise ValueError(f"kv_cache for kv_cache_dtype {spec.kv_cache_dtype!r} must be the page view "
                         "allocate_kv_cache returns (pages of "
                         f"{layout.page_bytes} bytes: values then scales); got strides {tuple(kv_cache.stride())}")
    end = kv_cache.storage_offset() + kv_cache.shape[0] * layout.page_bytes
    if kv_cache.untyped_storage().nbytes() < end:
        raise ValueError(f"kv_cache's memory ends before its last page's scales ({end} bytes needed): allocate it "
                         "with allocate_kv_cache")


def kv_scale_views(kv_cache: torch.Tensor, layout: KVPageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scales of a page-scaled cache, views of its memory.

    Returns
    -------
    k_scales, v_scales : [num_blocks, block_size, num_kv_heads] float32 (per token and head), or
        [num_blocks, block_size, num_kv_heads, head_size // 16] float8_e4m3fn (NVFP4's block scales).
    """
    if not layout.format.scales_in_pages:
        raise ValueError(f"a {layout.format.value} cache has no scales in its pages")
    num_blocks = kv_cache.shape[0]
    pages = kv_cache.as_strided((num_blocks, layout.page_bytes), (layout.page_bytes, 1)).view(torch.uint8)
    region = pages[:, 2 * layout.values_bytes: 2 * (layout.values_bytes + layout.scales_bytes)]
    bs, hkv = layout.block_size, layout.num_kv_heads
    if layout.format is KVCacheFormat.NVFP4:
        scales = region.view(torch.float8_e4m3fn).view(num_blocks, 2, bs, hkv, layout.scale_bytes)
    else:
        scales = region.view(torch.float32).view(num_blocks, 2, bs, hkv)
    return scales[:, 0], scales[:, 1]


def format_of(spec_or_dtype: "AttentionSpec | str") -> KVCacheFormat:
    """The format of a spec or a ``kv_cache_dtype`` value."""
    if isinstance(spec_or_dtype, AttentionSpec):
        return spec_or_dtype.kv_cache_format
    return kv_cache_format(spec_or_dtype)
