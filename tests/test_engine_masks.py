"""Masks beyond causal on the compact engine, float32 on the CPU through the reference backend, judged by a dense
recompute of the whole sequence under the mask's definition (``TinyLlama.forward_dense`` over
``attnbackends.masks.dense_visibility``):

- image spans on a ``causal_spans`` model: greedy tokens equal the dense recompute's, with spans that the step
  budget would split (the engine ends chunks at span starts), several spans per request, requests without spans and
  a span longer than a step (split; its tokens see the span up to their chunk's end, checked against a dense
  recompute under that mask);
- block diffusion on a ``block_causal`` model: every decided token and its logits row equal the dense recompute's
  at that point of the decoding.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig, block_diffusion_generate
from attnbackends.spec import AttentionMask

BASE = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16,
            intermediate_size=128)
SPANS_CFG = TinyLlamaConfig(**BASE, mask=AttentionMask(kind="causal_spans"))
BLOCK = 4
BLOCK_CFG = TinyLlamaConfig(**BASE, mask=AttentionMask(kind="block_causal", block_len=BLOCK))
MASK_TOKEN = 63
NEW_TOKENS = 6


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(BASE["vocab_size"] - 1) for _ in range(n)] for n in lengths]


def _engine(cfg, budget=16, **kw):
    return PagedEngine(TinyLlama(cfg, seed=0), EngineConfig(block_size=4, num_blocks=128,
                       max_num_batched_tokens=budget, max_num_reqs=4, **kw),
                       attention_config=AttentionConfig(backend="reference"))


@torch.inference_mode()
def _dense_greedy(model, prompt, spans, new_tokens):
    seq, rows = list(prompt), []
    for _ in range(new_tokens):
        logits = model.forward_dense(torch.tensor(seq), spans)[-1]
        rows.append(logits)
        seq.append(int(logits.argmax()))
    return seq[len(prompt):], torch.stack(rows)


def test_image_spans_match_a_dense_masked_recompute():
    prompts = _prompts((20, 9, 30, 5))
    # spans across the 16-token budget's natural chunk ends (16, 32) and inside a single step; one request without
    spans = [[(2, 7), (12, 19)], [(0, 9)], [(10, 15), (14 + 1, 27)], None]
    engine = _engine(SPANS_CFG)
    result = engine.generate(prompts, NEW_TOKENS, spans=spans)
    assert engine.allocator.num_free == 128, "pages leaked"
    for i, prompt in enumerate(prompts):
        want, rows = _dense_greedy(engine.model, prompt, spans[i] or (), NEW_TOKENS)
        assert result.tokens[i] == want, f"request {i}: {result.tokens[i]} vs dense {want}"
        torch.testing.assert_close(result.logits[i], rows, rtol=1e-4, atol=1e-4)
    # the spans matter: causal greedy tokens differ
    causal = [_dense_greedy(engine.model, p, (), NEW_TOKENS)[0] for p in prompts]
    assert causal != result.tokens


def test_a_span_longer_than_a_step_is_split():
    """A span of 24 tokens with a budget of 16 cannot be served in one step: the engine ends the first chunk at the
    span's start, then splits the span. A token computed in a chunk that ends at e sees the keys the mask shows it
    below e, so the dense oracle is the whole sequence under that mask (each token's states are computed once, in
    its chunk, from keys computed the same way)."""
    import torch.nn.functional as F

    from attnbackends.masks import dense_visibility

    prompt, span = _prompts((28,), seed=3)[0], (2, 26)
    engine = _engine(SPANS_CFG)
    result = engine.generate([prompt], NEW_TOKENS, spans=[[span]])
    assert engine.scheduled_tokens[:3] == [2, 16, 10]
    seq = torch.tensor(prompt + result.tokens[0][:-1])
    positions = torch.arange(seq.shape[0])
    chunk_end = torch.tensor([2] * 2 + [18] * 16 + [28] * 10 + list(range(29, seq.shape[0] + 1)))
    spec = engine.model.attention_spec(torch.float32, 4)
    visible = dense_visibility(spec, positions, seq.shape[0], spans=[span]) & (positions[None, :] < chunk_end[:, None])
    group = BASE["num_heads"] // BASE["num_kv_heads"]

    def attend(_, q, k, v):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible)
        return o.transpose(0, 1)

    with torch.inference_mode():
        logits = engine.model.forward(seq, positions, attend)[len(prompt) - 1:]
    assert logits.argmax(dim=-1).tolist() == result.tokens[0]
    torch.testing.assert_close(result.logits[0], logits, rtol=1e-4, atol=1e-4)
    unsplit = _dense_greedy(engine.model, prompt, [span], NEW_TOKENS)[1]
    assert not torch.allclose(unsplit, logits, atol=1e-3), "the split should change the span tokens' answer"


def test_span_arguments_are_checked():
    engine = _engine(SPANS_CFG)
    with pytest.raises(ValueError, match="past its prompt"):
        engine.generate([[1, 2, 3]], 2, spans=[[(1, 4)]])
    with pytest.raises(ValueError, match="overlaps"):
        engine.generate([[1, 2, 3, 4, 5]], 2, spans=[[(0, 3), (2, 4)]])
    with pytest.raises(ValueError, match="entries"):
        engine.generate([[1, 2, 3]], 2, spans=[])
    with pytest.raises(ValueError, match="causal_spans"):
        _engine(BLOCK_CFG, budget=8).generate([[1, 2, 3]], 2, spans=[[(0, 2)]])


@torch.inference_mode()
def _dense_block_diffusion(model, prompt, new_tokens):
    """The decoding rule recomputed densely: per step, the sequence up to the active block's end (undecided
    positions as the mask token); decide the most confident undecided position of the active block."""
    seq = list(prompt) + [None] * new_tokens
    chosen = {}
    while None in seq:
        first = seq.index(None)
        start, end = first // BLOCK * BLOCK, min(first // BLOCK * BLOCK + BLOCK, len(seq))
        ids = torch.tensor([MASK_TOKEN if t is None else t for t in seq[:end]])
        logits = model.forward_dense(ids)
        undecided = [p for p in range(start, end) if seq[p] is None]
        probs = torch.softmax(logits[undecided], dim=-1).max(dim=-1)
        k = int(probs.values.argmax())
        seq[undecided[k]] = int(probs.indices[k])
        chosen[undecided[k]] = logits[undecided[k]]
    return seq[len(prompt):], torch.stack([chosen[p] for p in range(len(prompt), len(seq))])


@pytest.mark.parametrize("budget", [8, 12])
def test_block_diffusion_matches_a_dense_block_causal_recompute(budget):
    prompts = _prompts((3, 9, 14))  # ends inside a block, on a block edge, and a prefill chunked at budget 8
    engine = _engine(BLOCK_CFG, budget=budget)
    result = block_diffusion_generate(engine, prompts, NEW_TOKENS + 1, mask_token_id=MASK_TOKEN)
    assert engine.allocator.num_free == 128, "pages leaked"
    for i, prompt in enumerate(prompts):
        want, rows = _dense_block_diffusion(engine.model, prompt, NEW_TOKENS + 1)
        assert result.tokens[i] == want, f"request {i}: {result.tokens[i]} vs dense {want}"
        torch.testing.assert_close(result.logits[i], rows, rtol=1e-4, atol=1e-4)


def test_block_diffusion_arguments_are_checked():
    with pytest.raises(ValueError, match="block_causal"):
        block_diffusion_generate(_engine(SPANS_CFG), [[1, 2]], 2, mask_token_id=MASK_TOKEN)
    with pytest.raises(ValueError, match="two blocks"):
        block_diffusion_generate(_engine(BLOCK_CFG, budget=6), [[1, 2]], 2, mask_token_id=MASK_TOKEN)
    with pytest.raises(ValueError, match="mask_token_id"):
        block_diffusion_generate(_engine(BLOCK_CFG, budget=8), [[1, 2]], 2, mask_token_id=-1)
    with pytest.raises(ValueError, match="empty"):
        block_diffusion_generate(_engine(BLOCK_CFG, budget=8), [[]], 2, mask_token_id=MASK_TOKEN)
