"""transformers' Gemma 3 (interleaved sliding/global layers, per-kind RoPE bases) and gpt-oss (sinks, alternating
window, MoE) with random weights, served on the grouped engine with per-group backends and compared with
transformers' own greedy generate (float32, token for token and logits) and forward (float16 engine with
interpreted Triton sliding groups, logits)."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from hybrid_hf_models import (  # noqa: E402
    HFGemma3Model,
    HFGptOssModel,
    tiny_gemma3,
    tiny_gpt_oss,
    transformers_greedy,
)

from attnbackends import AttentionSpec, LayerGroupsConfig  # noqa: E402
from attnbackends.engine import EngineConfig, GroupedPagedEngine  # noqa: E402

MODELS = {"gemma3": (tiny_gemma3, HFGemma3Model), "gpt_oss": (tiny_gpt_oss, HFGptOssModel)}
# Prompts past the window (8) and several pages (4 tokens) long, so sliding groups drop and free pages; chunked by
# the step budget of 16 tokens.
PROMPTS = [list(range(1, 30)), [5, 6, 7], [9] * 11 + [3, 1]]
ENGINE = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_reqs=2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_float32_generate_token_for_token(kind):
    build, wrap = MODELS[kind]
    hf = build(seed=1)
    want_tokens, want_logits = transformers_greedy(hf, PROMPTS, 8)
    engine = GroupedPagedEngine(wrap(hf), ENGINE)
    assert {g.name for g in engine.groups.groups} == {"sliding_8", "full"}
    if kind == "gpt_oss":
        assert all(g.spec.has_sinks for g in engine.groups.groups)
    got = engine.generate(PROMPTS, 8)
    assert got.tokens == want_tokens
    for ours, theirs in zip(got.logits, want_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert all(p.num_free == p.num_blocks for p in engine.pools)


@pytest.mark.parametrize("kind", list(MODELS))
def test_wrong_window_is_caught(kind):
    """The comparison can fail: the same model served with every layer global differs from transformers."""
    build, wrap = MODELS[kind]

    class AllGlobal(wrap):
        def layer_specs(self, dtype, block_size):
            return [AttentionSpec(**{**s.model_dump(), "sliding_window": None})
                    for s in super().layer_specs(dtype, block_size)]

    hf = build(seed=1)
    _, want_logits = transformers_greedy(hf, PROMPTS[:1], 4)
    got = GroupedPagedEngine(AllGlobal(hf), ENGINE).generate(PROMPTS[:1], 4)
    assert not torch.allclose(got.logits[0][0], want_logits[0][0], atol=1e-2)


@pytest.mark.parametrize("kind", list(MODELS))
def test_float16_triton_sliding_groups_against_transformers_forward(kind):
    """Sliding groups on interpreted Triton, global groups on the reference backend, the model in float16; every
    step's logits against transformers' float32 forward over the engine's own tokens."""
    build, wrap = MODELS[kind]
    reference = build(seed=2, head_dim=64)  # a head size every GPU backend serves (FlashInfer: 64, 128, 256)
    engine = GroupedPagedEngine(
        wrap(build(seed=2, head_dim=64)), EngineConfig(block_size=16, num_blocks=16, max_num_batched_tokens=48, max_num_reqs=2),
        dtype=torch.float16, attention_config=LayerGroupsConfig(groups={"sliding_8": "triton", "full": "reference"}),
    )
    prompts = [list(range(1, 31)), [4, 2]]
    got = engine.generate(prompts, 3)
    assert got.backend == "sliding_8=triton,full=reference"
    with torch.inference_mode():
        for prompt, tokens, logits in zip(prompts, got.tokens, got.logits):
            for i in range(len(tokens)):
                want = reference(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
                torch.testing.assert_close(logits[i], want, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# 16-bit rounding moves these logits by up to 0.05 (float16) and 0.4 (bfloat16, gpt-oss) with the reference backend;
# a wrong window moves them by more than 10.
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float16, 1e-1, 2e-2), (torch.bfloat16, 6e-1, 5e-2)])
@pytest.mark.parametrize("kind,groups", [("gemma3", None), ("gemma3", {"sliding_8": "triton", "full": "flashinfer"}),
                                         ("gpt_oss", None)])
def test_gpu_groups_against_transformers_forward(kind, groups, dtype, atol, rtol):
    """On the GPU: the registry's per-group choice (or a pinned pair of backends), the model in 16-bit; every step's
    logits against transformers' float32 forward over the engine's own tokens, and the pages of every pool freed."""
    build, wrap = MODELS[kind]
    reference = build(seed=2, head_dim=64)  # a head size every GPU backend serves (FlashInfer: 64, 128, 256)
    engine = GroupedPagedEngine(
        wrap(build(seed=2, head_dim=64)), EngineConfig(block_size=16, num_blocks=32, max_num_batched_tokens=48, max_num_reqs=2),
        device="cuda", dtype=dtype, attention_config=LayerGroupsConfig(groups=groups) if groups else None,
    )
    prompts = [list(range(1, 31)), [4, 2]]
    got = engine.generate(prompts, 4)
    if groups:
        assert got.backend == ",".join(f"{name}={backend}" for name, backend in groups.items())
    with torch.inference_mode():
        for prompt, tokens, logits in zip(prompts, got.tokens, got.logits):
            for i in range(len(tokens)):
                want = reference(torch.tensor([prompt + tokens[:i]])).logits[0, -1].float()
                torch.testing.assert_close(logits[i].float().cpu(), want, atol=atol, rtol=rtol)
    assert all(p.num_free == p.num_blocks for p in engine.pools)
