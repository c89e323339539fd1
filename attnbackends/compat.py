"""Every reach into another library's private surface, with one version table (:data:`PRIVATE_SURFACES`).

Each surface names the package whose internals it uses and the versions it was checked against (None: any version,
guarded by a feature test instead). Where a surface cannot be used, the caller takes its public fallback and
:func:`fallback_reason` logs why, once per surface and reason.

Surfaces: FlashInfer's decode-wrapper fields (fast re-planning, :mod:`attnbackends.flashinfer.fast_plan`),
FlashInfer's JIT module generators (ahead-of-time builds, :mod:`attnbackends.flashinfer.warmup`), Triton's
compiled-kernel launcher (:func:`launch_compiled_triton_kernel`), aten's memory-efficient attention with its
log-sum-exp (:func:`efficient_attention_with_lse`) and flash-attn 4's ``flash_attn.cute``
(:func:`flash_attn_cute_available`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

import torch

__all__ = [
    "PRIVATE_SURFACES",
    "PrivateSurface",
    "efficient_attention_with_lse",
    "fallback_reason",
    "flash_attn_cute_available",
    "flashinfer_jit_generators",
    "launch_compiled_triton_kernel",
    "package_version",
    "surface_unsupported_reason",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivateSurface:
    """A private API of ``package`` that this library uses: what it is and the versions it was checked against."""

    package: str
    what: str
    tested_versions: Optional[frozenset[str]] = None  # None: any version (a feature test guards it)


#: The version table: one entry per private surface.
PRIVATE_SURFACES: dict[str, PrivateSurface] = {
    "flashinfer_decode_replan": PrivateSurface(
        "flashinfer-python", "BatchDecodeWithPagedKVCacheWrapper's private fields, re-planned without plan()",
        frozenset({"0.6.13"})),
    "flashinfer_jit": PrivateSurface(
        "flashinfer-python", "flashinfer.jit module generators (gen_batch_decode_module, gen_batch_prefill_module, "
        "gen_cascade_module) and flashinfer.utils.determine_attention_backend (their signatures are checked by "
        "calling them: a mismatch is a logged fallback)"),
    "triton_compiled_launch": PrivateSurface(
        "triton", "launching the CompiledKernel that a JIT launch returns: compiled[grid](*args, *constexprs)",
        frozenset({"3.6.0"})),
    "aten_efficient_attention": PrivateSurface(
        "torch", "torch.ops.aten._scaled_dot_product_efficient_attention (SDPA's kernel, returning the LSE)"),
    "flash_attn_cute": PrivateSurface(
        "flash-attn-4", "flash_attn.cute, shipped inside a namespace package flash_attn"),
}


@lru_cache(maxsize=None)
def package_version(distribution: str) -> Optional[str]:
    """The installed version of a distribution (e.g. "flashinfer-python"), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def surface_unsupported_reason(surface: str, version: Optional[str] = None) -> Optional[str]:
    """Why ``surface`` (a key of :data:`PRIVATE_SURFACES`) cannot be used with ``version`` (default: the installed
    one), or None when it can."""
    entry = PRIVATE_SURFACES[surface]
    version = version if version is not None else package_version(entry.package)
    if entry.tested_versions is None:
        return None
    if version is None:
        return f"{entry.package} is not installed"
    if version.split("+")[0] not in entry.tested_versions:
        return (f"{entry.what}: {entry.package} {version} is not one of the tested versions "
                f"{sorted(entry.tested_versions)}")
    return None


_LOGGED: set[tuple[str, str]] = set()


def fallback_reason(surface: str, reason: str) -> str:
    """Log, once per ``surface`` and ``reason``, that the public fallback is used instead; returns ``reason``."""
    if (surface, reason) not in _LOGGED:
        _LOGGED.add((surface, reason))
        logger.info("%s: using the public fallback (%s)", surface, reason)
    return reason


# ------------------------------------------------------------------------------------------- Triton's launcher
_COMPILED: dict[tuple, Any] = {}


