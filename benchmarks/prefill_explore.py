"""Causal paged prefill in Triton: candidate formulations, checked and timed side by side with the peers.

    python benchmarks/prefill_explore.py --out $OUT/prefill.json 2>&1 | tee $OUT/prefill.log
    python benchmarks/prefill_explore.py --quick ...        # one best-guess config per candidate

Cache layout (the project's): ``kv_cache [num_blocks, 2, block_size, num_kv_heads, head_size]`` (contiguous),
``block_table [num_seqs, max_blocks]`` int32, ``query [num_tokens, num_heads, head_size]``, ``query_start_loc
[num_seqs + 1]`` int32, ``seq_lens [num_seqs]`` int32 (context + new tokens; the i-th new token of a sequence sits
at position ``seq_len - query_len + i``).

Candidates (one tile = BLOCK_M query rows x the keys of the sequence, BLOCK_N keys per step, online softmax in
the log2 domain with the softmax scale folded into one FMA; only the tiles that touch the causal diagonal are
masked):

- **A** FlashAttention-2 style: a program owns BLOCK_M tokens of ONE query head; K and V are loaded row-major as
  ``[BLOCK_N, head_size]`` tiles (16-byte vectors along head_size, one block-table lookup per key row) and the
  scores are ``dot(q, trans(k))``.
- **B** A with the query heads that share a KV head packed as extra rows (BLOCK_M = tokens x QPK): same loads,
  a quarter of the K/V traffic per query head, a narrower causal diagonal.
- **C** A with the unmasked key loop as ``tl.range(..., num_stages=...)`` (deeper per-loop pipeline) or
  ``tl.range(..., warp_specialize=True)`` (see F and G for where Triton 3.6 applies it on sm_90).
- **D** TMA: device-side tensor descriptors for Q and O (per sequence, so a tile never writes into the next
  sequence), and for K/V one descriptor over the cache viewed as ``[num_blocks * 2 * block_size,
  num_kv_heads * head_size]`` read one ``[block_size, head_size]`` box per page, boxes joined into the tile.
  ``kv_tma=False`` keeps the pointer loads for K/V (isolates the Q/O part).
- **E** A on a persistent grid (a few programs per SM looping over (query block, head) items, heaviest first).
- **F** the prefill fast path: cached context from the pages (pointer loads), the sequence's new tokens from
  the contiguous ``key``/``value`` the engine just projected (TMA boxes, no page table; the same numbers when
  the cache holds what was just written). Its new-token loop has only descriptor loads, the shape Triton's
  Hopper warp specialisation is built for, so it also runs with ``warp_specialize=True`` (8 warps: Triton 3.6
  leaves the loop as it is).
- **G** sequences without cached context only: K/V from the contiguous key/value, one key loop with every tile
  masked, 4 warps: the one attention shape Triton 3.6 warp-specialises on sm_90 (two-loop causal kernels fail
  to compile with 4 warps and are left alone with 8).
- **H** sequences without cached context only: the Gluon kernel of ``benchmarks/prefill_explore_gluon.py``
  (FlashAttention-3 style, two consumer warpgroups, explicit async wgmma; ``num_stages`` is its K/V buffer
  count). Not part of the default ``--families``; it cannot run under the interpreter.

Every program's query block comes from a work list built once per batch on the host (what a metadata builder
would do): (sequence, query block) pairs sorted by the number of keys they see, heaviest first, so the longest
programs start first and the tail of the launch is short.

Safety: each candidate family is first compiled and checked in a child process (``--probe``): a compiler
assertion or an illegal memory access there kills the child, not this run. Passing configs are then checked
against torch SDPA on the timed shapes and timed here, next to FlashInfer, torch SDPA and the current
``attnbackends`` kernel, all in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

if __name__ == "__main__":  # run as a script (so are its child processes): the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.explore_common import Log, kill_child, run_families, spawn_child  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
RCP_LN2 = 1.4426950408889634

HQ, HKV, D, PAGE = 32, 8, 128, 16
# The GPU run; ``--dry-run-cpu`` switches to the interpreter (float32: its bfloat16 dot is not exact).
DEVICE, DTYPE = "cuda", torch.bfloat16
SHAPES = [(1, 8192), (4, 4096), (16, 1024)]
REL_TOL = 1e-2


# ==============================================================================================================
# Kernels
# ==============================================================================================================
@triton.jit
def _softmax_update(acc, l_i, m_i, qk, v, n, pos, kv_end, qk_scale, MASKED: tl.constexpr):
    """One online-softmax step over a [BLOCK_M, BLOCK_N] score tile (log2 domain): key n is visible from a row
    at position pos iff n <= pos and n < kv_end. Unmasked tiles fold the scale into the exponent's FMA; every
    row sees at least one key in the first tile it visits, so the running max is finite and exp2(-inf - m) is
    a clean 0."""
    if MASKED:
        vis = (n[None, :] <= pos[:, None]) & (n[None, :] < kv_end)
        qk = tl.where(vis, qk * qk_scale, float("-inf"))
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
def _tma_page(kv_desc, bt_row, page_idx, n_pages, kv_col, KV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The [BLOCK_SIZE, HEAD] box of K (KV=0) or V (KV=1) of logical page ``page_idx``. Pages past the sequence
    read physical page 0: their keys are masked, and a TMA box never faults."""
    page = tl.load(bt_row + page_idx, mask=page_idx < n_pages, other=0)
    return kv_desc.load([(page * 2 + KV) * BLOCK_SIZE, kv_col])


