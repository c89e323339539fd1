"""The MLA decode's launch plan: every launch decision made once per batch, then one cached launch per kernel.

:func:`plan_mla_decode` (a builder calls it in ``build``, once per batch for every layer) picks the kernel (the
Gluon Hopper kernel, the Triton TMA kernel or the portable Triton kernel), the KV split count, the grid, the
constexprs and the output buffers (the latent output, or the split partials and the reduction's launch), and
works out the part of the compiled-kernel key that depends on the batch. Asked to (``fuse_up_projection``), it
plans the up-projection too, fused with the split reduction (:mod:`.projection_kernels`): one launch from the
partials (or the one-split latent) to the layer's [T, H, V] output, run by :func:`launch_mla_up_projection` with
the layer's W_UV and the call's output. :func:`plan_mla_absorb` plans the query absorption's launch, and for a
decode-only batch the same launch writing the batch's new tokens into the cache
(:func:`launch_mla_absorb_and_write`: one launch instead of the cache write's and the absorption's).
:class:`MLACacheState` holds what depends on one cache tensor only (its TMA descriptors, its page count, its part
of the key, what a launch that writes into it needs), built once per cache, and what a plan's launches over that
cache have worked out (their arguments, their prepared launches): a plan is not changed after planning.
:func:`launch_mla_decode` then adds the queries and launches through the kernels' cached launchers
(:class:`~attnbackends.ops.launch.DescriptorLauncher`): no argument binding, no descriptor encoding, no decisions.

A compiled kernel is specialised on its integer arguments (== 1, multiple of 16) and on its pointers' 16-byte
alignment, so its key holds those properties of every argument: the batch's (planned), the cache's (per cache) and
the queries' and the new tokens' (per call: their strides and alignment).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..ops.launch import DescriptorLauncher, PreparedLaunch, launch_keeping_prepared
from ..ops.launch_math import cdiv, next_power_of_2
from ..ops.page_guard import fault_record, raise_pending_faults
from ..ops.quant import FP8_DTYPES
from ..platform import is_triton_interpreted
from ..ops.mla_cache import cache_dtype_constexprs
from .decode_hopper import (
    HOPPER_BLOCK_H, HOPPER_NUM_WARPS, hopper_args, hopper_constexprs, hopper_descriptors, hopper_launcher,
    hopper_reason,
)
from .projection_kernels import (
    _mla_absorb_kernel, _mla_absorb_write_kernel, _mla_reduce_up_kernel, absorb_blocks, reduce_up_blocks,
)
from .decode_kernel import (
    MLADecodeConfig, _mla_decode_kernel, _mla_decode_reduce_kernel, _mla_decode_tma_kernel, decode_kernel_name,
    default_decode_config, reduce_block_c,
    tma_descriptors,
)

__all__ = ["CacheStates", "LOG2E", "MLACacheState", "MLADecodePlan", "choose_decode_kernel", "decode_launch_args",
           "launch_mla_absorb", "launch_mla_absorb_and_write", "launch_mla_decode", "launch_mla_up_projection",
           "MLAAbsorbPlan", "mla_decode", "plan_mla_absorb", "plan_mla_decode", "tensor_key", "weight_launch_state"]

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634

POINTER_CONSTEXPRS = ("KV_LORA", "ROPE", "BLOCK_C", "BLOCK_R", "PAGE_SIZE", "BLOCK_H", "BLOCK_N", "IS_FP8",
                      "STORE_LSE", "MAX_Q", "USE_TREE", "INTERPRET")
TMA_CONSTEXPRS = ("KV_LORA", "HALF", "ROPE", "PAGE_SIZE", "BLOCK_H", "BLOCK_N", "STORE_LSE", "MAX_Q", "USE_TREE",
                  "INTERPRET")
REDUCE_CONSTEXPRS = ("KV_LORA", "BLOCK_C", "NUM_SPLITS", "BLOCK_S", "STORE_LSE")
ABSORB_CONSTEXPRS = ("NOPE", "ROPE", "KV_LORA", "BLOCK_T", "BLOCK_P", "BLOCK_L", "BLOCK_R", "INTERPRET")
ABSORB_WRITE_CONSTEXPRS = ABSORB_CONSTEXPRS + ("BLOCK_C", "IS_FP8", "FP8_MAX", "FP8_MANT_BITS", "FP8_MIN_EXP")
REDUCE_UP_CONSTEXPRS = ("KV_LORA", "V_DIM", "NUM_SPLITS", "BLOCK_S", "BLOCK_T", "BLOCK_C", "BLOCK_V", "STORE_LSE",
                        "INTERPRET")

_POINTER = DescriptorLauncher(_mla_decode_kernel, POINTER_CONSTEXPRS)
_TMA = DescriptorLauncher(_mla_decode_tma_kernel, TMA_CONSTEXPRS, (2, 3))
_REDUCE = DescriptorLauncher(_mla_decode_reduce_kernel, REDUCE_CONSTEXPRS)
_REDUCE_UP = DescriptorLauncher(_mla_reduce_up_kernel, REDUCE_UP_CONSTEXPRS)
_ABSORB = DescriptorLauncher(_mla_absorb_kernel, ABSORB_CONSTEXPRS)
_ABSORB_WRITE = DescriptorLauncher(_mla_absorb_write_kernel, ABSORB_WRITE_CONSTEXPRS)


def _int_key(*values: int) -> tuple:
    """How Triton specialises these integers (1 is a constant, multiples of 16 are marked, 64-bit ones differ)."""
    return tuple((v == 1, v % 16 == 0, v >= 2 ** 31) for v in values)


def _ptr_key(*tensors: torch.Tensor) -> tuple:
    """How Triton specialises these pointers (16-byte aligned or not) and their element types."""
    return tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors)


def tensor_key(t: torch.Tensor) -> tuple:
    """A query tensor's part of a compiled-kernel key: dtype, strides (specialised integers) and alignment."""
    return (t.dtype, t.stride(), t.data_ptr() % 16 == 0)


