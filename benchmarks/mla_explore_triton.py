"""Triton candidate kernels for MLA decode over the paged latent cache (driven by ``benchmarks/mla_explore.py``).

Cache layout (the project's, ``attnbackends/mla/cache.py``): ``kv_cache [num_blocks, PAGE, LKV + R]``, one latent
"KV head" c = [kv_c (LKV) ; k_pe (R)] per token; fp8 caches hold saturate(c / k_scale). Queries are absorbed:
``q_nope [T, H, LKV]`` and ``q_pe [T, H, R]``, T = query rows (B * q_len for uniform speculative decoding).

One kernel, :func:`_mla_candidate_kernel`, with the candidates' choices as constexprs:

- the accumulator [BLOCK_H, LKV] kept as NCHUNK column chunks (1, 2 or 4 separate ``tl.dot`` accumulators),
  products accumulated in place (``tl.dot(p, v, acc * alpha)``, ACC_INPLACE) or added (``acc * alpha + dot``);
- the cache tile read once as [BLOCK_N, LKV] (+ the rope columns) and used as K and as V;
- LOAD 0: pointer loads; 1: host TMA descriptors over the cache as [num_blocks * PAGE, LKV + R] (one box per
  chunk of a page); 2: the same descriptors built on the device (``tl.make_tensor_descriptor``);
- FOLD_SCALE: the softmax scale folded into the exp2 argument (one FMA) instead of a multiply of the scores;
- fp8 pages: KV_FP8 reads e4m3 and converts the tile to the query dtype (exact) for bf16 tensor-core products;
  QK_FP8 also quantises the query rows to e4m3 (one scale per row) and runs Q.K^T on fp8 tensor cores; PV_FP8
  runs P.V on fp8 tensor cores (P rounded to e4m3);
- P_VIA_MEM: P and alpha round-trip through a per-program global scratch, so Triton's layout heuristic no
  longer sees Q.K^T feeding P.V and splits Q.K^T across the two warpgroups instead of computing it twice;
- a work list built once per batch on the host (:func:`build_schedule`): each item is one query row over one key
  range [kv_lo, kv_hi) (the causal end of that row already applied, so q_len > 1 needs nothing more), written
  to the output directly when the row has one item, else to float32 partials that :func:`_combine_kernel`
  merges by log-sum-exp; PERSISTENT walks the list with a fixed grid.

Every program writes the natural-log LSE of its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from attnbackends.ops.quant import round_to_fp8_grid

LOG2E = 1.4426950408889634
FP8_E4M3_MAX = 448.0
WORK_FIELDS = 5  # row, request, kv_lo, kv_hi, slot (-1: write the output directly)


# ==============================================================================================================
# Kernels
# ==============================================================================================================
@triton.jit
def _load_chunk(CACHE, desc, row, rows_ptr, n_mask, col0, offs_w, LOAD: tl.constexpr, MASKED: tl.constexpr):
    """Columns col0 .. col0 + W of the tile's BLOCK_N cache rows: [BLOCK_N, W]. ``row`` is the first cache row of
    a whole tile (TMA); ``rows_ptr`` [BLOCK_N] the row pointers of a pointer tile (masked rows read 0)."""
    if LOAD == 0 or MASKED:
        if MASKED:
            t = tl.load(rows_ptr[:, None] + col0 + offs_w[None, :], mask=n_mask[:, None], other=0.0)
        else:
            t = tl.load(rows_ptr[:, None] + col0 + offs_w[None, :])
    else:
        t = desc.load([row, col0])
    return t


@triton.jit
def _to_e4m3(x, INTERPRET: tl.constexpr):
    """float32 -> e4m3 with round-to-nearest-even (the interpreter's own cast truncates)."""
    if INTERPRET:
        x = round_to_fp8_grid(x, 3, -6)
    return x.to(tl.float8e4nv)


@triton.jit
def _as_mma(x, dtype, INTERPRET: tl.constexpr):
    """A cache tile as a tensor-core operand of ``dtype`` (fp8 -> 16-bit is exact; the interpreter computes its
    dots in float32)."""
    if INTERPRET:
        return x.to(tl.float32)
    return x.to(dtype)


@triton.jit
def _tile_step(acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, n0, kv_hi, row, bt_row, CACHE,
               kv_desc, pe_desc, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale,
               LKV: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               NCHUNK: tl.constexpr, LOAD: tl.constexpr, ACC_INPLACE: tl.constexpr, FOLD_SCALE: tl.constexpr,
               KV_FP8: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr, P_VIA_MEM: tl.constexpr,
               MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 (masked at kv_hi when MASKED): scores over the chunks and the rope part, then
    the online-softmax update of every accumulator chunk. ``row`` is the tile's first cache row (whole tiles).

    P_VIA_MEM: P and alpha go to the program's global scratch (``p_scr`` [BLOCK_H, BLOCK_N], ``a_scr``
    [BLOCK_H]) and are read back, so no value of P.V derives from Q.K^T in SSA form. Triton then no longer sees
    a "chained dot" and gives Q.K^T the warps layout [4, 2] (each warpgroup computes half of the keys) instead of
    [8, 1] (with 64 rows, both warpgroups compute all of S)."""
    CW: tl.constexpr = LKV // NCHUNK
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, CW)
    offs_r = tl.arange(0, R)
    n_mask = offs_n < kv_hi
    if LOAD == 0 or MASKED:
        if MASKED:
            page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        rows_ptr = CACHE + page * stride_c_blk + (offs_n % PAGE) * stride_c_tok
    else:
        rows_ptr = CACHE
    k0 = _load_chunk(CACHE, kv_desc, row, rows_ptr, n_mask, 0, offs_w, LOAD, MASKED)
    if NCHUNK >= 2:
        k1 = _load_chunk(CACHE, kv_desc, row, rows_ptr, n_mask, CW, offs_w, LOAD, MASKED)
    if NCHUNK == 4:
        k2 = _load_chunk(CACHE, kv_desc, row, rows_ptr, n_mask, 2 * CW, offs_w, LOAD, MASKED)
        k3 = _load_chunk(CACHE, kv_desc, row, rows_ptr, n_mask, 3 * CW, offs_w, LOAD, MASKED)
    k_pe = _load_chunk(CACHE, pe_desc, row, rows_ptr, n_mask, LKV, offs_r, LOAD, MASKED)

    # Scores [BLOCK_H, BLOCK_N]: fp8 tensor cores on the stored values (QK_FP8), else 16-bit ones.
    if QK_FP8:
        if INTERPRET:
            s = tl.dot(q0.to(tl.float32), tl.trans(k0.to(tl.float32)))
            if NCHUNK >= 2:
                s = tl.dot(q1.to(tl.float32), tl.trans(k1.to(tl.float32)), s)
            if NCHUNK == 4:
                s = tl.dot(q2.to(tl.float32), tl.trans(k2.to(tl.float32)), s)
                s = tl.dot(q3.to(tl.float32), tl.trans(k3.to(tl.float32)), s)
            s = tl.dot(q_pe.to(tl.float32), tl.trans(k_pe.to(tl.float32)), s)
        else:
            s = tl.dot(q0, tl.trans(k0))
            if NCHUNK >= 2:
                s = tl.dot(q1, tl.trans(k1), s)
            if NCHUNK == 4:
                s = tl.dot(q2, tl.trans(k2), s)
                s = tl.dot(q3, tl.trans(k3), s)
            s = tl.dot(q_pe, tl.trans(k_pe), s)
    else:
        s = tl.dot(q0, tl.trans(_as_mma(k0, q0.dtype, INTERPRET)))
        if NCHUNK >= 2:
            s = tl.dot(q1, tl.trans(_as_mma(k1, q0.dtype, INTERPRET)), s)
        if NCHUNK == 4:
            s = tl.dot(q2, tl.trans(_as_mma(k2, q0.dtype, INTERPRET)), s)
            s = tl.dot(q3, tl.trans(_as_mma(k3, q0.dtype, INTERPRET)), s)
        s = tl.dot(q_pe, tl.trans(_as_mma(k_pe, q0.dtype, INTERPRET)), s)
    if QK_FP8:
        s = s * q_mul[:, None]  # the per-row query scale
    if MASKED:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    # Online softmax in the log2 domain: m_i in the units of s (FOLD_SCALE: the scale rides in the exp2's FMA).
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2((m_i - m_new) * qk_scale)
        p = tl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
    else:
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV_FP8:
        pv = _to_e4m3(p, INTERPRET)
        if INTERPRET:
            pv = pv.to(tl.float32)
    else:
        pv = p.to(q_pe.dtype) if not QK_FP8 else p.to(tl.bfloat16)
        if INTERPRET:
            pv = pv.to(tl.float32)
    if P_VIA_MEM:
        offs_h = tl.arange(0, pv.shape[0])
        offs_p = offs_h[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(p_scr + offs_p, pv)
        tl.store(a_scr + offs_h, alpha)
        tl.debug_barrier()  # every thread's part of P is written
        pv = tl.load(p_scr + offs_p)
        alpha = tl.load(a_scr + offs_h)
        tl.debug_barrier()  # every thread has read P before the next tile overwrites it
    if PV_FP8:
        v0 = k0.to(tl.float32) if INTERPRET else k0
    else:
        v0 = _as_mma(k0, pv.dtype, INTERPRET)
    if ACC_INPLACE:
        acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
    else:
        acc0 = acc0 * alpha[:, None] + tl.dot(pv, v0)
    if NCHUNK >= 2:
        if PV_FP8:
            v1 = k1.to(tl.float32) if INTERPRET else k1
        else:
            v1 = _as_mma(k1, pv.dtype, INTERPRET)
        if ACC_INPLACE:
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
        else:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1)
    if NCHUNK == 4:
        if PV_FP8:
            v2 = k2.to(tl.float32) if INTERPRET else k2
            v3 = k3.to(tl.float32) if INTERPRET else k3
        else:
            v2 = _as_mma(k2, pv.dtype, INTERPRET)
            v3 = _as_mma(k3, pv.dtype, INTERPRET)
        if ACC_INPLACE:
            acc2 = tl.dot(pv, v2, acc2 * alpha[:, None])
            acc3 = tl.dot(pv, v3, acc3 * alpha[:, None])
        else:
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2)
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, v3)
    return acc0, acc1, acc2, acc3, l_i, m_new


@triton.jit
def _store_chunk(acc, inv, O_ROW, OP_ROW, direct, col0, offs_w, h_mask):
    """Chunk [BLOCK_H, W] of the normalised output: to the output row (direct) or the float32 partial row."""
    o = acc * inv[:, None]
    if direct:
        tl.store(O_ROW + col0 + offs_w[None, :], o.to(O_ROW.dtype.element_ty), mask=h_mask[:, None])
    else:
        tl.store(OP_ROW + col0 + offs_w[None, :], o, mask=h_mask[:, None])


@triton.jit
def _work_item(Q_NOPE, Q_PE, CACHE, kv_desc, pe_desc, BLOCK_TABLE, WORK, O, LSE, O_PART, LSE_PART, p_scr, a_scr, w, hb,
               num_blocks, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_c_blk, stride_c_tok, stride_bt,
               stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h, stride_lp_s,
               qk_scale, v_scale,
               H: tl.constexpr, LKV: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_N: tl.constexpr, NCHUNK: tl.constexpr, LOAD: tl.constexpr, ACC_INPLACE: tl.constexpr,
               FOLD_SCALE: tl.constexpr, KV_FP8: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
               P_VIA_MEM: tl.constexpr, LOOP_STAGES: tl.constexpr, LOOP_WS: tl.constexpr,
               NO_ACC_MULTIBUF: tl.constexpr, INTERPRET: tl.constexpr):
    """One work item (query row, key range) for heads hb * BLOCK_H .. + BLOCK_H."""
    CW: tl.constexpr = LKV // NCHUNK
    t = tl.load(WORK + w * 5)
    req = tl.load(WORK + w * 5 + 1)
    kv_lo = tl.load(WORK + w * 5 + 2)
    kv_hi = tl.load(WORK + w * 5 + 3)
    slot = tl.load(WORK + w * 5 + 4)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    offs_w = tl.arange(0, CW)
    offs_r = tl.arange(0, R)
    q_row = Q_NOPE + t.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h
    q0 = tl.load(q_row + offs_w[None, :], mask=h_mask[:, None], other=0.0)
    q1 = q0
    q2 = q0
    q3 = q0
    if NCHUNK >= 2:
        q1 = tl.load(q_row + CW + offs_w[None, :], mask=h_mask[:, None], other=0.0)
    if NCHUNK == 4:
        q2 = tl.load(q_row + 2 * CW + offs_w[None, :], mask=h_mask[:, None], other=0.0)
        q3 = tl.load(q_row + 3 * CW + offs_w[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(Q_PE + t.to(tl.int64) * stride_qp_t + heads[:, None] * stride_qp_h + offs_r[None, :],
                   mask=h_mask[:, None], other=0.0)
    q_mul = tl.full([BLOCK_H], 1.0, tl.float32)
    if QK_FP8:
        # One e4m3 scale per query row (head): amax over all LKV + R columns.
        amax = tl.max(tl.abs(q0.to(tl.float32)), 1)
        if NCHUNK >= 2:
            amax = tl.maximum(amax, tl.max(tl.abs(q1.to(tl.float32)), 1))
        if NCHUNK == 4:
            amax = tl.maximum(amax, tl.max(tl.abs(q2.to(tl.float32)), 1))
            amax = tl.maximum(amax, tl.max(tl.abs(q3.to(tl.float32)), 1))
        amax = tl.maximum(amax, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
        q_mul = tl.where(amax > 0.0, amax / 448.0, 1.0)
        inv_q = (1.0 / q_mul)[:, None]
        q0 = _to_e4m3(q0.to(tl.float32) * inv_q, INTERPRET)
        q1 = _to_e4m3(q1.to(tl.float32) * inv_q, INTERPRET)
        q2 = _to_e4m3(q2.to(tl.float32) * inv_q, INTERPRET)
        q3 = _to_e4m3(q3.to(tl.float32) * inv_q, INTERPRET)
        q_pe = _to_e4m3(q_pe.to(tl.float32) * inv_q, INTERPRET)
    elif INTERPRET:
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, CW], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_bt
    if LOAD == 2:
        kv_d = tl.make_tensor_descriptor(CACHE, shape=[num_blocks * PAGE, LKV + R], strides=[LKV + R, 1],
                                         block_shape=[BLOCK_N, CW])
        pe_d = tl.make_tensor_descriptor(CACHE, shape=[num_blocks * PAGE, LKV + R], strides=[LKV + R, 1],
                                         block_shape=[BLOCK_N, R])
    else:
        kv_d = kv_desc
        pe_d = pe_desc
    full_hi = kv_lo + (kv_hi - kv_lo) // BLOCK_N * BLOCK_N
    if INTERPRET:
        n0 = kv_lo
        while n0 < full_hi:
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            acc0, acc1, acc2, acc3, l_i, m_i = _tile_step(
                acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, n0, kv_hi, row, bt_row, CACHE,
                kv_d, pe_d, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale, LKV, R, PAGE, BLOCK_N, NCHUNK, LOAD,
                ACC_INPLACE, FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, False, INTERPRET)
            n0 += BLOCK_N
    elif LOOP_WS:
        for n0 in tl.range(kv_lo, full_hi, BLOCK_N, warp_specialize=True):
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            acc0, acc1, acc2, acc3, l_i, m_i = _tile_step(
                acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, n0, kv_hi, row, bt_row, CACHE,
                kv_d, pe_d, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale, LKV, R, PAGE, BLOCK_N, NCHUNK, LOAD,
                ACC_INPLACE, FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, False, INTERPRET)
    elif LOOP_STAGES > 0:
        for n0 in tl.range(kv_lo, full_hi, BLOCK_N, num_stages=LOOP_STAGES,
                           disallow_acc_multi_buffer=NO_ACC_MULTIBUF):
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            acc0, acc1, acc2, acc3, l_i, m_i = _tile_step(
                acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, n0, kv_hi, row, bt_row, CACHE,
                kv_d, pe_d, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale, LKV, R, PAGE, BLOCK_N, NCHUNK, LOAD,
                ACC_INPLACE, FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, False, INTERPRET)
    else:
        for n0 in tl.range(kv_lo, full_hi, BLOCK_N, disallow_acc_multi_buffer=NO_ACC_MULTIBUF):
            row = tl.load(bt_row + n0 // PAGE) * PAGE + n0 % PAGE
            acc0, acc1, acc2, acc3, l_i, m_i = _tile_step(
                acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, n0, kv_hi, row, bt_row, CACHE,
                kv_d, pe_d, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale, LKV, R, PAGE, BLOCK_N, NCHUNK, LOAD,
                ACC_INPLACE, FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, False, INTERPRET)
    if full_hi < kv_hi:  # the last, partial tile: masked pointer loads (rows past the end may hold anything)
        acc0, acc1, acc2, acc3, l_i, m_i = _tile_step(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, q_pe, q_mul, full_hi, kv_hi, 0, bt_row, CACHE,
            kv_d, pe_d, p_scr, a_scr, stride_c_blk, stride_c_tok, qk_scale, LKV, R, PAGE, BLOCK_N, NCHUNK, LOAD,
            ACC_INPLACE, FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, True, INTERPRET)

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    if FOLD_SCALE:
        lse2 = m_i * qk_scale + tl.log2(l_safe)
    else:
        lse2 = m_i + tl.log2(l_safe)
    lse = tl.where(has_keys, lse2 / 1.4426950408889634, float("-inf"))
    inv = tl.where(has_keys, v_scale / l_safe, 0.0)
    direct = slot < 0
    o_row = O + t.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h
    op_row = O_PART + tl.maximum(slot, 0).to(tl.int64) * stride_op_s + heads[:, None] * stride_op_h
    _store_chunk(acc0, inv, o_row, op_row, direct, 0, offs_w, h_mask)
    if NCHUNK >= 2:
        _store_chunk(acc1, inv, o_row, op_row, direct, CW, offs_w, h_mask)
    if NCHUNK == 4:
        _store_chunk(acc2, inv, o_row, op_row, direct, 2 * CW, offs_w, h_mask)
        _store_chunk(acc3, inv, o_row, op_row, direct, 3 * CW, offs_w, h_mask)
    if direct:
        tl.store(LSE + t.to(tl.int64) * stride_lse_t + heads, lse, mask=h_mask)
    else:
        tl.store(LSE_PART + slot.to(tl.int64) * stride_lp_s + heads, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_items", "num_blocks", "stride_bt"])
def _mla_candidate_kernel(
    Q_NOPE, Q_PE,  # [T, H, LKV], [T, H, R]
    CACHE,  # [num_blocks, PAGE, LKV + R]
    KV_DESC, PE_DESC,  # host TMA descriptors over CACHE as [num_blocks * PAGE, LKV + R] (LOAD == 1), else CACHE
    BLOCK_TABLE,  # [B, W] int32
    WORK,  # [num_items, 5] int32
    O, LSE,  # [T, H, LKV] query dtype, [T, H] float32
    O_PART, LSE_PART,  # [S, H, LKV] float32, [S, H] float32
    P_SCR, A_SCR,  # P_VIA_MEM: per program [BLOCK_H * BLOCK_N] P and [BLOCK_H] float32 alpha scratch
    num_items, num_blocks,
    stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_c_blk, stride_c_tok, stride_bt,
    stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h, stride_lp_s,
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # k_scale for fp8 caches, else 1
    H: tl.constexpr, LKV: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NCHUNK: tl.constexpr, LOAD: tl.constexpr, ACC_INPLACE: tl.constexpr,
    FOLD_SCALE: tl.constexpr, KV_FP8: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
    P_VIA_MEM: tl.constexpr, LOOP_STAGES: tl.constexpr, LOOP_WS: tl.constexpr, NO_ACC_MULTIBUF: tl.constexpr,
    PERSISTENT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (H // BLOCK_H, num_items) (head blocks fastest, so both read a tile while it is in L2), or
    (H // BLOCK_H, programs) walking the work list when PERSISTENT."""
    hb = tl.program_id(0)
    prog = (tl.program_id(1) * tl.num_programs(0) + hb).to(tl.int64)
    p_scr = P_SCR + prog * (BLOCK_H * BLOCK_N)
    a_scr = A_SCR + prog * BLOCK_H
    if PERSISTENT:
        w = tl.program_id(1)
        while w < num_items:
            _work_item(Q_NOPE, Q_PE, CACHE, KV_DESC, PE_DESC, BLOCK_TABLE, WORK, O, LSE, O_PART, LSE_PART, p_scr,
                       a_scr, w, hb,
                       num_blocks, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_c_blk, stride_c_tok,
                       stride_bt, stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h, stride_lp_s,
                       qk_scale, v_scale, H, LKV, R, PAGE, BLOCK_H, BLOCK_N, NCHUNK, LOAD, ACC_INPLACE, FOLD_SCALE,
                       KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, LOOP_STAGES, LOOP_WS, NO_ACC_MULTIBUF, INTERPRET)
            w += tl.num_programs(1)
    else:
        _work_item(Q_NOPE, Q_PE, CACHE, KV_DESC, PE_DESC, BLOCK_TABLE, WORK, O, LSE, O_PART, LSE_PART, p_scr, a_scr,
                   tl.program_id(1), hb, num_blocks, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_c_blk,
                   stride_c_tok, stride_bt, stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h,
                   stride_lp_s, qk_scale, v_scale, H, LKV, R, PAGE, BLOCK_H, BLOCK_N, NCHUNK, LOAD, ACC_INPLACE,
                   FOLD_SCALE, KV_FP8, QK_FP8, PV_FP8, P_VIA_MEM, LOOP_STAGES, LOOP_WS, NO_ACC_MULTIBUF, INTERPRET)


@triton.jit(do_not_specialize=["num_rows"])
def _combine_kernel(O_PART, LSE_PART, ROWS, O, LSE, num_rows,
                    stride_op_s, stride_op_h, stride_lp_s, stride_o_t, stride_o_h, stride_lse_t,
                    H: tl.constexpr, LKV: tl.constexpr, BLOCK_HC: tl.constexpr):
    """Merge the partials of the rows that were split: ROWS [num_rows, 3] int32 (row, first slot, slot count).
    Grid (num_rows, cdiv(H, BLOCK_HC)); an online log-sum-exp merge over the row's slots (a slot whose lse is
    -inf contributes nothing)."""
    r = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HC + tl.arange(0, BLOCK_HC)
    h_mask = heads < H
    t = tl.load(ROWS + r * 3)
    first = tl.load(ROWS + r * 3 + 1)
    count = tl.load(ROWS + r * 3 + 2)
    offs = tl.arange(0, LKV)
    m = tl.full([BLOCK_HC], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_HC], tl.float32)
    acc = tl.zeros([BLOCK_HC, LKV], tl.float32)
    j = 0
    while j < count:
        s = (first + j).to(tl.int64)
        lse = tl.load(LSE_PART + s * stride_lp_s + heads, mask=h_mask, other=float("-inf"))
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        wgt = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
        part = tl.load(O_PART + s * stride_op_s + heads[:, None] * stride_op_h + offs[None, :],
                       mask=h_mask[:, None], other=0.0)
        acc = acc * a[:, None] + tl.where(wgt[:, None] > 0.0, part * wgt[:, None], 0.0)
        den = den * a + wgt
        m = m_new
        j += 1
    ok = den > 0.0
    inv = tl.where(ok, 1.0 / tl.where(ok, den, 1.0), 0.0)
    tl.store(O + t.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h + offs[None, :],
             (acc * inv[:, None]).to(O.dtype.element_ty), mask=h_mask[:, None])
    tl.store(LSE + t.to(tl.int64) * stride_lse_t + heads,
             tl.where(ok, m + tl.log(tl.where(ok, den, 1.0)), float("-inf")), mask=h_mask)


