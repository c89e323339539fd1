"""Triton MLA decode: MQA of absorbed queries over the paged latent cache, split along the KV axis.

Every query head attends to the same latent "KV head" c = [kv_c ; k_pe] (Lkv + R wide); the value is kv_c. One
program handles BLOCK_H heads of one request over one KV split, so each cache tile is loaded once for BLOCK_H heads
and both products run on tensor cores (M = BLOCK_H). Splits are merged by their log-sum-exp in a second kernel:
the reduction here, or the up-projection kernel of :mod:`.projection_kernels`, which merges and projects at once.

Speculative decoding: a request may decode several query tokens (verify 1 + k drafts). Its programs' rows are then
(query token, head) pairs, row = t * H + h, so the cache is still read once per request for all of them; a row's
query token t sits at position L - q_len + t and sees keys up to it (causal), and inside a tree-verify request's
draft segment only its ancestors (the packed tree mask of :attr:`CommonAttentionMetadata.spec_tree_mask`). Only the
tiles reaching past the keys every row sees are masked per row.

A page id outside the cache is read as page 0 (:func:`attnbackends.ops.page_guard.safe_page`; the page guard
reports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ..ops.launch_math import cdiv, next_power_of_2
from ..ops.lse_merge import merge_by_lse
from ..ops.page_guard import safe_page
from ..ops.quant import dequantize_from_cache
from ..ops.tree_mask import tree_visible
from ..platform import DeviceInfo
from .decode_hopper import HOPPER_BLOCK_H, hopper_decode_applies, hopper_descriptors

__all__ = ["MLADecodeConfig", "default_decode_config", "mla_decode_torch", "choose_num_splits",
           "decode_kernel_name", "decode_descriptors", "tma_descriptors"]



@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of the decode kernel."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = False  # load whole cache tiles with TMA (see :func:`tma_decode_applies`)
    use_hopper: bool = False  # the Gluon kernel of :mod:`.decode_hopper` where it applies (Hopper, 16-bit, no tree)
    #: an fp8 e4m3 cache's score products on the Gluon kernel: "16-bit" (pages widened to the queries' dtype) or
    #: "e4m3" (queries quantised to e4m3 with one scale per row, pages read as stored; P.V stays 16-bit)
    fp8_scores: str = "16-bit"

    #: The values of :attr:`fp8_scores`.
    FP8_SCORES = ("16-bit", "e4m3")

    def __post_init__(self) -> None:
        if self.fp8_scores not in self.FP8_SCORES:
            raise ValueError(f"MLADecodeConfig.fp8_scores must be one of {self.FP8_SCORES}, got {self.fp8_scores!r}")


def default_decode_config(num_heads: int, interpreted: bool = False) -> MLADecodeConfig:
    """The launch config for ``num_heads`` heads (tiny tiles under the interpreter)."""
    if interpreted:
        return MLADecodeConfig(block_h=max(16, min(next_power_of_2(num_heads), 16)), block_n=16, num_warps=4, num_stages=1)
    # The fastest config of the sweep in benchmarks/NOTES.md (python -m benchmarks.mla --sweep).
    block_h = 64 if num_heads >= 64 else max(16, next_power_of_2(num_heads))
    return MLADecodeConfig(block_h=block_h, block_n=64 if block_h >= 64 else 32, num_warps=8 if block_h >= 64 else 4,
                           num_stages=2, use_tma=True, use_hopper=block_h == HOPPER_BLOCK_H)


def choose_num_splits(batch: int, num_heads: int, max_seq_len: int, sm_count: int, config: MLADecodeConfig) -> int:
    """KV splits for grids under half the SMs, as many as fill the GPU once without starting a second wave (a
    decode program holds a whole SM: one more program than SMs doubles the time of the longest ones), never more
    than one split per 256 tokens or 64 splits. Fuller grids run unsplit: the partials' round trip costs more than
    the idle SMs. ``num_heads``: the rows of one request (query heads x its longest query, see :func:`mla_decode`)."""
    programs = batch * cdiv(num_heads, config.block_h)
    if sm_count <= 0 or 2 * programs >= sm_count:
        return 1
    want = sm_count // programs
    return int(max(1, min(want, cdiv(max_seq_len, 256), 64)))


@triton.jit
def _visible(offs_n, pos, draft_start, draft_len, tree_ptr, USE_TREE: tl.constexpr):
    """[BLOCK_H, BLOCK_N] bool: key offs_n is visible from the row at position pos (causal), and inside the draft
    segment [draft_start, draft_start + draft_len) only where the packed tree mask allows it."""
    vis = offs_n[None, :] <= pos[:, None]
    if USE_TREE:
        vis = tree_visible(vis, offs_n, pos, draft_start, draft_len, tree_ptr)
    return vis


@triton.jit
def _decode_tile(
    acc, l_i, m_i, q, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok, qk_scale_log2,
    offs_c, offs_r, c_mask, r_mask, pos, draft_start, draft_len, tree_ptr,
    KV_LORA: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr,
    ROW_MASK: tl.constexpr, USE_TREE: tl.constexpr, INTERPRET: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    page = safe_page(tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0), num_blocks).to(tl.int64)
    row = page * stride_c_blk + (offs_n % PAGE_SIZE) * stride_c_tok
    kv = tl.load(CACHE + row[:, None] + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
    k_pe = tl.load(CACHE + row[:, None] + KV_LORA + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    if IS_FP8 or INTERPRET:
        # e4m3 / e5m2 values are exact in fp16 and bf16; the scale is applied to the fp32 results. (The
        # interpreter computes in float32: its tl.dot on bfloat16 is wrong.)
        kv = kv.to(q.dtype)
        k_pe = k_pe.to(q.dtype)
    s = tl.dot(q, tl.trans(kv)) + tl.dot(q_pe, tl.trans(k_pe))  # [BLOCK_H, BLOCK_N]
    s = tl.where(n_mask[None, :], s * qk_scale_log2, float("-inf"))
    if ROW_MASK:
        s = tl.where(_visible(offs_n, pos, draft_start, draft_len, tree_ptr, USE_TREE), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key of this tile yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return acc, l_i, m_new


@triton.jit
def _split_prologue(
    SEQ_LENS, QUERY_START, TREE_INDPTR, Q_PE, stride_qp_t, stride_qp_h, num_heads, num_splits,
    ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MAX_Q: tl.constexpr,
    USE_TREE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The program's request ``b``, its KV split and key range [start, end), its rows [BLOCK_H] (query token ``tok``
    and head of each, the row mask, the row's position ``pos``), the keys every row sees (``all_end``), the draft
    segment (start, length, mask pointer offset) and the rows' rotary queries q_pe [BLOCK_H, BLOCK_R] (float32
    under the interpreter)."""
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    rows = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    if MAX_Q == 1:
        q_len = 1
        heads = rows
        h_mask = rows < num_heads
        tok = b + rows * 0
    else:
        q_lo = tl.load(QUERY_START + b)
        q_len = tl.load(QUERY_START + b + 1) - q_lo
        heads = rows % num_heads
        h_mask = rows < q_len * num_heads
        tok = q_lo + rows // num_heads
    pos = seq_len - q_len + rows // num_heads
    all_end = seq_len - q_len + 1
    if USE_TREE:
        tree_lo = tl.load(TREE_INDPTR + b)
        tree_size = tl.load(TREE_INDPTR + b + 1) - tree_lo
        draft_len = (tl.sqrt(tree_size.to(tl.float32)) + 0.5).to(tl.int32)
        draft_start = seq_len - draft_len
        all_end = tl.minimum(all_end, draft_start)
    else:
        tree_lo = 0
        draft_len = 0
        draft_start = seq_len
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if MAX_Q > 1:
        end = tl.where(hb * BLOCK_H < q_len * num_heads, end, start)  # row blocks past the query tokens: no keys
    offs_r = tl.arange(0, BLOCK_R)
    q_pe = tl.load(
        Q_PE + tok[:, None] * stride_qp_t + heads[:, None] * stride_qp_h + offs_r[None, :],
        mask=h_mask[:, None] & (offs_r < ROPE)[None, :],
        other=0.0,
    )
    if INTERPRET:
        q_pe = q_pe.to(tl.float32)
    return b, split, start, end, tok, heads, h_mask, pos, all_end, draft_start, draft_len, tree_lo, q_pe


