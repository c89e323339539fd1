"""Speculative decoding inputs: query-length capabilities, the packed tree mask, and the reference backend and the
oracle on multi-token decodes and tree-verify batches."""

import random

import pytest
import torch

from attnbackends import AttentionSpec, QueryLenSupport, explain
from attnbackends.platform import DeviceInfo
from attnbackends.reference.backend import ReferenceBackend, ReferenceMetadataBuilder
from attnbackends.speculative.tree_mask import (
    chain_parents,
    check_parents,
    expand_tree_mask,
    request_tree_mask,
    tree_mask_from_parents,
    with_tree_mask,
)
from attnbackends.testing import (
    SequenceShape,
    assert_close_to_oracle,
    check_backend_case,
    conformance_cases,
    make_random_batch,
    oracle_attention,
    run_backend_on_batch,
    tolerance_for,
)
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents
from attnbackends.testing.oracle import _draft_visibility

BASE = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=8)


def test_chain_mask_is_the_causal_triangle_and_tree_rows_are_ancestors():
    mask, indptr, indptr_cpu = tree_mask_from_parents([chain_parents(5), EAGLE_TREE_8, None])
    assert indptr_cpu.tolist() == [0, 25, 89, 89] and indptr.dtype == torch.int32
    assert torch.equal(mask[:25].view(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())
    tree = mask[25:89].view(8, 8)
    assert tree[7].nonzero().flatten().tolist() == [0, 1, 4, 7]  # 7 -> 4 -> 1 -> root
    assert tree[3].nonzero().flatten().tolist() == [0, 3]
    assert tree[:, 0].all()


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 1], [-1, -2]])
def test_bad_parents_are_rejected(parents):
    with pytest.raises(ValueError, match="parent must come before"):
        check_parents(parents)


def test_with_tree_mask_checks_lengths():
    batch = make_random_batch(AttentionSpec(**BASE), [SequenceShape(3, 4)])
    with pytest.raises(ValueError, match="only 3 query tokens"):
        with_tree_mask(batch.common, [chain_parents(4)])
    with pytest.raises(ValueError, match="entries for 1 requests"):
        with_tree_mask(batch.common, [None, None])


def test_expand_tree_mask_matches_the_oracles_rule():
    shapes = [SequenceShape(8, 5), SequenceShape(1, 9), SequenceShape(6, 0), SequenceShape(4, 3)]
    trees = [list(EAGLE_TREE_8), None, None, [-1, 0, 0]]  # the last: a draft segment shorter than the query
    batch = make_random_batch(AttentionSpec(**BASE), shapes, tree_parents=trees)
    full = expand_tree_mask(batch.common)
    at = 0
    for shape, parents in zip(shapes, trees):
        q, seq = shape.query_len, shape.seq_len
        want = torch.ones(q, seq, dtype=torch.bool)
        want &= torch.arange(seq)[None, :] <= torch.arange(shape.context_len, seq)[:, None]
        if parents:
            want &= _draft_visibility(parents, q, seq)
        assert torch.equal(full[at : at + q * seq].view(q, seq), want)
        at += q * seq
    assert at == full.numel()
    assert torch.equal(expand_tree_mask(batch.common, 1, 3), full[8 * 13 : 8 * 13 + 10 + 36])


def test_oracle_tree_mask_matters_and_a_chain_is_causal():
    spec = AttentionSpec(**BASE)
    shapes = [SequenceShape(8, 13), SequenceShape(8, 2)]
    causal = oracle_attention(make_random_batch(spec, shapes, seed=3))
    chain = oracle_attention(make_random_batch(spec, shapes, seed=3, tree_parents=[chain_parents(8)] * 2))
    tree = oracle_attention(make_random_batch(spec, shapes, seed=3, tree_parents=[list(EAGLE_TREE_8)] * 2))
    assert torch.equal(causal, chain)
    # token 0 (root) and the root's children see the same keys under either mask; token 2 does not (it skips 1)
    assert torch.equal(causal[0], tree[0]) and torch.equal(causal[1], tree[1])
    assert not torch.allclose(causal[2], tree[2])


