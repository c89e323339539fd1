"""Hopper MLA decode in Gluon: the split-KV decode of :mod:`.decode_kernel` with both products split across two
warpgroups, for 16-bit latent caches on compute capability 9.0.

Plain Triton lays a [64 heads, keys] score tile out with its rows across all 8 warps, so each warpgroup computes
the whole Q.K^T of a tile to feed its half of P.V. Gluon names the layouts, so here (FlashMLA's split):

- scores S [64 rows, BLOCK_N keys]: warps [4, 2], each warpgroup computes Q.K^T for half of the keys; the row max
  and sum cross the warpgroups;
- output O [64 rows, Lkv]: warps [4, 2], each warpgroup owns Lkv / 2 columns in registers;
- P [64, BLOCK_N] goes through shared memory (each warpgroup needs every key's probability for its columns);
- one page-aligned tile [BLOCK_N, Lkv] + [BLOCK_N, R] arrives by TMA into NBUF buffers tracked by mbarriers; the
  latent part serves as K (a transposed view) and as V;
- the tiles past the keys every row sees (the partial last tile; with several query tokens, the tiles each row
  sees in part) are read through masked pointer loads (rows past a sequence's end may hold anything, NaN included,
  and must read as zero for P.V) and masked per row.

Grid, rows, splits, outputs and the log-sum-exp of a split are exactly those of :func:`_mla_decode_tma_kernel`
(:func:`.decode_kernel.mla_decode` launches either and reduces the splits the same way). Tree verification runs on
the Triton kernels. Gluon does not run under the interpreter: the GPU tests check this kernel against the oracle.

A page id outside the cache is read as page 0 (the page guard reports it).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HOPPER_BLOCK_H", "HOPPER_BLOCK_N", "gluon_available", "hopper_decode_applies", "hopper_descriptors",
           "launch_hopper_decode"]

HOPPER_BLOCK_H = 64  # rows per program: one wgmma M tile
HOPPER_BLOCK_N = 64  # keys per tile
HOPPER_NBUF = 2  # tiles in flight (two 64 x 576 16-bit tiles, Q, P: the shared memory of one SM)
HOPPER_NUM_WARPS = 8
HOPPER_TAIL_ROWS = 16  # keys per pointer-load chunk of a partially visible tile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    _GLUON_IMPORT_ERROR = None
except ImportError as exc:  # a Triton without Gluon: the Triton kernels serve every GPU
    _GLUON_IMPORT_ERROR = exc


def gluon_available() -> bool:
    """Whether the installed Triton ships Gluon's Hopper language (``triton.experimental.gluon``)."""
    return _GLUON_IMPORT_ERROR is None


def hopper_decode_applies(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, tree: bool) -> bool:
    """Whether this kernel serves these inputs: a CUDA device of compute capability 9.0 (wgmma), Gluon installed, a
    16-bit cache in the query dtype whose pages are contiguous rows of Lkv + R elements and hold whole tiles, Lkv a
    power of two up to 512 (each warpgroup's half is one wgmma N), R a power of two up to 256, no tree mask."""
    if tree or not gluon_available() or not kv_cache.is_cuda:
        return False
    if torch.cuda.get_device_capability(kv_cache.device) != (9, 0):
        return False
    kv_lora, rope = q_nope.shape[-1], q_pe.shape[-1]
    num_blocks, page, width = kv_cache.shape
    if kv_cache.dtype not in (torch.float16, torch.bfloat16) or not kv_cache.dtype == q_nope.dtype == q_pe.dtype:
        return False
    if kv_lora & (kv_lora - 1) or not 32 <= kv_lora <= 512 or rope & (rope - 1) or not 16 <= rope <= 256:
        return False
    if width != kv_lora + rope or page % HOPPER_BLOCK_N:
        return False
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) != page * width:
        return False
    return q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1


