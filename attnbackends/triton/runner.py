"""The runner of Triton step plans: issues a :class:`~.step_plan.TritonStepPlan`'s launches in order, on its streams.

One runner per builder (:attr:`attnbackends.triton.backend.TritonMetadataBuilder.runner`, carried in every metadata
it builds); it owns the side streams the plans name, two per device at most, made on first use. The impl's
``forward`` checks its inputs and calls :meth:`TritonStepRunner.run`; every launch decision was made in the
builder, so the runner only picks the program for the forward's tensors (:meth:`.TritonStepPlan.program_for`) and
issues each entry: a kernel launch through the kernel's launcher (:mod:`.launch`, :mod:`.prefill_launch`,
:mod:`.prefill_hopper`, :mod:`.kv_dequant`, :mod:`attnbackends.ops.kv_cache_write`) or a fork / join between
streams.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..metadata import CommonAttentionMetadata
from ..spec import KVCacheFormat
from ..ops.kv_cache_write import finish_cache_write, reshape_and_cache
from .kv_dequant import dequantise_pages
from .launch import launch_attention
from .prefill_hopper import launch_hopper_prefill
from .prefill_hopper_paged import launch_paged_prefill
from .prefill_launch import launch_prefill_new_kv
from .step_plan import LaunchKind, StreamRole, TritonStepPlan

__all__ = ["CacheViews", "LayerArgs", "TritonStepRunner"]

#: CUDA priority of each side stream (CUDA clamps to the device's range; lower is higher priority).
STREAM_PRIORITIES = {StreamRole.SIDE: 0, StreamRole.PRIORITY: -1024}


class LayerArgs(NamedTuple):
    """One layer's launch constants on one device (its impl makes them once per device).

    scale : the softmax scale; soft_cap : the logit soft-cap (0.0: none); alibi : [num_heads] float32 ALiBi slopes
    or None; sinks : [num_heads] float32 sink logits or None; k_scale, v_scale : the per-tensor scales the kernel
    takes (fp8 per tensor, NVFP4's global scales; :func:`.kv_load.launch_tensor_scales`); kv_format : the cache's.
    """

    scale: float
    soft_cap: float
    alibi: Optional[torch.Tensor]
    sinks: Optional[torch.Tensor]
    k_scale: float
    v_scale: float
    kv_format: KVCacheFormat = KVCacheFormat.SIXTEEN_BIT


class CacheViews(NamedTuple):
    """The key and value halves of a ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` cache
    (``[num_blocks, block_size, num_kv_heads, head_size]`` views) and their part of the unified kernel's compiled-
    kernel key (dtype, strides, 16-byte alignment); made once per cache tensor by the impl."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    launch_key: tuple

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "CacheViews":
        k, v = kv_cache[:, 0], kv_cache[:, 1]
        return cls(k, v, (k.dtype, k.stride(), v.stride(), k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0))


class TritonStepRunner:
    """Runs step plans; owns their side streams (per device, made once, kept for the runner's life)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[torch.device, StreamRole], "torch.cuda.Stream"] = {}

    def stream(self, device: torch.device, role: StreamRole) -> "torch.cuda.Stream":
        """The side stream ``role`` of ``device`` (made on first use, at :data:`STREAM_PRIORITIES`' priority)."""
        stream = self._streams.get((device, role))
        if stream is None:
            stream = self._streams[(device, role)] = torch.cuda.Stream(device, priority=STREAM_PRIORITIES[role])
        return stream

    def run(self, step: TritonStepPlan, query: torch.Tensor, key: Optional[torch.Tensor],
            value: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor], output: torch.Tensor,
            common: CommonAttentionMetadata, layer: LayerArgs, views: Optional[CacheViews]) -> torch.Tensor:
        """Issue the program of ``step`` for these tensors (shapes as in
        :meth:`attnbackends.interface.AttentionImpl.forward`; ``views``: ``kv_cache``'s, None without a cache);
        returns ``output``. No checks: the impl checked the tensors."""
        program = step.program_for(query, key, value, output, kv_cache, common.slot_mapping)
        for entry in program.launches:
            if entry.stream is _MAIN:
                _CASES[entry.kind](entry.plan, step, query, key, value, kv_cache, output, common, layer, views)
                continue
            side = self.stream(query.device, entry.stream)
            if entry.kind is _FORK:
                side.wait_stream(torch.cuda.current_stream(query.device))
            elif entry.kind is _JOIN:
                torch.cuda.current_stream(query.device).wait_stream(side)
            else:
                with torch.cuda.stream(side):
                    _CASES[entry.kind](entry.plan, step, query, key, value, kv_cache, output, common, layer, views)
        return output


# One case per kernel-launching LaunchKind: (entry's plan, step, query, key, value, kv_cache, output, common, layer,
# views) -> None, launching on the current stream. Enum members are read once here: reading them on the hot path
# costs host time on every layer's forward.
_MAIN, _FORK, _JOIN = StreamRole.MAIN, LaunchKind.FORK, LaunchKind.JOIN


def _write_cache(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    reshape_and_cache(key, value, kv_cache, common.slot_mapping, layer.k_scale, layer.v_scale, validate=False,
                      kv_format=layer.kv_format)


def _attention(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    scale, soft_cap, alibi, sinks, k_scale, v_scale = layer[:6]
    key_cache, value_cache, launch_key = views
    launch_attention(plan, query, key_cache, value_cache, output, common.query_start_loc, common.seq_lens,
                     common.block_table, scale, soft_cap, alibi, sinks, k_scale, v_scale, cache_key=launch_key,
                     tree_mask=step.tree_mask, tree_indptr=common.spec_tree_mask_indptr,
                     span_key_end=step.span_key_end, custom_mask=step.custom_mask,
                     custom_mask_indptr=step.custom_mask_indptr)


def _attention_no_cache(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    launch_attention(plan, query, key, value, output, common.query_start_loc, None, None, layer.scale,
                     layer.soft_cap, layer.alibi, layer.sinks)


def _triton_prefill(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    launch_prefill_new_kv(plan, query, key, value, output, views.key_cache, views.value_cache, common.block_table,
                          common.seq_lens, common.query_start_loc, layer.scale, layer.soft_cap, layer.sinks)


def _gluon_prefill(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    if plan.writes_cache:
        launch_hopper_prefill(plan, query, key, value, output, common.query_start_loc, layer.scale, kv_cache,
                              common.slot_mapping, step.write_todo)
    else:
        launch_hopper_prefill(plan, query, key, value, output, common.query_start_loc, layer.scale)


def _gluon_paged_prefill(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    launch_paged_prefill(plan, query, output, kv_cache, common.block_table, common.seq_lens, common.query_start_loc,
                         layer.scale, layer.soft_cap, layer.sinks)


def _dequant_pages(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    dequantise_pages(plan.config, views.key_cache, views.value_cache, plan.pages, plan.scratch, layer.k_scale,
                     layer.v_scale)


def _gluon_paged_prefill_scratch(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    pages = step.dequant
    launch_paged_prefill(plan, query, output, pages.scratch, pages.block_table, common.seq_lens,
                         common.query_start_loc, layer.scale, layer.soft_cap, layer.sinks)


def _attention_scratch(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    pages = step.dequant
    first = pages.first_seq
    scratch = pages.scratch
    launch_attention(plan, query, scratch[:, 0], scratch[:, 1], output, common.query_start_loc[first:],
                     common.seq_lens[first:], pages.block_table[first:], layer.scale, layer.soft_cap, layer.alibi,
                     layer.sinks)


def _finish_cache_write(plan, step, query, key, value, kv_cache, output, common, layer, views) -> None:
    finish_cache_write(key, value, kv_cache, common.slot_mapping, step.write_todo, plan.num_tokens)


_CASES = {
    LaunchKind.CACHE_WRITE: _write_cache,
    LaunchKind.ATTENTION: _attention,
    LaunchKind.ATTENTION_NO_CACHE: _attention_no_cache,
    LaunchKind.TRITON_PREFILL: _triton_prefill,
    LaunchKind.GLUON_PREFILL: _gluon_prefill,
    LaunchKind.GLUON_PAGED_PREFILL: _gluon_paged_prefill,
    LaunchKind.FINISH_CACHE_WRITE: _finish_cache_write,
    LaunchKind.DEQUANT_PAGES: _dequant_pages,
    LaunchKind.GLUON_PAGED_PREFILL_SCRATCH: _gluon_paged_prefill_scratch,
    LaunchKind.ATTENTION_SCRATCH: _attention_scratch,
}
