"""examples/deepseek_sparse_generate.py: on the CPU the built-in engine serves a DeepSeek-V3.2-shaped model on the
reference sparse MLA backend token for token the same as a cache-free recompute through the reference's definition,
and a top-k below the context changes what the model computes; on a GPU, on triton_mla_sparse, layer by layer the
same as the reference impl."""

from __future__ import annotations

import pytest
import torch

from attnbackends import AttentionConfig
from attnbackends.engine import EngineConfig, PagedEngine, TinyDeepseekSparse, TinyDeepseekSparseConfig
from attnbackends.engine.speculative import NgramDrafter, SpeculativeConfig
from attnbackends.mla.sparse.backend import TritonSparseMLAImpl
from attnbackends.ops.sparse_mla_cache import SparseMLACache
from attnbackends.reference.backend import ReferenceMetadataBuilder
from attnbackends.reference.sparse_mla import ReferenceSparseMLAImpl
from attnbackends.testing.tolerances import Tolerance, tolerance_for
from examples.deepseek_sparse_generate import MIN_AGREEMENT, main, run_sparse_generation

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


class LayerCheck:
    """Wraps ``TritonSparseMLAImpl.forward``: each call also runs the reference impl on the same inputs and a copy of
    the cache, and counts the query tokens whose output is outside ``tol`` of the reference's (or NaN)."""

    def __init__(self, tol: Tolerance) -> None:
        self.tol = tol
        self.tokens = 0
        self.outside: list[tuple[int, float]] = []  # (call, a token's worst excess over tol)
        self.calls = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        triton_forward = TritonSparseMLAImpl.forward
        check = self

        def forward(impl, q, kv_c_normed, k_pe, kv_cache, metadata, output, **indexer_inputs):
            common = metadata.common
            cache = SparseMLACache(kv_cache.latent.clone(), kv_cache.index.clone())
            want = output.clone()
            ReferenceSparseMLAImpl(impl.spec, kv_b_proj=impl.kv_b_proj).forward(
                q, kv_c_normed, k_pe, cache, ReferenceMetadataBuilder(impl.spec, q.device).build(common), want,
                **indexer_inputs)
            got = triton_forward(impl, q, kv_c_normed, k_pe, kv_cache, metadata, output, **indexer_inputs)
            n = common.num_actual_tokens
            for worst in check.tol.excess(got[:n], want[:n]).amax(dim=(1, 2)).cpu():
                if not worst <= 0:  # outside the tolerance, or NaN
                    check.outside.append((check.calls, float(worst)))
            check.tokens += n
            check.calls += 1
            return got

        monkeypatch.setattr(TritonSparseMLAImpl, "forward", forward)


@pytest.mark.gpu
@pytest.mark.parametrize("latent_format", ["auto", "fp8_ds_mla"])
def test_the_example_on_a_gpu_serves_triton_mla_sparse(latent_format, monkeypatch):
    """Every layer call of the engine's triton_mla_sparse equals the reference impl on the same inputs and cache
    (the rare token a near-tied top-k swaps aside); end to end, greedy tokens agree with the recompute at least as
    the example demands (its docstring: a rounding-level difference can swap a near-tied top-k choice)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("triton_mla_sparse needs sm_89+")
    check = LayerCheck(tolerance_for(torch.float16, "fp8_e4m3" if latent_format == "fp8_ds_mla" else "auto"))
    check.install(monkeypatch)
    report = run_sparse_generation("cuda", torch.float16, latent_format=latent_format)
    assert report.backend == "triton_mla_sparse"
    assert report.selected_fraction < 0.7
    assert check.calls > 0 and len(check.outside) <= 0.02 * check.tokens, (check.tokens, check.outside)
    assert report.agreement >= MIN_AGREEMENT, (report.tokens, report.recompute_tokens, report.max_logit_diff)
