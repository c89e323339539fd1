"""Serve a Hugging Face ``transformers`` Llama-architecture model (``LlamaForCausalLM``) on the paged engine.

The adapter holds the transformers model and re-implements its forward on flat batches, reading the modules'
weights: embeddings, RMSNorm, rotary embedding, grouped-query attention through the engine's backend, SwiGLU MLP,
final norm and LM head. transformers' own attention and KV cache are never called.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnbackends.spec import AttentionSpec
from .hf_common import apply_rope, linear, rms_norm, rope_cos_sin, swiglu_mlp

__all__ = ["HFLlamaModel"]


class HFLlamaModel(nn.Module):
    """A :class:`~attnbackends.engine.EngineModel` over a transformers ``LlamaForCausalLM``.

    Parameters
    ----------
    hf_model : a ``LlamaForCausalLM`` (or a model with the same module names: ``model.embed_tokens``,
        ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``input_layernorm``, ``post_attention_layernorm``,
        ``mlp.{gate,up,down}_proj``, ``model.norm``, ``model.rotary_emb``, ``lm_head``). Its weights are used as
        they are (no copy): moving the adapter moves the transformers model.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        cfg = hf_model.config
        if getattr(cfg, "sliding_window", None) or getattr(cfg, "layer_types", None) and any(
            t != "full_attention" for t in cfg.layer_types
        ):
            raise NotImplementedError("HFLlamaModel serves full-attention models only (no sliding-window layers)")
        self.hf = hf_model
        self.num_layers = cfg.num_hidden_layers
        attn = hf_model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype,
            block_size=block_size, scale=self.scaling,
        )

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {}

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attn, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""
        model = self.hf.model
        x = F.embedding(tokens, model.embed_tokens.weight)  # [T, hidden]
        cos, sin = rope_cos_sin(model.rotary_emb, positions, x.dtype)  # [T, D]
        t, d = tokens.shape[0], self.head_dim
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            h = rms_norm(x, layer.input_layernorm)
            q = apply_rope(linear(h, a.q_proj).view(t, self.num_heads, d), cos, sin)
            k = apply_rope(linear(h, a.k_proj).view(t, self.num_kv_heads, d), cos, sin)
            v = linear(h, a.v_proj).view(t, self.num_kv_heads, d)
            o = attn(i, q, k, v)  # [T, Hq, D]
            x = x + linear(o.reshape(t, self.num_heads * d), a.o_proj)
            x = x + swiglu_mlp(rms_norm(x, layer.post_attention_layernorm), layer.mlp)
        if logits_rows is not None:
            x = x[logits_rows]
        return linear(rms_norm(x, model.norm), self.hf.lm_head).float()