def hopper_descriptors(kv_cache: torch.Tensor, kv_lora: int) -> tuple[Any, Any]:
    """TMA descriptors over ``kv_cache`` [num_blocks, block_size, Lkv + R] viewed as rows: (latent [BLOCK_N, Lkv]
    boxes, rope [BLOCK_N, R] boxes). They depend on the cache only: build them once per cache."""
    num_blocks, page, width = kv_cache.shape
    rows = kv_cache.view(num_blocks * page, width)
    gdt = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    shape_kv, shape_pe = [HOPPER_BLOCK_N, kv_lora], [HOPPER_BLOCK_N, width - kv_lora]
    return (GluonTensorDescriptor.from_tensor(rows, shape_kv, gl.NVMMASharedLayout.get_default_for(shape_kv, gdt)),
            GluonTensorDescriptor.from_tensor(rows, shape_pe, gl.NVMMASharedLayout.get_default_for(shape_pe, gdt)))


def launch_hopper_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start, out, lse, stride_o_s: int,
                         num_splits: int, qk_scale_log2: float, max_query_len: int, grid, descriptors) -> None:
    """One launch over ``grid`` = (B, cdiv(H * max_query_len, 64), num_splits); arguments as the Triton TMA
    kernel's (``out``/``lse``: the output and LSE, or the split partials with ``stride_o_s``)."""
    kv_lora, rope = q_nope.shape[-1], q_pe.shape[-1]
    kv_desc, pe_desc = descriptors if descriptors is not None else hopper_descriptors(kv_cache, kv_lora)
    _mla_decode_hopper_kernel[grid](
        q_nope, q_pe, kv_desc, pe_desc, kv_cache, block_table, seq_lens, query_start, out,
        lse if lse is not None else seq_lens,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), kv_cache.shape[0],
        out.stride(0), out.stride(1), stride_o_s,
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        q_nope.shape[1], num_splits, qk_scale_log2,
        LKV=kv_lora, R=rope, PAGE=kv_cache.shape[1], BLOCK_H=HOPPER_BLOCK_H, BLOCK_N=HOPPER_BLOCK_N, NBUF=HOPPER_NBUF,
        STORE_LSE=lse is not None, MAX_Q=int(max_query_len), TAIL_ROWS=HOPPER_TAIL_ROWS,
        num_warps=HOPPER_NUM_WARPS,
    )