@triton.jit
def _split_epilogue(l_i, m_i, out_scale, LSE, tok, split, heads, h_mask, stride_lse_t, stride_lse_h,
                    STORE_LSE: tl.constexpr):
    """Stores the split's natural-log LSE (-inf without keys) when STORE_LSE; returns the factor [BLOCK_H] that
    turns the accumulator into the output: out_scale / l_i, 0 for rows without keys."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    if STORE_LSE:
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        tl.store(LSE + tok * stride_lse_t + heads * stride_lse_h + split, lse, mask=h_mask)
    return tl.where(has_keys, out_scale / l_safe, 0.0)


@triton.jit
def _mla_decode_kernel(
    Q_NOPE,  # [T, H, KV_LORA] absorbed queries (T query tokens, request b's from QUERY_START[b])
    Q_PE,  # [T, H, ROPE]
    CACHE,  # [num_blocks, PAGE_SIZE, KV_LORA + ROPE]
    BLOCK_TABLE,  # [B, W] int32
    SEQ_LENS,  # [B] int32
    QUERY_START,  # [B + 1] int32 (read when MAX_Q > 1; token b is request b's otherwise)
    TREE_MASK,  # [sum n_i^2] uint8, the packed tree mask (read when USE_TREE)
    TREE_INDPTR,  # [B + 1] int32
    O,  # one split: [T, H, KV_LORA] output; else [T, H, num_splits, KV_LORA] float32 partials
    LSE,  # one split: [T, H] float32 (optional); else [T, H, num_splits] float32
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,  # Q_NOPE, Q_PE
    stride_c_blk, stride_c_tok, stride_bt_b, num_blocks,  # CACHE, BLOCK_TABLE
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,  # O, LSE
    num_heads, num_splits,
    qk_scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,  # k_scale for fp8 caches, else 1
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    STORE_LSE: tl.constexpr,
    MAX_Q: tl.constexpr,  # the longest query of the batch: rows are MAX_Q x H per request
    USE_TREE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b, split, start, end, tok, heads, h_mask, pos, all_end, draft_start, draft_len, tree_lo, q_pe = _split_prologue(
        SEQ_LENS, QUERY_START, TREE_INDPTR, Q_PE, stride_qp_t, stride_qp_h, num_heads, num_splits, ROPE, BLOCK_R,
        BLOCK_H, BLOCK_N, MAX_Q, USE_TREE, INTERPRET)
    tree_ptr = TREE_MASK + tree_lo
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_mask = offs_c < KV_LORA
    r_mask = offs_r < ROPE
    q = tl.load(
        Q_NOPE + tok[:, None] * stride_qn_t + heads[:, None] * stride_qn_h + offs_c[None, :],
        mask=h_mask[:, None] & c_mask[None, :],
        other=0.0,
    )
    if INTERPRET:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b * stride_bt_b
    # Tiles before `mid` hold keys every row sees (each holds at least one valid key, so m_i is finite after the
    # first); later ones are masked per row (several query tokens, or a draft tree).
    if MAX_Q > 1 or USE_TREE:
        mid = start + tl.maximum(tl.minimum(all_end, end) - start, 0) // BLOCK_N * BLOCK_N
    else:
        mid = end
    if INTERPRET:  # the interpreter cannot use its 1-element scalar arrays as range() bounds
        n0 = start
        while n0 < mid:
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                qk_scale_log2, offs_c, offs_r, c_mask, r_mask, pos, draft_start, draft_len, tree_ptr,
                KV_LORA, PAGE_SIZE, BLOCK_N, IS_FP8, False, USE_TREE, INTERPRET)
            n0 += BLOCK_N
        if MAX_Q > 1 or USE_TREE:
            while n0 < end:
                acc, l_i, m_i = _decode_tile(
                    acc, l_i, m_i, q, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                    qk_scale_log2, offs_c, offs_r, c_mask, r_mask, pos, draft_start, draft_len, tree_ptr,
                    KV_LORA, PAGE_SIZE, BLOCK_N, IS_FP8, True, USE_TREE, INTERPRET)
                n0 += BLOCK_N
    else:
        for n0 in range(start, mid, BLOCK_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                qk_scale_log2, offs_c, offs_r, c_mask, r_mask, pos, draft_start, draft_len, tree_ptr,
                KV_LORA, PAGE_SIZE, BLOCK_N, IS_FP8, False, USE_TREE, INTERPRET)
        if MAX_Q > 1 or USE_TREE:
            for n0 in range(mid, end, BLOCK_N):
                acc, l_i, m_i = _decode_tile(
                    acc, l_i, m_i, q, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                    qk_scale_log2, offs_c, offs_r, c_mask, r_mask, pos, draft_start, draft_len, tree_ptr,
                    KV_LORA, PAGE_SIZE, BLOCK_N, IS_FP8, True, USE_TREE, INTERPRET)

    norm = _split_epilogue(l_i, m_i, v_scale, LSE, tok, split, heads, h_mask, stride_lse_t, stride_lse_h, STORE_LSE)
    o_ptr = O + tok[:, None] * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s + offs_c[None, :]
    tl.store(o_ptr, (acc * norm[:, None]).to(O.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


@triton.jit
def _mla_decode_reduce_kernel(
    O_PART,  # [B, H, S, KV_LORA] float32
    LSE_PART,  # [B, H, S] float32
    O,  # [B, H, KV_LORA]
    LSE,  # [B, H] float32 (optional)
    stride_p_b,
    stride_p_h,
    stride_p_s,
    stride_lp_b,
    stride_lp_h,
    stride_o_b,
    stride_o_h,
    stride_lse_b,
    stride_lse_h,
    KV_LORA: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(LSE_PART + b * stride_lp_b + h * stride_lp_h + offs_s, mask=s_mask, other=float("-inf"))
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # one column block of the latent per program
    c_mask = offs_c < KV_LORA
    parts = tl.load(
        O_PART + b * stride_p_b + h * stride_p_h + offs_s[:, None] * stride_p_s + offs_c[None, :],
        mask=s_mask[:, None] & c_mask[None, :],
        other=0.0,
    )
    o, merged_lse = merge_by_lse(parts, lse, False)
    tl.store(O + b * stride_o_b + h * stride_o_h + offs_c, o.to(O.dtype.element_ty), mask=c_mask)
    if STORE_LSE and tl.program_id(2) == 0:
        tl.store(LSE + b * stride_lse_b + h * stride_lse_h, merged_lse)


def reduce_block_c(kv_lora: int, num_splits: int) -> int:
    """Latent columns per program of the split reduction: [splits, columns] float32 partials held in registers stay
    at most 4096 values (no spills at 4 warps, whatever the split count)."""
    return max(16, min(next_power_of_2(kv_lora), 4096 // next_power_of_2(num_splits)))


@triton.jit
def _online_softmax_step(
    acc0, acc1, l_i, m_i, q0, q1, q_pe, kv0, kv1, k_pe, vis, qk_scale_log2, MASKED: tl.constexpr,
    ROW_MASK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One tile of keys: scores over the latent halves and the rope part, then the online-softmax update of the
    two halves of the accumulator ([BLOCK_H, Lkv / 2] each). ``vis``: the visible keys when MASKED, [1, BLOCK_N]
    (or [BLOCK_H, BLOCK_N] per row when ROW_MASK, where a row may see none of them)."""
    if INTERPRET:  # the interpreter's tl.dot on 16-bit inputs is wrong: compute in float32 (q is already)
        kv0 = kv0.to(tl.float32)
        kv1 = kv1.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    s = tl.dot(q0, tl.trans(kv0)) + tl.dot(q1, tl.trans(kv1)) + tl.dot(q_pe, tl.trans(k_pe))
    s = s * qk_scale_log2
    if MASKED:
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if ROW_MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(kv0.dtype)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, kv0)
    acc1 = acc1 * alpha[:, None] + tl.dot(p, kv1)
    return acc0, acc1, l_i, m_new


