"""The reference backend: straightforward per-request torch code, any device, every feature.

It is slow (a Python loop over requests) and exists to be right: the CPU default, the fallback of last resort on
GPUs, and the baseline the other backends are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..masks import custom_mask_of, dense_visibility
from ..interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport, QueryLenSupport
from ..metadata import CommonAttentionMetadata, validate_common_metadata
from ..ops.kv_cache_write import gather_kv_torch, reshape_and_cache_torch
from ..ops.page_guard import raise_faults_before_gathering
from ..speculative.tree_mask import request_tree_mask
from ..spec import KV_CACHE_DTYPES, AttentionMask, AttentionSpec, AttentionType, MaskKind
from ..validation import check_forward_inputs
from .functional import sequence_attention

_PLAIN_MASK = AttentionMask()

__all__ = ["ReferenceBackend", "ReferenceMetadata", "ReferenceMetadataBuilder", "ReferenceImpl"]


@dataclass(frozen=True)
class ReferenceMetadata:
    """The common metadata plus host lists the per-request loop walks (built from the CPU copies: no sync); never
    written after ``build()``. ``debug``: the builder's debug flag; impls then validate inputs and the block table
    on every call."""

    common: CommonAttentionMetadata
    query_start_loc: list[int]
    seq_lens: list[int]
    debug: bool = False
    tree_masks: Optional[list[Optional[torch.Tensor]]] = None  # per request [n, n] bool, from common.spec_tree_mask


class ReferenceMetadataBuilder(AttentionMetadataBuilder[ReferenceMetadata]):
    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 1024
    supports_tree_mask = True

    def build(self, common: CommonAttentionMetadata) -> ReferenceMetadata:
        if self.debug:
            paged = self.spec.attn_type.uses_kv_cache  # encoder batches have no block table to check
            validate_common_metadata(common, block_size=self.spec.block_size if paged else None)
        trees = None
        if common.spec_tree_mask is not None:
            trees = [request_tree_mask(common, i) for i in range(common.num_reqs)]
        return ReferenceMetadata(
            common=common,
            query_start_loc=common.query_start_loc_cpu.tolist(),
            seq_lens=common.seq_lens_cpu.tolist(),
            debug=self.debug,
            tree_masks=trees,
        )


class ReferenceImpl(AttentionImpl[ReferenceMetadata]):
    can_return_lse = True

    def __init__(self, spec: AttentionSpec, **kwargs) -> None:
        super().__init__(spec, **kwargs)
        self.alibi_slopes = (
            torch.tensor(spec.alibi_slopes, dtype=torch.float32) if spec.alibi_slopes is not None else None
        )

    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping, self.k_scale, self.v_scale,
                                self.spec.kv_cache_format)

    def forward_with_lse(self, query: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                         output: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`AttentionImpl.forward_with_lse` (a per-request torch loop)."""
        qsl = common.query_start_loc_cpu.tolist()
        for i, seq_len in enumerate(common.seq_lens_cpu.tolist()):
            start, end = qsl[i], qsl[i + 1]
            if seq_len == 0:
                output[start:end] = 0.0
                lse[:, start:end] = float("-inf")
                continue
            key, value = gather_kv_torch(kv_cache, common.block_table[i], seq_len, self.k_scale, self.v_scale,
                                         kv_format=self.spec.kv_cache_format)
            out, part_lse = sequence_attention(
                query[start:end], key, value, torch.full((end - start,), seq_len, device=query.device),
                scale=self.scale, causal=False, logits_soft_cap=self.spec.logits_soft_cap,
            )
            output[start:end] = out.to(output.dtype)
            lse[:, start:end] = part_lse.float()
        return output, lse

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: ReferenceMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        spec = self.spec
        common = metadata.common
        check_forward_inputs(self, metadata, common, query, key, value, kv_cache, output,
                             backend=ReferenceBackend)
        if kv_cache is not None and key is not None:
            self.update_kv_cache(key, value, kv_cache, common.slot_mapping)
        if kv_cache is not None:
            raise_faults_before_gathering(common)
        if kv_cache is None and (key is None or value is None):
            raise ValueError("key and value are required when there is no kv_cache (encoder attention)")
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        alibi = self.alibi_slopes.to(query.device) if self.alibi_slopes is not None else None
        sinks = self.sinks.to(query.device) if self.sinks is not None else None
        causal = spec.causal and common.causal
        masked = spec.mask != _PLAIN_MASK  # the layer's mask kind, applied as its definition
        masks = common.masks
        qsl = metadata.query_start_loc
        for i in range(common.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            seq_len = metadata.seq_lens[i]
            if kv_cache is not None:
                k, v = gather_kv_torch(kv_cache, common.block_table[i], seq_len, self.k_scale, self.v_scale,
                                       dtype=compute, kv_format=spec.kv_cache_format)
            else:
                k, v = key[start:end], value[start:end]
            context = seq_len - (end - start)
            positions = torch.arange(context, seq_len, device=query.device)
            visible = None
            if masked:
                visible = dense_visibility(
                    spec, positions, seq_len,
                    spans=masks.spans[i] if masks is not None and masks.spans else (),
                    custom=(custom_mask_of(masks, i, end - start, seq_len)
                            if masks is not None and masks.custom_mask is not None else None))
            out, _ = sequence_attention(
                query[start:end],
                k,
                v,
                positions,
                scale=self.scale,
                causal=causal and not masked,
                sliding_window=spec.sliding_window,
                logits_soft_cap=spec.logits_soft_cap,
                alibi_slopes=alibi,
                sinks=sinks,
                compute_dtype=compute,
                tree_mask=metadata.tree_masks[i] if metadata.tree_masks is not None else None,
                visible=visible,
            )
            output[start:end] = out.to(output.dtype)
        return output


class ReferenceBackend(AttentionBackend):
    """Pure torch; every dtype, KV dtype, head size, attention type and feature; any device."""

    name = "reference"
    description = "pure torch, per-request loop; any device; the correctness baseline"
    supported_dtypes = frozenset({"float16", "bfloat16", "float32"})
    supported_kv_cache_dtypes = frozenset(KV_CACHE_DTYPES)
    runs_on_cpu = True
    supported_attn_types = frozenset(AttentionType)
    supports_sliding_window = True
    supports_alibi = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supported_mask_kinds = frozenset(MaskKind)
    supports_window_right = True
    supports_separate_v_head_size = False
    cudagraph_support = CudaGraphSupport.NEVER

    @classmethod
    def get_builder_cls(cls) -> type[ReferenceMetadataBuilder]:
        return ReferenceMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[ReferenceImpl]:
        return ReferenceImpl