def choose_decode_kernel(*, num_heads: int, kv_lora: int, rope: int, page: int, cache_dtype: torch.dtype,
                         q_dtype: torch.dtype, compute_capability: "tuple[int, int] | None", tree: bool,
                         config: MLADecodeConfig) -> str:
    """The decode kernel for a layer and batch, from host facts only: "hopper" (the Gluon kernel: asked for by
    ``config.use_hopper``, 64-row programs, no tree, a cache and queries it reads), "tma" (the Triton kernel with
    TMA tiles, a 16-bit cache on compute capability >= 9.0) or "pointer" (any other). The cache's layout (pages of
    contiguous rows) is checked per cache by :class:`MLACacheState`."""
    if (config.use_hopper and config.block_h == HOPPER_BLOCK_H and not tree
            and not hopper_reason(kv_lora, rope, page, cache_dtype, compute_capability)
            and q_dtype in (torch.float16, torch.bfloat16)
            and (cache_dtype == torch.float8_e4m3fn or cache_dtype == q_dtype)):
        return "hopper"
    half = kv_lora // 2
    if (config.use_tma and cache_dtype in (torch.float16, torch.bfloat16) and kv_lora % 2 == 0
            and not half & (half - 1) and not rope & (rope - 1) and half <= 256 and rope <= 256
            and page % config.block_n == 0
            and (compute_capability is None or compute_capability >= (9, 0))):
        return "tma"
    return "pointer"


class _PlanLaunches:
    """What :func:`launch_mla_decode` keeps for one plan over one cache (:meth:`MLACacheState.plan_launches`): the
    portable-kernel fallback plan (planned once, where the cache's pages are not contiguous rows); the decode
    launch worked out for planned query buffers (launcher, key, arguments, plan), with the buffers and scales it was
    worked out for, and its prepared launch; the split reduction's prepared launch."""

    __slots__ = ("pointer_plan", "q_nope", "q_pe", "scales", "launch", "prepared", "reduce_prepared")

    def __init__(self) -> None:
        self.pointer_plan: Optional["MLADecodePlan"] = None
        self.q_nope: Optional[torch.Tensor] = None
        self.q_pe: Optional[torch.Tensor] = None
        self.scales: Optional[tuple[float, float]] = None
        self.launch: Optional[tuple] = None
        self.prepared: Optional[PreparedLaunch] = None
        self.reduce_prepared: Optional[PreparedLaunch] = None


class MLACacheState:
    """What the decode launch needs of one latent cache [num_blocks, block_size, Lkv + R], built once per cache:
    its page count and strides, whether its pages are contiguous rows (the TMA kernels read them so), its TMA
    descriptors (per kernel and tile), and its part of the compiled-kernel key; what a launch that writes new
    tokens into it needs (:meth:`writer`); and what each plan's launches over it have worked out
    (:meth:`plan_launches`)."""

    __slots__ = ("cache", "num_blocks", "stride_blk", "stride_tok", "rows_contiguous", "key", "_descriptors",
                 "_writer", "_plans", "__weakref__")

    #: Plans whose launches over this cache are kept worked out (all dropped when full).
    KEPT_PLANS = 64

    def __init__(self, kv_cache: torch.Tensor) -> None:
        num_blocks, page, width = kv_cache.shape
        self.cache = kv_cache
        self.num_blocks = num_blocks
        self.stride_blk, self.stride_tok = kv_cache.stride(0), kv_cache.stride(1)
        self.rows_contiguous = kv_cache.stride() == (page * width, width, 1)
        self.key = (kv_cache.dtype, tuple(kv_cache.shape[1:]), kv_cache.stride(), kv_cache.data_ptr() % 16 == 0,
                    _int_key(num_blocks))
        self._descriptors: dict[tuple, Any] = {}
        self._writer: Optional[tuple] = None
        self._plans: dict[MLADecodePlan, _PlanLaunches] = {}  # held by the key: a plan compares by identity

    def plan_launches(self, plan: "MLADecodePlan") -> _PlanLaunches:
        """What ``plan``'s launches over this cache have worked out (empty on first use)."""
        kept = self._plans.get(plan)
        if kept is None:
            if len(self._plans) >= self.KEPT_PLANS:
                self._plans.clear()
            kept = self._plans[plan] = _PlanLaunches()
        return kept

    def writer(self) -> tuple:
        """(key, args, constexprs) of this cache in a launch that writes new tokens into it
        (:func:`launch_mla_absorb_and_write`), built on first use: its part of the compiled-kernel key, its runtime
        arguments (the cache, its page and row strides, block size, slot count, its device's fault record) and the
        constexprs of its dtype (:func:`~attnbackends.ops.mla_cache.cache_dtype_constexprs`)."""
        w = self._writer
        if w is None:
            cache = self.cache
            faults = fault_record(cache.device)
            block_size = cache.shape[1]
            num_slots = self.num_blocks * block_size
            w = self._writer = (  # num_slots is not specialised on its value, only on its integer width
                (self.key, num_slots >= 2 ** 31, _ptr_key(faults.record, faults.host_flag)),
                (cache, self.stride_blk, self.stride_tok, block_size, num_slots, faults.record, faults.host_flag),
                cache_dtype_constexprs(cache.dtype),
            )
        return w

    def descriptors(self, kernel: str, kv_lora: int, config: MLADecodeConfig) -> Optional[tuple[Any, Any]]:
        """The TMA descriptors ``kernel`` reads this cache through (None for the pointer kernel), built once."""
        if kernel == "pointer":
            return None
        k = (kernel, kv_lora, config.block_n)
        d = self._descriptors.get(k)
        if d is None:
            d = self._descriptors[k] = (hopper_descriptors(self.cache, kv_lora) if kernel == "hopper"
                                        else tma_descriptors(self.cache, kv_lora, config))
        return d


