"""Triton prefill kernel for Hopper: the prefill and chunked-prefill sequences of a batch, with their new tokens'
keys and values read from the contiguous ``key``/``value`` the forward writes to the cache, and only the cached
context from the pages.

A program is GQA_PACK query heads of one KV head x one block of BLOCK_M // GQA_PACK query tokens of one sequence
(its BLOCK_M rows: each token's heads in turn; GQA_PACK 1: one head, as FlashAttention tiles it; the query heads of
a KV head packed together read each key and value tile once for all of them). Causal; with a sliding window
(every tile it reads masked), a logits soft-cap and attention sinks as options. Q, the new K/V and O move by
TMA tensor descriptors made per sequence (their row bound is the sequence's end, so boxes past it read zeros and
store nothing); the cached context is read row by row through the block table. Tiles that every row sees
entirely run without a mask; only the context's partial last tile and the causal diagonal are masked. Scores are
in the log2 domain with the softmax scale folded into the exponent.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.page_guard import safe_page
from .kernels import RCP_LN2, _tanh

__all__ = ["prefill_new_kv_kernel"]


@triton.jit
def _log2_scores(qk, qk_scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """Raw scores -> log2-domain logits (``qk_scale`` is the softmax scale, times log2(e) without a soft-cap)."""
    if USE_SOFTCAP:
        return soft_cap * _tanh(qk * qk_scale / soft_cap) * RCP_LN2
    return qk * qk_scale


@triton.jit
def _online_softmax_step(acc, l_i, m_i, qk, v, n, pos, kv_end, qk_scale, soft_cap, MASKED: tl.constexpr,
                         SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr):
    """One online-softmax step over a [BLOCK_M, BLOCK_N] score tile: key ``n`` is visible from a row at position
    ``pos`` iff n <= pos, n < kv_end and (with a window) n > pos - SLIDING_WINDOW. Without a window every row sees a
    key in the first tile it reads, so the running max is finite from then on; with one, a row may see nothing
    yet, and its max stays -inf without producing NaN."""
    if MASKED:
        visible = (n[None, :] <= pos[:, None]) & (n[None, :] < kv_end)
        if SLIDING_WINDOW > 0:
            visible = visible & (n[None, :] > pos[:, None] - SLIDING_WINDOW)
        qk = tl.where(visible, _log2_scores(qk, qk_scale, soft_cap, USE_SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if SLIDING_WINDOW > 0:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(qk - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
    elif USE_SOFTCAP:
        qk = _log2_scores(qk, qk_scale, soft_cap, USE_SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, key_lo, pos, qk_scale, soft_cap,
                  offs_n, offs_d, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                  USE_SOFTCAP: tl.constexpr):
    """Cached keys j*BLOCK_N .. j*BLOCK_N + BLOCK_N - 1 (all before the new tokens), through the block table.
    A masked tile reads only keys in ``[key_lo, ctx)`` (zeros elsewhere): pages past the context or before every
    row's window may hold anything, NaN included, and a zero weight times NaN is NaN."""
    n = j * BLOCK_N + offs_n
    if MASKED:
        ok = (n < ctx) & (n >= key_lo)
        page = safe_page(tl.load(bt_row + n // BLOCK_SIZE, mask=ok, other=0), num_blocks).to(tl.int64)
        slot = n % BLOCK_SIZE
        k = tl.load(k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], mask=ok[:, None],
                    other=0.0)
        v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :], mask=ok[:, None],
                    other=0.0)
    else:
        page = safe_page(tl.load(bt_row + n // BLOCK_SIZE), num_blocks).to(tl.int64)
        slot = n % BLOCK_SIZE
        k = tl.load(k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :])
        v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k))
    return _online_softmax_step(acc, l_i, m_i, qk, v, n, pos, ctx, qk_scale, soft_cap, MASKED, SLIDING_WINDOW,
                                USE_SOFTCAP)


@triton.jit
def _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end, qk_scale, soft_cap,
                    offs_n, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                    USE_SOFTCAP: tl.constexpr):
    """New tokens i*BLOCK_N .. of the sequence from the contiguous key/value (positions relative to the
    sequence's first new token)."""
    n = i * BLOCK_N + offs_n
    k = k_desc.load([q_start + i * BLOCK_N, kv_col])
    v = v_desc.load([q_start + i * BLOCK_N, kv_col])
    qk = tl.dot(q, tl.trans(k))
    return _online_softmax_step(acc, l_i, m_i, qk, v, n, tok, new_end, qk_scale, soft_cap, MASKED, SLIDING_WINDOW,
                                USE_SOFTCAP)