def launch_compiled_triton_kernel(kernel: Any, key: tuple, grid: tuple, args: tuple, constexprs: dict[str, Any],
                                  device: Optional[torch.device] = None) -> None:
    """Launch a ``@triton.jit`` kernel; after its first launch per ``key``, launch the compiled kernel directly.

    The first launch goes through the JIT (``kernel[grid](*args, **constexprs)``), which compiles and returns the
    compiled kernel; later launches call Triton's launcher for it (``compiled[grid](*args, *constexprs)``),
    skipping the JIT's per-call argument binding and cache lookup. Valid only when the kernel specialises on
    nothing but what ``key`` names: give every argument a fixed dtype and alignment per key, and disable integer
    specialisation (``do_not_specialize``) or name it in ``key``.

    Parameters
    ----------
    kernel : the ``@triton.jit`` function.
    key : hashable; what the compiled kernel depends on (e.g. kernel name, device index, dtypes, constexprs).
    grid : the launch grid (a tuple of ints).
    args : the runtime arguments, in signature order.
    constexprs : the constexpr arguments, in signature order (after ``args``).
    device : the CUDA device to launch on (its current stream); default: the current device.

    Off a checked Triton version (see :data:`PRIVATE_SURFACES`) every launch goes through the JIT.
    """
    if device is not None and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device.index):  # Triton launches on the current device's stream
            return launch_compiled_triton_kernel(kernel, key, grid, args, constexprs)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[grid](*args, *constexprs.values())
        return None
    launched = kernel[grid](*args, **constexprs)
    if _direct_launch_ok():
        _COMPILED[key] = launched
    return None


@lru_cache(maxsize=None)
def _direct_launch_ok() -> bool:
    reason = surface_unsupported_reason("triton_compiled_launch")
    if reason is not None:
        fallback_reason("triton_compiled_launch", reason)
    return reason is None


# ------------------------------------------------------------------------------------------------- FlashInfer JIT
def flashinfer_jit_generators() -> Optional[dict[str, Callable[..., Any]]]:
    """FlashInfer's JIT module generators for ahead-of-time builds, or None (reason logged) where this flashinfer's
    are not the checked ones: keys gen_batch_decode_module, gen_batch_prefill_module, gen_cascade_module,
    determine_attention_backend."""
    reason = surface_unsupported_reason("flashinfer_jit")
    if reason is None:
        try:
            from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
            from flashinfer.jit.cascade import gen_cascade_module
            from flashinfer.utils import determine_attention_backend
        except ImportError as exc:
            reason = f"importing them failed: {exc}"
        else:
            return dict(gen_batch_decode_module=gen_batch_decode_module,
                        gen_batch_prefill_module=gen_batch_prefill_module, gen_cascade_module=gen_cascade_module,
                        determine_attention_backend=determine_attention_backend)
    fallback_reason("flashinfer_jit", reason)
    return None


# ------------------------------------------------------------------------------------------------------- aten
def efficient_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                                 scale: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """SDPA's memory-efficient kernel with its log-sum-exp, or None (reason logged) where aten lacks it.

    q : [H, Q, D]; k : [H, K, D]; v : [H, K, Dv]. Returns (out [H, Q, Dv], lse [H, Q] float32, natural log).
    """
    op = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
    if op is None:
        fallback_reason("aten_efficient_attention", f"torch {torch.__version__} has no such op")
        return None
    out, lse = op(q[None], k[None], v[None], None, True, 0.0, causal, scale=scale)[:2]
    return out[0], lse[0, :, : q.shape[1]]


# -------------------------------------------------------------------------------------------------- flash-attn
def flash_attn_cute_available() -> bool:
    """Whether flash-attn 4's ``flash_attn.cute`` is installed. Its wheel ships ``flash_attn`` as a namespace
    package (no ``flash_attn/__init__.py``), so the test is on the ``cute`` subpackage, which must be a real module."""
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")
