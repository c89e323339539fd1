"""Triton prefill kernel for Hopper: the prefill and chunked-prefill sequences of a batch, with their new tokens'
keys and values read from the contiguous ``key``/``value`` the forward writes to the cache, and only the cached
context from the pages.

A program is one query head x one block of BLOCK_M query tokens of one sequence. Q, the new K/V and O move by
TMA tensor descriptors made per sequence (their row bound is the sequence's end, so boxes past it read zeros and
store nothing); the cached context is read row by row through the block table. Tiles that every row sees
entirely run without a mask; only the context's partial last tile and the causal diagonal are masked. Scores are
in the log2 domain with the softmax scale folded into the exponent.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.page_guard import safe_page

__all__ = ["prefill_new_kv_kernel"]


@triton.jit
def _online_softmax_step(acc, l_i, m_i, qk, v, n, pos, kv_end, qk_scale, MASKED: tl.constexpr):
    """One online-softmax step over a [BLOCK_M, BLOCK_N] score tile: key ``n`` is visible from a row at position
    ``pos`` iff n <= pos and n < kv_end. Every row sees a key in the first tile it visits, so the running max is
    finite from then on and masked scores give a clean 0."""
    if MASKED:
        visible = (n[None, :] <= pos[:, None]) & (n[None, :] < kv_end)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, pos, qk_scale, offs_n, offs_d,
                  stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  MASKED: tl.constexpr):
    """Cached keys j*BLOCK_N .. j*BLOCK_N + BLOCK_N - 1 (all before the new tokens), through the block table."""
    n = j * BLOCK_N + offs_n
    if MASKED:
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=n < ctx, other=0)
    else:
        page = tl.load(bt_row + n // BLOCK_SIZE)
    page = safe_page(page, num_blocks).to(tl.int64)
    slot = n % BLOCK_SIZE
    k = tl.load(k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :])
    v = tl.load(v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k))
    return _online_softmax_step(acc, l_i, m_i, qk, v, n, pos, ctx, qk_scale, MASKED)


@triton.jit
def _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end, qk_scale, offs_n,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """New tokens i*BLOCK_N .. of the sequence from the contiguous key/value (positions relative to the
    sequence's first new token)."""
    n = i * BLOCK_N + offs_n
    k = k_desc.load([q_start + i * BLOCK_N, kv_col])
    v = v_desc.load([q_start + i * BLOCK_N, kv_col])
    qk = tl.dot(q, tl.trans(k))
    return _online_softmax_step(acc, l_i, m_i, qk, v, n, tok, new_end, qk_scale, MASKED)


@triton.jit(do_not_specialize=["num_blocks", "first_seq", "stride_qt", "stride_kt", "stride_vt", "stride_ot",
                               "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
                               "stride_bt"])
def prefill_new_kv_kernel(
    query_ptr, key_ptr, value_ptr, output_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, num_blocks,
    seq_lens_ptr, query_start_loc_ptr, first_seq,
    stride_qt, stride_kt, stride_vt, stride_ot, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, qk_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (NUM_HEADS, max query blocks, number of prefill sequences): sequence ``first_seq + program_id(2)``,
    query block ``num_programs(1) - 1 - program_id(1)`` (the causally heaviest blocks start first), query head
    ``program_id(0)`` (the heads of one KV head run together and share its pages in L2).

    query/output: [num_tokens, NUM_HEADS, HEAD_SIZE] (rows ``stride_qt``/``stride_ot`` apart); key/value:
    [num_tokens, NUM_KV_HEADS, HEAD_SIZE], the batch's new keys and values; key_cache/value_cache: paged
    [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE] (any strides, head_size contiguous); ``qk_scale``: the
    softmax scale times log2(e). Causal, no window, soft-cap, ALiBi or sinks.
    """
    QPK: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    head = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    q_len = q_end - q_start
    if q_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // QPK
    kv_col = kv_head * HEAD_SIZE
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_SIZE)
    tok = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query token index within the sequence
    pos = ctx + tok

    q_desc = tl.make_tensor_descriptor(query_ptr, shape=[q_end, NUM_HEADS * HEAD_SIZE], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, HEAD_SIZE])
    q = q_desc.load([q_start + q_block * BLOCK_M, head * HEAD_SIZE])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)

    # Cached context 0..ctx-1: visible to every row; whole tiles unmasked, the partial last one masked at ctx.
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head * stride_kh
    v_base = value_cache_ptr + kv_head * stride_vh
    ctx_full = ctx // BLOCK_N
    if INTERPRET:
        j = 0
        while j < ctx_full:
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, pos,
                                          qk_scale, offs_n, offs_d, stride_kb, stride_ks, stride_vb, stride_vs,
                                          BLOCK_N, BLOCK_SIZE, False)
            j += 1
    else:
        for j in range(0, ctx_full):
            acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, j, k_base, v_base, bt_row, num_blocks, ctx, pos,
                                          qk_scale, offs_n, offs_d, stride_kb, stride_ks, stride_vb, stride_vs,
                                          BLOCK_N, BLOCK_SIZE, False)
    if ctx_full * BLOCK_N < ctx:
        acc, l_i, m_i = _context_tile(acc, l_i, m_i, q, ctx_full, k_base, v_base, bt_row, num_blocks, ctx, pos,
                                      qk_scale, offs_n, offs_d, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N,
                                      BLOCK_SIZE, True)

    # New tokens: tiles wholly at or before this block's first row unmasked, the causal diagonal masked.
    k_desc = tl.make_tensor_descriptor(key_ptr, shape=[q_end, NUM_KV_HEADS * HEAD_SIZE], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, HEAD_SIZE])
    v_desc = tl.make_tensor_descriptor(value_ptr, shape=[q_end, NUM_KV_HEADS * HEAD_SIZE], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, HEAD_SIZE])
    tok0 = q_block * BLOCK_M
    new_end = tl.minimum(tok0 + BLOCK_M, q_len)
    unmasked_hi = (tok0 + 1) // BLOCK_N
    if INTERPRET:
        i = 0
        while i < unmasked_hi:
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, offs_n, BLOCK_N, False)
            i += 1
        i = unmasked_hi
        while i < tl.cdiv(new_end, BLOCK_N):
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, offs_n, BLOCK_N, True)
            i += 1
    else:
        for i in range(0, unmasked_hi):
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, offs_n, BLOCK_N, False)
        for i in range(unmasked_hi, tl.cdiv(new_end, BLOCK_N)):
            acc, l_i, m_i = _new_token_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, new_end,
                                            qk_scale, offs_n, BLOCK_N, True)

    o_desc = tl.make_tensor_descriptor(output_ptr, shape=[q_end, NUM_HEADS * HEAD_SIZE], strides=[stride_ot, 1],
                                       block_shape=[BLOCK_M, HEAD_SIZE])
    o_desc.store([q_start + q_block * BLOCK_M, head * HEAD_SIZE], (acc / l_i[:, None]).to(output_ptr.dtype.element_ty))
