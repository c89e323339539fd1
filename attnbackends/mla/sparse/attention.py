"""Sparse MLA attention on Triton: absorbed-weight MLA of each query token over the cache slots its indexer chose.

Per query token t and a block of BLOCK_H heads: logits = [ql ; q_pe] . c_j over the chosen slots j (gathered from
the latent cache by slot, in tiles of BLOCK_N), online softmax, o_latent = softmax . kv_c_j. Decodes and prefill
tokens run alike (each token has its own selection). The fp8_ds_mla latent is dequantised in registers (the nope
tile times its 128-value tile scale; the rope part is bfloat16).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...ops.launch_math import cdiv, next_power_of_2
from ...ops.page_guard import safe_page
from ...ops.sparse_mla_cache import ds_latent_views
from ...platform import is_triton_interpreted
from ...spec import AttentionSpec

__all__ = ["SparseAttentionConfig", "default_attention_config", "sparse_mla_attention"]

_LOG2E = 1.4426950408889634


class SparseAttentionConfig(tuple):
    """(BLOCK_H, BLOCK_N, num_warps, num_stages)."""

    def __new__(cls, block_h: int, block_n: int, num_warps: int, num_stages: int) -> "SparseAttentionConfig":
        return super().__new__(cls, (block_h, block_n, num_warps, num_stages))


def default_attention_config(num_heads: int, interpreted: bool) -> SparseAttentionConfig:
    """The tile config: small tiles under the interpreter; on a GPU up to 64 heads x 64 tokens, 8 warps, unpipelined
    (the most heads per gathered tile that fit the registers: each gathered latent row is read by fewer programs;
    tl.dot needs 16 rows, fewer heads are masked). ``benchmarks.sparse_mla_tile_sweep`` measures the others."""
    if interpreted:
        return SparseAttentionConfig(min(4, next_power_of_2(num_heads)), 8, 1, 1)
    return SparseAttentionConfig(min(64, max(16, next_power_of_2(num_heads))), 64, 8, 1)


@triton.jit
def _sparse_mla_kernel(
    QL, QPE, NOPE, SCALES, ROPE, SLOTS, OUT,
    stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h, stride_n_blk, stride_n_tok, stride_s_blk, stride_s_tok,
    stride_r_blk, stride_r_tok, stride_slots_t, stride_o_t, stride_o_h,
    num_heads, num_blocks, block_size, qk_scale_log2, TOPK: tl.constexpr,
    LKV: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DS_FP8: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (T, cdiv(num_heads, BLOCK_H)): o_latent of token program_id(0), heads [BLOCK_H * program_id(1), ...)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_c = tl.arange(0, LKV)
    offs_r = tl.arange(0, BLOCK_R)
    ql = tl.load(QL + t * stride_ql_t + offs_h[:, None] * stride_ql_h + offs_c[None, :], mask=h_mask[:, None],
                 other=0.0)
    qpe = tl.load(QPE + t * stride_qpe_t + offs_h[:, None] * stride_qpe_h + offs_r[None, :],
                  mask=h_mask[:, None] & (offs_r < R)[None, :], other=0.0)
    if INTERPRET:  # the interpreter's tl.dot on 16-bit inputs is wrong: compute in float32
        ql = ql.to(tl.float32)
        qpe = qpe.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, LKV), tl.float32)
    for j0 in range(0, TOPK, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        slot = tl.load(SLOTS + t * stride_slots_t + offs_n, mask=offs_n < TOPK, other=-1)
        valid = slot >= 0
        safe = tl.where(valid, slot, 0)
        page = safe_page(safe // block_size, num_blocks).to(tl.int64)
        row = safe % block_size
        kv = tl.load(NOPE + page[:, None] * stride_n_blk + row[:, None] * stride_n_tok + offs_c[None, :],
                     mask=valid[:, None], other=0.0)
        if DS_FP8:
            sc = tl.load(SCALES + page[:, None] * stride_s_blk + row[:, None] * stride_s_tok
                         + tl.arange(0, LKV // 128)[None, :], mask=valid[:, None], other=0.0)
            kv = tl.reshape(tl.reshape(kv.to(tl.float32), (BLOCK_N, LKV // 128, 128)) * sc[:, :, None],
                            (BLOCK_N, LKV)).to(QL.dtype.element_ty)
        kpe = tl.load(ROPE + page[:, None] * stride_r_blk + row[:, None] * stride_r_tok + offs_r[None, :],
                      mask=valid[:, None] & (offs_r < R)[None, :], other=0.0).to(QL.dtype.element_ty)
        if INTERPRET:
            kv = kv.to(tl.float32)
            kpe = kpe.to(tl.float32)
        s = tl.dot(ql, tl.trans(kv)) + tl.dot(qpe, tl.trans(kpe))
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(OUT + t * stride_o_t + offs_h[:, None] * stride_o_h + offs_c[None, :], out.to(OUT.dtype.element_ty),
             mask=h_mask[:, None])


def sparse_mla_attention(ql: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor,
                         out: torch.Tensor, spec: AttentionSpec, num_tokens: int,
                         config: Optional[SparseAttentionConfig] = None) -> torch.Tensor:
    """o_latent of the first ``num_tokens`` tokens over their chosen slots.

    ql [T, N, Lkv] and q_pe [T, N, R] (model dtype, any strides with a unit last one); latent: the layer's latent
    cache (either format); slots [T, topk] int32 (-1 padding); out [T, N, Lkv] (any strides, unit last one).
    A token with no chosen slot gets zeros."""
    lkv, r, n = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_heads
    if lkv != next_power_of_2(lkv):
        raise ValueError(f"the Triton sparse MLA kernel needs a power-of-two kv_lora_rank, got {lkv}")
    ds = spec.sparse_indexer.latent_format == "fp8_ds_mla"
    if ds:
        nope, scales, rope = ds_latent_views(latent, spec)
    else:
        nope, rope, scales = latent[..., :lkv], latent[..., lkv:], latent
    cfg = config or default_attention_config(n, is_triton_interpreted())
    block_h, block_n, warps, stages = cfg
    if num_tokens == 0:
        return out
    _sparse_mla_kernel[(num_tokens, cdiv(n, block_h))](
        ql, q_pe, nope, scales, rope, slots, out,
        ql.stride(0), ql.stride(1), q_pe.stride(0), q_pe.stride(1), nope.stride(0), nope.stride(1),
        scales.stride(0), scales.stride(1), rope.stride(0), rope.stride(1), slots.stride(0), out.stride(0),
        out.stride(1), n, latent.shape[0], spec.block_size, spec.softmax_scale * _LOG2E, TOPK=slots.shape[1],
        LKV=lkv, R=r, BLOCK_R=next_power_of_2(r), BLOCK_H=block_h, BLOCK_N=block_n, DS_FP8=ds,
        INTERPRET=is_triton_interpreted(), num_warps=warps, num_stages=stages)
    return out
