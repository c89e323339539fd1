"""The paged engine judged by Hugging Face transformers: greedy generation over a batch of prompts of different
lengths (chunked prefill, requests joining as others finish) must match transformers' own ``generate`` token for
token, with every backend that runs here.

CPU: float32 for the pure-torch backends (logits equal to ~1e-5), float16 for the Triton ones (interpreted; Triton
has no float32 path) against transformers in float16. GPU (``-m gpu``): float32 for the pure-torch backends (every
token identical), bf16 for every backend that fits (logits to bf16 rounding; tokens identical up to near-ties).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, DeviceInfo, explain  # noqa: E402
from attnbackends.engine import (  # noqa: E402
    EngineConfig,
    PagedEngine,
    build_hf_model,
    compare_with_transformers,
    wrap_hf_model,
)

# Prompt lengths: a single token, shorter than a page, longer than the step budget (chunked), a page boundary.
PROMPT_LENGTHS = (1, 5, 23, 16)
# A small budget and few slots: prefills are chunked and the fourth request waits for a slot.
ENGINE = EngineConfig(block_size=16, num_blocks=32, max_num_batched_tokens=16, max_num_reqs=3)


def _prompts(lengths=PROMPT_LENGTHS, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _fits(model, backend: str, dtype: torch.dtype, device: DeviceInfo) -> list[str]:
    spec = model.attention_spec(dtype, ENGINE.block_size)
    row = {r.name: r for r in explain(spec, device, AttentionConfig()).rows}[backend]
    return row.reasons


CPU_CASES = [
    ("llama", "reference", torch.float32, 1e-4),
    ("llama", "triton", torch.float16, 0.1),
    ("deepseek", "reference_mla", torch.float32, 1e-4),
    ("deepseek", "triton_mla", torch.float16, 0.1),
]


@pytest.mark.parametrize("kind,backend,dtype,logit_tol", CPU_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_engine_matches_transformers_generate_cpu(kind, backend, dtype, logit_tol):
    hf = build_hf_model(kind, seed=0, dtype=dtype)
    reasons = _fits(wrap_hf_model(hf), backend, dtype, DeviceInfo.cpu())
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    report = compare_with_transformers(
        hf, _prompts(), max_new_tokens=4, attention_config=AttentionConfig(backend=backend), engine_config=ENGINE
    )
    assert report.backend == backend
    assert report.tokens_compared == 4 * len(PROMPT_LENGTHS)
    assert report.all_identical, f"{report.summary()}; first mismatch {report.first_mismatch}"
    assert report.max_logit_diff < logit_tol, report.summary()


def test_scheduler_budget_waiting_requests_and_page_release():
    hf = build_hf_model("llama", seed=1)
    engine = PagedEngine(wrap_hf_model(hf), ENGINE, attention_config=AttentionConfig(backend="reference"))
    prompts = _prompts((3, 40, 7, 1, 18), seed=1)
    result = engine.generate(prompts, max_new_tokens=3)
    assert [len(t) for t in result.tokens] == [3] * len(prompts)
    assert max(engine.scheduled_tokens) <= ENGINE.max_num_batched_tokens
    assert engine.allocator.num_free == ENGINE.num_blocks  # every page came back
    # The same prompts one at a time give the same tokens: batching and chunking change nothing.
    alone = [engine.generate([p], max_new_tokens=3).tokens[0] for p in prompts]
    assert alone == result.tokens


def test_eos_stops_a_request_early():
    hf = build_hf_model("llama", seed=2)
    engine = PagedEngine(wrap_hf_model(hf), ENGINE, attention_config=AttentionConfig(backend="reference"))
    prompt = _prompts((6,), seed=2)
    free_run = engine.generate(prompt, max_new_tokens=4).tokens[0]
    stopped = engine.generate(prompt, max_new_tokens=4, eos_token_id=free_run[1]).tokens[0]
    assert stopped == free_run[: free_run.index(free_run[1]) + 1]


# ------------------------------------------------------------------------------------------------------------ GPU

# Head sizes the fast GPU kernels serve: Llama head_dim 64; DeepSeek-V3's MLA geometry (latent 512, rope 64).
GPU_CONFIGS = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "deepseek": dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}
GPU_BACKENDS = {"llama": ("flashinfer", "triton", "reference"), "deepseek": ("flashinfer_mla", "triton_mla", "reference_mla")}
GPU_CASES = [(kind, backend) for kind, names in GPU_BACKENDS.items() for backend in names]


def _gpu_compare(kind: str, backend: str, dtype: torch.dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = build_hf_model(kind, seed=0, dtype=dtype, device="cuda", **GPU_CONFIGS[kind])
    reasons = _fits(wrap_hf_model(hf), backend, dtype, DeviceInfo.current())
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    report = compare_with_transformers(
        hf, _prompts((1, 7, 33, 64, 100, 250)), max_new_tokens=16, attention_config=AttentionConfig(backend=backend),
        engine_config=EngineConfig(block_size=16, num_blocks=256, max_num_batched_tokens=128, max_num_reqs=4),
    )
    print(report.summary())
    assert report.backend == backend
    return report


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", GPU_CASES, ids=lambda v: str(v))
def test_engine_matches_transformers_generate_gpu_bf16(kind, backend):
    report = _gpu_compare(kind, backend, torch.bfloat16)
    # Logits (at every step before a divergence, same context on both sides) agree to bf16 rounding: a few percent
    # of the largest logit. H100, 2026-11-21: max |diff| 0.10-0.17 with logits up to ~17.
    assert report.max_logit_diff <= 0.02 * report.max_abs_logit, report.summary()
    # Tokens: identical until a sequence meets a near-tie. transformers' bf16 logits are quantised to 1/16 at
    # 8..16, so exact ties (margin 0) between the top two are common on a 256-token random vocabulary; where
    # the two runs part, transformers' margin between its token and the engine's must be within two bf16 ulps
    # of the top logit (a rounding decision, not a wrong token). Past that point the contexts differ.
    assert all(m <= 0.25 for m in report.mismatch_margins), report.summary()
    assert report.tokens_identical >= report.tokens_compared // 2, report.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", [("llama", "reference"), ("deepseek", "reference_mla")], ids=str)
def test_engine_matches_transformers_generate_gpu_float32(kind, backend):
    """In float32 (the backends that have it) every token is identical on the GPU too."""
    report = _gpu_compare(kind, backend, torch.float32)
    assert report.all_identical, report.summary()
    assert report.max_logit_diff < 1e-4, report.summary()
