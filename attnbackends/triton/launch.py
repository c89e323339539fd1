"""Launchers for the Triton unified paged-attention kernels.

``unified_attention`` runs a whole mixed batch (decodes, prefills, chunked prefills) in one kernel launch, plus
one reduction launch when split-KV is used. It performs no host-device synchronisation, and allocates nothing
when a :class:`SplitKVWorkspace` is passed, so a decode step can be captured in a CUDA graph: the grid depends
only on tensor shapes and on host ints fixed at capture (``num_decodes``, ``num_kv_splits``), never on the
values of ``seq_lens``.

Argument checks live in :func:`check_unified_attention_args`; call it once (``validate=True``, the default, calls
it on every launch) and pass ``validate=False`` on the hot path.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch

from ..compat import DirectLauncher
from ..ops.launch_math import next_power_of_2
from ..ops.quant import FP8_DTYPES
from ..platform import is_triton_interpreted
from .kernels import _reduce_segments_kernel, _unified_attention_kernel

logger = logging.getLogger(__name__)

__all__ = [
    "KernelConfig",
    "LaunchPlan",
    "SplitKVWorkspace",
    "check_unified_attention_args",
    "choose_num_kv_splits",
    "launch_attention",
    "pick_kernel_config",
    "plan_attention",
    "unified_attention",
    "varlen_attention",
]

Scale = Union[float, torch.Tensor]

QUERY_DTYPES = (torch.float16, torch.bfloat16)
MIN_HEAD_SIZE = 32
MAX_HEAD_SIZE = 512
MAX_KV_SPLITS = 32


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# --------------------------------------------------------------------------------------------------------------
# Split-KV workspace and heuristic
# --------------------------------------------------------------------------------------------------------------
@dataclass
class SplitKVWorkspace:
    """Preallocated buffers for split-KV partial results (allocate once, reuse every step and in CUDA graphs).

    Attributes
    ----------
    partial_out : torch.Tensor
        ``[max_num_tokens, num_heads, max_segments, head_size]`` float32, normalised per-segment outputs.
    partial_lse : torch.Tensor
        ``[max_num_tokens, num_heads, max_segments]`` float32, per-segment log2-sum-exp (``-inf``: no keys).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(cls, max_num_tokens: int, num_heads: int, head_size: int, max_segments: int = MAX_KV_SPLITS,
                 device: Union[torch.device, str, None] = None) -> "SplitKVWorkspace":
        """Allocate buffers for up to ``max_num_tokens`` query tokens and ``max_segments`` KV segments."""
        for name, value in (("max_num_tokens", max_num_tokens), ("num_heads", num_heads),
                            ("head_size", head_size), ("max_segments", max_segments)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        partial_out = torch.empty(max_num_tokens, num_heads, max_segments, head_size, dtype=torch.float32,
                                  device=device)
        partial_lse = torch.empty(max_num_tokens, num_heads, max_segments, dtype=torch.float32, device=device)
        return cls(partial_out, partial_lse)

    @property
    def max_num_tokens(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_segments(self) -> int:
        return self.partial_out.shape[2]

    def fits(self, num_tokens: int, num_heads: int, head_size: int, num_segments: int) -> bool:
        """Whether a batch of this shape can use the workspace with ``num_segments`` segments."""
        t, h, s, d = self.partial_out.shape
        return num_tokens <= t and num_heads == h and head_size == d and num_segments <= s


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, num_heads: int, num_sms: int,
                         max_seq_len: Optional[int] = None, *, max_query_len: int = 1,
                         max_splits: int = MAX_KV_SPLITS, min_keys_per_split: int = 128,
                         programs_per_sm: int = 3) -> int:
    """Number of KV segments per (sequence, KV head) for split-KV decode; 1 means no split.

    Pure Python, so it can be evaluated once at CUDA-graph capture and unit-tested on a CPU. A program owns one
    KV head of one sequence (its ``num_heads // num_kv_heads`` query heads are packed into one tile), so a
    decode batch launches ``num_seqs * num_kv_heads`` programs; when that is under ``programs_per_sm`` programs
    per SM the key range is cut so the memory system gets enough loads in flight. The result is a power of two
    (few compiled variants), at most ``max_splits``, and leaves at least ``min_keys_per_split`` keys of
    ``max_seq_len`` (when given) to each segment. Batches with long queries (``max_query_len > 16``) already
    have enough programs and never split.

    H100 (132 SMs, 32/8 heads, head 128): B=1 x 1024 -> 8 (17.6 us; 16: 19.4, 32: 18.4), B=1 x 16384 -> 32
    (46 us; 16: 52), B=16 x 4096 -> 4, B >= 64 -> 1 (2 was 5-10% slower).
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
    splits = next_power_of_2(math.ceil(target / programs))
    if max_seq_len is not None:
        splits = min(splits, max(1, max_seq_len // max(1, min_keys_per_split)))
    splits = min(splits, max(1, max_splits))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


# --------------------------------------------------------------------------------------------------------------
# Tile configuration
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """Tile shapes and launch options.

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
    """Default tiles, from sweeps on an H100 (benchmarks/NOTES.md).

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
        # One launch for decodes + prefills: 4 warps and 32-key prefill steps suit both paths (the mixed-batch
        # sweep in benchmarks/NOTES.md).
        tile_n, num_warps, num_stages = 32, 4, 3
    elif has_generic_path and block_m >= 128 and long_seqs:
        num_warps, num_stages = 8, 3
    elif head_pad > 256:
        # A 512-wide accumulator: spread it over 8 warps once a tile has more than 16 rows.
        num_warps, num_stages = (8 if block_m > 16 else 4), 2
    else:
        num_warps, num_stages = 4, (2 if big_head else 3)
    return KernelConfig(decode_block_m, decode_tile_n, block_m, tile_n, num_warps, num_stages)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------
def _check_scale(name: str, scale: Scale, device: torch.device) -> None:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be a python float or a 1-element float32 tensor, got "
                             f"{tuple(scale.shape)} {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device}, expected {device}")
    elif isinstance(scale, (float, int)) and not isinstance(scale, bool):
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"{name} must be a positive finite number, got {scale}")
    else:
        raise ValueError(f"{name} must be a python float or a 1-element float32 tensor, got {type(scale).__name__}")


def _check_common(query: torch.Tensor, output: torch.Tensor, query_start_loc: torch.Tensor, num_kv_heads: int,
                  head_size: int, causal: bool, sliding_window, logits_soft_cap, alibi_slopes, sinks,
                  softmax_scale) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
    allowed = QUERY_DTYPES + ((torch.float32,) if (query.device.type == "cpu") else ())
    if query.dtype not in allowed:
        raise ValueError(f"query dtype must be one of {allowed}, got {query.dtype}")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dimension (stride(-1) == 1)")
    num_heads = query.shape[1]
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} does not match the key head_size {head_size}")
    if not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be in [{MIN_HEAD_SIZE}, {MAX_HEAD_SIZE}], got {head_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if output.shape != query.shape:
        raise ValueError(f"output shape {tuple(output.shape)} must equal query shape {tuple(query.shape)}")
    if output.dtype not in QUERY_DTYPES + (torch.float32,):
        raise ValueError(f"output dtype must be float16, bfloat16 or float32, got {output.dtype}")
    if output.stride(-1) != 1:
        raise ValueError("output must be contiguous in its last dimension (stride(-1) == 1)")
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32 or query_start_loc.numel() < 2:
        raise ValueError("query_start_loc must be a 1-D int32 tensor [num_seqs + 1], got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    for name, t in (("output", output), ("query_start_loc", query_start_loc)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device} (query's device)")
    if not isinstance(softmax_scale, (float, int)) or isinstance(softmax_scale, bool) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive python float, got {softmax_scale!r}")
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
        if not causal:
            raise NotImplementedError("sliding_window is only supported with causal=True")
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (float, int)) or not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be None or a positive float, got {logits_soft_cap!r}")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (num_heads,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor of shape [num_heads] = [{num_heads}]")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")


def check_unified_attention_args(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table,
                                 max_query_len, max_seq_len, softmax_scale, *, causal=True, sliding_window=None,
                                 logits_soft_cap=None, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
                                 workspace=None, num_decodes=None, num_kv_splits=None) -> None:
    """Validate the arguments of :func:`unified_attention`; raises ValueError / NotImplementedError naming the
    offending argument. Reads only shapes, dtypes, strides and devices (no host-device sync)."""
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got "
                             f"{getattr(t, 'shape', None)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1)")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
    _, block_size, num_kv_heads, head_size = key_cache.shape
    _check_common(query, output, query_start_loc, num_kv_heads, head_size, causal, sliding_window,
                  logits_soft_cap, alibi_slopes, sinks, softmax_scale)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in FP8_DTYPES and t.dtype != query.dtype:
            raise ValueError(f"{name} dtype must be query's dtype ({query.dtype}) or one of {FP8_DTYPES}, "
                             f"got {t.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
                         f"{tuple(value_cache.shape)} {value_cache.dtype} must match")
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size (key_cache.shape[1]) must be a positive multiple of 16, got {block_size}")
    num_seqs = query_start_loc.numel() - 1
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.numel() != num_seqs:
        raise ValueError(f"seq_lens must be a 1-D int32 tensor [num_seqs] = [{num_seqs}], got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table must be a 2-D int32 tensor [>= num_seqs, max_blocks], got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    for name, t in (("seq_lens", seq_lens), ("block_table", block_table)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
    for name, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative python int (host value), got {v!r}")
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds block_table capacity "
                         f"{block_table.shape[1]} x {block_size}")
    _check_scale("k_scale", k_scale, query.device)
    _check_scale("v_scale", v_scale, query.device)
    if isinstance(k_scale, torch.Tensor) != isinstance(v_scale, torch.Tensor):
        raise ValueError("k_scale and v_scale must both be floats or both be tensors")
    if num_decodes is not None:
        if not isinstance(num_decodes, int) or not 0 <= num_decodes <= num_seqs:
            raise ValueError(f"num_decodes must be None or an int in [0, num_seqs={num_seqs}], got {num_decodes!r}")
        if num_decodes > query.shape[0]:
            raise ValueError(f"num_decodes ({num_decodes}) exceeds num_tokens ({query.shape[0]})")
    if num_kv_splits is not None:
        if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= 64:
            raise ValueError(f"num_kv_splits must be None or an int in [1, 64], got {num_kv_splits!r}")
    if workspace is not None and not isinstance(workspace, SplitKVWorkspace):
        raise ValueError(f"workspace must be a SplitKVWorkspace, got {type(workspace).__name__}")
    if workspace is not None and workspace.partial_out.device != query.device:
        raise ValueError(f"workspace is on {workspace.partial_out.device}, expected {query.device}")


# --------------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------------
#: The constexpr parameters of ``_unified_attention_kernel`` and ``_reduce_segments_kernel``, in signature order.
UNIFIED_CONSTEXPRS = (
    "QPK", "HEAD_SIZE", "HEAD_PAD", "BLOCK_SIZE", "DECODE_PATH", "DECODE_BLOCK_M", "DECODE_TILE_N", "GENERIC_PATH",
    "BLOCK_Q", "BLOCK_M", "TILE_N", "PAGED", "CAUSAL", "SLIDING_WINDOW", "USE_SOFTCAP", "USE_ALIBI", "USE_SINKS",
    "SCALES_ARE_PTRS", "KV_FP8", "NUM_SEGMENTS", "RETURN_LSE", "INTERPRET", "DECODE_Q", "USE_TREE",
)
REDUCE_CONSTEXPRS = ("HEAD_SIZE", "HEAD_PAD", "NUM_SEGMENTS", "SEG_PAD", "RETURN_LSE")

_attention_launcher = DirectLauncher(_unified_attention_kernel, UNIFIED_CONSTEXPRS)
_reduce_launcher = DirectLauncher(_reduce_segments_kernel, REDUCE_CONSTEXPRS)


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch decision for one batch of one layer group, made once (a builder makes it in ``build``).

    Attributes
    ----------
    grid : (programs, num_kv_heads, num_kv_splits) of the attention kernel; ``grid[0] == 0``: nothing to run.
    num_seqs, num_decodes : requests in the batch; the first ``num_decodes`` run on the decode tiles.
    constexprs : the values of :data:`UNIFIED_CONSTEXPRS` (tile shapes, features, paths).
    num_warps, num_stages : launch options of the attention kernel.
    config : the tile configuration the constexprs came from.
    workspace : split-KV partial buffers (``num_kv_splits > 1``), else None.
    partial_strides : (token, head, segment) strides of ``workspace.partial_out`` and (token, head) of
        ``partial_lse``; zeros without split-KV.
    reduce_grid, reduce_constexprs, reduce_num_warps : the split-KV reduction's launch (grid None: no reduction).
    """

    grid: tuple[int, int, int]
    num_seqs: int
    num_decodes: int
    constexprs: tuple
    num_warps: int
    num_stages: int
    config: KernelConfig
    workspace: Optional[SplitKVWorkspace]
    partial_strides: tuple[int, int, int, int, int]
    reduce_grid: Optional[tuple[int, int, int]]
    reduce_constexprs: tuple
    reduce_num_warps: int

    @property
    def num_kv_splits(self) -> int:
        return self.grid[2]


def plan_attention(
    *, num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, num_seqs: int,
    max_query_len: int, max_seq_len: int, kv_fp8: bool, causal: bool, sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None, use_alibi: bool = False, use_sinks: bool = False,
    scales_are_ptrs: bool = False, paged: bool = True, return_lse: bool = False, num_decodes: Optional[int] = None,
    num_kv_splits: Optional[int] = None, num_sms: int = 1, workspace: Optional[SplitKVWorkspace] = None,
    config: Optional[KernelConfig] = None, device: Union[torch.device, str, None] = None,
    decode_query_len: int = 1, use_tree: bool = False,
) -> LaunchPlan:
    """The launch plan of one batch: split-KV factor, tile config, grid and constexprs, from host ints only.

    ``num_tokens``: query tokens of the batch (padding excluded). ``num_decodes``: default all sequences when
    ``max_query_len <= 1``, else none. ``num_kv_splits``: default :func:`choose_num_kv_splits` with ``num_sms``
    (pass 1 on the CPU). A split needs ``workspace`` to fit the batch; without one, one is allocated on
    ``device`` (not CUDA-graph capturable), and a workspace too small means no split. ``decode_query_len``: the
    longest decode (speculative verify: 1 + draft tokens); a decode program then holds all of a request's query
    tokens x its query heads in one tile. ``use_tree``: the launch takes a packed tree mask.
    """
    qpk = num_heads // num_kv_heads
    if num_decodes is None:
        num_decodes = num_seqs if max_query_len <= 1 else 0
    decode_path = num_decodes > 0
    generic_path = num_decodes < num_seqs
    if num_kv_splits is None:
        num_kv_splits = 1
        if num_sms > 1 and num_seqs > 0:
            num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, num_heads, num_sms, max_seq_len,
                                                 max_query_len=max_query_len)
    if config is None:
        config = pick_kernel_config(head_size, qpk, max_query_len, has_decode_path=decode_path,
                                    has_generic_path=generic_path, kv_fp8=kv_fp8,
                                    keys_per_split=max_seq_len // num_kv_splits, max_seq_len=max_seq_len)
    block_m = max(config.block_m, next_power_of_2(qpk))
    block_q = max(1, block_m // qpk)
    if num_kv_splits > 1:
        if workspace is None:
            workspace = SplitKVWorkspace.allocate(max(num_tokens, 1), num_heads, head_size, num_kv_splits, device)
        elif not workspace.fits(num_tokens, num_heads, head_size, num_kv_splits):
            logger.debug("split-KV workspace too small for %d tokens x %d segments; not splitting",
                         num_tokens, num_kv_splits)
            num_kv_splits = 1
    if num_kv_splits > 1:
        po, pl = workspace.partial_out, workspace.partial_lse
        partial_strides = (po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1))
    else:
        workspace, partial_strides = None, (0, 0, 0, 0, 0)
    programs = (num_decodes if decode_path else 0) + (
        num_tokens // block_q + num_seqs - num_decodes if generic_path else 0)
    head_pad = next_power_of_2(head_size)
    constexprs = (
        qpk, head_size, head_pad, block_size, decode_path,
        max(config.decode_block_m, next_power_of_2(qpk * max(1, decode_query_len))),
        config.decode_tile_n, generic_path, block_q, block_m, config.tile_n, paged, bool(causal),
        int(sliding_window or 0), bool(logits_soft_cap), use_alibi, use_sinks, scales_are_ptrs, kv_fp8,
        num_kv_splits, return_lse, is_triton_interpreted(), max(1, decode_query_len), bool(use_tree),
    )
    reduce_grid = (num_tokens, num_heads, 1) if num_kv_splits > 1 and programs else None
    return LaunchPlan(
        grid=(programs, num_kv_heads, num_kv_splits), num_seqs=num_seqs, num_decodes=num_decodes,
        constexprs=constexprs, num_warps=config.num_warps, num_stages=config.num_stages, config=config,
        workspace=workspace, partial_strides=partial_strides, reduce_grid=reduce_grid,
        reduce_constexprs=(head_size, head_pad, num_kv_splits, next_power_of_2(num_kv_splits), return_lse),
        reduce_num_warps=4 if head_pad * num_kv_splits >= 2048 else 2,
    )


def _alignment(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def launch_attention(
    plan: LaunchPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    output: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], softmax_scale: float, logits_soft_cap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None, k_scale: Scale = 1.0,
    v_scale: Scale = 1.0, return_lse: Optional[torch.Tensor] = None, *, cache_key: Optional[tuple] = None,
    tree_mask: Optional[torch.Tensor] = None, tree_indptr: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run ``plan`` on these tensors (no checks: see :func:`unified_attention` for the shapes).

    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` views when the plan is
    paged; ``[num_tokens, num_kv_heads, head_size]`` keys and values otherwise (``seq_lens`` and ``block_table``
    None). ``cache_key``: what the caller knows fixes the caches' part of the compiled-kernel key (their dtype,
    strides and alignment); computed here when None. ``tree_mask`` ([sum n_i^2] uint8) and ``tree_indptr``
    ([num_seqs + 1] int32): the packed tree mask of a plan made with ``use_tree``.
    """
    if plan.grid[0] == 0:
        return output
    dummy = output
    paged = block_table is not None
    if cache_key is None:
        cache_key = (key_cache.dtype, key_cache.stride(), value_cache.stride(), _alignment(key_cache),
                     _alignment(value_cache))
    if paged:
        stride_kb, stride_ks, stride_kh = key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)
        stride_vb, stride_vs, stride_vh = value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)
        num_blocks, stride_bt = key_cache.shape[0], block_table.stride(0)
    else:
        stride_kb, stride_ks, stride_kh = 0, key_cache.stride(0), key_cache.stride(1)
        stride_vb, stride_vs, stride_vh = 0, value_cache.stride(0), value_cache.stride(1)
        num_blocks, stride_bt = 1, 0
        block_table = seq_lens = dummy
    workspace = plan.workspace
    partial_out, partial_lse = (workspace.partial_out, workspace.partial_lse) if workspace is not None else (
        dummy, dummy)
    scales_are_ptrs = plan.constexprs[17]
    lse_stride_h = return_lse.stride(0) if return_lse is not None else 0
    lse = return_lse if return_lse is not None else dummy
    args = (
        query, key_cache, value_cache, output, block_table, num_blocks, seq_lens, query_start_loc,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        partial_out, partial_lse, lse,
        k_scale if scales_are_ptrs else float(k_scale), v_scale if scales_are_ptrs else float(v_scale),
        tree_mask if tree_mask is not None else dummy, tree_indptr if tree_indptr is not None else dummy,
        plan.num_seqs, plan.num_decodes,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        *plan.partial_strides, lse_stride_h, softmax_scale, logits_soft_cap,
    )
    key = (plan.constexprs, plan.num_warps, plan.num_stages, query.dtype, output.dtype, block_table.dtype,
           _alignment(query), _alignment(output), cache_key)
    _attention_launcher(key, plan.grid, args, plan.constexprs, plan.num_warps, plan.num_stages)
    if plan.reduce_grid is not None:
        args = (output, partial_out, partial_lse, lse, query_start_loc, plan.num_seqs, output.stride(0),
                output.stride(1), *plan.partial_strides, lse_stride_h)
        key = (plan.reduce_constexprs, plan.reduce_num_warps, output.dtype, _alignment(output))
        _reduce_launcher(key, plan.reduce_grid, args, plan.reduce_constexprs, plan.reduce_num_warps, 2)
    return output


def _launch(query, key, value, output, query_start_loc, seq_lens, block_table, *, paged, block_size,
            max_query_len, max_seq_len, softmax_scale, causal, sliding_window, logits_soft_cap, alibi_slopes,
            sinks, k_scale, v_scale, workspace, num_decodes, num_kv_splits, config, return_lse=None):
    """Plan and launch in one go: the functional entry points' path."""
    num_tokens, num_heads, head_size = query.shape
    device = output.device
    plan = plan_attention(
        num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=key.shape[-2], head_size=head_size,
        block_size=block_size, num_seqs=query_start_loc.shape[0] - 1, max_query_len=max_query_len,
        max_seq_len=max_seq_len, kv_fp8=key.dtype in FP8_DTYPES, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, use_alibi=alibi_slopes is not None, use_sinks=sinks is not None,
        scales_are_ptrs=isinstance(k_scale, torch.Tensor), paged=paged, return_lse=return_lse is not None,
        num_decodes=num_decodes, num_kv_splits=num_kv_splits,
        num_sms=_device_sm_count(device) if device.type == "cuda" else 1, workspace=workspace, config=config,
        device=device,
    )
    return launch_attention(
        plan, query, key, value, output, query_start_loc, seq_lens if paged else None,
        block_table if paged else None, float(softmax_scale), float(logits_soft_cap or 0.0), alibi_slopes, sinks,
        k_scale, v_scale, return_lse)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    *,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    workspace: Optional[SplitKVWorkspace] = None,
    num_decodes: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    validate: bool = True,
    config: Optional[KernelConfig] = None,
    return_lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged attention over a mixed batch of decodes, prefills and chunked prefills, in one launch.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_size]`` float16 / bfloat16 (float32 on CPU), last dim contiguous. Tokens at
        index ``>= query_start_loc[-1]`` are padding: their output rows are left untouched.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_size]``, query's dtype or float8_e4m3fn / float8_e5m2;
        strided views such as ``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` of a
        ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` cache. ``block_size`` is a multiple of 16.
        The new tokens' keys and values must already be written.
    output : torch.Tensor
        ``[num_tokens, num_heads, head_size]`` float16 / bfloat16 / float32, written in place and returned.
    query_start_loc : torch.Tensor
        ``[num_seqs + 1]`` int32, cumulative query lengths (``query_start_loc[0] == 0``).
    seq_lens : torch.Tensor
        ``[num_seqs]`` int32, context + new tokens per sequence.
    block_table : torch.Tensor
        ``[>= num_seqs, max_blocks]`` int32, physical block of each logical block.
    max_query_len, max_seq_len : int
        Host upper bounds of the query lengths and sequence lengths (pick tile shapes and the split count).
    softmax_scale : float
        Scale applied to ``q . k``.
    causal : bool
        Query at position ``p`` sees keys ``0..p`` (True) or every key of its sequence (False).
    sliding_window : int, optional
        Key ``j`` is visible from position ``p`` iff ``p - W < j <= p``. Causal only.
    logits_soft_cap : float, optional
        ``cap * tanh(s / cap)`` applied to the scaled logits, before ALiBi and masking.
    alibi_slopes : torch.Tensor, optional
        ``[num_heads]`` float32; adds ``slope_h * (j - p)`` to the logits.
    sinks : torch.Tensor, optional
        ``[num_heads]`` float32; one extra logit per head in the softmax denominator, carrying no value.
    k_scale, v_scale : float or torch.Tensor
        fp8 dequantisation scales (``read = stored * scale``): python floats or 1-element float32 tensors
        (tensors avoid recompiles and host syncs). Ignored for a non-fp8 cache.
    workspace : SplitKVWorkspace, optional
        Buffers for split-KV partials; without it, split-KV allocates (not CUDA-graph capturable).
    num_decodes : int, optional
        The first ``num_decodes`` sequences have query length 1 and run on the decode tiles, the rest on the
        prefill tiles, in the same launch. Default: all sequences when ``max_query_len <= 1``, else none.
    num_kv_splits : int, optional
        Force the number of KV segments (1: no split). Default: :func:`choose_num_kv_splits` on CUDA, 1 on CPU.
        Fix it when capturing a CUDA graph.
    validate : bool
        Run :func:`check_unified_attention_args` first (pass False on the hot path once checked).
    config : KernelConfig, optional
        Override the tile configuration (tuning).
    return_lse : torch.Tensor, optional
        ``[num_heads, >= num_tokens]`` float32 with unit stride in the token dimension; receives the natural-log
        log-sum-exp of each query row's logits over its visible keys (sinks included), ``-inf`` where the row sees
        no key (e.g. ``seq_len`` 0: a context-parallel rank holding none of the sequence's blocks; its output row
        is then 0). Padding rows are left untouched. For merging partial results with ``merge_attn_states``.

    Returns
    -------
    torch.Tensor
        ``output``.
    """
    if validate:
        if return_lse is not None:
            if (return_lse.dim() != 2 or return_lse.dtype != torch.float32 or return_lse.shape[0] != query.shape[1]
                    or return_lse.shape[1] < query.shape[0] or return_lse.stride(1) != 1):
                raise ValueError(f"return_lse must be a [num_heads={query.shape[1]}, >= num_tokens={query.shape[0]}] "
                                 f"float32 tensor with unit token stride, got {tuple(return_lse.shape)} "
                                 f"{return_lse.dtype} strides {tuple(return_lse.stride())}")
            if return_lse.device != query.device:
                raise ValueError(f"return_lse is on {return_lse.device}, expected {query.device}")
        check_unified_attention_args(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, max_query_len,
            max_seq_len, softmax_scale, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale, workspace=workspace, num_decodes=num_decodes, num_kv_splits=num_kv_splits)
    return _launch(
        query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, paged=True,
        block_size=key_cache.shape[1], max_query_len=max_query_len, max_seq_len=max_seq_len, softmax_scale=softmax_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, workspace=workspace, num_decodes=num_decodes,
        num_kv_splits=num_kv_splits, config=config, return_lse=return_lse)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    softmax_scale: float,
    causal: bool = False,
    *,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    validate: bool = True,
    config: Optional[KernelConfig] = None,
) -> torch.Tensor:
    """Attention over contiguous variable-length sequences without a KV cache (encoder self-attention).

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_size]`` float16 / bfloat16 (float32 on CPU), last dim contiguous.
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_size]``, query's dtype, last dim contiguous. Sequence ``i`` owns rows
        ``query_start_loc[i]:query_start_loc[i+1]`` of query, key and value.
    output : torch.Tensor
        ``[num_tokens, num_heads, head_size]``, written in place (padding rows untouched) and returned.
    query_start_loc : torch.Tensor
        ``[num_seqs + 1]`` int32 cumulative sequence lengths.
    max_seq_len : int
        Host upper bound of the sequence lengths.
    softmax_scale : float
        Scale applied to ``q . k``.
    causal : bool
        Default False (every token sees its whole sequence).
    sliding_window, logits_soft_cap, alibi_slopes, sinks
        As in :func:`unified_attention`.
    """
    if validate:
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 3 or t.shape[0] != query.shape[0] or t.shape[2] != query.shape[2]:
                raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_size] matching query "
                                 f"{tuple(query.shape)}, got {tuple(t.shape)}")
            if t.dtype != query.dtype:
                raise ValueError(f"{name} dtype {t.dtype} must equal query dtype {query.dtype}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
            if t.device != query.device:
                raise ValueError(f"{name} is on {t.device}, expected {query.device}")
        if key.shape != value.shape:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
        _check_common(query, output, query_start_loc, key.shape[1], key.shape[2], causal, sliding_window,
                      logits_soft_cap, alibi_slopes, sinks, softmax_scale)
        if not isinstance(max_seq_len, int) or max_seq_len < 0:
            raise ValueError(f"max_seq_len must be a non-negative python int, got {max_seq_len!r}")
    return _launch(
        query, key, value, output, query_start_loc, None, None, paged=False, block_size=16, max_query_len=max(max_seq_len, 2), max_seq_len=max_seq_len, softmax_scale=softmax_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_scale=1.0, v_scale=1.0, workspace=None, num_decodes=0, num_kv_splits=1, config=config)
