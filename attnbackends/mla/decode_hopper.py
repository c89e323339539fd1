"""Hopper MLA decode in Gluon: the split-KV decode of :mod:`.decode_kernel` for 16-bit and fp8 (e4m3) latent caches
on compute capability 9.0, warp-specialised as FlashInfer's and FlashMLA's Hopper kernels are.

Plain Triton lays a [64 heads, keys] score tile out with its rows across all 8 warps, so each warpgroup computes
the whole Q.K^T of a tile to feed its half of P.V. Gluon names the layouts and the partitions. One program (rows =
(query token, head) pairs of one request, one KV split) runs three partitions over NBUF stages of shared memory:

- **softmax** (the default partition, one warpgroup): the rows' queries into shared memory once; per tile the whole
  64 x 64 score tile [Q ; Q_pe] . [K ; K_pe]^T, the keys each row sees, the online softmax (log2 domain, the scale
  in the exp2's FMA), P published over the tile's rope-key slot (dead once the scores are done) with the rows'
  rescale alpha, then O[:, Lkv/2:] += P . V with P from registers; at the end the row sums for the other half,
  the LSE and its half of the output;
- **P.V** (one warpgroup): per tile O[:, :Lkv/2] = alpha * O + P . V with P from shared memory;
- **loader** (one warp): one page-aligned tile [64, Lkv] + [64, R] per stage by TMA once both consumers released
  the stage.

16-bit caches. Shared memory at Lkv 512: 2 stages x [64, 576] (147 KB) + Q, Q_pe [64, 576] (74 KB). Barriers (tile
j in stage s = j % NBUF, phase (j // NBUF) & 1): the loader waits kv_empty[s] (two arrivals: both consumers),
expects the bytes and copies onto kv_ready[s]; softmax waits kv_ready[s], publishes P and alpha and arrives
p_ready[s]; P.V waits kv_ready[s] and p_ready[s]; both arrive kv_empty[s] after their P.V. P and alpha of stage s
are rewritten only for tile j + NBUF, which needs both releases of tile j. The row sums go through l_ready.

fp8 e4m3 caches (queries fp16 / bf16; read as stored * k_scale). wgmma reads 16-bit operands, so each tile is
widened in shared memory, exactly (every e4m3 value is a bf16 and an fp16 value), into ONE converted 16-bit tile
[64, Lkv] + [64, R] that both consumers read, the two splitting the widening: the P.V worker its V columns
[0, Lkv/2) and the rope part, the softmax partition its columns [Lkv/2, Lkv). After a tile's scores each of these
regions is read by the partition that widens it alone (its V half; P over the rope slot: the worker), so a
partition may overwrite it for the next tile once its own P.V is done, and the handshake below is all the ordering
needed. 8 warps share the widening, which sits between one tile's P.V and the next tile's scores.
Shared memory at Lkv 512: 2 fp8 stages x [64, 576] (74 KB) + the converted tile (74 KB) + Q, Q_pe (74 KB): 221 KB.
The scale k_scale is in qk_scale (scores) and multiplies the output with 1 / l (v_scale). Barriers (tile j, stage
s = j % NBUF):

- kv_ready[s] (1 arrival + the TMA bytes; parity (j // NBUF) & 1): the loader's expect; both consumers wait;
- kv_empty[s] (2 arrivals; the loader waits parity ((j // NBUF) & 1) ^ 1): each consumer once its columns of the
  fp8 stage are widened (the stage is free long before the tile's P.V);
- conv_ready (1 arrival, parity j & 1): the P.V worker after widening its columns and the rope part of tile j; the
  softmax partition waits before the scores. The worker reaches tile j + 1's widening only after p_ready of tile j
  (so after tile j's scores: the columns and the rope slot it overwrites are dead) and after its own P.V of tile j;
- p_ready (1 arrival, parity j & 1): the softmax partition after P (over the converted rope slot) and alpha; the
  P.V worker waits. P and alpha of tile j + 1 are written after conv_ready of tile j + 1, which the worker arrives
  after its P.V of tile j has read them;
- l_ready (1 arrival, parity 0): the row sums, as for 16-bit caches.

e4m3 score products (``MLADecodeConfig.fp8_scores = "e4m3"``, constexpr FP8_QK): the softmax partition quantises
its rows' queries to e4m3 once, one scale per row over all Lkv + R columns (amax / 448), and the score tile is one
e4m3 wgmma (m64n64k32) straight from the fp8 stage, scaled back per row; P.V stays 16-bit on widened V. The
converted tile holds V only, each consumer widening the half its own P.V reads, and P moves to NBUF per-stage
buffers. Accuracy class: the queries' e4m3 rounding (3 mantissa bits) and sm_90's reduced-precision e4m3
accumulation; the GPU tests bound both. Shared memory at Lkv 512: 2 fp8 stages (74 KB) + converted V (64 KB) + 2 P
buffers (16 KB) + e4m3 queries (36 KB): 194 KB. Barriers (tile j, stage s = j % NBUF):

- kv_ready[s]: as above;
- kv_empty[s] (2 arrivals): the softmax partition after the scores and its widening of tile j, the P.V worker
  after its P.V of tile j (which reads P of stage s, rewritten for tile j + NBUF only after this release);
- p_ready[s] (1 arrival, parity (j // NBUF) & 1): the softmax partition after P and alpha of tile j;
- l_ready: as above.
Each half of the converted tile is written and read by one partition only, in program order: no barrier.

One body serves the three: ``_pipeline`` allocates the buffers and barriers a variant uses (None for the others),
and each partition chooses by the constexprs FP8 (fp8 pages) and FP8_QK (e4m3 score products) where it reads the
score operands, V and P and which of the barriers above a tile passes. P and alpha sit in P_BUFS slots, tile j in
slot j % P_BUFS with p_ready parity (j // P_BUFS) & 1: one slot for fp8 pages with 16-bit score products, one per
stage otherwise.

Widening (``_e4m3_to``): the byte sign-extended (prmt), shifted onto the 16-bit exponent and mantissa fields, masked,
and multiplied by the power of two that re-biases the exponent (exact, subnormals included): 2 integer and 2
FMA-pipe instructions per pair of values, where Triton's own conversion to bf16 goes through fp16 and a quarter-rate
F2F per value. An e4m3 NaN (never written by the cache writer for finite inputs) reads as +-480
(``HOPPER_FP8_BITS = False``: Triton's conversion, NaN kept).

The last, partial tile of a split is loaded by TMA as a whole page too: its score columns past the end are -inf,
and its V rows past the end, which may hold anything (NaN: 0 * NaN = NaN in P.V), are zeroed in shared memory by
each consumer for its own column half (16-bit: after the tile's scores; fp8: while widening). With several query
tokens each row sees keys up to its own position (causal); a row that sees no key of a split gets LSE -inf and a
zero output.

Grid, rows, splits and outputs are those of ``_mla_decode_tma_kernel`` (:func:`.decode_kernel.mla_decode`
launches either and reduces the splits the same way). Tree verification and other shapes run on the Triton
kernels. Gluon does not run under the interpreter: the GPU tests check this kernel against the oracle.

A page id outside the cache is read as page 0 (the page guard reports it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..compat import gluon_available
from ..ops.launch import DescriptorLauncher
from ..platform import DeviceInfo, is_triton_interpreted

__all__ = ["HOPPER_BLOCK_H", "HOPPER_BLOCK_N", "HOPPER_CONSTEXPRS", "gluon_available", "hopper_args",
           "hopper_constexprs", "hopper_decode_applies", "hopper_descriptors", "hopper_inputs_reason",
           "hopper_kernel", "hopper_launcher", "hopper_reason"]

HOPPER_BLOCK_H = 64  # rows per program: one wgmma M tile
HOPPER_BLOCK_N = 64  # keys per tile; P [64 rows, 64 keys] is published over the [64 keys, R = 64] rope slot
HOPPER_ROPE = 64
HOPPER_NBUF = 2  # stages: two [64, Lkv + R] tiles (16-bit) or fp8 tiles; Q, Q_pe (and the fp8 path's converted tile)
# fill the shared memory of one SM at Lkv 512
HOPPER_REGS = (232, 40)  # registers per thread of the P.V warpgroup and of the loader warp (setmaxnreg)
# fp8 pages are widened by bit placement and one exact power-of-two multiply (2 integer + 2 FMA-pipe instructions per
# pair of values; an e4m3 NaN reads as +-480); False: by Triton's conversion (cvt.rn.f16x2.e4m3x2, NaN kept, and on to
# bf16 by one F2F per value, a quarter-rate instruction on sm_90)
HOPPER_FP8_BITS = True
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor


def hopper_reason(kv_lora: int, rope: int, block_size: int, kv_cache_dtype: torch.dtype,
                  compute_capability: "tuple[int, int] | None") -> str:
    """Why the kernel cannot serve a layer ("" if it can): a 16-bit or fp8 e4m3 cache; Lkv a multiple of 128 up to
    512 (each warpgroup's half is one wgmma N of 64-column slices; 256 or 512 with fp8, converted in 128-column
    slices); R = 64; pages of whole 64-key tiles; compute capability 9.0 (wgmma, setmaxnreg); Gluon installed."""
    fp8 = kv_cache_dtype == torch.float8_e4m3fn
    if kv_cache_dtype not in _CACHE_DTYPES:
        name = str(kv_cache_dtype).removeprefix("torch.")
        return f"a {name} latent cache (needs float16, bfloat16 or float8_e4m3fn)"
    if fp8 and kv_lora not in (256, 512):
        return f"latent width {kv_lora} with an fp8 cache (needs 256 or 512)"
    if kv_lora % 128 or not 128 <= kv_lora <= 512:
        return f"latent width {kv_lora} (needs a multiple of 128 up to 512)"
    if rope != HOPPER_ROPE:
        return f"rope width {rope} (needs {HOPPER_ROPE})"
    if block_size % HOPPER_BLOCK_N:
        return f"page size {block_size} (not a multiple of {HOPPER_BLOCK_N})"
    if compute_capability != (9, 0):
        return "compute capability is not 9.0"
    if not gluon_available():
        return "triton.experimental.gluon is not installed"
    return ""


def hopper_inputs_reason(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, tree: bool,
                         compute_capability: "tuple[int, int] | None") -> str:
    """Why the kernel cannot serve these inputs on a device of ``compute_capability`` ("" if it can): no tree mask,
    a layer :func:`hopper_reason` admits, fp16/bf16 queries, a 16-bit cache in the query dtype or an fp8 e4m3
    cache, contiguous pages of Lkv + R wide rows. Device-free (:func:`hopper_decode_applies` adds the device)."""
    if tree:
        return "a tree mask"
    kv_lora, rope = q_nope.shape[-1], q_pe.shape[-1]
    num_blocks, page, width = kv_cache.shape
    why = hopper_reason(kv_lora, rope, page, kv_cache.dtype, compute_capability)
    if why:
        return why
    if q_nope.dtype != q_pe.dtype or q_nope.dtype not in (torch.float16, torch.bfloat16):
        return f"queries in {q_nope.dtype} / {q_pe.dtype} (needs one of float16, bfloat16)"
    if kv_cache.dtype != torch.float8_e4m3fn and kv_cache.dtype != q_nope.dtype:
        return f"a {kv_cache.dtype} cache with {q_nope.dtype} queries (a 16-bit cache is read in the query dtype)"
    if width != kv_lora + rope:
        return f"cache rows of {width} (needs Lkv + R = {kv_lora + rope})"
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) != page * width:
        return "a cache whose pages are not contiguous rows"
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1:
        return "queries without unit stride in the last dimension"
    return ""


def hopper_decode_applies(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, tree: bool) -> bool:
    """Whether this kernel serves these inputs: a CUDA cache and :func:`hopper_inputs_reason` finds nothing."""
    if is_triton_interpreted() or kv_cache.device.type != "cuda":
        return False
    return not hopper_inputs_reason(q_nope, q_pe, kv_cache, tree, DeviceInfo.current(kv_cache.device).compute_capability)


def hopper_descriptors(kv_cache: torch.Tensor, kv_lora: int) -> tuple[Any, Any]:
    """TMA descriptors over ``kv_cache`` [num_blocks, block_size, Lkv + R] (16-bit or fp8 e4m3) viewed as rows:
    (latent [64, Lkv] boxes, rope [64, R] boxes). They depend on the cache only: build them once per cache."""
    num_blocks, page, width = kv_cache.shape
    rows = kv_cache.view(num_blocks * page, width)
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[kv_cache.dtype]
    shape_kv, shape_pe = [HOPPER_BLOCK_N, kv_lora], [HOPPER_BLOCK_N, width - kv_lora]
    return (GluonTensorDescriptor.from_tensor(rows, shape_kv, gl.NVMMASharedLayout.get_default_for(shape_kv, gdt)),
            GluonTensorDescriptor.from_tensor(rows, shape_pe, gl.NVMMASharedLayout.get_default_for(shape_pe, gdt)))


#: The constexpr parameters of ``_mla_decode_hopper_kernel``, in signature order (``num_warps`` is one: a Gluon
#: kernel declares it).
HOPPER_CONSTEXPRS = ("LKV", "R", "PAGE", "BLOCK_H", "BLOCK_N", "NBUF", "STORE_LSE", "MAX_Q", "REGS_PV", "REGS_LOAD",
                     "FP8", "FP8_BITS", "FP8_QK", "num_warps")
HOPPER_NUM_WARPS = 4  # the default partition: one warpgroup


def hopper_constexprs(kv_lora: int, rope: int, page: int, store_lse: bool, max_query_len: int,
                      fp8: bool, e4m3_scores: bool = False) -> tuple:
    """The values of :data:`HOPPER_CONSTEXPRS` for one layer and batch. ``e4m3_scores``: an fp8 cache's score
    products in e4m3 (queries quantised per row), else in the queries' 16-bit dtype."""
    return (kv_lora, rope, page, HOPPER_BLOCK_H, HOPPER_BLOCK_N, HOPPER_NBUF, bool(store_lse), int(max_query_len),
            HOPPER_REGS[0], HOPPER_REGS[1], bool(fp8), HOPPER_FP8_BITS, bool(fp8 and e4m3_scores), HOPPER_NUM_WARPS)