class CacheStates:
    """An impl's :class:`MLACacheState` per cache tensor: found by identity (the engine passes the same tensor every
    step), else by (data_ptr, shape, strides, dtype), else built."""

    __slots__ = ("_by_id", "_by_layout")

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Any, MLACacheState]] = {}
        self._by_layout: dict[tuple, MLACacheState] = {}

    def get(self, kv_cache: torch.Tensor) -> MLACacheState:
        hit = self._by_id.get(id(kv_cache))
        if hit is not None and hit[0]() is kv_cache:
            return hit[1]
        layout = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype)
        state = self._by_layout.get(layout)
        if state is None:
            if len(self._by_layout) >= 64:  # caches reallocated over and over: drop the old ones
                self._by_layout.clear()
                self._by_id.clear()
            state = self._by_layout[layout] = MLACacheState(kv_cache)
        self._by_id[id(kv_cache)] = (weakref.ref(kv_cache), state)
        return state


@dataclass(eq=False)
class MLADecodePlan:
    """One batch's decode launch (see the module docstring). Made by :func:`plan_mla_decode`, not changed after it
    (what launching it over a cache works out is kept in that cache's :class:`MLACacheState`); compares by identity.

    Attributes
    ----------
    kernel : "hopper", "tma" or "pointer".
    grid : (cdiv(H * max_query_len, block_h), B, num_splits).
    out : what the decode kernel writes: the latent output [T, H, Lkv] or the float32 partials [T, H, S, Lkv].
    lse : the LSE (or the split partials' [T, H, S]); None: not stored.
    output, output_lse : the caller's latent output [T, H, Lkv] and LSE [T, H] (or None).
    reduce_grid, reduce_args, reduce_constexprs, reduce_key : the split reduction's launch (grid None: no split,
        or the reduction is fused with the up-projection).
    up_grid, up_head, up_ints, up_constexprs, up_key, up_num_warps : the fused reduction + up-projection's launch
        (grid None: not planned; ``output`` then holds the latent output for the caller's own up-projection):
        the planned arguments before the layer's W_UV and the call's output, the planned integers after them.
    """

    kernel: str
    config: MLADecodeConfig
    grid: tuple[int, int, int]
    constexprs: tuple
    num_warps: int
    num_stages: int
    num_splits: int
    kv_lora: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    tree_mask: torch.Tensor
    tree_indptr: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    stride_o_s: int
    output: torch.Tensor
    output_lse: Optional[torch.Tensor]
    key: tuple
    reduce_grid: Optional[tuple[int, int, int]] = None
    reduce_args: tuple = ()
    reduce_constexprs: tuple = ()
    reduce_key: tuple = ()
    up_grid: Optional[tuple[int, int, int]] = None
    up_head: tuple = ()
    up_ints: tuple = ()
    up_constexprs: tuple = ()
    up_key: tuple = ()
    up_num_warps: int = 4
    replan: dict = field(default_factory=dict, repr=False)  # plan_mla_decode's arguments (for the fallback)

    @property
    def is_noop(self) -> bool:
        return self.grid[1] == 0


