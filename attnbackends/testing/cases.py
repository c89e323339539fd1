"""Random batches for testing backends: mixes of decodes, prefills and chunked prefills over random pages."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..metadata import CommonAttentionMetadata, build_common_metadata
from ..ops.quant import dequantize_from_cache, quantize_for_cache
from ..spec import AttentionSpec
from ..speculative.tree_mask import with_tree_mask

__all__ = [
    "CaseNotSupported",
    "SequenceShape",
    "RandomBatch",
    "make_random_batch",
    "random_sequence_shapes",
    "random_tree_parents",
    "EAGLE_TREE_8",
    "SEQUENCE_KINDS",
]

SEQUENCE_KINDS = ("decode", "prefill", "chunked_prefill")


class CaseNotSupported(Exception):
    """The backend declares the case's spec unsupported on this device; ``reasons`` says why."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True)
class SequenceShape:
    """One request of a batch: ``query_len`` new tokens after ``context_len`` cached ones."""

    query_len: int
    context_len: int = 0

    @property
    def seq_len(self) -> int:
        return self.query_len + self.context_len


def random_sequence_shapes(
    rng: random.Random,
    num_seqs: int,
    block_size: int,
    *,
    max_context: int = 80,
    max_query: int = 40,
    kinds: Sequence[str] = SEQUENCE_KINDS,
    decodes_first: bool = True,
) -> list[SequenceShape]:
    """Random request shapes; lengths favour the edges (1, block_size - 1, block_size, block_size + 1)."""

    def length(upper: int, lower: int = 1) -> int:
        edges = [v for v in (1, block_size - 1, block_size, block_size + 1, 2 * block_size) if lower <= v <= upper]
        if edges and rng.random() < 0.4:
            return rng.choice(edges)
        return rng.randint(lower, max(lower, upper))

    shapes = []
    for _ in range(num_seqs):
        kind = rng.choice(list(kinds))
        if kind == "decode":
            shapes.append(SequenceShape(1, length(max_context, 0) if rng.random() < 0.9 else 0))
        elif kind == "prefill":
            shapes.append(SequenceShape(length(max_query), 0))
        elif kind == "chunked_prefill":
            shapes.append(SequenceShape(length(max_query, 2), length(max_context)))
        else:
            raise ValueError(f"unknown sequence kind {kind!r}; allowed: {', '.join(SEQUENCE_KINDS)}")
    if decodes_first:
        shapes.sort(key=lambda s: s.query_len > 1)
    return shapes


#: A root and 7 draft tokens in three branches (EAGLE-like): root -> 1, 2, 3; 1 -> 4, 5; 2 -> 6; 4 -> 7.
EAGLE_TREE_8 = (-1, 0, 0, 0, 1, 1, 2, 4)


def random_tree_parents(rng: random.Random, n: int) -> list[int]:
    """A random token tree of ``n`` tokens rooted at token 0 (parents as in :mod:`attnbackends.speculative.tree_mask`)."""
    return [-1] + [rng.randrange(a) for a in range(1, n)]


@dataclass
class RandomBatch:
    """A random batch, ready to run through a backend, with what the oracle needs to check it.

    Attributes
    ----------
    query : [num_tokens, num_heads, head_size] in spec.dtype (num_tokens = actual tokens + padding)
    key, value : [num_tokens, num_kv_heads, head_size] / [..., value_head_size]: the new tokens' K and V
    kv_cache : [num_blocks, 2, block_size, num_kv_heads, head_size] in the cache dtype with every context token
        written and every other slot random (never zeros); None for layers without a cache
    common : the batch's CommonAttentionMetadata
    sinks : [num_heads] float32 or None
    dense_keys, dense_values : per request [seq_len, num_kv_heads, D] float64, exactly as a backend reads them back
        (after the cache dtype's round trip)
    tree_parents : per request, the parent array of its draft segment (its last len(parents) query tokens; see
        :mod:`attnbackends.speculative.tree_mask`) or None; ``common`` then carries the tree mask
    """

    spec: AttentionSpec
    shapes: list[SequenceShape]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: Optional[torch.Tensor]
    common: CommonAttentionMetadata
    sinks: Optional[torch.Tensor]
    k_scale: float
    v_scale: float
    dense_keys: list[torch.Tensor] = field(repr=False)
    dense_values: list[torch.Tensor] = field(repr=False)
    tree_parents: Optional[list[Optional[list[int]]]] = None

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def new_output(self, poison: float = float("nan")) -> torch.Tensor:
        """An output buffer [num_tokens, num_heads, value_head_size] filled with ``poison``."""
        shape = (self.query.shape[0], self.spec.num_heads, self.spec.value_head_size)
        return torch.full(shape, poison, dtype=self.query.dtype, device=self.query.device)