# ==============================================================================================================
# Host side: schedule (once per batch), configs, launch
# ==============================================================================================================
@dataclass
class Schedule:
    """The work of one batch, built once on the host (a metadata builder's job).

    work : [num_items, 5] int32 (row, request, kv_lo, kv_hi, slot); rows : [num_split_rows, 3] int32 (row, first
    slot, count) for the combine; num_slots partial rows."""

    work: torch.Tensor
    rows: torch.Tensor
    num_slots: int
    splits_per_row: int  # the largest split count (for the log)


def build_schedule(seq_lens: list[int], q_len: int, *, splits: Optional[int] = None, num_sms: int = 132,
                   head_blocks: int = 2, min_keys: int = 512, align: int = 256, balanced: bool = False,
                   device="cpu") -> Schedule:
    """Work items for requests of ``seq_lens`` keys (new tokens included) with ``q_len`` query rows each: row
    ``b * q_len + i`` sees keys [0, seq_len - q_len + i + 1).

    ``splits`` fixes the split count per row; None picks the most splits whose programs (``head_blocks`` per
    item) still fit one wave of ``num_sms``, never under ``min_keys`` keys per split. ``balanced``: FlashMLA-style,
    the rows' keys are cut into about equal pieces over the whole batch (long rows split more than short ones).
    Split boundaries are multiples of ``align`` (a multiple of every tile width and of the page size)."""
    if q_len < 1 or any(L < q_len for L in seq_lens):
        raise ValueError(f"every request needs seq_len >= q_len >= 1 (its new tokens are keys too); q_len {q_len}, "
                         f"shortest seq_len {min(seq_lens, default=0)}")
    rows_keys = []
    for b, L in enumerate(seq_lens):
        for i in range(q_len):
            rows_keys.append((b * q_len + i, b, L - q_len + i + 1))
    total_keys = sum(k for _, _, k in rows_keys)
    n_rows = len(rows_keys)
    items, split_rows, slot = [], [], 0
    if balanced:
        target_items = max(n_rows, num_sms // max(1, head_blocks))
        piece = max(min_keys, align * math.ceil(total_keys / target_items / align))
    for t, b, keys in rows_keys:
        if balanced:
            n = max(1, math.ceil(keys / piece))
        elif splits is not None:
            n = max(1, min(splits, math.ceil(keys / align)))
        else:
            want = num_sms // max(1, n_rows * head_blocks)  # the most splits that still fit one wave
            n = max(1, min(want, keys // min_keys if keys >= min_keys else 1))
        per = align * math.ceil(math.ceil(keys / n) / align)
        bounds = [(lo, min(lo + per, keys)) for lo in range(0, keys, per)]
        if len(bounds) == 1:
            items.append((t, b, 0, keys, -1))
        else:
            split_rows.append((t, slot, len(bounds)))
            for lo, hi in bounds:
                items.append((t, b, lo, hi, slot))
                slot += 1
    # Longest items first: the tail of the launch is short.
    items.sort(key=lambda it: -(it[3] - it[2]))
    work = torch.tensor(items, dtype=torch.int32).reshape(-1, WORK_FIELDS).to(device)
    rows = torch.tensor(split_rows, dtype=torch.int32).reshape(-1, 3).to(device)
    most = max([c for _, _, c in split_rows], default=1)
    return Schedule(work, rows, slot, most)


@dataclass(frozen=True)
class TritonConfig:
    """One compiled Triton candidate. ``load``: 0 pointers, 1 host TMA descriptors, 2 device descriptors.
    ``fp8``: "" (16-bit cache), "dequant" (e4m3 pages, 16-bit products), "qk" (fp8 Q.K^T), "qkpv" (both fp8).
    ``schedule``: "split" (split count from the SM count), "balanced" (FlashMLA-style pieces);
    ``programs_per_sm`` > 0: persistent grid."""

    family: str
    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    nchunk: int = 2
    load: int = 1
    acc_inplace: bool = True
    fold_scale: bool = True
    fp8: str = ""
    loop_stages: int = 0
    loop_ws: bool = False
    no_acc_multibuf: bool = False
    p_via_mem: bool = False
    schedule: str = "split"
    programs_per_sm: int = 0

    @property
    def label(self) -> str:
        s = f"{self.family} h{self.block_h} n{self.block_n} w{self.num_warps} s{self.num_stages} c{self.nchunk}"
        s += ("", " tma", " tmadev")[self.load]
        if not self.acc_inplace:
            s += " addacc"
        if not self.fold_scale:
            s += " mulscale"
        if self.fp8:
            s += f" fp8{self.fp8}"
        if self.loop_stages:
            s += f" loop{self.loop_stages}"
        if self.loop_ws:
            s += " ws"
        if self.no_acc_multibuf:
            s += " nomb"
        if self.p_via_mem:
            s += " pmem"
        if self.schedule != "split":
            s += f" {self.schedule}"
        if self.programs_per_sm:
            s += f" persist{self.programs_per_sm}"
        return s

    @property
    def kv_fp8(self) -> bool:
        return self.fp8 != ""


def validate_config(cfg: TritonConfig, lkv: int, rope: int, page: int) -> None:
    """Raise ValueError for a config these inputs cannot run."""
    if cfg.nchunk not in (1, 2, 4):
        raise ValueError(f"nchunk must be 1, 2 or 4, got {cfg.nchunk}")
    if lkv % cfg.nchunk or (lkv // cfg.nchunk) & (lkv // cfg.nchunk - 1):
        raise ValueError(f"LKV {lkv} / nchunk {cfg.nchunk} must be a power of two")
    if cfg.load not in (0, 1, 2):
        raise ValueError(f"load must be 0 (pointers), 1 (host TMA) or 2 (device TMA), got {cfg.load}")
    if cfg.load and (lkv // cfg.nchunk > 256 or rope > 256):
        raise ValueError(f"a TMA box side is at most 256: LKV / nchunk = {lkv // cfg.nchunk}, R = {rope}")
    if cfg.load and page % cfg.block_n:
        raise ValueError(f"TMA tiles lie in one page: page {page} must be a multiple of block_n {cfg.block_n}")
    if cfg.fp8 not in ("", "dequant", "qk", "qkpv"):
        raise ValueError(f"fp8 must be '', 'dequant', 'qk' or 'qkpv', got {cfg.fp8!r}")
    if cfg.p_via_mem and cfg.fp8 == "qkpv":
        raise ValueError("p_via_mem keeps P in 16 bits: not with fp8 P (fp8='qkpv')")
    if cfg.schedule not in ("split", "balanced"):
        raise ValueError(f"schedule must be 'split' or 'balanced', got {cfg.schedule!r}")


def tma_descriptors(cache: torch.Tensor, cfg: TritonConfig, lkv: int):
    """Host descriptors over the cache rows: (latent chunk box [block_n, LKV / nchunk], rope box [block_n, R])."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nb, page, width = cache.shape
    rows = cache.view(nb * page, width)
    return (TensorDescriptor.from_tensor(rows, [cfg.block_n, lkv // cfg.nchunk]),
            TensorDescriptor.from_tensor(rows, [cfg.block_n, width - lkv]))


def make_triton_launch(cfg: TritonConfig, q_nope, q_pe, cache, block_table, sched: Schedule, out, lse, *,
                       scale: float, k_scale: float = 1.0, num_sms: int = 132, interpret: bool = False):
    """A no-argument callable running ``cfg`` over ``sched`` into ``out`` [T, H, LKV] and ``lse`` [T, H]
    (partials and descriptors allocated here, once)."""
    T, H, lkv = q_nope.shape
    rope = q_pe.shape[-1]
    nb, page, width = cache.shape
    validate_config(cfg, lkv, rope, page)
    if width != lkv + rope:
        raise ValueError(f"cache width {width} != LKV + R = {lkv + rope}")
    is_fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if cfg.kv_fp8 != is_fp8:
        raise ValueError(f"config fp8={cfg.fp8!r} does not match the cache dtype {cache.dtype}")
    if cfg.fp8 in ("qk", "qkpv") and cache.dtype != torch.float8_e4m3fn:
        raise ValueError("fp8 tensor-core products need an e4m3 cache")
    device = q_nope.device
    o_part = torch.empty(max(1, sched.num_slots), H, lkv, dtype=torch.float32, device=device)
    lse_part = torch.empty(max(1, sched.num_slots), H, dtype=torch.float32, device=device)
    if cfg.load == 1:
        kv_desc, pe_desc = tma_descriptors(cache, cfg, lkv)
    else:
        kv_desc, pe_desc = cache, cache
    head_blocks = triton.cdiv(H, cfg.block_h)
    num_items = sched.work.shape[0]
    if cfg.programs_per_sm:
        grid = (head_blocks, max(1, min(num_items, cfg.programs_per_sm * num_sms // head_blocks)))
    else:
        grid = (head_blocks, num_items)
    programs = grid[0] * grid[1] if cfg.p_via_mem else 1
    p_scr = torch.empty(programs, cfg.block_h * cfg.block_n, device=device,
                        dtype=torch.float32 if interpret else (torch.bfloat16 if cfg.fp8 else q_nope.dtype))
    a_scr = torch.empty(programs, cfg.block_h, dtype=torch.float32, device=device)
    launch = Launch()
    launch.add(_mla_candidate_kernel, grid,
               (q_nope, q_pe, cache, kv_desc, pe_desc, block_table, sched.work, out, lse, o_part, lse_part, p_scr,
                a_scr, num_items, nb, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
                cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0),
                o_part.stride(0), o_part.stride(1), lse_part.stride(0),
                scale * LOG2E * (k_scale if is_fp8 else 1.0), k_scale if is_fp8 else 1.0),
               dict(H=H, LKV=lkv, R=rope, PAGE=page, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NCHUNK=cfg.nchunk,
                    LOAD=cfg.load, ACC_INPLACE=cfg.acc_inplace, FOLD_SCALE=cfg.fold_scale, KV_FP8=is_fp8,
                    QK_FP8=cfg.fp8 in ("qk", "qkpv"), PV_FP8=cfg.fp8 == "qkpv", P_VIA_MEM=cfg.p_via_mem,
                    LOOP_STAGES=cfg.loop_stages,
                    LOOP_WS=cfg.loop_ws, NO_ACC_MULTIBUF=cfg.no_acc_multibuf, PERSISTENT=cfg.programs_per_sm > 0,
                    INTERPRET=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    add_combine(launch, sched, o_part, lse_part, out, lse)
    return launch


def add_combine(launch: "Launch", sched: Schedule, o_part, lse_part, out, lse) -> None:
    """Append the log-sum-exp merge of the split rows (if any) to ``launch``."""
    if not sched.rows.shape[0]:
        return
    T, H, lkv = out.shape
    block_hc = 4
    launch.add(_combine_kernel, (sched.rows.shape[0], triton.cdiv(H, block_hc)),
               (o_part, lse_part, sched.rows, out, lse, sched.rows.shape[0], o_part.stride(0), o_part.stride(1),
                lse_part.stride(0), out.stride(0), out.stride(1), lse.stride(0)),
               dict(H=H, LKV=lkv, BLOCK_HC=block_hc, num_warps=4))


class Launch:
    """The kernel launches of one candidate on one batch, argument lists built once: calling it runs them in
    order; ``calls`` exposes them for the offline compiler (``mla_explore --compile-only``)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, kernel, grid, args: tuple, kwargs: dict) -> None:
        self.calls.append((kernel, grid, args, kwargs))

    def __call__(self) -> None:
        for kernel, grid, args, kwargs in self.calls:
            kernel[grid](*args, **kwargs)
