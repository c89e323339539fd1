"""Conformance of a model with layer groups: every layer's output against the oracle, on one batch whose layers
have different specs, with one metadata build per group (what an engine does each step)."""

from __future__ import annotations

import random
from typing import Optional, Sequence

import torch

from ..layer_groups import GroupedMetadataBuilder, LayerGroups, LayerGroupsConfig, group_layers
from ..layer_groups import window_pages_per_request
from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionSpec
from .cases import RandomBatch, SequenceShape, make_random_batch, random_sequence_shapes
from .oracle import oracle_attention
from .tolerances import assert_close_to_oracle, tolerance_for

__all__ = ["LAYER_GROUP_SHAPES", "check_layer_groups", "layer_group_batches"]

# Decodes and chunked prefills whose contexts reach past the windows the tests use, so that whole pages drop.
LAYER_GROUP_SHAPES = (
    SequenceShape(1, 0), SequenceShape(1, 5), SequenceShape(1, 47), SequenceShape(1, 70),
    SequenceShape(6, 0), SequenceShape(9, 33), SequenceShape(17, 40),
)


def layer_group_batches(
    specs: Sequence[AttentionSpec], shapes: Sequence[SequenceShape], *, seed: int = 0, device: "torch.device | str" = "cpu"
) -> list[RandomBatch]:
    """One random batch per layer (its own queries, keys, values and cache) over ONE block table and one set of
    request shapes: the batch's common metadata is the same for every layer (every spec must share the block
    size). Layers without a KV cache (encoders) get batches of the same query lengths without a cache."""
    block_sizes = {s.block_size for s in specs}
    if len(block_sizes) != 1:
        raise ValueError(f"layers of one batch must share block_size; got {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    pages = [-(-s.seq_len // block_size) for s in shapes]
    num_blocks = sum(pages) + max(2, sum(pages) // 4)
    pool = random.Random(seed).sample(range(num_blocks), sum(pages))
    tables, at = [], 0
    for n in pages:
        tables.append(pool[at : at + n])
        at += n
    batches = []
    for layer, spec in enumerate(specs):
        layer_seed = seed * 1000 + layer + 1
        if spec.attn_type.uses_kv_cache:
            batches.append(make_random_batch(spec, shapes, seed=layer_seed, device=device, num_blocks=num_blocks,
                                             block_tables=tables))
        else:
            batches.append(make_random_batch(spec, [SequenceShape(s.query_len, 0) for s in shapes], seed=layer_seed,
                                             device=device))
    return batches


def _poison_pages_outside_window(batch: RandomBatch, tables: torch.Tensor) -> int:
    """NaN into the cached pages no query of the batch may see (wholly before every query's window); returns how
    many. A backend (or a trim) that reads them produces NaN."""
    spec = batch.spec
    count = 0
    for r, shape in enumerate(batch.shapes):
        first_visible = max(0, shape.context_len - spec.sliding_window + 1)
        for page in range(first_visible // spec.block_size):
            batch.kv_cache[int(tables[r, page])] = float("nan")
            count += 1
    return count


def check_layer_groups(
    specs: Sequence[AttentionSpec],
    *,
    config: "LayerGroupsConfig | AttentionConfig | None" = None,
    device: "torch.device | str" = "cpu",
    shapes: Optional[Sequence[SequenceShape]] = None,
    seed: int = 0,
) -> LayerGroups:
    """Check a model with layer groups end to end on one batch.

    Groups ``specs`` (:func:`~attnbackends.layer_groups.group_layers` with ``config``), builds each group's metadata
    once from the batch's one common metadata, runs every layer's impl into a poisoned output, and compares each
    layer with the float64 oracle at its dtype's tolerance. In sliding-window layers the cached pages wholly before
    every query's window are set to NaN first: reading them fails the check. Also checks that each sliding-window
    group's block table was narrowed to at most :func:`~attnbackends.layer_groups.window_pages_per_request` pages.

    shapes : request shapes (default: random decodes and chunked prefills, decodes first, drawn from ``seed``).

    Returns the groups (their backends and explanations). Raises AssertionError naming the layer and group.
    """
    device = torch.device(device)
    groups = group_layers(specs, DeviceInfo.current(device), config)
    if shapes is None:
        block_size = specs[0].block_size
        shapes = random_sequence_shapes(random.Random(seed), 6, block_size, max_context=90, max_query=20,
                                        kinds=("decode", "chunked_prefill"))
    batches = layer_group_batches(specs, shapes, seed=seed, device=device)
    cached = [b for b in batches if b.kv_cache is not None]
    common = cached[0].common if cached else batches[0].common
    for batch in batches:
        if batch.sinks is not None:
            batch.sinks = batch.sinks.to(device)
        if batch.spec.sliding_window is not None and batch.kv_cache is not None:
            _poison_pages_outside_window(batch, common.block_table_cpu)
    builder = GroupedMetadataBuilder(groups, device, max_num_reqs=len(shapes))
    step = builder.build([common if g.spec.attn_type.uses_kv_cache else _encoder_common(batches, g.layers)
                          for g in groups.groups])
    for group, group_common in zip(groups.groups, step.commons):
        if group.window is not None:
            cap = window_pages_per_request(group.window, group.spec.block_size, common.max_query_len)
            width = group_common.block_table.shape[1]
            if width > cap:
                raise AssertionError(f"group {group.name}: block table {width} pages wide, the window needs <= {cap}")
    impls = groups.make_impls(lambda layer: {"sinks": batches[layer].sinks, "k_scale": batches[layer].k_scale,
                                             "v_scale": batches[layer].v_scale})
    for layer, (batch, impl) in enumerate(zip(batches, impls)):
        group = groups.groups[groups.layer_group[layer]]
        output = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, step.per_layer[layer], output)
        n = batch.num_actual_tokens
        tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
        assert_close_to_oracle(output[:n], oracle_attention(batch), tol,
                               what=f"layer {layer} (group {group.name}, backend {group.backend.name})")
    return groups


def _encoder_common(batches: list[RandomBatch], layers: Sequence[int]):
    return batches[layers[0]].common
