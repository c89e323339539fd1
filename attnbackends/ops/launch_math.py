"""Integer helpers for kernel launch parameters, on the host.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``@triton.jit`` functions: called from Python they go through the
JIT's call machinery, several per launch. These plain-Python versions skip it, which matters on host-bound decode
steps (a KV-cache write per layer, the FlashInfer page-table kernels per step; benchmarks/NOTES.md).
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