def plan_mla_decode(
    *, num_tokens: int, num_heads: int, kv_lora: int, rope: int, page: int, cache_dtype: torch.dtype,
    q_dtype: torch.dtype, block_table: torch.Tensor, seq_lens: torch.Tensor, output: torch.Tensor,
    num_splits: int = 1, config: MLADecodeConfig, compute_capability: "tuple[int, int] | None",
    lse: Optional[torch.Tensor] = None, partials: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    query_start_loc: Optional[torch.Tensor] = None, max_query_len: int = 1,
    tree_mask: Optional[torch.Tensor] = None, tree_indptr: Optional[torch.Tensor] = None,
    kernel: Optional[str] = None, fuse_up_projection: bool = False, v_dim: int = 0,
) -> MLADecodePlan:
    """The launch plan of one batch's decode (arguments as :func:`~attnbackends.mla.decode_kernel.mla_decode`;
    ``output`` [T, H, Lkv] may have any strides with a unit last one). Host facts only, no device work beyond
    allocating the split partials when ``partials`` is None and ``num_splits > 1``. ``kernel``: force one (else
    :func:`choose_decode_kernel`). ``fuse_up_projection``: plan the up-projection to ``v_dim`` values per head
    (:func:`launch_mla_up_projection`), fused with the split reduction when ``num_splits > 1`` (the merged latent
    is then never stored; ``lse`` is written by the fused kernel), reading ``output`` with one split."""
    batch = seq_lens.shape[0]
    max_query_len = int(max_query_len)
    num_splits = max(1, int(num_splits))
    tree = tree_indptr is not None
    if kernel is None:
        kernel = choose_decode_kernel(num_heads=num_heads, kv_lora=kv_lora, rope=rope, page=page,
                                      cache_dtype=cache_dtype, q_dtype=q_dtype,
                                      compute_capability=compute_capability, tree=tree, config=config)
    block_h = HOPPER_BLOCK_H if kernel == "hopper" else config.block_h
    # The row blocks of one request are adjacent programs: they read the same pages, which L2 then serves once.
    grid = (cdiv(num_heads * max_query_len, block_h), batch, num_splits)
    query_start = query_start_loc if query_start_loc is not None else seq_lens
    tree_mask_t = tree_mask.view(torch.uint8) if tree_mask is not None else seq_lens
    tree_indptr_t = tree_indptr if tree_indptr is not None else seq_lens
    if num_splits > 1:
        if partials is None:
            o_part = torch.empty(num_tokens, num_heads, num_splits, kv_lora, dtype=torch.float32, device=output.device)
            lse_part = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=output.device)
        else:
            o_part, lse_part = partials
        out, out_lse, stride_o_s = o_part, lse_part, o_part.stride(2)
    else:
        out, out_lse, stride_o_s = output, lse, 0
    fp8 = cache_dtype in FP8_DTYPES
    store_lse = out_lse is not None
    interpret = is_triton_interpreted()
    if kernel == "hopper":
        constexprs = hopper_constexprs(kv_lora, rope, page, store_lse, max_query_len, cache_dtype == torch.float8_e4m3fn,
                                       config.fp8_scores == "e4m3")
        num_warps, num_stages = HOPPER_NUM_WARPS, 3
    elif kernel == "tma":
        constexprs = (kv_lora, kv_lora // 2, rope, page, config.block_h, config.block_n, store_lse, max_query_len, tree,
                      interpret)
        num_warps, num_stages = config.num_warps, config.num_stages
    else:
        constexprs = (kv_lora, rope, next_power_of_2(kv_lora), next_power_of_2(rope), page, config.block_h,
                      config.block_n, fp8, store_lse, max_query_len, tree, interpret)
        num_warps, num_stages = config.num_warps, config.num_stages
    lse_strides = (out_lse.stride(0), out_lse.stride(1)) if out_lse is not None else (0, 0)
    key = (kernel, constexprs, num_warps, num_stages,
           _ptr_key(block_table, seq_lens, query_start, tree_mask_t, tree_indptr_t, out,
                    out_lse if out_lse is not None else seq_lens),
           _int_key(block_table.stride(0), out.stride(0), out.stride(1), stride_o_s, *lse_strides, num_heads,
                    num_splits))
    plan = MLADecodePlan(
        kernel=kernel, config=config, grid=grid, constexprs=constexprs, num_warps=num_warps, num_stages=num_stages,
        num_splits=num_splits, kv_lora=kv_lora, block_table=block_table, seq_lens=seq_lens, query_start=query_start,
        tree_mask=tree_mask_t, tree_indptr=tree_indptr_t, out=out, lse=out_lse, stride_o_s=stride_o_s, output=output,
        output_lse=lse, key=key,
    )
    if fuse_up_projection:
        if v_dim < 1:
            raise ValueError(f"fuse_up_projection needs v_dim >= 1, got {v_dim}")
        _plan_up_projection(plan, num_tokens, num_heads, kv_lora, v_dim, lse)
    elif num_splits > 1:
        reduce_c = reduce_block_c(kv_lora, num_splits)
        plan.reduce_grid = (num_tokens, num_heads, cdiv(kv_lora, reduce_c))
        plan.reduce_args = (
            o_part, lse_part, output, lse if lse is not None else lse_part,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            output.stride(0), output.stride(1),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        )
        plan.reduce_constexprs = (kv_lora, reduce_c, num_splits, next_power_of_2(num_splits), lse is not None)
        plan.reduce_key = (plan.reduce_constexprs, _ptr_key(*plan.reduce_args[:4]), _int_key(*plan.reduce_args[4:]))
    plan.replan = dict(num_tokens=num_tokens, num_heads=num_heads, kv_lora=kv_lora, rope=rope, page=page,
                        cache_dtype=cache_dtype, q_dtype=q_dtype, block_table=block_table, seq_lens=seq_lens,
                        output=output, num_splits=num_splits, config=config, compute_capability=compute_capability,
                        lse=lse, partials=(out, out_lse) if num_splits > 1 else None,
                        query_start_loc=query_start_loc, max_query_len=max_query_len, tree_mask=tree_mask,
                        tree_indptr=tree_indptr, fuse_up_projection=fuse_up_projection, v_dim=v_dim)
    return plan


