"""Speculative decoding in the compact engine: greedy tokens with speculation equal greedy tokens without it
(float32 on the CPU), for an n-gram drafter and a draft model, both proposing trees of more than one branch."""

import random

import pytest
import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig
from attnbackends.engine.speculative import (
    DraftModelDrafter,
    DraftTree,
    NgramDrafter,
    SpeculativeConfig,
    accept_greedy,
)

CFG = TinyLlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16,
                      intermediate_size=128)
ENGINE = EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=48, max_num_reqs=4)
NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    motif = [rng.randrange(CFG.vocab_size) for _ in range(5)]
    out = [motif * 3 + [rng.randrange(CFG.vocab_size) for _ in range(3)] + motif[:2]]  # repeats: n-gram hits
    out += [[rng.randrange(CFG.vocab_size) for _ in range(n)] for n in (3, 11, 17, 6)]
    return out


def run(backend: str, speculative=None):
    engine = PagedEngine(TinyLlama(CFG, seed=0), ENGINE, attention_config=AttentionConfig(backend=backend),
                         speculative=speculative)
    result = engine.generate(prompts(), NEW_TOKENS)
    assert engine.allocator.num_free == ENGINE.num_blocks, "pages leaked"
    return result


@pytest.fixture(scope="module")
def greedy():
    return run("reference")


def test_accept_greedy_walks_the_longest_agreeing_path():
    tree = DraftTree()
    tree.add_path([5, 6, 7], limit=8)
    tree.add_path([5, 9], limit=8)
    tree.add_path([8], limit=8)
    assert tree.tokens == [5, 6, 7, 9, 8] and tree.parents == [-1, 0, 1, 0, -1]
    assert tree.segment_parents() == [-1, 0, 1, 2, 1, 0] and tree.num_branches == 2
    # target after root: 5 (accept 0), after 5: 9 (accept 3), after 9: 4 (bonus)
    assert accept_greedy(tree, [5, 9, 0, 0, 4, 0]) == ([0, 3], 4)
    assert accept_greedy(tree, [1, 0, 0, 0, 0, 0]) == ([], 1)
    assert accept_greedy(tree, [5, 6, 7, 3, 0, 0]) == ([0, 1, 2], 3)


def test_ngram_drafter_proposes_branches_from_earlier_occurrences():
    tree = NgramDrafter(max_ngram=2, num_branches=2, depth=3).propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 8)
    assert tree.tokens == [5, 6, 1, 3, 4, 1] and tree.parents == [-1, 0, 1, -1, 3, 4]
    assert len(NgramDrafter().propose([1, 2, 3], 4)) == 0
    assert len(NgramDrafter(depth=5).propose([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3)) == 3


@pytest.mark.parametrize("drafter_kind", ["ngram", "draft_model_other_seed", "draft_model_same_weights"])
def test_speculative_greedy_equals_plain_greedy_reference(greedy, drafter_kind):
    if drafter_kind == "ngram":
        drafter = NgramDrafter(num_branches=2, depth=3)
    else:
        seed = 0 if drafter_kind == "draft_model_same_weights" else 1
        drafter = DraftModelDrafter.from_model(TinyLlama(CFG, seed=seed).float(), num_branches=2, depth=3)
    result = run("reference", SpeculativeConfig(drafter, num_speculative_tokens=6))
    assert result.tokens == greedy.tokens
    for got, want in zip(result.logits, greedy.logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stats = result.speculative
    assert stats.verify_steps > 0 and stats.branching_steps > 0
    print(f"{drafter_kind}: acceptance length {stats.acceptance_length:.2f} over {stats.verify_steps} verify steps, "
          f"{stats.accepted_tokens}/{stats.draft_tokens} drafts accepted; steps {result.num_steps} vs {greedy.num_steps}")
    if drafter_kind == "draft_model_same_weights":
        assert stats.acceptance_length > 2.5  # the target's own greedy branch is always in the tree
        assert result.num_steps < greedy.num_steps
    if drafter_kind == "ngram":
        assert stats.accepted_tokens > 0


def test_speculation_needs_a_backend_that_declares_it():
    from attnbackends import BackendNotSupportedError
    from attnbackends.selection.registry import register_backend, unregister_backend
    from attnbackends.reference.backend import ReferenceBackend, ReferenceMetadataBuilder
    from attnbackends.interface import QueryLenSupport

    class SingleBuilder(ReferenceMetadataBuilder):
        query_len_support = QueryLenSupport.SINGLE
        max_decode_query_len = 1
        supports_tree_mask = False

    @register_backend("single_token_only")
    class SingleOnly(ReferenceBackend):
        name = "single_token_only"

        @classmethod
        def get_builder_cls(cls):
            return SingleBuilder

    try:
        with pytest.raises(BackendNotSupportedError, match="num_speculative_tokens 4 needs decodes of 5 tokens"):
            PagedEngine(TinyLlama(CFG), ENGINE, attention_config=AttentionConfig(backend="single_token_only"),
                        speculative=SpeculativeConfig(NgramDrafter(), num_speculative_tokens=4))
    finally:
        unregister_backend("single_token_only")
