"""Warp-specialised Gluon candidate for causal prefill on Hopper (FlashAttention-3 style), every token new.

The case and the API are those of :mod:`benchmarks.prefill_explore_gluon`: Q / K / V / O contiguous
``[tokens, heads, 128]`` 16-bit, sequences given by ``query_start_loc`` (varlen), GQA, causal, no cached context.

Work items are (head, sequence, 128-row query block), head fastest (the query heads of one KV head run side by
side, so their K/V tiles come from L2), the last (heaviest) query blocks first. Program p of P runs item
r * P + p in round r, in reverse order (r * P + P - 1 - p) on odd rounds (P = one per SM when ``persistent``, else
one program per item). Each program runs three partitions over NBUF stages of shared memory:

- **loader** (worker, 1 warp, REGS_LOAD registers): per item Q once ([128, 128] box, once both consumers are done
  with the previous item's Q), K_0, then per tile j K_{j+1} (one tile ahead: S_{j+1} is issued before P_j.V_j)
  and V_j, each into its own stage by TMA as soon as both consumers have released that stage;
- **consumer 0 / consumer 1** (the default partition and a 4-warp worker, one warpgroup each, REGS_CONSUMER
  registers): rows r0 = m0 + 64 * WG .. r0 + 63 of the query tile. Iteration j issues S_j = Q.K_j^T
  (``m64nBLOCK_Nk16``) and O += P_{j-1}.V_{j-1} (``m64n128k16``, P from registers), waits for S_j only, releases
  K_j, masks S_j (tiles on the diagonal only), runs the online softmax (log2 domain, the scale in the exp2's FMA)
  while P.V runs, then waits for P.V, releases V_{j-1} and rescales O. No instruction touches the accumulator of
  a wgmma in flight (ptxas would serialise every wgmma of the kernel otherwise). After the last S the consumer
  releases Q, issues the last P.V, normalises and stores its 64 rows while the loader already brings the next
  item's Q and first tiles;
- **ping-pong** (``PINGPONG``): the two consumers take turns issuing their wgmma (a turn = the one or two wgmma
  of an iteration), so the tensor cores run one warpgroup's products while the other one exponentiates.

Barriers. Counters carried across a program's items: i (items done), it (tiles done; tile j of the item is
g = it + j, in stage s = g % NBUF with use parity (g // NBUF) & 1), and turns (n_tiles + 1 per item, so an item
starts at turn it + i):

    q_ready       count 1  loader expect-tx (+ Q bytes) per item; consumers wait parity i & 1
    q_empty       count 2  each consumer arrives once its last S of the item is complete; the loader waits parity
                           (i & 1) ^ 1 before Q of item i (a fresh barrier passes parity 1: item 0 goes at once)
    k_ready[s]    count 1  loader expect-tx (+ K bytes); consumers wait parity (g // NBUF) & 1 before S_g
    v_ready[s]    count 1  loader expect-tx (+ V bytes); consumers wait the same parity before P_g.V_g
    k_empty[s]    count 2  each consumer arrives once S_g is complete; the loader waits parity ((g // NBUF) & 1)
                           ^ 1 before loading tile g into stage s (the first NBUF loads pass at once)
    v_empty[s]    count 2  each consumer arrives once P_g.V_g is complete; the loader as for K
    turn[w]       count 1  (PINGPONG) consumer w's k-th turn waits turn[w] parity (k & 1) ^ (1 - w) (consumer
                           0's first turn passes at once); after issuing, a consumer arrives on turn[1 - w]

Both consumers run the same n_tiles per item (the other warpgroup's extra diagonal tile is fully masked for
its rows, P = 0 there), so they make the same number of turns and arrivals, and every barrier anyone waits on
gets all its arrivals. No barrier can run a phase ahead of a waiter: a stage (or Q) is refilled only after both
consumers released its previous content, which each does only after waiting for that content.

Tails: keys past a sequence's end (the next sequence's keys, or TMA's zero fill past the last token) lie above the
causal diagonal of every valid row, so they are masked (diagonal tiles are the only ones that reach past a valid
row), and they hold finite values (0 * finite = 0 in P.V). Query rows past the end (the next sequence's queries
or zeros) compute finite values (key 0 is visible to every row, so the row max is finite from tile 0) that are
not stored. O is written by masked pointer stores, or (``EPI_TMA``) by a TMA store of the warpgroup's 64 rows
staged in shared memory when all 64 rows are valid, masked stores otherwise: a TMA box would run into the next
sequence's rows.

Registers: ``gl.warp_specialize`` pads the 5 worker warps to 2 warpgroups (12 warps, 384 threads, kernel
.maxnreg 168, one program per SM); setmaxnreg gives the consumer worker REGS_CONSUMER, the loader's warpgroup
REGS_LOAD and the default partition what is left: (240, 24) gives both consumers 240.

Gluon does not run under the interpreter: on a CPU this module is only compiled for sm_90 (:func:`compile_report`,
``--compile-only``); ``tests/test_prefill_explore_gluon_ws.py`` checks it against a float64 reference on the GPU
and ``python -m benchmarks.prefill_explore_gluon_ws --out DIR/ws.json`` checks each config in a child process
and times the passing ones next to FlashInfer's ragged prefill, torch SDPA and the non-specialised Gluon
candidate.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

if __name__ == "__main__":  # run as a script (so are its child processes): the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.prefill_explore_gluon import (
    BLOCK_M,
    RCP_LN2,
    _check,
    _descriptors,
    _gl_dtype,
    _masked_scores,
    _softmax_step,
)

ROWS_PER_WG = 64  # query rows of one consumer warpgroup: one wgmma M tile
CONSUMER_WARPS = 4


# ==============================================================================================================
# Kernel
# ==============================================================================================================
@gluon.jit
def _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ: gl.constexpr, BLOCK_M: gl.constexpr):
    """This program's item of round r -> (head, first token of the sequence, its length, first row of the query
    tile, whether there is work). Items run head fastest (the query heads of one KV head side by side), then
    sequence, then query block from the last (heaviest) down; round r gives item r * P + p to program p of P, in
    reverse order on odd rounds (a snake: the programs that got the heavier item of one round get the lighter one
    of the next). Past the last item, or a tile that starts past its sequence's end, there is no work."""
    P = gl.num_programs(0)
    p = gl.program_id(0)
    w = r * P + p + (r & 1) * (P - 1 - 2 * p)
    wc = gl.minimum(w, num_items - 1)
    h = wc % HQ
    rest = wc // HQ
    seq = rest % num_seqs
    qb = num_q_blocks - 1 - rest // num_seqs
    start = gl.load(QSL + seq)
    q_len = gl.load(QSL + seq + 1) - start
    m0 = qb * BLOCK_M
    return h, start, q_len, m0, (w < num_items) & (m0 < q_len)


