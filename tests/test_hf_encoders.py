"""transformers' BERT (encoder-only) and Whisper (encoder-decoder) with random weights, served through the library's
layer groups and compared with transformers itself.

- BERT on :class:`~attnbackends.engine.EncoderEngine`: sequences packed varlen (no padding, several per step, the
  token budget splitting the batch) against transformers' forward over a right-padded batch with an attention
  mask; float32 on the reference backend, float16 on interpreted Triton (Triton has no float32 path).
- Whisper on :class:`~attnbackends.engine.EncoderDecoderEngine` with one group per attention type (``encoder``,
  ``full``, ``cross``), each pinned to its own backend: greedy tokens equal to transformers' ``generate`` (decoder
  prompt = the start token) or to greedy decoding by transformers' forward (longer decoder prompts, chunked), and
  logits against transformers' forward. float32 on the reference backend with the plain random model; float16
  with interpreted Triton groups on the wide-margin model (its greedy choices survive low-precision rounding).
"""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from attnbackends import AttentionConfig, AttentionSpec, LayerGroupsConfig  # noqa: E402
from attnbackends.engine import EncoderDecoderEngine, EncoderEngine, EngineConfig, GroupedPagedEngine  # noqa: E402
from examples.engine.hf_models.hf_common import successor_permutation  # noqa: E402
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

# Lengths 4, 30, 1, 14, 41: a single token, several pages' worth, longer than half the step budget.
SEQUENCES = [[5, 17, 99, 3], list(range(10, 40)), [7], [3] * 12 + [100, 101], list(range(60, 19, -1))]
TOKEN_TYPES = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in SEQUENCES]  # sentence A, then B

START, EOS = 1, 2  # tiny_whisper's decoder start and end tokens
# One encoder pass per request (16 encoder positions, budget 16), two requests running, a third waiting.
WHISPER_ENGINE = EngineConfig(block_size=16, num_blocks=24, max_num_batched_tokens=16, max_num_reqs=2)


# ------------------------------------------------------------------------------------------------------- BERT
def test_bert_float32_reference_matches_transformers():
    bert = tiny_bert(seed=1)
    want = transformers_bert_embeddings(bert, SEQUENCES, TOKEN_TYPES)
    engine = EncoderEngine(HFBertEncoder(bert), attention_config=AttentionConfig(backend="reference"),
                           max_num_batched_tokens=48, max_num_reqs=3)
    assert engine.backend == "encoder=reference"
    got = engine.encode(SEQUENCES, token_type_ids=TOKEN_TYPES)
    assert engine.num_steps == 3  # [4, 30, 1] | [14] | [41]: the budget and the request limit split the batch
    for i, (ours, theirs) in enumerate(zip(got, want)):
        assert ours.shape == (len(SEQUENCES[i]), 64)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5, msg=lambda m: f"sequence {i}: {m}")


def test_bert_packing_keeps_sequences_apart():
    """The comparison can fail: the same packed batch attended as ONE sequence (tokens seeing other sequences)
    differs from transformers for every sequence that shares a step."""

    class OneSequence(EncoderEngine):
        def metadata(self, lengths):
            return super().metadata([sum(lengths)])

    bert = tiny_bert(seed=1)
    want = transformers_bert_embeddings(bert, SEQUENCES[:3])
    got = OneSequence(HFBertEncoder(bert), attention_config=AttentionConfig(backend="reference")).encode(SEQUENCES[:3])
    assert all(float((a - b).abs().max()) > 0.1 for a, b in zip(got, want))


def test_bert_float16_triton_against_reference_and_transformers():
    """Interpreted Triton and the reference backend serve the same float16 model: they agree to float16 rounding
    of attention, and both agree with transformers' float32 forward to float16 rounding of the whole model."""
    sequences = [SEQUENCES[0], SEQUENCES[3], SEQUENCES[2], list(range(90, 111))]
    want = transformers_bert_embeddings(tiny_bert(seed=2), sequences)
    runs = {}
    for backend in ("triton", "reference"):
        engine = EncoderEngine(HFBertEncoder(tiny_bert(seed=2)), dtype=torch.float16, max_num_batched_tokens=32,
                               attention_config=LayerGroupsConfig(groups={"encoder": backend}))
        assert engine.backend == f"encoder={backend}"
        runs[backend] = engine.encode(sequences)
    for i, (tri, ref, theirs) in enumerate(zip(runs["triton"], runs["reference"], want)):
        assert tri.dtype == torch.float16
        # CPU: max |diff| 0.0047 against transformers (hidden states of norm ~1 per element), Triton = reference
        torch.testing.assert_close(tri.float(), ref.float(), atol=4e-3, rtol=4e-3, msg=lambda m: f"seq {i}: {m}")
        torch.testing.assert_close(tri.float(), theirs, atol=1.5e-2, rtol=1e-2, msg=lambda m: f"seq {i}: {m}")


