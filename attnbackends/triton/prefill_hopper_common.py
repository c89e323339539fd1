"""The code the two warp-specialised Gluon Hopper prefill kernels share: :mod:`.prefill_hopper` (fresh
prompts, keys with the forward) and :mod:`.prefill_hopper_paged` (every key from the cache's pages). Both run the
work order, the shared-memory stages and barriers, the ping-pong turns and the consumer warpgroups described in
:mod:`.prefill_hopper`'s docstring; their loaders (and the fresh kernel's cache writer) differ and stay in their
modules.

One body serves both through constexpr switches, each off in the fresh kernel, whose code is then as if the switch
did not exist:

- ``PAGED`` (the paged kernel passes its sequence lengths): a sequence has ``ctx = seq_len - query_len`` cached
  keys before its queries (row i sits at position ``ctx + i``), and the value rows of an item's last tile past
  ``seq_len`` are zeroed before its P.V (the paged loader fills them from the sequence's last page again);
- ``WINDOW``, ``SOFTCAP``, ``SINKS``: the paged kernel's options (its module docstring).

Pointers a kernel does not have (the fresh kernel's sequence lengths and sinks) are passed as None.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..compat import gluon_available

__all__ = ["hopper_device_reason", "launch_plan"]


def hopper_device_reason(compute_capability: "tuple[int, int] | None", interpreted: bool, has_gluon: bool) -> str:
    """Why a device of ``compute_capability`` (None: not a CUDA device) cannot run the kernels ("" if it can):
    compute capability 9.0 (wgmma, setmaxnreg), not under the Triton interpreter, Gluon installed (``has_gluon``:
    the caller's own check, which its tests replace)."""
    if interpreted:
        return "the Triton interpreter (Gluon compiles for the GPU only)"
    if compute_capability != (9, 0):
        return "compute capability is not 9.0"
    if not has_gluon:
        return "triton.experimental.gluon is not installed"
    return ""


def launch_plan(kernel: Any, args_of: Callable[..., tuple], plan: Any, output: torch.Tensor,
                *args: Any) -> torch.Tensor:
    """Launch ``kernel`` as ``plan`` says (nothing for an empty grid) with the (grid, args, kwargs) of
    ``args_of(plan, *args)``, on ``output``'s device (a JIT launch goes to the current device's stream); returns
    ``output``."""
    if plan.grid[0] <= 0:
        return output
    grid, kernel_args, kwargs = args_of(plan, *args)
    device = output.device
    if device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[grid](*kernel_args, **kwargs)
    else:
        kernel[grid](*kernel_args, **kwargs)
    return output


if gluon_available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ: gl.constexpr, BLOCK_M: gl.constexpr,
                   SEQ_LENS=None):
        """This program's item of round r -> (head, sequence, first query token of the sequence, query length,
        cached tokens before its queries (``SEQ_LENS`` [num_seqs] minus the query length; 0 without ``SEQ_LENS``),
        first row of the query tile, whether there is work). Items run head fastest (the query heads of one KV head
        side by side), then sequence, then query block from the last (heaviest) down; round r gives item r * P + p
        to program p of P, in reverse order on odd rounds (a snake: the programs that got the heavier item of one
        round get the lighter one of the next). Past the last item, or a tile that starts past its sequence's end,
        there is no work."""
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
        if SEQ_LENS is None:
            ctx = 0
        else:
            ctx = gl.load(SEQ_LENS + seq) - q_len
        m0 = qb * BLOCK_M
        return h, seq, start, q_len, ctx, m0, (w < num_items) & (m0 < q_len)

    @gluon.jit
    def _key_tiles(ctx, q_len, m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WINDOW: gl.constexpr):
        """The key tiles of a work item (query rows m0 .. m0 + BLOCK_M - 1 after ``ctx`` cached tokens): (the first,
        the one past the last). They end at the query tile's causal diagonal; with a window they start at the tile
        of the first row's first visible key."""
        j_end = gl.cdiv(ctx + gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
        if WINDOW > 0:
            j0 = gl.maximum(ctx + m0 - WINDOW + 1, 0) // BLOCK_N
        else:
            j0 = 0
        return j0, j_end

    @gluon.jit
    def _stage_buffers(q_desc, k_desc, v_desc, o_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD: gl.constexpr, NBUF: gl.constexpr, EPI_TMA: gl.constexpr):
        """Shared memory: (Q [BLOCK_M, HEAD], K and V stages [NBUF, BLOCK_N, HEAD], O staging [BLOCK_M, HEAD]), in
        the descriptors' layouts; without ``EPI_TMA`` the O staging is Q's buffer, never written (the masked pointer
        stores need no staging)."""
        gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 query rows each")
        gl.static_assert(BLOCK_M % BLOCK_N == 0, "a query tile ends on a key tile boundary")
        gl.static_assert(NBUF >= 2, "the next tile flies while this one is read")
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], v_desc.layout)
        if EPI_TMA:
            o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], o_desc.layout)
        else:
            o_smem = q_smem
        return q_smem, k_bufs, v_bufs, o_smem

    @gluon.jit
    def _alloc_barriers(NBUF: gl.constexpr):
        """The loader's and consumers' barriers, not yet initialised (:func:`_init_barriers`): (q_ready, q_empty,
        k_ready, v_ready, k_empty, v_empty [NBUF], turn [2]). A kernel allocates its own barriers before it
        initialises any: a barrier's shared memory is then never reused by one allocated after it (a barrier no
        partition waits on, such as ``turn`` without ping-pong, is dead once initialised)."""
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        return q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn

    @gluon.jit
    def _init_barriers(q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, NBUF: gl.constexpr):
        """The arrival counts of :func:`_alloc_barriers`' barriers (their parities: :mod:`.prefill_hopper`'s
        docstring). The caller fences them for the async proxy once its own barriers are initialised too."""
        mbarrier.init(q_ready, count=1)  # the loader's expect-tx arrival (+ the TMA bytes)
        mbarrier.init(q_empty, count=2)  # both consumers' last Q.K^T of the item is complete
        for s in gl.static_range(NBUF):
            mbarrier.init(k_ready.index(s), count=1)  # the loader's expect-tx of the tile
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=2)  # both consumers release the stage
            mbarrier.init(v_empty.index(s), count=2)
        for s in gl.static_range(2):
            mbarrier.init(turn.index(s), count=1)  # the other consumer's arrival

    @gluon.jit
    def _load_q(q_desc, q_smem, q_ready, q_empty, i, start, m0, h, HEAD: gl.constexpr):
        """The loader: TMA head h's query rows start + m0 .. + BLOCK_M - 1 into ``q_smem`` once both consumers are
        done with the previous item's (``i``: items this program has loaded before)."""
        mbarrier.wait(q_empty, (i & 1) ^ 1)
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + m0, h * HEAD], q_ready, q_smem)

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
    def _tanh(x, MODE: gl.constexpr):
        """tanh(x / k) for the SOFTCAP mode ``MODE`` (:data:`.prefill_hopper_paged.SOFTCAP_TANH`; k = 1 for the
        hardware tanh, 2 log2(e) for the exp2-based one: :func:`.prefill_hopper_paged._tanh_input_scale`); +-1 at
        +-inf."""
        if MODE == 1:
            return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                             is_pure=True, pack=1)
        else:
            return 1.0 - 2.0 / (gl.exp2(x) + 1.0)

    @gluon.jit
    def _scores(s, j, pos0, n_unmasked, n_left, cap_in, s_layout: gl.constexpr, ROWS: gl.constexpr,
                BLOCK_N: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
        """The score tile j of rows at positions pos0 .. pos0 + ROWS - 1: soft-capped (tanh of the scaled score: the
        exponent scale holds the cap), keys above the diagonal or left of the window at -inf (tiles j < n_unmasked
        and >= n_left pass unmasked)."""
        if SOFTCAP:
            s = _tanh(s * cap_in, SOFTCAP)
        masked = j >= n_unmasked
        if WINDOW > 0:
            masked = masked | (j < n_left)
        if masked:
            pos = pos0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1)
            if WINDOW > 0:
                keep = keep & (gl.expand_dims(keys, 0) > gl.expand_dims(pos, 1) - WINDOW)
            s = gl.where(keep, s, gl.full_like(s, float("-inf")))
        return s

    @gluon.jit
    def _softmax_step(s, l_i, m_i, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr, WINDOW: gl.constexpr):
        """Online softmax step of a score tile (log2 domain, the scale in the exp2's FMA): (P as the A operand of
        P.V, l_i, m_new, alpha). With a window a row may have seen no key yet (max -inf): its exponents then use 0
        in place of the max."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if WINDOW > 0:
            m_use = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
        else:
            m_use = m_new
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use * qk_scale, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(dtype), p_layout), l_i, m_new, alpha

    @gluon.jit
    def _zero_value_tail(buf, first, HEAD: gl.constexpr, BLOCK_N: gl.constexpr):
        """Rows ``first`` .. BLOCK_N - 1 of a value tile in shared memory ``buf`` [BLOCK_N, HEAD] to zero (they
        hold the sequence's last page again, or slots past its end: anything, NaN included, and they enter P.V with
        weight 0). Both consumer warpgroups run it on the same stage: they write the same bits (zeros, or a valid
        row's own value), so neither disturbs the other's P.V. In pieces of 8 rows x 64 columns (one swizzle atom
        of 16-bit values; 4 values per thread); the writes are fenced for wgmma and the warpgroup synchronised."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        for ch in gl.static_range(BLOCK_N // 8):
            if ch * 8 + 8 > first:
                keep = gl.expand_dims(ch * 8 + rows < first, 1) & gl.expand_dims(cols >= 0, 0)
                for c0 in gl.static_range(0, HEAD, 64):
                    piece = buf.slice(ch * 8, 8).slice(c0, 64, dim=1)
                    vals = piece.load(layout)
                    piece.store(gl.where(keep, vals, gl.zeros_like(vals)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _attend(q, k_bufs, v_bufs, q_empty, k_ready, v_ready, k_empty, v_empty, turn, pos0, j0, nt, it, t, seq_len,
                qk_scale, cap_in, WG: gl.constexpr, HEAD: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                PINGPONG: gl.constexpr, PAGED: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
        """One warpgroup's 64 query rows at positions pos0 .. pos0 + 63 against key tiles j0 .. j0 + nt - 1 of a
        sequence of ``seq_len`` keys: (O unnormalised [64, HEAD] float32, row sums [64], row maxima [64]). ``it``:
        the program's running tile count before this item (stage and parity of every tile), ``t``: its running
        turn count (nt + 1 turns per item)."""
        ROWS: gl.constexpr = 64
        dtype: gl.constexpr = q.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        if PAGED:
            n_unmasked = (pos0 + 1) // BLOCK_N  # tiles whose last key is <= pos0: below every row's diagonal
        else:
            n_unmasked = pos0 // BLOCK_N  # the same: with no cached context pos0 is a multiple of 64
        n_left = gl.cdiv(pos0 + ROWS - WINDOW, BLOCK_N)  # (window) tiles from here on hold no key left of it

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
        s = _scores(s, j0, pos0, n_unmasked, n_left, cap_in, s_layout, ROWS, BLOCK_N, WINDOW, SOFTCAP)
        p, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype, WINDOW)
        for jj in range(1, nt):
            g = it + jj
            buf = g % NBUF
            prev = (g - 1) % NBUF
            mbarrier.wait(k_ready.index(buf), (g // NBUF) & 1)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // NBUF) & 1)
            _turn_wait(turn, t + jj, WG, PINGPONG)
            s_tok = warpgroup_mma(q, k_bufs.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p, v_bufs.index(prev), o, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # wgmma groups retire in order: S_j is done
            mbarrier.arrive(k_empty.index(buf), count=1)
            s = _scores(s, j0 + jj, pos0, n_unmasked, n_left, cap_in, s_layout, ROWS, BLOCK_N, WINDOW, SOFTCAP)
            p_next, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype, WINDOW)
            o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))  # P_{j-1} lives until P.V is done
            mbarrier.arrive(v_empty.index(prev), count=1)
            p = p_next
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        mbarrier.arrive(q_empty, count=1)  # every Q.K^T of the item is complete: the loader may bring the next Q
        last = (it + nt - 1) % NBUF
        mbarrier.wait(v_ready.index(last), ((it + nt - 1) // NBUF) & 1)
        if PAGED:
            tail = seq_len - (j0 + nt - 1) * BLOCK_N  # valid keys of the last tile (only it reaches past the end)
            if tail < BLOCK_N:
                _zero_value_tail(v_bufs.index(last), tail, HEAD, BLOCK_N)
        _turn_wait(turn, t + nt, WG, PINGPONG)
        o_tok = warpgroup_mma(p, v_bufs.index(last), o, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(v_empty.index(last), count=1)
        return o, l_i, m_i

    @gluon.jit
    def _consumer_partition(q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn, o_desc, O, QSL, SEQ_LENS, SINK, stride_o_t, num_seqs, num_q_blocks, num_items,
                            qk_scale, cap_in, WG: gl.constexpr, HQ: gl.constexpr, HEAD: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                            PINGPONG: gl.constexpr, EPI_TMA: gl.constexpr, WINDOW: gl.constexpr,
                            SOFTCAP: gl.constexpr, SINKS: gl.constexpr):
        """One consumer warpgroup: rows r0 = m0 + 64 * WG .. r0 + 63 of each work item's query tile; normalises
        them (with the head's sink logit where ``SINKS``) and stores them (masked pointer stores, or a TMA store
        staged in ``o_smem`` when all 64 rows are valid). ``SEQ_LENS``: the paged kernel's sequence lengths (keys
        from pages, ``PAGED``), None in the fresh kernel."""
        ROWS: gl.constexpr = 64
        PAGED: gl.constexpr = SEQ_LENS is not None
        dtype: gl.constexpr = q_smem.dtype
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD, 16])
        q = q_smem.slice(WG * ROWS, ROWS, dim=0)
        o_stage = o_smem.slice(WG * ROWS, ROWS, dim=0)
        it = 0
        i = 0
        for r in range(gl.cdiv(num_items, gl.num_programs(0))):
            h, _, start, q_len, ctx, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ, BLOCK_M,
                                                               SEQ_LENS)
            j0, j_end = _key_tiles(ctx, q_len, m0, BLOCK_M, BLOCK_N, WINDOW)
            if has_work:
                r0 = m0 + WG * ROWS
                nt = j_end - j0
                mbarrier.wait(q_ready, i & 1)
                o, l_i, m_i = _attend(q, k_bufs, v_bufs, q_empty, k_ready, v_ready, k_empty, v_empty, turn, ctx + r0,
                                      j0, nt, it, it + i, ctx + q_len, qk_scale, cap_in, WG, HEAD, BLOCK_N, NBUF,
                                      PINGPONG, PAGED, WINDOW, SOFTCAP)
                it += nt
                i += 1

                if SINKS:  # the sink's weight exp(sink - max) joins the denominator; max over both, no overflow
                    sink = gl.load(SINK + h).to(gl.float32) * 1.4426950408889634
                    mq = m_i * qk_scale
                    mf = gl.maximum(mq, sink)
                    a = gl.exp2(mq - mf)
                    inv_rows = a / (l_i * a + gl.exp2(sink - mf))
                else:
                    inv_rows = 1.0 / l_i
                inv = gl.convert_layout(inv_rows, gl.SliceLayout(1, o_layout))
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
