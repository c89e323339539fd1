"""DeepSeek sparse attention (V3.2) in pure torch: the exact computation, the oracle of every sparse MLA backend,
and the ``reference_mla_sparse`` backend over it.

For a query token t of a request at position p (its context + its index among the step's tokens), with the
request's cached tokens j = 0 .. p (its own key written first):

1. Indexer (:func:`indexer_scores`): q_idx[t] [H, D] is quantised per (head, quant_block) exactly as the keys are
   (:func:`~attnbackends.ops.sparse_mla_cache.quantize_blockwise_fp8`) and read back; the keys are the index
   cache's dequantised values; ``score(t, j) = index_scale * sum_h w[t, h] * relu(q_idx[t, h] . k_idx[j])``.
2. Top-k (:func:`topk_positions`): the ``topk`` visible tokens of highest score, listed by descending score;
   equal scores: the lower position first. Fewer than ``topk`` visible tokens: the rest of the row is -1.
3. Translation (:func:`positions_to_slots`): position j -> cache slot ``block_table[j // bs] * bs + j % bs``
   (-1 stays -1).
4. Attention (:func:`sparse_mla_attention`): MLA (DESIGN.md's semantics, the model's softmax scale) over exactly
   the selected tokens, in the absorbed form (ql = q_nope @ W_UK_T per head; logits = [ql ; q_pe] . c over the
   selected latents; o = softmax . kv_c @ W_UV), which equals the up-projected form up to rounding.

With ``topk`` >= a request's length every visible token is selected and the result is dense MLA's.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..interface import AttentionBackend, CudaGraphSupport, MLAAttentionImpl
from ..ops.page_guard import raise_faults_before_gathering
from ..ops.sparse_mla_cache import (
    SparseMLACache, SparseMLACacheHooks, dequantize_blockwise_fp8, quantize_blockwise_fp8, read_index_keys,
    read_latent, write_index_keys, write_sparse_latent,
)
from ..ops.sparse_mla_inputs import check_sparse_mla_inputs
from ..spec import AttentionSpec, SparseIndexerSpec
from .backend import ReferenceMetadata, ReferenceMetadataBuilder

__all__ = [
    "ReferenceSparseMLABackend",
    "ReferenceSparseMLAImpl",
    "indexer_scores",
    "positions_to_slots",
    "request_selection",
    "sparse_mla_attention",
    "topk_positions",
]

#: Query tokens the reference attends at once (bounds its [tokens, heads, length] logits).
_QUERY_CHUNK = 16


def indexer_scores(index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor,
                   sparse: SparseIndexerSpec, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """index_q [Q, H, D] (model dtype), index_weights [Q, H], keys [L, D] (dequantised index keys) -> scores
    [Q, L] in ``compute_dtype`` (step 1 of the module docstring; no causal mask)."""
    q8, qs = quantize_blockwise_fp8(index_q, sparse.quant_block)
    q = dequantize_blockwise_fp8(q8, qs, compute_dtype)
    dots = torch.einsum("qhd,ld->qhl", q, keys.to(compute_dtype)).clamp_min(0)
    return torch.einsum("qhl,qh->ql", dots, index_weights.to(compute_dtype)) * sparse.softmax_scale


def topk_positions(scores: torch.Tensor, query_positions: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [Q, L], query_positions [Q] -> [Q, topk] int64 positions (step 2: causal, descending score, ties to
    the lower position, -1 past the visible tokens)."""
    num_q, length = scores.shape
    pos = torch.arange(length, device=scores.device)
    visible = pos[None, :] <= query_positions[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    # a stable descending sort keeps equal scores in position order
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.where(torch.gather(visible, 1, order), order, torch.full_like(order, -1))
    if chosen.shape[1] < topk:
        chosen = torch.cat([chosen, chosen.new_full((num_q, topk - chosen.shape[1]), -1)], dim=1)
    return chosen


def positions_to_slots(positions: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [Q, K] int64 (-1 padding) of one request, pages [W] its page ids -> cache slots [Q, K] int64."""
    valid = positions >= 0
    safe = positions.clamp_min(0)
    slots = pages.long()[safe // block_size] * block_size + safe % block_size
    return torch.where(valid, slots, torch.full_like(slots, -1))


def sparse_mla_attention(q: torch.Tensor, latent: torch.Tensor, positions: torch.Tensor, w_uk_t: torch.Tensor,
                         w_uv: torch.Tensor, scale: float, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q [Q, N, P + R], latent [L, Lkv + R] (dequantised), positions [Q, K] (-1 padding), W_UK_T [N, P, Lkv],
    W_UV [N, Lkv, V] -> [Q, N, V] in ``compute_dtype`` (step 4). A query that selected nothing gives zeros."""
    num_q = q.shape[0]
    p, lkv = w_uk_t.shape[1], w_uk_t.shape[2]
    lat = latent.to(compute_dtype)
    w_uk, w_v = w_uk_t.to(compute_dtype), w_uv.to(compute_dtype)
    out = torch.zeros(num_q, q.shape[1], w_v.shape[2], dtype=compute_dtype, device=q.device)
    for start in range(0, num_q, _QUERY_CHUNK):
        qc = q[start: start + _QUERY_CHUNK].to(compute_dtype)
        ql = torch.einsum("qnp,npl->qnl", qc[..., :p], w_uk)  # [Qc, N, Lkv]
        logits = (torch.einsum("qnl,jl->qnj", ql, lat[:, :lkv])
                  + torch.einsum("qnr,jr->qnj", qc[..., p:], lat[:, lkv:])) * scale  # [Qc, N, L]
        pos = positions[start: start + _QUERY_CHUNK]
        selected = torch.zeros(pos.shape[0], latent.shape[0] + 1, dtype=torch.bool, device=q.device)
        selected.scatter_(1, torch.where(pos >= 0, pos, latent.shape[0]), True)
        selected = selected[:, :-1]
        logits = logits.masked_fill(~selected[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing selected: zeros
        o_lat = torch.einsum("qnj,jl->qnl", probs, lat[:, :lkv])
        out[start: start + _QUERY_CHUNK] = torch.einsum("qnl,nlv->qnv", o_lat, w_v)
    return out


def request_selection(index_q: torch.Tensor, index_weights: torch.Tensor, index_cache: torch.Tensor,
                      pages: torch.Tensor, seq_len: int, spec: AttentionSpec,
                      compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 for one request's Q query tokens (the last Q of its ``seq_len``; its keys already in
    ``index_cache`` on ``pages`` [W]) -> (scores [Q, seq_len] with -inf where invisible, positions [Q, topk],
    slots [Q, topk])."""
    bs = spec.block_size
    num_q = index_q.shape[0]
    pos = torch.arange(seq_len, device=index_q.device)
    key_slots = pages.long()[pos // bs] * bs + pos % bs
    keys = read_index_keys(index_cache, key_slots, spec, compute_dtype)
    scores = indexer_scores(index_q, index_weights, keys, spec.sparse_indexer, compute_dtype)
    qpos = torch.arange(seq_len - num_q, seq_len, device=index_q.device)
    positions = topk_positions(scores, qpos, spec.sparse_indexer.topk)
    scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
    return scores, positions, positions_to_slots(positions, pages, bs)


class ReferenceSparseMLAImpl(MLAAttentionImpl[ReferenceMetadata]):
    """Sparse MLA as the module docstring defines it, one request at a time, in float32 (float64 for float64
    inputs). ``forward`` as :mod:`~attnbackends.ops.sparse_mla_inputs` documents it."""

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        if not spec.is_sparse_mla:
            raise ValueError("sparse MLA impls need a spec with a sparse_indexer")
        super().__init__(spec, **kwargs)

    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: SparseMLACache,
                        slot_mapping: torch.Tensor) -> None:
        """Write the latent part of new tokens (their index keys: :func:`write_index_keys`)."""
        write_sparse_latent(kv_c_normed, k_pe, kv_cache.latent, slot_mapping, self.spec, impl="torch")

    def forward(self, q: torch.Tensor, kv_c_normed: Optional[torch.Tensor], k_pe: Optional[torch.Tensor],
                kv_cache: SparseMLACache, metadata: ReferenceMetadata, output: torch.Tensor, *,
                index_q: Optional[torch.Tensor] = None, index_k: Optional[torch.Tensor] = None,
                index_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        spec = self.spec
        common = metadata.common
        check_sparse_mla_inputs(spec, metadata, common, q, kv_c_normed, k_pe, kv_cache, output, index_q, index_k,
                                index_weights)
        n_tokens = common.num_actual_tokens
        if kv_c_normed is not None:
            self.update_kv_cache(kv_c_normed[:n_tokens], k_pe[:n_tokens], kv_cache, common.slot_mapping)
            write_index_keys(index_k[:n_tokens], kv_cache.index, common.slot_mapping, spec, impl="torch")
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        p, v, n = spec.qk_nope_head_dim, spec.v_head_dim, spec.num_heads
        w = self.kv_b_proj.view(n, p + v, spec.kv_lora_rank)
        w_uk_t, w_uv = w[:, :p], w[:, p:].transpose(1, 2)
        raise_faults_before_gathering(common)
        qsl, bs = metadata.query_start_loc, spec.block_size
        for i in range(common.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], metadata.seq_lens[i]
            if end == start:
                continue
            pages = common.block_table[i, : math.ceil(seq_len / bs)].long()
            _, positions, _ = request_selection(index_q[start:end], index_weights[start:end], kv_cache.index,
                                                pages, seq_len, spec, compute)
            pos = torch.arange(seq_len, device=q.device)
            latent = read_latent(kv_cache.latent, pages[pos // bs] * bs + pos % bs, spec, compute)
            out = sparse_mla_attention(q[start:end], latent, positions, w_uk_t, w_uv, spec.softmax_scale, compute)
            output[start:end] = out.to(output.dtype)
        return output


class ReferenceSparseMLABackend(SparseMLACacheHooks, AttentionBackend):
    """Pure torch DeepSeek sparse attention (indexer, top-k, MLA over the selection); any device; the oracle."""

    name = "reference_mla_sparse"
    description = "pure torch DeepSeek sparse attention (V3.2): indexer, top-k, MLA over the selection; the oracle"
    is_mla = True
    supports_sparse_indexer = True
    supported_dtypes = frozenset({"float16", "bfloat16", "float32"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16", "float32"})
    runs_on_cpu = True
    cudagraph_support = CudaGraphSupport.NEVER

    @classmethod
    def get_builder_cls(cls) -> type[ReferenceMetadataBuilder]:
        return ReferenceMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[ReferenceSparseMLAImpl]:
        return ReferenceSparseMLAImpl
