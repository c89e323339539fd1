"""The engine's masked requests on the GPU (`pytest -m gpu`) through the Triton backend in bf16: image spans
(chunks ending at span starts, a span as long as the step budget) and block diffusion, against a float32 dense recompute
under the mask; decode steps after the spans replayed from CUDA graphs give the eager engine's tokens."""

import pytest
import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig, block_diffusion_generate
from attnbackends.spec import AttentionMask

pytestmark = pytest.mark.gpu

SPANS = TinyLlamaConfig(mask=AttentionMask(kind="causal_spans"))
BLOCKS = TinyLlamaConfig(mask=AttentionMask(kind="block_causal", block_len=16))
PROMPT_LENGTHS = (40, 100, 7, 64)
SPAN_LISTS = [[(3, 35)], [(10, 74), (80, 99)], None, [(0, 64)]]

def _prompts(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size - 1, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]

def _engine(cfg, cuda_graphs=False, budget=64):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return PagedEngine(TinyLlama(cfg, seed=0), EngineConfig(block_size=16, max_num_batched_tokens=budget),
                       device="cuda", dtype=torch.bfloat16, cuda_graphs=cuda_graphs,
                       attention_config=AttentionConfig(backend="triton"))

def _dense(cfg, tokens, spans=()):
    model = TinyLlama(cfg, seed=0).to("cuda").eval()
    with torch.inference_mode():
        return model.forward_dense(torch.tensor(tokens, device="cuda"), spans).cpu()

def test_spans_first_token_logits_match_a_dense_recompute():
    engine = _engine(SPANS)
    prompts = _prompts(SPANS)
    result = engine.generate(prompts, 1, spans=SPAN_LISTS)
    for prompt, spans, logits in zip(prompts, SPAN_LISTS, result.logits):
        torch.testing.assert_close(logits[0], _dense(SPANS, prompt, spans or ())[-1], rtol=0.05, atol=0.15)

def test_span_decode_steps_from_cuda_graphs_give_eagers_tokens():
    prompts = _prompts(SPANS, seed=1)
    want = _engine(SPANS, cuda_graphs=False).generate(prompts, 24, spans=SPAN_LISTS)
    engine = _engine(SPANS, cuda_graphs=True)
    got = engine.generate(prompts, 24, spans=SPAN_LISTS)
    assert engine.graph_steps > 0, engine.cuda_graphs_reason
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.15)

def test_block_diffusion_first_decision_matches_a_dense_recompute():
    engine = _engine(BLOCKS)
    prompts = _prompts(BLOCKS)
    mask_token = BLOCKS.vocab_size - 1
    result = block_diffusion_generate(engine, prompts, 1, mask_token_id=mask_token)
    for prompt, logits in zip(prompts, result.logits):
        end = min((len(prompt) // 16 + 1) * 16, len(prompt) + 1)
        dense = _dense(BLOCKS, prompt + [mask_token] * (end - len(prompt)))
        torch.testing.assert_close(logits[0], dense[len(prompt)], rtol=0.05, atol=0.15)
