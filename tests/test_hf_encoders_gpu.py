"""GPU twins of tests/test_hf_encoders.py: BERT and Whisper served through layer groups in bfloat16 on the GPU, for
every backend that declares the group's attention type and fits it there (a group whose backend does not fit is
skipped with the registry's reasons). Run on the GPU host: ``pytest -m gpu tests/test_hf_encoders_gpu.py``.

Geometries use head size 64 (what every GPU backend serves). Bounds come from CPU bfloat16 proxies of the same
runs (reference backend): BERT hidden states within 0.047 of transformers' float32 forward (values up to ~4.5);
Whisper's wide-margin model gives transformers' float32 tokens, logits within 0.25 of transformers' bfloat16
forward (logits up to ~48).
"""

import random

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, DeviceInfo, LayerGroupsConfig, explain_layers  # noqa: E402
from attnbackends.engine import EncoderDecoderEngine, EncoderEngine, EngineConfig  # noqa: E402
from examples.hf_encoder_models import (  # noqa: E402
    WHISPER_SUCCESSOR_LOGIT,
    HFBertEncoder,
    HFWhisperModel,
    random_mel_features,
    tiny_bert,
    tiny_whisper,
    transformers_bert_embeddings,
    transformers_whisper_forward_greedy,
    transformers_whisper_generate,
    transformers_whisper_logits,
)

pytestmark = pytest.mark.gpu

BERT_GEOMETRY = dict(hidden_size=128, intermediate_size=256, max_position_embeddings=256)  # 2 heads of 64
WHISPER_GEOMETRY = dict(d_model=128, encoder_ffn_dim=256, decoder_ffn_dim=256, max_source_positions=64,
                        max_target_positions=128)
START, EOS = 1, 2
# The long prompt has more tokens (71) than the encoder output (64): one cross-attention chunk with more queries
# than keys. Two requests run at once, the third waits.
WHISPER_PROMPTS = [[START] + list(range(30, 100)), [START], [START]]
WHISPER_ENGINE = EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=128, max_num_reqs=2)
NEW_TOKENS = 12

ENCODER_BACKENDS = ("triton", "reference")  # the registered backends that declare encoder attention types
DECODER_BACKENDS = ("flashinfer", "flash_attn", "triton", "reference")


def _skip_unless_fits(specs, config):
    """Skip (naming the registry's reasons) where a pinned backend does not fit its group on this GPU."""
    for name, ex in explain_layers(specs, DeviceInfo.current(), config).items():
        if ex.chosen is None:
            row = {r.name: r for r in ex.rows}[ex.requested]
            pytest.skip(f"group {name}: {ex.requested} cannot run here: {'; '.join(row.reasons)}")


@pytest.mark.parametrize("backend", ENCODER_BACKENDS)
def test_bert_bf16_gpu(backend):
    rng = random.Random(0)
    sequences = [[rng.randrange(128) for _ in range(n)] for n in (1, 7, 33, 64, 100, 200)]
    want = transformers_bert_embeddings(tiny_bert(seed=0, **BERT_GEOMETRY).cuda(), sequences)
    model = HFBertEncoder(tiny_bert(seed=0, **BERT_GEOMETRY))
    config = LayerGroupsConfig(groups={"encoder": backend})
    _skip_unless_fits(model.layer_specs(torch.bfloat16, 16), config)
    engine = EncoderEngine(model, device="cuda", dtype=torch.bfloat16, attention_config=config,
                           max_num_batched_tokens=256)
    got = engine.encode(sequences)
    assert engine.backend == f"encoder={backend}" and engine.num_steps == 2
    for i, (ours, theirs) in enumerate(zip(got, want)):
        torch.testing.assert_close(ours.float().cpu(), theirs, atol=0.15, rtol=0.0, msg=lambda m: f"sequence {i}: {m}")


def _whisper_case(dtype, pins):
    seed = 0
    reference = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT, **WHISPER_GEOMETRY).cuda()
    features = random_mel_features(reference, len(WHISPER_PROMPTS), seed=seed)
    want = [transformers_whisper_forward_greedy(reference, features[0], WHISPER_PROMPTS[0], NEW_TOKENS, EOS)]
    want += transformers_whisper_generate(reference, features[1:], NEW_TOKENS)
    model = HFWhisperModel(tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT, **WHISPER_GEOMETRY))
    config = LayerGroupsConfig(groups=pins)
    _skip_unless_fits(model.layer_specs(dtype, WHISPER_ENGINE.block_size), config)
    engine = EncoderDecoderEngine(model, WHISPER_ENGINE, device="cuda", dtype=dtype, attention_config=config)
    got = engine.generate(features, WHISPER_PROMPTS, NEW_TOKENS, eos_token_id=EOS)
    print(engine.groups)
    assert got.backend == ",".join(f"{name}={pins[name]}" for name in ("encoder", "full", "cross"))
    assert got.tokens == want
    same_dtype = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT, **WHISPER_GEOMETRY).to("cuda", dtype)
    worst, scale = 0.0, 0.0
    for x, prompt, tokens, logits in zip(features, WHISPER_PROMPTS, got.tokens, got.logits):
        theirs = transformers_whisper_logits(same_dtype, x, prompt + tokens)[len(prompt) - 1: -1]
        worst = max(worst, float((logits - theirs).abs().max()))
        scale = max(scale, float(theirs.abs().max()))
    return worst, scale


@pytest.mark.parametrize("encoder_backend", ENCODER_BACKENDS)
@pytest.mark.parametrize("decoder_backend", DECODER_BACKENDS)
def test_whisper_bf16_gpu_wide_margin(encoder_backend, decoder_backend):
    """The encoder and cross groups on one backend, the decoder's self-attention on another: tokens equal to
    transformers' float32 ones, logits to bf16 rounding of transformers' bf16 forward (<= 2% of the largest)."""
    pins = {"encoder": encoder_backend, "full": decoder_backend, "cross": encoder_backend}
    worst, scale = _whisper_case(torch.bfloat16, pins)
    print(f"{pins}: max |logit diff| {worst:.3g} with logits up to {scale:.3g}")
    assert worst <= 0.02 * scale


@pytest.fixture
def no_tf32(monkeypatch):
    """float32 convolutions and matrix products without TF32 (the engine runs Whisper's convolutions on a batch of
    inputs, transformers on one at a time: TF32 would round them differently)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def test_whisper_float32_gpu_reference(no_tf32):
    """float32 (the reference backend has it): logits to float32 rounding."""
    worst, scale = _whisper_case(torch.float32, {"encoder": "reference", "full": "reference", "cross": "reference"})
    assert worst < 1e-3, f"max |logit diff| {worst:.3g} with logits up to {scale:.3g}"


def test_bert_float32_gpu_reference(no_tf32):
    sequences = [list(range(1, 40)), [5], list(range(100, 128)) * 3]
    want = transformers_bert_embeddings(tiny_bert(seed=1, **BERT_GEOMETRY).cuda(), sequences)
    engine = EncoderEngine(HFBertEncoder(tiny_bert(seed=1, **BERT_GEOMETRY)), device="cuda",
                           attention_config=AttentionConfig(backend="reference"))
    for ours, theirs in zip(engine.encode(sequences), want):
        torch.testing.assert_close(ours.cpu(), theirs, atol=1e-4, rtol=1e-4)