@gluon.jit
def _load_tile(desc, bufs, ready, empty, row, col, g, NBUF: gl.constexpr):
    """TMA the [BLOCK_N, HEAD] tile starting at token ``row`` into stage g % NBUF (g: the program's running tile
    count) once both consumers released the stage's previous tile, g - NBUF."""
    s = g % NBUF
    mbarrier.wait(empty.index(s), ((g // NBUF) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, bufs.index(s))


@gluon.jit
def _loader_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                      v_empty, QSL, num_seqs, num_q_blocks, num_items,
                      HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """1 warp. Per work item: Q (once both consumers' last Q.K^T of the previous item is complete), K_0, then per
    tile j K_{j+1} (one tile ahead: S_{j+1} is issued before P_j.V_j) and V_j."""
    it = 0
    i = 0
    for r in range(gl.cdiv(num_items, gl.num_programs(0))):
        h, start, q_len, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ, BLOCK_M)
        if has_work:
            col_kv = (h // (HQ // HKV)) * HEAD
            n_tiles = gl.cdiv(gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
            mbarrier.wait(q_empty, (i & 1) ^ 1)
            mbarrier.expect(q_ready, q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [start + m0, h * HEAD], q_ready, q_smem)
            _load_tile(k_desc, k_bufs, k_ready, k_empty, start, col_kv, it, NBUF)
            for j in range(n_tiles):
                if j + 1 < n_tiles:
                    _load_tile(k_desc, k_bufs, k_ready, k_empty, start + (j + 1) * BLOCK_N, col_kv, it + j + 1, NBUF)
                _load_tile(v_desc, v_bufs, v_ready, v_empty, start + j * BLOCK_N, col_kv, it + j, NBUF)
            it += n_tiles
            i += 1


@gluon.jit
def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait for this warpgroup's k-th turn to issue wgmma (consumer 0's first turn is free)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: this warpgroup's wgmma are issued; the other warpgroup's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _attend(q, k_bufs, v_bufs, q_empty, k_ready, v_ready, k_empty, v_empty, turn, r0, n_tiles, it, t, qk_scale,
            WG: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
            PINGPONG: gl.constexpr):
    """One warpgroup's 64 query rows (from r0) against key tiles 0 .. n_tiles - 1 of its sequence: (O unnormalised
    [64, HEAD] float32, row sums [64]). ``it``: the program's running tile count before this item (stage and
    parity of every tile), ``t``: its running turn count (n_tiles + 1 turns per item)."""
    ROWS: gl.constexpr = 64
    dtype: gl.constexpr = q.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n_unmasked = r0 // BLOCK_N  # tiles whose last key is <= r0: visible to every row of this warpgroup

    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    o = gl.zeros([ROWS, HEAD], gl.float32, layout=o_layout)

    s0 = it % NBUF
    mbarrier.wait(k_ready.index(s0), (it // NBUF) & 1)
    _turn_wait(turn, t, WG, PINGPONG)
    s_tok = warpgroup_mma(q, k_bufs.index(s0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(s0), count=1)
    s = _masked_scores(s, 0, r0, n_unmasked, s_layout, ROWS, BLOCK_N)
    p, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype)
    for j in range(1, n_tiles):
        g = it + j
        buf = g % NBUF
        prev = (g - 1) % NBUF
        mbarrier.wait(k_ready.index(buf), (g // NBUF) & 1)
        mbarrier.wait(v_ready.index(prev), ((g - 1) // NBUF) & 1)
        _turn_wait(turn, t + j, WG, PINGPONG)
        s_tok = warpgroup_mma(q, k_bufs.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p, v_bufs.index(prev), o, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # wgmma groups retire in order: S_j is done
        mbarrier.arrive(k_empty.index(buf), count=1)
        s = _masked_scores(s, j, r0, n_unmasked, s_layout, ROWS, BLOCK_N)
        p_next, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))  # P_{j-1} lives until P.V is done
        mbarrier.arrive(v_empty.index(prev), count=1)
        p = p_next
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    mbarrier.arrive(q_empty, count=1)  # every Q.K^T of the item is complete: the loader may bring the next Q
    last = (it + n_tiles - 1) % NBUF
    mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // NBUF) & 1)
    _turn_wait(turn, t + n_tiles, WG, PINGPONG)
    o_tok = warpgroup_mma(p, v_bufs.index(last), o, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    mbarrier.arrive(v_empty.index(last), count=1)
    return o, l_i


@gluon.jit
def _consumer_partition(q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                        o_desc, O, QSL, num_seqs, num_q_blocks, num_items, stride_o_t, qk_scale,
                        WG: gl.constexpr, HQ: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PINGPONG: gl.constexpr, EPI_TMA: gl.constexpr):
    """One consumer warpgroup: rows r0 = m0 + 64 * WG .. r0 + 63 of each work item's query tile; normalises and
    stores them (masked pointer stores, or a TMA store staged in ``o_smem`` when all 64 rows are valid)."""
    ROWS: gl.constexpr = 64
    dtype: gl.constexpr = q_smem.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD, 16])
    q = q_smem.slice(WG * ROWS, ROWS, dim=0)
    o_stage = o_smem.slice(WG * ROWS, ROWS, dim=0)
    it = 0
    i = 0
    for r in range(gl.cdiv(num_items, gl.num_programs(0))):
        h, start, q_len, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ, BLOCK_M)
        if has_work:
            r0 = m0 + WG * ROWS
            n_tiles = gl.cdiv(gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
            mbarrier.wait(q_ready, i & 1)
            o, l_i = _attend(q, k_bufs, v_bufs, q_empty, k_ready, v_ready, k_empty, v_empty, turn, r0, n_tiles, it,
                             it + i, qk_scale, WG, HEAD, BLOCK_N, NBUF, PINGPONG)
            it += n_tiles
            i += 1

            inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
            out = (o * gl.expand_dims(inv, 1)).to(dtype)
            if EPI_TMA and r0 + ROWS <= q_len:
                o_stage.store(out)
                fence_async_shared()
                gl.thread_barrier()  # every warp's rows in shared memory before one thread issues the store
                tma.async_copy_shared_to_global(o_desc, [start + r0, h * HEAD], o_stage)
                tma.store_wait(0)  # o_stage is rewritten by the next item
            else:
                rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
                cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
                ptrs = (O + gl.expand_dims((start + rows).to(gl.int64) * stride_o_t, 1) + h * HEAD
                        + gl.expand_dims(cols, 0))
                gl.store(ptrs, out, mask=gl.expand_dims(rows < q_len, 1) & gl.expand_dims(cols < HEAD, 0))


@gluon.jit
def _prefill_ws_kernel(
    q_desc, k_desc, v_desc, o_desc,  # TMA over Q [T, HQ * HEAD] (box BLOCK_M x HEAD), K / V [T, HKV * HEAD]
                                     # (BLOCK_N x HEAD), O [T, HQ * HEAD] (64 x HEAD)
    O, QSL,  # [T, HQ, HEAD]; [B + 1] int32
    stride_o_t, num_seqs, num_q_blocks, qk_scale,  # qk_scale: softmax scale * log2(e)
    HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NBUF: gl.constexpr, PINGPONG: gl.constexpr, EPI_TMA: gl.constexpr, REGS_CONSUMER: gl.constexpr,
    REGS_LOAD: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (programs,): each program runs its share of the HQ * num_seqs * num_q_blocks work items in rounds
    (:func:`_work_item`; one item each when programs = items, persistent when programs = SMs). Warps: 4
    (consumer 0, the default partition) + 4 (consumer 1) + 1 (TMA loader)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 query rows each")
    gl.static_assert(BLOCK_M % BLOCK_N == 0, "a query tile ends on a key tile boundary")
    gl.static_assert(NBUF >= 2, "the next tile flies while this one is read")
    dtype: gl.constexpr = q_desc.dtype
    num_items = HQ * num_seqs * num_q_blocks

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], v_desc.layout)
    if EPI_TMA:
        o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], o_desc.layout)
    else:
        o_smem = q_smem  # unused
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)  # the loader's expect-tx arrival (+ the TMA bytes)
    mbarrier.init(q_empty, count=2)  # both consumers' last Q.K^T of the item is complete
    for s in gl.static_range(NBUF):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # both consumers release the stage
        mbarrier.init(v_empty.index(s), count=2)
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)  # the other consumer's arrival
    fence_async_shared()  # the initialised barriers visible to the async proxy (TMA complete-tx)
    gl.thread_barrier()

    gl.warp_specialize([
        (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                               turn, o_desc, O, QSL, num_seqs, num_q_blocks, num_items, stride_o_t, qk_scale, 0, HQ,
                               HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG, EPI_TMA)),
        (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                               turn, o_desc, O, QSL, num_seqs, num_q_blocks, num_items, stride_o_t, qk_scale, 1, HQ,
                               HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG, EPI_TMA)),
        (_loader_partition, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                             k_empty, v_empty, QSL, num_seqs, num_q_blocks, num_items, HQ, HKV, HEAD, BLOCK_M,
                             BLOCK_N, NBUF)),
    ], [4, 1], [REGS_CONSUMER, REGS_LOAD])


