"""The FlashInfer impl's partial attention with its log-sum-exp (:meth:`AttentionImpl.forward_with_lse`), which
context-parallel decode merges across ranks: FlashInfer's decode wrapper over the requests with keys here.

FlashInfer cannot plan a request without keys, so those are left out (output 0, lse -inf). Its LSE is base 2 (its
kernels work in exp2) and is converted to natural log. Planned per call: a context-parallel step runs it once per
layer outside the builder's plan.
"""

from __future__ import annotations

import math

import torch

from ..metadata import CommonAttentionMetadata
from ..ops.flashinfer.plan_inputs import paged_kv_plan_inputs
from ..ops.flashinfer.wrapper_pool import standalone_decode_wrapper

__all__ = ["forward_with_lse"]


def forward_with_lse(self, query: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                     output: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`attnbackends.interface.AttentionImpl.forward_with_lse` for :class:`~.backend.FlashInferImpl` (shapes
    there)."""
    from ..compat import import_flashinfer

    spec = self.spec
    flashinfer = import_flashinfer()
    output.zero_()
    lse.fill_(float("-inf"))
    held_cpu = torch.nonzero(common.seq_lens_cpu > 0).flatten()
    if held_cpu.numel() == 0:
        return output, lse
    held = held_cpu.to(query.device, non_blocking=True)
    n = held_cpu.numel()
    inputs = paged_kv_plan_inputs(
        torch.arange(n + 1, dtype=torch.int32), common.seq_lens_cpu[held_cpu].to(torch.int32),
        common.block_table.index_select(0, held), spec.block_size,
    )
    wrapper = standalone_decode_wrapper(flashinfer, query.device, spec.num_queries_per_kv > 1)
    wrapper.plan(
        inputs.kv_indptr, inputs.kv_indices, inputs.kv_last_page_len, spec.num_heads, spec.num_kv_heads,
        spec.head_size, spec.block_size, pos_encoding_mode="NONE", logits_soft_cap=spec.logits_soft_cap,
        sm_scale=spec.softmax_scale, q_data_type=query.dtype, kv_data_type=kv_cache.dtype, o_data_type=query.dtype,
    )
    scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if kv_cache.dtype.itemsize == 1 else {}
    part, part_lse = wrapper.run(query.index_select(0, held), kv_cache, return_lse=True, **scales)
    output.index_copy_(0, held, part.to(output.dtype))
    lse.index_copy_(1, held, (part_lse.float() * math.log(2.0)).transpose(0, 1))
    return output, lse
