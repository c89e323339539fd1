"""Gluon candidate for MLA decode on Hopper (candidate F of ``benchmarks/mla_explore.py``).

Plain Triton computes the scores of a 64-head tile twice on an 8-warp program: it lays the score tile out with
the rows split across warps ("chained dot" heuristic), so both warpgroups compute the full Q.K^T of a tile to
feed their half of the P.V product. Gluon names the layouts, so here the two warpgroups (8 warps) split every
product along N, FlashMLA-style:

- scores S [64 heads, BLOCK_N keys]: warps [4, 2], each warpgroup computes Q.K^T for half of the keys (no work
  done twice); the row max and sum cross the two warpgroups (a shared running max);
- output O [64, LKV]: warps [4, 2], each warpgroup owns LKV / 2 columns (256 for DeepSeek), the accumulator
  stays in registers (128 per thread);
- P [64, BLOCK_N] is exchanged through shared memory: each warpgroup needs every key's probability for its
  half of P.V;
- the cache tile [BLOCK_N, LKV] + [BLOCK_N, R] arrives by TMA (one page = one tile) into NBUF buffers tracked by
  mbarriers, and the latent part serves as K (transposed view) and as V;
- the last, partial tile of a work item is filled by masked pointer loads (rows past the end of the sequence
  may hold anything, NaN included, and must read as zero for P.V);
- PIPELINE: P.V of tile j - 1 runs on the tensor cores while the warps exponentiate tile j (needs NBUF >= 3,
  so 32-key tiles: see :func:`_pipelined_tiles` for the order and why it is not FlashAttention-3's).

Work items, partials and the log-sum-exp merge are those of ``benchmarks/mla_explore_triton.py``.

Gluon does not run under the interpreter: on a CPU this module is only imported and compiled for sm_90
(``python -m benchmarks.mla_explore --compile-only``); the GPU sweep checks it against the oracle.
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
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.mla_explore_triton import LOG2E, Launch, Schedule, add_combine


@gluon.jit
def _issue_tile(kv_desc, pe_desc, bt_row, n0, buf, kv_bufs, pe_bufs, ready, LKV: gl.constexpr, PAGE: gl.constexpr):
    """TMA the whole tile starting at key n0 (inside one page) into buffer ``buf``; ready[buf] completes when
    both boxes have landed."""
    page = gl.load(bt_row + n0 // PAGE)
    row = page * PAGE + n0 % PAGE
    bar = ready.index(buf)
    mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv_bufs.index(buf))
    tma.async_copy_global_to_shared(pe_desc, [row, LKV], bar, pe_bufs.index(buf))


@gluon.jit
def _attend_tile(q_smem, qpe_smem, kv, pe, p_smem, o, l_i, m_i, s_zero, n0, kv_hi, qk_scale,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
    """One tile: S = [Q ; Q_pe] . [K ; K_pe]^T split along the keys, online softmax (log2 domain, the scale in the
    exp2's FMA), P through shared memory, O += P . V split along the columns."""
    s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(qpe_smem, pe.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if MASKED:
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(offs_n < kv_hi, 0)
        s = gl.where(keep, s, gl.full_like(s, float("-inf")))
    p, l_i, m_new, alpha = _softmax_step(s, l_i, m_i, qk_scale, o_layout)
    o = o * gl.expand_dims(alpha, 1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()  # both warpgroups' halves of P are in shared memory
    o = warpgroup_mma(p_smem, kv, o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    return o, l_i, m_new


@gluon.jit
def _softmax_step(s, l_i, m_i, qk_scale, o_layout: gl.constexpr):
    """Online softmax of a score tile (log2 domain, the scale in the exp2's FMA): (p, l_i, m_new, alpha in the
    output's row layout)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2((m_i - m_new) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new * qk_scale, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, l_i, m_new, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))


@gluon.jit
def _plain_tiles(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, kv_desc, pe_desc, bt_row, kv_lo, kv_hi, n_full,
                 o, l_i, m_i, s_zero, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, LKV: gl.constexpr,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """The n_full whole tiles one after the other (Q.K^T, softmax, P.V), NBUF tiles in flight by TMA."""
    for i in range(n_full):
        buf = i % NBUF
        mbarrier.wait(ready.index(buf), (i // NBUF) & 1)
        o, l_i, m_i = _attend_tile(q_smem, qpe_smem, kv_bufs.index(buf), pe_bufs.index(buf), p_smem, o, l_i, m_i,
                                   s_zero, kv_lo + i * BLOCK_N, kv_hi, qk_scale, s_layout, o_layout, BLOCK_N, False)
        gl.thread_barrier()  # every warp is done with buffer ``buf`` (and with P)
        if i + NBUF < n_full:
            _issue_tile(kv_desc, pe_desc, bt_row, kv_lo + (i + NBUF) * BLOCK_N, buf, kv_bufs, pe_bufs, ready, LKV,
                        PAGE)
    return o, l_i, m_i


@gluon.jit
def _publish_p_and_issue_next(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, o, p, alpha, s_zero, j, n_full,
                              NBUF: gl.constexpr):
    """O *= alpha_j, P_j to shared memory for both warpgroups, then issue S_{j+1} (on whatever buffer
    (j + 1) % NBUF holds when j is the last tile: that S is discarded)."""
    o = o * gl.expand_dims(alpha, 1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()  # both halves of P_j are in shared memory
    nb = (j + 1) % NBUF
    mbarrier.wait(ready.index(nb), ((j + 1) // NBUF) & 1, pred=j + 1 < n_full)
    s_tok = warpgroup_mma(q_smem, kv_bufs.index(nb).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(qpe_smem, pe_bufs.index(nb).permute((1, 0)), s_tok, is_async=True)
    return o, s_tok


@gluon.jit
def _pipelined_tiles(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, kv_desc, pe_desc, bt_row, kv_lo, n_full,
                     o, l_i, m_i, s_zero, qk_scale, o_layout: gl.constexpr, LKV: gl.constexpr, PAGE: gl.constexpr,
                     BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """The n_full whole tiles with P.V of tile j - 1 on the tensor cores while the warps exponentiate tile j.

    Iteration j, with S_j in flight and P_{j-1} in shared memory: wait S_j; issue PV_{j-1}; softmax(S_j); wait
    PV_{j-1}; barrier (both warpgroups are done with buffer j - 1 and with P); refill buffer j - 1 with tile
    j - 1 + NBUF; O *= alpha_j; P_j to shared memory; issue S_{j+1}. A wgmma is only ever issued, and its
    accumulator only ever written by other instructions, while no other wgmma is in flight (ptxas serialises
    every wgmma of the function otherwise). Tile j + 1 is read while buffer j - 1 is busy: NBUF >= 3."""
    gl.static_assert(NBUF >= 3, "tile j + 1 is read while buffer j - 1 is still busy")
    mbarrier.wait(ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, kv_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_tok = warpgroup_mma(qpe_smem, pe_bufs.index(0).permute((1, 0)), s_tok, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    p, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, o_layout)
    o, s_tok = _publish_p_and_issue_next(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, o, p, alpha, s_zero, 0,
                                         n_full, NBUF)
    for j in range(1, n_full):
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        o_tok = warpgroup_mma(p_smem, kv_bufs.index((j - 1) % NBUF), o, is_async=True)
        p, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, o_layout)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        gl.thread_barrier()  # both warpgroups are done with P_{j-1} and with buffer j - 1
        refill = j - 1 + NBUF
        if refill < n_full:
            _issue_tile(kv_desc, pe_desc, bt_row, kv_lo + refill * BLOCK_N, (j - 1) % NBUF, kv_bufs, pe_bufs, ready,
                        LKV, PAGE)
        o, s_tok = _publish_p_and_issue_next(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, o, p, alpha, s_zero,
                                             j, n_full, NBUF)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))  # the last, discarded S (buffer n_full % NBUF)
    o = warpgroup_mma(p_smem, kv_bufs.index((n_full - 1) % NBUF), o)
    gl.thread_barrier()
    return o, l_i, m_i


@gluon.jit
def _mla_gluon_kernel(
    Q_NOPE, Q_PE,  # [T, H, LKV], [T, H, R] 16-bit
    CACHE,  # [num_blocks, PAGE, LKV + R] (the partial last tile is read through pointers)
    kv_desc, pe_desc,  # TMA over CACHE as [num_blocks * PAGE, LKV + R]: boxes [BLOCK_N, LKV] and [BLOCK_N, R]
    BLOCK_TABLE, WORK,  # [B, W] int32; [num_items, 5] int32 (row, request, kv_lo, kv_hi, slot)
    O, LSE, O_PART, LSE_PART,  # [T, H, LKV], [T, H] float32; [S, H, LKV] float32, [S, H] float32
    stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_c_blk, stride_c_tok, stride_bt,
    stride_o_t, stride_o_h, stride_lse_t, stride_op_s, stride_op_h, stride_lp_s,
    qk_scale,  # softmax scale * log2(e)
    H: gl.constexpr, LKV: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (H // BLOCK_H, num_items), 8 warps (two warpgroups)."""
    gl.static_assert(num_warps == 8, "two warpgroups split every product")
    gl.static_assert(BLOCK_H == 64, "one wgmma M tile of heads")
    gl.static_assert(PAGE % BLOCK_N == 0, "a TMA tile lies in one page")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, LKV // 2, 16])
    row_blk: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    pe_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    dtype: gl.constexpr = Q_NOPE.dtype.element_ty
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LKV], dtype)
    qpe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)

    hb = gl.program_id(0)
    w = gl.program_id(1)
    t = gl.load(WORK + w * 5).to(gl.int64)
    req = gl.load(WORK + w * 5 + 1)
    kv_lo = gl.load(WORK + w * 5 + 2)
    kv_hi = gl.load(WORK + w * 5 + 3)
    slot = gl.load(WORK + w * 5 + 4)
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt

    kv_bufs = gl.allocate_shared_memory(kv_desc.dtype, [NBUF, BLOCK_N, LKV], kv_desc.layout)
    pe_bufs = gl.allocate_shared_memory(pe_desc.dtype, [NBUF, BLOCK_N, R], pe_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(ready.index(i), count=1)
    n_full = (kv_hi - kv_lo) // BLOCK_N
    for i in gl.static_range(NBUF):  # the first tiles fly while the queries load
        if i < n_full:
            _issue_tile(kv_desc, pe_desc, bt_row, kv_lo + i * BLOCK_N, i, kv_bufs, pe_bufs, ready, LKV, PAGE)

    # Queries of the program's heads, staged in shared memory as the A operand of Q.K^T.
    rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, row_blk))
    cols = gl.arange(0, LKV, layout=gl.SliceLayout(0, row_blk))
    q = gl.load(Q_NOPE + t * stride_q_t + gl.expand_dims(rows, 1) * stride_q_h + gl.expand_dims(cols, 0),
                mask=gl.expand_dims(rows < H, 1) & gl.expand_dims(cols < LKV, 0), other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LKV], q_sl, q)
    rows_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, pe_blk))
    cols_pe = gl.arange(0, R, layout=gl.SliceLayout(0, pe_blk))
    qpe = gl.load(Q_PE + t * stride_qp_t + gl.expand_dims(rows_pe, 1) * stride_qp_h + gl.expand_dims(cols_pe, 0),
                  mask=gl.expand_dims(rows_pe < H, 1) & gl.expand_dims(cols_pe < R, 0), other=0.0)
    qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R], qpe_sl, qpe)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
    fence_async_shared()
    gl.thread_barrier()

    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
    o = gl.zeros([BLOCK_H, LKV], gl.float32, layout=o_layout)
    if PIPELINE:
        if n_full > 0:
            o, l_i, m_i = _pipelined_tiles(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, kv_desc, pe_desc,
                                           bt_row, kv_lo, n_full, o, l_i, m_i, s_zero, qk_scale, o_layout, LKV,
                                           PAGE, BLOCK_N, NBUF)
    else:
        o, l_i, m_i = _plain_tiles(q_smem, qpe_smem, kv_bufs, pe_bufs, p_smem, ready, kv_desc, pe_desc, bt_row,
                                   kv_lo, kv_hi, n_full, o, l_i, m_i, s_zero, qk_scale, s_layout, o_layout, LKV,
                                   PAGE, BLOCK_N, NBUF)

    tail = kv_lo + n_full * BLOCK_N
    if tail < kv_hi:
        buf = n_full % NBUF
        offs_n = tail + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, row_blk))
        n_ok = offs_n < kv_hi
        page = gl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(gl.int64)
        row_ptr = CACHE + page * stride_c_blk + (offs_n % PAGE).to(gl.int64) * stride_c_tok
        kv_t = gl.load(gl.expand_dims(row_ptr, 1) + gl.expand_dims(cols, 0),
                       mask=gl.expand_dims(n_ok, 1) & gl.expand_dims(cols < LKV, 0), other=0.0)
        kv_bufs.index(buf).store(kv_t)
        offs_n_pe = tail + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pe_blk))
        n_ok_pe = offs_n_pe < kv_hi
        page_pe = gl.load(bt_row + offs_n_pe // PAGE, mask=n_ok_pe, other=0).to(gl.int64)
        row_ptr_pe = CACHE + page_pe * stride_c_blk + (offs_n_pe % PAGE).to(gl.int64) * stride_c_tok + LKV
        pe_t = gl.load(gl.expand_dims(row_ptr_pe, 1) + gl.expand_dims(cols_pe, 0),
                       mask=gl.expand_dims(n_ok_pe, 1) & gl.expand_dims(cols_pe < R, 0), other=0.0)
        pe_bufs.index(buf).store(pe_t)
        fence_async_shared()
        gl.thread_barrier()
        o, l_i, m_i = _attend_tile(q_smem, qpe_smem, kv_bufs.index(buf), pe_bufs.index(buf), p_smem, o, l_i, m_i,
                                   s_zero, tail, kv_hi, qk_scale, s_layout, o_layout, BLOCK_N, True)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(ready.index(i))

    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
    lse = gl.where(has_keys, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453,
                   gl.full_like(l_i, float("-inf")))
    inv = gl.where(has_keys, 1.0 / l_safe, gl.zeros_like(l_i))
    out = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), 1)
    heads_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, LKV, layout=gl.SliceLayout(0, o_layout))
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


