"""CUDA-graph replay equals eager for every registered backend that declares graph support (cudagraph_support >
NEVER) and accepts the spec on this GPU: capture one uniform single-token decode step (with padding rows, as an
engine pads to a captured batch size), replay it on new sequence lengths, pages and tokens copied into the captured
buffers, and compare with an eager forward of the same batch and with the oracle. GPU only."""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.interface import CudaGraphSupport
from attnbackends.selection.registry import backend_names, get_backend_class
from attnbackends.testing import SequenceShape, assert_close_to_oracle, make_random_batch, oracle_attention
from attnbackends.testing import tolerance_for
from attnbackends.testing.cuda_graphs import capture_forward

pytestmark = pytest.mark.gpu

SPECS = {
    "bf16": AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16),
    "fp8": AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                         kv_cache_dtype="fp8_e4m3"),
}
NUM_BLOCKS = 512
WIDTH = 64  # block-table width: 1024 tokens per request
CAPTURE = (1000, 40, 17, 600, 5, 300)  # contexts at capture: the longest any replay uses comes first
REPLAYS = [(3, 700, 64, 31, 999, 1), (15, 16, 17, 18, 19, 20), (1000, 40, 17, 600, 5, 300)]
PAD = 2  # padded to a captured batch size of 8 tokens


def _graph_backends():
    names = []
    for name in backend_names():
        try:
            cls = get_backend_class(name)
        except Exception:  # a plugin that fails to import is not this test's business
            continue
        if cls.cudagraph_support > CudaGraphSupport.NEVER and not cls.is_mla:
            names.append(name)
    return names


def _batch(spec, contexts, seed, scales):
    return make_random_batch(spec, [SequenceShape(1, c) for c in contexts], seed=seed, device="cuda",
                             num_blocks=NUM_BLOCKS, pad_tokens=PAD, fp8_scales=scales)


def _widen(common):
    """The batch's common metadata with a fixed-width block table (the captured buffer's shape)."""
    table = torch.zeros(common.num_reqs, WIDTH, dtype=common.block_table.dtype, device=common.block_table.device)
    table[:, : common.block_table.shape[1]] = common.block_table
    return dataclasses.replace(common, block_table=table, block_table_cpu=table.cpu())


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("name", _graph_backends())
def test_cuda_graph_replay_equals_eager(name, spec_name):
    backend = get_backend_class(name)
    spec = SPECS[spec_name]
    reasons = backend.not_supported_reasons(spec, DeviceInfo.current(torch.device("cuda")))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    scales = (0.02, 0.03) if spec.is_fp8_kv_cache else None  # fixed: the captured layer keeps its scales
    builder_cls, impl_cls = backend.get_builder_cls(), backend.get_impl_cls()
    impl = impl_cls(spec, k_scale=scales[0] if scales else 1.0, v_scale=scales[1] if scales else 1.0)
    builder = builder_cls(spec, "cuda", max_num_reqs=len(CAPTURE))

    first = _batch(spec, CAPTURE, 0, scales)
    # The captured buffers: every replay copies its batch into these addresses.
    query, key, value = first.query.clone(), first.key.clone(), first.value.clone()
    kv_cache = first.kv_cache.clone()
    static = _widen(first.common)
    static = dataclasses.replace(
        static, query_start_loc=static.query_start_loc.clone(), seq_lens=static.seq_lens.clone(),
        block_table=static.block_table.clone(), slot_mapping=static.slot_mapping.clone(),
    )
    output = first.new_output()
    meta = builder.build_for_cudagraph_capture(static)
    graph = capture_forward(lambda: impl.forward(query, key, value, kv_cache, meta, output))

    for seed, contexts in enumerate(REPLAYS, start=1):
        batch = _batch(spec, contexts, seed, scales)
        new = _widen(batch.common)
        for dst, src in ((query, batch.query), (key, batch.key), (value, batch.value), (kv_cache, batch.kv_cache),
                         (static.query_start_loc, new.query_start_loc), (static.seq_lens, new.seq_lens),
                         (static.block_table, new.block_table), (static.slot_mapping, new.slot_mapping)):
            dst.copy_(src)
        step_common = dataclasses.replace(
            new, query_start_loc=static.query_start_loc, seq_lens=static.seq_lens,
            block_table=static.block_table, slot_mapping=static.slot_mapping,
        )
        builder.build(step_common)  # backends that plan on the host (FlashInfer) re-plan into persistent buffers
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_cache = output.clone(), kv_cache.clone()

        eager_builder = builder_cls(spec, "cuda", max_num_reqs=len(CAPTURE))
        eager_cache = batch.kv_cache.clone()
        eager = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, eager_cache, eager_builder.build(batch.common), eager)

        n = batch.num_actual_tokens
        tol = tolerance_for(spec.torch_dtype, spec.kv_cache_dtype)
        what = f"{name} replay, contexts {contexts}"
        assert torch.isnan(replayed[n:].float()).all(), f"{what}: padding rows written"
        assert_close_to_oracle(replayed[:n], eager[:n].double(), tol, what=f"{what} vs eager")
        assert_close_to_oracle(replayed[:n], oracle_attention(batch), tol, what=f"{what} vs oracle")
        assert torch.equal(replayed_cache.view(torch.uint8), eager_cache.view(torch.uint8)), f"{what}: cache differs"
