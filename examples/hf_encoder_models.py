"""Hugging Face ``transformers`` encoder models served through the library's layer groups.

- :class:`HFBertEncoder` over ``BertModel``: an encoder-only embedder. Every layer's self-attention is an
  ``encoder_only`` layer (bidirectional, no KV cache) on :class:`~attnbackends.engine.EncoderEngine`; sequences
  are packed varlen, without padding.
- :class:`HFWhisperModel` over ``WhisperForConditionalGeneration``: an encoder-decoder served on
  :class:`~attnbackends.engine.EncoderDecoderEngine` with one layer group per attention type: ``encoder`` (the
  audio encoder's bidirectional self-attention, no cache), ``full`` (the decoder's causal self-attention over the
  paged cache) and ``cross`` (decoder queries over the encoder output's keys and values, cached once per request).

How transformers' attention maps onto :class:`~attnbackends.AttentionSpec` (transformers 5.x, eager attention):
BERT's ``eager_attention_forward`` computes ``softmax(q k^T * head_dim**-0.5 + mask)``, its padding mask only
hiding other sequences' padding, which packing makes unnecessary. Whisper multiplies the query projection by
``head_dim**-0.5`` before attention and calls attention with scaling 1.0; the adapter does the same (spec
``scale=1.0``) so float32 runs round alike. Whisper's encoder has no padding mask (every input is
``2 * max_source_positions`` mel frames), its cross-attention sees all ``max_source_positions`` encoder outputs.
The adapters call the transformers modules themselves (embeddings, convolutions, projections, layer norms, MLPs)
and hand attention to the library; transformers' own attention and cache are never used.

Run ``python -m examples.hf_encoder_models`` from the checkout's root to compare both with transformers.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnbackends import AttentionSpec, AttentionType
from examples.engine.hf_models.hf_common import require_transformers, successor_permutation

__all__ = [
    "HFBertEncoder",
    "HFWhisperModel",
    "WHISPER_SUCCESSOR_LOGIT",
    "WIDE_MARGIN_BRANCH_SCALE",
    "WIDE_MARGIN_POSITION_SCALE",
    "add_whisper_successor_bigram",
    "random_mel_features",
    "seed_encoder_weights",
    "tiny_bert",
    "tiny_whisper",
    "transformers_bert_embeddings",
    "transformers_whisper_forward_greedy",
    "transformers_whisper_generate",
    "transformers_whisper_logits",
]

# successor_logit of the wide-margin Whisper (tiny_whisper). Measured on CPU bfloat16 against float32 (seeds 0-2,
# 3 inputs, 12 greedy steps): smallest top-2 margin 7-10 logits on d_model 64 and 12-15 on d_model 128, against
# bfloat16 logit errors <= 0.26; every token the successor of the previous one
# (tests/test_hf_encoders.py::test_wide_margin_whisper_survives_low_precision keeps it so).
WHISPER_SUCCESSOR_LOGIT = 40.0
# The wide-margin Whisper's decoder: residual-branch outputs (attention out_proj, fc2) and learned positions scaled
# down, so that the token embedding keeps a large share of the last residual stream. Without it the successor's
# margin drops below 1 logit on d_model 64 (the branches and positions, each as large as the embedding, swamp it).
WIDE_MARGIN_BRANCH_SCALE = 0.5
WIDE_MARGIN_POSITION_SCALE = 0.3


@torch.no_grad()
def seed_encoder_weights(model: nn.Module, seed: int = 0, logit_scale: float = 4.0) -> nn.Module:
    """Seeded weights with peaked attention and well-separated greedy choices: matrices std 1/sqrt(fan_in),
    embeddings std 1 (Whisper's fixed sinusoidal encoder positions are kept), convolutions std 1/sqrt(fan_in),
    layer-norm weights 1 + 0.1 N(0, 1), biases 0.02 N(0, 1), an untied LM head ``logit_scale`` times wider."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("encoder.embed_positions.weight"):
            continue
        if "norm" in name.lower() and name.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            value = 0.02 * torch.randn(p.shape, generator=gen)
        elif "embed" in name or "embeddings" in name:
            value = torch.randn(p.shape, generator=gen)
        else:
            fan_in = p[0].numel()
            value = torch.randn(p.shape, generator=gen) * fan_in**-0.5
            if name.startswith("proj_out"):
                value *= logit_scale
        p.copy_(value.to(p.dtype))
    return model


# ------------------------------------------------------------------------------------------------------ BERT
def tiny_bert(seed: int = 0, **overrides: Any) -> nn.Module:
    """A float32 ``BertModel`` (no pooler) with seeded weights: 2 layers, 2 heads of 32 (hidden 64), vocab 128,
    positions up to 64, two token types."""
    from transformers import BertConfig, BertModel

    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    config = BertConfig(**kwargs)
    config._attn_implementation = "eager"
    return seed_encoder_weights(BertModel(config, add_pooling_layer=False), seed).eval()


class HFBertEncoder(nn.Module):
    """An :class:`~attnbackends.engine.EncoderEngineModel` over ``BertModel``: the last hidden state of packed
    sequences."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        cfg = hf_model.config
        if cfg.is_decoder or getattr(cfg, "add_cross_attention", False):
            raise NotImplementedError("HFBertEncoder serves BERT as an encoder (is_decoder=False, no cross-attention)")
        self.hf = hf_model
        self.num_layers = cfg.num_hidden_layers
        attn = hf_model.encoder.layer[0].attention.self
        self.num_heads, self.head_dim, self.scaling = attn.num_attention_heads, attn.attention_head_size, attn.scaling

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        spec = AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.num_heads, head_size=self.head_dim,
                             dtype=dtype, block_size=block_size, attn_type=AttentionType.ENCODER_ONLY,
                             scale=self.scaling)
        return [spec] * self.num_layers

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions (from 0 in each sequence), token_type_ids : [T] int64 -> last hidden state [T, hidden]."""
        bert = self.hf
        t = tokens.shape[0]
        x = bert.embeddings(input_ids=tokens[None], position_ids=positions[None],
                            token_type_ids=None if token_type_ids is None else token_type_ids[None])[0]
        for i, layer in enumerate(bert.encoder.layer):
            a = layer.attention.self
            q, k, v = (proj(x).view(t, self.num_heads, self.head_dim) for proj in (a.query, a.key, a.value))
            h = layer.attention.output(attn(i, q, k, v).reshape(t, -1), x)  # dense, residual, LayerNorm
            x = layer.output(layer.intermediate(h), h)
        return x


@torch.inference_mode()
def transformers_bert_embeddings(hf_model: nn.Module, sequences: Sequence[Sequence[int]],
                                 token_type_ids: Optional[Sequence[Sequence[int]]] = None) -> list[torch.Tensor]:
    """transformers' own forward over one right-padded batch with an attention mask: [len, hidden] float32 per
    sequence, on the CPU."""
    n = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        if token_type_ids is not None:
            types[i, : len(s)] = torch.tensor(token_type_ids[i])
    device = next(hf_model.parameters()).device
    out = hf_model(input_ids=ids.to(device), attention_mask=mask.to(device),
                   token_type_ids=types.to(device)).last_hidden_state.float().cpu()
    return [out[i, : len(s)] for i, s in enumerate(sequences)]


# --------------------------------------------------------------------------------------------------- Whisper
def tiny_whisper(seed: int = 0, successor_logit: float = 0.0, **overrides: Any) -> nn.Module:
    """A float32 ``WhisperForConditionalGeneration`` with seeded weights: 2 encoder and 2 decoder layers, 2 heads of
    32 (d_model 64), 8 mel bins, 16 encoder positions (32 input frames), vocab 128 (pad 0, decoder start 1, end 2),
    no suppressed tokens, an untied LM head.

    successor_logit : > 0 builds the wide-margin model (``WHISPER_SUCCESSOR_LOGIT``): the decoder's residual
        branches and positions scaled by ``WIDE_MARGIN_BRANCH_SCALE`` / ``WIDE_MARGIN_POSITION_SCALE``, then the
        successor bigram (:func:`add_whisper_successor_bigram`), so that greedy choices survive float16 / bfloat16
        rounding. Attention still moves every logit (the logit comparisons check it); identical tokens then rule
        out gross errors only.
    """
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    kwargs: dict[str, Any] = dict(
        vocab_size=128, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=16,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None, tie_word_embeddings=False, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0,
    )
    kwargs.update(overrides)
    config = WhisperConfig(**kwargs)
    config._attn_implementation = "eager"
    model = seed_encoder_weights(WhisperForConditionalGeneration(config), seed).eval()
    if successor_logit:
        with torch.no_grad():
            for name, p in model.model.decoder.named_parameters():
                if name.endswith(("out_proj.weight", "fc2.weight")):
                    p.mul_(WIDE_MARGIN_BRANCH_SCALE)
            model.model.decoder.embed_positions.weight.mul_(WIDE_MARGIN_POSITION_SCALE)
        add_whisper_successor_bigram(model, successor_logit, seed)
    return model


def random_mel_features(model: nn.Module, num: int, seed: int = 0) -> list[torch.Tensor]:
    """``num`` seeded random inputs, each [num_mel_bins, 2 * max_source_positions] float32."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=gen) for _ in range(num)]


@torch.no_grad()
def add_whisper_successor_bigram(model: nn.Module, successor_logit: float, seed: int = 0) -> nn.Module:
    """The wide-margin successor bigram of :func:`examples.engine.hf_models.hf_common.add_successor_bigram`, for
    Whisper's decoder (final LayerNorm, learned positions): LM-head row ``succ(t)`` gains ``successor_logit *
    n_t / (|n_t|^2 share_t)``, ``n_t`` token t's embedding as the final LayerNorm scales it (without its bias) and
    ``share_t`` how much of it survives in the normalised last residual stream, measured by one teacher-forced
    forward over seeded random decoder tokens (and random mel input)."""
    decoder = model.model.decoder
    embed = decoder.embed_tokens.weight
    head = model.proj_out.weight
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("the successor bigram needs an untied LM head (tie_word_embeddings=False)")
    vocab = head.shape[0]
    norm = decoder.layer_norm
    e = embed.detach().float()
    centred = e - e.mean(-1, keepdim=True)
    n = norm.weight.float() * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    gen = torch.Generator().manual_seed(20_011 + seed)
    tokens = torch.randint(0, vocab, (8, model.config.max_target_positions), generator=gen)
    features = torch.stack(random_mel_features(model, 8, seed=30_011 + seed))
    out = model.model(input_features=features, decoder_input_ids=tokens, use_cache=False).last_hidden_state
    x = out.float() - norm.bias.float()
    nt = n[tokens]
    share = ((x * nt).sum(-1) / nt.pow(2).sum(-1)).flatten()
    flat = tokens.flatten()
    count = torch.bincount(flat, minlength=vocab)
    share_t = torch.zeros(vocab).index_add_(0, flat, share) / count.clamp(min=1)
    share_t = torch.where(count > 0, share_t, share.mean()).clamp(min=0.1)
    succ = successor_permutation(vocab, seed)
    delta = successor_logit * n / (n.pow(2).sum(-1, keepdim=True) * share_t[:, None])
    head.index_add_(0, succ, delta.to(head.dtype))
    return model


class HFWhisperModel(nn.Module):
    """An :class:`~attnbackends.engine.EncoderDecoderEngineModel` over ``WhisperForConditionalGeneration``.

    Attention layers are numbered: encoder self-attention ``0 .. E-1``, decoder self-attention ``E .. E+D-1``,
    cross-attention ``E+D .. E+2D-1`` (E encoder, D decoder layers). An encoder input is one request's mel
    features [num_mel_bins, 2 * max_source_positions].
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        self.num_encoder_layers, self.num_decoder_layers = cfg.encoder_layers, cfg.decoder_layers
        self.num_layers = cfg.encoder_layers + 2 * cfg.decoder_layers
        self.encoder_positions = cfg.max_source_positions
        self.num_mel_bins = cfg.num_mel_bins
        self._heads = {AttentionType.ENCODER: cfg.encoder_attention_heads,
                       AttentionType.DECODER: cfg.decoder_attention_heads,
                       AttentionType.ENCODER_DECODER: cfg.decoder_attention_heads}
        self.d_model = cfg.d_model

    def attn_type(self, layer: int) -> AttentionType:
        if layer < self.num_encoder_layers:
            return AttentionType.ENCODER
        if layer < self.num_encoder_layers + self.num_decoder_layers:
            return AttentionType.DECODER
        return AttentionType.ENCODER_DECODER

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        specs = []
        for layer in range(self.num_layers):
            kind = self.attn_type(layer)
            heads = self._heads[kind]
            specs.append(AttentionSpec(num_heads=heads, num_kv_heads=heads, head_size=self.d_model // heads,
                                       dtype=dtype, block_size=block_size, attn_type=kind, scale=1.0))
        return specs

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {}

    def encoder_len(self, encoder_input: torch.Tensor) -> int:
        frames = 2 * self.encoder_positions
        if tuple(encoder_input.shape) != (self.num_mel_bins, frames):
            raise ValueError(f"a Whisper encoder input is [num_mel_bins, 2 * max_source_positions] = "
                             f"[{self.num_mel_bins}, {frames}] mel features; got {tuple(encoder_input.shape)}")
        return self.encoder_positions

    @staticmethod
    def _query(a: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Whisper's scaled query projection [T, d] -> [T, H, Dh] (scaled before attention, as transformers does)."""
        return (a.q_proj(h) * a.scaling).view(h.shape[0], a.num_heads, a.head_dim)

    @staticmethod
    def _key_value(a: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (a.k_proj(h).view(h.shape[0], a.num_heads, a.head_dim),
                a.v_proj(h).view(h.shape[0], a.num_heads, a.head_dim))

    @staticmethod
    def _mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))

    def encode(self, encoder_inputs: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Mel features of B requests -> encoder output [B * max_source_positions, d_model]."""
        enc = self.hf.model.encoder
        param = enc.conv1.weight
        feats = torch.stack([x.to(device=param.device, dtype=param.dtype) for x in encoder_inputs])
        h = nn.functional.gelu(enc.conv1(feats))
        h = nn.functional.gelu(enc.conv2(h)).permute(0, 2, 1)  # [B, S, d]
        x = (h + enc.embed_positions.weight).reshape(-1, self.d_model)  # requests one after another
        for i, layer in enumerate(enc.layers):
            h = layer.self_attn_layer_norm(x)
            a = layer.self_attn
            o = attn(i, self._query(a, h), *self._key_value(a, h))
            x = x + a.out_proj(o.reshape(x.shape[0], -1))
            x = x + self._mlp(layer, x)
            if x.dtype == torch.float16:  # transformers clamps float16 encoder states the same way
                clamp = torch.finfo(x.dtype).max - 1000
                x = x.clamp(min=-clamp, max=clamp)
        return enc.layer_norm(x)

    def cross_key_value(self, layer: int, encoder_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        j = layer - self.num_encoder_layers - self.num_decoder_layers
        return self._key_value(self.hf.model.decoder.layers[j].encoder_attn, encoder_states)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""
        dec = self.hf.model.decoder
        x = dec.embed_tokens(tokens) + dec.embed_positions.weight[positions]
        t = x.shape[0]
        for j, layer in enumerate(dec.layers):
            a, c = layer.self_attn, layer.encoder_attn
            h = layer.self_attn_layer_norm(x)
            o = attn(self.num_encoder_layers + j, self._query(a, h), *self._key_value(a, h))
            x = x + a.out_proj(o.reshape(t, -1))
            h = layer.encoder_attn_layer_norm(x)
            o = attn(self.num_encoder_layers + self.num_decoder_layers + j, self._query(c, h), None, None)
            x = x + c.out_proj(o.reshape(t, -1))
            x = x + self._mlp(layer, x)
        x = dec.layer_norm(x)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.hf.proj_out(x).float()


@torch.inference_mode()
def transformers_whisper_generate(hf_model: nn.Module, features: Sequence[torch.Tensor], max_new_tokens: int
                                  ) -> list[list[int]]:
    """transformers' Whisper ``generate`` (greedy, short-form), one input at a time: the new tokens after the
    decoder start token, up to and including the end token if one is chosen."""
    cfg = hf_model.config
    param = next(hf_model.parameters())
    out = []
    for x in features:
        seq = hf_model.generate(x[None].to(device=param.device, dtype=param.dtype), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1, return_dict_in_generate=True).sequences[0].tolist()
        if seq[0] != cfg.decoder_start_token_id:
            raise AssertionError(f"transformers' Whisper generate returned {seq}, not starting with the decoder start "
                                 f"token {cfg.decoder_start_token_id}")
        out.append(seq[1:])
    return out


@torch.inference_mode()
def transformers_whisper_logits(hf_model: nn.Module, feature: torch.Tensor, decoder_tokens: Sequence[int]
                                ) -> torch.Tensor:
    """transformers' own forward (no cache) over one input and decoder sequence: logits [len(tokens), vocab]
    float32 on the CPU (row i chooses token i + 1)."""
    param = next(hf_model.parameters())
    out = hf_model(input_features=feature[None].to(device=param.device, dtype=param.dtype),
                   decoder_input_ids=torch.tensor([list(decoder_tokens)], device=param.device), use_cache=False)
    return out.logits[0].float().cpu()


def transformers_whisper_forward_greedy(hf_model: nn.Module, feature: torch.Tensor, prompt: Sequence[int],
                                        max_new_tokens: int, eos_token_id: Optional[int] = None) -> list[int]:
    """Greedy decoding by transformers' forward recomputed over the whole sequence each step (no cache): the
    reference for decoder prompts longer than the start token, which Whisper's ``generate`` builds itself."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(transformers_whisper_logits(hf_model, feature, tokens)[-1].argmax()))
        if tokens[-1] == eos_token_id:
            break
    return tokens[len(prompt):]


def _main() -> None:
    require_transformers()
    from attnbackends import LayerGroupsConfig
    from attnbackends.engine import EncoderDecoderEngine, EncoderEngine, EngineConfig

    bert = tiny_bert()
    sequences = [[5, 17, 99, 3], list(range(10, 40)), [7]]
    engine = EncoderEngine(HFBertEncoder(bert), max_num_batched_tokens=32)
    got = engine.encode(sequences)
    want = transformers_bert_embeddings(bert, sequences)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    print(f"BERT ({engine.backend}): max |embedding diff| vs transformers {diff:.2e}")

    whisper = tiny_whisper()
    features = random_mel_features(whisper, 3)
    want_tokens = transformers_whisper_generate(whisper, features, 8)
    config = LayerGroupsConfig(groups={"encoder": "reference", "full": "reference", "cross": "reference"})
    ed = EncoderDecoderEngine(HFWhisperModel(whisper), EngineConfig(block_size=16, num_blocks=32,
                                                                    max_num_batched_tokens=32, max_num_reqs=2),
                              attention_config=config)
    got = ed.generate(features, [[whisper.config.decoder_start_token_id]] * 3, 8,
                      eos_token_id=whisper.config.eos_token_id)
    same = sum(a == b for x, y in zip(got.tokens, want_tokens) for a, b in zip(x, y))
    print(f"Whisper ({got.backend}): {same}/{sum(map(len, want_tokens))} tokens equal to transformers' generate")
    print(ed.groups)


if __name__ == "__main__":
    _main()