# ==============================================================================================================
# Host side
# ==============================================================================================================
@dataclass(frozen=True)
class GluonConfig:
    """One compiled Gluon candidate. ``schedule``: "split" or "balanced" (see ``build_schedule``)."""

    family: str = "F"
    block_h: int = 64
    block_n: int = 64
    nbuf: int = 2
    pipeline: bool = False
    schedule: str = "split"
    num_warps: int = 8

    @property
    def label(self) -> str:
        s = f"{self.family} gluon h{self.block_h} n{self.block_n} buf{self.nbuf}"
        if self.pipeline:
            s += " pipelined"
        if self.schedule != "split":
            s += f" {self.schedule}"
        return s

    fp8 = ""  # 16-bit caches only

    @property
    def kv_fp8(self) -> bool:
        return False


def family_configs(quick: bool) -> list[GluonConfig]:
    """Candidate F's sweep, best guess first."""
    cs = [GluonConfig(), GluonConfig(block_n=32, nbuf=4, pipeline=True), GluonConfig(block_n=32, nbuf=4)]
    return cs[:1] if quick else cs


def make_gluon_launch(cfg: GluonConfig, q_nope, q_pe, cache, block_table, sched: Schedule, out, lse, *,
                      scale: float, k_scale: float = 1.0, num_sms: int = 132, interpret: bool = False) -> Launch:
    """A :class:`Launch` of the Gluon kernel over ``sched`` (+ the log-sum-exp merge of split rows)."""
    if interpret:
        raise NotImplementedError("Gluon kernels do not run under the Triton interpreter")
    T, H, lkv = q_nope.shape
    rope = q_pe.shape[-1]
    nb, page, width = cache.shape
    if cache.dtype not in (torch.float16, torch.bfloat16) or cache.dtype != q_nope.dtype:
        raise ValueError(f"the Gluon kernel reads 16-bit caches in the query dtype, got {cache.dtype} / "
                         f"{q_nope.dtype}")
    if width != lkv + rope or lkv & (lkv - 1) or rope & (rope - 1) or lkv // 2 > 256 or lkv > 512:
        raise ValueError(f"LKV {lkv} and R {rope} must be powers of two, LKV <= 512, width = LKV + R")
    if cfg.block_h != 64 or cfg.num_warps != 8:
        raise ValueError("the Gluon kernel runs 64 heads on 8 warps")
    if page % cfg.block_n:
        raise ValueError(f"page {page} must be a multiple of block_n {cfg.block_n}")
    if cfg.pipeline and cfg.nbuf < 3:
        raise ValueError(f"the pipelined loop needs nbuf >= 3, got {cfg.nbuf}")
    rows = cache.view(nb * page, width)
    gdt = gl.bfloat16 if cache.dtype == torch.bfloat16 else gl.float16
    kv_desc = TensorDescriptor.from_tensor(rows, [cfg.block_n, lkv],
                                           gl.NVMMASharedLayout.get_default_for([cfg.block_n, lkv], gdt))
    pe_desc = TensorDescriptor.from_tensor(rows, [cfg.block_n, rope],
                                           gl.NVMMASharedLayout.get_default_for([cfg.block_n, rope], gdt))
    o_part = torch.empty(max(1, sched.num_slots), H, lkv, dtype=torch.float32, device=q_nope.device)
    lse_part = torch.empty(max(1, sched.num_slots), H, dtype=torch.float32, device=q_nope.device)
    launch = Launch()
    launch.add(_mla_gluon_kernel, (triton.cdiv(H, cfg.block_h), sched.work.shape[0]),
               (q_nope, q_pe, cache, kv_desc, pe_desc, block_table, sched.work, out, lse, o_part, lse_part,
                q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
                cache.stride(1), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0),
                o_part.stride(0), o_part.stride(1), lse_part.stride(0), scale * LOG2E),
               dict(H=H, LKV=lkv, R=rope, PAGE=page, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NBUF=cfg.nbuf,
                    PIPELINE=cfg.pipeline, num_warps=cfg.num_warps))
    add_combine(launch, sched, o_part, lse_part, out, lse)
    return launch
