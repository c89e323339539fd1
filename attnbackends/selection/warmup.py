"""Compile what a spec needs before the first real step, and say what is compiling and how long it takes.

First use of a backend compiles kernels: FlashInfer builds a module per (dtypes, head size, window, soft-cap,
fa2/fa3) with ninja (tens of seconds each), flash-attn 4 compiles CuTe kernels (seconds), Triton JITs per
specialisation. :func:`warmup` selects the backend for each spec as the engine would, starts the ahead-of-time
builds of the backends that have one in the background (:meth:`AttentionBackend.warmup
<attnbackends.AttentionBackend.warmup>`: FlashInfer's modules, built side by side), and meanwhile runs one small
decode, prefill and mixed step through every selected backend, logging each with its time. Backends are reached only
through the classes the registry returns.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ..interface import AttentionBackend
from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionSpec
from .registry import select

__all__ = ["WarmupRecord", "warmup"]

logger = logging.getLogger(__name__)

_STEPS = {  # (query_lens, context_lens): one of each kind of step
    "decode": ([1, 1], [40, 17]),
    "prefill": ([33], [0]),
    "mixed": ([1, 9], [20, 30]),
}


@dataclass
class WarmupRecord:
    """One piece of warm-up: what (``"<backend> <step>"`` or ``"<backend> modules"``) and how long it took."""

    what: str
    seconds: float
    detail: str = ""


def _parts(backend: type[AttentionBackend]) -> list[type[AttentionBackend]]:
    """The plain backends that serve ``backend``'s steps: both parts of a phase composition, else itself."""
    parts = [getattr(backend, "decode_backend", None), getattr(backend, "prefill_backend", None)]
    return [p for p in parts if p is not None] or [backend]


def _builds_ahead(backend: type[AttentionBackend]) -> bool:
    """Whether ``backend`` has an ahead-of-time build (overrides :meth:`AttentionBackend.warmup`)."""
    return getattr(backend.warmup, "__func__", None) is not AttentionBackend.warmup.__func__


def compiles_kernels(backend: type[AttentionBackend]) -> bool:
    """Whether ``backend``'s first steps compile anything (Triton kernels, or a JIT-built package's modules); a
    pure-torch backend's first steps only warm torch's own caches."""
    return any(part.needs_triton or part.required_packages for part in _parts(backend))


def warmup(specs: Iterable[AttentionSpec], device: Optional[DeviceInfo] = None,
           config: Optional[AttentionConfig] = None) -> list[WarmupRecord]:
    """Compile the kernels ``specs`` need on ``device`` (default: the current one); returns what ran, with times."""
    from .tune_timing import timing_batch, timing_impl

    device = device or DeviceInfo.current()
    specs = list(dict.fromkeys(specs))
    chosen = [(spec, select(spec, device, config)) for spec in specs]
    ahead: dict[type[AttentionBackend], list[AttentionSpec]] = {}  # backends with an ahead-of-time build: their specs
    for spec, backend in chosen:
        for part in _parts(backend):
            if _builds_ahead(part) and spec not in ahead.setdefault(part, []):
                ahead[part].append(spec)
    records: list[WarmupRecord] = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: dict[type[AttentionBackend], Future] = {}
        for part, part_specs in ahead.items():
            logger.info("building %s's kernel modules for %d spec(s) in the background", part.name, len(part_specs))
            pending[part] = pool.submit(_timed_warmup, part, part_specs, device)
        # backends without an ahead-of-time build first: they compile while the builds run
        for spec, backend in sorted(chosen, key=lambda item: any(p in pending for p in _parts(item[1]))):
            for part in _parts(backend):
                if part in pending:
                    pending[part].result()  # its first steps would otherwise build the same modules once more
            builder = backend.get_builder_cls()(spec, device.torch_device)
            impl = timing_impl(backend, spec, device.torch_device)
            for step, (query_lens, context_lens) in _STEPS.items():
                batch = timing_batch(spec, query_lens, context_lens, device.torch_device)
                logger.info("warm-up: %s %s step (%s) ...", backend.name, step,
                            "compiling kernels on first use" if compiles_kernels(backend)
                            else "pure torch: nothing to compile, a first run")
                start = time.perf_counter()
                batch.forward(impl, builder.build(batch.common))
                if device.is_cuda:
                    torch.cuda.synchronize(device.torch_device)
                seconds = time.perf_counter() - start
                logger.info("warm-up: %s %s step took %.2f s", backend.name, step, seconds)
                records.append(WarmupRecord(f"{backend.name} {step}", seconds, _describe(spec)))
        for at, (part, future) in enumerate(pending.items()):
            built, seconds = future.result()
            records.insert(at, WarmupRecord(f"{part.name} modules", seconds, ", ".join(built)))
    return records


def _timed_warmup(backend: type[AttentionBackend], specs: list[AttentionSpec],
                  device: DeviceInfo) -> tuple[list[str], float]:
    start = time.perf_counter()
    built = backend.warmup(specs, device)
    return built, time.perf_counter() - start


def _describe(spec: AttentionSpec) -> str:
    return (f"{spec.num_heads}/{spec.num_kv_heads} heads, head {spec.head_size}, {spec.dtype}, "
            f"cache {spec.kv_cache_dtype}, page {spec.block_size}")
