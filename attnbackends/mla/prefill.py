"""Ragged (varlen) attention with log-sum-exp for the MLA prefill: the new tokens (causal) and each context chunk
(non-causal), with qk head P + R (192) and v head V (128).

Four kernels, chosen by what is installed (:func:`select_prefill_kernel`): flash-attn 4 (``flash_attn.cute``),
FlashInfer's ragged prefill wrapper, our Triton kernel, torch (SDPA's memory-efficient kernel on CUDA, plain
matmuls elsewhere). Every kernel is used as ``handle = kernel.plan(...)`` once per batch (in the metadata builder)
then ``out, lse = kernel.run(handle, q, k, v)`` per layer; lse is [H, T] float32 in natural-log units.
"""

from __future__ import annotations


import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from ..compat import efficient_attention_with_lse, flash_attn_cute_available, import_flashinfer
from ..ops.launch import DirectLauncher
from ..ops.flashinfer.plan_guard import planning
from ..ops.flashinfer.wrapper_pool import ragged_prefill_wrapper
from ..platform import DeviceInfo, is_triton_interpreted, package_available
from ..ops.launch_math import cdiv, next_power_of_2

__all__ = [
    "PREFILL_KERNELS",
    "RaggedPlan",
    "PrefillKernel",
    "available_prefill_kernels",
    "select_prefill_kernel",
    "get_prefill_kernel",
    "ragged_attention_triton",
]

logger = logging.getLogger(__name__)

PREFILL_KERNELS = ("flash_attn", "flashinfer", "triton", "sdpa")
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class RaggedPlan:
    """One ragged attention problem: queries per request against keys per request.

    cu_seqlens_q / cu_seqlens_k : [R + 1] int32 on the device; *_cpu the same on the host.
    wrapper : the kernel's planned wrapper for this problem (FlashInfer's ragged prefill wrapper), else None.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q_cpu: torch.Tensor
    cu_seqlens_k_cpu: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    scale: float
    wrapper: Any = None


class PrefillKernel:
    """A ragged attention kernel: :meth:`begin_batch`, then :meth:`plan` per ragged problem on the host once per
    batch, :meth:`run` per layer. One instance per metadata builder: a batch's plans stay valid until the next
    :meth:`begin_batch`."""

    name = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin_batch(self) -> None:
        """A new batch's plans follow (the previous batch's may be reused)."""

    def plan(
        self,
        cu_seqlens_q_cpu: torch.Tensor,
        cu_seqlens_k_cpu: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        num_heads: int,
        head_dim_qk: int,
        head_dim_v: int,
        dtype: torch.dtype,
    ) -> RaggedPlan:
        return self._ragged_plan(cu_seqlens_q_cpu, cu_seqlens_k_cpu, causal=causal, scale=scale)

    def _ragged_plan(self, cu_seqlens_q_cpu: torch.Tensor, cu_seqlens_k_cpu: torch.Tensor, *, causal: bool,
                     scale: float, wrapper: Any = None) -> RaggedPlan:
        q_lens = cu_seqlens_q_cpu[1:] - cu_seqlens_q_cpu[:-1]
        k_lens = cu_seqlens_k_cpu[1:] - cu_seqlens_k_cpu[:-1]
        return RaggedPlan(
            cu_seqlens_q=cu_seqlens_q_cpu.to(self.device, non_blocking=True),
            cu_seqlens_k=cu_seqlens_k_cpu.to(self.device, non_blocking=True),
            cu_seqlens_q_cpu=cu_seqlens_q_cpu,
            cu_seqlens_k_cpu=cu_seqlens_k_cpu,
            max_seqlen_q=int(q_lens.max()) if q_lens.numel() else 0,
            max_seqlen_k=int(k_lens.max()) if k_lens.numel() else 0,
            causal=causal,
            scale=scale,
            wrapper=wrapper,
        )

    def run(self, plan: RaggedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> (out [Tq, H, Dv] in q's dtype, lse [H, Tq] float32).

        Causal plans align the last query with the last key of each request (only used with Tq == Tk per request).
        A request without keys gets lse = -inf.
        """
        raise NotImplementedError


