"""Launching the Triton unified paged-attention kernels: the launch plan, its launch, and the functional API.

``unified_attention`` runs a whole mixed batch (decodes, prefills, chunked prefills) in one kernel launch, plus
one reduction launch when split-KV is used beside prefill programs (a decode-only split merges its segments in the
same launch: :attr:`LaunchPlan.fused_reduce`). It performs no host-device synchronisation, and allocates nothing
when a :class:`SplitKVWorkspace` is passed, so a decode step can be captured in a CUDA graph: the grid depends
only on tensor shapes and on host ints fixed at capture (``num_decodes``, ``num_kv_splits``), never on the
values of ``seq_lens``.

A plan may carry a balanced decode schedule (:mod:`.decode_schedule`, made by the builder from host data): its
decode programs then run one work unit each, grid (num_kv_heads, units + other programs, 1), the units of a split
request merged in the launch; its grid's unit rows are the schedule's, fixed for a CUDA graph's buffer.

The choices a plan is made of (tiles, split-KV count) come from :mod:`.heuristics`; the argument checks are
:func:`attnbackends.validation.check_unified_attention_args` and its neighbours there: ``validate=True`` (the
default) runs them on every launch, pass ``validate=False`` on the hot path once checked. A builder makes
:class:`LaunchPlan` once per batch (:func:`plan_attention`) and :func:`launch_attention` runs it through the
compiled kernel's launcher (:class:`attnbackends.ops.launch.DirectLauncher`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..ops.launch import DirectLauncher
from ..ops.launch_math import next_power_of_2
from ..ops.quant import FP8_DTYPES
from ..platform import is_triton_interpreted
from ..spec import AttentionSpec, MaskKind
from ..validation import check_return_lse, check_unified_attention_args, check_varlen_attention_args
from .heuristics import (
    MAX_KV_SPLITS,
    KernelConfig,
    choose_num_kv_splits,
    device_sm_count,
    fused_merge_rows,
    pick_kernel_config,
)
from .decode_schedule import SCHEDULED_MERGE_VALUES, DecodeSchedule
from .kernels import _reduce_segments_kernel, _unified_attention_kernel
from .mask_math import MASK_BLOCK_CAUSAL, MASK_CUSTOM, MASK_NON_CAUSAL, MASK_NONE, MASK_SPANS
from .kv_load import KV_PLAIN, kernel_kv_format, launch_tensor_scales
from ..spec import KVCacheFormat

logger = logging.getLogger(__name__)

__all__ = [
    "LaunchPlan",
    "MaskPlan",
    "SplitKVWorkspace",
    "causal_sliding_window",
    "mask_plan",
    "launch_attention",
    "plan_attention",
    "unified_attention",
    "varlen_attention",
]

Scale = Union[float, torch.Tensor]


# --------------------------------------------------------------------------------------------------------------
# Split-KV workspace
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
    counters : torch.Tensor, optional
        ``[max_num_tokens * num_heads]`` int32, zero: the segment tickets of a launch that merges its own segments
        (:attr:`LaunchPlan.fused_reduce`), one per (decode program, KV head) at ``program * num_kv_heads + kv_head``.
        Zeroed once here; such a launch leaves them zero, so it replays from a CUDA graph without a memset. None:
        every split launch is followed by the reduction launch.

    One launch at a time may use a workspace (the partials and the counters are per launch).
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    counters: Optional[torch.Tensor] = None

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
        counters = torch.zeros(max_num_tokens * num_heads, dtype=torch.int32, device=device)
        return cls(partial_out, partial_lse, counters)

    @property
    def max_num_tokens(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_segments(self) -> int:
        return self.partial_out.shape[2]

    def fits(self, num_tokens: int, num_heads: int, head_size: int, num_segments: int) -> bool:
        """Whether a batch of this shape can use the workspace with ``num_segments`` segments."""
        t, h, s, d = self._sizes[0]
        return num_tokens <= t and num_heads == h and head_size == d and num_segments <= s

    def fits_fused(self, num_decodes: int, num_kv_heads: int) -> bool:
        """Whether the counters serve a fused launch of ``num_decodes`` decode programs x ``num_kv_heads``."""
        return num_decodes * num_kv_heads <= self._sizes[1]

    @functools.cached_property
    def partial_strides(self) -> tuple[int, int, int, int, int]:
        """(token, head, segment) strides of ``partial_out`` and (token, head) of ``partial_lse``."""
        po, pl = self.partial_out, self.partial_lse
        return (po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1))

    @functools.cached_property
    def _sizes(self) -> tuple[tuple[int, ...], int]:
        """``partial_out``'s shape and the number of counters (-1 without), read once: every build checks them."""
        return tuple(self.partial_out.shape), self.counters.numel() if self.counters is not None else -1


