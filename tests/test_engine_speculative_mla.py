"""Speculative decoding in the engine for DeepSeek-V3 (MLA): a tiny transformers DeepseekV3ForCausalLM served on
the paged engine gives the same greedy tokens with speculation (n-gram and draft-model drafters, trees of more than
one branch, verified through the MLA backend's multi-token decode path with a tree mask) as without it.

CPU: float32 on reference_mla (logits to 1e-4 too); float16 on triton_mla (interpreted) with the wide-margin
model, whose greedy choices are far from ties, so the verify kernel's rounding cannot flip them."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig  # noqa: E402
from attnbackends.engine import EngineConfig, PagedEngine  # noqa: E402
from attnbackends.engine.speculative import DraftModelDrafter, NgramDrafter, SpeculativeConfig  # noqa: E402
from examples.engine.hf_models import build_hf_model, wrap_hf_model  # noqa: E402
from examples.engine.hf_models.hf import MARGIN_SUCCESSOR_LOGIT  # noqa: E402

ENGINE = EngineConfig(block_size=8, num_blocks=128, max_num_batched_tokens=40, max_num_reqs=3)
NEW_TOKENS = 12


def prompts(fork: tuple[int, ...] = ()) -> list[list[int]]:
    """Prompts with repeats (n-gram hits). With ``fork``, the wide-margin model's greedy chain after the last token
    of the last prompt, that prompt holds ``fork[0]`` twice, once followed by the rest of the chain and once by
    other tokens: the n-gram drafter's tree after the first generated token has two branches, one of them right."""
    rng = random.Random(0)
    motif = [rng.randrange(256) for _ in range(5)]
    out = [motif * 3 + motif[:2], [rng.randrange(256) for _ in range(11)], motif + [1, 2] + motif[:3]]
    if fork:
        out.append(list(fork) + [50, fork[0], 51, 61, FORK_LAST])
    return out


FORK_LAST = 7
MARGIN = dict(successor_logit=MARGIN_SUCCESSOR_LOGIT)


def successors(token: int, n: int) -> tuple[int, ...]:
    """The wide-margin model's greedy chain of ``n`` tokens after ``token`` (its seeded successors win by far)."""
    model = build_hf_model("deepseek", seed=0, **MARGIN)
    chain = [token]
    with torch.inference_mode():
        for _ in range(n):
            chain.append(int(model(torch.tensor([chain])).logits[0, -1].argmax()))
    return tuple(chain[1:])


def hf_drafter(seed: int, **kwargs) -> DraftModelDrafter:
    """A draft model sharing the vocabulary: a float32 transformers DeepSeek-V3 (its own forward, no cache)."""
    draft = build_hf_model("deepseek", seed=seed, **kwargs)

    @torch.inference_mode()
    def next_logits(tokens: list[int]) -> torch.Tensor:
        return draft(torch.tensor([tokens])).logits[0, -1].float()

    return DraftModelDrafter(next_logits, num_branches=2, depth=3)


def generate(backend: str, dtype: torch.dtype, speculative=None, fork: tuple[int, ...] = (), device: str = "cpu",
             **model_kwargs):
    hf = build_hf_model("deepseek", seed=0, dtype=dtype, device=device, **model_kwargs)
    engine = PagedEngine(wrap_hf_model(hf), ENGINE, device=device, dtype=dtype,
                         attention_config=AttentionConfig(backend=backend), speculative=speculative)
    result = engine.generate(prompts(fork), NEW_TOKENS)
    assert engine.allocator.num_free == ENGINE.num_blocks, "pages leaked"
    assert result.backend == backend
    return result


@pytest.fixture(scope="module")
def greedy_reference():
    return generate("reference_mla", torch.float32)


@pytest.mark.parametrize("drafter_kind", ["ngram", "draft_model_other_seed", "draft_model_same_weights"])
def test_reference_mla_speculative_greedy_equals_plain_greedy(greedy_reference, drafter_kind):
    drafter = {
        "ngram": lambda: NgramDrafter(num_branches=2, depth=3),
        "draft_model_other_seed": lambda: hf_drafter(1),
        "draft_model_same_weights": lambda: hf_drafter(0),
    }[drafter_kind]()
    result = generate("reference_mla", torch.float32, SpeculativeConfig(drafter, num_speculative_tokens=6))
    assert result.tokens == greedy_reference.tokens
    for got, want in zip(result.logits, greedy_reference.logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    stats = result.speculative
    assert stats.verify_steps > 0
    if drafter_kind != "draft_model_other_seed":  # an unrelated random model's drafts are rejected: rollback only
        assert stats.accepted_tokens > 0
    if drafter_kind != "ngram":  # two top-k branches every step
        assert stats.branching_steps == stats.verify_steps
    if drafter_kind == "draft_model_same_weights":  # the target's own greedy path is always one branch
        assert stats.acceptance_length > 2.5 and result.num_steps < greedy_reference.num_steps


@pytest.mark.parametrize("backend,dtype", [("reference_mla", torch.float32), ("triton_mla", torch.float16)])
def test_speculative_greedy_equals_plain_greedy_wide_margin(backend, dtype):
    """The n-gram drafter's trees branch here (the fork prompt), and triton_mla runs in float16 (interpreted)."""
    fork = successors(FORK_LAST, 3)
    plain = generate(backend, dtype, fork=fork, **MARGIN)
    if backend != "reference_mla":
        exact = generate("reference_mla", torch.float32, fork=fork, **MARGIN)
        assert plain.tokens == exact.tokens, "the wide-margin model's tokens must not depend on the precision"
    assert tuple(plain.tokens[-1][:3]) == fork
    for drafter in (NgramDrafter(num_branches=2, depth=3), hf_drafter(0, **MARGIN)):
        result = generate(backend, dtype, SpeculativeConfig(drafter, num_speculative_tokens=6), fork=fork, **MARGIN)
        assert result.tokens == plain.tokens
        stats = result.speculative
        assert stats.verify_steps > 0 and stats.accepted_tokens > 0 and stats.branching_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_mla_speculative_greedy_equals_plain_greedy_bf16_on_gpu():
    """bf16 on the GPU (the Hopper decode kernel's verify path) with the wide-margin model: n-gram and draft-model
    trees give the plain run's tokens, which are the float32 reference's."""
    fork = successors(FORK_LAST, 3)
    plain = generate("triton_mla", torch.bfloat16, fork=fork, device="cuda", **MARGIN)
    assert plain.tokens == generate("reference_mla", torch.float32, fork=fork, **MARGIN).tokens
    for drafter in (NgramDrafter(num_branches=2, depth=3), hf_drafter(0, **MARGIN)):
        result = generate("triton_mla", torch.bfloat16, SpeculativeConfig(drafter, num_speculative_tokens=6),
                          fork=fork, device="cuda", **MARGIN)
        assert result.tokens == plain.tokens
        assert result.speculative.verify_steps > 0 and result.speculative.accepted_tokens > 0
