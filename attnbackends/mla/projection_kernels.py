"""Triton kernels for the per-head projections around the MLA decode: the query absorption
(ql = q_nope @ W_UK_T per head) and the split-KV reduction fused with the up-projection
(o = merge_by_lse(partials) @ W_UV per head).

The absorption kernel serves small token counts (a cuBLAS call costs more host time than a cached Triton launch,
and both read the whole W_UK_T): it reads the queries through their strides and writes the absorbed queries and a
copy of the rotary queries into the builder's buffers, so the decode launch reads planned tensors only. In a
decode-only batch its launch also writes the new tokens' latent vectors into the cache
(:func:`_mla_absorb_write_kernel`, a slice of programs of its own), which saves the separate cache-write launch.

The up-projection kernel replaces two launches of the decode path (the split reduction, then a batched matmul over
the heads) by one: each program merges one head's split partials for a block of query tokens into the latent
[BLOCK_T, Lkv], rounds it to the model dtype exactly as the reduction stores its latent output, and multiplies it
by that head's W_UV [Lkv, V] on tensor cores. With one split it reads the decode kernel's 16-bit latent output
instead (no merge).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.launch_math import next_power_of_2
from ..ops.mla_cache import write_latent_token

__all__ = ["absorb_blocks", "reduce_up_blocks"]


def absorb_blocks(num_tokens: int, nope: int, kv_lora: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_P, BLOCK_L) of :func:`_mla_absorb_kernel`: query tokens per program (16 to 64, padded rows
    masked), the nope width per step of the matmul, latent columns per program."""
    block_t = max(16, min(next_power_of_2(num_tokens), 64))
    return block_t, max(16, min(next_power_of_2(nope), 64)), max(16, min(next_power_of_2(kv_lora), 128))


def reduce_up_blocks(num_tokens: int, kv_lora: int, v_dim: int, num_splits: int = 1) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, BLOCK_V) of :func:`_mla_reduce_up_kernel`: query tokens per program (16 to 64: tl.dot
    needs 16 rows, padded ones are masked), latent columns per step of the matmul (a token's [splits, columns]
    float32 partials held at once stay at most 4096 values), and the whole value width."""
    block_t = max(16, min(next_power_of_2(num_tokens), 64))
    block_c = max(16, min(next_power_of_2(kv_lora), 64, 4096 // next_power_of_2(max(1, num_splits))))
    return block_t, block_c, max(16, next_power_of_2(v_dim))


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` to nearest even, as a GPU converts it (the interpreter truncates to
    bfloat16: it is rounded here first, so that the truncation is exact)."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _mla_reduce_up_kernel(
    OUT,  # [T, H, V_DIM] model dtype, unit last stride (the call's tensor: the first argument)
    O_PART,  # NUM_SPLITS > 1: [T, H, S, KV_LORA] float32 partials; NUM_SPLITS == 1: [T, H, KV_LORA] latent
    LSE_PART,  # [T, H, S] float32 split LSEs (read when NUM_SPLITS > 1)
    LSE,  # [T, H] float32 merged LSE (written when STORE_LSE)
    W_UV,  # [H, KV_LORA, V_DIM] model dtype, unit last stride
    num_tokens,
    stride_p_t, stride_p_h, stride_p_s, stride_lp_t, stride_lp_h, stride_lse_t, stride_lse_h,
    stride_w_h, stride_w_c,
    stride_out_t, stride_out_h,
    KV_LORA: tl.constexpr,
    V_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two of NUM_SPLITS
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STORE_LSE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (H, cdiv(T, BLOCK_T)): head h, query tokens [t0, t0 + BLOCK_T). The merge weights are those of
    :func:`~attnbackends.ops.lse_merge.merge_by_lse` (a split whose LSE is -inf contributes nothing, NaN included;
    a token without keys gets a zero latent and LSE -inf)."""
    h = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    offs_c0 = tl.arange(0, BLOCK_C)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    lse_rows = LSE_PART + offs_t * stride_lp_t + h * stride_lp_h
    if NUM_SPLITS > 1 and STORE_LSE:
        lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=t_mask[:, None] & s_mask[None, :],
                      other=float("-inf"))  # [BLOCK_T, BLOCK_S]
        m = tl.max(lse, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: keep exp's arguments finite
        total = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe[:, None])), 1)
        merged = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(LSE + offs_t * stride_lse_t + h * stride_lse_h, merged, mask=t_mask)
    t0 = tl.program_id(1) * BLOCK_T
    rows = tl.arange(0, BLOCK_T)
    part_rows = O_PART + offs_t * stride_p_t + h * stride_p_h
    w_head = W_UV + h * stride_w_h
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for c0 in range(0, KV_LORA, BLOCK_C):
        offs_c = c0 + offs_c0
        c_mask = offs_c < KV_LORA
        tc_mask = t_mask[:, None] & c_mask[None, :]
        if NUM_SPLITS > 1:
            # one token at a time, all its splits in one [BLOCK_S, BLOCK_C] load: the loads of a program are few
            # and wide (a loop over the splits would chain NUM_SPLITS narrow loads per column block)
            latent = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for i in range(0, BLOCK_T):
                t = t0 + i
                if t < num_tokens:
                    lse_t = tl.load(LSE_PART + t * stride_lp_t + h * stride_lp_h + offs_s, mask=s_mask,
                                    other=float("-inf"))
                    m_t = tl.max(lse_t, 0)
                    m_t = tl.where(m_t == float("-inf"), 0.0, m_t)
                    w_t = tl.where(lse_t == float("-inf"), 0.0, tl.exp(lse_t - m_t))
                    total_t = tl.sum(w_t, 0)
                    w_t = w_t * tl.where(total_t > 0.0, 1.0 / tl.where(total_t > 0.0, total_t, 1.0), 0.0)
                    parts = tl.load(O_PART + t * stride_p_t + h * stride_p_h + offs_s[:, None] * stride_p_s
                                    + offs_c[None, :], mask=s_mask[:, None] & c_mask[None, :], other=0.0)
                    # where(), not a multiply, so a NaN in an ignored partial cannot leak through 0 * NaN
                    row = tl.sum(tl.where(w_t[:, None] > 0.0, parts * w_t[:, None], 0.0), 0)  # [BLOCK_C]
                    latent = tl.where(rows[:, None] == i, row[None, :], latent)
            # the latent in the model dtype, as the two-step path stores it before its matmul
            latent = _round_to(latent, W_UV.dtype.element_ty, INTERPRET)
        else:
            latent = tl.load(part_rows[:, None] + offs_c[None, :], mask=tc_mask, other=0.0).to(W_UV.dtype.element_ty)
        w_tile = tl.load(w_head + offs_c[:, None] * stride_w_c + offs_v[None, :], mask=c_mask[:, None] & v_mask[None, :],
                         other=0.0)  # [BLOCK_C, BLOCK_V]
        if INTERPRET:  # the interpreter's tl.dot on 16-bit inputs is wrong: the same products in float32
            acc += tl.dot(latent.to(tl.float32), w_tile.to(tl.float32))
        else:
            acc += tl.dot(latent, w_tile)
    out_ptr = OUT + offs_t[:, None] * stride_out_t + h * stride_out_h + offs_v[None, :]
    tl.store(out_ptr, _round_to(acc, OUT.dtype.element_ty, INTERPRET), mask=t_mask[:, None] & v_mask[None, :])


