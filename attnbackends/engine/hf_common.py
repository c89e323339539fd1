"""Pieces the Hugging Face adapters share: the transformers-style RMSNorm and rotary embedding re-implemented on
flat [tokens, ...] tensors, seeded weight initialisation, and small configs for tests and examples.

Each function follows the transformers module it replaces step by step (same dtype casts in the same places), so
that float32 runs reproduce transformers' numbers and low-precision runs round the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "apply_rope",
    "linear",
    "rms_norm",
    "rope_cos_sin",
    "seed_weights",
    "swiglu_mlp",
    "tiny_deepseek_v3_config",
    "tiny_llama_config",
]


def linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    """``module(x)`` through the module's weight (and bias), [T, in] -> [T, out]."""
    return F.linear(x, module.weight, module.bias)


def rms_norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """transformers' LlamaRMSNorm / DeepseekV3RMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * h.to(dtype)


def rope_cos_sin(rotary: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] of the transformers rotary module ``rotary`` (its current ``inv_freq`` and
    ``attention_scaling``) at ``positions`` [T], computed in float32 and cast to ``dtype`` as transformers does."""
    freqs = positions[:, None].float() * rotary.inv_freq.to(device=positions.device, dtype=torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rotary.attention_scaling).to(dtype), (emb.sin() * rotary.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] with cos, sin [T, D].

    interleave : DeepSeek's layout: pairs (x0, x1), (x2, x3), ... rotate together and the result is written
        de-interleaved, [rotated evens ; rotated odds] (transformers' ``apply_rotary_pos_emb_interleave``). Queries
        and keys get the same permutation, so their dot products are those of the interleaved rotation.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    if not interleave:
        return x * cos + _rotate_half(x) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def swiglu_mlp(x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """transformers' LlamaMLP / DeepseekV3MLP: down(act(gate(x)) * up(x))."""
    return linear(mlp.act_fn(linear(x, mlp.gate_proj)) * linear(x, mlp.up_proj), mlp.down_proj)


@torch.no_grad()
def seed_weights(model: nn.Module, seed: int = 0, logit_scale: float = 4.0) -> nn.Module:
    """Overwrite every parameter with seeded random values that give a well-conditioned random model.

    transformers initialises with std 0.02, which makes a random model's logits nearly flat: greedy choices then
    hinge on rounding and a bf16 run cannot be compared token for token. Here matrices get std 1/sqrt(fan_in)
    (embeddings std 1), norm weights 1 + 0.1 N(0, 1), the MoE score-correction bias 0, and the LM head
    ``logit_scale`` times its usual std so that the top logits are well separated.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif p.dim() == 1:
            value = 0.02 * torch.randn(p.shape, generator=gen)  # biases
        else:
            std = 1.0 if "embed" in name else p.shape[-1] ** -0.5
            if name.startswith("lm_head"):
                std *= logit_scale
            value = std * torch.randn(p.shape, generator=gen)
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    return model


def tiny_llama_config(**overrides: Any):
    """A small ``transformers.LlamaConfig`` (2 layers, 4 query / 2 KV heads of 32, vocab 256, no EOS)."""
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_deepseek_v3_config(**overrides: Any):
    """A small ``transformers.DeepseekV3Config``: MLA with q_lora_rank 64, kv_lora_rank 64, nope 32, rope 16,
    v 32, 4 heads, interleaved rope; layer 0 dense, layer 1 a MoE of 4 routed experts (2 groups, top-2) plus one
    shared expert."""
    from transformers import DeepseekV3Config

    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)
