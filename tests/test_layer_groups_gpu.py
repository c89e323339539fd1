"""CUDA graphs over a whole grouped decode step (GPU): every group's backend captured in one graph, sliding groups
reading their trimmed block tables from persistent buffers; replays with new contexts, pages and tokens equal the
oracle. Run with `pytest -m gpu tests/test_layer_groups_gpu.py` on the GPU host."""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec, GroupedMetadataBuilder, LayerGroupsConfig, group_layers
from attnbackends.testing import SequenceShape, assert_close_to_oracle, oracle_attention, tolerance_for
from attnbackends.testing.layer_groups import layer_group_batches

pytestmark = pytest.mark.gpu

WIDTH = 80  # block-table width of the captured common metadata: 1280 tokens per request
CAPTURE = (1000, 40, 17, 600)
REPLAYS = [(3, 700, 64, 999), (1200, 16, 300, 5)]
NUM_BLOCKS = 512  # more than any of these batches draws its pages from


def _specs(head_size):
    kw = dict(num_heads=16, num_kv_heads=8, head_size=head_size, dtype="bfloat16", block_size=16)
    return [AttentionSpec(**kw, sliding_window=None if (i + 1) % 3 == 0 else 128) for i in range(6)]


def _widen(common):
    table = torch.zeros(common.num_reqs, WIDTH, dtype=torch.int32, device=common.block_table.device)
    table[:, : common.block_table.shape[1]] = common.block_table
    return dataclasses.replace(common, block_table=table, block_table_cpu=table.cpu())


@pytest.mark.parametrize("head_size", [128, 256])
def test_grouped_decode_step_in_one_cuda_graph(head_size):
    specs = _specs(head_size)
    groups = group_layers(specs, config=LayerGroupsConfig(default={"backend": "triton"}))
    builder = GroupedMetadataBuilder(groups, "cuda", max_num_reqs=len(CAPTURE), cudagraph_max_query_len=1)
    impls = groups.make_impls()
    first = layer_group_batches(specs, [SequenceShape(1, c) for c in CAPTURE], seed=0, device="cuda")
    caches = [torch.randn(NUM_BLOCKS, *b.kv_cache.shape[1:], device="cuda").to(b.kv_cache.dtype) for b in first]
    for cache, b in zip(caches, first):
        cache[: b.kv_cache.shape[0]].copy_(b.kv_cache)
    static = _widen(first[0].common)
    qs = [b.query.clone() for b in first]
    ks = [b.key.clone() for b in first]
    vs = [b.value.clone() for b in first]
    outs = [b.new_output() for b in first]
    meta = builder.build_for_cudagraph_capture(static)

    def step(meta):
        for i, impl in enumerate(impls):
            impl.forward(qs[i], ks[i], vs[i], caches[i], meta.per_layer[i], outs[i])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(meta)
    for seed, contexts in enumerate(REPLAYS, start=1):
        batches = layer_group_batches(specs, [SequenceShape(1, c) for c in contexts], seed=seed, device="cuda")
        new = _widen(batches[0].common)
        for dst, src in ((static.query_start_loc, new.query_start_loc), (static.seq_lens, new.seq_lens),
                         (static.block_table, new.block_table), (static.slot_mapping, new.slot_mapping)):
            dst.copy_(src)
        for i, b in enumerate(batches):
            qs[i].copy_(b.query), ks[i].copy_(b.key), vs[i].copy_(b.value)
            caches[i].zero_()
            caches[i][: b.kv_cache.shape[0]].copy_(b.kv_cache)
            outs[i].fill_(float("nan"))
        step_common = dataclasses.replace(new, query_start_loc=static.query_start_loc, seq_lens=static.seq_lens,
                                          block_table=static.block_table, slot_mapping=static.slot_mapping)
        replay_meta = builder.build(step_common)  # trims into the captured buffers; builders re-plan in place
        for g, c in enumerate(replay_meta.commons):
            assert c.block_table.data_ptr() == meta.commons[g].block_table.data_ptr()
        graph.replay()
        torch.cuda.synchronize()
        for i, b in enumerate(batches):
            assert_close_to_oracle(outs[i], oracle_attention(b), tolerance_for(torch.bfloat16),
                                   what=f"layer {i}, replay {contexts}")