@triton.jit
def _absorb_tile(
    h, t_block, l_block, Q, W_UK_T, QL, Q_PE, num_tokens,
    stride_q_t, stride_q_h, stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h, stride_w_h, stride_w_p,
    NOPE: tl.constexpr, ROPE: tl.constexpr, KV_LORA: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Head h, query tokens [t_block * BLOCK_T, + BLOCK_T), latent columns [l_block * BLOCK_L, + BLOCK_L) of the
    absorption (arguments as :func:`_mla_absorb_kernel`); the tiles of latent block 0 also copy the rotary
    queries. ql is accumulated in float32 and rounded once to the model dtype (as cuBLAS does)."""
    offs_t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    offs_l = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
    l_mask = offs_l < KV_LORA
    q_rows = Q + offs_t * stride_q_t + h * stride_q_h
    w_head = W_UK_T + h * stride_w_h
    offs_p0 = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_T, BLOCK_L], dtype=tl.float32)
    for p0 in range(0, NOPE, BLOCK_P):
        offs_p = p0 + offs_p0
        p_mask = offs_p < NOPE
        q = tl.load(q_rows[:, None] + offs_p[None, :], mask=t_mask[:, None] & p_mask[None, :], other=0.0)
        w = tl.load(w_head + offs_p[:, None] * stride_w_p + offs_l[None, :], mask=p_mask[:, None] & l_mask[None, :],
                    other=0.0)
        if INTERPRET:  # the interpreter's tl.dot on 16-bit inputs is wrong: the same products in float32
            acc += tl.dot(q.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(q, w)
    tl.store(QL + offs_t[:, None] * stride_ql_t + h * stride_ql_h + offs_l[None, :],
             _round_to(acc, QL.dtype.element_ty, INTERPRET), mask=t_mask[:, None] & l_mask[None, :])
    if l_block == 0:
        offs_r = tl.arange(0, BLOCK_R)
        tr_mask = t_mask[:, None] & (offs_r < ROPE)[None, :]
        pe = tl.load(q_rows[:, None] + NOPE + offs_r[None, :], mask=tr_mask, other=0.0)
        tl.store(Q_PE + offs_t[:, None] * stride_qpe_t + h * stride_qpe_h + offs_r[None, :], pe, mask=tr_mask)


@triton.jit
def _mla_absorb_kernel(
    Q,  # [T, H, NOPE + ROPE] queries, unit last stride
    W_UK_T,  # [H, NOPE, KV_LORA] model dtype, unit last stride
    QL,  # [T, H, KV_LORA] absorbed queries (any strides with a unit last one)
    Q_PE,  # [T, H, ROPE] copy of the rotary queries (written by the programs of the first latent block)
    num_tokens,
    stride_q_t, stride_q_h, stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h,
    stride_w_h, stride_w_p,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    KV_LORA: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (H, cdiv(T, BLOCK_T), cdiv(KV_LORA, BLOCK_L)): head h, query tokens [t0, t0 + BLOCK_T), latent columns
    [l0, l0 + BLOCK_L) (:func:`_absorb_tile`)."""
    _absorb_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), Q, W_UK_T, QL, Q_PE, num_tokens,
                 stride_q_t, stride_q_h, stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h, stride_w_h, stride_w_p,
                 NOPE, ROPE, KV_LORA, BLOCK_T, BLOCK_P, BLOCK_L, BLOCK_R, INTERPRET)


