"""Warp-specialised Gluon candidate for MLA decode on Hopper (candidate W of ``benchmarks/mla_explore.py``).

The structure of FlashInfer's Hopper MLA kernel (asymmetric warpgroups, the score tile computed once), written in
Gluon 3.6 with ``gl.warp_specialize``. One program = one work item (row, request, kv_lo, kv_hi, slot) x 64 heads;
one tile = one 64-key page, loaded by TMA. Three partitions share NBUF stages of shared memory:

- **default** (4 warps, "WG-S"): loads the queries into shared memory (once), then per tile: S = [Q ; Q_pe] .
  [K ; K_pe]^T for the whole 64 x 64 score tile (``m64n64k16`` over the 576 dims), online softmax (log2 domain,
  the scale in the exp2's FMA), publishes P (16-bit) over the rope-key slot of the stage (dead once S is done)
  and the row rescale alpha into ``alpha_smem[stage]``, arrives ``p_ready[stage]``, then O[:, 256:512] =
  alpha * O + P . V[:, 256:512] with P from registers; writes the LSE and its half of the output;
- **worker 0** (4 warps, "WG-O"): per tile waits ``p_ready``, O[:, 0:256] = alpha * O + P . V[:, 0:256] with P
  from shared memory; at the end waits ``l_ready`` for the row sums and writes its half of the output;
- **worker 1** (1 warp): the TMA loader: per tile waits ``kv_empty[stage]`` (two arrivals: both consumers are
  done with the stage), looks the page up in the block table and loads [64, 512] + [64, 64] (Triton splits the
  [64, 512] box into 64-column TMA boxes, the 128-byte swizzle width) onto ``kv_ready[stage]``.

Barrier protocol (tile j uses stage s = j % NBUF, phase (j // NBUF) & 1):

    loader   : wait kv_empty[s] (phase ^ 1: the first NBUF waits pass on fresh barriers) -> expect + TMA -> kv_ready[s]
    default  : wait kv_ready[s] -> S -> P, alpha to smem, fence -> arrive p_ready[s] -> own P.V -> arrive kv_empty[s]
    worker 0 : wait kv_ready[s], p_ready[s] -> P.V -> arrive kv_empty[s]
    end      : default stores l, arrives l_ready (count 1, phase 0); worker 0 waits it.

P and alpha of stage s are rewritten only for tile j + NBUF, which needs kv_ready[s] again, which needs both
kv_empty arrivals of tile j: the worker has read them by then. Shared memory (NBUF 2): K/V 2 x 64 KiB, K_pe 2 x
8 KiB, Q 64 KiB, Q_pe 8 KiB = 216 KiB (+ barriers): NBUF 3 does not fit the 227 KiB of a block.

The last, partial tile of a work item (kv_hi - n0 < 64) is loaded by TMA as a whole page too: its score columns
past kv_hi are set to -inf (P = 0 there), and the V rows past kv_hi, which may hold anything (NaN: 0 * NaN = NaN in
P.V), are zeroed in shared memory by each consumer for its own column half before its P.V (the default after its
Q.K^T of that tile, the worker after ``p_ready``, i.e. after that Q.K^T as well: no race with the K reads).

Work items, partials and the log-sum-exp merge are those of ``benchmarks/mla_explore_triton.py``; the host API
mirrors ``benchmarks/mla_explore_gluon.py`` (candidate F). Gluon does not run under the interpreter: on a CPU this
module is only imported and compiled for sm_90 (``python -m benchmarks.mla_explore --compile-only --families W``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnbackends.mla.decode_hopper import hopper_descriptors
from benchmarks.mla_explore_triton import LOG2E, Launch, Schedule, add_combine


# ==============================================================================================================
# Kernel
# ==============================================================================================================
@gluon.jit
def _zero_rows_from(buf, nvalid, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Rows >= nvalid of the shared [ROWS, COLS] view ``buf`` := 0 (read-modify-write in 64-column slices, the
    128-byte swizzle atom; the 4 warps of the calling partition). The caller fences and syncs afterwards."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    keep = gl.expand_dims(rows < nvalid, 1)
    for c in gl.static_range(0, COLS, 64):
        part = buf.slice(c, 64, dim=1)
        x = part.load(blk)
        x = gl.where(keep, x, gl.zeros_like(x))
        part.store(x)


@gluon.jit
def _loader_partition(kv_desc, pe_desc, kv_bufs, pe_bufs, kv_ready, kv_empty, bt_row, kv_lo, n_tiles,
                      LKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """1 warp: one page (= one tile) per stage by TMA, as soon as both consumers have released the stage."""
    for j in range(n_tiles):
        s = j % NBUF
        # Fresh barriers are in phase 0: waiting for parity 1 passes at once, so the first NBUF tiles go out
        # without a release.
        mbarrier.wait(kv_empty.index(s), ((j // NBUF) & 1) ^ 1)
        n0 = kv_lo + j * BLOCK_N
        page = gl.load(bt_row + n0 // PAGE)
        row = page * PAGE + n0 % PAGE
        bar = kv_ready.index(s)
        mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv_bufs.index(s))
        tma.async_copy_global_to_shared(pe_desc, [row, LKV], bar, pe_bufs.index(s))


@gluon.jit
def _pv_worker_partition(kv_bufs, pe_bufs, alpha_smem, l_smem, kv_ready, kv_empty, p_ready, l_ready, t, hb, kv_lo,
                         kv_hi, slot, n_tiles, O, O_PART, stride_o_t, stride_o_h, stride_op_s, stride_op_h,
                         H: gl.constexpr, LKV: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                         NBUF: gl.constexpr):
    """4 warps: O[:, 0:LKV/2] = sum_j alpha-rescaled P_j . V_j[:, 0:LKV/2], P_j read from shared memory."""
    HALF: gl.constexpr = LKV // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    for j in range(n_tiles):
        s = j % NBUF
        ph = (j // NBUF) & 1
        mbarrier.wait(kv_ready.index(s), ph)  # already complete (p_ready implies it); makes the TMA data ours
        mbarrier.wait(p_ready.index(s), ph)
        v = kv_bufs.index(s).slice(0, HALF, dim=1)
        alpha = alpha_smem.index(s).load(gl.SliceLayout(1, o_layout))
        o = o * gl.expand_dims(alpha, 1)
        nvalid = kv_hi - (kv_lo + j * BLOCK_N)
        if nvalid < BLOCK_N:  # the last, partial page: its V rows past kv_hi may be NaN
            _zero_rows_from(v, nvalid, BLOCK_N, HALF)
            fence_async_shared()
            gl.thread_barrier()
        o = warpgroup_mma(pe_bufs.index(s), v, o, is_async=True)  # P (over the rope-key slot) . V[:, :HALF]
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        mbarrier.arrive(kv_empty.index(s), count=1)

    mbarrier.wait(l_ready, 0)
    l_i = l_smem.load(gl.SliceLayout(1, o_layout))
    has_keys = l_i > 0.0
    inv = gl.where(has_keys, 1.0 / gl.where(has_keys, l_i, gl.full_like(l_i, 1.0)), gl.zeros_like(l_i))
    out = o * gl.expand_dims(inv, 1)
    heads = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    mask = gl.expand_dims(heads < H, 1) & gl.expand_dims(cols < HALF, 0)
    if slot < 0:
        gl.store(O + t * stride_o_t + gl.expand_dims(heads, 1) * stride_o_h + gl.expand_dims(cols, 0),
                 out.to(O.dtype.element_ty), mask=mask)
    else:
        gl.store(O_PART + slot.to(gl.int64) * stride_op_s + gl.expand_dims(heads, 1) * stride_op_h
                 + gl.expand_dims(cols, 0), out, mask=mask)


@gluon.jit
def _softmax_publish(sc, kv, pe, alpha_buf, p_bar, l_i, m_i, nvalid, qk_scale, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, LKV: gl.constexpr, BLOCK_N: gl.constexpr):
    """One score tile (its Q.K^T done): mask the keys past kv_hi, zero our half of the V rows past kv_hi (partial
    tile only), online softmax, P over the K_pe slot and alpha to shared memory, arrive ``p_bar``.
    Returns (P 16-bit in the score layout, alpha in the output's row layout, l_i, m_i)."""
    HALF: gl.constexpr = LKV // 2
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    sc = gl.where(gl.expand_dims(offs_n < nvalid, 0), sc, gl.full_like(sc, float("-inf")))
    if nvalid < BLOCK_N:  # V rows past kv_hi may be NaN: zero our column half (this tile's K reads are done)
        _zero_rows_from(kv.slice(HALF, HALF, dim=1), nvalid, BLOCK_N, HALF)
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    alpha = gl.exp2((m_i - m_new) * qk_scale)
    p = gl.exp2(sc * qk_scale - gl.expand_dims(m_new * qk_scale, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pb = p.to(pe.dtype)
    pe.store(pb)  # P over K_pe of this stage: dead once S is done; the worker's A operand
    alpha_buf.store(alpha)
    fence_async_shared()  # P (and zeroed V rows) visible to the async proxy (wgmma) ...
    gl.thread_barrier()  # ... of every warp, before the arrive and before our own P.V
    mbarrier.arrive(p_bar, count=1)
    return pb, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), l_i, m_new


@gluon.jit
def _tiles_plain(q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, kv_ready, kv_empty, p_ready, kv_lo, kv_hi, n_tiles,
                 o, l_i, m_i, s_zero, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                 p_layout: gl.constexpr, LKV: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """Per tile: S (wait) -> softmax, publish -> own P.V (wait) -> release the stage."""
    HALF: gl.constexpr = LKV // 2
    for j in range(n_tiles):
        s = j % NBUF
        mbarrier.wait(kv_ready.index(s), (j // NBUF) & 1)
        kv = kv_bufs.index(s)
        pe = pe_bufs.index(s)
        sc = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, pe.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        pb, alpha, l_i, m_i = _softmax_publish(sc, kv, pe, alpha_smem.index(s), p_ready.index(s), l_i, m_i,
                                               kv_hi - (kv_lo + j * BLOCK_N), qk_scale, s_layout, o_layout, LKV,
                                               BLOCK_N)
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(gl.convert_layout(pb, p_layout), kv.slice(HALF, HALF, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        mbarrier.arrive(kv_empty.index(s), count=1)
    return o, l_i, m_i


@gluon.jit
def _tiles_overlapped(q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, kv_ready, kv_empty, p_ready, kv_lo, kv_hi,
                      n_tiles, o, l_i, m_i, s_zero, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                      p_layout: gl.constexpr, LKV: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """FA3-style: S_{j+1} is issued right behind our P_j.V_j, so the tensor cores run both while we wait.

    Iteration j (S_j in flight): wait S_j -> softmax, publish P_j -> O *= alpha_j, issue P_j.V_j -> wait
    kv_ready(j + 1) (skipped past the last tile) and issue S_{j+1} -> wait P_j.V_j (wgmma groups retire in order:
    ``num_outstanding=1``) -> release stage j. Past the last tile, S_{j+1} reads whatever stage (j + 1) % NBUF holds
    (no TMA writes it any more: the loader issues n_tiles loads) and is discarded. The zeroing of a partial last
    tile happens in ``_softmax_publish`` before P_j.V_j is issued; the K reads of that tile are done (S_j waited)."""
    HALF: gl.constexpr = LKV // 2
    mbarrier.wait(kv_ready.index(0), 0, pred=n_tiles > 0)
    s_tok = warpgroup_mma(q_smem, kv_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(qpe_smem, pe_bufs.index(0).permute((1, 0)), s_tok, is_async=True)
    for j in range(n_tiles):
        s = j % NBUF
        kv = kv_bufs.index(s)
        pe = pe_bufs.index(s)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        pb, alpha, l_i, m_i = _softmax_publish(sc, kv, pe, alpha_smem.index(s), p_ready.index(s), l_i, m_i,
                                               kv_hi - (kv_lo + j * BLOCK_N), qk_scale, s_layout, o_layout, LKV,
                                               BLOCK_N)
        o = o * gl.expand_dims(alpha, 1)
        o_tok = warpgroup_mma(gl.convert_layout(pb, p_layout), kv.slice(HALF, HALF, dim=1), o, is_async=True)
        nb = (j + 1) % NBUF
        mbarrier.wait(kv_ready.index(nb), ((j + 1) // NBUF) & 1, pred=j + 1 < n_tiles)
        s_tok = warpgroup_mma(q_smem, kv_bufs.index(nb).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(qpe_smem, pe_bufs.index(nb).permute((1, 0)), s_tok, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=1, deps=(o_tok,))
        mbarrier.arrive(kv_empty.index(s), count=1)
    warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))  # the last, discarded S
    return o, l_i, m_i


@gluon.jit
def _softmax_partition(Q_NOPE, Q_PE, q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, l_smem, kv_ready, kv_empty,
                       p_ready, l_ready, t, hb, kv_lo, kv_hi, slot, n_tiles, O, LSE, O_PART, LSE_PART,
                       stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_o_t, stride_o_h, stride_lse_t,
                       stride_op_s, stride_op_h, stride_lp_s, qk_scale,
                       H: gl.constexpr, LKV: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr,
                       BLOCK_N: gl.constexpr, NBUF: gl.constexpr, OVERLAP: gl.constexpr):
    """Default partition, 4 warps: queries to shared memory, S, softmax, P and alpha published, O[:, LKV/2:]."""
    HALF: gl.constexpr = LKV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # a [64, 64] chunk, 16-byte loads

    # Queries of the program's heads (the loader's first pages fly meanwhile), in 64-column chunks.
    rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_blk))
    row_ok = gl.expand_dims(rows < H, 1)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, q_blk))
    for c in gl.static_range(0, LKV, 64):
        q = gl.load(Q_NOPE + t * stride_q_t + gl.expand_dims(rows, 1) * stride_q_h + gl.expand_dims(c + cols, 0),
                    mask=row_ok & gl.expand_dims(cols < 64, 0), other=0.0)
        q_smem.slice(c, 64, dim=1).store(q)
    for c in gl.static_range(0, R, 64):
        qp = gl.load(Q_PE + t * stride_qp_t + gl.expand_dims(rows, 1) * stride_qp_h + gl.expand_dims(c + cols, 0),
                     mask=row_ok & gl.expand_dims(cols < 64, 0), other=0.0)
        qpe_smem.slice(c, 64, dim=1).store(qp)
    fence_async_shared()
    gl.thread_barrier()  # every warp's queries are in shared memory before the warpgroup's wgmma reads them

    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
    if OVERLAP:
        o, l_i, m_i = _tiles_overlapped(q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, kv_ready, kv_empty, p_ready,
                                        kv_lo, kv_hi, n_tiles, o, l_i, m_i, s_zero, qk_scale, s_layout, o_layout,
                                        p_layout, LKV, BLOCK_N, NBUF)
    else:
        o, l_i, m_i = _tiles_plain(q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, kv_ready, kv_empty, p_ready,
                                   kv_lo, kv_hi, n_tiles, o, l_i, m_i, s_zero, qk_scale, s_layout, o_layout,
                                   p_layout, LKV, BLOCK_N, NBUF)

    l_smem.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(l_ready, count=1)

    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
    lse = gl.where(has_keys, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453,
                   gl.full_like(l_i, float("-inf")))
    inv = gl.where(has_keys, 1.0 / l_safe, gl.zeros_like(l_i))
    out = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), 1)
    heads_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols_o = HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
    o_mask = gl.expand_dims(heads_o < H, 1) & gl.expand_dims(cols_o < LKV, 0)
    heads_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    if slot < 0:
        gl.store(O + t * stride_o_t + gl.expand_dims(heads_o, 1) * stride_o_h + gl.expand_dims(cols_o, 0),
                 out.to(O.dtype.element_ty), mask=o_mask)
        gl.store(LSE + t * stride_lse_t + heads_s, lse, mask=heads_s < H)
    else:
        s64 = slot.to(gl.int64)
        gl.store(O_PART + s64 * stride_op_s + gl.expand_dims(heads_o, 1) * stride_op_h + gl.expand_dims(cols_o, 0),
                 out, mask=o_mask)
        gl.store(LSE_PART + s64 * stride_lp_s + heads_s, lse, mask=heads_s < H)


@gluon.jit
def _mla_ws_kernel(
    Q_NOPE, Q_PE,  # [T, H, LKV], [T, H, R] 16-bit
    kv_desc, pe_desc,  # TMA over the cache as [num_blocks * PAGE, LKV + R]: boxes [BLOCK_N, LKV] and [BLOCK_N, R]
    BLOCK_TABLE, WORK,  # [B, W] int32; [num_items, 5] int32 (row, request, kv_lo, kv_hi, slot)
    O, LSE, O_PART, LSE_PART,  # [T, H, LKV], [T, H] float32; [S, H, LKV] float32, [S, H] float32
    stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_bt,
    stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h, stride_lp_s,
    qk_scale,  # softmax scale * log2(e)
    H: gl.constexpr, LKV: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, NBUF: gl.constexpr, OVERLAP: gl.constexpr, REGS_PV: gl.constexpr,
    REGS_LOAD: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (cdiv(H, BLOCK_H), num_items); 4 warps (default) + 4 (P.V worker) + 1 (TMA loader)."""
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(BLOCK_H == 64, "one wgmma M tile of heads")
    gl.static_assert(BLOCK_N == 64 and R == 64, "P [64 heads, 64 keys] is stored over the [64 keys, 64] K_pe slot")
    gl.static_assert(PAGE % BLOCK_N == 0, "a TMA tile lies in one page")
    gl.static_assert(LKV % 128 == 0, "two column halves of 64-column slices")
    dtype: gl.constexpr = Q_NOPE.dtype.element_ty

    hb = gl.program_id(0)
    w = gl.program_id(1)
    t = gl.load(WORK + w * 5).to(gl.int64)
    req = gl.load(WORK + w * 5 + 1)
    kv_lo = gl.load(WORK + w * 5 + 2)
    kv_hi = gl.load(WORK + w * 5 + 3)
    slot = gl.load(WORK + w * 5 + 4)
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    n_tiles = gl.cdiv(gl.maximum(kv_hi - kv_lo, 0), BLOCK_N)

    kv_bufs = gl.allocate_shared_memory(kv_desc.dtype, [NBUF, BLOCK_N, LKV], kv_desc.layout)
    pe_bufs = gl.allocate_shared_memory(pe_desc.dtype, [NBUF, BLOCK_N, R], pe_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LKV], gl.NVMMASharedLayout.get_default_for([BLOCK_H, LKV],
                                                                                                   dtype))
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R], gl.NVMMASharedLayout.get_default_for([BLOCK_H, R],
                                                                                                  dtype))
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [NBUF, BLOCK_H], vec_sl)  # rank-1 layout: indexed per stage
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(kv_ready.index(i), count=1)  # the loader's expect-tx arrival (+ the TMA bytes)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release the stage
        mbarrier.init(p_ready.index(i), count=1)  # the default partition published P and alpha
    mbarrier.init(l_ready, count=1)
    fence_async_shared()  # the initialised barriers visible to the async proxy (TMA complete-tx)
    gl.thread_barrier()

    gl.warp_specialize([
        (_softmax_partition, (Q_NOPE, Q_PE, q_smem, qpe_smem, kv_bufs, pe_bufs, alpha_smem, l_smem, kv_ready,
                              kv_empty, p_ready, l_ready, t, hb, kv_lo, kv_hi, slot, n_tiles, O, LSE, O_PART,
                              LSE_PART, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_o_t, stride_o_h,
                              stride_lse_t, stride_op_s, stride_op_h, stride_lp_s, qk_scale, H, LKV, R, BLOCK_H,
                              BLOCK_N, NBUF, OVERLAP)),
        (_pv_worker_partition, (kv_bufs, pe_bufs, alpha_smem, l_smem, kv_ready, kv_empty, p_ready, l_ready, t, hb,
                                kv_lo, kv_hi, slot, n_tiles, O, O_PART, stride_o_t, stride_o_h, stride_op_s,
                                stride_op_h, H, LKV, BLOCK_H, BLOCK_N, NBUF)),
        (_loader_partition, (kv_desc, pe_desc, kv_bufs, pe_bufs, kv_ready, kv_empty, bt_row, kv_lo, n_tiles, LKV,
                             PAGE, BLOCK_N, NBUF)),
    ], [4, 1], [REGS_PV, REGS_LOAD])


# ==============================================================================================================
# Host side
# ==============================================================================================================
@dataclass(frozen=True)
class GluonWSConfig:
    """One compiled warp-specialised Gluon candidate. ``regs_pv`` / ``regs_load``: setmaxnreg of the P.V worker and
    of the loader warp (the default partition gets what is left); ``schedule``: "split" or "balanced"."""

    family: str = "W"
    block_h: int = 64
    block_n: int = 64
    nbuf: int = 2
    overlap: bool = False
    regs_pv: int = 232
    regs_load: int = 40
    schedule: str = "split"
    num_warps: int = 4

    @property
    def label(self) -> str:
        s = f"{self.family} gluon-ws h{self.block_h} n{self.block_n} buf{self.nbuf} regs{self.regs_pv}/{self.regs_load}"
        if self.overlap:
            s += " overlap"
        if self.schedule != "split":
            s += f" {self.schedule}"
        return s

    fp8 = ""  # 16-bit caches only

    @property
    def kv_fp8(self) -> bool:
        return False


def family_configs(quick: bool) -> list[GluonWSConfig]:
    """Candidate W's sweep, best guess first. NBUF 3 does not fit shared memory with 64-key tiles (290 KiB)."""
    cs = [GluonWSConfig(), GluonWSConfig(overlap=True), GluonWSConfig(regs_pv=240, regs_load=24),
          GluonWSConfig(schedule="balanced")]
    return cs[:1] if quick else cs


def make_gluon_launch(cfg: GluonWSConfig, q_nope, q_pe, cache, block_table, sched: Schedule, out, lse, *,
                      scale: float, k_scale: float = 1.0, num_sms: int = 132, interpret: bool = False) -> Launch:
    """A :class:`Launch` of the warp-specialised kernel over ``sched`` (+ the log-sum-exp merge of split rows)."""
    if interpret:
        raise NotImplementedError("Gluon kernels do not run under the Triton interpreter")
    _, H, lkv = q_nope.shape
    rope = q_pe.shape[-1]
    nb, page, width = cache.shape
    if cache.dtype not in (torch.float16, torch.bfloat16) or cache.dtype != q_nope.dtype:
        raise ValueError(f"the Gluon kernel reads 16-bit caches in the query dtype, got {cache.dtype} / "
                         f"{q_nope.dtype}")
    if width != lkv + rope or lkv % 128 or lkv // 2 > 256 or rope != 64:
        raise ValueError(f"LKV {lkv} must be a multiple of 128 and <= 512, R {rope} must be 64, width = LKV + R")
    if cfg.block_h != 64 or cfg.block_n != 64 or cfg.num_warps != 4 or cfg.nbuf < 1:
        raise ValueError("the warp-specialised kernel runs 64 heads x 64-key tiles, 4 + 4 + 1 warps")
    if page % cfg.block_n:
        raise ValueError(f"page {page} must be a multiple of block_n {cfg.block_n}")
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError("queries and cache must be contiguous in their last dimension (cache fully contiguous)")
    work = sched.work.cpu()
    if work.shape[0] and bool((work[:, 2] % page != 0).any()):
        raise ValueError(f"work items must start on a page boundary (one tile = one page of {page} keys)")
    kv_desc, pe_desc = hopper_descriptors(cache, lkv)  # the backend kernel's boxes: [64, LKV] and [64, R]
    o_part = torch.empty(max(1, sched.num_slots), H, lkv, dtype=torch.float32, device=q_nope.device)
    lse_part = torch.empty(max(1, sched.num_slots), H, dtype=torch.float32, device=q_nope.device)
    launch = Launch()
    launch.add(_mla_ws_kernel, (triton.cdiv(H, cfg.block_h), sched.work.shape[0]),
               (q_nope, q_pe, kv_desc, pe_desc, block_table, sched.work, out, lse, o_part, lse_part,
                q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0),
                out.stride(0), out.stride(1), lse.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
                scale * LOG2E),
               dict(H=H, LKV=lkv, R=rope, PAGE=page, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NBUF=cfg.nbuf,
                    OVERLAP=cfg.overlap, REGS_PV=cfg.regs_pv, REGS_LOAD=cfg.regs_load, num_warps=cfg.num_warps))
    add_combine(launch, sched, o_part, lse_part, out, lse)
    return launch
