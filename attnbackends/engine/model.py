"""A tiny Llama-architecture model with seeded random weights: RMSNorm, rotary embeddings, GQA attention through
any attention backend, SwiGLU MLP. ``forward_dense`` recomputes a whole sequence with torch SDPA: the reference
(under the layer's mask, ``TinyLlamaConfig.mask``, as :func:`attnbackends.masks.dense_visibility` defines it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..masks import dense_visibility
from ..spec import AttentionMask, AttentionSpec

__all__ = ["TinyLlamaConfig", "TinyLlama"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    #: the attention mask of every layer (None: causal), e.g. ``AttentionMask(kind="block_causal", block_len=4)``
    mask: Optional[AttentionMask] = None


class _Layer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_size
        self.input_norm = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = nn.RMSNorm(h, eps=cfg.rms_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def seeded_init_(model: nn.Module, gen: torch.Generator) -> None:
    """Random weights from ``gen``, in parameter order: norm weights 1 + 0.1 N(0, 1) (norm biases 0.1 N(0, 1)), the
    embedding N(0, 1), every other matrix N(0, 1 / fan_in) (its last dimension)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                scale = 1.0 if name == "embed.weight" else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyLlama(nn.Module):
    """Llama-style decoder. ``forward(tokens, positions, attend)`` leaves attention to the caller's backend."""

    def __init__(self, cfg: TinyLlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        seeded_init_(self, gen)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_size, 2, dtype=torch.float32) / cfg.head_size))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        cfg = self.cfg
        return AttentionSpec(
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size, dtype=dtype,
            block_size=block_size, **({} if cfg.mask is None else {"mask": cfg.mask}),
        )

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """One spec per layer (all equal here), so that :class:`~attnbackends.engine.GroupedPagedEngine` serves
        the model too (e.g. with some layers' caches kept in 16 bits)."""
        return [self.attention_spec(dtype, block_size)] * self.cfg.num_layers

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {}

    def _inv_freq(self, layer: int) -> torch.Tensor:
        """[D/2] rotary frequencies of ``layer`` (one base for every layer here)."""
        return self.inv_freq

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """Rotary embedding, half-split convention. x: [T, H, D]; positions: [T]."""
        angles = positions.float()[:, None] * self._inv_freq(layer)[None, :]  # [T, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: AttendFn, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """tokens, positions: [T] int64 -> logits [T, vocab] float32 (only the rows ``logits_rows`` if given)."""
        cfg = self.cfg
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            q = self._rope(layer.q_proj(h).view(-1, cfg.num_heads, cfg.head_size), positions, i)
            k = self._rope(layer.k_proj(h).view(-1, cfg.num_kv_heads, cfg.head_size), positions, i)
            v = layer.v_proj(h).view(-1, cfg.num_kv_heads, cfg.head_size)
            o = attend(i, q, k, v)
            x = x + layer.o_proj(o.reshape(-1, cfg.num_heads * cfg.head_size))
            x = x + layer.mlp(layer.post_norm(x))
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.norm(x)).float()

    def forward_dense(self, tokens: torch.Tensor, spans: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """The whole sequence recomputed with SDPA (no cache) under the layer's mask: tokens [L] -> logits
        [L, vocab]. ``spans``: the sequence's bidirectional spans (a ``causal_spans`` mask)."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        positions = torch.arange(tokens.shape[0], device=tokens.device)
        visible = None
        if self.cfg.mask is not None:
            spec = self.attention_spec(torch.float32, 16)
            visible = dense_visibility(spec, positions, tokens.shape[0], spans=spans).to(tokens.device)

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=visible, is_causal=visible is None)
            return o.transpose(0, 1)

        return self.forward(tokens, positions, attend)
