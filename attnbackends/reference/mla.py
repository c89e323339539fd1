"""The reference MLA backend: the naive path, pure torch, any device; the oracle for MLA.

No weight absorption and no chunking: each request's whole latent cache is up-projected through kv_b_proj and
attended with ordinary causal MHA (qk head P + R, v head V) in float32, a tree-verify request's draft segment
under its tree mask (any query length: the builder is the reference backend's).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..interface import AttentionBackend, CudaGraphSupport, MLAAttentionImpl
from ..ops.page_guard import raise_faults_before_gathering
from ..ops.quant import dequantize_from_cache
from .backend import ReferenceMetadata, ReferenceMetadataBuilder
from .functional import sequence_attention
from ..spec import KV_CACHE_DTYPES, AttentionSpec
from ..ops.mla_cache import MLA_KV_CACHE_LAYOUT, concat_and_cache_mla, mla_kv_cache_shape

__all__ = ["ReferenceMLABackend", "ReferenceMLAImpl"]


class ReferenceMLAImpl(MLAAttentionImpl[ReferenceMetadata]):
    """Naive MLA: up-project the whole latent cache, run MHA per request. Constructor and forward as
    :class:`~attnbackends.interface.MLAAttentionImpl`; metadata from
    :class:`~attnbackends.reference.backend.ReferenceMetadataBuilder`."""

    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        """See :meth:`MLAAttentionImpl.update_kv_cache` (the torch write)."""
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, self.k_scale, impl="torch")

    def forward(self, q: torch.Tensor, kv_c_normed: Optional[torch.Tensor], k_pe: Optional[torch.Tensor],
                kv_cache: torch.Tensor, metadata: ReferenceMetadata, output: torch.Tensor) -> torch.Tensor:
        self.check_inputs(q, kv_c_normed, k_pe, kv_cache, metadata, output)
        spec = self.spec
        common = metadata.common
        n_tokens = common.num_actual_tokens
        if kv_c_normed is not None:
            self.update_kv_cache(kv_c_normed[:n_tokens], k_pe[:n_tokens], kv_cache, common.slot_mapping)
        n, p, v_dim, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        w = self.kv_b_proj.to(compute)
        block_size = kv_cache.shape[1]
        raise_faults_before_gathering(common)
        qsl = metadata.query_start_loc
        for i in range(common.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            seq_len = metadata.seq_lens[i]
            pages = common.block_table[i, : math.ceil(seq_len / block_size)].long()
            latent = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len]
            latent = dequantize_from_cache(latent, compute, self.k_scale)  # [L, Lkv + R]
            kv = (latent[:, :lkv] @ w.T).view(seq_len, n, p + v_dim)
            k = torch.cat([kv[..., :p], latent[:, None, lkv:].expand(-1, n, -1)], dim=-1)
            positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            out, _ = sequence_attention(
                q[start:end], k, kv[..., p:], positions, scale=self.scale, causal=True, compute_dtype=compute,
                tree_mask=metadata.tree_masks[i] if metadata.tree_masks is not None else None,
            )
            output[start:end] = out.to(output.dtype)
        return output


class ReferenceMLABackend(AttentionBackend):
    """Pure torch MLA (naive up-projection); any device, every cache dtype; the correctness baseline."""

    name = "reference_mla"
    description = "pure torch MLA: up-projects the whole latent cache and runs MHA; any device; the MLA oracle"
    is_mla = True
    supported_dtypes = frozenset({"float16", "bfloat16", "float32"})
    supported_kv_cache_dtypes = frozenset(KV_CACHE_DTYPES)
    runs_on_cpu = True
    cudagraph_support = CudaGraphSupport.NEVER
    kv_cache_layout = MLA_KV_CACHE_LAYOUT

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return mla_kv_cache_shape(num_blocks, spec.block_size, spec.head_size)

    @classmethod
    def get_builder_cls(cls) -> type[ReferenceMetadataBuilder]:
        return ReferenceMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[ReferenceMLAImpl]:
        return ReferenceMLAImpl
