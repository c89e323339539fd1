"""Test support for sparse MLA backends (here, not in attnbackends.testing: it uses the reference backend's
functions, which only backend families and tests may import): random batches with their caches, one forward through a backend, and the
float64 oracle (:mod:`attnbackends.reference.sparse_mla`'s functions over the batch's own values)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from attnbackends.interface import AttentionBackend
from attnbackends.metadata import CommonAttentionMetadata, build_common_metadata
from attnbackends.ops.sparse_mla_cache import (
    SparseMLACache, allocate_sparse_mla_cache, dequantize_blockwise_fp8, quantize_blockwise_fp8, write_index_keys,
    write_sparse_latent,
)
from attnbackends.reference.sparse_mla import indexer_scores, sparse_mla_attention, topk_positions
from attnbackends.spec import SPARSE_QUANT_BLOCK, AttentionSpec
from attnbackends.testing.cases import SequenceShape

__all__ = ["SparseMLABatch", "make_random_sparse_mla_batch", "run_sparse_mla_backend", "sparse_mla_oracle",
           "assert_valid_selection"]


@dataclass
class SparseMLABatch:
    """One step of a sparse MLA layer: the step's inputs (rows past ``num_actual_tokens`` are padding), the caches
    holding every request's context, and each request's whole sequence (``latent`` [L, Lkv + R] and ``index_k``
    [L, D] in the model dtype) for the oracle."""

    spec: AttentionSpec
    shapes: list[SequenceShape]
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    index_weights: torch.Tensor
    cache: SparseMLACache
    kv_b_proj: torch.Tensor
    common: CommonAttentionMetadata
    latent: list[torch.Tensor] = field(repr=False)
    keys: list[torch.Tensor] = field(repr=False)

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def new_output(self, poison: float = float("nan")) -> torch.Tensor:
        spec = self.spec
        return torch.full((self.q.shape[0], spec.num_heads, spec.v_head_dim), poison, dtype=spec.torch_dtype,
                          device=self.q.device)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The indexer's keyword arguments of ``forward``."""
        return dict(index_q=self.index_q, index_k=self.index_k, index_weights=self.index_weights)