def hopper_args(q_nope, q_pe, descriptors, block_table, seq_lens, query_start, out, lse, stride_o_s: int,
                num_blocks: int, num_splits: int, qk_scale_log2: float, v_scale: float) -> tuple:
    """The runtime arguments of ``_mla_decode_hopper_kernel`` in signature order, for a launch over
    (cdiv(H * max_query_len, 64), B, num_splits). ``out``/``lse``: the output and LSE (``lse`` None: none), or the
    split partials with ``stride_o_s``. An fp8 e4m3 cache is read as stored * k_scale: ``qk_scale_log2`` = scale *
    log2(e) * k_scale and ``v_scale`` = k_scale (16-bit caches: unused). ``descriptors``: :func:`hopper_descriptors`
    of the cache."""
    kv_desc, pe_desc = descriptors
    return (q_nope, q_pe, kv_desc, pe_desc, block_table, seq_lens, query_start, out,
            lse if lse is not None else seq_lens,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0), num_blocks,
            out.stride(0), out.stride(1), stride_o_s,
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            q_nope.shape[1], num_splits, float(qk_scale_log2), float(v_scale))


def hopper_launcher() -> Optional[DescriptorLauncher]:
    """The cached launcher of ``_mla_decode_hopper_kernel`` (None without Gluon)."""
    return _LAUNCHER


