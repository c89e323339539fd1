"""The argument checks of a sparse MLA ``forward`` (every sparse MLA backend's impl calls
:func:`check_sparse_mla_inputs` first).

A sparse MLA ``forward(q, kv_c_normed, k_pe, kv_cache, metadata, output, *, index_q, index_k, index_weights)`` takes
MLA's arguments (:meth:`~attnbackends.interface.MLAAttentionImpl.forward`) with ``kv_cache`` a
:class:`~attnbackends.ops.sparse_mla_cache.SparseMLACache`, plus the indexer's inputs of the step's tokens:

index_q : [>= n, H, D] the indexer queries (H = num_index_heads, D = index_head_dim), model dtype.
index_k : [>= n, D] the new tokens' indexer keys (written to the index cache first), or None with kv_c_normed.
index_weights : [>= n, H] float32 or model dtype, the per-head weights of each query's score.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..metadata import MetadataOrigin
from ..spec import AttentionSpec
from ..validation import check_tensor
from .page_guard import guard_block_table
from .sparse_mla_cache import SparseMLACache, sparse_mla_cache_shapes

__all__ = ["check_sparse_mla_inputs"]


def check_sparse_mla_inputs(spec: AttentionSpec, metadata: Any, common: Any, q: torch.Tensor,
                            kv_c_normed: Optional[torch.Tensor], k_pe: Optional[torch.Tensor], kv_cache: Any,
                            output: torch.Tensor, index_q: Any, index_k: Any, index_weights: Any) -> None:
    """ValueError naming the first argument that does not fit ``spec``; range-checks the block table against the
    cache's pages where the metadata's builder was not told them (``num_blocks``)."""
    n_tok = common.num_actual_tokens
    n, p, r, v, lkv = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                       spec.kv_lora_rank)
    sparse = spec.sparse_indexer
    h, d = sparse.num_index_heads, sparse.index_head_dim
    dtype = spec.torch_dtype
    check_tensor("q", q, shape=(None, n, p + r), dtype=dtype, names=("num_tokens", "num_heads", "P + R"),
                 min_rows=n_tok)
    device = q.device
    check_tensor("output", output, shape=(q.shape[0], n, v), dtype=dtype, device=device,
                 names=("num_tokens", "num_heads", "v_head_dim"))
    if (kv_c_normed is None) != (k_pe is None) or (kv_c_normed is None) != (index_k is None):
        raise ValueError("kv_c_normed, k_pe and index_k must be given together (or all None when the caches hold "
                         "the step's tokens)")
    if kv_c_normed is not None:
        check_tensor("kv_c_normed", kv_c_normed, shape=(None, lkv), dtype=dtype, device=device,
                     names=("num_tokens", "kv_lora_rank"), min_rows=n_tok)
        check_tensor("k_pe", k_pe, shape=(kv_c_normed.shape[0], r), dtype=dtype, device=device,
                     names=("num_tokens", "qk_rope_head_dim"))
        check_tensor("index_k", index_k, shape=(None, d), dtype=dtype, device=device,
                     names=("num_tokens", "index_head_dim"), min_rows=n_tok)
    if index_q is None or index_weights is None:
        raise ValueError("a sparse MLA forward needs index_q [T, num_index_heads, index_head_dim] and "
                         "index_weights [T, num_index_heads]")
    check_tensor("index_q", index_q, shape=(None, h, d), dtype=dtype, device=device,
                 names=("num_tokens", "num_index_heads", "index_head_dim"), min_rows=n_tok)
    check_tensor("index_weights", index_weights, shape=(None, h), dtype=(torch.float32, dtype), device=device,
                 names=("num_tokens", "num_index_heads"), min_rows=n_tok)
    if not isinstance(kv_cache, SparseMLACache):
        raise ValueError(f"kv_cache of a sparse MLA layer must be a SparseMLACache (latent, index), got "
                         f"{type(kv_cache).__name__}: allocate it with the backend's allocate_kv_cache")
    num_blocks = kv_cache.latent.shape[0] if kv_cache.latent.dim() == 3 else -1
    latent_shape, index_shape = sparse_mla_cache_shapes(max(num_blocks, 1), spec)
    want_dtype = torch.uint8 if sparse.latent_format == "fp8_ds_mla" else dtype
    for name, t, shape, dt in (("kv_cache.latent", kv_cache.latent, latent_shape, want_dtype),
                               ("kv_cache.index", kv_cache.index, index_shape, torch.uint8)):
        if tuple(t.shape) != shape or t.dtype != dt or t.device != device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {shape} {dt} tensor on {device}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    origin = getattr(metadata, "origin", None)
    checked = origin.num_blocks if isinstance(origin, MetadataOrigin) else None
    if checked is None:
        guard_block_table(common, num_blocks, spec.block_size)
    elif checked != num_blocks:
        raise ValueError(f"the caches have {num_blocks} pages, but the metadata's builder was made with "
                         f"num_blocks={checked}")