@triton.jit
def _cat_rows(a, b):
    """[R, C] and [R, C] -> [2R, C], a's rows first (join puts the pair last; move it first, then merge)."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def _tma_pages(kv_desc, bt_row, first, n_pages, kv_col, KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               NP: tl.constexpr):
    """NP consecutive logical pages (NP in 2, 4, 8) as one [NP * BLOCK_SIZE, HEAD] tile."""
    tl.static_assert(NP == 2 or NP == 4 or NP == 8, "BLOCK_N // block_size must be 2, 4 or 8")
    t = _cat_rows(_tma_page(kv_desc, bt_row, first, n_pages, kv_col, KV, BLOCK_SIZE),
                  _tma_page(kv_desc, bt_row, first + 1, n_pages, kv_col, KV, BLOCK_SIZE))
    if NP >= 4:
        t = _cat_rows(t, _cat_rows(_tma_page(kv_desc, bt_row, first + 2, n_pages, kv_col, KV, BLOCK_SIZE),
                                   _tma_page(kv_desc, bt_row, first + 3, n_pages, kv_col, KV, BLOCK_SIZE)))
    if NP == 8:
        u = _cat_rows(_tma_page(kv_desc, bt_row, first + 4, n_pages, kv_col, KV, BLOCK_SIZE),
                      _tma_page(kv_desc, bt_row, first + 5, n_pages, kv_col, KV, BLOCK_SIZE))
        u = _cat_rows(u, _cat_rows(_tma_page(kv_desc, bt_row, first + 6, n_pages, kv_col, KV, BLOCK_SIZE),
                                   _tma_page(kv_desc, bt_row, first + 7, n_pages, kv_col, KV, BLOCK_SIZE)))
        t = _cat_rows(t, u)
    return t


@triton.jit
def _kv_tile(acc, l_i, m_i, q, j, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale, offs_n, offs_d,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, STRIDE_PAGE: tl.constexpr, STRIDE_SLOT: tl.constexpr,
             STRIDE_KV: tl.constexpr, KV_TMA: tl.constexpr, MASKED: tl.constexpr):
    """Keys j*BLOCK_N .. j*BLOCK_N + BLOCK_N - 1 of one sequence for one KV head."""
    n = j * BLOCK_N + offs_n  # [BLOCK_N] key positions
    if KV_TMA:
        n_pages = tl.cdiv(kv_end, BLOCK_SIZE)
        first = j * (BLOCK_N // BLOCK_SIZE)
        k = _tma_pages(kv_desc, bt_row, first, n_pages, kv_col, 0, BLOCK_SIZE, BLOCK_N // BLOCK_SIZE)
        v = _tma_pages(kv_desc, bt_row, first, n_pages, kv_col, 1, BLOCK_SIZE, BLOCK_N // BLOCK_SIZE)
    else:
        # One block-table lookup per key row; K and V of a page differ by a constant offset.
        if MASKED:
            n_ok = n < kv_end
            page = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0)
        else:
            page = tl.load(bt_row + n // BLOCK_SIZE)
        row = page.to(tl.int64) * STRIDE_PAGE + (n % BLOCK_SIZE) * STRIDE_SLOT  # [BLOCK_N]
        k_ptrs = kv_base + row[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD], head_size contiguous
        if MASKED:
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            v = tl.load(k_ptrs + STRIDE_KV, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(k_ptrs + STRIDE_KV)
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32
    return _softmax_update(acc, l_i, m_i, qk, v, n, pos, kv_end, qk_scale, MASKED)


@triton.jit
def _new_kv_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale, offs_n,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """New tokens i*BLOCK_N .. of the sequence read from the contiguous key/value just projected (one TMA box
    each, no page table); ``tok`` and the key index are both relative to the sequence's first new token."""
    n = i * BLOCK_N + offs_n
    k = k_desc.load([q_start + i * BLOCK_N, kv_col])  # [BLOCK_N, HEAD]
    v = v_desc.load([q_start + i * BLOCK_N, kv_col])
    qk = tl.dot(q, tl.trans(k))
    return _softmax_update(acc, l_i, m_i, qk, v, n, tok, q_len, qk_scale, MASKED)


@triton.jit
def _new_kv_loop(acc, l_i, m_i, q, lo, hi, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale, offs_n,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOOP_WS: tl.constexpr, LOOP_STAGES: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Tiles lo..hi-1 of the new tokens (see _kv_loop for the loop forms)."""
    if INTERPRET:
        i = lo
        while i < hi:
            acc, l_i, m_i = _new_kv_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale,
                                         offs_n, BLOCK_N, MASKED)
            i += 1
    elif LOOP_WS:
        for i in tl.range(lo, hi, warp_specialize=True):
            acc, l_i, m_i = _new_kv_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale,
                                         offs_n, BLOCK_N, MASKED)
    elif LOOP_STAGES > 0:
        for i in tl.range(lo, hi, num_stages=LOOP_STAGES):
            acc, l_i, m_i = _new_kv_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale,
                                         offs_n, BLOCK_N, MASKED)
    else:
        for i in range(lo, hi):
            acc, l_i, m_i = _new_kv_tile(acc, l_i, m_i, q, i, k_desc, v_desc, q_start, kv_col, tok, q_len, qk_scale,
                                         offs_n, BLOCK_N, MASKED)
    return acc, l_i, m_i


@triton.jit
def _kv_loop(acc, l_i, m_i, q, lo, hi, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale, offs_n, offs_d,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, STRIDE_PAGE: tl.constexpr, STRIDE_SLOT: tl.constexpr,
             STRIDE_KV: tl.constexpr, KV_TMA: tl.constexpr, MASKED: tl.constexpr, LOOP_WS: tl.constexpr,
             LOOP_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """Key tiles lo..hi-1. The interpreter gets a while-loop: with numpy >= 2.3 it cannot turn its 1-element
    scalar arrays into range() bounds."""
    if INTERPRET:
        j = lo
        while j < hi:
            acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, j, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale,
                                     offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                     KV_TMA, MASKED)
            j += 1
    elif LOOP_WS:
        for j in tl.range(lo, hi, warp_specialize=True):
            acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, j, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale,
                                     offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                     KV_TMA, MASKED)
    elif LOOP_STAGES > 0:
        for j in tl.range(lo, hi, num_stages=LOOP_STAGES):
            acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, j, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale,
                                     offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                     KV_TMA, MASKED)
    else:
        for j in range(lo, hi):
            acc, l_i, m_i = _kv_tile(acc, l_i, m_i, q, j, kv_base, kv_desc, kv_col, bt_row, kv_end, pos, qk_scale,
                                     offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                     KV_TMA, MASKED)
    return acc, l_i, m_i


@triton.jit
def _prefill_tile(q_ptr, kv_ptr, o_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, work_ptr, key_ptr, value_ptr, num_blocks,
                  stride_bt, qk_scale, w, group,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  ROWS_PER_TOK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                  KV_TMA: tl.constexpr, NEW_KV: tl.constexpr, LOOP_WS: tl.constexpr, LOOP_STAGES: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Work item ``w`` (a query block of one sequence) for head group ``group``: ROWS_PER_TOK == 1 is one query
    head (rows = tokens), ROWS_PER_TOK == QPK packs the query heads of one KV head (rows = tokens x heads).
    NEW_KV: the cached context comes from the pages, the sequence's new tokens from the contiguous
    ``key``/``value`` [num_tokens, num_kv_heads, head_size] (TMA, no page table)."""
    QPK: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_Q: tl.constexpr = BLOCK_M // ROWS_PER_TOK
    tl.static_assert(QPK % ROWS_PER_TOK == 0)
    tl.static_assert(ROWS_PER_TOK == 1 or not TMA, "the TMA query box holds one head: no GQA packing")
    tl.static_assert(not NEW_KV or (TMA and not KV_TMA), "NEW_KV reads Q/O by TMA and the context by pointers")
    STRIDE_TOK: tl.constexpr = NUM_HEADS * HEAD
    STRIDE_SLOT: tl.constexpr = NUM_KV_HEADS * HEAD
    STRIDE_KV: tl.constexpr = BLOCK_SIZE * STRIDE_SLOT
    STRIDE_PAGE: tl.constexpr = 2 * STRIDE_KV

    seq = tl.load(work_ptr + 2 * w)
    q_block = tl.load(work_ptr + 2 * w + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    q_len = q_end - q_start
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    head0 = group * ROWS_PER_TOK
    kv_head = head0 // QPK
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD)
    tok = q_block * BLOCK_Q + offs_m // ROWS_PER_TOK  # [BLOCK_M] token index inside the sequence
    pos = ctx + tok
    row_ok = tok < q_len
    q_off = (q_start + tok).to(tl.int64) * STRIDE_TOK + (head0 + offs_m % ROWS_PER_TOK) * HEAD

    if TMA:
        # Per-sequence descriptors: rows past the sequence read as zeros and are never written.
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[q_end, STRIDE_TOK], strides=[STRIDE_TOK, 1],
                                           block_shape=[BLOCK_M, HEAD])
        q = q_desc.load([q_start + q_block * BLOCK_M, head0 * HEAD])
    else:
        q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if KV_TMA:
        kv_desc = tl.make_tensor_descriptor(kv_ptr, shape=[num_blocks * 2 * BLOCK_SIZE, STRIDE_SLOT],
                                            strides=[STRIDE_SLOT, 1], block_shape=[BLOCK_SIZE, HEAD])
    else:
        kv_desc = kv_ptr

    first_pos = ctx + q_block * BLOCK_Q
    kv_end = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)  # one past the last key any row sees
    full_hi = (first_pos + 1) // BLOCK_N  # tiles every row sees entirely: no mask
    tile_hi = tl.cdiv(kv_end, BLOCK_N)
    kv_base = kv_ptr + kv_head * HEAD
    kv_col = kv_head * HEAD
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
    if NEW_KV:
        # Context keys 0..ctx-1 are visible to every row: whole tiles unmasked, the partial last one masked at ctx.
        ctx_full = ctx // BLOCK_N
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, 0, ctx_full, kv_base, kv_desc, kv_col, bt_row, ctx, pos,
                                 qk_scale, offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                 False, False, False, 0, INTERPRET)
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, ctx_full, tl.cdiv(ctx, BLOCK_N), kv_base, kv_desc, kv_col, bt_row,
                                 ctx, pos, qk_scale, offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT,
                                 STRIDE_KV, False, True, False, 0, INTERPRET)
        k_desc = tl.make_tensor_descriptor(key_ptr, shape=[q_end, STRIDE_SLOT], strides=[STRIDE_SLOT, 1],
                                           block_shape=[BLOCK_N, HEAD])
        v_desc = tl.make_tensor_descriptor(value_ptr, shape=[q_end, STRIDE_SLOT], strides=[STRIDE_SLOT, 1],
                                           block_shape=[BLOCK_N, HEAD])
        tok0 = q_block * BLOCK_Q
        new_end = tl.minimum(tok0 + BLOCK_Q, q_len)
        acc, l_i, m_i = _new_kv_loop(acc, l_i, m_i, q, 0, (tok0 + 1) // BLOCK_N, k_desc, v_desc, q_start, kv_col,
                                     tok, new_end, qk_scale, offs_n, BLOCK_N, False, LOOP_WS, LOOP_STAGES, INTERPRET)
        acc, l_i, m_i = _new_kv_loop(acc, l_i, m_i, q, (tok0 + 1) // BLOCK_N, tl.cdiv(new_end, BLOCK_N), k_desc,
                                     v_desc, q_start, kv_col, tok, new_end, qk_scale, offs_n, BLOCK_N, True, False,
                                     0, INTERPRET)
    else:
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, 0, full_hi, kv_base, kv_desc, kv_col, bt_row, kv_end, pos,
                                 qk_scale, offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                 KV_TMA, False, LOOP_WS, LOOP_STAGES, INTERPRET)
        acc, l_i, m_i = _kv_loop(acc, l_i, m_i, q, full_hi, tile_hi, kv_base, kv_desc, kv_col, bt_row, kv_end, pos,
                                 qk_scale, offs_n, offs_d, BLOCK_N, BLOCK_SIZE, STRIDE_PAGE, STRIDE_SLOT, STRIDE_KV,
                                 KV_TMA, True, False, 0, INTERPRET)
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    if TMA:
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[q_end, STRIDE_TOK], strides=[STRIDE_TOK, 1],
                                           block_shape=[BLOCK_M, HEAD])
        o_desc.store([q_start + q_block * BLOCK_M, head0 * HEAD], out)
    else:
        tl.store(o_ptr + q_off[:, None] + offs_d[None, :], out, mask=row_ok[:, None])


