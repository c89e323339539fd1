"""Gluon candidate for causal prefill on Hopper (FlashAttention-3 style), every token new.

The case: causal prefill of sequences without cached context, Q / K / V / O contiguous ``[tokens, heads, 128]``
16-bit, sequences given by ``query_start_loc`` (varlen), GQA (the query heads of one KV head are adjacent
programs, so their K/V tiles are read from L2).

One program owns a 128-row query tile of one head; its 8 warps are two consumer warpgroups, each owning 64 query
rows (the score and output layouts put the warps [8, 1]: each warpgroup issues its own ``m64`` wgmma):

- Q arrives once by TMA; K and V tiles of BLOCK_N keys arrive by TMA into NBUF buffers with one mbarrier each
  for K and for V (Q.K^T starts as soon as K has landed); a buffer is refilled once both warpgroups are done
  with it, NBUF - 2 tiles ahead of the tile whose K is read (NBUF = 2 prefetches V only);
- the loop is software-pipelined inside each warpgroup: iteration j issues S_j = Q.K_j^T and then
  O += P_{j-1}.V_{j-1}, waits for S_j only, runs the online softmax of S_j (log2 domain, the scale in the
  exp2's FMA) while P.V is on the tensor cores, then waits for P.V and rescales O. P stays in registers as the
  A operand of P.V. Every wgmma is issued while no instruction touches an accumulator of a wgmma in flight
  (ptxas serialises every wgmma of the kernel otherwise);
- only the tiles that touch the causal diagonal are masked; keys past the sequence's end (the next sequence's
  keys, or TMA's zero fill past the last token) are always above the diagonal of every valid query row;
- O is written by masked pointer stores (a TMA box would run into the next sequence's rows).

The TMA loads are issued by the consumer warps themselves, NBUF - 1 tiles ahead; a warp-specialised producer is
not written yet.

Gluon does not run under the interpreter: on a CPU this module is only compiled for sm_90
(:func:`compile_report`); ``tests/test_prefill_explore_gluon.py`` checks it against a float64 reference on the
GPU and ``python -m benchmarks.prefill_explore_gluon`` times it next to FlashInfer.
"""

from __future__ import annotations

import argparse
import json
import math

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

from attnbackends.triton.prefill_hopper import _masked_scores, _softmax_step  # the library kernel's device helpers

RCP_LN2 = 1.4426950408889634
BLOCK_M = 128
NUM_WARPS = 8


@gluon.jit
def _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, row, col, buf):
    """TMA the K and V tiles starting at token ``row`` (head column ``col``) into buffer ``buf``."""
    kb = k_ready.index(buf)
    mbarrier.expect(kb, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], kb, k_bufs.index(buf))
    vb = v_ready.index(buf)
    mbarrier.expect(vb, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], vb, v_bufs.index(buf))