def _plan_up_projection(plan: MLADecodePlan, num_tokens: int, num_heads: int, kv_lora: int, v_dim: int,
                        lse: Optional[torch.Tensor]) -> None:
    """The fused reduction + up-projection's launch (``plan.up_*``): it reads the split partials, or with one
    split the latent output the decode kernel writes."""
    splits = plan.num_splits
    block_t, block_c, block_v = reduce_up_blocks(num_tokens, kv_lora, v_dim, splits)
    store_lse = splits > 1 and lse is not None  # with one split the decode kernel writes the LSE itself
    if splits > 1:
        part, part_lse = plan.out, plan.lse
        part_strides = (part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1))
    else:
        part, part_lse = plan.output, plan.seq_lens
        part_strides = (part.stride(0), part.stride(1), 0, 0, 0)
    lse_t = lse if store_lse else plan.seq_lens
    plan.up_grid = (num_heads, cdiv(num_tokens, block_t), 1)
    plan.up_head = (part, part_lse, lse_t)
    plan.up_ints = (num_tokens, *part_strides, *((lse.stride(0), lse.stride(1)) if store_lse else (0, 0)))
    plan.up_constexprs = (kv_lora, v_dim, splits, next_power_of_2(splits), block_t, block_c, block_v, store_lse,
                          is_triton_interpreted())
    plan.up_key = (plan.up_constexprs, _ptr_key(*plan.up_head), _int_key(*plan.up_ints))