def make_random_sparse_mla_batch(spec: AttentionSpec, shapes: Sequence[SequenceShape], *, seed: int = 0,
                                 device: "torch.device | str" = "cpu", pad_tokens: int = 0,
                                 repeated_keys: Optional[Sequence[Optional[Sequence[int]]]] = None,
                                 num_blocks: Optional[int] = None) -> SparseMLABatch:
    """A random batch, one request per shape (decodes first). Latents, queries and index inputs are N(0, 1),
    kv_b_proj N(0, 1/Lkv), index weights N(0, 1/H). ``repeated_keys``: per request, positions whose index key is
    a copy of the request's position 0 key (their scores tie exactly). Pages are drawn at random."""
    if not spec.is_sparse_mla:
        raise ValueError("make_random_sparse_mla_batch needs a sparse MLA spec")
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    dtype, sparse = spec.torch_dtype, spec.sparse_indexer
    n, p, r, v, lkv, bs = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                           spec.kv_lora_rank, spec.block_size)
    h, d = sparse.num_index_heads, sparse.index_head_dim

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)

    latent = [randn(s.seq_len, lkv + r) for s in shapes]
    keys = [randn(s.seq_len, d) for s in shapes]
    for i, rep in enumerate(repeated_keys or []):
        for pos in rep or []:
            keys[i][pos] = keys[i][0]
    total_q = sum(s.query_len for s in shapes)
    rows = total_q + pad_tokens
    q = randn(rows, n, p + r)
    index_q = randn(rows, h, d)
    index_weights = randn(rows, h, scale=h ** -0.5).float()
    new_latent = torch.cat([x[s.context_len:] for x, s in zip(latent, shapes)] + [randn(pad_tokens, lkv + r)])
    new_keys = torch.cat([x[s.context_len:] for x, s in zip(keys, shapes)] + [randn(pad_tokens, d)])
    kv_b_proj = randn(n * (p + v), lkv, scale=1 / math.sqrt(lkv))

    pages_needed = [math.ceil(s.seq_len / bs) for s in shapes]
    total_pages = sum(pages_needed)
    num_blocks = num_blocks or total_pages + max(2, total_pages // 4)
    pool = rng.sample(range(num_blocks), total_pages)
    tables, at = [], 0
    for count in pages_needed:
        tables.append(pool[at: at + count])
        at += count
    cache = allocate_sparse_mla_cache(num_blocks, spec, "cpu")
    cache.latent.view(torch.uint8).fill_(0xFF)  # NaN in every float format: a read of an unwritten slot shows
    cache.index.fill_(0xFF)
    for x, k, s, table in zip(latent, keys, shapes, tables):
        if s.context_len:
            pos = torch.arange(s.context_len)
            slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
            write_sparse_latent(x[: s.context_len, :lkv], x[: s.context_len, lkv:], cache.latent, slots, spec,
                                impl="torch")
            write_index_keys(k[: s.context_len], cache.index, slots, spec, impl="torch")
    common = build_common_metadata([s.query_len for s in shapes], [s.context_len for s in shapes], tables, bs,
                                   device, num_padded_tokens=rows)
    to = dict(device=device)
    return SparseMLABatch(
        spec=spec, shapes=list(shapes), q=q.to(**to), kv_c=new_latent[:, :lkv].contiguous().to(**to),
        k_pe=new_latent[:, lkv:].contiguous().to(**to), index_q=index_q.to(**to),
        index_k=new_keys.contiguous().to(**to), index_weights=index_weights.to(**to),
        cache=SparseMLACache(cache.latent.to(**to), cache.index.to(**to)), kv_b_proj=kv_b_proj.to(**to),
        common=common, latent=latent, keys=keys,
    )


def _stored_latent(batch: SparseMLABatch, x: torch.Tensor) -> torch.Tensor:
    """A request's latent [L, Lkv + R] as the cache reads it back, float64."""
    spec = batch.spec
    if spec.sparse_indexer.latent_format != "fp8_ds_mla":
        return x.double()
    lkv = spec.kv_lora_rank
    q8, s = quantize_blockwise_fp8(x[:, :lkv], SPARSE_QUANT_BLOCK)
    return torch.cat([dequantize_blockwise_fp8(q8, s, torch.float64), x[:, lkv:].bfloat16().double()], dim=-1)


def sparse_mla_oracle(batch: SparseMLABatch, topk: Optional[int] = None, device: "torch.device | str" = "cpu"
                      ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The float64 answer, computed on ``device``: (output [num_actual_tokens, N, V], per request the scores [Q, L]
    (-inf where invisible) and the selected positions [Q, topk])."""
    spec = batch.spec
    sparse = spec.sparse_indexer
    topk = topk or sparse.topk
    n, p, v, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    w = batch.kv_b_proj.double().to(device).view(n, p + v, lkv)
    w_uk_t, w_uv = w[:, :p], w[:, p:].transpose(1, 2)
    outs, all_scores, all_positions, start = [], [], [], 0
    for s, x, k in zip(batch.shapes, batch.latent, batch.keys):
        rows = slice(start, start + s.query_len)
        start += s.query_len
        q8, ks = quantize_blockwise_fp8(k.to(device), sparse.quant_block)
        keys = dequantize_blockwise_fp8(q8, ks, torch.float64)
        scores = indexer_scores(batch.index_q[rows].to(device), batch.index_weights[rows].to(device), keys, sparse)
        qpos = torch.arange(s.context_len, s.seq_len, device=device)
        positions = topk_positions(scores, qpos, topk)
        visible = torch.arange(s.seq_len, device=device)[None, :] <= qpos[:, None]
        all_scores.append(scores.masked_fill(~visible, float("-inf")))
        all_positions.append(positions)
        outs.append(sparse_mla_attention(batch.q[rows].to(device), _stored_latent(batch, x.to(device)), positions,
                                         w_uk_t, w_uv, spec.softmax_scale))
    return torch.cat(outs), all_scores, all_positions


def assert_valid_selection(chosen: torch.Tensor, scores: torch.Tensor, topk: int, atol: float) -> None:
    """``chosen`` [Q, topk] positions (-1 padding, any order) is a top-k of ``scores`` [Q, L] (-inf: invisible) up
    to ``atol``: every visible token counted, none twice, and no unchosen visible token scores more than
    ``atol`` above a chosen one."""
    for t in range(scores.shape[0]):
        row = scores[t]
        visible = torch.isfinite(row)
        got = chosen[t][chosen[t] >= 0].cpu()
        want = min(topk, int(visible.sum()))
        assert got.numel() == want, f"query {t}: {got.numel()} tokens chosen, expected {want}"
        assert got.unique().numel() == got.numel(), f"query {t}: a token chosen twice: {got.tolist()}"
        assert bool(visible[got].all()), f"query {t}: an invisible (future) token chosen: {got.tolist()}"
        rest = visible.clone()
        rest[got] = False
        if got.numel() and bool(rest.any()):
            worst_chosen, best_left = float(row[got].min()), float(row[rest].max())
            assert best_left <= worst_chosen + atol, (
                f"query {t}: token {int(torch.nonzero(rest & (row == best_left))[0])} (score {best_left}) left out "
                f"for one scoring {worst_chosen}")


def run_sparse_mla_backend(backend_cls: type[AttentionBackend], batch: SparseMLABatch, *,
                           builder_kwargs: Optional[dict[str, Any]] = None
                           ) -> tuple[torch.Tensor, SparseMLACache, Any]:
    """One forward of ``batch`` through a sparse MLA backend: (output, the caches after the step, the metadata)."""
    builder = backend_cls.get_builder_cls()(batch.spec, batch.q.device, **(builder_kwargs or {}))
    metadata = builder.build(batch.common)
    impl = backend_cls.get_impl_cls()(batch.spec, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    cache = SparseMLACache(batch.cache.latent.clone(), batch.cache.index.clone())
    output = batch.new_output()
    returned = impl.forward(batch.q, batch.kv_c, batch.k_pe, cache, metadata, output, **batch.inputs())
    if returned is not output:
        raise AssertionError("forward must return the caller's output tensor")
    return output, cache, metadata
