"""Plan and launch of the Hopper prefill kernel (:mod:`attnbackends.triton.prefill_kernel`).

The builder asks :func:`prefill_new_kv_unsupported_reason` once per layer spec and device; where the kernel
applies, a batch with prefills gets a :class:`PrefillPlan` for its prefill sequences next to a decode-only
unified plan, and the impl runs that pair whenever the forward brings the step's new keys and values in a layout
the kernels' descriptors take (:func:`tma_compatible`; otherwise, or without them, the batch's single unified plan
runs instead). A batch whose prefills have no cached context gets the Gluon kernel's plan in place of the
:class:`PrefillPlan` where that kernel serves the layer (:mod:`.prefill_hopper`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..compat import DirectLauncher, ensure_triton_scratch_allocator
from ..ops.launch_math import cdiv
from ..platform import is_triton_interpreted
from .prefill_kernel import prefill_new_kv_kernel

__all__ = ["PREFILL_CONSTEXPRS", "PrefillConfig", "PrefillPlan", "default_prefill_config", "launch_prefill_new_kv",
           "plan_prefill_new_kv", "prefill_kernel_args", "prefill_kernel_pays", "prefill_new_kv_unsupported_reason",
           "tma_compatible"]

PREFILL_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "SLIDING_WINDOW",
                      "USE_SOFTCAP", "USE_SINKS", "GQA_PACK", "INTERPRET")
HEAD_SIZES = (64, 128)
_LOG2E = 1.4426950408889634


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
    """The launch config (tiny tiles under the interpreter). Head 128: 64x64 tiles on one warpgroup, the fastest
    in the H100 tile sweep on every prefill shape although it spills a little (two CTAs per SM hide it; sweep in
    benchmarks/results, ``triton_api.py --prefill-sweep``). A window masks every tile it visits, which at head size
    128 spills more with 64-key tiles: 32-key tiles there (benchmarks/prefill_compile_report.py)."""
    if interpreted:
        return PrefillConfig(16, 16, 4, 1)
    if sliding_window and head_size > 64:
        return PrefillConfig(block_n=32)
    if head_size == 128:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return PrefillConfig()


@dataclass(frozen=True)
class PrefillPlan:
    """The prefill kernel's launch for one batch: sequences ``first_seq`` .. ``first_seq + grid[2] - 1``."""

    grid: tuple[int, int, int]
    first_seq: int
    constexprs: tuple  # the values of PREFILL_CONSTEXPRS
    num_warps: int
    num_stages: int

    @property
    def use_softcap(self) -> bool:
        return self.constexprs[PREFILL_CONSTEXPRS.index("USE_SOFTCAP")]


def prefill_new_kv_unsupported_reason(
    *, head_size: int, dtype: torch.dtype, kv_fp8: bool, causal: bool, use_alibi: bool,
    compute_capability: "tuple[int, int] | None", interpreted: bool = False, deterministic: bool = False,
) -> Optional[str]:
    """Why the prefill kernel cannot run a layer of this shape on a device of ``compute_capability`` (None: not a
    CUDA device) (None: it can). Under the Triton interpreter (``interpreted``) any power-of-two head size from 16
    runs, on any device, but not bfloat16 (the interpreter's descriptor loads of bfloat16 return wrong values)."""
    for bad, what in ((kv_fp8, "an fp8 KV cache"), (not causal, "non-causal attention"), (use_alibi, "ALiBi"),
                      (deterministic, "deterministic mode")):
        if bad:
            return f"does not take {what}"
    if interpreted:
        if dtype == torch.bfloat16:
            return "bfloat16 under the Triton interpreter"
        return None if head_size >= 16 and head_size & (head_size - 1) == 0 else f"head_size {head_size}"
    if compute_capability is None:
        return "needs a CUDA device"
    if tuple(compute_capability) < (9, 0):
        return "needs TMA (sm_90 or newer)"
    if head_size not in HEAD_SIZES:
        return f"does not take head_size {head_size} (takes {HEAD_SIZES})"
    return None


