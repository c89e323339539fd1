"""Merge two partial attention results computed over disjoint key sets (DESIGN.md, "merge_attn_states").

For (o_a, lse_a) and (o_b, lse_b): m = max(lse_a, lse_b), w_x = e^(lse_x - m),
o = (o_a w_a + o_b w_b) / (w_a + w_b), lse = m + log(w_a + w_b). A side whose lse is -inf contributes nothing,
whatever its output holds (NaN included); when both are -inf the output is 0 and the lse -inf.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import triton
import triton.language as tl

from .launch_math import next_power_of_2
from .lse_merge import merge_by_lse

__all__ = ["merge_attn_states", "merge_attn_states_torch"]


@triton.jit
def _merge_attn_states_kernel(
    OUT,
    OUT_LSE,
    A,
    A_LSE,
    B,
    B_LSE,
    stride_out_t,
    stride_out_h,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    stride_lse_h,  # every lse is [H, T] with this head stride and unit token stride
    head_size,
    HAS_OUT_LSE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    side = tl.arange(0, 2)  # 0: A (prefix), 1: B (suffix)
    is_a = side == 0
    lse_in = tl.load(tl.where(is_a, A_LSE, B_LSE) + h * stride_lse_h + t).to(tl.float32)  # [2]
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_size
    rows = tl.where(is_a, A + t * stride_a_t + h * stride_a_h, B + t * stride_b_t + h * stride_b_h)  # [2]
    parts = tl.load(rows[:, None] + offs[None, :], mask=mask[None, :], other=0.0).to(tl.float32)  # [2, BLOCK_D]
    o, lse = merge_by_lse(parts, lse_in, False)
    tl.store(OUT + t * stride_out_t + h * stride_out_h + offs, o.to(OUT.dtype.element_ty), mask=mask)
    if HAS_OUT_LSE:
        tl.store(OUT_LSE + h * stride_lse_h + t, lse)


def merge_attn_states_torch(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch merge; returns (output [T, H, D] float32, lse [H, T] float32). Shapes as in merge_attn_states."""
    lse_a = prefix_lse.float().transpose(0, 1)[..., None]  # [T, H, 1]
    lse_b = suffix_lse.float().transpose(0, 1)[..., None]
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_a = torch.where(lse_a == float("-inf"), torch.zeros_like(lse_a), torch.exp(lse_a - m_safe))
    w_b = torch.where(lse_b == float("-inf"), torch.zeros_like(lse_b), torch.exp(lse_b - m_safe))
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total.clamp_min(1e-38), torch.zeros_like(total))
    zero = torch.zeros((), dtype=torch.float32, device=prefix_output.device)
    out = torch.where(w_a > 0, prefix_output.float() * (w_a * inv), zero) + torch.where(
        w_b > 0, suffix_output.float() * (w_b * inv), zero
    )
    lse = torch.where(total > 0, m_safe + torch.log(total.clamp_min(1e-38)), torch.full_like(total, float("-inf")))
    return out, lse[..., 0].transpose(0, 1).contiguous()


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: Optional[torch.Tensor] = None,
    impl: Literal["auto", "triton", "torch"] = "auto",
) -> torch.Tensor:
    """Merge two partial attention outputs over disjoint key sets into ``output``.

    Parameters
    ----------
    output : [T, H, D] any float dtype; written (may alias ``prefix_output`` or ``suffix_output``).
    prefix_output, suffix_output : [T, H, D] partial outputs (each normalised over its own keys).
    prefix_lse, suffix_lse : [H, T] float32 natural-log log-sum-exp of each side's scaled logits; -inf = no keys.
    output_lse : [H, T] float32 or None; receives the merged lse (may alias an input lse).
    impl : "triton" (a CUDA tensor, or the CPU under TRITON_INTERPRET=1), "torch", or "auto" (Triton on CUDA).

    Returns
    -------
    output
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    num_tokens, num_heads, head_size = output.shape
    for name, t in (("prefix_output", prefix_output), ("suffix_output", suffix_output)):
        if t.shape != output.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(output.shape)}")
    for name, t in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if t is not None and t.shape != (num_heads, num_tokens):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({num_heads}, {num_tokens})")
    use_triton = impl == "triton" or (impl == "auto" and output.is_cuda)
    if not use_triton or num_tokens == 0:
        out, lse = merge_attn_states_torch(prefix_output, prefix_lse, suffix_output, suffix_lse)
        output.copy_(out)
        if output_lse is not None:
            output_lse.copy_(lse)
        return output
    prefix_lse = prefix_lse.contiguous()
    suffix_lse = suffix_lse.contiguous()
    lse_out = output_lse
    if lse_out is not None and not lse_out.is_contiguous():
        lse_out = torch.empty_like(prefix_lse)
    for t in (output, prefix_output, suffix_output):
        if t.stride(-1) != 1:
            raise ValueError("merge_attn_states needs unit stride in the head dimension")
    _merge_attn_states_kernel[(num_tokens, num_heads)](
        output,
        lse_out if lse_out is not None else prefix_lse,
        prefix_output,
        prefix_lse,
        suffix_output,
        suffix_lse,
        output.stride(0),
        output.stride(1),
        prefix_output.stride(0),
        prefix_output.stride(1),
        suffix_output.stride(0),
        suffix_output.stride(1),
        prefix_lse.stride(0),
        head_size,
        HAS_OUT_LSE=lse_out is not None,
        BLOCK_D=next_power_of_2(head_size),
    )
    if output_lse is not None and lse_out is not output_lse:
        output_lse.copy_(lse_out)
    return output
