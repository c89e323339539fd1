"""triton_mla_sparse on the CPU (interpreted, tiny dims) against the float64 oracle: the index-key and latent writes,
the indexer's selection (a valid top-k of the oracle's scores; exact ties go to the lower position), the attention
over the selection, mixed batches, chunked prefill in several indexer groups, and padding left untouched."""

import os

import pytest
import torch

from attnbackends.mla.sparse.backend import TritonSparseMLABackend, TritonSparseMLAMetadataBuilder
from attnbackends.ops.sparse_mla_cache import (
    allocate_sparse_mla_cache, read_index_keys, write_index_keys, write_sparse_latent,
)
from attnbackends.testing import SequenceShape as S
from tests.mla.sparse_mla_support import (
    assert_valid_selection, make_random_sparse_mla_batch, run_sparse_mla_backend, sparse_mla_oracle,
)
from tests.mla.test_sparse_mla_reference import MIXED, tiny_sparse_spec

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


def positions_of(slots, batch):
    """Cache slots [T, K] -> per token the sorted positions they hold (-1 dropped)."""
    bs = batch.spec.block_size
    out, t = [], 0
    for r, s in enumerate(batch.shapes):
        pages = batch.common.block_table[r].tolist()
        where = {pages[i // bs] * bs + i % bs: i for i in range(s.seq_len)}
        for _ in range(s.query_len):
            out.append(sorted(where[x] for x in slots[t].tolist() if x >= 0))
            t += 1
    return out


@pytest.mark.parametrize("latent_format,kv_lora_rank", [("auto", 64), ("fp8_ds_mla", 128)])
def test_cache_writes_match_the_torch_layout(latent_format, kv_lora_rank):
    spec = tiny_sparse_spec(latent_format=latent_format, kv_lora_rank=kv_lora_rank)
    gen = torch.Generator().manual_seed(0)
    caches = [allocate_sparse_mla_cache(5, spec, "cpu") for _ in range(2)]
    for c in caches:
        c.latent.view(torch.uint8).fill_(0x5A)
        c.index.fill_(0x5A)
    slots = torch.tensor([0, 3, 7, -1, 12, 19])
    k = torch.randn(6, 32, generator=gen).bfloat16()
    kv = torch.randn(6, kv_lora_rank, generator=gen).bfloat16()
    pe = torch.randn(6, 16, generator=gen).bfloat16()
    for c, impl in zip(caches, ("torch", "triton")):
        write_index_keys(k, c.index, slots, spec, impl=impl)
        write_sparse_latent(kv, pe, c.latent, slots, spec, impl=impl)
    assert torch.equal(caches[0].index, caches[1].index)
    assert torch.equal(caches[0].latent.view(torch.uint8), caches[1].latent.view(torch.uint8))
    got = read_index_keys(caches[1].index, slots[slots >= 0], spec)
    torch.testing.assert_close(got, k[slots >= 0].float(), rtol=2 ** -4, atol=1e-3)


@pytest.mark.parametrize("latent_format,kv_lora_rank,topk", [("auto", 64, 6), ("auto", 64, 3), ("fp8_ds_mla", 128, 5)])
def test_triton_sparse_matches_oracle(latent_format, kv_lora_rank, topk):
    spec = tiny_sparse_spec(topk=topk, latent_format=latent_format, kv_lora_rank=kv_lora_rank)
    batch = make_random_sparse_mla_batch(spec, MIXED, seed=topk, pad_tokens=2)
    out, cache, meta = run_sparse_mla_backend(TritonSparseMLABackend, batch)
    want, scores, _ = sparse_mla_oracle(batch)
    n = batch.num_actual_tokens
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    chosen = positions_of(meta.slots, batch)
    t = 0
    for s in scores:
        for row in s:
            pos = torch.tensor(chosen[t] + [-1] * (topk - len(chosen[t])))
            assert_valid_selection(pos[None], row[None], topk, atol=1e-4)
            t += 1
    # the attention over the kernel's own selection (near-ties may pick another valid top-k)
    tol = 3e-2 if latent_format == "fp8_ds_mla" else 2e-2
    torch.testing.assert_close(out[:n].double(), want, atol=tol, rtol=tol)


def test_exact_ties_go_to_the_lower_position():
    """Copies of one index key score exactly alike in the kernel and the oracle: the top-k must take the lowest
    positions among them, also where the tie straddles the top-k boundary."""
    spec = tiny_sparse_spec(topk=4)
    shapes = [S(1, 20), S(3, 14)]
    # request 0: position 0's key copied to 5 more positions; the query that sees them all
    batch = make_random_sparse_mla_batch(spec, shapes, seed=5, repeated_keys=[[3, 6, 9, 12, 18], [2, 5, 8, 11, 15]])
    # make the copied key the best one by far: its weight-scaled dot products dominate
    for i, s in enumerate(shapes):
        batch.keys[i][:] = batch.keys[i] * 0.01
        batch.keys[i][[0] + ([3, 6, 9, 12, 18] if i == 0 else [2, 5, 8, 11, 15])] = batch.keys[i][0] * 100
    batch = _rewrite_keys(batch)
    _, _, meta = run_sparse_mla_backend(TritonSparseMLABackend, batch)
    _, scores, positions = sparse_mla_oracle(batch)
    chosen = positions_of(meta.slots, batch)
    oracle = [sorted(p for p in row.tolist() if p >= 0) for ps in positions for row in ps]
    assert chosen == oracle
    t = 0
    for s, ps in zip(scores, positions):
        for row, pos in zip(s, ps):
            top = row[pos[0]]
            tied = torch.nonzero(row == top).flatten().tolist()
            if len(tied) > 4:  # the tie straddles the boundary: the four lowest positions win
                assert chosen[t] == tied[:4], (chosen[t], tied)
            t += 1
    assert any(len(torch.nonzero(r == r.max())) > 4 for s in scores for r in s), "the case must have a wide tie"


def _rewrite_keys(batch):
    """The batch's caches rewritten from its (edited) per-request index keys and its new-token keys."""
    spec, bs = batch.spec, batch.spec.block_size
    new = []
    for r, (s, k) in enumerate(zip(batch.shapes, batch.keys)):
        pages = torch.tensor(batch.common.block_table[r].tolist()[: -(-s.seq_len // bs)])
        pos = torch.arange(s.context_len)
        write_index_keys(k[: s.context_len], batch.cache.index, pages[pos // bs] * bs + pos % bs, spec, impl="torch")
        new.append(k[s.context_len:])
    pad = batch.index_k[sum(s.query_len for s in batch.shapes):]
    batch.index_k = torch.cat(new + [pad]).contiguous()
    return batch


def test_chunked_prefill_in_several_indexer_groups():
    spec = tiny_sparse_spec(topk=5)
    shapes = [S(1, 11), S(1, 3), S(7, 18), S(6, 0)]
    batch = make_random_sparse_mla_batch(spec, shapes, seed=9, pad_tokens=1)
    kw = dict(indexer_workspace_bytes=8 * 25 * 3)  # 3 tokens per group
    meta = TritonSparseMLAMetadataBuilder(spec, "cpu", **kw).build(batch.common)
    assert len(meta.groups) == 5 and meta.num_decode_tokens == 2
    out, _, meta = run_sparse_mla_backend(TritonSparseMLABackend, batch, builder_kwargs=kw)
    want, scores, _ = sparse_mla_oracle(batch)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), want, atol=2e-2, rtol=2e-2)


def test_topk_covering_the_context_equals_dense_selection():
    spec = tiny_sparse_spec(topk=40)
    batch = make_random_sparse_mla_batch(spec, MIXED, seed=2)
    _, _, meta = run_sparse_mla_backend(TritonSparseMLABackend, batch)
    chosen = positions_of(meta.slots, batch)
    t = 0
    for s in batch.shapes:
        for i in range(s.query_len):
            assert chosen[t] == list(range(s.context_len + i + 1))
            t += 1


def test_bad_inputs_are_named():
    spec = tiny_sparse_spec()
    batch = make_random_sparse_mla_batch(spec, [S(1, 4)], seed=1)
    builder = TritonSparseMLABackend.get_builder_cls()(spec, "cpu")
    meta = builder.build(batch.common)
    impl = TritonSparseMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
    with pytest.raises(ValueError, match="index_q"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta, batch.new_output(),
                     index_k=batch.index_k, index_weights=batch.index_weights)
    with pytest.raises(ValueError, match="SparseMLACache"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.cache.latent, meta, batch.new_output(), **batch.inputs())
    with pytest.raises(ValueError, match="index_weights"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta, batch.new_output(), index_q=batch.index_q,
                     index_k=batch.index_k, index_weights=batch.index_weights[:, :2])
    with pytest.raises(ValueError, match="sparse MLA spec"):
        TritonSparseMLAMetadataBuilder(spec.model_copy(update={"sparse_indexer": None}), "cpu")
