"""Every reach into another library's private surface, with one version table (:data:`PRIVATE_SURFACES`).

Each surface names the package whose internals it uses and the versions it was checked against (None: any version,
guarded by a feature test instead). Where a surface cannot be used, the caller takes its public fallback and
:func:`fallback_reason` logs why, once per surface and reason.

Surfaces: FlashInfer's decode-wrapper fields (fast re-planning, :mod:`attnbackends.flashinfer.fast_plan`),
FlashInfer's JIT module generators (ahead-of-time builds, :mod:`attnbackends.flashinfer.warmup`), Triton's
compiled-kernel launcher (:class:`DirectLauncher`), aten's memory-efficient attention with its
log-sum-exp (:func:`efficient_attention_with_lse`), Triton's scratch allocator
(:func:`ensure_triton_scratch_allocator`), FlashInfer MLA's planned page ids (contained in place by
:mod:`attnbackends.mla.backends` for device-only block tables) and flash-attn 4's ``flash_attn.cute``
(:func:`flash_attn_cute_available`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import triton
from triton import knobs

__all__ = [
    "DescriptorLauncher",
    "DirectLauncher",
    "PRIVATE_SURFACES",
    "PrivateSurface",
    "cuda_sleep",
    "efficient_attention_with_lse",
    "ensure_triton_scratch_allocator",
    "fallback_reason",
    "flash_attn_cute_available",
    "flashinfer_jit_generators",
    "gluon_available",
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
        "triton", "launching the CompiledKernel that a JIT launch returns through its own launcher "
        "(compiled.run(grid, stream, compiled.function, compiled.packed_metadata, hooks, *args))",
        frozenset({"3.6.0"})),
    "aten_efficient_attention": PrivateSurface(
        "torch", "torch.ops.aten._scaled_dot_product_efficient_attention (SDPA's kernel, returning the LSE)"),
    "triton_scratch_allocator": PrivateSurface(
        "triton", "triton.runtime._allocation._allocator (the context's scratch allocator, read to leave an "
        "allocator the application set in place)"),
    "flashinfer_mla_kv_indices": PrivateSurface(
        "flashinfer-python", "BatchMLAPagedAttentionWrapper.plan() keeping (outside CUDA-graph mode) the device "
        "kv_indices tensor it is given, so page ids contained in place after plan() are the ones run() reads "
        "(checked by tests/mla/test_mla_page_containment.py::test_flashinfer_mla_cuda_table_without_host_copy)",
        frozenset({"0.6.13"})),
    "torch_cuda_sleep": PrivateSurface(
        "torch", "torch.cuda._sleep (a kernel spinning for a number of GPU clock cycles, used to put the host "
        "ahead of the GPU in checks)"),
    "flash_attn_cute": PrivateSurface(
        "flash-attn-4", "flash_attn.cute, shipped inside a namespace package flash_attn"),
    # MLA launch path (DescriptorLauncher, gluon_available)
    "triton_descriptor_launch": PrivateSurface(
        "triton", "a compiled kernel's C launcher behind the wrapper that encodes its host TMA descriptors on every "
        "launch (the wrapper's closure variable 'launcher' and 'tensordesc_indices', and "
        "triton.backends.nvidia.driver.make_tensordesc_arg, which encodes one descriptor)",
        frozenset({"3.6.0"})),
    "triton_gluon": PrivateSurface(
        "triton", "triton.experimental.gluon and its Hopper language (an experimental package: checked by importing "
        "it)"),
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
@lru_cache(maxsize=None)
def _direct_launch_unsupported() -> Optional[str]:
    return surface_unsupported_reason("triton_compiled_launch")


def _raw_stream_getters():
    try:
        from torch._C import _cuda_getCurrentRawStream, _cuda_getDevice
    except ImportError:  # pragma: no cover - torch without CUDA bindings
        return None, None
    return _cuda_getCurrentRawStream, _cuda_getDevice


_current_raw_stream, _current_device = _raw_stream_getters()


def _launch_hooks_set() -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps them in HookChain objects, older ones use None)."""
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class DirectLauncher:
    """One kernel's launches, keyed by specialisation.

    Parameters
    ----------
    kernel : the ``@triton.jit`` function.
    constexpr_names : the kernel's constexpr parameters, in signature order, all after its runtime parameters.
    """

    __slots__ = ("kernel", "constexpr_names", "_compiled", "_fallback_reason")

    def __init__(self, kernel: Any, constexpr_names: Sequence[str]) -> None:
        self.kernel = kernel
        self.constexpr_names = tuple(constexpr_names)
        self._compiled: dict[Hashable, tuple] = {}
        self._fallback_reason: str | None = None

    def launch_on(self, device: torch.device, key: Hashable, grid: tuple[int, int, int], args: tuple,
                  constexprs: tuple, num_warps: int = 4, num_stages: int = 3) -> None:
        """:meth:`__call__` on ``device``'s current stream, switching the current device when it differs."""
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device.index):
                return self(key, grid, args, constexprs, num_warps, num_stages)
        return self(key, grid, args, constexprs, num_warps, num_stages)

    def __call__(self, key: Hashable, grid: tuple[int, int, int], args: tuple, constexprs: tuple,
                 num_warps: int, num_stages: int) -> None:
        """Launch on the current CUDA stream. ``args``: the runtime arguments in signature order; ``constexprs``:
        the values of ``constexpr_names``, in that order."""
        entry = self._compiled.get(key)
        if entry is not None and not _launch_hooks_set():
            run, function, packed = entry
            run(grid[0], grid[1], grid[2], _current_raw_stream(_current_device()), function, packed, None, None,
                None, *args, *constexprs)
            return
        compiled = self.kernel[grid](*args, **dict(zip(self.constexpr_names, constexprs)), num_warps=num_warps,
                                     num_stages=num_stages)
        if entry is None:
            self._remember(key, compiled)

    def _remember(self, key: Hashable, compiled: Any) -> None:
        reason = None
        if compiled is None:
            reason = "the kernel runs under the Triton interpreter"
        elif _direct_launch_unsupported() is not None:
            reason = _direct_launch_unsupported()
        elif _current_raw_stream is None:
            reason = "torch has no CUDA stream bindings"
        elif _launch_hooks_set():
            reason = "Triton launch hooks are set"
        elif not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            reason = f"Triton {triton.__version__}'s compiled kernel has no run/function/packed_metadata"
        if reason is not None:
            if reason != self._fallback_reason:
                fallback_reason("triton_compiled_launch",
                                f"{getattr(self.kernel, '__name__', 'kernel')}: launched through the JIT on every "
                                f"call ({reason})")
                self._fallback_reason = reason
            return
        self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)


