"""Pieces the Hugging Face adapters share: the transformers-style RMSNorm and rotary embedding re-implemented on
flat [tokens, ...] tensors, seeded weight initialisation, and small configs for tests and examples.

Each function follows the transformers module it replaces step by step (same dtype casts in the same places), so
that float32 runs reproduce transformers' numbers and low-precision runs round the same way.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "TRANSFORMERS_MISSING",
    "add_successor_bigram",
    "apply_rope",
    "linear",
    "rms_norm",
    "rope_cos_sin",
    "seed_weights",
    "successor_permutation",
    "swiglu_mlp",
    "tiny_deepseek_v3_config",
    "tiny_llama_config",
    "require_transformers",
]

TRANSFORMERS_MISSING = ("this example compares with Hugging Face transformers, which is not installed: "
                        "pip install 'attnbackends[dev]' (the dev extra brings transformers>=4.56)")


def require_transformers() -> None:
    """Exit with :data:`TRANSFORMERS_MISSING` (status 1) where transformers cannot be imported: the examples' entry
    points call it first, instead of ending in a bare ModuleNotFoundError."""
    try:
        found = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        sys.exit(TRANSFORMERS_MISSING)


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
def seed_weights(model: nn.Module, seed: int = 0, logit_scale: float = 4.0, successor_logit: float = 0.0) -> nn.Module:
    """Overwrite every parameter with seeded random values that give a well-conditioned random model.

    transformers initialises with std 0.02, which makes a random model's logits nearly flat: greedy choices then
    hinge on rounding and a bf16 run cannot be compared token for token. Here matrices get std 1/sqrt(fan_in)
    (embeddings std 1), norm weights 1 + 0.1 N(0, 1), the MoE score-correction bias 0, and the LM head
    ``logit_scale`` times its usual std so that the top logits are well separated.

    Even so, the top two of 256 random logits are often within bf16 rounding of each other (exact ties are common
    once transformers' bf16 logits are quantised to 1/16), and raising ``logit_scale`` does not help: the rounding
    noise of the hidden state grows with the logits. ``successor_logit`` > 0 builds a *wide-margin* model instead:

    successor_logit : add to the (otherwise unchanged) random LM head a "successor" bigram (see
        :func:`add_successor_bigram`). A seeded permutation ``succ`` of the vocabulary (one cycle through every
        token) is drawn, and LM-head row ``succ(t)`` gains a multiple of ``n_t = final_norm(embedding(t))``, token
        t's embedding as the final RMSNorm scales it, such that the embedding's part of the last residual stream
        raises the logit of ``succ(t)`` by ``successor_logit`` on average (calibrated per token by one forward pass
        over random tokens), while other rows gain only ~1/sqrt(hidden) of that. With ``successor_logit`` several
        times the spread of the random logits (std ~``logit_scale``), greedy decoding picks ``succ(current
        token)`` by a margin of many bf16 rounding steps, so bf16 and float32 runs agree token for token: with 48
        on hidden size 256, the smallest top-2 margin over 96 steps is 7-19 for seeds 0-4 against bf16 logit
        errors <= 0.4 (logits up to ~60); hidden size 128 narrows it (1-14), the cross-talk between embedding
        directions growing as 1/sqrt(hidden). The random part (std ~``logit_scale``, context-dependent through
        attention) still moves every logit; changing the context moves a token's logits by ~12-25. So on this
        model logit comparisons still test attention's precision, while identical tokens test only for gross
        errors (the choice no longer depends on attention). The permutation and the calibration tokens come from
        their own ``seed``-derived generators: every other weight is the same as with ``successor_logit=0``.
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
    if successor_logit:
        add_successor_bigram(model, successor_logit, seed)
    return model


@torch.no_grad()
def successor_permutation(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The seeded successor map of :func:`seed_weights` (``successor_logit``): int64 [vocab], ``succ[t]`` is the
    token that follows t; a single cycle through the whole vocabulary."""
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(10_007 + seed))
    succ = torch.empty(vocab_size, dtype=torch.long)
    succ[order] = order.roll(-1)
    return succ


@torch.no_grad()
def add_successor_bigram(model: nn.Module, successor_logit: float, seed: int = 0) -> nn.Module:
    """Add the successor component of :func:`seed_weights` to a causal LM's LM head (in place).

    Row ``succ(t)`` of the LM head gains ``successor_logit * n_t / (|n_t|^2 share_t)``: ``n_t`` is token t's
    embedding through the final RMSNorm, and ``share_t`` the mean of ``<n_t, final_norm(h)> / |n_t|^2`` over the
    positions where t is the input token, measured by one forward pass of the model over seeded random token
    sequences. ``share_t`` is how much of the embedding survives in the last residual stream (about 0.7 for the
    Llama test configs, 0.6 for DeepSeek's, varying by token): dividing by it makes ``successor_logit`` the
    successor's mean logit gain in real forward passes, for every token alike.

    Needs ``model.get_input_embeddings()``, ``model.get_output_embeddings()`` (untied), the decoder at
    ``model.model`` returning ``last_hidden_state`` after its final RMSNorm ``model.model.norm`` (the Llama and
    DeepSeek-V3 layouts).
    """
    embed = model.get_input_embeddings().weight  # [V, hidden]
    head = model.get_output_embeddings().weight  # [V, hidden]
    if head.data_ptr() == embed.data_ptr():
        raise ValueError("successor_logit needs an untied LM head (tie_word_embeddings=False)")
    vocab = head.shape[0]
    norm = model.model.norm
    e = embed.detach().float()
    n = norm.weight.detach().float() * e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    # share_t: the embedding's share of the final normalised residual stream, over 2048 random input tokens.
    gen = torch.Generator().manual_seed(20_011 + seed)
    tokens = torch.randint(0, vocab, (16, 128), generator=gen)
    training = model.training
    model.eval()
    try:
        x = model.model(input_ids=tokens.to(embed.device)).last_hidden_state.float().cpu()  # [16, 128, hidden]
    finally:
        model.train(training)
    nt = n.cpu()[tokens]
    share = ((x * nt).sum(-1) / nt.pow(2).sum(-1)).flatten()
    flat = tokens.flatten()
    count = torch.bincount(flat, minlength=vocab)
    share_t = torch.zeros(vocab).index_add_(0, flat, share) / count.clamp(min=1)
    share_t = torch.where(count > 0, share_t, share.mean()).clamp(min=0.1)
    succ = successor_permutation(vocab, seed)
    delta = successor_logit * n.cpu() / (n.cpu().pow(2).sum(-1, keepdim=True) * share_t[:, None])  # row t -> succ(t)
    head.index_add_(0, succ.to(head.device), delta.to(device=head.device, dtype=head.dtype))
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