@triton.jit
def _pointer_tail_tile(
    acc0, acc1, l_i, m_i, q0, q1, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
    qk_scale_log2, offs_h, offs_r, offs_n, pos, draft_start, draft_len, tree_ptr,
    KV_LORA: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, ROW_MASK: tl.constexpr,
    USE_TREE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """A tile of the TMA kernel read through masked pointer loads (rows past ``end`` may hold anything)."""
    n = n0 + offs_n
    n_mask = n < end
    page = safe_page(tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0), num_blocks).to(tl.int64)
    row_ptr = CACHE + page * stride_c_blk + (n % PAGE_SIZE) * stride_c_tok
    kv0 = tl.load(row_ptr[:, None] + offs_h[None, :], mask=n_mask[:, None], other=0.0)
    kv1 = tl.load(row_ptr[:, None] + HALF + offs_h[None, :], mask=n_mask[:, None], other=0.0)
    k_pe = tl.load(row_ptr[:, None] + KV_LORA + offs_r[None, :], mask=n_mask[:, None], other=0.0)
    vis = n_mask[None, :]
    if ROW_MASK:
        vis = vis & _visible(n, pos, draft_start, draft_len, tree_ptr, USE_TREE)
    return _online_softmax_step(acc0, acc1, l_i, m_i, q0, q1, q_pe, kv0, kv1, k_pe, vis, qk_scale_log2, True,
                                ROW_MASK, INTERPRET)