def prefill_kernel_pays(query_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, first_seq: int) -> bool:
    """Whether the prefill kernel should run requests ``first_seq`` onwards rather than the unified kernel.

    It reads the new tokens' keys and values by TMA, fast, but the cached context through page-table loads, slower
    than the unified kernel (on the H100 a step of 60 decodes and 4 x 512 new tokens on 2048 cached ones took
    longer split between the two kernels than in one unified launch). So it runs where the new tokens' causal
    attention is at least as much work as their attention to the context: sum(q^2 / 2) >= sum(q * context), with
    q the new tokens and context the cached ones of each request (int32 CPU tensors [num_reqs])."""
    q = query_lens_cpu.numpy()[first_seq:].astype(np.int64)  # numpy: a few microseconds of host time per build
    context = seq_lens_cpu.numpy()[first_seq:] - q
    return int(q @ q) >= 2 * int(q @ context)


def plan_prefill_new_kv(*, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, num_seqs: int,
                        first_seq: int, max_query_len: int, sliding_window: Optional[int] = None,
                        use_softcap: bool = False, use_sinks: bool = False,
                        config: Optional[PrefillConfig] = None) -> PrefillPlan:
    """The launch of sequences ``first_seq`` .. ``num_seqs - 1`` whose longest query is ``max_query_len``."""
    interpreted = is_triton_interpreted()
    config = config or default_prefill_config(interpreted, head_size, sliding_window)
    pack = config.gqa_pack
    qpk = num_heads // num_kv_heads
    if pack < 1 or pack & (pack - 1) or qpk % pack or config.block_m % pack:
        raise ValueError(f"gqa_pack={pack} must be a power of two dividing the query heads per KV head ({qpk}) and "
                         f"block_m ({config.block_m})")
    grid = (num_heads // pack, cdiv(max(max_query_len, 1), config.block_m // pack), num_seqs - first_seq)
    constexprs = (num_heads, num_kv_heads, head_size, block_size, config.block_m, config.block_n,
                  int(sliding_window or 0), bool(use_softcap), bool(use_sinks), pack, interpreted)
    return PrefillPlan(grid, first_seq, constexprs, config.num_warps, config.num_stages)


def _row_tma_ok(t: torch.Tensor) -> bool:
    """A [tokens, heads, head_size] tensor TMA can address as [tokens, heads * head_size] rows."""
    row = t.stride(0) * t.element_size()
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and row % 16 == 0 and t.data_ptr() % 16 == 0)


def tma_compatible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether the four token tensors have the row layout the prefill kernels' descriptors need (both kernels': unit
    stride in the head dimension, heads contiguous, 16-byte aligned row strides and data pointers)."""
    return _row_tma_ok(query) and _row_tma_ok(key) and _row_tma_ok(value) and _row_tma_ok(output)


_launcher = DirectLauncher(prefill_new_kv_kernel, PREFILL_CONSTEXPRS)


def prefill_kernel_args(plan: PrefillPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        output: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        softmax_scale: float, soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> tuple:
    """The kernel's runtime arguments, in signature order, for :func:`launch_prefill_new_kv`'s tensors."""
    return (query, key, value, output, key_cache, value_cache, block_table, key_cache.shape[0], seq_lens,
            query_start_loc, sinks if sinks is not None else output, plan.first_seq, query.stride(0), key.stride(0),
            value.stride(0), output.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
            softmax_scale if plan.use_softcap else softmax_scale * _LOG2E, float(soft_cap or 1.0))


def launch_prefill_new_kv(plan: PrefillPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          output: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          softmax_scale: float, soft_cap: float = 0.0,
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``plan`` (no checks). query/output [num_tokens, num_heads, head_size]; key/value [num_tokens,
    num_kv_heads, head_size] (the step's new tokens, rows as in query); key_cache/value_cache [num_blocks,
    block_size, num_kv_heads, head_size] views; block_table [num_seqs, max_pages] int32; ``soft_cap`` for a plan
    made with ``use_softcap``; sinks [num_heads] float32 for one made with ``use_sinks``."""
    if plan.grid[2] <= 0:
        return output
    ensure_triton_scratch_allocator()
    args = prefill_kernel_args(plan, query, key, value, output, key_cache, value_cache, block_table, seq_lens,
                               query_start_loc, softmax_scale, soft_cap, sinks)
    launch_key = (plan.constexprs, plan.num_warps, plan.num_stages, query.dtype, key_cache.dtype,
                  block_table.dtype, key_cache.data_ptr() % 16 == 0, value_cache.data_ptr() % 16 == 0)
    _launcher(launch_key, plan.grid, args, plan.constexprs, plan.num_warps, plan.num_stages)
    return output
