"""The Triton backend's launch heuristics: host-only rules that pick tiles, split-KV counts and kernels.

Everything here is pure Python over host ints (plus the device's SM count, queried once per device), so a builder
evaluates it in ``build`` (or at CUDA-graph capture) and tests check it on a CPU. The measurements behind each rule
are in ``benchmarks/NOTES.md``.

- unified kernel: :func:`choose_num_kv_splits` (split-KV decode), :func:`pick_kernel_config` (tiles, warps,
  stages), :func:`fused_merge_rows` (the rows a fused split-KV merge takes at once),
  :func:`deterministic_kernel_config` (the batch-invariant mode's fixed tiles), :data:`MAX_DECODE_TILE_ROWS`;
- Triton prefill kernel: :func:`default_prefill_config`, :func:`prefill_kernel_pays` (split a batch or not);
- the device: :func:`device_sm_count`.

The write-beside rule (SMs a Gluon prefill leaves to the cache write) has its model in :mod:`.write_beside`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from ..ops.launch_math import next_power_of_2
from ..spec import AttentionSpec
from .kv_load import dots_in_fp16

__all__ = [
    "DETERMINISTIC_QUERY_LEN",
    "KernelConfig",
    "MAX_DECODE_TILE_ROWS",
    "MAX_KV_SPLITS",
    "MERGE_TILE_VALUES",
    "PrefillConfig",
    "choose_num_kv_splits",
    "default_prefill_config",
    "deterministic_kernel_config",
    "device_sm_count",
    "fused_merge_rows",
    "pick_kernel_config",
    "prefill_kernel_pays",
]

#: Most KV segments per (sequence, KV head) of a split-KV decode (the builder's workspace holds this many).
MAX_KV_SPLITS = 32

#: Most rows (decode query tokens x query heads per KV head) one decode program holds.
MAX_DECODE_TILE_ROWS = 128

#: Most float32 partial values the fused split-KV merge loads at once (32 registers a thread at 4 warps).
MERGE_TILE_VALUES = 4096

#: The query length the deterministic mode's fixed tile config is picked for (any batch then uses that config).
DETERMINISTIC_QUERY_LEN = 64


# --------------------------------------------------------------------------------------------------------------
# The device
# --------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (queried once per GPU); 1 for a device that is not CUDA."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# --------------------------------------------------------------------------------------------------------------
# Unified kernel: split-KV and tiles
# --------------------------------------------------------------------------------------------------------------
def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, num_heads: int, num_sms: int,
                         max_seq_len: Optional[int] = None, *, max_query_len: int = 1,
                         max_splits: int = MAX_KV_SPLITS, min_keys_per_split: int = 64,
                         programs_per_sm: int = 2) -> int:
    """Number of KV segments per (sequence, KV head) for split-KV decode; 1 means no split.

    Pure Python, so it can be evaluated once at CUDA-graph capture and unit-tested on a CPU. A program owns one
    KV head of one sequence (its ``num_heads // num_kv_heads`` query heads are packed into one tile), so a
    decode batch launches ``num_seqs * num_kv_heads`` programs; when that is under ``programs_per_sm`` programs
    per SM the key range is cut so the memory system gets enough loads in flight, into the largest power of two
    of segments that keeps the programs at or under that many per SM (the split launch merges its segments itself:
    past one to two programs per SM the merge's wait costs more than the loads gain). The result is a power of two
    (few compiled variants), at most ``max_splits``, and leaves at least ``min_keys_per_split`` keys of
    ``max_seq_len`` (when given) to each segment. Batches with long queries (``max_query_len > 16``) already
    have enough programs and never split.
    """
    if num_seqs < 1 or num_kv_heads < 1 or num_heads < 1 or num_sms < 1:
        raise ValueError("num_seqs, num_kv_heads, num_heads and num_sms must be positive")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if max_query_len > 16:
        return 1
    programs = num_seqs * num_kv_heads
    target = programs_per_sm * num_sms
    if programs >= target:
        return 1
    splits = target // programs
    if max_seq_len is not None:
        splits = min(splits, max(1, max_seq_len // max(1, min_keys_per_split)))
    splits = min(splits, max(1, max_splits))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch options of the unified kernel.

    ``decode_block_m``/``decode_tile_n`` are used by the decode path (one query token per program),
    ``block_m``/``tile_n`` by the generic path (``block_m // queries_per_kv`` query tokens per program).
    """

    decode_block_m: int = 16
    decode_tile_n: int = 64
    block_m: int = 128
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def pick_kernel_config(head_size: int, queries_per_kv: int, max_query_len: int, *, has_decode_path: bool,
                       has_generic_path: bool, kv_fp8: bool = False, keys_per_split: Optional[int] = None,
                       max_seq_len: Optional[int] = None) -> KernelConfig:
    """Default tiles (the tile sweeps behind them: benchmarks/NOTES.md).

    Decode: ``max(16, queries_per_kv)`` rows; 128 keys (8 pages of 16) per step, or 64 when split-KV leaves
    fewer than 512 keys per segment; 4 warps, 3 stages. Prefill: up to 128 rows; 128 keys per step with
    8 warps for long sequences, 32 keys with 4 warps for short ones.
    """
    head_pad = next_power_of_2(head_size)
    qpk_pad = next_power_of_2(queries_per_kv)
    decode_block_m = max(16, qpk_pad)
    big_head = head_pad > 128
    if big_head:
        decode_tile_n = 32
    elif keys_per_split is not None and keys_per_split < 512 and not kv_fp8:
        decode_tile_n = 64
    else:
        decode_tile_n = 128
    rows = max_query_len * queries_per_kv
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    if big_head:
        block_m = min(block_m, 64 if head_pad <= 256 else 32)
    block_m = max(block_m, qpk_pad)
    long_seqs = max_seq_len is None or max_seq_len >= 2048
    if big_head:
        tile_n = 32
    elif block_m >= 128:
        tile_n = 128 if long_seqs else 32
    else:
        tile_n = 64
    if has_generic_path and has_decode_path and block_m >= 128 and not big_head:
        # One launch for decodes + prefills: 4 warps and 32-key prefill steps suit both paths.
        tile_n, num_warps, num_stages = 32, 4, 3
    elif has_generic_path and block_m >= 128 and long_seqs:
        num_warps, num_stages = 8, 3
    elif head_pad > 256:
        # A 512-wide accumulator: spread it over 8 warps once a tile has more than 16 rows.
        num_warps, num_stages = (8 if block_m > 16 else 4), 2
    else:
        num_warps, num_stages = 4, (2 if big_head else 3)
    return KernelConfig(decode_block_m, decode_tile_n, block_m, tile_n, num_warps, num_stages)


def fused_merge_rows(tile_rows: int, seg_pad: int, head_pad: int) -> int:
    """Query rows the fused split-KV merge (the last segment program of a decode) merges at once: a power of two, at
    most ``tile_rows`` (the decode tile's rows, rounded up to a power of two), and as many as keep a step's partials
    (rows x ``seg_pad`` segments x ``head_pad`` values) within :data:`MERGE_TILE_VALUES`, one row at least."""
    rows = max(1, MERGE_TILE_VALUES // (seg_pad * head_pad))
    rows = 1 << (rows.bit_length() - 1)
    return min(next_power_of_2(tile_rows), rows)


def deterministic_kernel_config(spec: AttentionSpec) -> KernelConfig:
    """The tile config of deterministic mode: a function of the spec only (head size, heads per KV head, cache
    dtype), never of the batch."""
    return pick_kernel_config(
        spec.head_size, spec.num_queries_per_kv, DETERMINISTIC_QUERY_LEN, has_decode_path=True,
        has_generic_path=True, kv_fp8=dots_in_fp16(spec), keys_per_split=None, max_seq_len=None,
    )


# --------------------------------------------------------------------------------------------------------------
# Triton prefill kernel
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch options of the prefill kernel. ``gqa_pack``: query heads of one KV head per program
    (the tile's rows are ``block_m // gqa_pack`` tokens x ``gqa_pack`` heads); 1 (default): one head."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    gqa_pack: int = 1


def default_prefill_config(interpreted: bool = False, head_size: int = 128,
                           sliding_window: Optional[int] = None) -> PrefillConfig:
    """The launch config (tiny tiles under the interpreter). Head 128: 64x64 tiles on one warpgroup, the tile
    sweep's choice on every prefill shape although it spills a little (two CTAs per SM hide the spill). A window
    masks every tile it covers, which at head size 128 spills more with 64-key tiles: 32-key tiles there
    (benchmarks/prefill_compile_report.py shows the spills)."""
    if interpreted:
        return PrefillConfig(16, 16, 4, 1)
    if sliding_window and head_size > 64:
        return PrefillConfig(block_n=32)
    if head_size == 128:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return PrefillConfig()


def prefill_kernel_pays(query_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, first_seq: int) -> bool:
    """Whether the prefill kernel should run requests ``first_seq`` onwards rather than the unified kernel.

    It reads the new tokens' keys and values by TMA, fast, but the cached context through page-table loads, slower
    than the unified kernel: a context-heavy step runs faster in one unified launch than split between the two
    kernels. So it runs where the new tokens' causal attention is at least as much work as their attention to the
    context: sum(q^2 / 2) >= sum(q * context), with q the new tokens and context the cached ones of each request
    (int32 CPU tensors [num_reqs])."""
    q = query_lens_cpu.numpy()[first_seq:].astype(np.int64)  # numpy: less host time than torch ops on tiny tensors
    context = seq_lens_cpu.numpy()[first_seq:] - q
    return int(q @ q) >= 2 * int(q @ context)
