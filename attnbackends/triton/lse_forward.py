"""The Triton impl's partial attention with its log-sum-exp (:meth:`AttentionImpl.forward_with_lse`), which
context-parallel decode merges across ranks: one ``unified_attention`` launch with ``return_lse``."""

from __future__ import annotations

import torch

from ..metadata import CommonAttentionMetadata
from .launch import unified_attention

__all__ = ["forward_with_lse"]


def forward_with_lse(self, query: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                     output: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`attnbackends.interface.AttentionImpl.forward_with_lse` for :class:`~.backend.TritonImpl` (shapes
    there): every cached key is visible (non-causal), no sinks, no cache write."""
    unified_attention(
        query, kv_cache[:, 0], kv_cache[:, 1], output, common.query_start_loc, common.seq_lens, common.block_table,
        common.max_query_len, common.max_seq_len, self.scale, causal=False,
        logits_soft_cap=self.spec.logits_soft_cap, k_scale=self.k_scale, v_scale=self.v_scale,
        num_decodes=common.num_reqs, return_lse=lse,
    )
    return output, lse
