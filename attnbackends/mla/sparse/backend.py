"""The ``triton_mla_sparse`` backend: DeepSeek sparse attention (V3.2) on Triton.

``forward`` (arguments: :mod:`attnbackends.ops.sparse_mla_inputs`) writes the step's latent vectors and indexer keys
into the layer's :class:`~attnbackends.ops.sparse_mla_cache.SparseMLACache`, scores every visible cached token per
query token (:mod:`.indexer`, in token groups whose int64 key buffer stays under the builder's
``indexer_workspace_bytes``), takes the top-k (``torch.topk`` over the keys) and translates it to cache slots, then
runs absorbed-weight MLA over the chosen slots (:mod:`.attention`): ql = q_nope @ W_UK_T (``torch.bmm``), the sparse
kernel, o = o_latent @ W_UV (``torch.bmm``). Decodes, prefill chunks on cached context and multi-token verify
tokens all take this path: each query token has its own selection, causal within its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...interface import AttentionBackend, AttentionMetadataBuilder, CudaGraphSupport, MLAAttentionImpl, QueryLenSupport
from ...metadata import CommonAttentionMetadata, validate_common_metadata
from ...ops.sparse_mla_cache import (
    SparseMLACache, SparseMLACacheHooks, write_index_keys, write_sparse_latent,
)
from ...ops.sparse_mla_inputs import check_sparse_mla_inputs
from ...platform import DeviceInfo
from ...spec import AttentionSpec
from ..common import split_kv_b_proj
from .attention import SparseAttentionConfig, sparse_mla_attention
from .indexer import select_slots

__all__ = ["SparseMLAMetadata", "TritonSparseMLABackend", "TritonSparseMLAImpl", "TritonSparseMLAMetadataBuilder"]


@dataclass(frozen=True)
class SparseMLAMetadata:
    """One batch's plan, shared by every layer.

    token_req, token_pos : [T] int32 each query token's request and position. num_keys : the longest sequence (the
    indexer's key count per token). groups : (start, end) token ranges scored at once. keys_buffer : [>= group,
    num_keys] int64 and slots : [T, topk] int32, the builder's buffers (every layer rewrites them in turn).
    """

    common: CommonAttentionMetadata
    num_actual_tokens: int
    num_decode_tokens: int
    token_req: torch.Tensor
    token_pos: torch.Tensor
    num_keys: int
    groups: tuple[tuple[int, int], ...]
    keys_buffer: torch.Tensor
    slots: torch.Tensor
    attention_config: Optional[SparseAttentionConfig] = None
    debug: bool = False


class TritonSparseMLAMetadataBuilder(AttentionMetadataBuilder[SparseMLAMetadata]):
    """Plans a batch: each query token's request and position (from the host copies), the indexer's token groups
    and the buffers of its keys and chosen slots.

    Parameters (beyond the base class): indexer_workspace_bytes : the largest int64 key buffer of one token group
    (tokens x longest sequence x 8 bytes); attention_config : the sparse kernel's tiles (default: per device).
    """

    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 64
    supports_tree_mask = False
    DEFAULT_INDEXER_WORKSPACE_BYTES = 256 * 1024 * 1024

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", *,
                 indexer_workspace_bytes: int = DEFAULT_INDEXER_WORKSPACE_BYTES,
                 attention_config: Optional[SparseAttentionConfig] = None, **kwargs: Any) -> None:
        super().__init__(spec, device, **kwargs)
        if not spec.is_sparse_mla:
            raise ValueError("TritonSparseMLAMetadataBuilder needs a sparse MLA spec (AttentionSpec.mla(..., "
                             "sparse_indexer=...))")
        if indexer_workspace_bytes < 8:
            raise ValueError(f"indexer_workspace_bytes must be >= 8, got {indexer_workspace_bytes}")
        self.indexer_workspace_bytes = int(indexer_workspace_bytes)
        self.attention_config = attention_config
        self._keys = torch.empty(0, dtype=torch.int64, device=self.device)
        self._slots = torch.empty(0, dtype=torch.int32, device=self.device)

    def build(self, common: CommonAttentionMetadata) -> SparseMLAMetadata:
        if self.debug:
            validate_common_metadata(common, block_size=self.spec.block_size)
        n = common.num_actual_tokens
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
        seq = common.seq_lens_cpu[: common.num_reqs].long()
        qlens = qsl[1:] - qsl[:-1]
        token_req = torch.repeat_interleave(torch.arange(common.num_reqs), qlens, output_size=n)
        token_pos = torch.arange(n) - qsl[token_req] + (seq - qlens)[token_req]
        num_keys = max(1, int(seq.max()) if common.num_reqs else 1)
        per_group = max(1, min(n, self.indexer_workspace_bytes // (8 * num_keys)))
        groups = tuple((s, min(n, s + per_group)) for s in range(0, n, per_group))
        topk = self.spec.sparse_indexer.topk
        if self._keys.numel() < per_group * num_keys:
            self._keys = torch.empty(per_group * num_keys, dtype=torch.int64, device=self.device)
        if self._slots.numel() < n * topk:
            self._slots = torch.empty(n * topk, dtype=torch.int32, device=self.device)
        return SparseMLAMetadata(
            common=common, num_actual_tokens=n, num_decode_tokens=int((qlens == 1).sum()),
            token_req=token_req.to(torch.int32).to(self.device, non_blocking=True),
            token_pos=token_pos.to(torch.int32).to(self.device, non_blocking=True),
            num_keys=num_keys, groups=groups, keys_buffer=self._keys[: per_group * num_keys].view(per_group, num_keys),
            slots=self._slots[: n * topk].view(n, topk), attention_config=self.attention_config, debug=self.debug,
        )


class TritonSparseMLAImpl(MLAAttentionImpl[SparseMLAMetadata]):
    """Sparse MLA on Triton (module docstring). Constructor as :class:`~attnbackends.interface.MLAAttentionImpl`."""

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        if not spec.is_sparse_mla:
            raise ValueError("sparse MLA impls need a spec with a sparse_indexer")
        super().__init__(spec, **kwargs)
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None

    def process_weights_after_loading(self) -> None:
        """W_UK_T [N, P, Lkv] and W_UV [N, Lkv, V] from kv_b_proj."""
        self.W_UK_T, self.W_UV = split_kv_b_proj(self.kv_b_proj, self.spec)

    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: SparseMLACache,
                        slot_mapping: torch.Tensor) -> None:
        """Write the latent part of new tokens (their index keys: ``write_index_keys``)."""
        write_sparse_latent(kv_c_normed, k_pe, kv_cache.latent, slot_mapping, self.spec, impl="triton")

    def forward(self, q: torch.Tensor, kv_c_normed: Optional[torch.Tensor], k_pe: Optional[torch.Tensor],
                kv_cache: SparseMLACache, metadata: SparseMLAMetadata, output: torch.Tensor, *,
                index_q: Optional[torch.Tensor] = None, index_k: Optional[torch.Tensor] = None,
                index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        spec = self.spec
        common = metadata.common
        check_sparse_mla_inputs(spec, metadata, common, q, kv_c_normed, k_pe, kv_cache, output, index_q, index_k,
                                index_weights)
        if self.W_UK_T is None:
            self.process_weights_after_loading()
        n = metadata.num_actual_tokens
        if kv_c_normed is not None:
            self.update_kv_cache(kv_c_normed[:n], k_pe[:n], kv_cache, common.slot_mapping)
            write_index_keys(index_k[:n], kv_cache.index, common.slot_mapping, spec, impl="triton")
        slots = select_slots(index_q, index_weights, kv_cache.index, common.block_table, metadata.token_req,
                             metadata.token_pos, spec, metadata.groups, metadata.num_keys, metadata.keys_buffer,
                             metadata.slots)
        p = spec.qk_nope_head_dim
        ql = torch.bmm(q[:n, :, :p].transpose(0, 1), self.W_UK_T)  # [N, n, Lkv]
        o_latent = torch.empty_like(ql)
        sparse_mla_attention(ql.transpose(0, 1), q[:n, :, p:], kv_cache.latent, slots, o_latent.transpose(0, 1),
                             spec, n, metadata.attention_config)
        # [N, n, Lkv] @ [N, Lkv, V] -> [N, n, V], written into output's [n, N, V] rows
        output[:n].copy_(torch.bmm(o_latent, self.W_UV).transpose(0, 1))
        return output


class TritonSparseMLABackend(SparseMLACacheHooks, AttentionBackend):
    """DeepSeek sparse attention on Triton: fp8 indexer, top-k, absorbed MLA over the chosen tokens."""

    name = "triton_mla_sparse"
    description = ("DeepSeek sparse attention (V3.2) on Triton: fp8 lightning indexer, top-k to cache slots, "
                   "absorbed MLA over the selection (decode and prefill)")
    is_mla = True
    supports_sparse_indexer = True
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16"})
    needs_triton = True
    min_compute_capability = (8, 9)  # fp8 e4m3 index keys (and the fp8_ds_mla latent) convert natively from sm_89
    cudagraph_support = CudaGraphSupport.NEVER

    @classmethod
    def spec_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().spec_reasons(spec)
        sparse = spec.sparse_indexer
        if spec.is_sparse_mla:
            for name, value in (("kv_lora_rank", spec.kv_lora_rank), ("num_index_heads", sparse.num_index_heads),
                                ("index_head_dim", sparse.index_head_dim), ("quant_block", sparse.quant_block)):
                if value & (value - 1):
                    reasons.append(f"{name} {value} is not a power of two (the Triton kernels tile it whole)")
        return reasons

    @classmethod
    def kernel_notes(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        return ["indexer: one Triton launch per token group writing int64 sort keys (score, then lower position "
                "first); top-k: torch.topk over the keys, then one Triton launch translating positions to slots",
                "attention: the Triton sparse MLA kernel (absorbed weights, 16 heads x 32 chosen tokens per tile) "
                "between two torch.bmm projections"]

    @classmethod
    def get_builder_cls(cls) -> type[TritonSparseMLAMetadataBuilder]:
        return TritonSparseMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[TritonSparseMLAImpl]:
        return TritonSparseMLAImpl