@triton.jit(do_not_specialize=["num_blocks", "first_seq", "stride_qt", "stride_kt", "stride_vt", "stride_ot",
                               "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
                               "stride_bt"])
def prefill_new_kv_kernel(
    query_ptr, key_ptr, value_ptr, output_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, num_blocks,
    seq_lens_ptr, query_start_loc_ptr, sinks_ptr, first_seq,
    stride_qt, stride_kt, stride_vt, stride_ot, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, qk_scale, soft_cap,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, GQA_PACK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (NUM_HEADS // GQA_PACK, max query blocks, number of prefill sequences): sequence ``first_seq +
    program_id(2)``, query block ``num_programs(1) - 1 - program_id(1)`` (the causally heaviest blocks start first),
    query heads ``program_id(0) * GQA_PACK`` onwards (the heads of one KV head run together and share its pages in
    L2). GQA_PACK divides NUM_HEADS // NUM_KV_HEADS and BLOCK_M.

    query/output: [num_tokens, NUM_HEADS, HEAD_SIZE] (rows ``stride_qt``/``stride_ot`` apart); key/value:
    [num_tokens, NUM_KV_HEADS, HEAD_SIZE], the batch's new keys and values; key_cache/value_cache: paged
    [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] (any strides, head_size contiguous); ``qk_scale``: the
    softmax scale, times log2(e) unless USE_SOFTCAP (``soft_cap``: the cap); sinks: [NUM_HEADS] float32 logits
    (USE_SINKS). Causal; SLIDING_WINDOW > 0: a query at position p sees keys p - SLIDING_WINDOW + 1 .. p.
    """
    QPK: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_Q: tl.constexpr = BLOCK_M // GQA_PACK  # query tokens per program
    head0 = tl.program_id(0) * GQA_PACK  # the program's first query head (GQA_PACK heads of one KV head)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    q_len = q_end - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head0 // QPK
    kv_col = kv_head * HEAD_SIZE
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_m = tl.arange(0, BLOCK_M)
    # [BLOCK_M] query token index within the sequence of each row (rows are token-major: token, then head)
    tok = q_block * BLOCK_Q + offs_m // GQA_PACK
    pos = ctx + tok

    if GQA_PACK > 1:  # rows are (token, head) pairs: boxes over [tokens, heads, head_size]
        q_desc = tl.make_tensor_descriptor(query_ptr, shape=[q_end, NUM_HEADS, HEAD_SIZE],
                                           strides=[stride_qt, HEAD_SIZE, 1], block_shape=[BLOCK_Q, GQA_PACK, HEAD_SIZE])
        q = tl.reshape(q_desc.load([q_start + q_block * BLOCK_Q, head0, 0]), [BLOCK_M, HEAD_SIZE])
    else:
        q_desc = tl.make_tensor_descriptor(query_ptr, shape=[q_end, NUM_HEADS * HEAD_SIZE], strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, HEAD_SIZE])
        q = q_desc.load([q_start + q_block * BLOCK_M, head0 * HEAD_SIZE])

    if USE_SINKS:
        row_head = head0 + offs_m % GQA_PACK
        m_i = tl.load(sinks_ptr + row_head).to(tl.float32) * RCP_LN2
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    tok0 = q_block * BLOCK_Q

    # Cached context 0..ctx-1: visible to every row; whole tiles unmasked, the partial last one masked at ctx.
    # With a window: the tiles from the block's first row's window on, all masked.
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head * stride_kh
    v_base = value_cache_ptr + kv_head * stride_vh
    if SLIDING_WINDOW > 0:
        key_lo = ctx + tok0 - SLIDING_WINDOW + 1  # the first key any row of the block sees
        ctx_lo = tl.maximum(key_lo, 0) // BLOCK_N
        ctx_full = ctx_lo  # no unmasked tiles
        ctx_hi = tl.cdiv(ctx, BLOCK_N)
    else:
        key_lo = 0
        ctx_lo = 0
        ctx_full = ctx // BLOCK_N
        ctx_hi = tl.cdiv(ctx, BLOCK_N)
    if INTERPRET:
        j = ctx_lo
        while j < ctx_full:
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, key_lo, pos,
                                          qk_scale, soft_cap, offs_n, offs_d, stride_kb, stride_ks, stride_vb,
                                          stride_vs, BLOCK_N, BLOCK_SIZE, False, SLIDING_WINDOW, USE_SOFTCAP)
            j += 1
        j = ctx_full
        while j < ctx_hi:
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, key_lo, pos,
                                          qk_scale, soft_cap, offs_n, offs_d, stride_kb, stride_ks, stride_vb,
                                          stride_vs, BLOCK_N, BLOCK_SIZE, True, SLIDING_WINDOW, USE_SOFTCAP)
            j += 1
    else:
        for j in range(ctx_lo, ctx_full):
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, key_lo, pos,
                                          qk_scale, soft_cap, offs_n, offs_d, stride_kb, stride_ks, stride_vb,
                                          stride_vs, BLOCK_N, BLOCK_SIZE, False, SLIDING_WINDOW, USE_SOFTCAP)
        if SLIDING_WINDOW > 0:
            for j in range(ctx_full, ctx_hi):
                acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, key_lo,
                                              pos, qk_scale, soft_cap, offs_n, offs_d, stride_kb, stride_ks, stride_vb,
                                              stride_vs, BLOCK_N, BLOCK_SIZE, True, SLIDING_WINDOW, USE_SOFTCAP)
        elif ctx_full < ctx_hi:  # the partial last context tile
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, ctx_full, k_base, v_base, bt_row, num_blocks, ctx,
                                          key_lo, pos, qk_scale, soft_cap, offs_n, offs_d, stride_kb, stride_ks,
                                          stride_vb, stride_vs, BLOCK_N, BLOCK_SIZE, True, SLIDING_WINDOW,
                                          USE_SOFTCAP)

    # New tokens: tiles wholly at or before this block's first row unmasked, the causal diagonal masked.
    k_desc = tl.make_tensor_descriptor(key_ptr, shape=[q_end, NUM_KV_HEADS * HEAD_SIZE], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, HEAD_SIZE])
    v_desc = tl.make_tensor_descriptor(value_ptr, shape=[q_end, NUM_KV_HEADS * HEAD_SIZE], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, HEAD_SIZE])
    new_end = tl.minimum(tok0 + BLOCK_Q, q_len)
    if SLIDING_WINDOW > 0:
        new_lo = tl.maximum(tok0 - SLIDING_WINDOW + 1, 0) // BLOCK_N
        unmasked_hi = new_lo
    else:
        new_lo = 0
        unmasked_hi = (tok0 + 1) // BLOCK_N
    new_hi = tl.cdiv(new_end, BLOCK_N)
    if INTERPRET:
        i = new_lo
        while i < unmasked_hi:
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, soft_cap, offs_n, BLOCK_N, False, SLIDING_WINDOW, USE_SOFTCAP)
            i += 1
        i = unmasked_hi
        while i < new_hi:
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, soft_cap, offs_n, BLOCK_N, True, SLIDING_WINDOW, USE_SOFTCAP)
            i += 1
    else:
        for i in range(new_lo, unmasked_hi):
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, soft_cap, offs_n, BLOCK_N, False, SLIDING_WINDOW, USE_SOFTCAP)
        for i in range(unmasked_hi, new_hi):
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, soft_cap, offs_n, BLOCK_N, True, SLIDING_WINDOW, USE_SOFTCAP)

    if SLIDING_WINDOW > 0:  # rows past the request's end may see no key at all; they are not stored
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(output_ptr.dtype.element_ty)
    if GQA_PACK > 1:
        o_desc = tl.make_tensor_descriptor(output_ptr, shape=[q_end, NUM_HEADS, HEAD_SIZE],
                                           strides=[stride_ot, HEAD_SIZE, 1], block_shape=[BLOCK_Q, GQA_PACK, HEAD_SIZE])
        o_desc.store([q_start + q_block * BLOCK_Q, head0, 0], tl.reshape(out, [BLOCK_Q, GQA_PACK, HEAD_SIZE]))
    else:
        o_desc = tl.make_tensor_descriptor(output_ptr, shape=[q_end, NUM_HEADS * HEAD_SIZE], strides=[stride_ot, 1],
                                           block_shape=[BLOCK_M, HEAD_SIZE])
        o_desc.store([q_start + q_block * BLOCK_M, head0 * HEAD_SIZE], out)