@triton.jit
def _mla_decode_tma_kernel(
    Q_NOPE, Q_PE,  # as in _mla_decode_kernel
    KV_DESC,  # TMA descriptor over the cache as [num_blocks * PAGE_SIZE, KV_LORA + ROPE], block [BLOCK_N, HALF]
    PE_DESC,  # the same rows, block [BLOCK_N, ROPE]
    CACHE,  # the tiles past the fully visible ones are read through pointers
    BLOCK_TABLE, SEQ_LENS, QUERY_START, TREE_MASK, TREE_INDPTR, O, LSE,  # as in _mla_decode_kernel
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,  # Q_NOPE, Q_PE
    stride_c_blk, stride_c_tok, stride_bt_b, num_blocks,  # CACHE, BLOCK_TABLE
    stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,  # O, LSE
    num_heads, num_splits,
    qk_scale_log2,  # softmax scale * log2(e)
    KV_LORA: tl.constexpr,
    HALF: tl.constexpr,  # KV_LORA // 2, a power of two <= 256 (a TMA box side)
    ROPE: tl.constexpr,  # a power of two
    PAGE_SIZE: tl.constexpr,  # a multiple of BLOCK_N: every whole tile lies in one page
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr,
    MAX_Q: tl.constexpr,
    USE_TREE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """:func:`_mla_decode_kernel` for 16-bit caches with whole tiles loaded by TMA (Hopper's bulk tensor copies,
    pipelined by the compiler); the accumulator is kept as two halves because a TMA box side is at most 256."""
    b, split, start, end, tok, heads, h_mask, pos, all_end, draft_start, draft_len, tree_lo, q_pe = _split_prologue(
        SEQ_LENS, QUERY_START, TREE_INDPTR, Q_PE, stride_qp_t, stride_qp_h, num_heads, num_splits, ROPE, ROPE,
        BLOCK_H, BLOCK_N, MAX_Q, USE_TREE, INTERPRET)
    tree_ptr = TREE_MASK + tree_lo
    if MAX_Q > 1 or USE_TREE:
        full_end = start + tl.maximum(tl.minimum(all_end, end) - start, 0) // BLOCK_N * BLOCK_N
    else:
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    offs_h = tl.arange(0, HALF)
    offs_r = tl.arange(0, ROPE)
    q_rows = Q_NOPE + tok[:, None] * stride_qn_t + heads[:, None] * stride_qn_h
    q0 = tl.load(q_rows + offs_h[None, :], mask=h_mask[:, None], other=0.0)
    q1 = tl.load(q_rows + HALF + offs_h[None, :], mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    bt_row = BLOCK_TABLE + b * stride_bt_b
    offs_n = tl.arange(0, BLOCK_N)
    all_keys = (offs_n >= 0)[None, :]
    if INTERPRET:  # the interpreter cannot use its 1-element scalar arrays as range() bounds
        n0 = start
        while n0 < full_end:
            row = safe_page(tl.load(bt_row + n0 // PAGE_SIZE), num_blocks) * PAGE_SIZE + n0 % PAGE_SIZE
            acc0, acc1, l_i, m_i = _online_softmax_step(
                acc0, acc1, l_i, m_i, q0, q1, q_pe, KV_DESC.load([row, 0]), KV_DESC.load([row, HALF]),
                PE_DESC.load([row, KV_LORA]), all_keys, qk_scale_log2, False, False, INTERPRET)
            n0 += BLOCK_N
        while n0 < end:
            acc0, acc1, l_i, m_i = _pointer_tail_tile(
                acc0, acc1, l_i, m_i, q0, q1, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                qk_scale_log2, offs_h, offs_r, offs_n, pos, draft_start, draft_len, tree_ptr,
                KV_LORA, HALF, PAGE_SIZE, MAX_Q > 1 or USE_TREE, USE_TREE, INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(start, full_end, BLOCK_N):
            row = safe_page(tl.load(bt_row + n0 // PAGE_SIZE), num_blocks) * PAGE_SIZE + n0 % PAGE_SIZE
            acc0, acc1, l_i, m_i = _online_softmax_step(
                acc0, acc1, l_i, m_i, q0, q1, q_pe, KV_DESC.load([row, 0]), KV_DESC.load([row, HALF]),
                PE_DESC.load([row, KV_LORA]), all_keys, qk_scale_log2, False, False, INTERPRET)
        # the partial last tile, and with several query tokens or a tree the tiles each row sees in part
        for n0 in range(full_end, end, BLOCK_N):
            acc0, acc1, l_i, m_i = _pointer_tail_tile(
                acc0, acc1, l_i, m_i, q0, q1, q_pe, n0, end, bt_row, num_blocks, CACHE, stride_c_blk, stride_c_tok,
                qk_scale_log2, offs_h, offs_r, offs_n, pos, draft_start, draft_len, tree_ptr,
                KV_LORA, HALF, PAGE_SIZE, MAX_Q > 1 or USE_TREE, USE_TREE, INTERPRET)

    inv = _split_epilogue(l_i, m_i, 1.0, LSE, tok, split, heads, h_mask, stride_lse_t, stride_lse_h, STORE_LSE)[:, None]
    o_ptr = O + tok[:, None] * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s + offs_h[None, :]
    tl.store(o_ptr, (acc0 * inv).to(O.dtype.element_ty), mask=h_mask[:, None])
    tl.store(o_ptr + HALF, (acc1 * inv).to(O.dtype.element_ty), mask=h_mask[:, None])


def tma_decode_applies(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, config: MLADecodeConfig) -> bool:
    """Whether the TMA kernel can serve these inputs: asked for, a 16-bit cache whose pages are contiguous rows of
    Lkv + R elements, page size a multiple of the tile, Lkv / 2 and R powers of two that fit a TMA box (<= 256),
    and (on a GPU) compute capability 9.0 or newer."""
    kv_lora, rope = q_nope.shape[-1], q_pe.shape[-1]
    half = kv_lora // 2
    page = kv_cache.shape[1]
    if not config.use_tma or kv_cache.dtype not in (torch.float16, torch.bfloat16) or kv_lora % 2:
        return False
    if half & (half - 1) or rope & (rope - 1) or half > 256 or rope > 256 or page % config.block_n:
        return False
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != kv_lora + rope or kv_cache.stride(0) != page * (kv_lora + rope):
        return False
    if kv_cache.is_cuda and DeviceInfo.current(kv_cache.device).compute_capability < (9, 0):
        return False
    return q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1


def tma_descriptors(kv_cache: torch.Tensor, kv_lora: int, config: MLADecodeConfig) -> tuple[Any, Any]:
    """The TMA kernel's descriptors over ``kv_cache`` [num_blocks, block_size, Lkv + R]: (latent halves, rope part).
    They depend on the cache and the config only: build them once per cache (an impl keeps its layer's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, page, width = kv_cache.shape
    rows = kv_cache.view(num_blocks * page, width)
    return (TensorDescriptor.from_tensor(rows, [config.block_n, kv_lora // 2]),
            TensorDescriptor.from_tensor(rows, [config.block_n, width - kv_lora]))


def decode_kernel_name(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, config: MLADecodeConfig,
                       tree: bool) -> str:
    """The decode kernel :func:`mla_decode` launches for these inputs: "hopper" (the Gluon kernel of
    :mod:`.decode_hopper`, asked for by ``config.use_hopper`` and applicable), "tma" (the Triton kernel with TMA
    tiles, see :func:`tma_decode_applies`) or "pointer" (the portable Triton kernel)."""
    if config.use_hopper and config.block_h == HOPPER_BLOCK_H and hopper_decode_applies(q_nope, q_pe, kv_cache, tree):
        return "hopper"
    return "tma" if tma_decode_applies(q_nope, q_pe, kv_cache, config) else "pointer"


def decode_descriptors(kernel: str, kv_cache: torch.Tensor, kv_lora: int, config: MLADecodeConfig) -> Optional[tuple[Any, Any]]:
    """The TMA descriptors ``kernel`` (a :func:`decode_kernel_name`) reads ``kv_cache`` through (None: none). They
    depend on the cache, the kernel and the config only: an impl builds its layer's once."""
    if kernel == "hopper":
        return hopper_descriptors(kv_cache, kv_lora)
    return tma_descriptors(kv_cache, kv_lora, config) if kernel == "tma" else None



def mla_decode_torch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    output: torch.Tensor,
    *,
    scale: float,
    k_scale: float = 1.0,
    query_lens_cpu: Optional[torch.Tensor] = None,
    tree_masks: Optional[list[Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """Pure-torch :func:`~attnbackends.mla.decode_launch.mla_decode` (a loop over requests, float32): the CPU path and the kernel's test twin.

    seq_lens_cpu : [B] int32 on the CPU. query_lens_cpu : [B] int32 on the CPU, the query tokens per request (None:
    one each). tree_masks : per request its [n, n] bool draft-segment mask or None. Other arguments as in
    :func:`mla_decode`.
    """
    kv_lora = q_nope.shape[-1]
    block_size = kv_cache.shape[1]
    query_lens = query_lens_cpu.tolist() if query_lens_cpu is not None else [1] * len(seq_lens_cpu)
    start = 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens_cpu.tolist(), query_lens)):
        pages = block_table[i, : math.ceil(seq_len / block_size)].long()
        latent = dequantize_from_cache(kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len], torch.float32, k_scale)
        q = torch.cat([q_nope[start : start + q_len], q_pe[start : start + q_len]], dim=-1).float()  # [Q, H, Lkv + R]
        scores = torch.einsum("qhc,lc->qhl", q, latent) * scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]  # [Q, L]
        tree = tree_masks[i] if tree_masks is not None else None
        if tree is not None:
            n = tree.shape[0]
            visible[q_len - n :, seq_len - n :] &= tree.cpu()
        scores = scores.masked_fill(~visible.to(scores.device)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        output[start : start + q_len] = torch.einsum("qhl,lc->qhc", probs, latent[:, :kv_lora]).to(output.dtype)
        start += q_len
    return output
