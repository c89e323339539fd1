"""Compile FlashInfer's JIT kernels for a set of specs ahead of time, all in one parallel build.

FlashInfer compiles a kernel module per (dtypes, head size, window on/off, soft-cap on/off, fa2/fa3) on first use,
tens of seconds each when done one at a time as layers first run. :func:`precompile` builds every module the given
specs will need side by side: one thread per module runs that module's own ninja build (the one a first use would
run, so first use then finds it up to date). It leans on flashinfer's module generators (``flashinfer.jit``, through
:func:`attnbackends.compat.flashinfer_jit_generators`), which are not a stable API: on any mismatch it logs and
returns, and the kernels compile lazily as before. Each build's parallelism is ninja's (``MAX_JOBS`` if the user
sets it).
Each module is built by its own ninja run, not by one combined ``flashinfer.jit.build_jit_specs`` build, whose
ninja log lives elsewhere: first use would find no record of the outputs and compile them again.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from ..compat import fallback_reason, flashinfer_jit_generators, import_flashinfer
from ..spec import AttentionSpec

__all__ = ["precompile"]

logger = logging.getLogger(__name__)

_POS_ENCODING_NONE = 0


def precompile(
    specs: Iterable[AttentionSpec],
    device: "torch.device | str | None" = None,
    *,
    builder_cls: type,
    decode: bool = True,
    prefill: bool = True,
    cascade: bool = False,
) -> list[str]:
    """Build the kernel modules ``specs`` use (decode, prefill, and the cascade merge if asked); returns their names.

    ``builder_cls`` is the metadata builder whose choices decide the decode modules (tensor-core decode or not, as
    it decides by default): :class:`~attnbackends.flashinfer.FlashInferMetadataBuilder`, which
    :meth:`FlashInferBackend.warmup <attnbackends.flashinfer.FlashInferBackend.warmup>` passes (this module does not
    import the backend's: the backend class reaches it). Returns an empty list (after logging why) when
    flashinfer's generators do not match what this expects.
    """
    fi = import_flashinfer()
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    generators = flashinfer_jit_generators()
    if generators is None:
        return []
    gen_batch_decode_module = generators["gen_batch_decode_module"]
    gen_batch_prefill_module = generators["gen_batch_prefill_module"]
    try:
        jit_specs = {}
        for spec in specs:
            q, kv = spec.torch_dtype, spec.kv_cache_torch_dtype
            args = (
                q, kv, q, torch.int32, spec.head_size, spec.head_size, _POS_ENCODING_NONE,
                spec.sliding_window is not None, spec.logits_soft_cap is not None,
            )
            chosen = []
            if decode:
                if builder_cls(spec, "cpu").use_tensor_cores:
                    # The tensor-core decode path runs FlashInfer's fa2 prefill kernels (fp8 KV with 16-bit queries
                    # also resolves to fa2).
                    chosen.append(gen_batch_prefill_module("fa2", *args, False))
                else:
                    chosen.append(gen_batch_decode_module(*args))
            if prefill:
                backend = generators["determine_attention_backend"](device, _POS_ENCODING_NONE, False, False, q, kv)
                chosen.append(gen_batch_prefill_module(backend, *args, False))
            for jit_spec in chosen:
                jit_specs[jit_spec.name] = jit_spec
        if cascade:
            jit_spec = generators["gen_cascade_module"]()
            jit_specs[jit_spec.name] = jit_spec
        _build_side_by_side(list(jit_specs.values()))
    except (AttributeError, TypeError) as exc:
        fallback_reason("flashinfer_jit", f"flashinfer {getattr(fi, '__version__', '?')}: ahead-of-time kernel "
                        f"build skipped ({exc}); kernels compile on first use")
        return []
    return sorted(jit_specs)


def _build_side_by_side(jit_specs: list) -> None:
    """Run each module's own ninja build in its own thread."""
    if not jit_specs:
        return
    with ThreadPoolExecutor(max_workers=len(jit_specs)) as pool:
        for future in [pool.submit(spec.build, False) for spec in jit_specs]:
            future.result()