# ==============================================================================================================
# Host side
# ==============================================================================================================
DEFAULT_REGS = (240, 24)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM: what an offline compile assumes


def launch_args(q, k, v, out, query_start_loc, max_len: int, scale: float, block_n: int = 128, nbuf: int = 2,
                pingpong: bool = True, persistent: bool = True, epi_tma: bool = False,
                regs: tuple[int, int] = DEFAULT_REGS):
    """(grid, args, kwargs) of one launch of :func:`_prefill_ws_kernel` (also what the offline compile uses).
    ``persistent``: one program per SM looping over the work items (else one program per item); ``regs``:
    setmaxnreg of the consumer worker and of the loader warp (the default consumer gets the rest)."""
    _check(q, k, v, out, query_start_loc, block_n, nbuf)
    regs = tuple(regs)
    if len(regs) != 2 or regs[0] % 8 or regs[1] % 8 or not (24 <= regs[1] <= regs[0] <= 256):
        raise ValueError(f"regs must be (consumer, loader) multiples of 8 with 24 <= loader <= consumer <= 256, "
                         f"got {regs}")
    T, HQ, D = q.shape
    num_seqs = query_start_loc.numel() - 1
    num_q_blocks = triton.cdiv(max(int(max_len), 1), BLOCK_M)
    q_desc, k_desc, v_desc = _descriptors(q, k, v, block_n)
    gdt = _gl_dtype(q.dtype)
    o_desc = TensorDescriptor.from_tensor(out.view(T, HQ * D), [ROWS_PER_WG, D],
                                          gl.NVMMASharedLayout.get_default_for([ROWS_PER_WG, D], gdt))
    items = HQ * num_seqs * num_q_blocks
    grid = (min(items, _num_sms(q.device)) if persistent else items,)
    args = (q_desc, k_desc, v_desc, o_desc, out, query_start_loc, out.stride(0), num_seqs, num_q_blocks,
            scale * RCP_LN2)
    kwargs = dict(HQ=HQ, HKV=k.shape[1], HEAD=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, NBUF=nbuf,
                  PINGPONG=bool(pingpong), EPI_TMA=bool(epi_tma), REGS_CONSUMER=int(regs[0]),
                  REGS_LOAD=int(regs[1]), num_warps=CONSUMER_WARPS)
    return grid, args, kwargs


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
        max_len: int, scale: float, *, block_n: int = 128, nbuf: int = 2, pingpong: bool = True,
        persistent: bool = True, epi_tma: bool = False, regs: tuple[int, int] = DEFAULT_REGS) -> torch.Tensor:
    """Causal varlen prefill, every token new: ``out = softmax(scale * q k^T + causal) v`` per sequence.

    Parameters
    ----------
    q, out : [tokens, num_heads, 128] bfloat16 / float16, contiguous
    k, v : [tokens, num_kv_heads, 128], same dtype, contiguous; num_heads a multiple of num_kv_heads
    query_start_loc : [num_seqs + 1] int32 on the device, sequence i is tokens [qsl[i], qsl[i + 1])
    max_len : the longest sequence (host int; a larger value only adds work items that are skipped)
    scale : softmax scale
    block_n, nbuf, pingpong, persistent, epi_tma, regs : the kernel config (see :data:`CONFIGS`)
    """
    if q.device.type != "cuda":
        raise NotImplementedError("the Gluon kernel runs on CUDA (sm_90) only, not under the Triton interpreter")
    grid, args, kwargs = launch_args(q, k, v, out, query_start_loc, max_len, scale, block_n, nbuf, pingpong,
                                     persistent, epi_tma, regs)
    _prefill_ws_kernel[grid](*args, **kwargs)
    return out


