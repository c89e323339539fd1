"""Speculative decoding on the Triton backend against the float64 oracle (interpreted on the CPU at tiny shapes):
multi-token decodes on the decode path (one program per request and KV head holds all its query tokens) and tree
verification (only the tiles over the draft segment masked), plus the engine's speculative path."""

import random

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.testing import (
    SequenceShape,
    check_backend_case,
    check_backend_on_batch,
    conformance_cases,
    make_random_batch,
)
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadataBuilder

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [c for c in conformance_cases("float16", 32, 16) + conformance_cases("bfloat16", 64, 32)
         if "tree" in c.name or "multi_token" in c.name]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_speculative_conformance(case):
    check_backend_case(TritonAttentionBackend, case, device=DEVICE)


@pytest.mark.parametrize("heads", [(2, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("depth", [1, 3, 7])
def test_uniform_multi_token_decode_runs_on_the_decode_path(heads, depth):
    spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=32, dtype="float16", block_size=16,
                         num_speculative_tokens=depth)
    shapes = [SequenceShape(1 + depth, c) for c in (0, 15, 16, 47)]
    batch = make_random_batch(spec, shapes, seed=depth, device=DEVICE)
    plan = TritonMetadataBuilder(spec, DEVICE).build(batch.common).plan
    assert plan.num_decodes == len(shapes) and plan.grid[0] == len(shapes)  # one program per request (x KV heads)
    check_backend_on_batch(TritonAttentionBackend, batch)


def test_tree_verify_random_trees_with_a_prefill_behind():
    rng = random.Random(3)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16,
                         num_speculative_tokens=11, speculative_tree=True, sliding_window=40)
    shapes = [SequenceShape(12, rng.randint(0, 70)) for _ in range(3)] + [SequenceShape(30, 20)]
    trees = [random_tree_parents(rng, 12), list(EAGLE_TREE_8) + [4, 7, 0, 8], None, None]
    check_backend_on_batch(TritonAttentionBackend, make_random_batch(spec, shapes, seed=4, device=DEVICE,
                                                                     tree_parents=trees))


def test_deep_verify_falls_back_to_the_generic_path():
    spec = AttentionSpec(num_heads=8, num_kv_heads=1, head_size=32, dtype="float16", block_size=16,
                         num_speculative_tokens=31, speculative_tree=True)
    rng = random.Random(0)
    batch = make_random_batch(spec, [SequenceShape(32, 5), SequenceShape(20, 40)], device=DEVICE,
                              tree_parents=[random_tree_parents(rng, 32), random_tree_parents(rng, 20)])
    assert TritonMetadataBuilder(spec, DEVICE).build(batch.common).plan.num_decodes == 0  # 32 x 8 rows
    check_backend_on_batch(TritonAttentionBackend, batch)


def test_engine_speculative_greedy_equals_plain_greedy_triton():
    from attnbackends import AttentionConfig
    from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig
    from attnbackends.engine.speculative import DraftModelDrafter, NgramDrafter, SpeculativeConfig

    cfg = TinyLlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=32,
                          intermediate_size=128)
    engine_cfg = EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=48, max_num_reqs=3)
    rng = random.Random(1)
    motif = [rng.randrange(64) for _ in range(4)]
    prompts = [motif * 3 + motif[:2], [rng.randrange(64) for _ in range(9)], [5, 6, 7]]
    dtype = torch.float16

    def run(speculative=None):
        engine = PagedEngine(TinyLlama(cfg, seed=0), engine_cfg, device=DEVICE, dtype=dtype,
                             attention_config=AttentionConfig(backend="triton"), speculative=speculative)
        return engine.generate(prompts, 12)

    plain = run()
    for drafter in (NgramDrafter(num_branches=2, depth=3),
                    DraftModelDrafter.from_model(TinyLlama(cfg, seed=0).float(), DEVICE, num_branches=2, depth=3)):
        result = run(SpeculativeConfig(drafter, num_speculative_tokens=6))
        assert result.tokens == plain.tokens
        assert result.speculative.verify_steps > 0 and result.speculative.accepted_tokens > 0
        if isinstance(drafter, DraftModelDrafter):  # two top-k branches every step
            assert result.speculative.branching_steps == result.speculative.verify_steps