def test_encoder_engine_bad_input():
    bert = tiny_bert(seed=0)
    engine = EncoderEngine(HFBertEncoder(bert), max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="sequence 1 has 20 tokens, more than max_num_batched_tokens = 16"):
        engine.encode([[1, 2], list(range(20))])
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        engine.encode([[]])
    with pytest.raises(ValueError, match="token_type_ids must give one id per token"):
        engine.encode([[1, 2]], token_type_ids=[[0]])

    class Causal(HFBertEncoder):
        def layer_specs(self, dtype, block_size):
            return [AttentionSpec(**{**s.model_dump(), "attn_type": "decoder"})
                    for s in super().layer_specs(dtype, block_size)]

    with pytest.raises(ValueError, match=r"layers \[0, 1\] are not encoder_only layers"):
        EncoderEngine(Causal(bert))


# ---------------------------------------------------------------------------------------------------- Whisper
def _transformers_reference(hf, features, prompts, max_new_tokens):
    """transformers' greedy tokens: its ``generate`` where the decoder prompt is the start token (what Whisper's
    generate builds itself), greedy decoding by its forward otherwise."""
    out = []
    for x, prompt in zip(features, prompts):
        if prompt == [START]:
            out.append(transformers_whisper_generate(hf, [x], max_new_tokens)[0])
        else:
            out.append(transformers_whisper_forward_greedy(hf, x, prompt, max_new_tokens, EOS))
    return out


def _check_logits(hf, features, prompts, result, atol, rtol):
    """The engine's logits at every generated step against transformers' forward over the engine's own tokens."""
    for i, (x, prompt, tokens, logits) in enumerate(zip(features, prompts, result.tokens, result.logits)):
        want = transformers_whisper_logits(hf, x, prompt + tokens)[len(prompt) - 1: -1]
        torch.testing.assert_close(logits, want, atol=atol, rtol=rtol, msg=lambda m: f"request {i}: {m}")


def test_whisper_float32_generate_token_for_token():
    hf = tiny_whisper(seed=1)
    features = random_mel_features(hf, 3, seed=1)
    want = transformers_whisper_generate(hf, features, 8)
    engine = EncoderDecoderEngine(HFWhisperModel(hf), WHISPER_ENGINE,
                                  attention_config=LayerGroupsConfig(default="reference"))
    assert [(g.name, g.layers) for g in engine.groups.groups] == [("encoder", (0, 1)), ("full", (2, 3)),
                                                                  ("cross", (4, 5))]
    got = engine.generate(features, [[START]] * 3, 8, eos_token_id=EOS)
    assert got.tokens == want
    _check_logits(hf, features, [[START]] * 3, got, atol=1e-4, rtol=1e-4)
    assert engine.num_encoder_passes == 3  # each request's encoder ran once, when it was admitted
    assert all(pool.num_free == pool.num_blocks for pool in engine.pools)  # cross pages came back too


def test_whisper_long_decoder_prompts_chunked_in_debug_mode():
    """Decoder prompts longer than the encoder output (21 > 16 encoder positions: a cross-attention query chunk
    with more queries than keys) and longer than the step budget (chunked prefill), every batch validated in
    debug mode."""
    hf = tiny_whisper(seed=3)
    features = random_mel_features(hf, 3, seed=3)
    prompts = [[START] + list(range(20, 40)), [START], [START, 5, 6, 7, 8, 9, 10]]
    want = _transformers_reference(hf, features, prompts, 6)
    engine = EncoderDecoderEngine(
        HFWhisperModel(hf), EngineConfig(block_size=16, num_blocks=24, max_num_batched_tokens=24, max_num_reqs=3),
        attention_config=LayerGroupsConfig(default=AttentionConfig(backend="reference", debug=True)))
    got = engine.generate(features, prompts, 6, eos_token_id=EOS)
    assert got.tokens == want
    _check_logits(hf, features, prompts, got, atol=1e-4, rtol=1e-4)
    assert engine.scheduled_tokens[0] == 24  # the 21-token prompt and a chunk of the next one in one step


def test_whisper_cross_attention_over_half_the_encoder_is_caught():
    """The comparison can fail: cross-attention seeing only the first half of each request's encoder output."""

    class HalfCross(EncoderDecoderEngine):
        def _step_commons(self, batch, common):
            commons = super()._step_commons(batch, common)
            for g in self.cross_groups:
                c = commons[g]
                commons[g] = dataclasses.replace(c, seq_lens=c.seq_lens // 2, seq_lens_cpu=c.seq_lens_cpu // 2,
                                                 max_seq_len=c.max_seq_len // 2)
            return commons

    hf = tiny_whisper(seed=1)
    features = random_mel_features(hf, 1, seed=1)
    got = HalfCross(HFWhisperModel(hf), WHISPER_ENGINE, attention_config=LayerGroupsConfig(default="reference")
                    ).generate(features, [[START]], 2)
    want = transformers_whisper_logits(hf, features[0], [START])[0]
    assert float((got.logits[0][0] - want).abs().max()) > 0.1


@pytest.mark.parametrize("pins", [
    {"encoder": "triton", "full": "reference", "cross": "triton"},
    {"encoder": "reference", "full": "triton", "cross": "reference"},
], ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_whisper_float16_triton_groups_wide_margin(pins):
    """Groups on interpreted Triton and the reference backend in one engine, the model in float16 (the
    wide-margin model): tokens equal to transformers' float32 ones, logits to float16 rounding of transformers'
    float16 forward."""
    seed = 4
    reference32 = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT)
    features = random_mel_features(reference32, 2, seed=seed)
    prompts = [[START] + list(range(30, 50)), [START]]
    want = _transformers_reference(reference32, features, prompts, 5)
    engine = EncoderDecoderEngine(
        HFWhisperModel(tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT)),
        EngineConfig(block_size=16, num_blocks=16, max_num_batched_tokens=32, max_num_reqs=2),
        dtype=torch.float16, attention_config=LayerGroupsConfig(groups=pins))
    got = engine.generate(features, prompts, 5, eos_token_id=EOS)
    assert got.backend == ",".join(f"{name}={pins[name]}" for name in ("encoder", "full", "cross"))
    assert got.tokens == want
    reference16 = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT).half()
    # CPU: max |diff| 0.016-0.031 with logits up to ~53 (the bound is ~3x that)
    scale = max(float(logits.abs().max()) for logits in got.logits)
    _check_logits(reference16, features, prompts, got, atol=0.002 * scale, rtol=0.0)


