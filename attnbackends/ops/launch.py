"""The launch machinery every Triton and Gluon kernel family goes through: cached compiled launchers
(:class:`DirectLauncher`, :class:`DescriptorLauncher` for kernels taking host TMA descriptors) and prepared launches
(:class:`PreparedLaunch`: the C launcher's arguments worked out once, launched with :func:`launch_prepared`,
:func:`launch_prepared_sequence` or :func:`launch_keeping_prepared`).

The reaches into Triton's private launcher surfaces (the compiled kernel's C launcher, the descriptor encoder, the
raw CUDA stream) are :mod:`attnbackends.compat`'s, with their version table; this module only uses them.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence

import torch
import triton

from ..compat import (
    descriptor_encoder, direct_launch_unsupported_reason, fallback_reason, launch_hooks_set, raw_descriptor_launch,
    raw_stream_getters,
)

__all__ = [
    "DescriptorLauncher",
    "DirectLauncher",
    "PreparedLaunch",
    "launch_keeping_prepared",
    "launch_prepared",
    "launch_prepared_sequence",
]

_raw_stream, _raw_device = raw_stream_getters()


def _current_stream() -> int:
    """The current CUDA stream of the current device, as the C launcher takes it."""
    return _raw_stream(_raw_device())


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
        if entry is not None and not launch_hooks_set():
            run, function, packed = entry
            run(grid[0], grid[1], grid[2], _current_stream(), function, packed, None, None,
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
        elif direct_launch_unsupported_reason() is not None:
            reason = direct_launch_unsupported_reason()
        elif _raw_stream is None:
            reason = "torch has no CUDA stream bindings"
        elif launch_hooks_set():
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


class PreparedLaunch(NamedTuple):
    """A cached launch worked out once (:meth:`DescriptorLauncher.prepare`): the C launcher, the arguments it takes
    before the kernel's, and the kernel's own after the ones each call passes (descriptors encoded, each tensor as
    its device address, constexprs appended); ``keep`` holds the tensors whose addresses ``tail`` passes, for as
    long as the launch is kept."""

    run: Callable[..., Any]
    head: tuple
    tail: tuple
    keep: tuple = ()


def _addresses(args: Sequence[Any]) -> tuple[tuple, tuple]:
    """(``args`` with each tensor replaced by its device address, the tensors). Triton's C launcher takes an integer
    pointer argument as it is, where for a tensor it calls ``data_ptr()`` and asks the driver about the address."""
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if not tensors:
        return tuple(args), ()
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), tensors


def launch_prepared(prepared: PreparedLaunch, grid: tuple[int, int, int]) -> bool:
    """Launch ``prepared`` (prepared without call arguments) over ``grid`` on the current CUDA stream; False
    (nothing launched) where a Triton launch hook is installed, which only a launch through
    :class:`DescriptorLauncher` calls."""
    if launch_hooks_set():
        return False
    prepared.run(grid[0], grid[1], grid[2], _current_stream(), *prepared.head, *prepared.tail)
    return True


def launch_prepared_sequence(launches: tuple, call: tuple) -> bool:
    """Launch prepared launches back to back on the current CUDA stream: ``launches`` holds
    (prepared, grid, start, stop) per launch, its leading arguments being ``call[start:stop]``. False (nothing
    launched) where a Triton launch hook is installed."""
    if launch_hooks_set():
        return False
    stream = _current_stream()
    for prepared, grid, start, stop in launches:
        prepared.run(grid[0], grid[1], grid[2], stream, *prepared.head, *call[start:stop], *prepared.tail)
    return True


def launch_keeping_prepared(prepared: Optional[PreparedLaunch], launcher: "DescriptorLauncher", key: Hashable,
                            grid: tuple[int, int, int], args: tuple, constexprs: tuple, num_warps: int,
                            num_stages: int) -> Optional[PreparedLaunch]:
    """Launch arguments that do not change between calls: through ``prepared`` where it can
    (:func:`launch_prepared`), else through ``launcher`` (compiling on first use), preparing the launch for the next
    call. Returns the prepared launch to keep (None where the launcher cannot prepare one yet)."""
    if prepared is not None and launch_prepared(prepared, grid):
        return prepared
    launcher(key, grid, args, constexprs, num_warps, num_stages)
    return launcher.prepare(key, args, constexprs)


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
                hit = self._encoded[slot] = (desc, descriptor_encoder()[0](desc, metas[i]))
            final += args[at:pos]
            final += hit[1]
            at = pos + 1
        final += args[at:]
        return final

    def prepare(self, key: Hashable, args: tuple, constexprs: tuple,
                leading: int = 0) -> Optional["PreparedLaunch"]:
        """The launch of compiled kernel ``key`` with these ``args`` and ``constexprs`` worked out once, for
        arguments that do not change between calls (the same tensors, descriptors and numbers) but for the first
        ``leading`` runtime ones, which each call passes (before any descriptor): run it with
        :func:`launch_prepared` (no leading ones) or :func:`launch_prepared_sequence`. None where the kernel is not
        compiled through this launcher yet (launch it once first) or launches through the JIT."""
        if self.descriptor_positions and leading > min(self.descriptor_positions):
            raise ValueError(f"a prepared launch's {leading} leading arguments must come before its descriptors "
                             f"(positions {self.descriptor_positions})")
        raw = self._raw.get(key)
        if raw is not None:
            tail, keep = _addresses(self.encoded_args(key, args, raw[2])[leading:])
            return PreparedLaunch(raw[0], tuple(raw[1]), tail + tuple(constexprs), keep)
        entry = self._compiled.get(key)
        if entry is not None:
            run, function, packed = entry
            tail, keep = _addresses(args[leading:])
            return PreparedLaunch(run, (function, packed, None, None, None), tail + tuple(constexprs), keep)
        return None

    def __call__(self, key: Hashable, grid: tuple[int, int, int], args: tuple, constexprs: tuple,
                 num_warps: int, num_stages: int) -> None:
        raw = self._raw.get(key)
        if raw is not None and not launch_hooks_set():
            raw[0](grid[0], grid[1], grid[2], _current_stream(), *raw[1],
                   *self.encoded_args(key, args, raw[2]), *constexprs)
            return
        entry = self._compiled.get(key)
        if entry is not None and not launch_hooks_set():
            run, function, packed = entry
            run(grid[0], grid[1], grid[2], _current_stream(), function, packed, None, None,
                None, *args, *constexprs)
            return
        options = dict(zip(self.constexpr_names, constexprs))
        options.setdefault("num_warps", num_warps)
        options.setdefault("num_stages", num_stages)
        compiled = self.kernel[grid](*args, **options)
        if entry is None:
            self._remember(key, compiled)
            if key in self._compiled and self.descriptor_positions:
                raw, reason = raw_descriptor_launch(compiled, self.descriptor_positions)
                if raw is not None:
                    self._raw[key] = raw
                else:
                    fallback_reason("triton_descriptor_launch",
                                    f"{getattr(self.kernel, '__name__', 'kernel')}: descriptors encoded on every "
                                    f"launch ({reason})")
