"""A tiny DeepSeek-V3.2-shaped decoder with seeded random weights: MLA with a LoRA query path and DeepSeek sparse
attention's lightning indexer, whose inputs each layer computes as DeepSeek-V3.2 does.

Per layer, on the normalised hidden state h [T, hidden]:

- query path: q_latent = RMSNorm(h @ W_qa) [T, q_lora_rank]; q = q_latent @ W_qb [T, N, P + R], its rope part
  rotated (interleaved pairs);
- latent path: [kv_c ; k_pe] = h @ W_kva; kv_c RMS-normalised [T, Lkv], k_pe rotated (interleaved) [T, R];
- indexer: index_q = q_latent @ W_iqb [T, H, D] (the query path's latent, not h), index_k = LayerNorm(h @ W_ik)
  [T, D] (one key per token, shared by the index heads); the first R values of each are rotated (half-split
  pairs), then both are Hadamard-rotated (orthonormal, D a power of two); index_weights = h @ W_iw * H^-1/2 [T, H]
  float32. The score scale D^-1/2 is the spec's ``index_scale`` default;
- attention through the engine (``attn.mla(layer, q, kv_c, k_pe, index_q=..., index_k=..., index_weights=...)``:
  the backend writes the latent and index caches, selects each query's top-k tokens and attends over them);
- a dense SwiGLU MLP (DeepSeek's MoE layers are left out: they do not touch attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import AttentionSpec, SparseIndexerSpec
from .model import seeded_init_

__all__ = ["TinyDeepseekSparse", "TinyDeepseekSparseConfig", "hadamard_matrix"]


@dataclass(frozen=True)
class TinyDeepseekSparseConfig:
    """Sizes of :class:`TinyDeepseekSparse` (DeepSeek-V3.2's shape, reduced widths).

    latent_format : the latent cache's format (:class:`~attnbackends.SparseIndexerSpec`): "auto" (model dtype) or
        "fp8_ds_mla" (DeepSeek's fp8 format; kv_lora_rank a multiple of 128).
    """

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 16
    q_lora_rank: int = 64
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 64
    v_head_dim: int = 32
    num_index_heads: int = 8
    index_head_dim: int = 128
    index_topk: int = 16
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    latent_format: str = "auto"

    def __post_init__(self) -> None:
        d, r = self.index_head_dim, self.qk_rope_head_dim
        if d & (d - 1) or d < r:
            raise ValueError(f"index_head_dim must be a power of two (Hadamard rotation) and >= qk_rope_head_dim "
                             f"({r}), got {d}")
        if r % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {r}")


def hadamard_matrix(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [n, n] float32 (n a power of two): x @ H rotates x's last dim."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(n)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x [T, ..., R] with cos, sin [T, R/2]: pairs (2i, 2i+1) if ``interleaved``, else
    (i, i + R/2)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class _Indexer(nn.Module):
    def __init__(self, cfg: TinyDeepseekSparseConfig) -> None:
        super().__init__()
        h, d = cfg.num_index_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, h, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg: TinyDeepseekSparseConfig) -> None:
        super().__init__()
        n, p, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.input_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.rms_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, n * (p + r), bias=False)
        self.wkv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + r, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=cfg.rms_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (p + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(n * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.indexer = _Indexer(cfg)
        self.post_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class TinyDeepseekSparse(nn.Module):
    """DeepSeek-V3.2-shaped decoder (module docstring); an :class:`~attnbackends.engine.EngineModel` whose spec is
    sparse MLA, so :class:`~attnbackends.engine.PagedEngine` serves it on a sparse MLA backend."""

    def __init__(self, cfg: TinyDeepseekSparseConfig = TinyDeepseekSparseConfig(), seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        seeded_init_(self, gen)
        r = cfg.qk_rope_head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("hadamard", hadamard_matrix(cfg.index_head_dim), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        cfg = self.cfg
        return AttentionSpec.mla(
            num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, dtype=dtype, block_size=block_size,
            sparse_indexer=SparseIndexerSpec(num_index_heads=cfg.num_index_heads, index_head_dim=cfg.index_head_dim,
                                             topk=cfg.index_topk, latent_format=cfg.latent_format),
        )

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {"kv_b_proj": self.layers[layer].kv_b_proj.weight.detach()}

    def _indexer_inputs(self, layer: _Layer, h: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> dict[str, torch.Tensor]:
        """index_q [T, H, D], index_k [T, D] (model dtype) and index_weights [T, H] float32 of one layer."""
        cfg, idx = self.cfg, layer.indexer
        t, r, heads = h.shape[0], cfg.qk_rope_head_dim, cfg.num_index_heads
        q = idx.wq_b(q_latent).view(t, heads, cfg.index_head_dim)
        k = idx.k_norm(idx.wk(h))
        q = torch.cat([_rotate(q[..., :r], cos, sin, interleaved=False), q[..., r:]], dim=-1)
        k = torch.cat([_rotate(k[..., :r], cos, sin, interleaved=False), k[..., r:]], dim=-1)
        rot = self.hadamard.to(h.dtype)
        weights = idx.weights_proj(h).float() * heads ** -0.5
        return {"index_q": (q @ rot).contiguous(), "index_k": (k @ rot).contiguous(), "index_weights": weights}

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: Any,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32. ``attn.mla(layer, q, kv_c,
        k_pe, index_q=, index_k=, index_weights=)`` -> [T, N, V] serves each layer's attention."""
        cfg = self.cfg
        n, p, r, lkv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        cos, sin = angles.cos(), angles.sin()
        t = tokens.shape[0]
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            q_latent = layer.q_norm(layer.wq_a(h))  # [T, q_lora_rank]
            q_nope, q_pe = layer.wq_b(q_latent).view(t, n, p + r).split([p, r], dim=-1)
            kv_c, k_pe = layer.wkv_a(h).split([lkv, r], dim=-1)
            kv_c = layer.kv_norm(kv_c)
            q = torch.cat([q_nope, _rotate(q_pe, cos, sin, interleaved=True)], dim=-1)
            k_pe = _rotate(k_pe, cos, sin, interleaved=True)
            indexer = self._indexer_inputs(layer, h, q_latent, cos, sin)
            o = attn.mla(i, q, kv_c.contiguous(), k_pe.contiguous(), **indexer)  # [T, N, V]
            x = x + layer.wo(o.reshape(t, n * cfg.v_head_dim))
            gate, up = layer.gate_up(layer.post_norm(x)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.norm(x)).float()
