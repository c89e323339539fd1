"""The host running ahead of the GPU: an engine builds step N+1's metadata while step N's kernels are still queued.

A backend must keep each built metadata valid until the kernels that use it have run, whatever the host builds
after it (a persistent host buffer rewritten by the next ``build()`` while an asynchronous copy of it is pending is
the classic way to break this). :func:`check_backend_run_ahead` runs several different batches through one builder
and one impl without synchronising, behind a GPU stall on CUDA so the host is certainly ahead, then checks every
step's output against the oracle.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ..compat import cuda_sleep
from ..interface import AttentionBackend
from ..spec import AttentionSpec
from .cases import SequenceShape, make_random_batch
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = ["RUN_AHEAD_STEPS", "run_ahead_batches", "check_backend_run_ahead", "put_host_ahead"]

#: Engine steps of different compositions: mixed, pure decode, more prefill, pure decode with other lengths.
RUN_AHEAD_STEPS: tuple[tuple[SequenceShape, ...], ...] = (
    (SequenceShape(1, 40), SequenceShape(1, 77), SequenceShape(23, 0), SequenceShape(9, 50)),
    (SequenceShape(1, 130), SequenceShape(1, 5), SequenceShape(1, 64), SequenceShape(1, 97), SequenceShape(1, 33)),
    (SequenceShape(1, 12), SequenceShape(40, 31), SequenceShape(17, 100), SequenceShape(5, 0)),
    (SequenceShape(1, 200), SequenceShape(1, 17)),
)

#: GPU clock cycles of the stall queued before the steps (a fraction of a second on current GPUs).
STALL_CYCLES = 200_000_000


def put_host_ahead(device: "torch.device | str", stall_cycles: int = STALL_CYCLES) -> None:
    """Let ``device``'s queued work finish, then queue a GPU stall of ``stall_cycles`` clock cycles on the current
    stream, so that whatever the host enqueues next runs after the host has moved on (unless the host itself is
    slowed for longer than the stall, as on a machine whose cores are all busy). No-op off CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cuda_sleep(stall_cycles)


def run_ahead_batches(spec: AttentionSpec, device: "torch.device | str", num_blocks: int = 96) -> list[Any]:
    """One random batch per entry of :data:`RUN_AHEAD_STEPS`, each with its own cache (standard attention: of
    ``num_blocks`` pages, so a step that reads another step's page table reads valid memory and fails on its values,
    not by a crash). MLA specs get :class:`~attnbackends.testing.mla.MLABatch` es sharing one ``kv_b_proj`` (one
    impl runs them all)."""
    if spec.is_mla:
        from .mla import make_random_mla_batch

        batches = [make_random_mla_batch(spec, shapes, seed=100 + i, device=device)
                   for i, shapes in enumerate(RUN_AHEAD_STEPS)]
        return [dataclasses.replace(b, kv_b_proj=batches[0].kv_b_proj) for b in batches]
    return [make_random_batch(spec, shapes, seed=100 + i, device=device, num_blocks=num_blocks)
            for i, shapes in enumerate(RUN_AHEAD_STEPS)]


def check_backend_run_ahead(backend_cls: type[AttentionBackend], batches: Sequence[Any]) -> None:
    """Build and run every batch in turn with one builder and one impl, never synchronising in between, then check
    each step's output (NaN-poisoned beforehand) against the oracle. The batches (:class:`RandomBatch` es, or MLA
    batches sharing one ``kv_b_proj``, as :func:`run_ahead_batches` makes them) must share spec, scales and sinks.
    """
    first = batches[0]
    spec, device = first.spec, _device_of(first)
    mla = spec.is_mla
    for b in batches[1:]:
        same = b.spec == spec and b.k_scale == first.k_scale and (
            b.kv_b_proj is first.kv_b_proj if mla else
            b.v_scale == first.v_scale and (b.sinks is None) == (first.sinks is None))
        if not same:
            raise ValueError("check_backend_run_ahead needs batches of one spec with the same scales, sinks and "
                             "MLA up-projection")
    builder = backend_cls.get_builder_cls()(spec, device)
    if mla:
        impl = backend_cls.get_impl_cls()(spec, kv_b_proj=first.kv_b_proj, k_scale=first.k_scale)
        impl.process_weights_after_loading()
    else:
        impl = backend_cls.get_impl_cls()(spec, sinks=first.sinks, k_scale=first.k_scale, v_scale=first.v_scale)

    def step(batch, cache, output) -> None:
        metadata = builder.build(batch.common)
        if mla:
            impl.forward(batch.q, batch.kv_c, batch.k_pe, cache, metadata, output)
        else:
            impl.forward(batch.query, batch.key, batch.value, cache, metadata, output)

    caches = [b.kv_cache.clone() for b in batches]
    outputs = [b.new_output() for b in batches]
    step(first, first.kv_cache.clone(), first.new_output())  # compile on first use before the stall, not during it
    put_host_ahead(device)
    for batch, cache, output in zip(batches, caches, outputs):
        step(batch, cache, output)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
    for i, (batch, output) in enumerate(zip(batches, outputs)):
        n = batch.num_actual_tokens
        assert_close_to_oracle(output[:n], _oracle(batch), tol,
                               what=f"{backend_cls.name} step {i} of {len(batches)} built ahead of the GPU")


def _device_of(batch) -> torch.device:
    return (batch.q if batch.spec.is_mla else batch.query).device


def _oracle(batch) -> torch.Tensor:
    if batch.spec.is_mla:
        from .mla import mla_oracle

        return mla_oracle(batch)
    return oracle_attention(batch)