# --------------------------------------------------------------------------------------------------------------
# Launch plan and launch
# --------------------------------------------------------------------------------------------------------------
#: The constexpr parameters of ``_unified_attention_kernel`` and ``_reduce_segments_kernel``, in signature order.
UNIFIED_CONSTEXPRS = (
    "QPK", "HEAD_SIZE", "HEAD_PAD", "BLOCK_SIZE", "DECODE_PATH", "DECODE_BLOCK_M", "DECODE_TILE_N", "GENERIC_PATH",
    "BLOCK_Q", "BLOCK_M", "TILE_N", "PAGED", "CAUSAL", "SLIDING_WINDOW", "USE_SOFTCAP", "USE_ALIBI", "USE_SINKS",
    "SCALES_ARE_PTRS", "KV_FP8", "NUM_SEGMENTS", "RETURN_LSE", "INTERPRET", "DECODE_Q", "USE_TREE", "FUSED_REDUCE",
    "SEG_PAD", "MERGE_ROWS", "DECODE_SCHEDULED", "MASK_KIND", "KV_FORMAT",
)
REDUCE_CONSTEXPRS = ("HEAD_SIZE", "HEAD_PAD", "NUM_SEGMENTS", "SEG_PAD", "RETURN_LSE")

_attention_launcher = DirectLauncher(_unified_attention_kernel, UNIFIED_CONSTEXPRS)
_reduce_launcher = DirectLauncher(_reduce_segments_kernel, REDUCE_CONSTEXPRS)


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch decision for one batch of one layer group, made once (a builder makes it in ``build``).

    Attributes
    ----------
    grid : (programs, num_kv_heads, num_kv_splits) of the attention kernel; ``grid[0] == 0``: nothing to run. A
        scheduled plan's: (num_kv_heads, programs, 1).
    num_seqs, num_decodes : requests in the batch; the first ``num_decodes`` run on the decode tiles.
    constexprs : the values of :data:`UNIFIED_CONSTEXPRS` (tile shapes, features, paths).
    num_warps, num_stages : launch options of the attention kernel.
    config : the tile configuration the constexprs came from.
    workspace : split-KV partial buffers (``num_kv_splits > 1``), else None.
    partial_strides : (token, head, segment) strides of ``workspace.partial_out`` and (token, head) of
        ``partial_lse``; zeros without split-KV.
    fused_reduce : the attention launch merges its own segments (split-KV, every program a decode program, and a
        workspace with counters for them): no reduction launch.
    reduce_grid, reduce_constexprs, reduce_num_warps : the split-KV reduction's launch (grid None: no reduction
        launch, for an unsplit or a fused plan).
    decode_schedule : the decodes' balanced schedule (:mod:`.decode_schedule`; grid (num_kv_heads, programs, 1),
        the units merged in the launch through ``workspace``), or None: one program per decode (x segments).
    mask_args : the layer mask's runtime ints (block length, window left, window right; -1: that window side
        unbounded) beside the ``MASK_KIND`` constexpr (:mod:`.mask_math`).
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
    fused_reduce: bool
    reduce_grid: Optional[tuple[int, int, int]]
    reduce_constexprs: tuple
    reduce_num_warps: int
    decode_schedule: Optional[DecodeSchedule] = None
    mask_args: tuple[int, int, int] = (0, -1, -1)

    @property
    def num_kv_splits(self) -> int:
        return self.grid[2]

    @property
    def num_decode_programs(self) -> int:
        """Grid rows of the decode programs: the schedule's unit rows, or one per decode."""
        schedule = self.decode_schedule
        return schedule.num_programs if schedule is not None else self.num_decodes