class SdpaPrefill(PrefillKernel):
    """torch: SDPA's memory-efficient kernel on CUDA (it returns the lse), plain float32 matmuls elsewhere."""

    name = "sdpa"

    def run(self, plan, q, k, v):
        num_heads, head_dim_v = q.shape[1], v.shape[-1]
        out = torch.zeros(q.shape[0], num_heads, head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.full((num_heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        qs, ks = plan.cu_seqlens_q_cpu.tolist(), plan.cu_seqlens_k_cpu.tolist()
        for i in range(len(qs) - 1):
            q0, q1, k0, k1 = qs[i], qs[i + 1], ks[i], ks[i + 1]
            if q1 == q0 or k1 == k0:
                continue
            qi = q[q0:q1].transpose(0, 1)  # [H, Q, D]
            ki, vi = k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
            result = efficient_attention_with_lse(qi, ki, vi, plan.causal, plan.scale) if q.is_cuda else None
            o, l_i = result if result is not None else _math_attention(qi, ki, vi, plan.causal, plan.scale)
            out[q0:q1] = o.transpose(0, 1).to(q.dtype)
            lse[:, q0:q1] = l_i
        return out, lse


def _math_attention(q, k, v, causal, scale):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # [H, Q, K]
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.float(), lse


class TritonPrefill(PrefillKernel):
    """Our Triton ragged flash-attention kernel."""

    name = "triton"

    def run(self, plan, q, k, v):
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ragged_attention_triton(q, k, v, plan, out, lse)
        return out, lse


class FlashAttnPrefill(PrefillKernel):
    """flash-attn 4 (``flash_attn.cute.flash_attn_varlen_func`` with ``return_lse=True``)."""

    name = "flash_attn"

    def run(self, plan, q, k, v):
        from flash_attn.cute import flash_attn_varlen_func

        if plan.max_seqlen_k == 0:
            return _empty_result(q, v)
        out, lse = flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=plan.scale,
            causal=plan.causal,
            return_lse=True,
        )
        return out, lse


class FlashInferPrefill(PrefillKernel):
    """FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (one planned wrapper per ragged problem)."""

    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._wrappers: list[Any] = []  # planned in order within a batch, reused by the next batch
        self._next = 0

    def begin_batch(self) -> None:
        self._next = 0

    def plan(self, cu_seqlens_q_cpu, cu_seqlens_k_cpu, *, causal, scale, num_heads, head_dim_qk, head_dim_v, dtype):
        if self._next == len(self._wrappers):
            self._wrappers.append(ragged_prefill_wrapper(import_flashinfer(), self.device))
        wrapper = self._wrappers[self._next]
        self._next += 1
        with planning(wrapper):
            wrapper.plan(
                cu_seqlens_q_cpu.to(torch.int32),
                cu_seqlens_k_cpu.to(torch.int32),
                num_heads,
                num_heads,
                head_dim_qk,
                head_dim_vo=head_dim_v,
                causal=causal,
                sm_scale=scale,
                q_data_type=dtype,
                kv_data_type=dtype,
            )
        return self._ragged_plan(cu_seqlens_q_cpu, cu_seqlens_k_cpu, causal=causal, scale=scale, wrapper=wrapper)

    def run(self, plan, q, k, v):
        if plan.max_seqlen_k == 0:
            return _empty_result(q, v)
        out, lse = plan.wrapper.run(q, k, v, return_lse=True)
        # FlashInfer's lse is log2-based, [T, H].
        return out, (lse.float() * _LN2).transpose(0, 1).contiguous()


def _empty_result(q, v):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)


_CLASSES = {"flash_attn": FlashAttnPrefill, "flashinfer": FlashInferPrefill, "triton": TritonPrefill, "sdpa": SdpaPrefill}


# (qk head, v head) pairs the library kernels are built for; other MLA sizes (small test models) use Triton/SDPA.
_FLASH_ATTN_HEAD_DIMS = frozenset({(64, 64), (128, 128), (192, 128)})
_FLASHINFER_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


def available_prefill_kernels(
    device: DeviceInfo, dtype: torch.dtype, head_dims: Optional[tuple[int, int]] = None
) -> list[str]:
    """The prefill kernels that can run here for (qk head, v head) ``head_dims``, fastest first."""
    names = []
    half = dtype in (torch.float16, torch.bfloat16)
    if (
        device.is_cuda and half and device.compute_capability >= (9, 0) and flash_attn_cute_available()
        and (head_dims is None or head_dims in _FLASH_ATTN_HEAD_DIMS)
    ):
        names.append("flash_attn")
    if (
        device.is_cuda and half and package_available("flashinfer")
        and (head_dims is None or head_dims in _FLASHINFER_HEAD_DIMS)
    ):
        names.append("flashinfer")
    if device.runs_triton and dtype != torch.float32:
        names.append("triton")
    names.append("sdpa")
    return names


def select_prefill_kernel(
    device: DeviceInfo, dtype: torch.dtype, prefer: str = "auto", head_dims: Optional[tuple[int, int]] = None
) -> str:
    """The prefill kernel name: ``prefer`` if it can run here (ValueError otherwise), else the fastest available.

    On the CPU "auto" picks "sdpa": the Triton interpreter is far slower than torch.
    """
    available = available_prefill_kernels(device, dtype, head_dims)
    if prefer == "auto":
        return available[0] if device.is_cuda else "sdpa"
    if prefer not in PREFILL_KERNELS:
        raise ValueError(f"prefill_backend {prefer!r} is not one of: auto, {', '.join(PREFILL_KERNELS)}")
    if prefer not in available:
        raise ValueError(f"prefill_backend {prefer!r} cannot run on {device.describe()}; available: {', '.join(available)}")
    return prefer


def get_prefill_kernel(name: str, device: torch.device) -> PrefillKernel:
    """A kernel instance by name (see :data:`PREFILL_KERNELS`)."""
    return _CLASSES[name](torch.device(device))


@triton.jit
def _ragged_tile(
    acc, l_i, m_i, q_a, q_b, n0, k_start, k_len, shift, offs_m, offs_a, offs_v, v_mask,
    K, V, stride_k_t, stride_k_h, stride_v_t, stride_v_h, h, qk_scale_log2,
    HEAD_QK: tl.constexpr, HEAD_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < k_len
    k_rows = K + (k_start + offs_n)[:, None] * stride_k_t + h * stride_k_h
    k_a = tl.load(k_rows + offs_a[None, :], mask=n_mask[:, None], other=0.0).to(q_a.dtype)
    s = tl.dot(q_a, tl.trans(k_a))
    if HEAD_B > 0:
        offs_b = HEAD_A + tl.arange(0, HEAD_B)
        k_b = tl.load(k_rows + offs_b[None, :], mask=n_mask[:, None] & (offs_b[None, :] < HEAD_QK), other=0.0)
        s += tl.dot(q_b, tl.trans(k_b.to(q_b.dtype)))
    visible = n_mask[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
    s = tl.where(visible, s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_t = tl.load(
        V + (k_start + offs_n)[:, None] * stride_v_t + h * stride_v_h + offs_v[None, :],
        mask=n_mask[:, None] & v_mask[None, :],
        other=0.0,
    ).to(q_a.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_t.dtype), v_t)
    return acc, l_i, m_new


@triton.jit
def _ragged_attention_kernel(
    Q, K, V, O, LSE,
    CU_Q, CU_K,
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    stride_lse_h,
    qk_scale_log2,
    HEAD_QK: tl.constexpr,
    HEAD_A: tl.constexpr,  # power-of-two leading part of the qk head
    HEAD_B: tl.constexpr,  # the rest, padded to a power of two (0: none)
    HEAD_V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)
    q_start = tl.load(CU_Q + r)
    q_len = tl.load(CU_Q + r + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    k_start = tl.load(CU_K + r)
    k_len = tl.load(CU_K + r + 1) - k_start
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_a = tl.arange(0, HEAD_A)
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < HEAD_V
    q_rows = Q + (q_start + offs_m)[:, None] * stride_q_t + h * stride_q_h
    q_a = tl.load(q_rows + offs_a[None, :], mask=m_mask[:, None], other=0.0)
    if HEAD_B > 0:
        offs_b = HEAD_A + tl.arange(0, HEAD_B)
        q_b = tl.load(q_rows + offs_b[None, :], mask=m_mask[:, None] & (offs_b[None, :] < HEAD_QK), other=0.0)
    else:
        q_b = q_a  # unused
    if INTERPRET:  # the interpreter's tl.dot on bfloat16 is wrong: compute in float32 there
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    # Causal: query i (of q_len) sees keys 0 .. i + k_len - q_len.
    shift = k_len - q_len
    k_end = k_len
    if CAUSAL:
        k_end = tl.minimum(k_len, (mb + 1) * BLOCK_M + shift)
    if INTERPRET:  # the interpreter cannot use its 1-element scalar arrays as range() bounds
        n0 = 0
        while n0 < k_end:
            acc, l_i, m_i = _ragged_tile(
                acc, l_i, m_i, q_a, q_b, n0, k_start, k_len, shift, offs_m, offs_a, offs_v, v_mask,
                K, V, stride_k_t, stride_k_h, stride_v_t, stride_v_h, h, qk_scale_log2,
                HEAD_QK, HEAD_A, HEAD_B, BLOCK_N, CAUSAL, INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(0, k_end, BLOCK_N):
            acc, l_i, m_i = _ragged_tile(
                acc, l_i, m_i, q_a, q_b, n0, k_start, k_len, shift, offs_m, offs_a, offs_v, v_mask,
                K, V, stride_k_t, stride_k_h, stride_v_t, stride_v_h, h, qk_scale_log2,
                HEAD_QK, HEAD_A, HEAD_B, BLOCK_N, CAUSAL, INTERPRET)
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc * tl.where(has_keys, 1.0 / l_safe, 0.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    o_rows = O + (q_start + offs_m)[:, None] * stride_o_t + h * stride_o_h
    tl.store(o_rows + offs_v[None, :], acc.to(O.dtype.element_ty), mask=m_mask[:, None] & v_mask[None, :])
    tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=m_mask)


def ragged_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RaggedPlan, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Ragged attention into ``out`` [Tq, H, Dv] and ``lse`` [H, Tq] (float32, unit token stride)."""
    num_reqs = plan.cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or num_reqs == 0:
        return
    head_qk, head_v = q.shape[-1], v.shape[-1]
    head_a = 1 << (head_qk.bit_length() - 1)
    head_b = next_power_of_2(head_qk - head_a) if head_qk > head_a else 0
    interpreted = is_triton_interpreted()
    block_m, block_n = (16, 16) if interpreted else (64, 64)
    grid = (cdiv(max(plan.max_seqlen_q, 1), block_m), q.shape[1], num_reqs)
    constexprs = (head_qk, head_a, head_b, head_v, next_power_of_2(head_v), block_m, block_n, plan.causal,
                  interpreted)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
               out.stride(1), lse.stride(0))
    args = (q, k, v, out, lse, plan.cu_seqlens_q, plan.cu_seqlens_k, *strides, plan.scale * 1.4426950408889634)
    key = (constexprs, q.dtype, k.dtype, v.dtype, out.dtype, strides,
           tuple(t.data_ptr() % 16 == 0 for t in (q, k, v, out, lse, plan.cu_seqlens_q, plan.cu_seqlens_k)))
    _RAGGED(key, grid, args, constexprs, 4 if interpreted else 8, 1 if interpreted else 2)


_RAGGED = DirectLauncher(_ragged_attention_kernel, (
    "HEAD_QK", "HEAD_A", "HEAD_B", "HEAD_V", "BLOCK_V", "BLOCK_M", "BLOCK_N", "CAUSAL", "INTERPRET"))
