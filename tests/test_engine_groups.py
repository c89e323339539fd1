"""The grouped engine: a hybrid model (sliding-window and global layers, optional sinks) served with one backend per
layer group and per-group page pools, token for token against dense recomputation; sliding groups free the pages
that fall out of their window, and the freed pages are reused by other requests."""

import pytest
import torch

from attnbackends import AttentionSpec, LayerGroupsConfig
from attnbackends.engine import EngineConfig, GroupedPagedEngine, PagedEngine, TinyHybrid, TinyHybridConfig
from attnbackends.layer_groups import window_pages_per_request

PROMPTS = [[5, 9, 2], list(range(3, 40)), [7] * 21, list(range(100, 111))]


def dense_greedy(model, prompt, max_new_tokens):
    tokens, logits = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            out = model.forward_dense(torch.tensor(tokens))[-1]
            logits.append(out)
            tokens.append(int(out.argmax()))
    return tokens[len(prompt):], torch.stack(logits)


class _Watched(GroupedPagedEngine):
    """Records every request's live pages per group after each reservation."""

    def _reserve_pages(self, req, num_tokens):
        super()._reserve_pages(req, num_tokens)
        for g, pages in enumerate(self._pages_of[req.index]):
            live = sum(p is not None for p in pages)
            self.peak_live[g] = max(self.peak_live.get(g, 0), live)
            self.freed[g] = self.freed.get(g, 0) + sum(p is None for p in pages)


@pytest.mark.parametrize("sinks", [False, True])
def test_hybrid_engine_matches_dense_recomputation(sinks):
    cfg = TinyHybridConfig(vocab_size=128, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2, head_size=16,
                           intermediate_size=128, sliding_window=6, global_every=3, sinks=sinks)
    model = TinyHybrid(cfg, seed=3)
    econf = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_reqs=3)
    engine = _Watched(model, econf)
    engine.peak_live, engine.freed = {}, {}
    result = engine.generate(PROMPTS, max_new_tokens=6)
    groups = {g.name: g for g in engine.groups.groups}
    assert set(groups) == {"sliding_6", "full"}
    sliding = groups["sliding_6"].index
    cap = window_pages_per_request(6, 4, 16)
    assert engine.pools[sliding].num_blocks == 3 * cap
    assert engine.peak_live[sliding] <= cap
    assert engine.freed[sliding] > 0  # pages left the window and went back to the pool
    assert all(p.num_free == p.num_blocks for p in engine.pools)  # everything released at the end
    assert result.backend == "sliding_6=reference,full=reference"
    for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits):
        want_tokens, want_logits = dense_greedy(model, prompt, 6)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=2e-4)


def test_ignoring_windows_changes_the_tokens():
    """The dense check can fail: serving every layer as global gives other tokens than the hybrid model."""
    cfg = TinyHybridConfig(vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_size=16,
                           intermediate_size=128, sliding_window=4, global_every=3)
    model = TinyHybrid(cfg, seed=3)
    full = TinyHybrid(TinyHybridConfig(**{**cfg.__dict__, "global_every": 1}), seed=3)
    full.load_state_dict(model.state_dict())
    econf = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_reqs=3)
    ours = GroupedPagedEngine(full, econf).generate(PROMPTS[1:3], max_new_tokens=4)
    wanted = [dense_greedy(model, p, 4)[1] for p in PROMPTS[1:3]]
    assert any(not torch.allclose(a, b, atol=1e-2) for a, b in zip(ours.logits, wanted))


def test_triton_sliding_groups_with_reference_global_groups():
    """Sliding layers on interpreted Triton, global layers on the reference backend, float16, in one engine."""
    cfg = TinyHybridConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_size=32,
                           intermediate_size=64, sliding_window=5, global_every=2)
    model = TinyHybrid(cfg, seed=1)
    econf = EngineConfig(block_size=16, num_blocks=8, max_num_batched_tokens=40, max_num_reqs=2)
    prompts = [list(range(1, 36)), [3, 4]]  # the long one's first pages leave the window
    pins = LayerGroupsConfig(groups={"sliding_5": "triton", "full": "reference"})
    mixed = GroupedPagedEngine(model, econf, dtype=torch.float16, attention_config=pins).generate(prompts, 3)
    assert mixed.backend == "sliding_5=triton,full=reference"
    model32 = TinyHybrid(cfg, seed=1)
    with torch.inference_mode():
        for prompt, tokens, logits in zip(prompts, mixed.tokens, mixed.logits):
            for i in range(len(tokens)):  # the engine's own tokens as the context: every step compared
                want = model32.forward_dense(torch.tensor(prompt + tokens[:i]))[-1]
                torch.testing.assert_close(logits[i], want, atol=3e-2, rtol=3e-2)  # float16 model vs float32


def test_encoder_layers_are_refused():
    class Enc(TinyHybrid):
        def layer_specs(self, dtype, block_size):
            return [AttentionSpec(**{**s.model_dump(), "attn_type": "encoder_only", "sliding_window": None})
                    for s in super().layer_specs(dtype, block_size)]

    with pytest.raises(NotImplementedError, match="no KV cache"):
        GroupedPagedEngine(Enc(TinyHybridConfig(num_layers=2)), EngineConfig())


def test_plain_engine_still_serves_one_spec_models():
    cfg = TinyHybridConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_size=16,
                           intermediate_size=32)
    from attnbackends.engine import TinyLlama, TinyLlamaConfig

    llama = TinyLlama(TinyLlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                      head_size=16, intermediate_size=32))
    out = PagedEngine(llama, EngineConfig(block_size=4, num_blocks=16)).generate([[1, 2, 3]], 2)
    assert len(out.tokens[0]) == 2
    assert cfg.is_global(2) and not cfg.is_global(1)
