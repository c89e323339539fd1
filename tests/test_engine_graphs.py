"""The built-in engine's decode steps from CUDA graphs (:mod:`attnbackends.engine.cuda_graphs`).

CPU: the option is off with its reason; the padded decode step the graphs replay (a step of n requests written
into the persistent buffers padded to the capture size) is run eagerly and must give the engine's own tokens and
logits. GPU: graphs on against graphs off, tokens identical."""

import logging

import pytest
import torch

from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig
from attnbackends.engine.cuda_graphs import DEFAULT_CAPTURE_SIZES, DecodeGraphs, capture_sizes
from attnbackends.engine.demo_setup import demo_prompts

SMALL = TinyLlamaConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_size=16,
                        intermediate_size=128)


def test_capture_sizes_follow_the_engine_limits():
    assert capture_sizes(None, 64, 64) == tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= 64)
    assert capture_sizes((8, 3, 64, 3), 16, 32) == (3, 8)
    for bad in ((0,), (2.0,), (True,)):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            capture_sizes(bad, 16, 16)


def test_cuda_graphs_off_on_the_cpu_with_the_reason(caplog):
    caplog.set_level(logging.WARNING, logger="attnbackends.engine.engine")
    engine = PagedEngine(TinyLlama(SMALL), device="cpu", cuda_graphs=True)
    assert engine.graphs is None and "CUDA device" in engine.cuda_graphs_reason
    assert "cuda_graphs=True" in caplog.text
    result = engine.generate([[1, 2, 3], [4]], 3)
    assert engine.graph_steps == 0 and engine.eager_steps == result.num_steps
    assert "cuda_graphs=False" in PagedEngine(TinyLlama(SMALL), device="cpu", cuda_graphs=False).cuda_graphs_reason
    with pytest.raises(ValueError, match="cuda_graphs"):
        PagedEngine(TinyLlama(SMALL), device="cpu", cuda_graphs="yes")


class _PaddedEager(DecodeGraphs):
    """The graphs' buffers and padding, run eagerly (the CPU cannot capture)."""

    def _capture(self, step, size):
        return None


@pytest.mark.parametrize("sizes", [(8,), (2, 4, 16)])
def test_padded_decode_steps_give_the_engines_tokens(sizes):
    """Decode steps written into the buffers padded to a capture size (reference backend, float32) give the tokens
    of the plain engine, and logits equal to rounding; requests finishing at different times shrink the batch."""
    prompts = demo_prompts(SMALL.vocab_size, 5, seed=3)
    config = EngineConfig(block_size=16, num_blocks=128, max_num_batched_tokens=48, max_num_reqs=8,
                          cudagraph_capture_sizes=sizes)
    plain = PagedEngine(TinyLlama(SMALL, seed=1), config, device="cpu")
    want = plain.generate(prompts, 6, eos_token_id=7)
    padded = PagedEngine(TinyLlama(SMALL, seed=1), config, device="cpu")
    padded.graphs = _PaddedEager(padded, capture_sizes(sizes, 8, 48))
    got = padded.generate(prompts, 6, eos_token_id=7)
    assert padded.graph_steps > 0 and padded.graphs.refused == {}
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _demo_engine(cuda_graphs, **options):
    model = TinyLlama(TinyLlamaConfig(), seed=0)
    return PagedEngine(model, EngineConfig(block_size=16, max_num_batched_tokens=64), device="cuda",
                       dtype=torch.bfloat16, cuda_graphs=cuda_graphs, builder_options=options or None)


@pytest.mark.gpu
def test_graph_decode_steps_give_eagers_tokens_bit_for_bit():
    """The demo model on the GPU, 8 prompts (a capture size: no padding), deterministic attention plans: the tokens
    and the logits of every generated token are those of the eager engine, bit for bit."""
    prompts = demo_prompts(TinyLlamaConfig().vocab_size, 8, seed=0)
    eager = _demo_engine(False, deterministic=True)
    want = eager.generate(prompts, 24)
    graphs = _demo_engine(None, deterministic=True)
    assert graphs.graphs is not None, graphs.cuda_graphs_reason
    got = graphs.generate(prompts, 24)
    assert graphs.graph_steps >= 20 and 8 in graphs.graphs.graphs
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_graph_decode_steps_padded_and_shrinking():
    """5 prompts (padded to 8), requests finishing at different times (an end token), the default builder: the
    tokens are the eager engine's, the logits close; the graphs replayed most decode steps."""
    prompts = demo_prompts(TinyLlamaConfig().vocab_size, 5, seed=1)
    want = _demo_engine(False).generate(prompts, 32, eos_token_id=3)
    engine = _demo_engine(True)
    got = engine.generate(prompts, 32, eos_token_id=3)
    assert engine.graph_steps > 0 and engine.graphs.replays >= engine.graph_steps - len(engine.graphs.graphs)
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.15)
