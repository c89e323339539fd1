"""Per-dtype tolerances for comparing a backend's output with the float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "tolerance_for", "assert_close_to_oracle"]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Outputs are softmax-weighted averages of N(0, 1) values: |o| <~ 1. The budget covers the rounding of the output
# and of the probabilities fed to a low-precision P @ V product (tensor cores take P in the input dtype).
_TOLERANCES = {
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3),  # tf32 matrix units on GPUs
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3),
    torch.bfloat16: Tolerance(atol=2.5e-2, rtol=2.5e-2),
    torch.float64: Tolerance(atol=1e-9, rtol=1e-9),
}


def tolerance_for(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> Tolerance:
    """Tolerance for outputs in ``dtype``. fp8 caches compare against the oracle's fp8 round trip of K/V, so only
    the extra rounding of dequantised values in the kernel's input dtype is added."""
    tol = _TOLERANCES[dtype]
    if kv_cache_dtype.startswith("fp8"):
        return Tolerance(atol=tol.atol * 2, rtol=tol.rtol * 2)
    return tol


def assert_close_to_oracle(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str = "output") -> None:
    """Assert ``actual`` matches ``expected`` elementwise within ``tol``; NaN never passes. The message names the
    worst element and the relative Frobenius error."""
    actual64 = actual.detach().double().cpu()
    expected = expected.double().cpu()
    if actual64.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual64.shape)} != expected {tuple(expected.shape)}")
    nan = torch.isnan(actual64)
    if bool(nan.any()):
        idx = tuple(int(i) for i in torch.nonzero(nan)[0])
        raise AssertionError(f"{what}: {int(nan.sum())} NaN values (first at {idx}): unwritten or invalid output")
    err = (actual64 - expected).abs()
    bound = tol.atol + tol.rtol * expected.abs()
    bad = err > bound
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        rel = float((actual64 - expected).norm() / expected.norm().clamp_min(1e-30))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside atol={tol.atol}, rtol={tol.rtol}; "
            f"first at {idx}: got {float(actual64[idx]):.6g}, expected {float(expected[idx]):.6g}; "
            f"max abs err {float(err.max()):.3g}; relative Frobenius error {rel:.3g}"
        )
