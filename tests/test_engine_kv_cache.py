"""The engine's KV-cache format option (``EngineConfig.kv_cache_dtype``): each quantised format is served on the CPU
(reference backend) and stored as that format, per-tensor scales reach the impls, layer groups keep the
``kv_cache_16bit_layers`` in 16 bits, teacher forcing feeds given tokens, and the greedy agreement it measures lies
in [0, 1] (1.0 for a format against itself); the ``auto`` cache still matches a dense recompute."""

import math

import pytest
import torch

from attnbackends import AttentionConfig, LayerGroupsConfig
from attnbackends.engine import (
    EngineConfig,
    GroupedPagedEngine,
    PagedEngine,
    TinyLlama,
    TinyLlamaConfig,
    calibrated_kv_scales,
    teacher_forced_agreement,
    token_agreement,
)
from attnbackends.spec import QUANTIZED_KV_CACHE_DTYPES

FORMATS = (*QUANTIZED_KV_CACHE_DTYPES, "fp8")
CFG = TinyLlamaConfig(vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_size=32,
                      intermediate_size=128)
PROMPTS = [[5, 9, 2], list(range(3, 40)), [7, 1] * 9, list(range(50, 61))]
REFERENCE = AttentionConfig(backend="reference")


def _engine(kv_cache_dtype="auto", kv_scales=None, seed=1, cls=PagedEngine, attention_config=REFERENCE):
    econf = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=16, max_num_reqs=3,
                         kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    return cls(TinyLlama(CFG, seed=seed), econf, attention_config=attention_config)


@pytest.fixture(scope="module")
def base_run():
    engine = _engine()
    return engine, engine.generate(PROMPTS, 6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantised_cache_generates_and_agreement_is_a_share(fmt, base_run):
    base, base_result = base_run
    scales = calibrated_kv_scales(base.kv_caches, fmt) if fmt in ("fp8", "nvfp4") else None
    engine = _engine(fmt, scales)
    assert engine.spec.kv_cache_dtype == fmt
    assert all(c.dtype == engine.spec.kv_cache_torch_dtype != torch.float32 for c in engine.kv_caches)
    result = engine.generate(PROMPTS, 6)
    assert [len(t) for t in result.tokens] == [6] * len(PROMPTS)
    # the quantised cache changes the numbers (the logits after the prompt differ from the 16-bit cache's)
    assert not torch.equal(result.logits[1][0], base_result.logits[1][0])
    against_16bit = teacher_forced_agreement(engine, PROMPTS, base_result.tokens)
    assert 0.0 <= against_16bit.agreement <= 1.0 and against_16bit.positions == 6 * len(PROMPTS)
    against_itself = teacher_forced_agreement(_engine(fmt, scales), PROMPTS, result.tokens)
    assert against_itself.agreement == 1.0 and against_itself.first_divergence is None


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int3'.*int8_per_token_head.*nvfp4"):
        EngineConfig(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="per-tensor scales apply to fp8 per tensor"):
        EngineConfig(kv_cache_dtype="int8_per_token_head", kv_scales=((0.1, 0.1),))
    with pytest.raises(ValueError, match="positive finite"):
        EngineConfig(kv_cache_dtype="fp8", kv_scales=((0.1, -1.0),))
    with pytest.raises(ValueError, match="one per layer"):
        _engine("fp8", kv_scales=((0.1, 0.1), (0.2, 0.2)))


def test_auto_cache_still_matches_dense_recompute():
    engine = _engine()
    assert engine.spec.kv_cache_dtype == "auto" and engine.kv_caches[0].dtype == torch.float32
    result = engine.generate(PROMPTS, 5)
    with torch.inference_mode():
        for prompt, tokens, logits in zip(PROMPTS, result.tokens, result.logits):
            dense = engine.model.forward_dense(torch.tensor(prompt + tokens))[len(prompt) - 1 : -1]
            assert dense.argmax(-1).tolist() == tokens
            torch.testing.assert_close(logits, dense, atol=2e-4, rtol=2e-4)
    forced = engine.generate_teacher_forced(PROMPTS, result.tokens)
    assert forced.tokens == result.tokens
    assert all(torch.equal(a, b) for a, b in zip(forced.logits, result.logits))


def test_teacher_forcing_feeds_the_given_tokens(base_run):
    base, base_result = base_run
    gen = torch.Generator().manual_seed(7)
    forced = [torch.randint(0, CFG.vocab_size, (4,), generator=gen).tolist() for _ in PROMPTS]
    result = base.generate_teacher_forced(PROMPTS, forced)
    assert result.tokens == forced
    for logits, free in zip(result.logits, base_result.logits):
        torch.testing.assert_close(logits[0], free[0])  # the first choice follows the prompt alone
    agree = token_agreement([lg.argmax(-1).tolist() for lg in result.logits], forced)
    assert agree.agreement < 1.0 and agree.first_divergence is not None  # random tokens are not the greedy ones
    with pytest.raises(ValueError, match="forced_tokens holds 1"):
        base.generate_teacher_forced(PROMPTS, forced[:1])


def test_token_agreement_counts_positions():
    agree = token_agreement([[1, 2, 3], [4, 5]], [[1, 0, 3], [4, 6]])
    assert (agree.matches, agree.positions, agree.first_divergence) == (3, 5, 1)
    assert math.isclose(agree.agreement, 0.6)


def test_calibrated_scales_reach_the_impls(base_run):
    base, _ = base_run
    scales = calibrated_kv_scales(base.kv_caches, "fp8")
    for (k_scale, v_scale), cache in zip(scales, base.kv_caches):
        assert math.isclose(k_scale, float(cache[:, 0].abs().max()) / 448, rel_tol=1e-6)
        assert math.isclose(v_scale, float(cache[:, 1].abs().max()) / 448, rel_tol=1e-6)
    engine = _engine("fp8", scales)
    assert [(i.k_scale, i.v_scale) for i in engine.impls] == list(scales)
    with pytest.raises(ValueError, match="takes no per-tensor scales"):
        calibrated_kv_scales(base.kv_caches, "int8_per_token_head")
    with pytest.raises(ValueError, match="unquantised"):
        calibrated_kv_scales(engine.kv_caches, "fp8")


def test_grouped_engine_keeps_16bit_layers(base_run):
    _, base_result = base_run
    layers = LayerGroupsConfig(default="reference", kv_cache_16bit_layers="0")
    engine = _engine("fp8", kv_scales=((0.02, 0.03),), cls=GroupedPagedEngine, attention_config=layers)
    assert [c.dtype for c in engine.kv_caches] == [torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fn]
    assert sorted(g.name for g in engine.groups.groups) == ["full", "full_fp8"]
    assert (engine.impls[0].k_scale, engine.impls[1].k_scale, engine.impls[2].v_scale) == (1.0, 0.02, 0.03)
    agree = teacher_forced_agreement(engine, PROMPTS, base_result.tokens)
    assert 0.0 <= agree.agreement <= 1.0 and agree.positions == 6 * len(PROMPTS)