# --------------------------------------------------------------------------------- Triton's scratch allocator
def _torch_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for kernels that make tensor descriptors on the device, from torch's caching allocator."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_scratch_allocator() -> None:
    """Give Triton a scratch allocator (torch's caching allocator) for kernels that make TMA descriptors on the
    device, unless this context already has one (an application's own is left in place)."""
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        unset = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError) as exc:
        fallback_reason("triton_scratch_allocator", f"cannot read Triton's allocator ({exc}); setting ours")
        unset = True
    if unset:
        triton.set_allocator(_torch_scratch)


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


def cuda_sleep(cycles: int) -> None:
    """Queue on the current CUDA stream a kernel that spins for ``cycles`` GPU clock cycles, so that the host runs
    ahead of the GPU. Raises RuntimeError where torch lacks the kernel."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._sleep (surface torch_cuda_sleep)")
    sleep(int(cycles))


# -------------------------------------------------------------------------------------------------- flash-attn
def flash_attn_cute_available() -> bool:
    """Whether flash-attn 4's ``flash_attn.cute`` is installed. Its wheel ships ``flash_attn`` as a namespace
    package (no ``flash_attn/__init__.py``), so the test is on the ``cute`` subpackage, which must be a real module."""
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


# =================================================================================================== MLA launch path
# Gluon availability and the launcher for kernels that take host TMA descriptors (the MLA decode kernels).

try:
    from triton.experimental import gluon as _gluon  # noqa: F401
    from triton.experimental.gluon.language.nvidia import hopper as _gluon_hopper  # noqa: F401

    _GLUON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as _exc:  # a Triton without Gluon: the Triton kernels serve every GPU
    _GLUON_IMPORT_ERROR = _exc


def gluon_available() -> bool:
    """Whether the installed Triton ships Gluon's Hopper language (``triton.experimental.gluon``)."""
    return _GLUON_IMPORT_ERROR is None


@lru_cache(maxsize=None)
def _descriptor_encoder() -> tuple[Optional[Callable[..., list]], Optional[str]]:
    """(Triton's encoder of one host TMA descriptor into launcher arguments, None) or (None, why not)."""
    reason = surface_unsupported_reason("triton_descriptor_launch")
    if reason is not None:
        return None, reason
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError as exc:
        return None, f"triton.backends.nvidia.driver.make_tensordesc_arg: {exc}"
    return make_tensordesc_arg, None