@gluon.jit
def _prefill_new_kernel(
    q_desc, k_desc, v_desc,  # TMA over Q [T, HQ * HEAD] (box BLOCK_M x HEAD), K / V [T, HKV * HEAD] (BLOCK_N x HEAD)
    O, QSL,  # [T, HQ, HEAD]; [B + 1] int32
    stride_o_t, num_seqs, num_q_blocks, qk_scale,  # qk_scale: softmax scale * log2(e)
    HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NBUF: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (HQ, num_seqs * num_q_blocks), 8 warps; the heaviest query blocks (last in their sequence) first."""
    gl.static_assert(num_warps == 8, "two consumer warpgroups of 64 query rows each")
    gl.static_assert(BLOCK_M == 128, "64 query rows per warpgroup")
    gl.static_assert(BLOCK_M % BLOCK_N == 0, "a query tile ends on a key tile boundary")
    gl.static_assert(NBUF >= 2, "the next tile flies while this one is read")
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, HEAD, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    h = gl.program_id(0)
    w = gl.program_id(1)
    seq = w % num_seqs
    qb = num_q_blocks - 1 - w // num_seqs
    start = gl.load(QSL + seq)
    q_len = gl.load(QSL + seq + 1) - start
    m0 = qb * BLOCK_M
    if m0 < q_len:
        col_q = h * HEAD
        col_kv = (h // (HQ // HKV)) * HEAD
        n_tiles = gl.cdiv(gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
        n_unmasked = m0 // BLOCK_N

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for i in gl.static_range(NBUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
        fence_async_shared()
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + m0, col_q], q_ready, q_smem)
        for i in gl.static_range(NBUF - 1):
            if i < n_tiles:
                _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, start + i * BLOCK_N, col_kv, i)

        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        o = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=o_layout)

        mbarrier.wait(q_ready, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        s = _masked_scores(s, 0, m0, n_unmasked, s_layout, BLOCK_M, BLOCK_N)
        p, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype)
        for j in range(1, n_tiles):
            gl.thread_barrier()  # both warpgroups are done with buffer (j - 2) % NBUF, refilled here
            if j + NBUF - 2 < n_tiles:
                nxt = j + NBUF - 2
                _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, start + nxt * BLOCK_N, col_kv,
                          nxt % NBUF)
            buf = j % NBUF
            prev = (j - 1) % NBUF
            mbarrier.wait(k_ready.index(buf), (j // NBUF) & 1)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // NBUF) & 1)
            o_tok = warpgroup_mma(p, v_bufs.index(prev), o, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            s = _masked_scores(s, j, m0, n_unmasked, s_layout, BLOCK_M, BLOCK_N)
            p_next, l_i, m_i, alpha = _softmax_step(s, l_i, m_i, qk_scale, p_layout, dtype)
            o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))  # P_{j-1} lives until P.V is done
            p = p_next
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        last = (n_tiles - 1) % NBUF
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NBUF) & 1)
        o = warpgroup_mma(p, v_bufs.index(last), o)
        mbarrier.invalidate(q_ready)
        for i in gl.static_range(NBUF):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))

        inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        out = (o * gl.expand_dims(inv, 1)).to(O.dtype.element_ty)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + gl.expand_dims((start + rows).to(gl.int64) * stride_o_t, 1) + col_q + gl.expand_dims(cols, 0)
        gl.store(ptrs, out, mask=gl.expand_dims(rows < q_len, 1) & gl.expand_dims(cols < HEAD, 0))


# ==============================================================================================================
# Host side
# ==============================================================================================================
def _gl_dtype(dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return gl.bfloat16
    if dtype == torch.float16:
        return gl.float16
    raise ValueError(f"q, k, v must be bfloat16 or float16, got {dtype}")


def _check(q, k, v, out, query_start_loc, block_n: int, nbuf: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or out.shape != q.shape:
        raise ValueError(f"q / out must be [tokens, heads, head_size] and k / v [tokens, kv_heads, head_size], got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError("q and k / v must have the same tokens and head_size (every token is new)")
    if q.shape[2] != 128:
        raise NotImplementedError(f"head_size {q.shape[2]}: only 128 is implemented")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    if len({q.dtype, k.dtype, v.dtype, out.dtype}) != 1:
        raise ValueError(f"q, k, v, out must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}")
    _gl_dtype(q.dtype)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1 or query_start_loc.numel() < 2:
        raise ValueError("query_start_loc must be a 1-D int32 tensor of num_seqs + 1 offsets")
    if block_n not in (64, 128) or nbuf < 2:
        raise ValueError(f"block_n must be 64 or 128 and nbuf >= 2, got block_n {block_n}, nbuf {nbuf}")


def _descriptors(q, k, v, block_n: int):
    T, HQ, D = q.shape
    HKV = k.shape[1]
    gdt = _gl_dtype(q.dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(T, HQ * D), [BLOCK_M, D],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gdt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gdt)
    k_desc = TensorDescriptor.from_tensor(k.view(T, HKV * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(T, HKV * D), [block_n, D], kv_layout)
    return q_desc, k_desc, v_desc


def launch_args(q, k, v, out, query_start_loc, max_len: int, scale: float, block_n: int = 128, nbuf: int = 2):
    """(grid, args, kwargs) of one launch of :func:`_prefill_new_kernel` (also what the offline compile uses)."""
    _check(q, k, v, out, query_start_loc, block_n, nbuf)
    T, HQ, D = q.shape
    num_seqs = query_start_loc.numel() - 1
    num_q_blocks = triton.cdiv(max(int(max_len), 1), BLOCK_M)
    q_desc, k_desc, v_desc = _descriptors(q, k, v, block_n)
    grid = (HQ, num_seqs * num_q_blocks)
    args = (q_desc, k_desc, v_desc, out, query_start_loc, out.stride(0), num_seqs, num_q_blocks, scale * RCP_LN2)
    kwargs = dict(HQ=HQ, HKV=k.shape[1], HEAD=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, NBUF=nbuf,
                  num_warps=NUM_WARPS)
    return grid, args, kwargs


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
        max_len: int, scale: float, *, block_n: int = 128, nbuf: int = 2) -> torch.Tensor:
    """Causal varlen prefill, every token new: ``out = softmax(scale * q k^T + causal) v`` per sequence.

    Parameters
    ----------
    q, out : [tokens, num_heads, 128] bfloat16 / float16, contiguous
    k, v : [tokens, num_kv_heads, 128], same dtype, contiguous; num_heads a multiple of num_kv_heads
    query_start_loc : [num_seqs + 1] int32 on the device, sequence i is tokens [qsl[i], qsl[i + 1])
    max_len : the longest sequence (host int; a larger value only launches programs that exit at once)
    scale : softmax scale
    """
    if q.device.type != "cuda":
        raise NotImplementedError("the Gluon kernel runs on CUDA (sm_90) only, not under the Triton interpreter")
    grid, args, kwargs = launch_args(q, k, v, out, query_start_loc, max_len, scale, block_n, nbuf)
    _prefill_new_kernel[grid](*args, **kwargs)
    return out


CONFIGS = [dict(block_n=128, nbuf=3), dict(block_n=64, nbuf=4), dict(block_n=128, nbuf=2)]


def compile_report(block_n: int = 128, nbuf: int = 2, tokens: int = 256, heads: int = 32, kv_heads: int = 8) -> dict:
    """Compile the kernel for sm_90 without a GPU (arguments built on the CPU) and report registers, spills,
    shared memory, wgmma shapes and ptxas notes (see ``benchmarks/offline_compile.py``)."""
    from benchmarks.offline_compile import compile_call

    q = torch.zeros(tokens, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(tokens, kv_heads, 128, dtype=torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    _, args, kwargs = launch_args(q, k, k.clone(), torch.empty_like(q), qsl, tokens, 0.1, block_n, nbuf)
    rep = compile_call(_prefill_new_kernel, args, kwargs)
    rep["config"] = dict(block_n=block_n, nbuf=nbuf)
    return rep


def _bench_main(argv=None) -> int:
    """Time the kernel next to FlashInfer's ragged prefill (every token new) on the H100 shapes of issue 14."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="sm_90 compile report, no GPU needed")
    ap.add_argument("--shapes", default="1x8192,4x4096,16x1024")
    ns = ap.parse_args(argv)
    if ns.compile_only:
        for cfg in CONFIGS:
            rep = compile_report(**cfg)
            print(json.dumps({k: v for k, v in rep.items() if k != "asm"}))
        return 0
    import flashinfer

    hq, hkv, d = 32, 8, 128
    for shape in ns.shapes.split(","):
        b, L = (int(x) for x in shape.split("x"))
        T = b * L
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, hq, d, generator=g, device="cuda").bfloat16()
        k = torch.randn(T, hkv, d, generator=g, device="cuda").bfloat16()
        v = torch.randn(T, hkv, d, generator=g, device="cuda").bfloat16()
        qsl = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        scale = 1.0 / math.sqrt(d)
        flops = 2.0 * 2.0 * b * L * L * hq * d / 2
        ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        fi = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        fi.plan(qsl, qsl, hq, hkv, d, causal=True, q_data_type=q.dtype, sm_scale=scale)
        ref = fi.run(q, k, v)
        row = {"shape": shape, "flashinfer_tflops": flops / triton.testing.do_bench(lambda: fi.run(q, k, v)) / 1e9}
        for cfg in CONFIGS:
            out = torch.full_like(q, float("nan"))
            run(q, k, v, out, qsl, L, scale, **cfg)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            grid, args, kwargs = launch_args(q, k, v, out, qsl, L, scale, **cfg)
            ms = triton.testing.do_bench(lambda: _prefill_new_kernel[grid](*args, **kwargs))
            row[f"gluon_n{cfg['block_n']}_buf{cfg['nbuf']}"] = {"tflops": flops / ms / 1e9, "rel_err_vs_fi": err}
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(_bench_main())
