"""Per-dtype tolerances for comparing a backend's output with the float64 oracle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ..spec import DTYPES, KV_CACHE_DTYPES, dtype_name, torch_dtype_of

__all__ = ["Tolerance", "tolerance_for", "assert_close_to_oracle"]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|``, and over the whole output
    ``||actual - expected|| <= rel_fro * ||expected||`` (Frobenius norms): rounding spreads evenly and stays far
    below ``rel_fro``, while a systematic error (a scale off by 1%) moves every element and fails it."""

    atol: float
    rtol: float
    rel_fro: float = float("inf")

    def excess(self, actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        """Elementwise ``|actual - expected| - (atol + rtol * |expected|)`` in float64: > 0 outside the tolerance
        (NaN where either is NaN)."""
        actual, expected = actual.detach().double(), expected.detach().double()
        return (actual - expected).abs() - (self.atol + self.rtol * expected.abs())


# Outputs are softmax-weighted averages of N(0, 1) values: |o| <~ 1. The elementwise budget covers the rounding of
# the output and of the probabilities fed to a low-precision P @ V product (tensor cores take P in the input dtype);
# the aggregate bound sits at about twice the rounding's relative Frobenius error, under half of a 1% scale error.
_TOLERANCES = {
    torch.float32: Tolerance(atol=2e-3, rtol=2e-3, rel_fro=2e-3),  # tf32 matrix units on GPUs
    torch.float16: Tolerance(atol=4e-3, rtol=4e-3, rel_fro=2e-3),
    torch.bfloat16: Tolerance(atol=2.5e-2, rtol=2.5e-2, rel_fro=5e-3),
    torch.float64: Tolerance(atol=1e-9, rtol=1e-9, rel_fro=1e-9),
}


def _as_torch_dtype(dtype: Union[torch.dtype, str]) -> torch.dtype:
    if dtype in ("float64", torch.float64):
        return torch.float64
    try:
        return torch_dtype_of(dtype_name(dtype))
    except ValueError:
        raise ValueError(f"dtype {dtype!r} has no tolerance; allowed: {', '.join(DTYPES)}, float64 "
                         "(names or torch dtypes)") from None


def tolerance_for(dtype: Union[torch.dtype, str], kv_cache_dtype: str = "auto") -> Tolerance:
    """Tolerance for outputs in ``dtype`` (a torch dtype or its name, e.g. ``"bfloat16"``).

    fp8 caches are judged against the oracle on the dequantised values (the oracle reads back exactly what the
    cache holds), so only the extra rounding of dequantised values in the kernel's input dtype is added to the
    elementwise budget; the aggregate bound stays, so a 1% scale error still fails."""
    tol = _TOLERANCES[_as_torch_dtype(dtype)]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype.startswith("fp8"):
        return Tolerance(atol=tol.atol * 2, rtol=tol.rtol * 2, rel_fro=tol.rel_fro)
    return tol


def assert_close_to_oracle(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str = "output") -> None:
    """Assert ``actual`` matches ``expected`` within ``tol`` (elementwise and in relative Frobenius norm); NaN never
    passes. The message names the worst element and the relative Frobenius error."""
    actual64 = actual.detach().double().cpu()
    expected = expected.double().cpu()
    if actual64.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual64.shape)} != expected {tuple(expected.shape)}")
    nan = torch.isnan(actual64)
    if bool(nan.any()):
        idx = tuple(int(i) for i in torch.nonzero(nan)[0])
        raise AssertionError(f"{what}: {int(nan.sum())} NaN values (first at {idx}): unwritten or invalid output")
    bad = tol.excess(actual64, expected) > 0
    rel = float((actual64 - expected).norm() / expected.norm().clamp_min(1e-30))
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside atol={tol.atol}, rtol={tol.rtol}; "
            f"first at {idx}: got {float(actual64[idx]):.6g}, expected {float(expected[idx]):.6g}; "
            f"max abs err {float((actual64 - expected).abs().max()):.3g}; relative Frobenius error {rel:.3g}"
        )
    if rel > tol.rel_fro:
        raise AssertionError(
            f"{what}: relative Frobenius error {rel:.3g} > {tol.rel_fro} (every element is within atol={tol.atol}, "
            f"rtol={tol.rtol}, but the output is off as a whole: a scale error?)"
        )
