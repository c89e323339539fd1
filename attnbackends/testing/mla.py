"""MLA test support: random MLA batches and the float64 naive oracle (up-project every latent token, causal MHA per request, tree
masks over tree-verify requests' draft segments)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..interface import AttentionBackend
from ..metadata import CommonAttentionMetadata, build_common_metadata
from ..ops.quant import dequantize_from_cache, quantize_for_cache
from ..spec import AttentionSpec
from ..speculative.tree_mask import with_tree_mask
from .cases import SequenceShape
from .oracle import draft_visibility

__all__ = ["MLABatch", "make_random_mla_batch", "mla_oracle", "poison_unread_slots", "run_mla_backend"]


@dataclass
class MLABatch:
    """A random MLA batch.

    Attributes
    ----------
    q : [num_tokens, N, P + R]; kv_c : [num_tokens, Lkv]; k_pe : [num_tokens, R] (model dtype; padding at the end)
    kv_cache : [num_blocks, block_size, Lkv + R] in the cache dtype, context written, every other slot random
    kv_b_proj : [N * (P + V), Lkv] model dtype
    dense_latent : per request [seq_len, Lkv + R] float64 as read back from the cache (after the fp8 round trip)
    tree_parents : per request, the parent array of its draft segment (its last len(parents) query tokens) or None;
        ``common`` then carries the tree mask
    """

    spec: AttentionSpec
    shapes: list[SequenceShape]
    q: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    kv_b_proj: torch.Tensor
    common: CommonAttentionMetadata
    k_scale: float
    dense_latent: list[torch.Tensor] = field(repr=False)
    tree_parents: Optional[list[Optional[list[int]]]] = None

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def new_output(self, poison: float = float("nan")) -> torch.Tensor:
        return torch.full(
            (self.q.shape[0], self.spec.num_heads, self.spec.v_head_dim), poison, dtype=self.q.dtype, device=self.q.device
        )


def make_random_mla_batch(
    spec: AttentionSpec,
    shapes: Sequence[SequenceShape],
    *,
    seed: int = 0,
    device: "torch.device | str" = "cpu",
    pad_tokens: int = 0,
    k_scale: Optional[float] = None,
    tree_parents: Optional[Sequence[Optional[Sequence[int]]]] = None,
) -> MLABatch:
    """A random batch for an MLA spec, one request per shape (keep decodes first); ``tree_parents`` (one entry per
    request, None for no tree) makes tree-verify requests (:func:`attnbackends.speculative.tree_mask.with_tree_mask`).

    Latents are N(0, 1); kv_b_proj is N(0, 1/Lkv) so up-projected keys and values are about N(0, 1); queries are
    N(0, 1), so logits are about N(0, 1) under the 1/sqrt(P + R) scale. fp8 caches get k_scale so the latent spans
    half the fp8 range (or the given one).
    """
    if not spec.is_mla:
        raise ValueError("make_random_mla_batch needs an MLA spec")
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    device = torch.device(device)
    dtype, cache_dtype = spec.torch_dtype, spec.kv_cache_torch_dtype
    n, p, r, v, lkv, bs = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                           spec.kv_lora_rank, spec.block_size)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    dense = [randn(s.seq_len, lkv + r).to(dtype) for s in shapes]
    if spec.is_fp8_kv_cache:
        if k_scale is None:
            k_scale = max(float(x.float().abs().max()) for x in dense) / (0.5 * float(torch.finfo(cache_dtype).max))
    else:
        k_scale = 1.0
    kv_b_proj = (randn(n * (p + v), lkv) / math.sqrt(lkv)).to(dtype)
    q = torch.cat([randn(s.query_len, n, p + r) for s in shapes] + [randn(pad_tokens, n, p + r)]).to(dtype)
    new = torch.cat([x[s.context_len :] for x, s in zip(dense, shapes)] + [randn(pad_tokens, lkv + r).to(dtype)])

    pages_needed = [math.ceil(s.seq_len / bs) for s in shapes]
    total_pages = sum(pages_needed)
    num_blocks = total_pages + max(2, total_pages // 4)
    pool = rng.sample(range(num_blocks), total_pages)
    tables, at = [], 0
    for count in pages_needed:
        tables.append(pool[at : at + count])
        at += count
    kv_cache = quantize_for_cache(randn(num_blocks, bs, lkv + r), cache_dtype, 1.0)
    for x, s, table in zip(dense, shapes, tables):
        for pos in range(s.context_len):
            kv_cache[table[pos // bs], pos % bs] = quantize_for_cache(x[pos], cache_dtype, k_scale)
    query_lens = [s.query_len for s in shapes]
    common = build_common_metadata(
        query_lens, [s.context_len for s in shapes], tables, bs, device, num_padded_tokens=sum(query_lens) + pad_tokens
    )
    if tree_parents is not None:
        tree_parents = [list(p) if p else None for p in tree_parents]
        common = with_tree_mask(common, tree_parents)
    round_trip = [dequantize_from_cache(quantize_for_cache(x, cache_dtype, k_scale), torch.float64, k_scale) for x in dense]
    return MLABatch(
        spec=spec,
        shapes=list(shapes),
        q=q.to(device),
        kv_c=new[:, :lkv].contiguous().to(device),
        k_pe=new[:, lkv:].contiguous().to(device),
        kv_cache=kv_cache.to(device),
        kv_b_proj=kv_b_proj.to(device),
        common=common,
        k_scale=k_scale,
        dense_latent=round_trip,
        tree_parents=tree_parents,
    )


def mla_oracle(batch: MLABatch) -> torch.Tensor:
    """The naive answer in float64: [num_actual_tokens, N, V] on the CPU."""
    spec = batch.spec
    n, p, v, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    w = batch.kv_b_proj.double().cpu()
    q_all = batch.q.double().cpu()
    outs, start = [], 0
    trees = batch.tree_parents or [None] * len(batch.shapes)
    for shape, latent, parents in zip(batch.shapes, batch.dense_latent, trees):
        q = q_all[start : start + shape.query_len].transpose(0, 1)  # [N, Q, P + R]
        start += shape.query_len
        kv = (latent[:, :lkv] @ w.T).view(-1, n, p + v).transpose(0, 1)  # [N, L, P + V]
        k = torch.cat([kv[..., :p], latent[None, :, lkv:].expand(n, -1, -1)], dim=-1)
        s = (q @ k.transpose(1, 2)) * spec.softmax_scale  # [N, Q, L]
        pos_q = torch.arange(shape.context_len, shape.seq_len)[:, None]
        pos_k = torch.arange(shape.seq_len)[None, :]
        visible = pos_k <= pos_q
        if parents:
            visible &= draft_visibility(parents, shape.query_len, shape.seq_len)
        s = s.masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(s, dim=-1) @ kv[..., p:]).transpose(0, 1))
    return torch.cat(outs)


def poison_unread_slots(kv_cache: torch.Tensor, common: CommonAttentionMetadata) -> torch.Tensor:
    """A copy of ``kv_cache`` [num_blocks, block_size, Lkv + R] with every slot that no request of ``common`` reads
    (positions at or past its seq_len) set to all-ones bytes: NaN in 16-bit and both fp8 dtypes. A write that lands
    outside its slots changes them; compare caches bytewise (``.view(torch.uint8)``), NaN being unequal to itself."""
    num_blocks, block_size, _ = kv_cache.shape
    table = common.block_table.tolist()
    read = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for r, n in enumerate(common.seq_lens_cpu[: common.num_reqs].tolist()):
        for pos in range(n):
            read[table[r][pos // block_size] * block_size + pos % block_size] = True
    poisoned = kv_cache.clone()
    poisoned.view(torch.uint8).view(num_blocks * block_size, -1)[(~read).to(kv_cache.device)] = 0xFF
    return poisoned


def run_mla_backend(
    backend_cls: type[AttentionBackend],
    batch: MLABatch,
    *,
    builder_kwargs: Optional[dict[str, Any]] = None,
    decode_threshold: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``batch`` through an MLA backend; returns (output, kv_cache after the step)."""
    builder = backend_cls.get_builder_cls()(batch.spec, batch.q.device, **(builder_kwargs or {}))
    if decode_threshold is not None:
        builder.decode_threshold = decode_threshold
    metadata = builder.build(batch.common)
    impl = backend_cls.get_impl_cls()(batch.spec, kv_b_proj=batch.kv_b_proj, k_scale=batch.k_scale)
    impl.process_weights_after_loading()
    kv_cache = batch.kv_cache.clone()
    output = batch.new_output()
    returned = impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, metadata, output)
    if returned is not output:
        raise AssertionError("forward must return the caller's output tensor")
    return output, kv_cache