def hopper_kernel() -> Any:
    """The ``@gluon.jit`` kernel (for ahead-of-time compiles; None without Gluon)."""
    return _mla_decode_hopper_kernel if gluon_available() else None


if gluon_available():

    @gluon.jit
    def _safe_page(page, num_blocks):
        return gl.where((page >= 0) & (page < num_blocks), page, 0)

    @gluon.jit
    def _zero_rows_from(buf, nvalid, ROWS: gl.constexpr, COLS: gl.constexpr):
        """Rows >= nvalid of the shared [ROWS, COLS] view ``buf`` := 0, in 64-column slices (the 128-byte swizzle
        atom), by the 4 warps of the calling partition; the caller fences and syncs afterwards."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk)) < nvalid, 1)
        for c in gl.static_range(0, COLS, 64):
            part = buf.slice(c, 64, dim=1)
            x = part.load(blk)
            part.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _row_pointer(base, q_lo, rows, num_heads, stride_t, stride_h):
        """Row r = token * H + head of the program's request: base + (q_lo + r // H) * stride_t + (r % H) * stride_h."""
        return base + (q_lo + rows // num_heads).to(gl.int64) * stride_t + (rows % num_heads) * stride_h

    @gluon.jit
    def _load_queries(Q_NOPE, Q_PE, q_smem, qpe_smem, q_lo, q_len, hb, num_heads, stride_q_t, stride_q_h, stride_qp_t,
                      stride_qp_h, LKV: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr):
        """The rows' queries into shared memory in 64-column chunks (rows past the request's tokens: 0), visible to
        the calling warpgroup's wgmma on return."""
        q_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] chunks, 16-byte loads
        rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_blk))
        row_ok = gl.expand_dims(rows < q_len * num_heads, 1)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, q_blk))
        q_ptr = gl.expand_dims(_row_pointer(Q_NOPE, q_lo, rows, num_heads, stride_q_t, stride_q_h), 1)
        for c in gl.static_range(0, LKV, 64):
            q_smem.slice(c, 64, dim=1).store(gl.load(q_ptr + gl.expand_dims(c + cols, 0), mask=row_ok, other=0.0))
        qpe_ptr = gl.expand_dims(_row_pointer(Q_PE, q_lo, rows, num_heads, stride_qp_t, stride_qp_h), 1)
        for c in gl.static_range(0, R, 64):
            qpe_smem.slice(c, 64, dim=1).store(gl.load(qpe_ptr + gl.expand_dims(c + cols, 0), mask=row_ok, other=0.0))
        fence_async_shared()
        gl.thread_barrier()  # every warp's queries are in shared memory before the warpgroup's wgmma reads them

    @gluon.jit
    def _load_queries_e4m3(Q_NOPE, Q_PE, q8_smem, q8pe_smem, q_lo, q_len, hb, num_heads, stride_q_t, stride_q_h,
                           stride_qp_t, stride_qp_h, LKV: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr):
        """The rows' queries quantised to e4m3 into shared memory, one scale per row over all LKV + R columns
        (amax / 448: the largest magnitude lands on e4m3's largest finite value; rows past the request's tokens
        and zero rows: 0 with scale 1). Returns the row scales [BLOCK_H] (layout: the rows of a [BLOCK_H, 128]
        blocked tile); the queries are visible to the calling warpgroup's wgmma on return."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [64, 128] chunks, 16-byte loads
        pe_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64]
        rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, blk))
        row_ok = gl.expand_dims(rows < q_len * num_heads, 1)
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
        q_ptr = gl.expand_dims(_row_pointer(Q_NOPE, q_lo, rows, num_heads, stride_q_t, stride_q_h), 1)
        rows_pe = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, pe_blk))
        pe_ok = gl.expand_dims(rows_pe < q_len * num_heads, 1)
        cols_pe = gl.arange(0, R, layout=gl.SliceLayout(0, pe_blk))
        qpe_ptr = gl.expand_dims(_row_pointer(Q_PE, q_lo, rows_pe, num_heads, stride_qp_t, stride_qp_h), 1)
        q_pe = gl.load(qpe_ptr + gl.expand_dims(cols_pe, 0), mask=pe_ok, other=0.0).to(gl.float32)
        amax = gl.convert_layout(gl.max(gl.abs(q_pe), axis=1), gl.SliceLayout(1, blk))
        for c in gl.static_range(0, LKV, 128):
            x = gl.load(q_ptr + gl.expand_dims(c + cols, 0), mask=row_ok, other=0.0).to(gl.float32)
            amax = gl.maximum(amax, gl.max(gl.abs(x), axis=1))
        scale = gl.where(amax > 0.0, amax * (1.0 / 448.0), gl.full_like(amax, 1.0))
        inv = gl.expand_dims(1.0 / scale, 1)
        for c in gl.static_range(0, LKV, 128):
            x = gl.load(q_ptr + gl.expand_dims(c + cols, 0), mask=row_ok, other=0.0).to(gl.float32)
            q8_smem.slice(c, 128, dim=1).store((x * inv).to(gl.float8e4nv))
        inv_pe = gl.expand_dims(gl.convert_layout(1.0 / scale, gl.SliceLayout(1, pe_blk)), 1)
        q8pe_smem.store((q_pe * inv_pe).to(gl.float8e4nv))
        fence_async_shared()
        gl.thread_barrier()  # every warp's queries are in shared memory before the warpgroup's wgmma reads them
        return scale

    @gluon.jit
    def _softmax_state(hb, seq_len, q_len, num_heads, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
        """The softmax partition's loop state: (its rows [BLOCK_H], each row's last visible key [BLOCK_H, 1], the
        tile's key offsets [BLOCK_N], a zero score tile, its output half O [BLOCK_H, HALF] = 0, row maxima -inf,
        row sums 0), in the score tile's layout ``s_layout`` and the output's ``o_layout``."""
        rows_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        pos = gl.expand_dims(seq_len - q_len + rows_s // num_heads, 1)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
        return rows_s, pos, offs_n, s_zero, o, m_i, l_i

    @gluon.jit
    def _mask_scores(sc, keys, end, pos, MAX_Q: gl.constexpr):
        """-inf where key ``keys`` [1, BLOCK_N] lies past the split's end or (several query tokens) after the row's
        position ``pos`` [BLOCK_H, 1]."""
        if MAX_Q > 1:
            sc = gl.where((keys < end) & (keys <= pos), sc, gl.full_like(sc, float("-inf")))
        else:
            sc = gl.where(keys < end, sc, gl.full_like(sc, float("-inf")))
        return sc

    @gluon.jit
    def _online_softmax(sc, m_i, l_i, qk_scale, MAX_Q: gl.constexpr):
        """One tile of the online softmax in the log2 domain (the scale in the exp2's FMA): (P, the rows' rescale
        alpha of the earlier tiles, the new row maxima, the new row sums)."""
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        if MAX_Q > 1:  # a row that sees no key yet keeps exp2 finite (its p and alpha are 0 and 1)
            m_use = gl.where(m_new == float("-inf"), gl.zeros_like(m_new), m_new)
        else:
            m_use = m_new
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        p = gl.exp2(sc * qk_scale - gl.expand_dims(m_use * qk_scale, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _softmax_epilogue(o, m_i, l_i, rows_s, l_smem, l_ready, O, LSE, q_lo, q_len, hb, split, num_heads, stride_o_t,
                          stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, qk_scale, out_scale,
                          LKV: gl.constexpr, BLOCK_H: gl.constexpr, STORE_LSE: gl.constexpr):
        """The softmax partition's end: the row sums to the P.V worker, the LSE (natural log, -inf for rows without
        keys) and O[:, LKV/2:] * out_scale / l (0 without keys)."""
        HALF: gl.constexpr = LKV // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        l_smem.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(l_ready, count=1)

        has_keys = l_i > 0.0
        l_safe = gl.where(has_keys, l_i, gl.full_like(l_i, 1.0))
        if STORE_LSE:
            lse = gl.where(has_keys, (m_i * qk_scale + gl.log2(l_safe)) * 0.6931471805599453,
                           gl.full_like(l_i, float("-inf")))
            lse_ptr = _row_pointer(LSE, q_lo, rows_s, num_heads, stride_lse_t, stride_lse_h) + split
            gl.store(lse_ptr, lse, mask=rows_s < q_len * num_heads)
        inv = gl.where(has_keys, out_scale / l_safe, gl.zeros_like(l_i))
        out = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), 1)
        rows_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        cols_o = HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptr = _row_pointer(O, q_lo, rows_o, num_heads, stride_o_t, stride_o_h) + split * stride_o_s
        gl.store(gl.expand_dims(o_ptr, 1) + gl.expand_dims(cols_o, 0), out.to(O.dtype.element_ty),
                 mask=gl.expand_dims(rows_o < q_len * num_heads, 1) & gl.expand_dims(cols_o < LKV, 0))

    @gluon.jit
    def _pv_epilogue(o, l_smem, l_ready, O, q_lo, q_len, hb, split, num_heads, stride_o_t, stride_o_h, stride_o_s,
                     out_scale, LKV: gl.constexpr, BLOCK_H: gl.constexpr):
        """The P.V partition's end: O[:, :LKV/2] * out_scale / l with the row sums of the softmax partition."""
        HALF: gl.constexpr = LKV // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        mbarrier.wait(l_ready, 0)
        l_i = l_smem.load(gl.SliceLayout(1, o_layout))
        inv = gl.where(l_i > 0.0, out_scale / gl.where(l_i > 0.0, l_i, gl.full_like(l_i, 1.0)), gl.zeros_like(l_i))
        rows = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptr = _row_pointer(O, q_lo, rows, num_heads, stride_o_t, stride_o_h) + split * stride_o_s
        gl.store(gl.expand_dims(o_ptr, 1) + gl.expand_dims(cols, 0), (o * gl.expand_dims(inv, 1)).to(O.dtype.element_ty),
                 mask=gl.expand_dims(rows < q_len * num_heads, 1) & gl.expand_dims(cols < HALF, 0))

    # e4m3 (s eeee mmm, bias 7) as a 16-bit float with the same bits placed: the byte sign-extended to 16 bits
    # (prmt), shifted so that eeee mmm lands on the low exponent and top mantissa bits, the bits above masked off:
    # the value / 2^120 (bf16, bias 127) or / 2^8 (fp16, bias 15), subnormals included; one multiply by that power of
    # two is exact. Four values per call: $2 holds four bytes, $0 and $1 two 16-bit results each, in order.
    def _e4m3_asm(shift: int, mask: str, scale: str, mul: str) -> str:
        """The inline PTX for one 16-bit format: ``shift`` places eeee mmm, ``mask`` keeps sign, exponent and
        mantissa, ``mul`` (mul.rn.bf16x2 / mul.rn.f16x2) by ``scale`` (the power of two, twice) re-biases."""
        return f"""{{
        .reg .b32 lo, hi, sc;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, {shift};
        shl.b32 hi, hi, {shift};
        and.b32 lo, lo, {mask};
        and.b32 hi, hi, {mask};
        mov.b32 sc, {scale};
        {mul} $0, lo, sc;
        {mul} $1, hi, sc;
    }}"""

    _E4M3_TO_BF16_ASM: gl.constexpr = gl.constexpr(_e4m3_asm(4, "0x87F087F0", "0x7B807B80", "mul.rn.bf16x2"))
    _E4M3_TO_F16_ASM: gl.constexpr = gl.constexpr(_e4m3_asm(7, "0xBF80BF80", "0x5C005C00", "mul.rn.f16x2"))

    @gluon.jit
    def _e4m3_to(x, dtype: gl.constexpr, BITS: gl.constexpr):
        """The float8e4nv tensor ``x`` in ``dtype`` (bfloat16 / float16): exact for every finite e4m3 value. BITS:
        by bit placement (an e4m3 NaN reads as +-480); else Triton's conversion."""
        if BITS:
            if dtype == gl.bfloat16:
                y = gl.inline_asm_elementwise(_E4M3_TO_BF16_ASM, "=r,=r,r", [x], dtype=gl.bfloat16, is_pure=True,
                                              pack=4)
            else:
                y = gl.inline_asm_elementwise(_E4M3_TO_F16_ASM, "=r,=r,r", [x], dtype=gl.float16, is_pure=True,
                                              pack=4)
        else:
            y = x.to(dtype)
        return y

    @gluon.jit
    def _convert_cols(src, dst, nvalid, C0: gl.constexpr, NC: gl.constexpr, W: gl.constexpr, ROWS: gl.constexpr,
                      ZERO_TAIL: gl.constexpr, BITS: gl.constexpr):
        """dst[:, C0 : C0 + NC] := src[:, C0 : C0 + NC] widened from e4m3 to dst's 16-bit dtype, in W-column slices
        (W = 128: one 128-byte swizzle row of fp8; 64 for a [ROWS, 64] fp8 buffer), by the 4 warps of the calling
        partition; with ZERO_TAIL rows >= nvalid := 0 (they may hold anything, NaN included: 0 * NaN = NaN in P.V).
        8 bytes read and 16 written per thread and row: half a warp reads one 128-byte row, a quarter writes one,
        without bank conflicts. The caller fences and syncs afterwards."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [256 // W, W // 8], [4, 1], [1, 0])
        for c in gl.static_range(C0, C0 + NC, W):
            y = _e4m3_to(src.slice(c, W, dim=1).load(blk), dst.dtype, BITS)
            if ZERO_TAIL:
                keep = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk)) < nvalid, 1)
                y = gl.where(keep, y, gl.zeros_like(y))
            dst.slice(c, W, dim=1).store(y)

    @gluon.jit
    def _widen_cols(src, dst, nvalid, C0: gl.constexpr, NC: gl.constexpr, ROWS: gl.constexpr, BITS: gl.constexpr):
        """dst[:, C0 : C0 + NC] := src[:, C0 : C0 + NC] widened by :func:`_convert_cols` in 128-column slices, rows
        >= nvalid zeroed in a partial tile only: a whole tile (nvalid >= ROWS) runs without the row mask."""
        if nvalid < ROWS:
            _convert_cols(src, dst, nvalid, C0, NC, 128, ROWS, True, BITS)
        else:
            _convert_cols(src, dst, nvalid, C0, NC, 128, ROWS, False, BITS)

    @gluon.jit
    def _loader_partition(kv_desc, pe_desc, kv_bufs, pe_bufs, kv_ready, kv_empty, bt_row, num_blocks, start, n_tiles,
                          LKV: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
        """1 warp: tile j (one page-aligned [BLOCK_N, LKV] + [BLOCK_N, R] box pair) into stage j % NBUF by TMA, once
        both consumers have released the stage (a fresh barrier passes the first wait, parity 1)."""
        for j in range(n_tiles):
            s = j % NBUF
            mbarrier.wait(kv_empty.index(s), ((j // NBUF) & 1) ^ 1)
            n0 = start + j * BLOCK_N
            row = _safe_page(gl.load(bt_row + n0 // PAGE), num_blocks) * PAGE + n0 % PAGE
            bar = kv_ready.index(s)
            mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv_bufs.index(s))
            tma.async_copy_global_to_shared(pe_desc, [row, LKV], bar, pe_bufs.index(s))

    @gluon.jit
    def _tile_view(bufs, j):
        """``bufs`` [1, ...] at an index that is 0 for every tile j but not a compile-time constant: the wgmma
        descriptors of a fixed buffer would be hoisted out of the tile loop next to the queries' (72 64-bit values)
        and spill."""
        return bufs.index(j >> 30)

    @gluon.jit
    def _pv_partition(kv_bufs, pe_bufs, cv_kv, cv_pe, p_bufs, alpha_smem, l_smem, kv_ready, kv_empty, conv_ready,
                      p_ready, l_ready, start, end, n_tiles, O, q_lo, q_len, hb, split, num_heads, stride_o_t,
                      stride_o_h, stride_o_s, out_scale, LKV: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr, P_BUFS: gl.constexpr, FP8: gl.constexpr,
                      FP8_BITS: gl.constexpr, FP8_QK: gl.constexpr):
        """4 warps: O[:, :LKV/2] = sum over tiles of the alpha-rescaled P . V[:, :LKV/2] with P from shared memory;
        O * out_scale / l at the end with the softmax partition's row sums. 16-bit pages: V in the stage (rows past
        the end zeroed here), P over the stage's rope-key slot, the stage released after the P.V. fp8 pages: first
        V's columns [0, LKV/2) widened into the converted tile ``cv_kv`` (rows past the end zeroed); with 16-bit
        score products also the rope part into ``cv_pe``, where P comes, and the fp8 stage released once widened;
        with e4m3 score products P from the stage's buffer in ``p_bufs``, the stage released after the P.V (its P
        is read until then). Arguments a variant does not use are None."""
        HALF: gl.constexpr = LKV // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        o = gl.zeros([BLOCK_H, HALF], gl.float32, layout=o_layout)
        for j in range(n_tiles):
            s = j % NBUF
            phase = (j // NBUF) & 1
            mbarrier.wait(kv_ready.index(s), phase)
            nvalid = end - (start + j * BLOCK_N)
            if FP8:
                # Our columns of the converted tile were last read by our own P.V of tile j-1 (waited) and, with
                # 16-bit score products, by tile j-1's scores (before its p_ready), the rope slot (P of tile j-1) by
                # our P.V: all done.
                _widen_cols(kv_bufs.index(s), cv_kv, nvalid, 0, HALF, BLOCK_N, FP8_BITS)
                if not FP8_QK:  # K only: its rows past the end meet masked scores
                    _convert_cols(pe_bufs.index(s), cv_pe, nvalid, 0, R, 64, BLOCK_N, False, FP8_BITS)
                fence_async_shared()  # the widened columns visible to wgmma ...
                gl.thread_barrier()  # ... of every warp, and every warp done reading the fp8 stage
                if not FP8_QK:
                    mbarrier.arrive(kv_empty.index(s), count=1)
                    mbarrier.arrive(conv_ready, count=1)
            ps = j % P_BUFS
            mbarrier.wait(p_ready.index(ps), (j // P_BUFS) & 1)
            o = o * gl.expand_dims(alpha_smem.index(ps).load(gl.SliceLayout(1, o_layout)), 1)
            if FP8:
                p_smem = p_bufs.index(s) if FP8_QK else cv_pe
                v = cv_kv.slice(0, HALF, dim=1)
            else:
                v = kv_bufs.index(s).slice(0, HALF, dim=1)
                if nvalid < BLOCK_N:  # the partial last tile: its V rows past the end may hold NaN
                    _zero_rows_from(v, nvalid, BLOCK_N, HALF)
                    fence_async_shared()
                    gl.thread_barrier()
                p_smem = pe_bufs.index(s)
            o = warpgroup_mma(p_smem, v, o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            if FP8_QK or not FP8:  # the stage's V or P was read until here
                mbarrier.arrive(kv_empty.index(s), count=1)

        _pv_epilogue(o, l_smem, l_ready, O, q_lo, q_len, hb, split, num_heads, stride_o_t, stride_o_h, stride_o_s,
                     out_scale, LKV, BLOCK_H)

    @gluon.jit
    def _softmax_partition(Q_NOPE, Q_PE, q_smem, qpe_smem, kv_bufs, pe_bufs, cv_kvs, cv_pes, p_bufs, alpha_smem,
                           l_smem, kv_ready, kv_empty, conv_ready, p_ready, l_ready, start, end, n_tiles, seq_len,
                           q_lo, q_len, hb, split, num_heads, O, LSE, stride_q_t, stride_q_h, stride_qp_t,
                           stride_qp_h, stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, qk_scale,
                           out_scale, LKV: gl.constexpr, R: gl.constexpr, BLOCK_H: gl.constexpr,
                           BLOCK_N: gl.constexpr, NBUF: gl.constexpr, P_BUFS: gl.constexpr, STORE_LSE: gl.constexpr,
                           MAX_Q: gl.constexpr, FP8: gl.constexpr, FP8_BITS: gl.constexpr, FP8_QK: gl.constexpr):
        """Default partition, 4 warps: the rows' queries to shared memory; per tile the whole score tile
        [Q ; Q_pe] . [K ; K_pe]^T, the keys each row sees (causal per row with several query tokens), online softmax,
        P and alpha published to the P.V worker, O[:, LKV/2:] += P . V with P from registers; the row sums to the
        worker, the LSE and O * out_scale / l at the end. 16-bit pages: the scores on the stage, V rows past the end
        zeroed in our half, P over the stage's rope-key slot. fp8 pages: first V's columns [LKV/2, LKV) widened
        into the converted tile (rows past the end zeroed); with 16-bit score products the fp8 stage released and
        the scores on the converted tile once the P.V worker has widened the rest, P over its rope slot; with e4m3
        score products the queries quantised per row, the scores straight from the fp8 stage, scaled back per row,
        P in the stage's buffer in ``p_bufs``. qk_scale includes k_scale for fp8 pages. Arguments a variant does not
        use are None."""
        HALF: gl.constexpr = LKV // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 32 if FP8_QK else 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

        # The rows' queries (the loader's first tiles fly meanwhile).
        if FP8_QK:
            q_scale = _load_queries_e4m3(Q_NOPE, Q_PE, q_smem.index(0), qpe_smem.index(0), q_lo, q_len, hb,
                                         num_heads, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, LKV, R, BLOCK_H)
            q_scale = gl.expand_dims(gl.convert_layout(q_scale, gl.SliceLayout(1, s_layout)), 1)
        else:
            _load_queries(Q_NOPE, Q_PE, q_smem, qpe_smem, q_lo, q_len, hb, num_heads, stride_q_t, stride_q_h,
                          stride_qp_t, stride_qp_h, LKV, R, BLOCK_H)

        rows_s, pos, offs_n, s_zero, o, m_i, l_i = _softmax_state(hb, seq_len, q_len, num_heads, s_layout, o_layout,
                                                                  BLOCK_H, BLOCK_N, HALF)
        for j in range(n_tiles):
            s = j % NBUF
            mbarrier.wait(kv_ready.index(s), (j // NBUF) & 1)
            n0 = start + j * BLOCK_N
            # The score tile's operands and our V: the stage as loaded; for fp8 pages our half of V widened into the
            # converted tile first (last read by our own P.V of tile j-1, and with 16-bit score products by tile
            # j-1's scores: both waited), then with 16-bit score products K read there too once the P.V worker has
            # widened the rest; the converted tiles and the e4m3 queries through _tile_view.
            q, q_pe, k = q_smem, qpe_smem, kv_bufs.index(s)
            if FP8:
                v = _tile_view(cv_kvs, j)
                if not FP8_QK:
                    k_pe = _tile_view(cv_pes, j)
                _widen_cols(k, v, end - n0, HALF, HALF, BLOCK_N, FP8_BITS)
                if FP8_QK:
                    q, q_pe, k_pe = _tile_view(q_smem, j), _tile_view(qpe_smem, j), pe_bufs.index(s)
                else:
                    k = v
                    fence_async_shared()  # our widened columns visible to wgmma ...
                    gl.thread_barrier()  # ... of every warp, and every warp done reading the fp8 stage
                    mbarrier.arrive(kv_empty.index(s), count=1)
                    mbarrier.wait(conv_ready, j & 1)  # the P.V worker's columns and the rope part
            else:
                k_pe = pe_bufs.index(s)
                v = k
            sc = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sc = warpgroup_mma(q_pe, k_pe.permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            if FP8_QK:
                sc = sc * q_scale
            sc = _mask_scores(sc, gl.expand_dims(n0 + offs_n, 0), end, pos, MAX_Q)
            if not FP8:
                if end - n0 < BLOCK_N:  # the partial last tile: zero our half of its V rows past the end (K is read)
                    _zero_rows_from(v.slice(HALF, HALF, dim=1), end - n0, BLOCK_N, HALF)
            p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i, qk_scale, MAX_Q)
            pb = p.to(v.dtype)
            # P over the 16-bit rope-key slot (dead once the scores are done) or in the stage's P buffer, and alpha:
            # the worker has read the ones they overwrite (the module docstring has the barriers that order it).
            if FP8_QK:
                p_bufs.index(s).store(pb)
            else:
                k_pe.store(pb)
            ps = j % P_BUFS
            alpha_smem.index(ps).store(alpha)
            fence_async_shared()  # P and our widened or zeroed V rows visible to wgmma ...
            gl.thread_barrier()  # ... of every warp, before the arrive and before our own P.V
            mbarrier.arrive(p_ready.index(ps), count=1)
            if FP8_QK:
                mbarrier.arrive(kv_empty.index(s), count=1)  # the scores and our widening are done with the fp8 stage
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            o = warpgroup_mma(gl.convert_layout(pb, p_layout), v.slice(HALF, HALF, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            if not FP8:
                mbarrier.arrive(kv_empty.index(s), count=1)

        _softmax_epilogue(o, m_i, l_i, rows_s, l_smem, l_ready, O, LSE, q_lo, q_len, hb, split, num_heads, stride_o_t,
                          stride_o_h, stride_o_s, stride_lse_t, stride_lse_h, qk_scale, out_scale, LKV, BLOCK_H,
                          STORE_LSE)

    @gluon.jit
    def _pipeline(Q_NOPE, Q_PE, kv_desc, pe_desc, O, LSE, bt_row, num_blocks, start, end, n_tiles, seq_len, q_lo, q_len,
                  hb, split, num_heads, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_o_t, stride_o_h,
                  stride_o_s, stride_lse_t, stride_lse_h, qk_scale, v_scale, LKV: gl.constexpr, R: gl.constexpr,
                  PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                  STORE_LSE: gl.constexpr, MAX_Q: gl.constexpr, REGS_PV: gl.constexpr, REGS_LOAD: gl.constexpr,
                  FP8: gl.constexpr, FP8_BITS: gl.constexpr, FP8_QK: gl.constexpr):
        """The kernel's shared memory, barriers and partitions (the module docstring has the protocol): NBUF stages
        [BLOCK_N, LKV] + [BLOCK_N, R] in the cache dtype filled by the loader; for fp8 pages one converted 16-bit
        tile, [BLOCK_N, LKV] + [BLOCK_N, R] with 16-bit score products and V [BLOCK_N, LKV] with e4m3 ones (then
        also NBUF P buffers [BLOCK_H, BLOCK_N]); the queries (e4m3 score products: quantised); alpha and p_ready in
        P_BUFS slots, one per stage but one in all for fp8 pages with 16-bit score products."""
        dtype: gl.constexpr = Q_NOPE.dtype.element_ty
        P_BUFS: gl.constexpr = 1 if FP8 and not FP8_QK else NBUF
        kv_bufs = gl.allocate_shared_memory(kv_desc.dtype, [NBUF, BLOCK_N, LKV], kv_desc.layout)
        pe_bufs = gl.allocate_shared_memory(pe_desc.dtype, [NBUF, BLOCK_N, R], pe_desc.layout)
        cv_kvs, cv_pes, p_bufs, cv_kv, cv_pe, conv_ready = None, None, None, None, None, None
        if FP8:
            cv_kvs = gl.allocate_shared_memory(dtype, [1, BLOCK_N, LKV],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_N, LKV], dtype))
            cv_kv = cv_kvs.index(0)
            if FP8_QK:
                p_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_H, BLOCK_N],
                                                   gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
            else:
                cv_pes = gl.allocate_shared_memory(dtype, [1, BLOCK_N, R],
                                                   gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype))
                cv_pe = cv_pes.index(0)
        # e4m3 queries with a leading index for _tile_view
        if FP8_QK:
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [1, BLOCK_H, LKV],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_H, LKV], gl.float8e4nv))
            qpe_smem = gl.allocate_shared_memory(gl.float8e4nv, [1, BLOCK_H, R],
                                                 gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.float8e4nv))
        else:
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, LKV],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_H, LKV], dtype))
            qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, R],
                                                 gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], dtype))
        vec_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        alpha_smem = gl.allocate_shared_memory(gl.float32, [P_BUFS, BLOCK_H], vec_sl)
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_sl)
        kv_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        if FP8 and not FP8_QK:
            conv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [P_BUFS, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NBUF):
            mbarrier.init(kv_ready.index(i), count=1)  # the loader's expect-tx arrival (+ the TMA bytes)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers released the stage
            if P_BUFS == NBUF:
                mbarrier.init(p_ready.index(i), count=1)  # the softmax partition published P and alpha
        if FP8 and not FP8_QK:
            mbarrier.init(conv_ready, count=1)  # the P.V worker widened its columns and the rope part of the tile
        if P_BUFS != NBUF:
            mbarrier.init(p_ready.index(0), count=1)
        mbarrier.init(l_ready, count=1)
        fence_async_shared()  # the initialised barriers visible to the TMA unit
        gl.thread_barrier()

        gl.warp_specialize([
            (_softmax_partition, (Q_NOPE, Q_PE, q_smem, qpe_smem, kv_bufs, pe_bufs, cv_kvs, cv_pes, p_bufs,
                                  alpha_smem, l_smem, kv_ready, kv_empty, conv_ready, p_ready, l_ready, start, end,
                                  n_tiles, seq_len, q_lo, q_len, hb, split, num_heads, O, LSE, stride_q_t, stride_q_h,
                                  stride_qp_t, stride_qp_h, stride_o_t, stride_o_h, stride_o_s, stride_lse_t,
                                  stride_lse_h, qk_scale, v_scale if FP8 else 1.0, LKV, R, BLOCK_H, BLOCK_N, NBUF,
                                  P_BUFS, STORE_LSE, MAX_Q, FP8, FP8_BITS, FP8_QK)),
            (_pv_partition, (kv_bufs, pe_bufs, cv_kv, cv_pe, p_bufs, alpha_smem, l_smem, kv_ready, kv_empty,
                             conv_ready, p_ready, l_ready, start, end, n_tiles, O, q_lo, q_len, hb, split, num_heads,
                             stride_o_t, stride_o_h, stride_o_s, v_scale if FP8 else 1.0, LKV, R, BLOCK_H, BLOCK_N,
                             NBUF, P_BUFS, FP8, FP8_BITS, FP8_QK)),
            (_loader_partition, (kv_desc, pe_desc, kv_bufs, pe_bufs, kv_ready, kv_empty, bt_row, num_blocks, start,
                                 n_tiles, LKV, PAGE, BLOCK_N, NBUF)),
        ], [4, 1], [REGS_PV, REGS_LOAD])

    @gluon.jit
    def _mla_decode_hopper_kernel(
        Q_NOPE, Q_PE,  # [T, H, LKV], [T, H, R] 16-bit
        kv_desc, pe_desc,  # TMA over the cache as [num_blocks * PAGE, LKV + R]: boxes [BLOCK_N, LKV], [BLOCK_N, R]
        BLOCK_TABLE, SEQ_LENS, QUERY_START,  # [B, W] int32, [B] int32, [B + 1] int32 (read when MAX_Q > 1)
        O, LSE,  # [T, H, (S,) LKV] output or float32 partials, [T, H(, S)] float32
        stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_bt, num_blocks,
        stride_o_t, stride_o_h, stride_o_s, stride_lse_t, stride_lse_h,
        num_heads, num_splits,
        qk_scale,  # softmax scale * log2(e) (* k_scale for an fp8 cache)
        v_scale,  # k_scale for an fp8 cache (read with FP8 only)
        LKV: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NBUF: gl.constexpr, STORE_LSE: gl.constexpr, MAX_Q: gl.constexpr, REGS_PV: gl.constexpr,
        REGS_LOAD: gl.constexpr, FP8: gl.constexpr, FP8_BITS: gl.constexpr, FP8_QK: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Grid (cdiv(H * MAX_Q, BLOCK_H), B, num_splits): request b's rows (query token, head) of one row block over
        one KV split, rows and positions as in ``_split_prologue`` of :mod:`.decode_kernel`. Warps: 4 (softmax,
        the default partition) + 4 (P.V) + 1 (TMA loader). FP8: the cache is e4m3, widened in shared memory to the
        queries' 16-bit dtype (FP8_BITS: how, see ``_e4m3_to``); FP8_QK: with e4m3 score products."""
        gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
        gl.static_assert(BLOCK_H == 64, "one wgmma M tile of rows")
        gl.static_assert(BLOCK_N == 64 and R == 64, "P [64 rows, 64 keys] is published over the [64 keys, 64] K_pe slot")
        gl.static_assert(PAGE % BLOCK_N == 0, "a TMA tile lies in one page")
        gl.static_assert(LKV % 128 == 0, "two column halves of 64-column slices")
        gl.static_assert(not FP8 or LKV % 256 == 0, "fp8: two column halves of 128-column (128-byte) slices")
        gl.static_assert(FP8 or not FP8_QK, "e4m3 score products read fp8 pages")

        hb = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(SEQ_LENS + b)
        if MAX_Q == 1:
            q_lo = b
            q_len = seq_len * 0 + 1
        else:
            q_lo = gl.load(QUERY_START + b)
            q_len = gl.load(QUERY_START + b + 1) - q_lo
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)
        if MAX_Q > 1:
            end = gl.where(hb * BLOCK_H < q_len * num_heads, end, start)  # row blocks past the tokens: no keys
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        bt_row = BLOCK_TABLE + b.to(gl.int64) * stride_bt

        _pipeline(Q_NOPE, Q_PE, kv_desc, pe_desc, O, LSE, bt_row, num_blocks, start, end, n_tiles, seq_len, q_lo, q_len,
                  hb, split, num_heads, stride_q_t, stride_q_h, stride_qp_t, stride_qp_h, stride_o_t, stride_o_h,
                  stride_o_s, stride_lse_t, stride_lse_h, qk_scale, v_scale, LKV, R, PAGE, BLOCK_H, BLOCK_N, NBUF,
                  STORE_LSE, MAX_Q, REGS_PV, REGS_LOAD, FP8, FP8_BITS, FP8_QK)

# The descriptors are arguments 2 and 3 (kv_desc, pe_desc): encoded once per descriptor object.
_LAUNCHER = DescriptorLauncher(_mla_decode_hopper_kernel, HOPPER_CONSTEXPRS, (2, 3)) if gluon_available() else None
