"""The paged engine judged by Hugging Face transformers: greedy generation over a batch of prompts of different
lengths (chunked prefill, requests joining as others finish) must match transformers' own ``generate`` token for
token, with every backend that runs here.

CPU: float32 for the pure-torch backends (logits equal to ~1e-5), float16 for the Triton ones (interpreted; Triton
has no float32 path) against transformers in float16. GPU (``-m gpu``): float32 for the pure-torch backends (every
token identical); bf16 for every backend that fits, on two models:

- the wide-margin model (``build_hf_model(successor_logit=MARGIN_SUCCESSOR_LOGIT)``): every token identical and
  logits to bf16 rounding. Its greedy choice is the seeded successor of the current token by a margin of many bf16
  rounding steps, so identical tokens rule out gross errors only; the logit tolerance is what checks attention
  (whose context-dependent part still moves every logit by several units). A CPU test guards that property, with
  CPU bf16 as the proxy for GPU bf16 rounding.
- the plain random model, whose choices depend on attention but are often near-ties (exact ties in transformers'
  own bf16 logits): tokens identical until a near-tie, and where a sequence parts the two tokens must be within
  bf16 rounding in transformers' logits.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, DeviceInfo, explain  # noqa: E402
from attnbackends.engine import EngineConfig, PagedEngine  # noqa: E402
from examples.engine.hf_models import (  # noqa: E402
    build_hf_model,
    compare_with_transformers,
    transformers_greedy,
    wrap_hf_model,
)
from examples.engine.hf_models.hf import MARGIN_SUCCESSOR_LOGIT  # noqa: E402

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


# Head sizes the fast GPU kernels serve: Llama head_dim 64; DeepSeek-V3's MLA geometry (latent 512, rope 64).
GPU_CONFIGS = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "deepseek": dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=128,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}
# The wide-margin model's geometry: the GPU configs, DeepSeek routing every token to all 4 experts. The router still
# weights them, but picks none. With a pick, group scores ~1e-3 apart turn up among a run's ~100 compared positions;
# bf16 rounding can flip such a pick and move that position's logits by units, failing the logit tolerance for a
# reason that has nothing to do with attention (seen on the CPU: 15.8 at one position of seed 1, groups 8e-4 apart).
MARGIN_CONFIGS = {
    "llama": GPU_CONFIGS["llama"],
    "deepseek": dict(GPU_CONFIGS["deepseek"], n_group=1, topk_group=1, num_experts_per_tok=4),
}
GPU_PROMPT_LENGTHS = (1, 7, 33, 64, 100, 250)
GPU_MAX_NEW_TOKENS = 16
GPU_ENGINE = EngineConfig(block_size=16, num_blocks=256, max_num_batched_tokens=128, max_num_reqs=4)
REFERENCE_BACKEND = {"llama": "reference", "deepseek": "reference_mla"}

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


# ------------------------------------------------------------------------------------------- wide-margin model


def _check_wide_margin_model(kind: str, seed: int) -> str:
    """The wide-margin model on the GPU test's geometry and prompts, run on the CPU: transformers in bf16 and the
    engine's pure-torch backend in bf16 give every token of transformers in float32 (CPU bf16 stands in for GPU
    bf16 rounding), with the smallest top-2 margin >= 10x the largest bf16 logit error, while the context still
    moves the logits by several units. Returns a line of numbers for the test log."""
    prompts = _prompts(GPU_PROMPT_LENGTHS)
    hf = build_hf_model(kind, seed=seed, successor_logit=MARGIN_SUCCESSOR_LOGIT, **MARGIN_CONFIGS[kind])
    exact_tokens, exact_logits = transformers_greedy(hf, prompts, GPU_MAX_NEW_TOKENS)
    with torch.inference_mode():  # the context's pull: last prompt token in context vs alone, float32
        context_shift = [
            float((hf(torch.tensor([p])).logits[0, -1] - hf(torch.tensor([p[-1:]])).logits[0, -1]).abs().max())
            for p in prompts if len(p) > 1
        ]
    report = compare_with_transformers(
        hf.to(torch.bfloat16), prompts, GPU_MAX_NEW_TOKENS,
        attention_config=AttentionConfig(backend=REFERENCE_BACKEND[kind]), engine_config=GPU_ENGINE,
    )
    assert report.reference_tokens == exact_tokens, "transformers bf16 parts from transformers float32"
    assert report.all_identical, report.summary()
    assert report.engine.tokens == exact_tokens
    bf16_error = max(
        [report.max_logit_diff] + [float((a - b).abs().max()) for a, b in zip(report.engine.logits, exact_logits)]
    )
    top2 = torch.cat(exact_logits).topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    line = (
        f"{kind} seed {seed}: {report.tokens_identical}/{report.tokens_compared} identical; smallest top-2 margin "
        f"{margin:.3g} vs bf16 logit error {bf16_error:.3g} (logits up to {report.max_abs_logit:.3g}); context shifts "
        f"logits by {min(context_shift):.3g}..{max(context_shift):.3g}"
    )
    assert margin >= 10 * bf16_error, line
    assert min(context_shift) >= 3.0, line  # attention still matters to the logits
    return line


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_wide_margin_model_tokens_survive_bf16(kind):
    """CI guard of the model the GPU bf16 test relies on (seed 0, the GPU test's seed)."""
    print(_check_wide_margin_model(kind, seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_wide_margin_model_other_seeds(kind, seed):
    """The margins are a property of the construction, not of a lucky seed."""
    print(_check_wide_margin_model(kind, seed))


# ------------------------------------------------------------------------------------------------------------ GPU

GPU_BACKENDS = {"llama": ("flashinfer", "triton", "reference"), "deepseek": ("flashinfer_mla", "triton_mla", "reference_mla")}
GPU_CASES = [(kind, backend) for kind, names in GPU_BACKENDS.items() for backend in names]


def _gpu_compare(kind: str, backend: str, dtype: torch.dtype, successor_logit: float = 0.0, configs=GPU_CONFIGS):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hf = build_hf_model(kind, seed=0, dtype=dtype, device="cuda", successor_logit=successor_logit, **configs[kind])
    reasons = _fits(wrap_hf_model(hf), backend, dtype, DeviceInfo.current())
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    report = compare_with_transformers(
        hf, _prompts(GPU_PROMPT_LENGTHS), max_new_tokens=GPU_MAX_NEW_TOKENS,
        attention_config=AttentionConfig(backend=backend), engine_config=GPU_ENGINE,
    )
    print(report.summary())
    assert report.backend == backend
    return report


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", GPU_CASES, ids=lambda v: str(v))
def test_engine_matches_transformers_generate_gpu_bf16_wide_margin(kind, backend):
    """The issue's criterion: in bf16 on the GPU, identical tokens and logits within tolerance on the seeded
    wide-margin model. Identical tokens rule out gross errors (the successor wins by far more than bf16 rounding:
    CPU bf16 proxy, seeds 0-4: smallest margin 7-19 against logit errors <= 0.4); the logit tolerance checks
    attention's precision."""
    report = _gpu_compare(kind, backend, torch.bfloat16, MARGIN_SUCCESSOR_LOGIT, MARGIN_CONFIGS)
    assert report.all_identical, f"{report.summary()}; first mismatch {report.first_mismatch}"
    # bf16 rounding of logits up to ~60; CPU proxy 0.25-0.40 (<= 0.7% of the largest logit).
    assert report.max_logit_diff <= 0.02 * report.max_abs_logit, report.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("kind,backend", GPU_CASES, ids=lambda v: str(v))
def test_engine_matches_transformers_generate_gpu_bf16_random_near_ties(kind, backend):
    """The plain random model, whose greedy choices depend on attention (not on a successor table) but are often
    near-ties: tokens identical until a sequence meets one, and the parting must be a rounding decision."""
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
