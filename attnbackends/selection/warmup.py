"""Compile what a spec needs before the first real step, and say what is compiling and how long it takes.

First use of a backend compiles kernels: FlashInfer builds a module per (dtypes, head size, window, soft-cap,
fa2/fa3) with ninja (tens of seconds each), flash-attn 4 compiles CuTe kernels (seconds), Triton JITs per
specialisation. :func:`warmup` selects the backend for each spec as the engine would, starts FlashInfer's module
builds in the background (they run side by side: :func:`attnbackends.flashinfer.precompile`), and meanwhile runs one
small decode, prefill and mixed step through every selected backend, logging each with its time.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

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
    """One piece of warm-up: what (``"<backend> <step>"`` or ``"flashinfer modules"``) and how long it took."""

    what: str
    seconds: float
    detail: str = ""


def _uses_flashinfer(backend: type) -> bool:
    parts = [getattr(backend, "decode_backend", None), getattr(backend, "prefill_backend", None), backend]
    return any(p is not None and p.name == "flashinfer" for p in parts)


def warmup(specs: Iterable[AttentionSpec], device: Optional[DeviceInfo] = None,
           config: Optional[AttentionConfig] = None) -> list[WarmupRecord]:
    """Compile the kernels ``specs`` need on ``device`` (default: the current one); returns what ran, with times."""
    from .tune_timing import timing_batch

    device = device or DeviceInfo.current()
    specs = list(dict.fromkeys(specs))
    chosen = [(spec, select(spec, device, config)) for spec in specs]
    records: list[WarmupRecord] = []
    flashinfer_specs = [spec for spec, backend in chosen if _uses_flashinfer(backend)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: Optional[Future] = None
        start_fi = time.perf_counter()
        if flashinfer_specs and device.is_cuda:
            from ..flashinfer import precompile

            logger.info("building FlashInfer kernel modules for %d spec(s) in the background", len(flashinfer_specs))
            pending = pool.submit(precompile, flashinfer_specs, device.torch_device)
        # backends without FlashInfer first: they compile while FlashInfer's modules build
        for spec, backend in sorted(chosen, key=lambda item: _uses_flashinfer(item[1])):
            if pending is not None and _uses_flashinfer(backend):
                pending.result()  # its first steps would otherwise build the same modules once more
            builder = backend.get_builder_cls()(spec, device.torch_device)
            impl = backend.get_impl_cls()(spec, sinks=torch.zeros(spec.num_heads) if spec.has_sinks else None)
            for step, (query_lens, context_lens) in _STEPS.items():
                batch = timing_batch(spec, query_lens, context_lens, device.torch_device)
                logger.info("warm-up: %s %s step (compiling kernels on first use) ...", backend.name, step)
                start = time.perf_counter()
                batch.forward(impl, builder.build(batch.common))
                if device.is_cuda:
                    torch.cuda.synchronize(device.torch_device)
                seconds = time.perf_counter() - start
                logger.info("warm-up: %s %s step took %.2f s", backend.name, step, seconds)
                records.append(WarmupRecord(f"{backend.name} {step}", seconds, _describe(spec)))
        if pending is not None:
            modules = pending.result()
            records.insert(0, WarmupRecord("flashinfer modules", time.perf_counter() - start_fi, ", ".join(modules)))
    return records


def _describe(spec: AttentionSpec) -> str:
    return (f"{spec.num_heads}/{spec.num_kv_heads} heads, head {spec.head_size}, {spec.dtype}, "
            f"cache {spec.kv_cache_dtype}, page {spec.block_size}")