def test_oracle_tree_equals_each_path_attended_alone():
    """A tree token's output equals a plain causal request made of its path (context + ancestors + itself)."""
    spec = AttentionSpec(**BASE)
    batch = make_random_batch(spec, [SequenceShape(8, 11)], seed=5, tree_parents=[list(EAGLE_TREE_8)])
    out = oracle_attention(batch)
    for a in (5, 6, 7):
        path, node = [], a
        while node >= 0:
            path.append(node)
            node = EAGLE_TREE_8[node]
        path.reverse()
        keys = torch.cat([batch.dense_keys[0][:11], batch.dense_keys[0][11:][path]])
        vals = torch.cat([batch.dense_values[0][:11], batch.dense_values[0][11:][path]])
        q = batch.query[a].double()  # [Hq, D]
        k = keys.repeat_interleave(2, dim=1)  # [L, Hq, D]
        v = vals.repeat_interleave(2, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * spec.softmax_scale, dim=-1)
        assert torch.allclose(out[a], torch.einsum("hl,lhd->hd", p, v), atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_reference_on_random_trees(seed):
    rng = random.Random(seed)
    spec = AttentionSpec(**BASE, sliding_window=rng.choice([None, 5, 30]), logits_soft_cap=rng.choice([None, 4.0]),
                         has_sinks=rng.random() < 0.5, num_speculative_tokens=15, speculative_tree=True)
    shapes, trees = [], []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 16)
        shapes.append(SequenceShape(n, rng.randint(0, 40)))
        trees.append(random_tree_parents(rng, n) if rng.random() < 0.8 else None)
    shapes.append(SequenceShape(20, 7))
    trees.append(None)
    batch = make_random_batch(spec, shapes, seed=seed, tree_parents=trees)
    output, _ = run_backend_on_batch(ReferenceBackend, batch)
    assert_close_to_oracle(output[: batch.num_actual_tokens], oracle_attention(batch), tolerance_for(torch.float32))


@pytest.mark.parametrize("case", [c for c in conformance_cases("float32", 32, 8)
                                  if "tree" in c.name or "multi_token" in c.name], ids=str)
def test_reference_speculative_conformance(case):
    check_backend_case(ReferenceBackend, case)


def test_builder_raises_the_decode_threshold_to_the_speculative_depth():
    spec = AttentionSpec(**BASE, num_speculative_tokens=3)
    builder = ReferenceMetadataBuilder(spec)
    assert builder.reorder_batch_threshold == 4
    assert ReferenceMetadataBuilder.reorder_batch_threshold == 1
    assert ReferenceMetadataBuilder.query_len_support is QueryLenSupport.VARLEN


def test_registry_explains_a_backend_that_cannot_serve_the_depth():
    spec = AttentionSpec(**{**BASE, "dtype": "float16"}, num_speculative_tokens=70, speculative_tree=True)
    table = {row[0]: row for row in explain(spec, DeviceInfo.cuda(9, 0)).as_table()}
    assert "num_speculative_tokens 70 needs decodes of 71 tokens" in table["triton"][2]  # its decodes: up to 64
    assert "tree verification is not supported" in table["flashinfer_mla"][2]  # MLA (rejected anyway) without trees
    assert "num_speculative_tokens" not in table["reference"][2]


def test_a_builder_refuses_a_depth_it_does_not_declare():
    from attnbackends.interface import AttentionMetadataBuilder

    class SingleOnly(AttentionMetadataBuilder):
        def build(self, common):
            return common

    with pytest.raises(NotImplementedError, match="num_speculative_tokens 2 needs decodes of 3 tokens"):
        SingleOnly(AttentionSpec(**BASE, num_speculative_tokens=2))


def test_request_tree_mask_views():
    batch = make_random_batch(AttentionSpec(**BASE), [SequenceShape(8, 1), SequenceShape(2, 3)],
                              tree_parents=[list(EAGLE_TREE_8), None])
    assert request_tree_mask(batch.common, 0).shape == (8, 8)
    assert request_tree_mask(batch.common, 1) is None
