"""The GPU twin of tests/test_integration_transformers.py (``pytest -m gpu``): greedy ``generate_batch`` with
``paged|attnbackends`` in bf16 on the Triton, FlashInfer and flash-attn backends and the registry's own choice,
against transformers' own paged attention in bf16 (``paged|sdpa``; ``paged|eager`` for gpt-oss), with chunked prefill and
prefix reuse; and all-MiniLM-L6-v2's sentence embeddings in bf16 (cosine >= 0.999 against transformers' float32).

bf16 greedy decoding parts at near-ties, for reasons that are not attention's. Llama and Qwen2 run as the
wide-margin models (greedy choice = the seeded successor by many bf16 rounding steps): every token must match.
Gemma 3 and gpt-oss run as plain seeded models, whose top logits can lie within bf16's noise of each other (two bf16
runs then pick different tokens, both off the float32 model's choice): each token either sequence picked is scored
by the float32 model, teacher-forced over that sequence (its logit deficit: the best logit minus the picked one),
and ours must be as faithful as transformers' own bf16 run: its largest deficit at most twice the peer's, or
``DEFICIT_FLOOR`` (a wiring error - a wrong layer spec, window or page - costs whole logits). A backend that cannot
serve a model's spec (the registry's reasons) is skipped with those reasons.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, BackendNotSupportedError  # noqa: E402
from attnbackends.compat import transformers_cb_hooks_reason  # noqa: E402
from attnbackends.integrations import transformers as integration  # noqa: E402
from examples.transformers_generate_batch import (  # noqa: E402
    generate_batch_tokens,
    peer_implementation,
    random_prompts,
    tiny_model,
)

pytestmark = pytest.mark.gpu
# generate_batch needs the continuous-batching names compat hooks (an older transformers lacks them).
_CB_HOOKS_MISSING = transformers_cb_hooks_reason()
needs_cb_hooks = pytest.mark.skipif(_CB_HOOKS_MISSING is not None, reason=str(_CB_HOOKS_MISSING))

PROMPT_LENGTHS = (1, 7, 33, 64, 100, 250)
MAX_NEW_TOKENS = 16
DEFICIT_FLOOR = 0.25
# Pages of 64 tokens, 128 tokens per step: the long prompts are prefilled in chunks.
CB = dict(page_size=64, num_blocks=128, max_batch_tokens=128)
WIDE_MARGIN = 48.0


def _model(kind: str) -> torch.nn.Module:
    margin = WIDE_MARGIN if kind in ("llama", "qwen2") else 0.0
    # Head size 64: one every fast backend serves (FlashInfer's are 64, 128, 256).
    overrides = dict(hidden_size=256, intermediate_size=512, head_dim=64) if kind in ("llama", "qwen2") else \
        dict(head_dim=64)
    return tiny_model(kind, successor_logit=margin, device="cuda", dtype=torch.bfloat16, **overrides)


def _ours(model, backend: str, prompts, **cb):
    integration.register(AttentionConfig(backend=backend))
    try:
        groups = integration.layer_groups_for(model, page_size=CB["page_size"])
    except BackendNotSupportedError as exc:
        pytest.skip(f"{backend} cannot serve this model here: {exc}")
    print(groups)
    return generate_batch_tokens(model, "paged|attnbackends", prompts, MAX_NEW_TOKENS, **{**CB, **cb})


def fp32_logit_deficits(model, prompts, *generations) -> list[list[float]]:
    """For each generation (one token list per prompt), per prompt the largest float32 logit deficit of its
    generated tokens: the model in float32 with eager attention, teacher-forced over prompt + generated; a token's
    deficit is the best logit minus its own there."""
    reference = copy.deepcopy(model).float()
    reference.set_attn_implementation("eager")
    device = next(reference.parameters()).device
    result = []
    with torch.no_grad():
        for generated in generations:
            worst = []
            for prompt, tokens in zip(prompts, generated):
                ids = torch.tensor([prompt + tokens], device=device)
                logits = reference(ids).logits[0, len(prompt) - 1:-1].double()
                picked = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
                worst.append((logits.max(dim=1).values - picked).max().item())
            result.append(worst)
    return result


def _check(kind: str, model, prompts, ours, peer) -> None:
    assert all(len(t) == MAX_NEW_TOKENS for t in ours)
    if kind in ("llama", "qwen2"):
        assert ours == peer, f"{kind}: {ours} vs {peer}"
        return
    if ours == peer:
        return
    ours_worst, peer_worst = fp32_logit_deficits(model, prompts, ours, peer)
    bound = max(DEFICIT_FLOOR, 2 * max(peer_worst))
    assert max(ours_worst) <= bound, (f"{kind}: float32 logit deficits per prompt {ours_worst} (transformers' own "
                                      f"bf16: {peer_worst}); tokens {ours} vs {peer}")


@needs_cb_hooks
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flash_attn", "auto"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gpt_oss"])
def test_generate_batch_bf16_matches_transformers(kind, backend):
    model = _model(kind)
    prompts = random_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=1)
    ours = _ours(model, backend, prompts)
    peer = generate_batch_tokens(model, peer_implementation(kind), prompts, MAX_NEW_TOKENS, **CB)
    _check(kind, model, prompts, ours, peer)


@needs_cb_hooks
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_prefix_reuse_bf16(backend):
    model = _model("llama")
    shared = random_prompts((128,), model.config.vocab_size, seed=2)[0]
    prompts = [shared + t for t in random_prompts((3, 70, 1, 20), model.config.vocab_size, seed=3)]
    ours = _ours(model, backend, prompts)
    peer = generate_batch_tokens(model, "paged|sdpa", prompts, MAX_NEW_TOKENS, **CB)
    _check("llama", model, prompts, ours, peer)


def test_minilm_embeddings_bf16():
    from tests.test_minilm_real_weights import (
        SENTENCES,
        engine_sentence_embeddings,
        load_minilm,
        require_minilm,
        transformers_sentence_embeddings,
    )

    path = require_minilm()
    tokenizer, reference_model = load_minilm(path)
    want = transformers_sentence_embeddings(reference_model, tokenizer, SENTENCES)
    _, model = load_minilm(path)
    got, backends = engine_sentence_embeddings(model, tokenizer, SENTENCES, device="cuda", dtype=torch.bfloat16)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert torch.all(cosine >= 0.999), f"{backends}: cosine {cosine.tolist()}"