def _raw_descriptor_launch(compiled: Any, positions: tuple[int, ...]) -> tuple[Optional[tuple], Optional[str]]:
    """(launch, base arguments, descriptor metadata) that launch ``compiled`` with descriptors encoded by the caller,
    or (None, why not)."""
    encode, reason = _descriptor_encoder()
    if encode is None:
        return None, reason
    run = compiled.run
    wrapper = getattr(run, "launch", None)
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not cells:
        return None, "the compiled kernel's launcher does not wrap its descriptors"
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    raw, indices = free.get("launcher"), free.get("tensordesc_indices")
    if not callable(raw) or indices is None or sorted(indices) != list(positions):
        return None, f"the launcher's descriptor arguments {sorted(indices or ())} are not {list(positions)}"
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None, "the kernel needs launch scratch memory"
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
    base = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)
    return (raw, base, tuple(metas)), None


class DescriptorLauncher(DirectLauncher):
    """:class:`DirectLauncher` for kernels that take host TMA descriptors (Triton's ``TensorDescriptor`` or
    Gluon's) at argument ``descriptor_positions``, or that declare ``num_warps`` as a constexpr parameter (Gluon).

    Triton's launcher encodes every descriptor argument (``cuTensorMapEncodeTiled``) on every launch; this one
    encodes each descriptor object once per compiled kernel and launches the C launcher with the encoded arguments
    (surface ``triton_descriptor_launch``; elsewhere it launches like :class:`DirectLauncher`). A descriptor object
    must therefore describe the same memory for as long as it is launched with: make a new one for a new tensor.
    """

    __slots__ = ("descriptor_positions", "_raw", "_encoded")

    #: Encoded descriptors kept per launcher before the oldest are dropped (each holds its tensor).
    MAX_ENCODED = 4096

    def __init__(self, kernel: Any, constexpr_names: Sequence[str], descriptor_positions: Sequence[int] = ()) -> None:
        super().__init__(kernel, constexpr_names)
        self.descriptor_positions = tuple(descriptor_positions)
        self._raw: dict[Hashable, tuple] = {}
        self._encoded: dict[tuple, tuple[Any, list]] = {}

    def encoded_args(self, key: Hashable, args: tuple, metas: tuple) -> list:
        """``args`` with each descriptor replaced by its encoded launcher arguments (encoded on first sight, per
        compiled kernel ``key`` and descriptor object)."""
        final: list = []
        at = 0
        for i, pos in enumerate(self.descriptor_positions):
            desc = args[pos]
            slot = (key, id(desc))
            hit = self._encoded.get(slot)
            if hit is None or hit[0] is not desc:
                if len(self._encoded) >= self.MAX_ENCODED:
                    self._encoded.clear()
                hit = self._encoded[slot] = (desc, _descriptor_encoder()[0](desc, metas[i]))
            final += args[at:pos]
            final += hit[1]
            at = pos + 1
        final += args[at:]
        return final

    def __call__(self, key: Hashable, grid: tuple[int, int, int], args: tuple, constexprs: tuple,
                 num_warps: int, num_stages: int) -> None:
        raw = self._raw.get(key)
        if raw is not None and not _launch_hooks_set():
            raw[0](grid[0], grid[1], grid[2], _current_raw_stream(_current_device()), *raw[1],
                   *self.encoded_args(key, args, raw[2]), *constexprs)
            return
        entry = self._compiled.get(key)
        if entry is not None and not _launch_hooks_set():
            run, function, packed = entry
            run(grid[0], grid[1], grid[2], _current_raw_stream(_current_device()), function, packed, None, None,
                None, *args, *constexprs)
            return
        options = dict(zip(self.constexpr_names, constexprs))
        options.setdefault("num_warps", num_warps)
        options.setdefault("num_stages", num_stages)
        compiled = self.kernel[grid](*args, **options)
        if entry is None:
            self._remember(key, compiled)
            if key in self._compiled and self.descriptor_positions:
                raw, reason = _raw_descriptor_launch(compiled, self.descriptor_positions)
                if raw is not None:
                    self._raw[key] = raw
                else:
                    fallback_reason("triton_descriptor_launch",
                                    f"{getattr(self.kernel, '__name__', 'kernel')}: descriptors encoded on every "
                                    f"launch ({reason})")
