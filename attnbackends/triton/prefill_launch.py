"""Plan and launch of the Triton prefill kernel (:mod:`attnbackends.triton.prefill_kernel`).

The builder asks :func:`prefill_new_kv_unsupported_reason` once per layer spec and device; where the kernel
applies, a batch with prefills gets a :class:`PrefillPlan` for its prefill sequences next to a decode-only
unified plan (when :func:`.heuristics.prefill_kernel_pays`), both in the batch's step plan (:mod:`.step_plan`). The
step plan runs that pair whenever the forward brings the step's new keys and values in a layout the kernels'
descriptors take (:func:`tma_compatible`; otherwise, or without them, the batch's single unified launch runs
instead). A batch whose prefills have no cached context gets the Gluon kernel's plan in place of the
:class:`PrefillPlan` where that kernel serves the layer (:mod:`.prefill_hopper`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..compat import ensure_triton_scratch_allocator
from ..ops.launch import DirectLauncher
from ..ops.launch_math import cdiv
from ..platform import is_triton_interpreted
from .heuristics import PrefillConfig, default_prefill_config
from .prefill_kernel import prefill_new_kv_kernel

__all__ = ["PREFILL_CONSTEXPRS", "PrefillPlan", "launch_prefill_new_kv", "plan_prefill_new_kv", "prefill_kernel_args",
           "prefill_new_kv_unsupported_reason", "tma_compatible"]

PREFILL_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "SLIDING_WINDOW",
                      "USE_SOFTCAP", "USE_SINKS", "GQA_PACK", "INTERPRET")
HEAD_SIZES = (64, 128)
_LOG2E = 1.4426950408889634


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
