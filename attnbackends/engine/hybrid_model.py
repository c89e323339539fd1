"""A tiny hybrid decoder with seeded random weights: Gemma-3-style interleaved sliding-window and global layers, each
kind with its own RoPE base, optional gpt-oss-style attention sinks. ``forward_dense`` recomputes a whole sequence
with dense masked attention (no cache): the reference the engine is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..spec import AttentionSpec
from .model import TinyLlama, TinyLlamaConfig

__all__ = ["TinyHybridConfig", "TinyHybrid"]


@dataclass(frozen=True)
class TinyHybridConfig(TinyLlamaConfig):
    """TinyLlama's sizes plus the layer pattern: layer i is global iff ``(i + 1) % global_every == 0``; the others
    see ``sliding_window`` keys (self included) and rotate with ``local_rope_theta``."""

    num_layers: int = 6
    sliding_window: int = 8
    global_every: int = 3
    local_rope_theta: float = 10000.0
    rope_theta: float = 1_000_000.0
    sinks: bool = False

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.global_every == 0


class TinyHybrid(TinyLlama):
    """:class:`~attnbackends.engine.TinyLlama` with sliding-window and global layers (a GroupedEngineModel)."""

    def __init__(self, cfg: TinyHybridConfig, seed: int = 0) -> None:
        super().__init__(cfg, seed)
        d = cfg.head_size
        local = 1.0 / (cfg.local_rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("local_inv_freq", local, persistent=False)
        self.sinks = None
        if cfg.sinks:
            gen = torch.Generator().manual_seed(seed + 1)
            self.sinks = nn.Parameter(torch.randn(cfg.num_layers, cfg.num_heads, generator=gen) * 2.0)

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        cfg = self.cfg
        return [
            AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size,
                          dtype=dtype, block_size=block_size, has_sinks=cfg.sinks,
                          sliding_window=None if cfg.is_global(i) else cfg.sliding_window)
            for i in range(cfg.num_layers)
        ]

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {"sinks": self.sinks[layer].detach().float()} if self.sinks is not None else {}

    def _inv_freq(self, layer: int) -> torch.Tensor:
        return self.inv_freq if self.cfg.is_global(layer) else self.local_inv_freq

    def forward_dense(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole sequence with dense attention (causal, each layer's window, sinks): tokens [L] -> [L, vocab]."""
        cfg = self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        n = tokens.shape[0]
        pos = torch.arange(n, device=tokens.device)
        distance = pos[None, :] - pos[:, None]  # [L, L], j - p

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            visible = distance <= 0
            if not cfg.is_global(layer):
                visible &= distance > -cfg.sliding_window
            k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, D]
            v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
            s = (q.transpose(0, 1).float() @ k.transpose(1, 2)) * cfg.head_size**-0.5  # [H, L, L]
            s = s.masked_fill(~visible, float("-inf"))
            if self.sinks is not None:
                sink = self.sinks[layer].float()[:, None, None].expand(-1, n, 1)
                p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
            else:
                p = torch.softmax(s, dim=-1)
            return (p @ v).transpose(0, 1).to(q.dtype)

        return self.forward(tokens, pos, attend)
