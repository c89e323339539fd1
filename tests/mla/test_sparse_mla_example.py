"""examples/deepseek_sparse_generate.py on the CPU: the built-in engine serves a DeepSeek-V3.2-shaped model on a
sparse MLA backend, token for token the same as a cache-free recompute through the reference's definition, and a
top-k below the context changes what the model computes."""

from __future__ import annotations

import pytest
import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyDeepseekSparse, TinyDeepseekSparseConfig
from attnbackends.engine.speculative import NgramDrafter, SpeculativeConfig
from attnbackends.ops.sparse_mla_cache import SparseMLACache
from examples.deepseek_sparse_generate import main, run_sparse_generation

# one prompt within the top-k (its selection drops nothing), two beyond it (one spanning two prefill chunks)
PROMPTS = (40, 70, 5)
TOPK = 16
REFERENCE = AttentionConfig(backend="reference_mla_sparse")


@pytest.fixture(scope="module")
def sparse_and_dense():
    sparse = run_sparse_generation("cpu", torch.float32, TOPK, PROMPTS, 4, attention_config=REFERENCE)
    dense = run_sparse_generation("cpu", torch.float32, 4096, PROMPTS, 4, attention_config=REFERENCE)
    return sparse, dense


def test_engine_tokens_equal_the_recompute(sparse_and_dense):
    for report in sparse_and_dense:
        assert report.backend == "reference_mla_sparse"
        assert report.num_tokens == 4 * len(PROMPTS)
        assert report.identical, (report.tokens, report.recompute_tokens)
        assert report.max_logit_diff < 1e-3


def test_a_topk_below_the_context_changes_the_output(sparse_and_dense):
    sparse, dense = sparse_and_dense
    assert sparse.selected_fraction < 0.7  # the selection dropped most of the visible pairs
    assert dense.selected_fraction == 1.0
    for length, a, b in zip(PROMPTS, sparse.first_logits, dense.first_logits):
        diff = float((a - b).abs().max())
        if length <= TOPK:  # every token is selected either way: same computation
            assert diff < 1e-4, (length, diff)
        else:
            assert diff > 1e-2 * float(b.abs().max()), (length, diff)


def test_the_engine_allocates_a_sparse_cache_per_layer():
    cfg = TinyDeepseekSparseConfig(num_layers=2)
    engine = PagedEngine(TinyDeepseekSparse(cfg), EngineConfig(num_blocks=8), attention_config=REFERENCE)
    assert engine.spec.is_sparse_mla and engine.spec.sparse_indexer.topk == cfg.index_topk
    assert len(engine.kv_caches) == 2
    assert all(isinstance(c, SparseMLACache) and c.latent.shape[0] == 8 for c in engine.kv_caches)
    assert all(not c.latent.any() and not c.index.any() for c in engine.kv_caches)
    with pytest.raises(NotImplementedError, match="speculative decoding with sparse MLA"):
        PagedEngine(TinyDeepseekSparse(cfg), EngineConfig(num_blocks=8), attention_config=REFERENCE,
                    speculative=SpeculativeConfig(NgramDrafter(), num_speculative_tokens=2))


def test_the_script_exits_non_zero_on_a_mismatch(monkeypatch, capsys):
    import examples.deepseek_sparse_generate as script

    real = script.topk_positions
    # the recompute keeps one token per query where the engine keeps 16: its attention differs, so must its tokens
    monkeypatch.setattr(script, "topk_positions", lambda s, p, k: real(s, p, 1))
    assert main(["--device", "cpu", "--new-tokens", "3"]) == 1
    assert "MISMATCH" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("latent_format", ["auto", "fp8_ds_mla"])
def test_the_example_on_a_gpu_serves_triton_mla_sparse(latent_format):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("triton_mla_sparse needs sm_89+")
    report = run_sparse_generation("cuda", latent_format=latent_format)
    assert report.backend == "triton_mla_sparse"
    assert report.selected_fraction < 0.7
    assert report.identical, (report.tokens, report.recompute_tokens, report.max_logit_diff)
