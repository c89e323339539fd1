"""merge_attn_states (Triton and torch) against a float64 oracle, -inf sides included."""

import math
import os

import pytest
import torch

from attnbackends.ops.merge_attn_states import merge_attn_states

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch"] + (["triton"] if TRITON_OK else [])


def oracle(o_a, lse_a, o_b, lse_b):
    """float64 merge written from the formula, one (token, head) at a time."""
    T, H, D = o_a.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((H, T), -math.inf, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            la, lb = float(lse_a[h, t]), float(lse_b[h, t])
            if la == -math.inf and lb == -math.inf:
                continue
            m = max(la, lb)
            wa = 0.0 if la == -math.inf else math.exp(la - m)
            wb = 0.0 if lb == -math.inf else math.exp(lb - m)
            acc = torch.zeros(D, dtype=torch.float64)
            if wa:
                acc += o_a[t, h].double() * wa
            if wb:
                acc += o_b[t, h].double() * wb
            out[t, h] = acc / (wa + wb)
            lse[h, t] = m + math.log(wa + wb)
    return out, lse


def make(T, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    o_a = torch.randn(T, H, D, generator=g).to(dtype)
    o_b = torch.randn(T, H, D, generator=g).to(dtype)
    lse_a = torch.randn(H, T, generator=g) * 4
    lse_b = torch.randn(H, T, generator=g) * 4
    # -inf rows: prefix only, suffix only, both; the ignored side holds NaN to prove it is not read into the result.
    lse_a[0, 0] = -math.inf
    o_a[0, 0] = float("nan")
    lse_b[1 % H, 1] = -math.inf
    o_b[1, 1 % H] = float("nan")
    lse_a[0, 2] = lse_b[0, 2] = -math.inf
    o_a[2, 0] = o_b[2, 0] = float("nan")
    lse_a[:, 3] = 80.0  # far apart: one side dominates without overflow
    lse_b[:, 3] = -80.0
    return o_a, lse_a, o_b, lse_b


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("D", [16, 24])
def test_merge_matches_oracle(impl, dtype, atol, D):
    T, H = 6, 3
    o_a, lse_a, o_b, lse_b = make(T, H, D, dtype, seed=D)
    want_o, want_lse = oracle(o_a, lse_a, o_b, lse_b)
    out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEVICE)
    out_lse = torch.full((H, T), float("nan"), dtype=torch.float32, device=DEVICE)
    merge_attn_states(
        out, o_a.to(DEVICE), lse_a.to(DEVICE), o_b.to(DEVICE), lse_b.to(DEVICE), output_lse=out_lse, impl=impl
    )
    out, out_lse = out.cpu(), out_lse.cpu()
    assert not torch.isnan(out).any()
    assert torch.equal(out[2, 0].float(), torch.zeros(D)), "both sides -inf: output 0"
    assert out_lse[0, 2] == -math.inf
    torch.testing.assert_close(out.double(), want_o, atol=atol, rtol=atol)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(out_lse), finite)
    torch.testing.assert_close(out_lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_in_place_aliasing(impl):
    """output and output_lse may alias the suffix inputs (the chunked-prefill accumulation pattern)."""
    T, H, D = 5, 2, 16
    o_a, lse_a, o_b, lse_b = make(T, H, D, torch.float32, seed=3)
    want_o, want_lse = oracle(o_a, lse_a, o_b, lse_b)
    acc, acc_lse = o_b.clone().to(DEVICE), lse_b.clone().to(DEVICE)
    merge_attn_states(acc, o_a.to(DEVICE), lse_a.to(DEVICE), acc, acc_lse, output_lse=acc_lse, impl=impl)
    torch.testing.assert_close(acc.cpu().double(), want_o, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(acc_lse.cpu().double()[finite], want_lse[finite], atol=1e-5, rtol=1e-5)


def test_merge_shape_errors():
    o = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="prefix_lse"):
        merge_attn_states(o, o, torch.zeros(2, 3), o, torch.zeros(3, 2), impl="torch")
    with pytest.raises(ValueError, match="impl"):
        merge_attn_states(o, o, torch.zeros(3, 2), o, torch.zeros(3, 2), impl="cuda")