@triton.jit(do_not_specialize=["num_slots"])
def _mla_absorb_write_kernel(
    Q,  # as _mla_absorb_kernel
    KV_C,  # [T, KV_LORA] the new tokens' latent KV (model dtype, unit last stride)
    K_PE,  # [T, ROPE] their rotary keys
    W_UK_T, QL, Q_PE,  # as _mla_absorb_kernel
    num_tokens,
    stride_q_t, stride_q_h, stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h,
    stride_w_h, stride_w_p,
    stride_kvc_t, stride_kpe_t,
    SLOTS,  # [>= T] int64 cache slot per token (-1: padding)
    CACHE,  # [num_blocks, block_size, KV_LORA + ROPE] the latent cache (model dtype or fp8), unit last stride
    stride_cache_blk, stride_cache_tok, block_size, num_slots,
    fault_ptr, fault_flag_ptr,  # the device's fault record (ops.page_guard)
    scale,  # k_scale of an fp8 cache
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    KV_LORA: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    """The absorption of :func:`_mla_absorb_kernel` and, in the same launch, the cache write of the T new tokens
    (:func:`~attnbackends.ops.mla_cache.write_latent_token`: the semantics of ``concat_and_cache_mla``).

    Grid (H + 1, cdiv(T, BLOCK_T), cdiv(KV_LORA, BLOCK_L)). Programs (h < H, tb, lb) are the absorption's tiles,
    unchanged: a head program's only extra work is one scalar comparison. The last row of axis 0 is a slice of
    programs of its own that only write tokens: program (H, tb, lb) writes the tokens ``tb * BLOCK_T + i`` with
    ``i`` = lb, lb + cdiv(KV_LORA, BLOCK_L), ... below BLOCK_T and T, so the tokens of a block are spread over the
    slice's latent-block programs and no head program waits on a write. The write touches only the cache and the
    absorption only QL and Q_PE: the two parts need no ordering inside the launch, and the decode launch that
    follows on the stream reads the written tokens."""
    h = tl.program_id(0)
    if h == tl.num_programs(0) - 1:
        L_BLOCKS: tl.constexpr = (KV_LORA + BLOCK_L - 1) // BLOCK_L
        t0 = tl.program_id(1) * BLOCK_T
        for j in range(0, (BLOCK_T + L_BLOCKS - 1) // L_BLOCKS):
            i = tl.program_id(2) + j * L_BLOCKS
            t = t0 + i
            if (i < BLOCK_T) & (t < num_tokens):
                write_latent_token(t, KV_C, K_PE, CACHE, SLOTS, stride_kvc_t, stride_kpe_t, stride_cache_blk,
                                   stride_cache_tok, scale, block_size, num_slots, fault_ptr, fault_flag_ptr,
                                   KV_LORA, ROPE, BLOCK_C, BLOCK_R, IS_FP8, FP8_MAX, FP8_MANT_BITS, FP8_MIN_EXP,
                                   INTERPRET)
    else:
        _absorb_tile(h, tl.program_id(1), tl.program_id(2), Q, W_UK_T, QL, Q_PE, num_tokens,
                     stride_q_t, stride_q_h, stride_ql_t, stride_ql_h, stride_qpe_t, stride_qpe_h, stride_w_h,
                     stride_w_p, NOPE, ROPE, KV_LORA, BLOCK_T, BLOCK_P, BLOCK_L, BLOCK_R, INTERPRET)
