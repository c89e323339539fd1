"""Which flash-attn is installed, and one call per flash-attn generation over our paged cache.

Three generations ship under different import names:

- flash-attn 4 (distribution ``flash-attn-4``): ``flash_attn.cute.flash_attn_varlen_func``; ``flash_attn`` itself is
  a namespace package there, so detection looks for the ``cute`` subpackage.
- flash-attn 3 (the Hopper build, ``flash_attn_interface``): ``flash_attn_with_kvcache`` takes varlen queries
  (``cu_seqlens_q``) over a paged cache (``page_table``).
- flash-attn 2 (``flash_attn``): ``flash_attn_varlen_func`` with ``block_table`` (pages of a multiple of 256 tokens).

:func:`installed_flash_attn` is the one place that decides which is present, without importing it (importing
``flash_attn.cute`` loads the CuTe DSL, seconds). The flash-attn 4 call uses its private ``_flash_attn_fwd`` where
:func:`attnbackends.compat.flash_attn_cute_private_forward` allows it (tested versions: it writes into the caller's
output, no extra copy), and the public function plus a copy elsewhere.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Optional

import torch

from ..compat import flash_attn_cute_private_forward

__all__ = [
    "FlashAttnInstall",
    "PagedCall",
    "installed_flash_attn",
    "paged_forward",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class FlashAttnInstall:
    """The installed flash-attn: its generation (2, 3 or 4), its distribution version, the module to import."""

    generation: int
    version: str
    module: str

    def describe(self) -> str:
        return f"flash-attn {self.generation} ({self.module} {self.version})"


def _real_module(name: str) -> bool:
    """``name`` can be imported and is a real module (not a bare namespace directory)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _version(*distributions: str) -> str:
    for dist in distributions:
        try:
            return importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    return "unknown"


@lru_cache(maxsize=None)
def installed_flash_attn() -> Optional[FlashAttnInstall]:
    """The newest flash-attn generation installed (4, then 3, then 2), or None; nothing is imported."""
    if _real_module("flash_attn.cute"):
        return FlashAttnInstall(4, _version("flash-attn-4", "flash_attn_4"), "flash_attn.cute")
    if _real_module("flash_attn_interface"):
        return FlashAttnInstall(3, _version("flash-attn-3", "flash_attn_3", "flashattn-hopper"), "flash_attn_interface")
    if _real_module("flash_attn"):
        version = _version("flash-attn", "flash_attn")
        if version.startswith("2."):
            return FlashAttnInstall(2, version, "flash_attn")
    return None


@dataclass(frozen=True)
class PagedCall:
    """What a layer fixes for every call: scale, causality, window (keys left and right of the query; None:
    unbounded), soft-cap (None: off) and sinks ([num_heads] float32 on the device, or None)."""

    softmax_scale: float
    causal: bool
    window_left: Optional[int]
    softcap: Optional[float]
    sinks: Optional[torch.Tensor]
    window_right: Optional[int] = None

    @property
    def window(self) -> tuple[Optional[int], Optional[int]]:
        """(left, right); a causal call's right side is 0 wherever a left side is set (as flash-attn reads it)."""
        right = self.window_right
        if right is None and self.window_left is not None and self.causal:
            right = 0
        return self.window_left, right


# A paged forward: (query [T, Hq, D], k_cache / v_cache [num_blocks, block_size, Hkv, D] (strided views of our
# cache), output [T, Hq, D], query_start_loc [R + 1] int32, seq_lens [R] int32, block_table [R, W] int32,
# cu_seqlens_k [R + 1] int32 or None, max_query_len, max_seq_len) -> None; writes output.
PagedForward = Callable[..., None]


def paged_forward(install: FlashAttnInstall, call: PagedCall) -> PagedForward:
    """The forward function of ``install``'s generation with ``call`` bound (imports flash-attn)."""
    if install.generation == 4:
        return _fa4_forward(install, call)
    if install.generation == 3:
        return _fa3_forward(call)
    if install.generation == 2:
        return _fa2_forward(call)
    raise ValueError(f"flash-attn generation {install.generation} is not supported; allowed: 2, 3, 4")


def _fa4_forward(install: FlashAttnInstall, call: PagedCall) -> PagedForward:
    window = call.window
    _flash_attn_fwd = flash_attn_cute_private_forward(install.version)
    if _flash_attn_fwd is not None:
        fixed: dict[str, Any] = dict(
            softmax_scale=call.softmax_scale, causal=call.causal, softcap=call.softcap,
            window_size_left=window[0], window_size_right=window[1], learnable_sink=call.sinks,
        )

        def forward(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, cu_seqlens_k,
                    max_query_len, max_seq_len) -> None:
            _flash_attn_fwd(
                q, k_cache, v_cache, cu_seqlens_q=query_start_loc, seqused_k=seq_lens, page_table=block_table,
                max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len, out=out, **fixed,
            )

        return forward

    from flash_attn.cute import flash_attn_varlen_func

    fixed = dict(softmax_scale=call.softmax_scale, causal=call.causal, softcap=call.softcap or 0.0,
                 window_size=window, learnable_sink=call.sinks)

    def forward_public(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, cu_seqlens_k,
                       max_query_len, max_seq_len) -> None:
        result, _ = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=query_start_loc, seqused_k=seq_lens, page_table=block_table,
            max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len, **fixed,
        )
        out.copy_(result)

    return forward_public


def _window_pair(call: PagedCall) -> tuple[int, int]:
    """flash-attn 2/3's (left, right) window; -1: unbounded."""
    left, right = call.window
    return (-1 if left is None else left, -1 if right is None else right)


def _fa3_forward(call: PagedCall) -> PagedForward:
    from flash_attn_interface import flash_attn_with_kvcache

    fixed = dict(softmax_scale=call.softmax_scale, causal=call.causal, softcap=call.softcap or 0.0,
                 window_size=_window_pair(call))

    def forward(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, cu_seqlens_k,
                max_query_len, max_seq_len) -> None:
        result = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seq_lens, page_table=block_table, cu_seqlens_q=query_start_loc,
            max_seqlen_q=max_query_len, **fixed,
        )
        out.copy_(result[0] if isinstance(result, tuple) else result)

    return forward


def _fa2_forward(call: PagedCall) -> PagedForward:
    from flash_attn import flash_attn_varlen_func

    fixed = dict(softmax_scale=call.softmax_scale, causal=call.causal, softcap=call.softcap or 0.0,
                 window_size=_window_pair(call))

    def forward(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, cu_seqlens_k,
                max_query_len, max_seq_len) -> None:
        result = flash_attn_varlen_func(
            q, k_cache, v_cache, query_start_loc, cu_seqlens_k, max_query_len, max_seq_len,
            block_table=block_table, **fixed,
        )
        out.copy_(result)

    return forward
