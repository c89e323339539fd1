"""Launch a ``@triton.jit`` kernel through its compiled launcher after the first launch per specialisation.

Triton's ``kernel[grid](*args)`` binds and specialises every argument on every call (its cost grows with the
argument count, tens of microseconds for the attention kernel). A :class:`DirectLauncher` sends the first call
for a key through that path, keeps the compiled kernel it returns, and later calls with the same key go straight
to the compiled kernel's launcher. The caller's key must name everything the JIT specialises on for the arguments
that can change: dtypes, the pointer alignments and integer values it specialises (strides), the constexprs and
the launch options; arguments whose values vary freely are marked ``do_not_specialize`` in the kernel.

Falls back to the JIT on every call, with a logged reason, under the interpreter, with Triton launch hooks set
(profilers), or where the compiled kernel lacks the launcher attributes this relies on (tested with Triton 3.6).
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

import triton
from triton import knobs

logger = logging.getLogger(__name__)

__all__ = ["DirectLauncher"]


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
        elif _current_raw_stream is None:
            reason = "torch has no CUDA stream bindings"
        elif _launch_hooks_set():
            reason = "Triton launch hooks are set"
        elif not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            reason = f"Triton {triton.__version__}'s compiled kernel has no run/function/packed_metadata"
        if reason is not None:
            if reason != self._fallback_reason:
                logger.info("%s: launching through the JIT on every call (%s)",
                            getattr(self.kernel, "__name__", "kernel"), reason)
                self._fallback_reason = reason
            return
        self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
