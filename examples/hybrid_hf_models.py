"""Hugging Face ``transformers`` models whose layers differ, served on the grouped paged engine.

- :class:`HFGemma3Model` over ``Gemma3ForCausalLM``: interleaved sliding-window ("sliding_attention") and global
  layers, each kind with its own RoPE base, q/k RMSNorm, the scale ``query_pre_attn_scalar ** -0.5``.
- :class:`HFGptOssModel` over ``GptOssForCausalLM``: alternating sliding-window and full layers, a learned sink
  logit per query head in every layer, the scale ``head_dim ** -0.5``, a top-k MoE.

How transformers' attention maps onto :class:`~attnbackends.AttentionSpec` (transformers 5.x, eager attention):
both models mask a sliding layer with ``kv_idx > q_idx - sliding_window`` on top of the causal mask, which is the
library's window W = ``config.sliding_window`` (W keys, self included). Gemma 3 passes no soft-cap to its attention
(``attn_logit_softcapping`` is unused there; a config that sets it is refused), gpt-oss adds its sink logit
``self_attn.sinks[h]`` to the softmax denominator only (the library's sinks). The adapters call the transformers
modules themselves (norms, projections, rotary embedding, MLP / MoE) on a batch of one flat sequence and hand
attention to the engine; transformers' own attention and cache are never used.

Run as a script to compare both with transformers' greedy ``generate``.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from torch import nn

from attnbackends import AttentionSpec

__all__ = ["HFGemma3Model", "HFGptOssModel", "seed_weights", "tiny_gemma3", "tiny_gpt_oss", "transformers_greedy"]


@torch.no_grad()
def seed_weights(model: nn.Module, seed: int = 0, logit_scale: float = 4.0) -> nn.Module:
    """Seeded weights that give well-separated greedy choices: matrices std 1/sqrt(hidden size), norm weights
    0.1 N(0, 1) around their neutral value, biases and sinks small, the LM head ``logit_scale`` times wider."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        if "norm" in name:
            neutral = 0.0 if type(model).__name__.startswith("Gemma") else 1.0  # Gemma's norms scale by 1 + w
            value = neutral + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("sinks"):
            value = 0.5 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1 or name.endswith("_bias"):
            value = 0.02 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * hidden**-0.5 * (logit_scale if "lm_head" in name else 1.0)
        p.copy_(value.to(p.dtype))
    return model


