"""Serve a Hugging Face ``transformers`` DeepSeek-V3-architecture model (``DeepseekV3ForCausalLM``, MLA) on the
paged engine.

The adapter re-implements the forward on flat batches from the transformers modules' weights: the query path
(``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``, or ``q_proj``), the latent path (``kv_a_proj_with_mqa`` ->
normalised kv_c and the rotary k_pe), rotary embedding (interleaved or not), MLA attention through the engine's
backend (which caches [kv_c ; k_pe] and owns ``kv_b_proj``), the dense MLP of the first ``first_k_dense_replace``
layers and the MoE (sigmoid router with group-limited top-k, routed experts, shared experts) of the others.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from attnbackends.spec import AttentionSpec
from .hf_common import apply_rope, linear, rms_norm, rope_cos_sin, swiglu_mlp

__all__ = ["HFDeepseekV3Model", "deepseek_moe"]


def deepseek_moe(x: torch.Tensor, moe: nn.Module) -> torch.Tensor:
    """transformers' DeepseekV3MoE on x [T, hidden]: routed experts weighted by the router, plus shared experts."""
    gate = moe.gate
    num_experts = gate.weight.shape[0]
    scores = F.linear(x.float(), gate.weight.float()).sigmoid()  # [T, E]
    choice = scores + gate.e_score_correction_bias
    per_group = num_experts // gate.num_group
    group_scores = choice.view(-1, gate.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, gate.num_group, per_group).reshape(-1, num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_idx = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]  # [T, k]
    topk_w = scores.gather(1, topk_idx)
    if gate.norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    topk_w = topk_w * gate.routed_scaling_factor
    experts = moe.experts
    out = torch.zeros_like(x)
    for e in range(num_experts):
        token_idx, slot = torch.where(topk_idx == e)
        if token_idx.numel() == 0:
            continue
        g, u = F.linear(x[token_idx], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(experts.act_fn(g) * u, experts.down_proj[e]) * topk_w[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out + swiglu_mlp(x, moe.shared_experts)


class HFDeepseekV3Model(nn.Module):
    """A :class:`~attnbackends.engine.EngineModel` over a transformers ``DeepseekV3ForCausalLM`` (MLA spec).

    The MLA impl of layer i gets that layer's ``self_attn.kv_b_proj.weight`` ([N * (P + V), Lkv]); the softmax scale
    is the transformers module's ``scaling`` (1/sqrt(P + R), times the YaRN mscale^2 where the config asks for it).
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        cfg = hf_model.config
        self.hf = hf_model
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.rope_interleave = bool(cfg.rope_interleave)
        self.scaling = float(hf_model.model.layers[0].self_attn.scaling)

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        return AttentionSpec.mla(
            num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, dtype=dtype, block_size=block_size,
            scale=self.scaling,
        )

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        return {"kv_b_proj": self.hf.model.layers[layer].self_attn.kv_b_proj.weight.detach()}

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attn, logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """tokens, positions [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""
        model = self.hf.model
        n, p, r, v, lkv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
        x = F.embedding(tokens, model.embed_tokens.weight)  # [T, hidden]
        cos, sin = rope_cos_sin(model.rotary_emb, positions, x.dtype)  # [T, R]
        t = tokens.shape[0]
        for i, layer in enumerate(model.layers):
            a = layer.self_attn
            h = rms_norm(x, layer.input_layernorm)
            if self.q_lora_rank is None:
                q = linear(h, a.q_proj)
            else:
                q = linear(rms_norm(linear(h, a.q_a_proj), a.q_a_layernorm), a.q_b_proj)
            q_nope, q_pe = q.view(t, n, p + r).split([p, r], dim=-1)
            kv_c, k_pe = linear(h, a.kv_a_proj_with_mqa).split([lkv, r], dim=-1)  # [T, Lkv], [T, R]
            kv_c = rms_norm(kv_c, a.kv_a_layernorm)
            q_pe = apply_rope(q_pe, cos, sin, self.rope_interleave)
            k_pe = apply_rope(k_pe[:, None, :], cos, sin, self.rope_interleave)[:, 0]
            o = attn.mla(i, torch.cat([q_nope, q_pe], dim=-1), kv_c.contiguous(), k_pe.contiguous())  # [T, N, V]
            x = x + linear(o.reshape(t, n * v), a.o_proj)
            h = rms_norm(x, layer.post_attention_layernorm)
            x = x + (deepseek_moe(h, layer.mlp) if hasattr(layer.mlp, "experts") else swiglu_mlp(h, layer.mlp))
        if logits_rows is not None:
            x = x[logits_rows]
        return linear(rms_norm(x, model.norm), self.hf.lm_head).float()