def plan_attention(
    *, num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, num_seqs: int,
    max_query_len: int, max_seq_len: int, kv_fp8: bool, causal: bool, sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None, use_alibi: bool = False, use_sinks: bool = False,
    scales_are_ptrs: bool = False, paged: bool = True, return_lse: bool = False, num_decodes: Optional[int] = None,
    num_kv_splits: Optional[int] = None, num_sms: int = 1, workspace: Optional[SplitKVWorkspace] = None,
    config: Optional[KernelConfig] = None, device: Union[torch.device, str, None] = None,
    decode_query_len: int = 1, use_tree: bool = False, decode_schedule: Optional[DecodeSchedule] = None,
    mask: Optional["MaskPlan"] = None,
    kv_format: int = KV_PLAIN,
) -> LaunchPlan:
    """The launch plan of one batch: split-KV factor, tile config, grid and constexprs, from host ints only.

    ``num_tokens``: query tokens of the batch (padding excluded). ``num_decodes``: default all sequences when
    ``max_query_len <= 1``, else none. ``num_kv_splits``: default :func:`.heuristics.choose_num_kv_splits` with
    ``num_sms`` (pass 1 on the CPU). A split needs ``workspace`` to fit the batch; without one, one is allocated on
    ``device`` (not CUDA-graph capturable), and a workspace too small means no split. ``decode_query_len``: the
    longest decode (speculative verify: 1 + draft tokens); a decode program then holds all of a request's query
    tokens x its query heads in one tile. ``use_tree``: the launch takes a packed tree mask.

    A split plan whose programs are all decode programs (``num_decodes == num_seqs``) merges its segments in the
    attention launch where ``workspace`` has counters for its programs (``fused_reduce``); others plan the
    reduction launch after it.

    ``kv_format``: the kernel's ``KV_FORMAT`` of the cache (:func:`.kv_load.kernel_kv_format`; a quantised format
    also takes ``kv_fp8=True``: its dots run in float16).

    ``decode_schedule``: the decodes run its work units (:mod:`.decode_schedule`) instead of ``num_kv_splits``
    segments each, also beside prefill programs; ``workspace`` (with counters) must hold the decodes' partials
    (:func:`schedule_fits`), the config's decode tile must divide the schedule's alignment, and ``num_kv_splits``
    must be None or 1. Where the units and the prefill programs together exceed the grid's :data:`MAX_GRID_Y`, the
    plan runs one program per decode instead (no schedule).

    ``mask``: the layer's mask kind on the unified kernel (:class:`.mask_math` kinds, :func:`mask_plan`); None: the
    ``causal`` / ``sliding_window`` path. A masked plan takes no decode schedule, a custom-mask plan no tree.
    """
    if mask is not None and decode_schedule is not None:
        raise ValueError("a masked plan runs its decodes unscheduled: the balanced decode schedule serves causal "
                         "layers only")
    if mask is not None and mask.kind == MASK_CUSTOM and use_tree:
        raise ValueError("a custom-mask batch takes no tree mask: the custom mask says which draft tokens each query "
                         "sees")
    qpk = num_heads // num_kv_heads
    if num_decodes is None:
        num_decodes = num_seqs if max_query_len <= 1 else 0
    decode_path = num_decodes > 0
    generic_path = num_decodes < num_seqs
    if decode_schedule is not None:
        plan = _plan_scheduled(
            decode_schedule, num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, block_size=block_size, num_seqs=num_seqs, num_decodes=num_decodes,
            max_query_len=max_query_len, max_seq_len=max_seq_len, kv_fp8=kv_fp8, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, use_alibi=use_alibi, use_sinks=use_sinks,
            scales_are_ptrs=scales_are_ptrs, paged=paged, return_lse=return_lse, num_kv_splits=num_kv_splits,
            workspace=workspace, config=config, decode_query_len=decode_query_len, use_tree=use_tree,
            kv_format=kv_format)
        if plan is not None:
            return plan
        num_kv_splits = 1  # too many prefill programs beside the units for the grid: one program per decode
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
        partial_strides = workspace.partial_strides
    else:
        workspace, partial_strides = None, (0, 0, 0, 0, 0)
    programs = (num_decodes if decode_path else 0) + (
        num_tokens // block_q + num_seqs - num_decodes if generic_path else 0)
    head_pad = next_power_of_2(head_size)
    seg_pad = next_power_of_2(num_kv_splits)
    decode_q = max(1, decode_query_len)
    fused_reduce = (num_kv_splits > 1 and decode_path and not generic_path
                    and workspace.fits_fused(num_decodes, num_kv_heads))
    merge_rows = fused_merge_rows(qpk * decode_q, seg_pad, head_pad) if fused_reduce else 1
    constexprs = (
        qpk, head_size, head_pad, block_size, decode_path,
        max(config.decode_block_m, next_power_of_2(qpk * decode_q)),
        config.decode_tile_n, generic_path, block_q, block_m, config.tile_n, paged, bool(causal),
        int(sliding_window or 0), bool(logits_soft_cap), use_alibi, use_sinks, scales_are_ptrs, kv_fp8,
        num_kv_splits, return_lse, is_triton_interpreted(), decode_q, bool(use_tree), fused_reduce, seg_pad,
        merge_rows, False, mask.kind if mask is not None else MASK_NONE, kv_format,
    )
    reduce_grid = (num_tokens, num_heads, 1) if num_kv_splits > 1 and programs and not fused_reduce else None
    return LaunchPlan(
        grid=(programs, num_kv_heads, num_kv_splits), num_seqs=num_seqs, num_decodes=num_decodes,
        constexprs=constexprs, num_warps=config.num_warps, num_stages=config.num_stages, config=config,
        workspace=workspace, partial_strides=partial_strides, fused_reduce=fused_reduce, reduce_grid=reduce_grid,
        reduce_constexprs=(head_size, head_pad, num_kv_splits, seg_pad, return_lse),
        reduce_num_warps=4 if head_pad * num_kv_splits >= 2048 else 2,
        mask_args=mask.args if mask is not None else (0, -1, -1),
    )


#: Most programs on a grid's second axis (CUDA's limit): a scheduled plan's decode units + prefill programs.
MAX_GRID_Y = 65535



def schedule_fits(workspace: Optional[SplitKVWorkspace], *, num_decode_tokens: int, num_decodes: int, num_heads: int,
                  num_kv_heads: int, head_size: int, max_units_per_request: int) -> bool:
    """Whether ``workspace`` holds a scheduled launch's partials (a row per decode token, a segment per unit of a
    request) and its tickets (one counter per decode and KV head)."""
    return (workspace is not None and workspace.fits(num_decode_tokens, num_heads, head_size, max_units_per_request)
            and workspace.fits_fused(num_decodes, num_kv_heads))


def _plan_scheduled(
    schedule: DecodeSchedule, *, num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
    block_size: int, num_seqs: int, num_decodes: int, max_query_len: int, max_seq_len: int, kv_fp8: bool,
    causal: bool, sliding_window: Optional[int], logits_soft_cap: Optional[float], use_alibi: bool, use_sinks: bool,
    scales_are_ptrs: bool, paged: bool, return_lse: bool, num_kv_splits: Optional[int],
    workspace: Optional[SplitKVWorkspace], config: Optional[KernelConfig], decode_query_len: int, use_tree: bool,
    kv_format: int = KV_PLAIN,
) -> Optional[LaunchPlan]:
    """:func:`plan_attention` for a batch whose decodes run ``schedule``'s work units (the arguments as there);
    None where the grid cannot hold them beside the batch's prefill programs."""
    qpk = num_heads // num_kv_heads
    decode_q = max(1, decode_query_len)
    if num_kv_splits not in (None, 1):
        raise ValueError(f"a scheduled plan runs its decodes' units unsplit: num_kv_splits must be None or 1, got "
                         f"{num_kv_splits}")
    if not paged or num_decodes < 1 or schedule.num_decodes != num_decodes:
        raise ValueError(f"the decode schedule is for {schedule.num_decodes} decodes of a paged batch; this plan has "
                         f"{num_decodes} decodes{'' if paged else ' and no cache'}")
    if not schedule_fits(workspace, num_decode_tokens=num_decodes * decode_q, num_decodes=num_decodes,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                         max_units_per_request=schedule.max_units_per_request):
        raise ValueError("a scheduled plan needs a split-KV workspace with counters that holds the decodes' partials "
                         f"({num_decodes} decodes, up to {schedule.max_units_per_request} units each)")
    generic_path = num_decodes < num_seqs
    if config is None:  # keys_per_split=None: the decode tile does not depend on the batch (the units are aligned)
        config = pick_kernel_config(head_size, qpk, max_query_len, has_decode_path=True,
                                    has_generic_path=generic_path, kv_fp8=kv_fp8, keys_per_split=None,
                                    max_seq_len=max_seq_len)
    if schedule.align % config.decode_tile_n:
        raise ValueError(f"the schedule's units are aligned to {schedule.align} keys, not a multiple of the decode "
                         f"tile ({config.decode_tile_n})")
    block_m = max(config.block_m, next_power_of_2(qpk))
    block_q = max(1, block_m // qpk)
    programs = schedule.num_programs + (num_tokens // block_q + num_seqs - num_decodes if generic_path else 0)
    if programs > MAX_GRID_Y:
        logger.debug("%d scheduled decode units and prefill programs exceed the grid's %d: unscheduled", programs,
                     MAX_GRID_Y)
        return None
    head_pad = next_power_of_2(head_size)
    seg_pad = next_power_of_2(schedule.max_units_per_request)
    merge_rows = max(1, SCHEDULED_MERGE_VALUES // (seg_pad * head_pad))
    merge_rows = min(1 << (merge_rows.bit_length() - 1), next_power_of_2(qpk * decode_q))
    constexprs = (
        qpk, head_size, head_pad, block_size, True, max(config.decode_block_m, next_power_of_2(qpk * decode_q)),
        config.decode_tile_n, generic_path, block_q, block_m, config.tile_n, paged, bool(causal),
        int(sliding_window or 0), bool(logits_soft_cap), use_alibi, use_sinks, scales_are_ptrs, kv_fp8,
        1, return_lse, is_triton_interpreted(), decode_q, bool(use_tree), False, seg_pad,
        merge_rows, True, MASK_NONE, kv_format,
    )
    return LaunchPlan(
        grid=(num_kv_heads, programs, 1), num_seqs=num_seqs, num_decodes=num_decodes, constexprs=constexprs,
        num_warps=config.num_warps, num_stages=config.num_stages, config=config, workspace=workspace,
        partial_strides=workspace.partial_strides, fused_reduce=False,
        reduce_grid=None, reduce_constexprs=(head_size, head_pad, 1, 1, return_lse), reduce_num_warps=2,
        decode_schedule=schedule,
    )


@dataclass(frozen=True)
class MaskPlan:
    """A layer's mask on the unified kernel: the ``MASK_KIND`` constexpr (:mod:`.mask_math`) and its runtime ints
    ``args`` (block length, window left, window right; -1: unbounded side)."""

    kind: int
    args: tuple[int, int, int]


def mask_plan(spec: AttentionSpec) -> Optional[MaskPlan]:
    """The unified kernel's plan for ``spec``'s mask; None for a causal layer (its window, one-sided, runs as the
    kernel's ``SLIDING_WINDOW``: :func:`causal_sliding_window`)."""
    kind = spec.mask.kind
    if kind is MaskKind.CAUSAL or not spec.attn_type.is_causal:
        return None
    codes = {MaskKind.NON_CAUSAL: MASK_NON_CAUSAL, MaskKind.BLOCK_CAUSAL: MASK_BLOCK_CAUSAL,
             MaskKind.CAUSAL_SPANS: MASK_SPANS, MaskKind.CUSTOM: MASK_CUSTOM}
    left, right = spec.window if spec.window is not None else (-1, -1)
    return MaskPlan(codes[kind], (spec.mask.block_len or 0, left, right))


def causal_sliding_window(spec: AttentionSpec) -> Optional[int]:
    """The ``sliding_window`` (keys seen, self included) of a causal layer's window, from ``sliding_window`` or a
    one-sided ``mask.window`` (left, 0); None without a window or for a masked layer (:func:`mask_plan`)."""
    if spec.mask.kind is not MaskKind.CAUSAL or spec.window is None:
        return None
    return spec.window[0] + 1


def _alignment(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def launch_attention(
    plan: LaunchPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    output: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], softmax_scale: float, logits_soft_cap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None, k_scale: Scale = 1.0,
    v_scale: Scale = 1.0, return_lse: Optional[torch.Tensor] = None, *, cache_key: Optional[tuple] = None,
    tree_mask: Optional[torch.Tensor] = None, tree_indptr: Optional[torch.Tensor] = None,
    span_key_end: Optional[torch.Tensor] = None, custom_mask: Optional[torch.Tensor] = None,
    custom_mask_indptr: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Run ``plan`` on these tensors (no checks: see :func:`unified_attention` for the shapes).

    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` views when the plan is
    paged; ``[num_tokens, num_kv_heads, head_size]`` keys and values otherwise (``seq_lens`` and ``block_table``
    None). ``cache_key``: what the caller knows fixes the caches' part of the compiled-kernel key (their dtype,
    strides and alignment); computed here when None. ``tree_mask`` ([sum n_i^2] uint8) and ``tree_indptr``
    ([num_seqs + 1] int32): the packed tree mask of a plan made with ``use_tree``. ``span_key_end`` ([num_tokens]
    int32): per token, the end of its visible keys, for a plan of mask kind spans
    (:attr:`attnbackends.masks.BatchMasks.span_key_end`). ``custom_mask`` ([sum_i ceil(Q_i L_i / 8)] uint8) and
    ``custom_mask_indptr`` ([num_seqs + 1] int32 byte offsets): the packed custom masks of a plan of mask kind custom
    (:attr:`attnbackends.masks.BatchMasks.custom_mask`), read through the kernel's tree-mask pointers.
    """
    if plan.grid[0] == 0:
        return output
    schedule = plan.decode_schedule
    dummy = output
    paged = block_table is not None
    # each stride() call is a torch call on every layer's forward: one per tensor, the caches' from cache_key
    if cache_key is None:
        cache_key = (key_cache.dtype, key_cache.stride(), value_cache.stride(), _alignment(key_cache),
                     _alignment(value_cache))
    k_strides, v_strides = cache_key[1], cache_key[2]
    if paged:
        stride_kb, stride_ks, stride_kh = k_strides[0], k_strides[1], k_strides[2]
        stride_vb, stride_vs, stride_vh = v_strides[0], v_strides[1], v_strides[2]
        num_blocks, stride_bt = key_cache.shape[0], block_table.stride(0)
    else:
        stride_kb, stride_ks, stride_kh = 0, k_strides[0], k_strides[1]
        stride_vb, stride_vs, stride_vh = 0, v_strides[0], v_strides[1]
        num_blocks, stride_bt = 1, 0
        block_table = seq_lens = dummy
    q_strides, o_strides = query.stride(), output.stride()
    workspace = plan.workspace
    partial_out, partial_lse = (workspace.partial_out, workspace.partial_lse) if workspace is not None else (
        dummy, dummy)
    counters = workspace.counters if plan.fused_reduce or schedule is not None else dummy
    scales_are_ptrs = plan.constexprs[17]
    lse_stride_h = return_lse.stride(0) if return_lse is not None else 0
    lse = return_lse if return_lse is not None else dummy
    if custom_mask is not None:  # a custom-mask plan has no tree: its bits take the tree's pointers
        tree_mask, tree_indptr = custom_mask, custom_mask_indptr
    args = (
        query, key_cache, value_cache, output, block_table, num_blocks, seq_lens, query_start_loc,
        alibi_slopes if alibi_slopes is not None else dummy, sinks if sinks is not None else dummy,
        partial_out, partial_lse, lse, counters,
        k_scale if scales_are_ptrs else float(k_scale), v_scale if scales_are_ptrs else float(v_scale),
        tree_mask if tree_mask is not None else dummy, tree_indptr if tree_indptr is not None else dummy,
        schedule.units if schedule is not None else dummy, span_key_end if span_key_end is not None else dummy,
        plan.num_seqs, plan.num_decodes, plan.num_decode_programs,
        q_strides[0], q_strides[1], o_strides[0], o_strides[1],
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        *plan.partial_strides, lse_stride_h, softmax_scale, logits_soft_cap, *plan.mask_args,
    )
    out_aligned = _alignment(output)
    key = (plan.constexprs, plan.num_warps, plan.num_stages, query.dtype, output.dtype, block_table.dtype,
           _alignment(query), out_aligned, cache_key)
    _attention_launcher(key, plan.grid, args, plan.constexprs, plan.num_warps, plan.num_stages)
    if plan.reduce_grid is not None:
        args = (output, partial_out, partial_lse, lse, query_start_loc, plan.num_seqs, o_strides[0], o_strides[1],
                *plan.partial_strides, lse_stride_h)
        key = (plan.reduce_constexprs, plan.reduce_num_warps, output.dtype, out_aligned)
        _reduce_launcher(key, plan.reduce_grid, args, plan.reduce_constexprs, plan.reduce_num_warps, 2)
    return output


def _launch(query, key, value, output, query_start_loc, seq_lens, block_table, *, paged, block_size,
            max_query_len, max_seq_len, softmax_scale, causal, sliding_window, logits_soft_cap, alibi_slopes,
            sinks, k_scale, v_scale, workspace, num_decodes, num_kv_splits, config, return_lse=None,
            kv_format: KVCacheFormat = KVCacheFormat.SIXTEEN_BIT):
    """Plan and launch in one go: the functional entry points' path."""
    num_tokens, num_heads, head_size = query.shape
    quantised = kv_format.scales_in_pages
    if quantised:
        k_scale, v_scale = launch_tensor_scales(kv_format, k_scale, v_scale)
    device = output.device
    plan = plan_attention(
        num_tokens=num_tokens, num_heads=num_heads, num_kv_heads=key.shape[-2], head_size=head_size,
        block_size=block_size, num_seqs=query_start_loc.shape[0] - 1, max_query_len=max_query_len,
        max_seq_len=max_seq_len, kv_fp8=key.dtype in FP8_DTYPES or quantised, causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, use_alibi=alibi_slopes is not None, use_sinks=sinks is not None,
        scales_are_ptrs=isinstance(k_scale, torch.Tensor), paged=paged, return_lse=return_lse is not None,
        num_decodes=num_decodes, num_kv_splits=num_kv_splits,
        num_sms=device_sm_count(device), workspace=workspace, config=config,
        device=device, kv_format=kernel_kv_format(kv_format),
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
    kv_format: KVCacheFormat = KVCacheFormat.SIXTEEN_BIT,
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
        Force the number of KV segments (1: no split). Default: :func:`.heuristics.choose_num_kv_splits` on CUDA,
        1 on CPU.
        Fix it when capturing a CUDA graph.
    validate : bool
        Run :func:`attnbackends.validation.check_unified_attention_args` first (pass False on the hot path once
        checked).
    config : KernelConfig, optional
        Override the tile configuration (tuning).
    return_lse : torch.Tensor, optional
        ``[num_heads, >= num_tokens]`` float32 with unit stride in the token dimension; receives the natural-log
        log-sum-exp of each query row's logits over its visible keys (sinks included), ``-inf`` where the row sees
        no key (e.g. ``seq_len`` 0: a context-parallel rank holding none of the sequence's blocks; its output row
        is then 0). Padding rows are left untouched. For merging partial results with ``merge_attn_states``.
    kv_format : KVCacheFormat
        The cache's format (``AttentionSpec.kv_cache_format``): a format with page scales takes the ``kv_cache[:, 0]``
        / ``kv_cache[:, 1]`` views of a cache from ``allocate_kv_cache`` (its scales are read beside the pages);
        ``k_scale``/``v_scale`` are then NVFP4's global scales and ignored by the per-token-head formats.

    Returns
    -------
    torch.Tensor
        ``output``.
    """
    if validate:
        if return_lse is not None:
            check_return_lse(return_lse, query)
        check_unified_attention_args(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, max_query_len,
            max_seq_len, softmax_scale, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale,
            v_scale=v_scale, workspace=workspace, num_decodes=num_decodes, num_kv_splits=num_kv_splits,
            kv_format=kv_format)
    return _launch(
        query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, paged=True,
        block_size=key_cache.shape[1], max_query_len=max_query_len, max_seq_len=max_seq_len,
        softmax_scale=softmax_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, workspace=workspace, num_decodes=num_decodes,
        num_kv_splits=num_kv_splits, config=config, return_lse=return_lse, kv_format=kv_format)


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
        check_varlen_attention_args(query, key, value, output, query_start_loc, max_seq_len, softmax_scale,
                                    causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                    alibi_slopes=alibi_slopes, sinks=sinks)
    return _launch(
        query, key, value, output, query_start_loc, None, None, paged=False, block_size=16,
        max_query_len=max(max_seq_len, 2), max_seq_len=max_seq_len, softmax_scale=softmax_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks,
        k_scale=1.0, v_scale=1.0, workspace=None, num_decodes=0, num_kv_splits=1, config=config)