def weight_launch_state(weight: torch.Tensor, name: str = "W_UV") -> tuple:
    """What :func:`launch_mla_up_projection` needs of a layer's W_UV [H, Lkv, V] (or :func:`launch_mla_absorb` of
    its W_UK_T [H, P, Lkv]), unit last stride: its part of the compiled-kernel key and its two leading strides.
    Compute it once per weight tensor; ``name`` names it in the error."""
    if weight.dim() != 3 or weight.stride(2) != 1:
        raise ValueError(f"{name} must be a 3-d [H, K, N] weight with a unit last stride, got shape "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    return tensor_key(weight), (weight.stride(0), weight.stride(1))


def launch_mla_up_projection(plan: MLADecodePlan, w_uv: torch.Tensor, w_state: tuple, output: torch.Tensor,
                             prepare: bool = False) -> Optional[PreparedLaunch]:
    """The planned fused reduction + up-projection (after :func:`launch_mla_decode` of the same plan):
    output[t, h, :] = latent[t, h, :] @ w_uv[h] for the plan's T query tokens.

    w_uv : [H, Lkv, V] the layer's up-projection weight (model dtype); w_state : its :func:`weight_launch_state`.
    output : [>= T, H, V] in the model dtype, any strides with a unit last one; rows past T are not written.
    prepare : also return this launch prepared (:meth:`~attnbackends.ops.launch.DescriptorLauncher.prepare`), the
    output its one leading argument (None where it cannot be prepared).
    """
    out_key = tensor_key(output)
    if out_key[1][-1] != 1:
        raise ValueError(f"the MLA up-projection needs an output with unit last stride, got strides {out_key[1]}")
    key = (plan.up_key, w_state[0], out_key)
    args = (output,) + plan.up_head + (w_uv,) + plan.up_ints + w_state[1] + out_key[1][:2]
    _REDUCE_UP(key, plan.up_grid, args, plan.up_constexprs, plan.up_num_warps, 2)
    return _REDUCE_UP.prepare(key, args, plan.up_constexprs, 1) if prepare else None


@dataclass
class MLAAbsorbPlan:
    """One batch's query absorption launch (:func:`plan_mla_absorb`): grid, the planned output buffers and their
    strides, constexprs and the batch's part of the compiled-kernel key.

    write_grid, write_slots, write_constexprs, write_key : the same launch writing the T new tokens into the cache
    too (:func:`launch_mla_absorb_and_write`): its grid, ``(slot_mapping,)``, the batch's constexprs and part of
    the key (grid None: not planned).
    """

    grid: tuple[int, int, int]
    buffers: tuple  # (ql [T, H, Lkv], q_pe [T, H, R])
    num_tokens: int
    buffer_strides: tuple
    constexprs: tuple
    key: tuple
    num_warps: int = 4
    write_grid: Optional[tuple[int, int, int]] = None
    write_slots: tuple = ()
    write_constexprs: tuple = ()
    write_key: tuple = ()


def plan_mla_absorb(*, num_tokens: int, num_heads: int, nope: int, rope: int, kv_lora: int, ql: torch.Tensor,
                    q_pe: torch.Tensor, slot_mapping: Optional[torch.Tensor] = None) -> MLAAbsorbPlan:
    """The launch of :func:`~attnbackends.mla.projection_kernels._mla_absorb_kernel` for ``num_tokens`` decode
    tokens: ql [T, H, Lkv] receives q_nope @ W_UK_T per head and q_pe [T, H, R] a copy of the rotary queries (any
    strides with a unit last one; the builder's buffers). ``slot_mapping`` ([>= T] int64, the batch's slots):
    plan the launch that also writes the T new tokens into the cache at these slots
    (:func:`~attnbackends.mla.projection_kernels._mla_absorb_write_kernel`) too. Host facts only."""
    if ql.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("the MLA absorption writes ql and q_pe with unit stride in the last dimension")
    block_t, block_p, block_l = absorb_blocks(num_tokens, nope, kv_lora)
    strides = (ql.stride(0), ql.stride(1), q_pe.stride(0), q_pe.stride(1))
    constexprs = (nope, rope, kv_lora, block_t, block_p, block_l, next_power_of_2(rope), is_triton_interpreted())
    grid = (num_heads, cdiv(num_tokens, block_t), cdiv(kv_lora, block_l))
    plan = MLAAbsorbPlan(
        grid=grid, buffers=(ql, q_pe), num_tokens=num_tokens, buffer_strides=strides, constexprs=constexprs,
        key=(constexprs, _ptr_key(ql, q_pe), _int_key(num_tokens, *strides)))
    if slot_mapping is not None:
        plan.write_grid = (num_heads + 1, grid[1], grid[2])  # the last row of axis 0 writes the tokens
        plan.write_slots = (slot_mapping,)
        plan.write_constexprs = constexprs + (next_power_of_2(kv_lora),)
        plan.write_key = (plan.write_constexprs, _ptr_key(ql, q_pe, slot_mapping), _int_key(num_tokens, *strides))
    return plan


def _absorb_args(plan: MLAAbsorbPlan, q_key: tuple, w_uk_t: torch.Tensor, w_state: tuple) -> tuple:
    """The absorption's runtime arguments after the queries for queries whose :func:`tensor_key` is ``q_key``."""
    q_strides = q_key[1]
    if q_strides[-1] != 1:
        raise ValueError(f"the MLA absorption needs queries with unit last stride, got strides {q_strides}")
    return (w_uk_t,) + plan.buffers + (plan.num_tokens, q_strides[0], q_strides[1]) + plan.buffer_strides + w_state[1]


def launch_mla_absorb(plan: MLAAbsorbPlan, q: torch.Tensor, w_uk_t: torch.Tensor, w_state: tuple,
                      prepare: bool = False) -> Optional[PreparedLaunch]:
    """The planned absorption: ql[t, h] = q[t, h, :P] @ w_uk_t[h] and q_pe[t, h] = q[t, h, P:] for the plan's T
    tokens. q : [>= T, H, P + R] in the model dtype, any strides with a unit last one (rows past T are not read);
    w_uk_t : [H, P, Lkv] the layer's weight; w_state : its :func:`weight_launch_state`. prepare : also return the
    launch prepared, the queries its one leading argument (as :func:`launch_mla_up_projection`)."""
    q_key = tensor_key(q)
    key, args = (plan.key, w_state[0], q_key), (q,) + _absorb_args(plan, q_key, w_uk_t, w_state)
    _ABSORB(key, plan.grid, args, plan.constexprs, plan.num_warps, 2)
    return _ABSORB.prepare(key, args, plan.constexprs, 1) if prepare else None


def launch_mla_absorb_and_write(plan: MLAAbsorbPlan, q: torch.Tensor, w_uk_t: torch.Tensor, w_state: tuple,
                                kv_c: torch.Tensor, k_pe: torch.Tensor, cache: MLACacheState,
                                k_scale: float, prepare: bool = False) -> Optional[PreparedLaunch]:
    """:func:`launch_mla_absorb` and, in the same launch, the cache write of the plan's T new tokens (a plan made
    with ``slot_mapping``): [kv_c[t] ; k_pe[t]] into cache slot ``slot_mapping[t]``, exactly as
    :func:`~attnbackends.ops.mla_cache.concat_and_cache_mla` writes it (-1 is padding, skipped; a slot outside the
    cache is skipped and recorded by the page guard, raised here under the interpreter and at the next check point
    on CUDA).

    kv_c : [>= T, Lkv], k_pe : [>= T, R] in the model dtype, any row strides with a unit last one (rows past T are
    not read); cache : the :class:`MLACacheState` of the latent cache; k_scale : its fp8 scale (stored =
    saturate(x / k_scale)), ignored for other cache dtypes. prepare : also return the launch prepared, its
    leading arguments (q, kv_c, k_pe) (as :func:`launch_mla_up_projection`).
    """
    q_key, kvc_key, kpe_key = tensor_key(q), tensor_key(kv_c), tensor_key(k_pe)
    tail = _absorb_args(plan, q_key, w_uk_t, w_state)
    if kvc_key[1][-1] != 1 or kpe_key[1][-1] != 1:
        raise ValueError("the MLA cache write needs unit stride in the last dimension of kv_c and k_pe")
    cache_key, cache_args, cache_constexprs = cache.writer()
    key = (plan.write_key, w_state[0], q_key, kvc_key, kpe_key, cache_key)
    args = (q, kv_c, k_pe) + tail + (kvc_key[1][0], kpe_key[1][0]) + plan.write_slots + cache_args + (k_scale,)
    constexprs = plan.write_constexprs + cache_constexprs
    _ABSORB_WRITE(key, plan.write_grid, args, constexprs, plan.num_warps, 2)
    if plan.constexprs[-1]:  # interpreted: the fault record is already written, and reading it costs no sync
        raise_pending_faults(cache.cache.device)
    return _ABSORB_WRITE.prepare(key, args, constexprs, 3) if prepare else None


def _pointer_fallback(plan: MLADecodePlan, cache: MLACacheState) -> MLADecodePlan:
    """The same batch on the portable kernel (a cache whose pages are not contiguous rows), planned once per
    cache."""
    kept = cache.plan_launches(plan)
    if kept.pointer_plan is None:
        logger.info("MLA decode: the cache's pages are not contiguous rows; the %s kernel cannot read them, the "
                    "portable kernel serves this batch", plan.kernel)
        kept.pointer_plan = plan_mla_decode(**plan.replan, kernel="pointer")
    return kept.pointer_plan


def decode_launch_args(plan: MLADecodePlan, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: MLACacheState,
                       qk_scale_log2: float, v_scale: float, q_nope_key: Optional[tuple] = None,
                       q_pe_key: Optional[tuple] = None) -> tuple[DescriptorLauncher, tuple, tuple, MLADecodePlan]:
    """(launcher, compiled-kernel key, runtime arguments, plan) of the decode kernel's launch for these queries and
    this cache (arguments as :func:`launch_mla_decode`; the plan is ``plan`` or its portable-kernel fallback)."""
    if plan.kernel != "pointer" and not cache.rows_contiguous:
        plan = _pointer_fallback(plan, cache)
    qn_key = q_nope_key if q_nope_key is not None else tensor_key(q_nope)
    qp_key = q_pe_key if q_pe_key is not None else tensor_key(q_pe)
    if qn_key[1][-1] != 1 or qp_key[1][-1] != 1:
        raise ValueError("the MLA decode needs queries with unit stride in the last dimension")
    key = (plan.key, qn_key, qp_key, cache.key)
    kernel = plan.kernel
    if kernel == "hopper":
        args = hopper_args(q_nope, q_pe, cache.descriptors("hopper", plan.kv_lora, plan.config), plan.block_table,
                           plan.seq_lens, plan.query_start, plan.out, plan.lse, plan.stride_o_s, cache.num_blocks,
                           plan.num_splits, qk_scale_log2, v_scale)
        return hopper_launcher(), key, args, plan
    out, lse = plan.out, plan.lse
    lse_t = lse if lse is not None else plan.seq_lens
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    common = (plan.block_table, plan.seq_lens, plan.query_start, plan.tree_mask, plan.tree_indptr, out, lse_t,
              q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
              cache.stride_blk, cache.stride_tok, plan.block_table.stride(0), cache.num_blocks,
              out.stride(0), out.stride(1), plan.stride_o_s, *lse_strides,
              q_nope.shape[1], plan.num_splits, float(qk_scale_log2))
    if kernel == "tma":
        kv_desc, pe_desc = cache.descriptors("tma", plan.kv_lora, plan.config)
        return _TMA, key, (q_nope, q_pe, kv_desc, pe_desc, cache.cache) + common, plan
    return _POINTER, key, (q_nope, q_pe, cache.cache) + common + (float(v_scale),), plan


def launch_mla_decode(plan: MLADecodePlan, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: MLACacheState,
                      qk_scale_log2: float, v_scale: float, q_nope_key: Optional[tuple] = None,
                      q_pe_key: Optional[tuple] = None) -> torch.Tensor:
    """Run ``plan`` (no checks beyond the unit last strides: see :func:`plan_mla_decode`).

    q_nope : [T, H, Lkv] absorbed queries, any strides with a unit last one; q_pe : [T, H, R] likewise.
    cache : the :class:`MLACacheState` of the latent cache. qk_scale_log2 : scale * log2(e) (* k_scale for an fp8
    cache); v_scale : k_scale for an fp8 cache, else 1. q_nope_key : :func:`tensor_key` of ``q_nope`` when the
    caller knows it (a buffer the builder owns); q_pe_key likewise for ``q_pe``. With both keys given the queries
    are taken for planned buffers: the launch's arguments are worked out once per plan and cache (the same query
    tensors and scales), kept in ``cache``. Returns ``plan.output``.
    """
    if plan.grid[1] == 0:
        return plan.output
    if q_nope_key is not None and q_pe_key is not None:
        # every argument is planned or the cache's: the launch is worked out once per cache and batch, and after
        # its first launch prepared (the C launcher's arguments fixed: launch_prepared)
        kept = cache._plans.get(plan)
        if kept is None:
            kept = cache.plan_launches(plan)
        if (kept.launch is None or kept.q_nope is not q_nope or kept.q_pe is not q_pe
                or kept.scales != (qk_scale_log2, v_scale)):
            kept.launch = decode_launch_args(plan, q_nope, q_pe, cache, qk_scale_log2, v_scale, q_nope_key, q_pe_key)
            kept.q_nope, kept.q_pe, kept.scales, kept.prepared = q_nope, q_pe, (qk_scale_log2, v_scale), None
        launcher, key, args, plan = kept.launch
        kept.prepared = launch_keeping_prepared(kept.prepared, launcher, key, plan.grid, args, plan.constexprs,
                                                plan.num_warps, plan.num_stages)
    else:
        launcher, key, args, run = decode_launch_args(plan, q_nope, q_pe, cache, qk_scale_log2, v_scale,
                                                      q_nope_key, q_pe_key)
        launcher(key, run.grid, args, run.constexprs, run.num_warps, run.num_stages)
        kept = cache.plan_launches(plan) if run.reduce_grid is not None else None
        plan = run
    if plan.reduce_grid is not None:
        # every argument of the split reduction is planned
        kept.reduce_prepared = launch_keeping_prepared(kept.reduce_prepared, _REDUCE, plan.reduce_key,
                                                       plan.reduce_grid, plan.reduce_args, plan.reduce_constexprs,
                                                       4, 2)
    return plan.output


def prepared_decode_launches(plan: MLADecodePlan, cache: MLACacheState) -> Optional[tuple]:
    """((prepared launch, grid), ...) of ``plan``'s launches over ``cache`` as :func:`launch_mla_decode` with
    planned queries runs them (the decode, then the split reduction where planned), all without leading
    arguments; None until each has been launched once and prepared."""
    kept = cache._plans.get(plan)
    if kept is None or kept.prepared is None:
        return None
    run = kept.launch[3]  # the plan the launch runs: ``plan`` or its portable-kernel fallback
    launches = ((kept.prepared, run.grid),)
    if run.reduce_grid is not None:
        if kept.reduce_prepared is None:
            return None
        launches += ((kept.reduce_prepared, run.reduce_grid),)
    return launches


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    k_scale: float = 1.0,
    num_splits: int = 1,
    config: Optional[MLADecodeConfig] = None,
    lse: Optional[torch.Tensor] = None,
    partials: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    descriptors: Optional[tuple[Any, Any]] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    max_query_len: int = 1,
    tree_mask: Optional[torch.Tensor] = None,
    tree_indptr: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention over the latent cache: B requests, T query tokens (one per request, or several for
    speculative verification).

    Parameters
    ----------
    q_nope : [T, H, Lkv] absorbed queries (q_nope @ W_UK_T), fp16/bf16, unit stride in the last dimension.
    q_pe : [T, H, R] rotary part of the queries.
    kv_cache : [num_blocks, block_size, Lkv + R] in the model dtype or fp8 (read as stored * k_scale).
    block_table : [B, W] int32 page ids (one outside ``[0, num_blocks)`` is read as page 0); seq_lens : [B] int32
        (keys per request, its new tokens included).
    output : [T, H, Lkv] receives the latent output softmax(scale * [q_nope; q_pe] . c) @ kv_c.
    num_splits : KV splits (see :func:`choose_num_splits`); > 1 adds a reduction kernel.
    lse : [T, H] float32 or None; receives the natural-log log-sum-exp of the scaled logits.
    partials : preallocated ([T, H, S, Lkv] float32, [T, H, S] float32) buffers for num_splits > 1.
    descriptors : :func:`decode_descriptors` of the kernel :func:`decode_kernel_name` picks for these inputs (built
        here when that kernel reads through TMA and none are given).
    query_start_loc : [B + 1] int32, request b's query tokens are ``query_start_loc[b] : query_start_loc[b + 1]``
        (each at most ``max_query_len``; token t of a request with L keys and Q tokens sits at position L - Q + t
        and sees keys up to it). None: one token per request (T == B).
    max_query_len : the longest request's query (host int; the kernel's rows per request are this x H).
    tree_mask, tree_indptr : the packed tree mask ([sum n_i^2] uint8 or bool) and its [B + 1] int32 offsets
        (:attr:`CommonAttentionMetadata.spec_tree_mask`): request b's last n_b tokens are a draft segment whose
        tokens see only their ancestors in it.

    Returns
    -------
    output
    """
    num_tokens, num_heads, kv_lora = q_nope.shape
    rope = q_pe.shape[-1]
    batch = seq_lens.shape[0]
    if kv_cache.shape[-1] != kv_lora + rope:
        raise ValueError(f"kv_cache last dimension {kv_cache.shape[-1]} != Lkv + R = {kv_lora + rope}")
    if (tree_mask is None) != (tree_indptr is None):
        raise ValueError("tree_mask and tree_indptr go together: pass both or neither")
    max_query_len = int(max_query_len)
    if query_start_loc is None and (max_query_len != 1 or num_tokens != batch):
        raise ValueError(f"{num_tokens} query tokens for {batch} requests (max_query_len {max_query_len}) need "
                         "query_start_loc")
    if batch == 0:
        return output
    config = config or default_decode_config(num_heads, interpreted=is_triton_interpreted())
    tree = tree_indptr is not None
    kernel = decode_kernel_name(q_nope, q_pe, kv_cache, config, tree)
    plan = plan_mla_decode(
        num_tokens=num_tokens, num_heads=num_heads, kv_lora=kv_lora, rope=rope, page=kv_cache.shape[1],
        cache_dtype=kv_cache.dtype, q_dtype=q_nope.dtype, block_table=block_table, seq_lens=seq_lens, output=output,
        num_splits=num_splits, config=config, compute_capability=None, lse=lse, partials=partials,
        query_start_loc=query_start_loc, max_query_len=max_query_len, tree_mask=tree_mask, tree_indptr=tree_indptr,
        kernel=kernel,
    )
    cache = MLACacheState(kv_cache)
    if descriptors is not None and kernel != "pointer":
        cache._descriptors[(kernel, kv_lora, config.block_n)] = descriptors
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    launch_mla_decode(plan, q_nope, q_pe, cache, scale * LOG2E * (k_scale if is_fp8 else 1.0),
                      k_scale if is_fp8 else 1.0)
    return output
