"""The host running ahead of the GPU: an engine builds step N+1's metadata while step N's kernels are still queued.

A backend must keep each built metadata valid until the kernels that use it have run, whatever the host builds
after it (a persistent host buffer rewritten by the next ``build()`` while an asynchronous copy of it is pending is
the classic way to break this). :func:`check_backend_run_ahead` runs several different batches through one builder
and one impl without synchronising, behind a GPU stall on CUDA so the host is certainly ahead, then checks every
step's output against the oracle.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..interface import AttentionBackend
from ..spec import AttentionSpec
from .cases import RandomBatch, SequenceShape, make_random_batch
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = ["RUN_AHEAD_STEPS", "run_ahead_batches", "check_backend_run_ahead"]

#: Engine steps of different compositions: mixed, pure decode, more prefill, pure decode with other lengths.
RUN_AHEAD_STEPS: tuple[tuple[SequenceShape, ...], ...] = (
    (SequenceShape(1, 40), SequenceShape(1, 77), SequenceShape(23, 0), SequenceShape(9, 50)),
    (SequenceShape(1, 130), SequenceShape(1, 5), SequenceShape(1, 64), SequenceShape(1, 97), SequenceShape(1, 33)),
    (SequenceShape(1, 12), SequenceShape(40, 31), SequenceShape(17, 100), SequenceShape(5, 0)),
    (SequenceShape(1, 200), SequenceShape(1, 17)),
)

#: GPU clock cycles of the stall queued before the steps (a fraction of a second on current GPUs).
STALL_CYCLES = 200_000_000


def run_ahead_batches(spec: AttentionSpec, device: "torch.device | str", num_blocks: int = 96) -> list[RandomBatch]:
    """One random batch per entry of :data:`RUN_AHEAD_STEPS`, each with its own cache of ``num_blocks`` pages (so a
    step that reads another step's page table reads valid memory and fails on its values, not by a crash)."""
    return [make_random_batch(spec, shapes, seed=100 + i, device=device, num_blocks=num_blocks)
            for i, shapes in enumerate(RUN_AHEAD_STEPS)]


def check_backend_run_ahead(backend_cls: type[AttentionBackend], batches: Sequence[RandomBatch]) -> None:
    """Build and run every batch in turn with one builder and one impl, never synchronising in between, then check
    each step's output (NaN-poisoned beforehand) against the oracle. The batches must share spec, scales and sinks.
    """
    first = batches[0]
    spec, device = first.spec, first.query.device
    for b in batches[1:]:
        if b.spec != spec or (b.k_scale, b.v_scale) != (first.k_scale, first.v_scale) or (b.sinks is None) != (
                first.sinks is None):
            raise ValueError("check_backend_run_ahead needs batches of one spec with the same scales and sinks")
    builder = backend_cls.get_builder_cls()(spec, device)
    impl = backend_cls.get_impl_cls()(spec, sinks=first.sinks, k_scale=first.k_scale, v_scale=first.v_scale)
    caches = [b.kv_cache.clone() for b in batches]
    outputs = [b.new_output() for b in batches]
    # one step first, so that compilation on first use happens before the stall, not during it
    impl.forward(first.query, first.key, first.value, first.kv_cache.clone(), builder.build(first.common),
                 first.new_output())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda._sleep(STALL_CYCLES)
    for batch, cache, output in zip(batches, caches, outputs):
        impl.forward(batch.query, batch.key, batch.value, cache, builder.build(batch.common), output)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
    for step, (batch, output) in enumerate(zip(batches, outputs)):
        n = batch.num_actual_tokens
        assert_close_to_oracle(output[:n], oracle_attention(batch), tol,
                               what=f"{backend_cls.name} step {step} of {len(batches)} built ahead of the GPU")