@pytest.mark.parametrize("geometry", [{}, {"d_model": 128, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256}],
                         ids=["cpu_geometry", "gpu_geometry"])
@pytest.mark.parametrize("seed", [0, 1])
def test_wide_margin_whisper_survives_low_precision(geometry, seed):
    """What makes the float16 / bfloat16 token checks sound, with CPU bfloat16 as the proxy for the GPU: on the
    wide-margin model every greedy token is the successor of the previous one, bfloat16 picks the same tokens as
    float32, and the smallest top-2 margin is >= 10x the largest bfloat16 logit error."""
    hf = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT, **geometry)
    features = random_mel_features(hf, 2, seed=seed)
    tokens = transformers_whisper_generate(hf, features, 10)
    low = tiny_whisper(seed=seed, successor_logit=WHISPER_SUCCESSOR_LOGIT, **geometry).to(torch.bfloat16)
    assert transformers_whisper_generate(low, features, 10) == tokens
    succ = successor_permutation(hf.config.vocab_size, seed)
    margin, error = float("inf"), 0.0
    for x, t in zip(features, tokens):
        seq = [START] + t
        assert all(int(succ[a]) == b for a, b in zip(seq[:-1], seq[1:]) if a != EOS)
        want = transformers_whisper_logits(hf, x, seq)[:-1]
        top2 = want.topk(2, dim=-1).values
        margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
        error = max(error, float((transformers_whisper_logits(low, x, seq)[:-1] - want).abs().max()))
    assert margin >= 10 * error, f"smallest top-2 margin {margin:.3g} vs bfloat16 logit error {error:.3g}"


def test_encoder_decoder_engine_bad_input():
    hf = tiny_whisper(seed=0)
    engine = EncoderDecoderEngine(HFWhisperModel(hf), WHISPER_ENGINE)
    features = random_mel_features(hf, 2)
    with pytest.raises(ValueError, match="got 2 encoder inputs for 1 decoder prompts"):
        engine.generate(features, [[START]], 2)
    with pytest.raises(ValueError, match="decoder prompt 1 is empty"):
        engine.generate(features, [[START], []], 2)
    with pytest.raises(ValueError, match=r"\[num_mel_bins, 2 \* max_source_positions\] = \[8, 32\]"):
        engine.generate([torch.randn(8, 30)], [[START]], 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate(features, [[START]] * 2, 0)
    with pytest.raises(ValueError, match="encoder input 0 makes 16 encoder tokens"):
        EncoderDecoderEngine(HFWhisperModel(hf), dataclasses.replace(WHISPER_ENGINE, max_num_batched_tokens=8)
                             ).generate(features[:1], [[START]], 2)

    class NoCross(HFWhisperModel):
        def layer_specs(self, dtype, block_size):
            return [s if s.attn_type.value != "encoder_decoder" else AttentionSpec(**{**s.model_dump(),
                                                                                       "attn_type": "encoder"})
                    for s in super().layer_specs(dtype, block_size)]

    with pytest.raises(ValueError, match="this one has no encoder_decoder layers"):
        EncoderDecoderEngine(NoCross(hf), WHISPER_ENGINE)
    with pytest.raises(NotImplementedError, match="EncoderDecoderEngine encoder-decoder models"):
        GroupedPagedEngine(HFWhisperModel(hf), WHISPER_ENGINE)


def test_groups_explain_every_attention_type():
    engine = EncoderDecoderEngine(HFWhisperModel(tiny_whisper(seed=0)), WHISPER_ENGINE)
    text = str(engine.groups)
    for name in ("group encoder: layers 0-1", "group full: layers 2-3", "group cross: layers 4-5"):
        assert name in text
    cross = engine.groups["cross"].explanation
    rows = {r.name: r for r in cross.rows}
    assert cross.chosen == "reference"
    assert any("attn_type encoder_decoder not supported" in reason for reason in rows["flashinfer"].reasons)