def tiny_gemma3(seed: int = 0, **overrides: Any) -> nn.Module:
    """A float32 ``Gemma3ForCausalLM`` with seeded weights: 4 layers (sliding, sliding, sliding, global), window 8,
    4 query / 2 KV heads of 32, RoPE bases 10k (local) and 1M (global), vocab 128."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, final_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    )
    kwargs.update(overrides)
    config = Gemma3TextConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return seed_weights(Gemma3ForCausalLM(config), seed).eval()


def tiny_gpt_oss(seed: int = 0, **overrides: Any) -> nn.Module:
    """A float32 ``GptOssForCausalLM`` with seeded weights: 4 layers alternating sliding (window 8) and full,
    sinks, 4 query / 2 KV heads of 32, 4 experts (top 2), vocab 128."""
    from transformers import GptOssConfig, GptOssForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kwargs.update(overrides)
    config = GptOssConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return seed_weights(GptOssForCausalLM(config), seed).eval()


class _HFHybrid(nn.Module):
    """Shared parts: the transformers model, its layer kinds, and the flat-batch plumbing."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        self.num_layers = cfg.num_hidden_layers
        self.layer_types = list(cfg.layer_types)
        unknown = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise NotImplementedError(f"layer types {unknown} are not served (sliding_attention, full_attention)")
        attn = hf_model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.sliding_window = cfg.sliding_window
        self._modeling = importlib.import_module(type(hf_model).__module__)

    def _spec(self, layer: int, dtype: torch.dtype, block_size: int, **kw: Any) -> AttentionSpec:
        sliding = self.layer_types[layer] == "sliding_attention"
        return AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                             dtype=dtype, block_size=block_size, scale=self.scaling,
                             sliding_window=self.sliding_window if sliding else None, **kw)

    def _attend(self, attn, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [1, H, T, D] (transformers' layout) -> [1, T, Hq * D]."""
        flat = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # [T, H, D]
        o = attn(layer, *flat)
        return o.reshape(1, o.shape[0], -1)

    def _project(self, a: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = h.shape[1]
        q = a.q_proj(h).view(1, t, -1, self.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(1, t, -1, self.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(1, t, -1, self.head_dim).transpose(1, 2)
        return q, k, v


class HFGemma3Model(_HFHybrid):
    """A :class:`~attnbackends.engine.GroupedEngineModel` over ``Gemma3ForCausalLM`` (text)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__(hf_model)
        if hf_model.config.attn_logit_softcapping is not None:
            raise NotImplementedError("attn_logit_softcapping is set, but transformers' Gemma 3 attention ignores it")

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        return [self._spec(i, dtype, block_size) for i in range(self.num_layers)]

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn, logits_rows: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""
        model, cfg = self.hf.model, self.hf.config
        x = model.embed_tokens(tokens[None])  # [1, T, hidden], scaled by sqrt(hidden)
        rope = {kind: model.rotary_emb(x, positions[None], kind) for kind in set(self.layer_types)}
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._project(a, h)
            q, k = self._modeling.apply_rotary_pos_emb(a.q_norm(q), a.k_norm(k), *rope[self.layer_types[i]])
            h = a.o_proj(self._attend(attn, i, q, k, v))
            x = x + layer.post_attention_layernorm(h)
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        x = model.norm(x)[0]
        if logits_rows is not None:
            x = x[logits_rows]
        logits = self.hf.lm_head(x)
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits.float()


class HFGptOssModel(_HFHybrid):
    """A :class:`~attnbackends.engine.GroupedEngineModel` over ``GptOssForCausalLM``: every layer's spec has sinks,
    and its impl gets that layer's ``self_attn.sinks``."""

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        return [self._spec(i, dtype, block_size, has_sinks=True) for i in range(self.num_layers)]

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {"sinks": self.hf.model.layers[layer].self_attn.sinks.detach().float()}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn, logits_rows: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""
        model = self.hf.model
        x = model.embed_tokens(tokens[None])  # [1, T, hidden]
        cos, sin = model.rotary_emb(x, positions[None])
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            q, k, v = self._project(a, layer.input_layernorm(x))
            q, k = self._modeling.apply_rotary_pos_emb(q, k, cos, sin)
            x = x + a.o_proj(self._attend(attn, i, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))[0]
        x = model.norm(x)[0]
        if logits_rows is not None:
            x = x[logits_rows]
        return self.hf.lm_head(x).float()


@torch.inference_mode()
def transformers_greedy(hf_model: nn.Module, prompts: list[list[int]], max_new_tokens: int
                        ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy ``generate``, one prompt at a time: new tokens and their logits ([new, vocab])."""
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=True,
                                eos_token_id=None, pad_token_id=0)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float())
    return tokens, logits


def _main() -> None:
    from attnbackends.engine import EngineConfig, GroupedPagedEngine
    from examples.engine.hf_models.hf_common import require_transformers

    require_transformers()

    prompts = [list(range(1, 30)), [5, 6, 7]]
    for build, wrap in ((tiny_gemma3, HFGemma3Model), (tiny_gpt_oss, HFGptOssModel)):
        hf = build()
        want, _ = transformers_greedy(hf, prompts, 8)
        engine = GroupedPagedEngine(wrap(hf), EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16))
        got = engine.generate(prompts, 8)
        same = sum(a == b for x, y in zip(got.tokens, want) for a, b in zip(x, y))
        print(f"{type(hf).__name__} ({got.backend}): {same}/{sum(map(len, want))} tokens equal to transformers")


if __name__ == "__main__":
    _main()