# The sweep, best guess first. Every entry names every field (the tests compare them with the reports).
_BASE = dict(block_n=128, nbuf=2, pingpong=True, persistent=True, epi_tma=False, regs=DEFAULT_REGS)
CONFIGS = [
    _BASE,
    dict(_BASE, persistent=False),
    dict(_BASE, pingpong=False),
    dict(_BASE, pingpong=False, persistent=False),
    dict(_BASE, nbuf=3),
    dict(_BASE, block_n=64, nbuf=3),
    dict(_BASE, block_n=64, nbuf=4, pingpong=False),
    dict(_BASE, epi_tma=True),
    dict(_BASE, regs=(232, 40)),
]


def config_label(cfg: dict) -> str:
    """A short unique name: ``ws n128 buf2 pp persist`` (+ ``tmaO``, ``regs232/40``)."""
    cfg = dict(_BASE, **cfg)
    s = f"ws n{cfg['block_n']} buf{cfg['nbuf']}"
    s += " pp" if cfg["pingpong"] else ""
    s += " persist" if cfg["persistent"] else ""
    s += " tmaO" if cfg["epi_tma"] else ""
    if tuple(cfg["regs"]) != DEFAULT_REGS:
        s += " regs{}/{}".format(*cfg["regs"])
    return s


def _launch_attrs(kernel, args: tuple, kwargs: dict) -> dict:
    """The 16-byte divisibility attributes the JIT derives at launch (pointers, integers divisible by 16), which
    ``offline_compile.compile_call`` leaves out: without them every O store is a 2-byte store."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    positional, attrs = list(args), {}
    for p in kernel.params:
        if p.is_constexpr:
            continue
        value = positional.pop(0) if positional else kwargs[p.name]
        attr = native_specialize_impl(CUDABackend, value, False, True, True)[1]
        if isinstance(attr, str) and attr:
            attrs[(p.num,)] = CUDABackend.parse_attr(attr)
    return attrs


def _sass_facts(sass: str) -> dict:
    """From the SASS: ``regs_by_limit`` {setmaxnreg limit: highest register number + 1 used under it}, each
    instruction counted under the last ``USETMAXREG`` above it in address order ("240": the consumers, "24": the
    loader; the out-of-line mbarrier retry loops at the end count under the last limit, "256"); ``local_ld_st``:
    spill loads / stores; ``global_stores`` {STG form: count}."""
    import re
    from collections import Counter

    limit, use = "kernel", {}
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            limit = str(int(m.group(1), 16))
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line)]
        if regs:
            use[limit] = max(use.get(limit, 0), max(regs) + 1)
    return {"regs_by_limit": dict(sorted(use.items())),
            "local_ld_st": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "global_stores": dict(Counter(re.findall(r"\b(STG\.E(?:\.\w+)?)\b", sass)))}


def compile_report(tokens: int = 256, heads: int = 32, kv_heads: int = 8, keep_asm: bool = False, **cfg) -> dict:
    """Compile the kernel for sm_90 without a GPU, as the GPU's JIT would (arguments built on the CPU, with the
    launch's divisibility attributes), for one config (``CONFIGS`` fields).

    Returns the keys of ``benchmarks.offline_compile.compile_call`` ("regs" is the kernel-level .maxnreg that
    warp specialisation sets; "stack" / "local" the spill stack; "shared", "shared_over_limit", "wgmma",
    "mma_sync", "ptxas_notes") plus "setmaxnreg" (the PTX's register moves), "maxnreg", :func:`_sass_facts`
    and "config"."""
    import re
    import subprocess
    from collections import Counter

    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.offline_compile import (
        SHARED_LIMIT,
        _ptxas_notes,
        _signature,
        _tool,
        sm90_target,
    )

    cfg = dict(_BASE, **cfg)
    q = torch.zeros(tokens, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(tokens, kv_heads, 128, dtype=torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    _, args, kwargs = launch_args(q, k, k.clone(), torch.empty_like(q), qsl, tokens, 0.1, **cfg)
    target = sm90_target()
    signature, constexprs, options = _signature(_prefill_ws_kernel, args, kwargs)
    attrs = _launch_attrs(_prefill_ws_kernel, args, kwargs)
    t0 = time.time()
    compiled = triton.compile(GluonASTSource(_prefill_ws_kernel, signature, constexprs, attrs), target=target,
                              options=options)
    rep = {"kernel": _prefill_ws_kernel.fn.__name__, "compile_s": round(time.time() - t0, 2),
           "shared": compiled.metadata.shared,
           "shared_over_limit": compiled.metadata.shared > SHARED_LIMIT[target.arch]}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    for key, field in (("regs", "REG"), ("stack", "STACK"), ("local", "LOCAL")):
        m = re.search(rf"\b{field}:(\d+)", usage)
        rep[key] = int(m.group(1)) if m else None
    ptx = compiled.asm["ptx"]
    rep["ptxas_notes"] = _ptxas_notes(ptx, target.arch)
    rep["wgmma"] = dict(Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.[\w.]+)", ptx)))
    rep["mma_sync"] = len(re.findall(r"\bmma\.sync\.aligned", ptx))
    rep["setmaxnreg"] = [f"{kind} {n}" for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                                 ptx)]
    m = re.search(r"\.maxnreg\s+(\d+)", ptx)
    rep["maxnreg"] = int(m.group(1)) if m else None
    rep.update(_sass_facts(sass))
    rep["config"] = {**cfg, "regs": list(cfg["regs"])}
    if keep_asm:
        rep["asm"] = {"ttgir": compiled.asm.get("ttgir", ""), "ptx": ptx, "sass": sass}
    return rep


# ==============================================================================================================
# Benchmark: python -m benchmarks.prefill_explore_gluon_ws --out DIR/prefill-ws.json
# ==============================================================================================================
SHAPES = "1x8192,4x4096,16x1024"
HQ, HKV, D = 32, 8, 128
CHECK_LENGTHS = [300, 127, 1, 77, 128, 200, 129]  # the probe's varlen batch (no cached context)
REL_TOL = 1e-2


def _launcher(fn_kernel, grid, args, kwargs):
    """A no-argument callable launching a prepared grid (descriptors built once, as a metadata builder would)."""
    kernel = fn_kernel[grid]
    return lambda: kernel(*args, **kwargs)


def _ws_fn(cfg: dict, q, k, v, out, qsl, max_len: int, scale: float):
    grid, args, kwargs = launch_args(q, k, v, out, qsl, max_len, scale, **cfg)
    return _launcher(_prefill_ws_kernel, grid, args, kwargs)


def _probe_main(ns) -> int:
    """Child process: per config, compile and check against the float32 reference on a varlen batch, then one
    launch per timed shape (a hang or crash shows here, not in the parent). JSON lines to --probe-out, 'started'
    before each config so that a dead child names it."""
    from benchmarks.prefill_explore import PagedBatch, compare, parse_shapes, reference

    configs = json.loads(ns.probe_configs)
    small = PagedBatch([(n, 0) for n in CHECK_LENGTHS], seed=1)
    ref = reference(small, torch.float32)
    key, value = small.new_kv()
    bench = [PagedBatch([(L, 0)] * B) for B, L in parse_shapes(ns.shapes)]
    with open(ns.probe_out, "a") as f:
        for cfg in configs:
            label = config_label(cfg)
            f.write(json.dumps({"label": label, "status": "started"}) + "\n")
            f.flush()
            t0 = time.time()
            try:
                out = torch.full_like(small.query, float("nan"))
                _ws_fn(cfg, small.query, key, value, out, small.qsl, max(small.q_lens), small.scale)()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                mad, rel = compare(out, ref)
                for bb in bench:
                    kk, vv = bb.new_kv()
                    _ws_fn(cfg, bb.query, kk, vv, torch.empty_like(bb.query), bb.qsl, max(bb.q_lens), bb.scale)()
                torch.cuda.synchronize()
                rec = {"label": label, "status": "ok" if rel < REL_TOL else "wrong", "max_abs": mad, "rel": rel,
                       "compile_s": round(compile_s, 2)}
            except Exception as e:  # noqa: BLE001 - one failing config must not stop the probe
                rec = {"label": label, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(f"probe {label}: {rec}", flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()
    return 0


def _flashinfer_ragged(q, k, v, qsl, scale: float):
    """FlashInfer's ragged prefill (every token new), planned once: (fn, out holder)."""
    import flashinfer

    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(qsl, qsl, q.shape[1], k.shape[1], q.shape[2], causal=True, q_data_type=q.dtype, sm_scale=scale)
    holder = {}

    def fn():
        holder["o"] = w.run(q, k, v)
    return fn, holder


def _warm_flashinfer_main(ns) -> int:
    """Child process: JIT-build (or load) FlashInfer's ragged prefill module for the timed parameters."""
    from benchmarks.prefill_explore import PagedBatch

    b = PagedBatch([(256, 0), (100, 0)])
    k, v = b.new_kv()
    fn, _ = _flashinfer_ragged(b.query, k, v, b.qsl, b.scale)
    fn()
    torch.cuda.synchronize()
    print("flashinfer ragged prefill module ready", flush=True)
    return 0


class _Sweep:
    """The parent process: probes in children, then peers and passing configs timed here, in one process."""

    def __init__(self, ns, log):
        from benchmarks.prefill_explore import parse_shapes

        self.ns, self.log = ns, log
        self.shapes = parse_shapes(ns.shapes)
        self.result = {"meta": {}, "probes": {}, "tflops": {}, "checks": {}, "rows": []}

    def _spawn(self, extra: list[str], prefix: str):
        from benchmarks.explore_common import spawn_child

        cmd = [sys.executable, "-m", "benchmarks.prefill_explore_gluon_ws", "--shapes", self.ns.shapes] + extra
        return spawn_child(cmd, self.log, prefix, cwd=str(Path(__file__).resolve().parents[1]))

    def probe(self, configs: list[dict]) -> dict:
        """{label: verdict}; a child that hangs past --probe-timeout-s on one config or dies is replaced by a new
        child for the configs after it; past --probe-budget-s no new child starts (the rest: "skipped")."""
        from benchmarks.explore_common import kill_child

        verdicts, pending = {}, list(configs)
        end = time.time() + self.ns.probe_budget_s
        while pending and time.time() < end:
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
                path = tmp.name
            proc = self._spawn(["--probe-configs", json.dumps(pending), "--probe-out", path], "probe")
            started_at, current, seen, rc = time.time(), None, 0, None
            while True:
                rc = proc.poll()
                lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
                for r in lines[seen:]:
                    if r["status"] == "started":
                        current, started_at = r["label"], time.time()
                    else:
                        verdicts[r["label"]] = r
                        current = None
                seen = len(lines)
                if rc is not None:
                    break
                if time.time() - started_at > self.ns.probe_timeout_s:
                    kill_child(proc)
                    rc = "timeout"
                    break
                time.sleep(0.5)
            os.unlink(path)
            if current is not None:
                status = "timeout" if rc == "timeout" else "crashed"
                verdicts[current] = {"label": current, "status": status, "error": f"child ended ({rc}) on it"}
                self.log(f"  {current}: {status} (child ended: {rc})")
            remaining = [c for c in pending if config_label(c) not in verdicts]
            if len(remaining) == len(pending):  # died before its first config: it would every time
                for c in remaining:
                    verdicts[config_label(c)] = {"label": config_label(c), "status": "error",
                                                 "error": f"probe process ended ({rc}) before any config"}
                remaining = []
            pending = remaining
        for c in pending:
            verdicts[config_label(c)] = {"label": config_label(c), "status": "skipped", "error": "probe budget spent"}
        return verdicts

    def add_time(self, name: str, shape, us: float, flops: float, check: str = "") -> None:
        key = f"{shape[0]}x{shape[1]}"
        self.result["tflops"].setdefault(name, {})[key] = round(flops / us / 1e6, 1)
        if check:
            self.result["checks"].setdefault(name, {})[key] = check
        self.log(f"  {name:34s} {key:>8s} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s  {check}")

    def write(self) -> None:
        if not self.ns.out:
            return
        rows = []
        peers = ("flashinfer_ragged", "sdpa")
        for name, per_shape in self.result["tflops"].items():
            for key, t in per_shape.items():
                B, L = (int(x) for x in key.split("x"))
                for peer in peers:
                    pt = self.result["tflops"].get(peer, {}).get(key)
                    if peer != name and pt:
                        rows.append({"case": "prefill_new", "backend": name, "peer": peer, "B": B, "L": L,
                                     "dtype": "bfloat16", "kv_dtype": "auto", "TFLOPs": t, "peer_TFLOPs": pt,
                                     "ratio": round(pt / t, 4)})
        self.result["rows"] = rows
        Path(self.ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.ns.out).write_text(json.dumps(self.result, indent=1) + "\n")

    def table(self) -> str:
        keys = [f"{B}x{L}" for B, L in self.shapes]
        lines = ["| kernel | " + " | ".join(f"{k} TFLOP/s (x FI / x SDPA)" for k in keys) + " |",
                 "|---|" + "---:|" * len(keys)]
        fi, sd = self.result["tflops"].get("flashinfer_ragged", {}), self.result["tflops"].get("sdpa", {})
        for name, per_shape in self.result["tflops"].items():
            cells = []
            for k in keys:
                t = per_shape.get(k)
                if t is None:
                    cells.append("—")
                    continue
                ratios = " / ".join(f"{t / p[k]:.2f}" if p.get(k) else "—" for p in (fi, sd))
                cells.append(f"{t:.0f} ({ratios})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _bench_main(ns) -> int:
    from benchmarks.explore_common import Log, kill_child
    from benchmarks.prefill_explore import PagedBatch, bench_us, compare, sdpa_fns
    from benchmarks.prefill_explore_gluon import CONFIGS as PLAIN_CONFIGS
    from benchmarks.prefill_explore_gluon import _prefill_new_kernel
    from benchmarks.prefill_explore_gluon import launch_args as plain_launch_args

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU (sm_90); --compile-only runs anywhere")
        return 2
    log = Log(str(Path(ns.out).with_suffix(".log")) if ns.out else None)
    faulthandler.dump_traceback_later(ns.budget_s, exit=True)  # a hang here (not in a probe) still ends the run
    configs = [CONFIGS[i] for i in ns.configs] if ns.configs else CONFIGS
    if ns.quick:
        configs = configs[:1]
    sweep = _Sweep(ns, log)
    sweep.result["meta"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "triton": triton.__version__, "shapes": ns.shapes, "heads": [HQ, HKV], "head_size": D,
                            "configs": {config_label(c): c for c in configs}}
    log(f"{sweep.result['meta']}")
    fi_proc = None
    if not ns.no_flashinfer:
        fi_proc = sweep._spawn(["--warm-flashinfer"], "flashinfer warm-up")

    log(f"== probes (compile, float32 reference on lengths {CHECK_LENGTHS}, one launch per shape)")
    verdicts = sweep.probe(sorted(configs, key=lambda c: (c["pingpong"], c["persistent"])))  # simplest first
    sweep.result["probes"] = verdicts
    passing = [c for c in configs if verdicts.get(config_label(c), {}).get("status") == "ok"]
    for c in configs:
        v = verdicts.get(config_label(c), {})
        rel = f"rel {v['rel']:.2e}" if "rel" in v else ""
        log(f"  {config_label(c):34s} {v.get('status')} {v.get('error', '')} {rel}")

    log("== timings (do_bench median), checked against SDPA's output")
    batches = {shape: PagedBatch([(shape[1], 0)] * shape[0]) for shape in sweep.shapes}
    refs = {}
    for shape, b in batches.items():
        best = None
        for name, (fn, holder) in sdpa_fns(b).items():
            try:
                fn()
                torch.cuda.synchronize()
                us = bench_us(fn)
                if best is None or us < best[0]:
                    best = (us, holder["o"])
            except Exception as e:  # noqa: BLE001
                log(f"  {name} {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
        if best is not None:
            sweep.add_time("sdpa", shape, best[0], b.flops(), "(best of gqa / expanded)")
            refs[shape] = best[1].transpose(1, 2).reshape(b.num_tokens, b.num_heads, b.head_size)

    def check(shape, out) -> tuple[bool, str]:
        if shape not in refs:
            return True, "(no reference)"
        mad, rel = compare(out, refs[shape])
        return rel < REL_TOL, f"max|diff| {mad:.2e} rel {rel:.2e}" + ("" if rel < REL_TOL else "  ** WRONG **")

    plain_cfg = PLAIN_CONFIGS[0]
    kernels = [(f"gluon_plain n{plain_cfg['block_n']} buf{plain_cfg['nbuf']}", None)] + [
        (f"gluon_{config_label(c)}", c) for c in passing]
    for name, cfg in kernels:
        for shape, b in batches.items():
            try:
                k, v = b.new_kv()
                out = torch.full_like(b.query, float("nan"))
                if cfg is None:
                    fn = _launcher(_prefill_new_kernel, *plain_launch_args(b.query, k, v, out, b.qsl, shape[1],
                                                                           b.scale, **plain_cfg))
                else:
                    fn = _ws_fn(cfg, b.query, k, v, out, b.qsl, shape[1], b.scale)
                fn()
                torch.cuda.synchronize()
                ok, msg = check(shape, out)
                if ok:
                    sweep.add_time(name, shape, bench_us(fn), b.flops(), msg)
                else:
                    log(f"  {name} {shape}: {msg}; not timed")
            except Exception as e:  # noqa: BLE001 - one failing config must not stop the sweep
                log(f"  {name} {shape}: error {type(e).__name__}: {str(e)[:300]}")
        sweep.write()

    if fi_proc is not None:
        log("== flashinfer ragged prefill")
        try:
            rc = fi_proc.wait(timeout=max(5.0, ns.flashinfer_wait_s))
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            kill_child(fi_proc)
            rc = "timeout"
        if rc != 0:
            log(f"  flashinfer warm-up ended with {rc}: no FlashInfer column")
        else:
            for shape, b in batches.items():
                try:
                    k, v = b.new_kv()
                    fn, holder = _flashinfer_ragged(b.query, k, v, b.qsl, b.scale)
                    fn()
                    torch.cuda.synchronize()
                    sweep.add_time("flashinfer_ragged", shape, bench_us(fn), b.flops(), check(shape, holder["o"])[1])
                except Exception as e:  # noqa: BLE001
                    log(f"  flashinfer {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
    sweep.write()
    faulthandler.cancel_dump_traceback_later()
    log("\n" + sweep.table())
    if ns.out:
        log(f"\nresults: {ns.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results (the log goes next to it, .log)")
    ap.add_argument("--shapes", default=SHAPES, help="BxL,... (32 q heads, 8 kv heads, head 128, bf16)")
    ap.add_argument("--configs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="indices into CONFIGS (default: all)")
    ap.add_argument("--quick", action="store_true", help="the first config only")
    ap.add_argument("--compile-only", action="store_true", help="sm_90 compile report, no GPU needed")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--probe-timeout-s", type=float, default=60.0,
                    help="per config (compile included; the first also pays the child's start-up)")
    ap.add_argument("--probe-budget-s", type=float, default=300.0, help="no new probe child after this")
    ap.add_argument("--flashinfer-wait-s", type=float, default=150.0, help="for its JIT warm-up, after the sweep")
    ap.add_argument("--budget-s", type=float, default=560.0, help="the parent's hang guard (faulthandler)")
    ap.add_argument("--probe-configs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-flashinfer", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.compile_only:
        configs = [CONFIGS[i] for i in ns.configs] if ns.configs else CONFIGS
        for cfg in configs:
            print(json.dumps(compile_report(**cfg)), flush=True)
        return 0
    if ns.probe_configs:
        return _probe_main(ns)
    if ns.warm_flashinfer:
        return _warm_flashinfer_main(ns)
    return _bench_main(ns)


if __name__ == "__main__":
    raise SystemExit(main())