def make_random_batch(
    spec: AttentionSpec,
    shapes: Sequence[SequenceShape],
    *,
    seed: int = 0,
    device: "torch.device | str" = "cpu",
    num_blocks: Optional[int] = None,
    pad_tokens: int = 0,
    fp8_scales: Optional[tuple[float, float]] = None,
    logit_magnitude: float = 1.0,
    tree_parents: Optional[Sequence[Optional[Sequence[int]]]] = None,
    block_tables: Optional[Sequence[Sequence[int]]] = None,
) -> RandomBatch:
    """A random batch for ``spec`` with one request per entry of ``shapes`` (keep decodes first for backends that
    need that order: see :func:`attnbackends.metadata.decode_first_order`).

    Pages are drawn at random without replacement from ``num_blocks`` (default: what the batch needs plus 25%).
    fp8 caches get scales chosen so the data spans the fp8 range (or ``fp8_scales``); ``logit_magnitude`` scales
    the queries, to exercise soft-capping and large logits. ``tree_parents`` (one entry per request, None for no
    tree) turns requests into tree-verify requests (:func:`attnbackends.speculative.tree_mask.with_tree_mask`).
    ``block_tables`` (one page list per request, within ``num_blocks``) replaces the random pages: batches of
    several layers then share one block table.
    """
    if spec.is_mla:
        raise ValueError("make_random_batch builds standard-attention batches; MLA has its own generator")
    if not shapes:
        raise ValueError("shapes must hold at least one request")
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    device = torch.device(device)
    dtype, cache_dtype = spec.torch_dtype, spec.kv_cache_torch_dtype
    uses_cache = spec.attn_type.uses_kv_cache
    hq, hkv, d, dv, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.value_head_size, spec.block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    dense_k = [randn(s.seq_len, hkv, d).to(dtype) for s in shapes]
    dense_v = [randn(s.seq_len, hkv, dv).to(dtype) for s in shapes]
    if spec.is_fp8_kv_cache:
        if fp8_scales is None:
            limit = float(torch.finfo(cache_dtype).max)
            kmax = max(float(k.float().abs().max()) for k in dense_k)
            vmax = max(float(v.float().abs().max()) for v in dense_v)
            fp8_scales = (kmax / (0.5 * limit), vmax / (0.5 * limit))
        k_scale, v_scale = fp8_scales
    else:
        k_scale = v_scale = 1.0

    queries = [randn(s.query_len, hq, d) * logit_magnitude for s in shapes]
    new_k = [k[s.context_len :] for k, s in zip(dense_k, shapes)]
    new_v = [v[s.context_len :] for v, s in zip(dense_v, shapes)]

    def cat_pad(parts: list[torch.Tensor], width: int, heads: int) -> torch.Tensor:
        x = torch.cat(parts + [randn(pad_tokens, heads, width)]) if pad_tokens else torch.cat(parts)
        return x.to(dtype).to(device)

    query = cat_pad(queries, d, hq)
    key = cat_pad(new_k, d, hkv)
    value = cat_pad(new_v, dv, hkv)
    query_lens = [s.query_len for s in shapes]

    if uses_cache:
        pages_needed = [math.ceil(s.seq_len / bs) for s in shapes]
        total_pages = sum(pages_needed)
        num_blocks = num_blocks if num_blocks is not None else total_pages + max(2, total_pages // 4)
        if num_blocks < total_pages:
            raise ValueError(f"num_blocks ({num_blocks}) < the {total_pages} pages this batch needs")
        pool = rng.sample(range(num_blocks), total_pages)
        tables, at = [], 0
        for n in pages_needed:
            tables.append(pool[at : at + n])
            at += n
        if block_tables is not None:
            tables = [list(t) for t in block_tables]
            short = [i for i, (t, n) in enumerate(zip(tables, pages_needed)) if len(t) < n]
            if len(tables) != len(shapes) or short or any(not 0 <= b < num_blocks for t in tables for b in t):
                raise ValueError(f"block_tables needs one list per request, enough pages each (short: {short}) and "
                                 f"page ids in [0, {num_blocks})")
        kv_cache = quantize_for_cache(randn(num_blocks, 2, bs, hkv, d), cache_dtype, 1.0)
        for k, v, s, table in zip(dense_k, dense_v, shapes, tables):
            for pos in range(s.context_len):
                block, off = table[pos // bs], pos % bs
                kv_cache[block, 0, off] = quantize_for_cache(k[pos], cache_dtype, k_scale)
                kv_cache[block, 1, off] = quantize_for_cache(v[pos], cache_dtype, v_scale)
        kv_cache = kv_cache.to(device)
        common = build_common_metadata(
            query_lens,
            [s.context_len for s in shapes],
            tables,
            bs,
            device,
            causal=spec.causal,
            num_padded_tokens=sum(query_lens) + pad_tokens,
        )
    else:
        if any(s.context_len for s in shapes):
            raise ValueError(f"attn_type {spec.attn_type.value} has no KV cache: context_len must be 0")
        kv_cache = None
        common = build_common_metadata(
            query_lens, [0] * len(shapes), None, bs, device, causal=False,
            num_padded_tokens=sum(query_lens) + pad_tokens,
        )

    def round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
        if not uses_cache:
            return x.double()
        return dequantize_from_cache(quantize_for_cache(x, cache_dtype, scale), torch.float64, scale)

    if tree_parents is not None:
        tree_parents = [list(p) if p else None for p in tree_parents]
        common = with_tree_mask(common, tree_parents)
    sinks = (randn(hq) * 2.0).to(device) if spec.has_sinks else None
    return RandomBatch(
        spec=spec,
        shapes=list(shapes),
        query=query,
        key=key,
        value=value,
        kv_cache=kv_cache,
        common=common,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        dense_keys=[round_trip(k, k_scale) for k in dense_k],
        dense_values=[round_trip(v, v_scale) for v in dense_v],
        tree_parents=tree_parents,
    )