if gluon_available():

    @gluon.jit
    def _safe_page(page, num_blocks):
        return gl.where((page >= 0) & (page < num_blocks), page, 0)

    @gluon.jit
    def _issue_tile(kv_desc, pe_desc, bt_row, num_blocks, n0, buf, kv_bufs, pe_bufs, ready, LKV: gl.constexpr,
                    PAGE: gl.constexpr):
        """TMA the tile of keys [n0, n0 + BLOCK_N) (inside one page) into buffer ``buf``; ready[buf] completes when
        both boxes have landed."""
        row = _safe_page(gl.load(bt_row + n0 // PAGE), num_blocks) * PAGE + n0 % PAGE
        bar = ready.index(buf)
        mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv_bufs.index(buf))
        tma.async_copy_global_to_shared(pe_desc, [row, LKV], bar, pe_bufs.index(buf))

    @gluon.jit
    def _load_tail_rows(CACHE, bt_row, num_blocks, n0, end, stride_c_blk, stride_c_tok, dst, col0,
                        COLS: gl.constexpr, PAGE: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
        """Keys [n0, n0 + ROWS), cache columns [col0, col0 + COLS), into ``dst`` [ROWS, COLS] by pointer loads;
        keys at or past ``end`` read as zero."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        offs_n = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        n_ok = offs_n < end
        page = _safe_page(gl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0), num_blocks).to(gl.int64)
        row_ptr = CACHE + page * stride_c_blk + (offs_n % PAGE) * stride_c_tok + col0
        dst.store(gl.load(gl.expand_dims(row_ptr, 1) + gl.expand_dims(cols, 0),
                          mask=gl.expand_dims(n_ok, 1) & gl.expand_dims(cols < COLS, 0), other=0.0))

    @gluon.jit
    def _attend_tile(q_smem, qpe_smem, kv, pe, p_smem, o, l_i, m_i, s_zero, vis, qk_scale,
                     o_layout: gl.constexpr, MASKED: gl.constexpr):
        """One tile: S = [Q ; Q_pe] . [K ; K_pe]^T split along the keys, online softmax (log2 domain, the scale in
        the exp2's FMA; ``vis`` [BLOCK_H, BLOCK_N] the visible keys when MASKED, where a row may see none), P
        through shared memory, O += P . V split along the columns."""
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qpe_smem, pe.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if MASKED:
            s = gl.where(vis, s, gl.full_like(s, float("-inf")))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if MASKED:  # a row without visible keys so far keeps exp2 finite (its p and alpha are 0 and 1)
            m_use = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
        else:
            m_use = m_new
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use * qk_scale, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' halves of P are in shared memory
        o = warpgroup_mma(p_smem, kv, o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        gl.thread_barrier()  # every warp is done with this tile's buffers and with P
        return o, l_i, m_new

    @gluon.jit
    def _mla_decode_hopper_kernel(
        Q_NOPE, Q_PE,  # [T, H, LKV], [T, H, R] 16-bit
        kv_desc, pe_desc,  # TMA over CACHE as [num_blocks * PAGE, LKV + R]: boxes [BLOCK_N, LKV] and [BLOCK_N, R]
        CACHE,  # [num_blocks, PAGE, LKV + R]: the tiles past the fully visible ones are read through pointers
        BLOCK_TABLE, SEQ_LENS, QUERY_START,  # [B, W] int32, [B] int32, [B + 1] int32 (read when MAX_Q > 1)
        O, LSE,  # [T, H, (S,) LKV] output or float32 partials, [T, H(, S)] float32
        stride_q_t, stride_q_h, stride_qp_t, stride_qp_h,
        stride_c_blk, stride_c_tok, stride_bt, num_blocks,
        stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
        num_heads, num_splits,
        qk_scale,  # softmax scale * log2(e)
        LKV: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NBUF: gl.constexpr, STORE_LSE: gl.constexpr, MAX_Q: gl.constexpr, TAIL_ROWS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Grid (B, cdiv(H * MAX_Q, BLOCK_H), num_splits), 8 warps: request b's rows (query token, head) of one row
        block over one KV split; rows and positions as in ``_split_prologue`` of :mod:`.decode_kernel`."""
        gl.static_assert(num_warps == 8, "two warpgroups split every product")
        gl.static_assert(BLOCK_H == 64, "one wgmma M tile of rows")
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

        b = gl.program_id(0)
        hb = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(SEQ_LENS + b)
        if MAX_Q == 1:
            q_lo = b
            q_len = 1
        else:
            q_lo = gl.load(QUERY_START + b)
            q_len = gl.load(QUERY_START + b + 1) - q_lo
        all_end = seq_len - q_len + 1  # keys every row sees
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)
        if MAX_Q > 1:
            end = gl.where(hb * BLOCK_H < q_len * num_heads, end, start)  # row blocks past the tokens: no keys
            n_full = gl.maximum(gl.minimum(all_end, end) - start, 0) // BLOCK_N
        else:
            n_full = gl.maximum(end - start, 0) // BLOCK_N
        bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

        kv_bufs = gl.allocate_shared_memory(kv_desc.dtype, [NBUF, BLOCK_N, LKV], kv_desc.layout)
        pe_bufs = gl.allocate_shared_memory(pe_desc.dtype, [NBUF, BLOCK_N, R], pe_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()  # the barriers are initialised before the TMA unit sees them
        for i in gl.static_range(NBUF):  # the first tiles fly while the queries load
            if i < n_full:
                _issue_tile(kv_desc, pe_desc, bt_row, num_blocks, start + i * BLOCK_N, i, kv_bufs, pe_bufs, ready,
                            LKV, PAGE)

        # The rows' queries, staged in shared memory as the A operand of Q.K^T: row = token * H + head.
        rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, row_blk))
        cols = gl.arange(0, LKV, layout=gl.SliceLayout(0, row_blk))
        q_ptr = Q_NOPE + (q_lo + rows // num_heads).to(gl.int64) * stride_q_t + (rows % num_heads) * stride_q_h
        q = gl.load(gl.expand_dims(q_ptr, 1) + gl.expand_dims(cols, 0),
                    mask=gl.expand_dims(rows < q_len * num_heads, 1) & gl.expand_dims(cols < LKV, 0), other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LKV], q_sl, q)
        rows_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, pe_blk))
        cols_pe = gl.arange(0, R, layout=gl.SliceLayout(0, pe_blk))
        qpe_ptr = Q_PE + (q_lo + rows_pe // num_heads).to(gl.int64) * stride_qp_t + (rows_pe % num_heads) * stride_qp_h
        qpe = gl.load(gl.expand_dims(qpe_ptr, 1) + gl.expand_dims(cols_pe, 0),
                      mask=gl.expand_dims(rows_pe < q_len * num_heads, 1) & gl.expand_dims(cols_pe < R, 0), other=0.0)
        qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R], qpe_sl, qpe)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_sl)
        fence_async_shared()
        gl.thread_barrier()

        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([BLOCK_H, LKV], gl.float32, layout=o_layout)
        no_mask = s_zero == 0.0  # unused by unmasked tiles
        for i in range(n_full):
            buf = i % NBUF
            mbarrier.wait(ready.index(buf), (i // NBUF) & 1)
            o, l_i, m_i = _attend_tile(q_smem, qpe_smem, kv_bufs.index(buf), pe_bufs.index(buf), p_smem, o, l_i,
                                       m_i, s_zero, no_mask, qk_scale, o_layout, False)
            if i + NBUF < n_full:
                _issue_tile(kv_desc, pe_desc, bt_row, num_blocks, start + (i + NBUF) * BLOCK_N, buf, kv_bufs,
                            pe_bufs, ready, LKV, PAGE)
        for i in gl.static_range(NBUF):
            mbarrier.invalidate(ready.index(i))

        # The partial last tile, and with several query tokens the tiles each row sees in part: pointer loads into
        # buffer 0 (no copy is in flight any more), keys past the end read as zero, then masked per row.
        rows_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        pos = seq_len - q_len + rows_s // num_heads
        for n0 in range(start + n_full * BLOCK_N, end, BLOCK_N):
            for c in gl.static_range(BLOCK_N // TAIL_ROWS):  # row chunks: a whole tile's pointers would spill
                _load_tail_rows(CACHE, bt_row, num_blocks, n0 + c * TAIL_ROWS, end, stride_c_blk, stride_c_tok,
                                kv_bufs.index(0).slice(c * TAIL_ROWS, TAIL_ROWS), 0, LKV, PAGE, TAIL_ROWS, num_warps)
                _load_tail_rows(CACHE, bt_row, num_blocks, n0 + c * TAIL_ROWS, end, stride_c_blk, stride_c_tok,
                                pe_bufs.index(0).slice(c * TAIL_ROWS, TAIL_ROWS), LKV, R, PAGE, TAIL_ROWS, num_warps)
            fence_async_shared()
            gl.thread_barrier()
            keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            vis = gl.expand_dims(keys < end, 0) & (gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1))
            o, l_i, m_i = _attend_tile(q_smem, qpe_smem, kv_bufs.index(0), pe_bufs.index(0), p_smem, o, l_i, m_i,
                                       s_zero, vis, qk_scale, o_layout, True)

        # Epilogue: the split's LSE (natural log, -inf without keys) and its normalised output.
        has_keys = l_i > 0.0
        l_safe = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
        valid_s = rows_s < q_len * num_heads
        tok_s = (q_lo + rows_s // num_heads).to(gl.int64)
        if STORE_LSE:
            lse = gl.where(has_keys, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453,
                           gl.full_like(l_i, float("-inf")))
            gl.store(LSE + tok_s * stride_lse_t + (rows_s % num_heads) * stride_lse_h + split, lse, mask=valid_s)
        inv = gl.where(has_keys, 1.0 / l_safe, gl.zeros_like(l_i))
        out = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), 1)
        rows_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, LKV, layout=gl.SliceLayout(0, o_layout))
        o_ptr = (O + (q_lo + rows_o // num_heads).to(gl.int64) * stride_o_t + (rows_o % num_heads) * stride_o_h
                 + split * stride_o_s)
        gl.store(gl.expand_dims(o_ptr, 1) + gl.expand_dims(cols_o, 0), out.to(O.dtype.element_ty),
                 mask=gl.expand_dims(rows_o < q_len * num_heads, 1) & gl.expand_dims(cols_o < LKV, 0))