# Batch-varying ints are not specialised, so one compiled kernel per config serves every timed shape.
@triton.jit(do_not_specialize=["num_blocks", "num_work", "stride_bt"])
def _prefill_kernel(q_ptr, kv_ptr, o_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, work_ptr, key_ptr, value_ptr, num_blocks,
                    num_work, stride_bt, qk_scale,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, ROWS_PER_TOK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, TMA: tl.constexpr, KV_TMA: tl.constexpr, NEW_KV: tl.constexpr,
                    LOOP_WS: tl.constexpr, LOOP_STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Grid (NUM_HEADS // ROWS_PER_TOK, num_work): axis 0 (fastest) runs the head groups of one query block
    together, so the query heads of a KV head read its pages while they are in L2; axis 1 walks the work list
    heaviest first. PERSISTENT: grid (programs,), each program strides over the flattened (work, group) items."""
    n_groups: tl.constexpr = NUM_HEADS // ROWS_PER_TOK
    if PERSISTENT:
        item = tl.program_id(0)
        total = num_work * n_groups
        while item < total:
            _prefill_tile(q_ptr, kv_ptr, o_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, work_ptr, key_ptr, value_ptr,
                          num_blocks, stride_bt, qk_scale, item // n_groups, item % n_groups,
                          NUM_HEADS, NUM_KV_HEADS, HEAD, BLOCK_SIZE, ROWS_PER_TOK, BLOCK_M, BLOCK_N, TMA, KV_TMA,
                          NEW_KV, LOOP_WS, LOOP_STAGES, INTERPRET)
            item += tl.num_programs(0)
    else:
        _prefill_tile(q_ptr, kv_ptr, o_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, work_ptr, key_ptr, value_ptr,
                      num_blocks, stride_bt, qk_scale, tl.program_id(1), tl.program_id(0),
                      NUM_HEADS, NUM_KV_HEADS, HEAD, BLOCK_SIZE, ROWS_PER_TOK, BLOCK_M, BLOCK_N, TMA, KV_TMA,
                      NEW_KV, LOOP_WS, LOOP_STAGES, INTERPRET)


@triton.jit(do_not_specialize=["num_work"])
def _prefill_new_ws_kernel(q_ptr, key_ptr, value_ptr, o_ptr, qsl_ptr, work_ptr, num_work, qk_scale,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP_WS: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """G: sequences without cached context, K/V from the contiguous key/value, ONE key loop (every tile
    masked) so that Triton's Hopper warp specialisation accepts it: on sm_90 it partitions a single TMA loop
    with 4 warps, and declines (8 warps) or fails to compile (4 warps) the two-loop causal split.
    Grid (NUM_HEADS, num_work), as _prefill_kernel."""
    QPK: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    STRIDE_TOK: tl.constexpr = NUM_HEADS * HEAD
    STRIDE_KV_TOK: tl.constexpr = NUM_KV_HEADS * HEAD
    head = tl.program_id(0)
    w = tl.program_id(1)
    seq = tl.load(work_ptr + 2 * w)
    q_block = tl.load(work_ptr + 2 * w + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    q_len = q_end - q_start
    kv_col = (head // QPK) * HEAD
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[q_end, STRIDE_TOK], strides=[STRIDE_TOK, 1],
                                       block_shape=[BLOCK_M, HEAD])
    k_desc = tl.make_tensor_descriptor(key_ptr, shape=[q_end, STRIDE_KV_TOK], strides=[STRIDE_KV_TOK, 1],
                                       block_shape=[BLOCK_N, HEAD])
    v_desc = tl.make_tensor_descriptor(value_ptr, shape=[q_end, STRIDE_KV_TOK], strides=[STRIDE_KV_TOK, 1],
                                       block_shape=[BLOCK_N, HEAD])
    q = q_desc.load([q_start + q_block * BLOCK_M, head * HEAD])
    tok = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    new_end = tl.minimum(q_block * BLOCK_M + BLOCK_M, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], dtype=tl.float32)
    acc, l_i, m_i = _new_kv_loop(acc, l_i, m_i, q, 0, tl.cdiv(new_end, BLOCK_N), k_desc, v_desc, q_start, kv_col,
                                 tok, new_end, qk_scale, offs_n, BLOCK_N, True, LOOP_WS, 0, INTERPRET)
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[q_end, STRIDE_TOK], strides=[STRIDE_TOK, 1],
                                       block_shape=[BLOCK_M, HEAD])
    o_desc.store([q_start + q_block * BLOCK_M, head * HEAD], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


# ==============================================================================================================
# Host side: configs, work list, launch
# ==============================================================================================================
@dataclass(frozen=True)
class Config:
    """One compiled variant. ``rows_per_tok``: 1 = one query head per program (A), 0 = all QPK heads of a KV head
    (B). ``tma``: Q/O through descriptors; ``kv_tma``: K/V one TMA box per page; ``new_kv``: new tokens' K/V
    from the contiguous key/value (F); ``single_loop``: G's one-loop kernel (no cached context, K/V contiguous).
    ``programs_per_sm`` > 0: persistent grid."""

    family: str
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    rows_per_tok: int = 1
    tma: bool = False
    kv_tma: bool = False
    new_kv: bool = False
    single_loop: bool = False
    gluon: bool = False
    loop_ws: bool = False
    loop_stages: int = 0
    programs_per_sm: int = 0

    @property
    def label(self) -> str:
        s = f"{self.family} m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"
        if self.rows_per_tok != 1:
            s += " gqa"
        if self.tma:
            s += " tmaQO" + ("+KV" if self.kv_tma else "")
        if self.new_kv:
            s += " newKV"
        if self.single_loop:
            s += " oneloop"
        if self.gluon:
            s += " gluon"
        if self.loop_ws:
            s += " ws"
        if self.loop_stages:
            s += f" loop{self.loop_stages}"
        if self.programs_per_sm:
            s += f" persist{self.programs_per_sm}"
        return s


def family_configs(family: str, quick: bool, best_a: Optional[Config] = None) -> list[Config]:
    """The sweep of one candidate family, best guess first (``quick``: that one only). Kept small: compiling
    costs 1-5 s per config on the H100."""
    if family == "A":
        cs = [Config("A", 128, 64, 8, 3), Config("A", 128, 128, 8, 2), Config("A", 128, 128, 8, 3),
              Config("A", 128, 64, 4, 3), Config("A", 128, 64, 8, 4), Config("A", 64, 64, 4, 3)]
    elif family == "B":
        cs = [Config("B", 128, 64, 8, 3, rows_per_tok=0), Config("B", 128, 128, 8, 2, rows_per_tok=0),
              Config("B", 128, 64, 4, 3, rows_per_tok=0), Config("B", 64, 64, 4, 3, rows_per_tok=0)]
    elif family == "C":
        # warp_specialize with 8 warps compiles to the plain loop on sm_90 (Triton 3.6 declines it): only the
        # 4-warp form is worth a compile, and offline it fails for this two-loop kernel (the probe records it).
        cs = [Config("C", 128, 64, 8, 3, loop_stages=4), Config("C", 128, 128, 8, 2, loop_stages=3),
              Config("C", 128, 64, 4, 3, loop_ws=True)]
    elif family == "D":
        cs = [Config("D", 128, 64, 8, 3, tma=True, kv_tma=True), Config("D", 128, 128, 8, 2, tma=True, kv_tma=True),
              Config("D", 128, 64, 8, 4, tma=True, kv_tma=True), Config("D", 128, 64, 4, 3, tma=True, kv_tma=True),
              Config("D", 128, 64, 8, 3, tma=True), Config("D", 128, 128, 8, 2, tma=True)]
    elif family == "F":
        cs = [Config("F", 128, 64, 8, 3, tma=True, new_kv=True), Config("F", 128, 128, 8, 2, tma=True, new_kv=True),
              Config("F", 128, 64, 8, 4, tma=True, new_kv=True), Config("F", 128, 64, 4, 3, tma=True, new_kv=True),
              Config("F", 128, 64, 4, 3, tma=True, new_kv=True, loop_ws=True)]
    elif family == "G":
        cs = [Config("G", 128, 64, 4, 3, single_loop=True, loop_ws=True),
              Config("G", 128, 64, 4, 2, single_loop=True, loop_ws=True),
              Config("G", 64, 64, 4, 3, single_loop=True, loop_ws=True),
              Config("G", 128, 64, 4, 3, single_loop=True), Config("G", 128, 64, 8, 3, single_loop=True)]
    elif family == "H":
        cs = [Config("H", 128, 128, 8, 3, single_loop=True, gluon=True),
              Config("H", 128, 64, 8, 4, single_loop=True, gluon=True),
              Config("H", 128, 128, 8, 2, single_loop=True, gluon=True)]
    elif family == "E":
        base = best_a or Config("A", 128, 64, 8, 3)
        cs = [replace(base, family="E", programs_per_sm=1), replace(base, family="E", programs_per_sm=2)]
        if best_a is None or (best_a.block_n, best_a.num_stages) != (128, 2):
            cs.append(Config("E", 128, 128, 8, 2, programs_per_sm=1))
    else:
        raise ValueError(f"unknown candidate family {family!r}; allowed: A, B, C, D, E, F, G, H")
    return cs[:1] if quick else cs


class PagedBatch:
    """A causal paged prefill batch: sequences of (query_len, context_len), pages shuffled, random data."""

    def __init__(self, shapes, *, num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=PAGE,
                 dtype=None, device=None, seed=0, extra_pages=3):
        dtype = dtype or DTYPE
        device = device or DEVICE
        g = torch.Generator(device=device).manual_seed(seed)
        self.shapes = list(shapes)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size, self.block_size = head_size, block_size
        self.q_lens = [q for q, _ in shapes]
        self.seq_lens_host = [q + c for q, c in shapes]
        pages = [triton.cdiv(s, block_size) for s in self.seq_lens_host]
        self.num_blocks = sum(pages) + extra_pages
        perm = torch.randperm(self.num_blocks, generator=g, device=device).to(torch.int32).cpu()
        self.max_blocks = max(pages)
        bt = torch.zeros(len(shapes), self.max_blocks, dtype=torch.int32)
        at = 0
        for i, n in enumerate(pages):
            bt[i, :n] = perm[at:at + n]
            at += n
        self.num_tokens = sum(self.q_lens)
        self.kv = torch.randn(self.num_blocks, 2, block_size, num_kv_heads, head_size, generator=g,
                              device=device).to(dtype)
        self.query = torch.randn(self.num_tokens, num_heads, head_size, generator=g, device=device).to(dtype)
        self.block_table = bt.to(device)
        self.block_table_host = bt
        self.qsl_host = [0] + torch.tensor(self.q_lens).cumsum(0).tolist()
        self.qsl = torch.tensor(self.qsl_host, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(self.seq_lens_host, dtype=torch.int32, device=device)
        self.scale = 1.0 / math.sqrt(head_size)
        self.device = device
        self._work = {}

    def work_list(self, block_q: int) -> torch.Tensor:
        """[num_work, 2] int32 (sequence, query block), heaviest (most visible keys) first; ties interleave
        sequences. Built once per batch on the host, as a metadata builder would."""
        if block_q not in self._work:
            items = []
            for s, (q_len, seq_len) in enumerate(zip(self.q_lens, self.seq_lens_host)):
                ctx = seq_len - q_len
                for b in range(triton.cdiv(q_len, block_q)):
                    items.append((-(ctx + min((b + 1) * block_q, q_len)), b, s))
            items.sort()
            self._work[block_q] = torch.tensor([[s, b] for _, b, s in items], dtype=torch.int32,
                                               device=self.device).reshape(-1, 2)
        return self._work[block_q]

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' keys and values as an engine holds them right after the QKV projection:
        contiguous [num_tokens, num_kv_heads, head_size] each (copied from the cache, once)."""
        if not hasattr(self, "_new_kv"):
            ks, vs = [], []
            for i, (q_len, seq_len) in enumerate(zip(self.q_lens, self.seq_lens_host)):
                pages = self.block_table[i, :triton.cdiv(seq_len, self.block_size)].long()
                kv = self.kv[pages].transpose(1, 2).reshape(-1, 2, self.num_kv_heads, self.head_size)
                ks.append(kv[seq_len - q_len:seq_len, 0])
                vs.append(kv[seq_len - q_len:seq_len, 1])
            self._new_kv = (torch.cat(ks).contiguous(), torch.cat(vs).contiguous())
        return self._new_kv

    def flops(self) -> float:
        """PERF.md's causal prefill count, 2·2·B·L²·Hq·D / 2 (all tokens new)."""
        return sum(2.0 * 2.0 * q * q * self.num_heads * self.head_size / 2 for q in self.q_lens)


def _num_sms(device) -> int:
    if torch.device(device).type != "cuda":
        return 4
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def make_launch(cfg: Config, b: PagedBatch, out: torch.Tensor):
    """A no-argument callable running ``cfg`` on batch ``b`` into ``out`` (work list built here, once)."""
    qpk = b.num_heads // b.num_kv_heads
    rows = qpk if cfg.rows_per_tok == 0 else cfg.rows_per_tok
    block_m = max(cfg.block_m, rows)
    if block_m % rows:
        raise ValueError(f"block_m {block_m} must be a multiple of the packed heads {rows}")
    for t in (b.query, b.kv, out):
        if not t.is_contiguous():
            raise ValueError("query, kv cache and output must be contiguous")
    if cfg.kv_tma and cfg.block_n % b.block_size:
        raise ValueError(f"block_n {cfg.block_n} must be a multiple of block_size {b.block_size} for per-page TMA")
    if cfg.gluon:
        return _gluon_launch(cfg, b, out)
    work = b.work_list(block_m // rows)
    num_work = work.shape[0]
    qk_scale = b.scale * RCP_LN2
    if cfg.single_loop:
        if any(s != q for s, q in zip(b.seq_lens_host, b.q_lens)):
            raise ValueError("the single-loop kernel (G) takes sequences without cached context only")
        key, value = b.new_kv()
        kernel = _prefill_new_ws_kernel[(b.num_heads, num_work)]
        args = (b.query, key, value, out, b.qsl, work, num_work, qk_scale)
        kw = dict(NUM_HEADS=b.num_heads, NUM_KV_HEADS=b.num_kv_heads, HEAD=b.head_size, BLOCK_M=block_m,
                  BLOCK_N=cfg.block_n, LOOP_WS=cfg.loop_ws, INTERPRET=INTERPRET, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
        return lambda: kernel(*args, **kw)
    groups = b.num_heads // rows
    if cfg.programs_per_sm:
        grid = (min(cfg.programs_per_sm * _num_sms(b.device), num_work * groups),)
    else:
        grid = (groups, num_work)
    key, value = b.new_kv() if cfg.new_kv else (b.kv, b.kv)
    kernel = _prefill_kernel[grid]
    args = (b.query, b.kv, out, b.block_table, b.qsl, b.seq_lens, work, key, value, b.num_blocks, num_work,
            b.block_table.stride(0), qk_scale)
    kw = dict(NUM_HEADS=b.num_heads, NUM_KV_HEADS=b.num_kv_heads, HEAD=b.head_size, BLOCK_SIZE=b.block_size,
              ROWS_PER_TOK=rows, BLOCK_M=block_m, BLOCK_N=cfg.block_n, TMA=cfg.tma, KV_TMA=cfg.kv_tma,
              NEW_KV=cfg.new_kv, LOOP_WS=cfg.loop_ws, LOOP_STAGES=cfg.loop_stages, PERSISTENT=cfg.programs_per_sm > 0,
              INTERPRET=INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def fn():
        kernel(*args, **kw)
    return fn


def _gluon_launch(cfg: Config, b: PagedBatch, out: torch.Tensor):
    """Candidate H: the Gluon kernel on the new tokens' contiguous K/V (no cached context)."""
    from benchmarks.prefill_explore_gluon import _prefill_new_kernel, launch_args

    if any(s != q for s, q in zip(b.seq_lens_host, b.q_lens)):
        raise ValueError("the Gluon kernel (H) takes sequences without cached context only")
    if INTERPRET:
        raise NotImplementedError("the Gluon kernel (H) does not run under the Triton interpreter")
    key, value = b.new_kv()
    grid, args, kw = launch_args(b.query, key, value, out, b.qsl, max(b.q_lens), b.scale, block_n=cfg.block_n,
                                 nbuf=cfg.num_stages)
    kernel = _prefill_new_kernel[grid]
    return lambda: kernel(*args, **kw)


def set_tma_allocator(device) -> None:
    """Device-side tensor descriptors need a global scratch buffer per launch, from this allocator."""
    dev = torch.device(device)

    def alloc(size: int, alignment: int, stream: Optional[int]):
        return torch.empty(size, dtype=torch.int8, device=dev)
    triton.set_allocator(alloc)


def reference(b: PagedBatch, dtype=torch.float64) -> torch.Tensor:
    """Causal paged attention per sequence in ``dtype`` from the cache: [num_tokens, num_heads, head_size]."""
    qpk = b.num_heads // b.num_kv_heads
    out = torch.empty(b.num_tokens, b.num_heads, b.head_size, dtype=dtype, device=b.device)
    for i, (q_len, seq_len) in enumerate(zip(b.q_lens, b.seq_lens_host)):
        ctx = seq_len - q_len
        pages = b.block_table[i, :triton.cdiv(seq_len, b.block_size)].long()
        k = b.kv[pages, 0].reshape(-1, b.num_kv_heads, b.head_size)[:seq_len].to(dtype)
        v = b.kv[pages, 1].reshape(-1, b.num_kv_heads, b.head_size)[:seq_len].to(dtype)
        k = k.repeat_interleave(qpk, dim=1)
        v = v.repeat_interleave(qpk, dim=1)
        q = b.query[b.qsl_host[i]:b.qsl_host[i + 1]].to(dtype)
        s = torch.einsum("qhd,khd->hqk", q, k) * b.scale
        qpos = ctx + torch.arange(q_len, device=b.device)
        kpos = torch.arange(seq_len, device=b.device)
        s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[b.qsl_host[i]:b.qsl_host[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, Frobenius relative error); NaN anywhere (an unwritten poisoned row) gives inf."""
    diff = (out.float() - ref.float())
    if not torch.isfinite(diff).all():
        return float("inf"), float("inf")
    return float(diff.abs().max()), float(diff.norm() / ref.float().norm().clamp_min(1e-30))


# ==============================================================================================================
# Benchmark driver
# ==============================================================================================================
def bench_us(fn) -> float:
    if DEVICE != "cuda":  # dry run: one timed call is enough to exercise the driver
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def small_check_batch(context: bool = True, **kw) -> PagedBatch:
    """Chunked prefill with cached context, a plain prefill, a decode-sized query, odd lengths
    (``context=False``: the same query lengths without cached context)."""
    if DEVICE != "cuda":  # the interpreter is slow: a smaller mix of the same kinds of sequences
        shapes = [(40, 23), (33, 0), (1, 17)]
    else:
        shapes = [(300, 200), (128, 0), (77, 1000), (1, 50), (200, 33)]
    return PagedBatch([(q, c if context else 0) for q, c in shapes], seed=1, **kw)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def probe_main(args) -> int:
    """Child process: compile and check each config (small chunked batch vs a float32 reference, then one run on
    every timed shape); one JSON line per config to --probe-out, 'started' before, so a crash names the config."""
    set_tma_allocator(DEVICE)
    configs = [Config(**c) for c in json.loads(args.probe_configs)]
    smalls = {ctx: small_check_batch(context=ctx) for ctx in (True, False)}
    refs = {ctx: reference(b, torch.float32) for ctx, b in smalls.items()}
    bench_batches = [PagedBatch([(L, 0)] * B) for B, L in parse_shapes(args.shapes)]
    with open(args.probe_out, "a") as f:
        for cfg in configs:
            f.write(json.dumps({"label": cfg.label, "status": "started"}) + "\n")
            f.flush()
            t0 = time.time()
            small, ref = smalls[not cfg.single_loop], refs[not cfg.single_loop]
            try:
                out = torch.full_like(small.query, float("nan"))
                make_launch(cfg, small, out)()
                sync()
                compile_s = time.time() - t0
                mad, rel = compare(out, ref)
                ok = rel < REL_TOL
                for bb in bench_batches:
                    o = torch.empty_like(bb.query)
                    make_launch(cfg, bb, o)()
                sync()
                rec = {"label": cfg.label, "status": "ok" if ok else "wrong", "max_abs": mad, "rel": rel,
                       "compile_s": round(compile_s, 2)}
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the probe
                rec = {"label": cfg.label, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(f"  probe {cfg.label}: {rec}", flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()
    return 0


def warm_flashinfer_main(args) -> int:
    """Child process: JIT-build (or load) FlashInfer's paged prefill module for the timed parameters, so the
    parent finds it in the cache."""
    b = PagedBatch([(256, 0), (100, 0)])
    fn, _ = flashinfer_prefill(b)
    fn()
    sync()
    print("flashinfer prefill module ready", flush=True)
    return 0


def flashinfer_prefill(b: PagedBatch):
    import flashinfer

    pages = [triton.cdiv(s, b.block_size) for s in b.seq_lens_host]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    indices = torch.cat([b.block_table[i, :n] for i, n in enumerate(pages)])
    last = torch.tensor([(s - 1) % b.block_size + 1 for s in b.seq_lens_host], dtype=torch.int32, device="cuda")
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(b.qsl, indptr, indices, last, b.num_heads, b.num_kv_heads, b.head_size, b.block_size, causal=True,
           q_data_type=b.query.dtype, kv_data_type=b.kv.dtype, sm_scale=b.scale)
    out = torch.empty_like(b.query)
    return (lambda: w.run(b.query, b.kv, out=out)), out


def sdpa_fns(b: PagedBatch):
    """torch SDPA on contiguous [B, H, L, D] (all sequences the same length, every token new): GQA through
    enable_gqa, and with K/V expanded to all query heads. Returns {name: (fn, out_view_as_[tokens, H, D])}."""
    import torch.nn.functional as F

    B, L = len(b.q_lens), b.q_lens[0]
    q = b.query.view(B, L, b.num_heads, b.head_size).transpose(1, 2).contiguous()
    pages = b.block_table.long()
    k = b.kv[pages, 0].reshape(B, -1, b.num_kv_heads, b.head_size)[:, :L].transpose(1, 2).contiguous()
    v = b.kv[pages, 1].reshape(B, -1, b.num_kv_heads, b.head_size)[:, :L].transpose(1, 2).contiguous()
    qpk = b.num_heads // b.num_kv_heads
    ke, ve = k.repeat_interleave(qpk, 1), v.repeat_interleave(qpk, 1)
    res = {}
    for name, kk, vv, extra in (("sdpa_gqa", k, v, dict(enable_gqa=True)), ("sdpa_expanded", ke, ve, {})):
        holder = {}

        def fn(kk=kk, vv=vv, extra=extra, holder=holder):
            holder["o"] = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=b.scale, **extra)
        res[name] = (fn, holder)
    return res


def current_kernel_fn(b: PagedBatch, out: torch.Tensor):
    from attnbackends.triton.launch import unified_attention

    def fn():
        unified_attention(b.query, b.kv[:, 0], b.kv[:, 1], out, b.qsl, b.seq_lens, b.block_table,
                          max(b.q_lens), max(b.seq_lens_host), b.scale, validate=False)
    return fn


def parse_shapes(s: str) -> list[tuple[int, int]]:
    shapes = []
    for part in s.split(","):
        B, L = part.lower().split("x")
        shapes.append((int(B), int(L)))
    return shapes


class Runner:
    """The parent process: peers, probes, checks, timings, rows."""

    def __init__(self, args, log: Log):
        self.args, self.log = args, log
        self.deadline = time.time() + args.budget_s
        self.shapes = parse_shapes(args.shapes)
        self.batches = {s: PagedBatch([(s[1], 0)] * s[0]) for s in self.shapes}
        self.refs: dict = {}
        self.peer_us: dict = {}  # (peer, shape) -> us
        self.results: list[dict] = []  # per config: label, family, config, per shape us / checks
        self.rows: list[dict] = []
        self.fi_proc: Optional[subprocess.Popen] = None

    # ---------------- child processes ----------------
    def _spawn(self, extra: list[str], prefix: str) -> subprocess.Popen:
        cmd = [sys.executable, "-u", os.path.abspath(__file__), "--shapes", self.args.shapes, *extra]
        if self.args.dry_run_cpu:
            cmd.append("--dry-run-cpu")
        return spawn_child(cmd, self.log, prefix)

    _kill = staticmethod(kill_child)

    def probe(self, configs: list[Config], timeout: float) -> dict[str, dict]:
        """Run configs in child processes until each has a verdict; a child that dies takes only the config it
        was on with it. Returns label -> record."""
        verdicts: dict[str, dict] = {}
        pending = list(configs)
        end = time.time() + timeout
        while pending and time.time() < end:
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
                path = tmp.name
            proc = self._spawn(["--probe-configs", json.dumps([asdict(c) for c in pending]), "--probe-out", path],
                               f"probe {pending[0].family}")
            try:
                rc = proc.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                self._kill(proc)
                rc = "timeout"
            recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
            os.unlink(path)
            started = None
            for r in recs:
                if r["status"] == "started":
                    started = r["label"]
                else:
                    verdicts[r["label"]] = r
                    started = None
            if started is not None:
                verdicts[started] = {"label": started, "status": "timeout" if rc == "timeout" else "crashed",
                                     "error": f"child process ended ({rc}) while on this config"}
                self.log(f"  {started}: child process ended ({rc}) on this config; skipped")
            progressed = any(c.label in verdicts for c in pending)
            pending = [c for c in pending if c.label not in verdicts]
            if rc == "timeout":
                break
            if not progressed:  # the child died before its first config: it would every time
                for c in pending:
                    verdicts[c.label] = {"label": c.label, "status": "error",
                                         "error": f"probe process ended ({rc}) before checking any config"}
                pending = []
        for c in pending:
            verdicts[c.label] = {"label": c.label, "status": "skipped", "error": "probe time budget spent"}
        return verdicts

    # ---------------- peers ----------------
    def run_peers(self) -> None:
        for shape, b in self.batches.items():
            try:
                fns = sdpa_fns(b)
                best = None
                for name, (fn, holder) in fns.items():
                    try:
                        fn()
                        sync()
                        us = bench_us(fn)
                        self.log(f"  {name:14s} {shape[0]}x{shape[1]}: {us:9.1f} us "
                                 f"{b.flops() / us / 1e6:6.1f} TFLOP/s")
                        if best is None or us < best[0]:
                            best = (us, name, holder["o"])
                    except Exception as e:  # noqa: BLE001
                        self.log(f"  {name} {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
                if best is not None:
                    self.peer_us[("sdpa", shape)] = best[0]
                    B, L = shape
                    self.refs[shape] = best[2].transpose(1, 2).reshape(B * L, b.num_heads, b.head_size)
            except Exception as e:  # noqa: BLE001
                self.log(f"  sdpa {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
        for shape, b in self.batches.items():
            try:
                out = torch.full_like(b.query, float("nan"))
                fn = current_kernel_fn(b, out)
                fn()
                sync()
                check = self._check(shape, out)
                us = bench_us(fn)
                self.peer_us[("triton_current", shape)] = us
                self.log(f"  triton (current) {shape[0]}x{shape[1]}: {us:9.1f} us {b.flops() / us / 1e6:6.1f} "
                         f"TFLOP/s  {check}")
            except Exception as e:  # noqa: BLE001
                self.log(f"  triton (current) {shape}: failed: {type(e).__name__}: {str(e)[:300]}")

    def run_flashinfer(self, wait_s: float) -> None:
        if ("flashinfer", self.shapes[0]) in self.peer_us or self.fi_proc is None:
            return
        try:
            rc = self.fi_proc.wait(timeout=max(0.0, wait_s))
        except subprocess.TimeoutExpired:
            if wait_s > 0:
                self.log("  flashinfer warm-up still running past its time; not timing flashinfer")
                self._kill(self.fi_proc)
                self.fi_proc = None
            return
        self.fi_proc = None
        if rc != 0:
            self.log(f"  flashinfer warm-up failed (rc {rc}); not timing flashinfer")
            return
        for shape, b in self.batches.items():
            try:
                fn, out = flashinfer_prefill(b)
                fn()
                sync()
                check = self._check(shape, out)
                us = bench_us(fn)
                self.peer_us[("flashinfer", shape)] = us
                self.log(f"  flashinfer {shape[0]}x{shape[1]}: {us:9.1f} us {b.flops() / us / 1e6:6.1f} TFLOP/s "
                         f"{check}")
            except Exception as e:  # noqa: BLE001
                self.log(f"  flashinfer {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
        self.write_rows()

    def _check(self, shape, out) -> str:
        ref = self.refs.get(shape)
        if ref is None:
            return "(no sdpa reference)"
        mad, rel = compare(out, ref)
        return f"max|diff| {mad:.2e} rel {rel:.2e}" + ("" if rel < REL_TOL else "  ** WRONG **")

    # ---------------- candidates ----------------
    def run_family(self, family: str, budget_s: float) -> None:
        t_end = time.time() + budget_s
        best_a = self._best_config("A") if family == "E" else None
        configs = family_configs(family, self.args.quick, best_a)
        self.log(f"== candidate {family}: {len(configs)} config(s), budget {budget_s:.0f} s")
        verdicts = self.probe(configs, timeout=0.8 * budget_s)
        for cfg in configs:
            v = verdicts.get(cfg.label, {})
            res = {"label": cfg.label, "family": family, "config": asdict(cfg), "probe": v, "shapes": {}}
            self.results.append(res)
            if v.get("status") != "ok":
                self.log(f"  {cfg.label}: {v.get('status')} {v.get('error', '')} "
                         f"{'rel %.2e' % v['rel'] if 'rel' in v else ''}")
                continue
            for shape, b in self.batches.items():
                if time.time() > t_end or time.time() > self.deadline:
                    self.log(f"  {cfg.label}: time budget spent, not timing {shape}")
                    break
                try:
                    out = torch.full_like(b.query, float("nan"))
                    fn = make_launch(cfg, b, out)
                    fn()
                    sync()
                    ref = self.refs.get(shape)
                    mad, rel = compare(out, ref) if ref is not None else (float("nan"), float("nan"))
                    entry = {"max_abs": mad, "rel": rel}
                    if ref is not None and not rel < REL_TOL:
                        entry["status"] = "wrong"
                        self.log(f"  {cfg.label} {shape[0]}x{shape[1]}: WRONG vs sdpa (max|diff| {mad:.2e} "
                                 f"rel {rel:.2e}); not timed")
                    else:
                        us = bench_us(fn)
                        entry.update(status="ok", us=us, tflops=b.flops() / us / 1e6)
                        self.log(f"  {cfg.label:34s} {shape[0]:>2d}x{shape[1]:<5d} {us:9.1f} us "
                                 f"{entry['tflops']:6.1f} TFLOP/s  {self._vs(shape, us)}  rel {rel:.1e}")
                    res["shapes"][shape] = entry
                except Exception as e:  # noqa: BLE001
                    res["shapes"][shape] = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    self.log(f"  {cfg.label} {shape}: error {type(e).__name__}: {str(e)[:300]}")
            self.write_rows()

    def _vs(self, shape, us) -> str:
        parts = []
        for peer in ("flashinfer", "sdpa", "triton_current"):
            p = self.peer_us.get((peer, shape))
            if p:
                parts.append(f"{p / us:5.2f}x {peer}")
        return "  ".join(parts)

    def _best_config(self, family: str) -> Optional[Config]:
        best = None
        for r in self.results:
            if r["family"] != family:
                continue
            e = r["shapes"].get(self.shapes[0], {})
            if e.get("status") == "ok" and (best is None or e["us"] < best[0]):
                best = (e["us"], Config(**r["config"]))
        return best[1] if best else None

    # ---------------- output ----------------
    def write_rows(self) -> None:
        rows = []

        def add(backend, peer, shape, us, extra=None):
            p = self.peer_us.get((peer, shape))
            if not p:
                return
            B, L = shape
            flops = self.batches[shape].flops()
            r = {"case": "prefill", "backend": backend, "peer": peer, "B": B, "L": L,
                 "dtype": str(DTYPE).replace("torch.", ""),
                 "kv_dtype": "auto", "us": round(us, 2), "peer_us": round(p, 2), "ratio": round(us / p, 4),
                 "TFLOPs": round(flops / us / 1e6, 1), "peer_TFLOPs": round(flops / p / 1e6, 1)}
            r.update(extra or {})
            rows.append(r)
        for shape in self.shapes:
            for backend in ("triton_current", "sdpa"):
                us = self.peer_us.get((backend, shape))
                if us:
                    for peer in ("flashinfer", "sdpa"):
                        if peer != backend:
                            add(backend if backend != "triton_current" else "triton", peer, shape, us)
        for r in self.results:
            for shape, e in r["shapes"].items():
                if e.get("status") == "ok":
                    for peer in ("flashinfer", "sdpa"):
                        add(f"triton_{r['family']}", peer, shape, e["us"],
                            {"config": r["label"], "max_abs_diff": e["max_abs"], "rel_err": e["rel"]})
        self.rows = rows
        if self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(json.dumps(rows, indent=1) + "\n")

    def table(self) -> str:
        hdr = "| candidate | config | " + " | ".join(
            f"{B}x{L} TFLOP/s (vs FI / vs SDPA)" for B, L in self.shapes) + " |"
        lines = [hdr, "|" + "---|" * (2 + len(self.shapes))]

        def cell(shape, us):
            if not us:
                return "—"
            t = self.batches[shape].flops() / us / 1e6
            fi, sd = self.peer_us.get(("flashinfer", shape)), self.peer_us.get(("sdpa", shape))
            return f"{t:.0f} ({fi / us:.2f} / {sd / us:.2f})" if fi and sd else (
                f"{t:.0f} (— / {sd / us:.2f})" if sd else f"{t:.0f}")
        for peer, name in (("flashinfer", "FlashInfer paged"), ("sdpa", "torch SDPA (best)"),
                           ("triton_current", "attnbackends triton (today)")):
            lines.append(f"| {name} | default | " + " | ".join(
                cell(s, self.peer_us.get((peer, s))) for s in self.shapes) + " |")
        for r in self.results:
            cells = []
            for s in self.shapes:
                e = r["shapes"].get(s)
                if e and e.get("status") == "ok":
                    cells.append(cell(s, e["us"]))
                elif e:
                    cells.append(e.get("status", "?"))
                else:
                    cells.append(r["probe"].get("status", "not run"))
            lines.append(f"| {r['family']} | {r['label']} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON rows (PERF.md format); the log goes next to it (.log)")
    ap.add_argument("--log", default=None, help="log file (default: --out with .log)")
    ap.add_argument("--quick", action="store_true", help="only the best-guess config of each candidate")
    ap.add_argument("--families", default="A,B,D,F,G,C,E", help="candidates to run, in order")
    ap.add_argument("--shapes", default=",".join(f"{B}x{L}" for B, L in SHAPES))
    ap.add_argument("--budget-s", type=float, default=340.0, help="wall-clock budget of the whole run")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="exercise the whole driver on the CPU through the Triton interpreter (TRITON_INTERPRET=1, "
                         "tiny --shapes such as 1x128,2x64); timings meaningless")
    ap.add_argument("--probe-configs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-flashinfer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    global DEVICE, DTYPE
    if args.dry_run_cpu:
        if not INTERPRET:
            print("--dry-run-cpu needs TRITON_INTERPRET=1 in the environment")
            return 2
        DEVICE, DTYPE = "cpu", torch.float32
        args.no_flashinfer = True
    if args.probe_configs:
        return probe_main(args)
    if args.warm_flashinfer:
        return warm_flashinfer_main(args)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("prefill_explore needs a CUDA GPU (the CPU checks are tests/test_prefill_explore.py)")
        return 2

    log_path = args.log or (str(Path(args.out).with_suffix(".log")) if args.out else None)
    log = Log(log_path)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    log(f"torch {torch.__version__}, triton {triton.__version__}, {where}, "
        f"shapes {args.shapes}, families {args.families}, quick {args.quick}, budget {args.budget_s:.0f} s")
    set_tma_allocator(DEVICE)
    run = Runner(args, log)
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F401
            run.fi_proc = run._spawn(["--warm-flashinfer"], "flashinfer warm-up")
        except Exception as e:  # noqa: BLE001
            log(f"flashinfer unavailable ({type(e).__name__}: {e}); no FlashInfer column")
    log("== peers: torch SDPA, current attnbackends kernel")
    run.run_peers()
    run.write_rows()
    families = [f.strip().upper() for f in args.families.split(",") if f.strip()]
    reserve = 30.0 if run.fi_proc is not None else 0.0
    run_families(families, lambda fam, budget: run.run_family(fam, budget_s=budget), run.deadline, log,
                 reserve_s=reserve, min_left_s=15, between=lambda: run.run_flashinfer(wait_s=0))
    log("== flashinfer")
    run.run_flashinfer(wait_s=max(5.0, run.deadline - time.time()))
    run.write_rows()
    log("\nSpeed ratios are peer time / candidate time (> 1: faster than the peer).\n")
    log(run.table())
    if args.out:
        log(f"\nrows: {args.out} ({len(run.rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
