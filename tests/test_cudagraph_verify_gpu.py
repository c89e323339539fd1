"""CUDA-graph capture of speculative verify batches (GPU only: `pytest -m gpu tests/test_cudagraph_verify_gpu.py`):
a uniform 1 + k batch without a tree and a 1 + 7 batch with a tree mask are captured once per backend (Triton:
its launch plan on the builder's persistent buffers; FlashInfer: a CUDA-graph prefill wrapper that
``build_for_cudagraph_capture`` creates and later ``build()`` calls re-plan), then replayed on new sequence
lengths, pages, tokens and trees copied into the captured buffers; each replay must equal an eager forward of the
same batch and the oracle, with padding rows untouched and the same cache writes."""

import dataclasses
import random

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.flashinfer import FlashInferBackend
from attnbackends.testing import SequenceShape, assert_close_to_oracle, make_random_batch, oracle_attention
from attnbackends.testing import tolerance_for
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents
from attnbackends.triton.backend import TritonAttentionBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_BLOCKS = 512
WIDTH = 64  # block-table width: 1024 tokens per request
CAPTURE = (1000, 40, 17, 600, 5, 300)  # the longest context any replay uses comes first
REPLAYS = [(3, 700, 64, 31, 999, 1), (15, 16, 17, 18, 19, 20), (1000, 40, 17, 600, 5, 300)]
PAD = 3  # padded to a captured token count


def _spec(depth, tree, kv_cache_dtype="auto"):
    return AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                         kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=depth, speculative_tree=tree)


def _batch(spec, contexts, seed, tree):
    rng = random.Random(seed)
    q = 1 + spec.num_speculative_tokens
    trees = None
    if tree:
        trees = [list(EAGLE_TREE_8) if i % 2 else random_tree_parents(rng, q) for i in range(len(contexts))]
    scales = (0.02, 0.03) if spec.is_fp8_kv_cache else None
    return make_random_batch(spec, [SequenceShape(q, c) for c in contexts], seed=seed, device="cuda",
                             num_blocks=NUM_BLOCKS, pad_tokens=PAD, fp8_scales=scales, tree_parents=trees)


def _widen(common):
    table = torch.zeros(common.num_reqs, WIDTH, dtype=common.block_table.dtype, device=common.block_table.device)
    table[:, : common.block_table.shape[1]] = common.block_table
    return dataclasses.replace(common, block_table=table, block_table_cpu=table.cpu())


DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "spec_tree_mask", "spec_tree_mask_indptr")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("depth,tree", [(3, False), (7, True)], ids=["uniform_1+3", "tree_1+7"])
@pytest.mark.parametrize("backend", [TritonAttentionBackend, FlashInferBackend], ids=lambda b: b.name)
def test_verify_batch_replays_equal_eager(backend, depth, tree, kv_cache_dtype):
    spec = _spec(depth, tree, kv_cache_dtype)
    reasons = backend.not_supported_reasons(spec, DeviceInfo.current(torch.device("cuda")))
    if reasons:
        pytest.skip(f"{backend.name}: {'; '.join(reasons)}")
    first = _batch(spec, CAPTURE, 0, tree)
    k_scale, v_scale = first.k_scale, first.v_scale
    impl = backend.get_impl_cls()(spec, k_scale=k_scale, v_scale=v_scale)
    builder = backend.get_builder_cls()(spec, "cuda", max_num_reqs=len(CAPTURE))
    query, key, value, kv_cache = (t.clone() for t in (first.query, first.key, first.value, first.kv_cache))
    static = _widen(first.common)
    static = dataclasses.replace(static, **{f: getattr(static, f).clone() for f in DEVICE_FIELDS
                                            if getattr(static, f) is not None})
    output = first.new_output()
    meta = builder.build_for_cudagraph_capture(static)
    if backend is FlashInferBackend:
        assert meta.cuda_graph and meta.prefill_wrapper is not None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl.forward(query, key, value, kv_cache, meta, output)  # warm-up (compiles, validates) outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, key, value, kv_cache, meta, output)

    for seed, contexts in enumerate(REPLAYS, start=1):
        batch = _batch(spec, contexts, seed, tree)
        assert (batch.k_scale, batch.v_scale) == (k_scale, v_scale)
        new = _widen(batch.common)
        pairs = [(query, batch.query), (key, batch.key), (value, batch.value), (kv_cache, batch.kv_cache)]
        pairs += [(getattr(static, f), getattr(new, f)) for f in DEVICE_FIELDS if getattr(static, f) is not None]
        for dst, src in pairs:
            dst.copy_(src)
        step_common = dataclasses.replace(new, **{f: getattr(static, f) for f in DEVICE_FIELDS})
        step_meta = builder.build(step_common)  # FlashInfer re-plans the captured wrapper's buffers
        if backend is FlashInferBackend:
            assert step_meta.cuda_graph and step_meta.prefill_wrapper is meta.prefill_wrapper
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_cache = output.clone(), kv_cache.clone()

        eager_builder = backend.get_builder_cls()(spec, "cuda", max_num_reqs=len(CAPTURE))
        eager_cache = batch.kv_cache.clone()
        eager = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, eager_cache, eager_builder.build(batch.common), eager)

        n = batch.num_actual_tokens
        tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
        what = f"{backend.name} verify replay, contexts {contexts}"
        assert torch.isnan(replayed[n:].float()).all(), f"{what}: padding rows written"
        assert_close_to_oracle(replayed[:n], eager[:n].double(), tol, what=f"{what} vs eager")
        assert_close_to_oracle(replayed[:n], oracle_attention(batch), tol, what=f"{what} vs oracle")
        assert torch.equal(replayed_cache.view(torch.uint8), eager_cache.view(torch.uint8)), f"{what}: cache differs"
