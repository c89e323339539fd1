"""The Triton backend's CUDA-graph support for whole mixed batches (``CudaGraphSupport.ALWAYS``).

A batch with prefills gets, from ``build_for_cudagraph_capture``, one unified launch whose grid depends only on the
batch's shape (requests, tokens). The same metadata must then serve every other batch of that shape, whatever its
mix of decodes, chunks on context and fresh prompts, once the new batch's values are written into the captured
tensors in place: on the CPU (interpreted, no graph) that is checked by running the captured metadata eagerly on
new batches against the oracle; on the GPU a captured graph is replayed 200 times on new batches and compared bit
for bit with an eager forward of the same metadata, and with the oracle.
"""

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec  # noqa: E402
from attnbackends.interface import CudaGraphSupport  # noqa: E402
from attnbackends.testing import SequenceShape, assert_close_to_oracle, make_random_batch  # noqa: E402
from attnbackends.testing import oracle_attention, tolerance_for  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend, TritonImpl, TritonMetadataBuilder  # noqa: E402
from attnbackends.testing.cuda_graphs import capture_forward  # noqa: E402


def _split(rng: random.Random, num_reqs: int, num_tokens: int, max_context: int) -> list[SequenceShape]:
    """``num_reqs`` requests sharing at most ``num_tokens`` query tokens in a random mix: decodes first, then
    chunks on context and fresh prompts (every request at least one token)."""
    budget = num_tokens - num_reqs
    num_decodes = rng.randint(0, num_reqs - 1)
    shapes = [SequenceShape(1, rng.randint(1, max_context)) for _ in range(num_decodes)]
    rest = num_reqs - num_decodes
    for _ in range(rest):
        extra = rng.randint(0, budget)
        budget -= extra
        context = rng.choice([0, rng.randint(1, max_context)])
        shapes.append(SequenceShape(1 + extra, context))
    return shapes


def _widen(common, width):
    """``common`` with a block table of ``width`` columns (the captured buffer's shape)."""
    table = torch.zeros(common.num_reqs, width, dtype=common.block_table.dtype, device=common.block_table.device)
    table[:, : common.block_table.shape[1]] = common.block_table
    return dataclasses.replace(common, block_table=table, block_table_cpu=table.cpu())


class _Captured:
    """The persistent tensors a captured step reads (every replay writes its batch into them) and the metadata
    built for the capture batch."""

    def __init__(self, spec, first, builder, width):
        self.width = width
        self.query, self.key, self.value = first.query.clone(), first.key.clone(), first.value.clone()
        self.kv_cache = first.kv_cache.clone()
        common = _widen(first.common, width)
        self.common = dataclasses.replace(
            common, query_start_loc=common.query_start_loc.clone(), seq_lens=common.seq_lens.clone(),
            block_table=common.block_table.clone(), slot_mapping=common.slot_mapping.clone())
        self.output = first.new_output()
        self.meta = builder.build_for_cudagraph_capture(self.common)

    def load(self, batch):
        """Write ``batch`` (same requests, at most as many tokens) into the captured tensors, in place."""
        new = _widen(batch.common, self.width)
        pad = self.query.shape[0] - batch.query.shape[0]
        assert pad >= 0
        for dst, src in ((self.query, batch.query), (self.key, batch.key), (self.value, batch.value)):
            dst[: src.shape[0]].copy_(src)
            dst[src.shape[0]:].normal_()  # padding rows: data no request owns
        self.kv_cache.copy_(batch.kv_cache)
        self.common.query_start_loc.copy_(new.query_start_loc)
        self.common.seq_lens.copy_(new.seq_lens)
        self.common.block_table.copy_(new.block_table)
        self.common.slot_mapping[: new.slot_mapping.shape[0]].copy_(new.slot_mapping)
        self.common.slot_mapping[new.slot_mapping.shape[0]:] = -1


def _batch(spec, shapes, seed, num_blocks, device, num_tokens):
    actual = sum(s.query_len for s in shapes)
    return make_random_batch(spec, shapes, seed=seed, device=device, num_blocks=num_blocks,
                             pad_tokens=num_tokens - actual)


def test_triton_declares_whole_mixed_batches():
    assert TritonAttentionBackend.cudagraph_support is CudaGraphSupport.ALWAYS


def test_captured_mixed_metadata_serves_other_mixes_of_its_shape():
    """CPU, interpreted: the capture plan of a mixed batch (4 requests, 24 tokens) runs eagerly on batches of the
    same shape with other mixes (all decodes, one long prompt, chunks on context) written in place; each matches the
    oracle and the cache write."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16)
    num_reqs, num_tokens, num_blocks, width = 4, 24, 24, 4
    builder = TritonMetadataBuilder(spec, "cpu", max_num_reqs=num_reqs, max_num_tokens=num_tokens)
    impl = TritonImpl(spec)
    first = _batch(spec, [SequenceShape(1, 20), SequenceShape(9, 0), SequenceShape(6, 17), SequenceShape(8, 3)], 0,
                   num_blocks, "cpu", num_tokens)
    cap = _Captured(spec, first, builder, width)
    assert cap.meta.num_decodes == 0 and cap.meta.prefill_split is None and cap.meta.num_kv_splits == 1
    mixes = [
        [SequenceShape(1, 30), SequenceShape(1, 1), SequenceShape(1, 47), SequenceShape(1, 12)],  # decodes, padded
        [SequenceShape(1, 5), SequenceShape(1, 9), SequenceShape(1, 2), SequenceShape(21, 0)],
        [SequenceShape(3, 40), SequenceShape(2, 0), SequenceShape(17, 13), SequenceShape(2, 33)],
    ]
    tol = tolerance_for(spec.torch_dtype)
    for seed, shapes in enumerate(mixes, start=1):
        batch = _batch(spec, shapes, seed, num_blocks, "cpu", num_tokens)
        cap.load(batch)
        cap.output.fill_(float("nan"))
        impl.forward(cap.query, cap.key, cap.value, cap.kv_cache, cap.meta, cap.output)
        n = batch.num_actual_tokens
        assert_close_to_oracle(cap.output[:n], oracle_attention(batch), tol, what=f"mix {shapes}")
        slots = batch.common.slot_mapping[:n]
        pages, offs = slots // spec.block_size, slots % spec.block_size
        assert torch.equal(cap.kv_cache[pages, 0, offs], batch.key[:n]), "keys not written"
        assert torch.equal(cap.kv_cache[pages, 1, offs], batch.value[:n]), "values not written"


@pytest.mark.gpu
def test_mixed_step_graph_replays_bit_for_bit():
    """H100: capture a mixed step (12 requests, 256 tokens), then 200 times write a new random mix of the same
    shape into the captured tensors, replay, and compare with an eager forward of the captured metadata on the same
    tensors: outputs and caches bit for bit; every 25th replay also against the oracle."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    num_reqs, num_tokens, num_blocks, width, max_context = 12, 256, 512, 48, 400
    builder = TritonMetadataBuilder(spec, "cuda", max_num_reqs=num_reqs, max_num_tokens=num_tokens)
    impl = TritonImpl(spec)
    rng = random.Random(0)
    first_shapes = [SequenceShape(1, 400)] * 6 + [SequenceShape(60, 0), SequenceShape(100, 300),
                                                  SequenceShape(40, 10), SequenceShape(30, 0),
                                                  SequenceShape(10, 200), SequenceShape(10, 5)]
    first = _batch(spec, first_shapes, 0, num_blocks, "cuda", num_tokens)
    assert first.num_actual_tokens == num_tokens
    cap = _Captured(spec, first, builder, width)
    graph = capture_forward(lambda: impl.forward(cap.query, cap.key, cap.value, cap.kv_cache, cap.meta, cap.output))
    tol = tolerance_for(spec.torch_dtype)
    for step in range(200):
        shapes = _split(rng, num_reqs, num_tokens, max_context)
        batch = _batch(spec, shapes, step + 1, num_blocks, "cuda", num_tokens)
        cap.load(batch)
        before = cap.kv_cache.clone()
        eager_out = torch.full_like(cap.output, float("nan"))
        cap.output.fill_(float("nan"))
        graph.replay()
        replayed, replayed_cache = cap.output.clone(), cap.kv_cache.clone()
        cap.kv_cache.copy_(before)
        impl.forward(cap.query, cap.key, cap.value, cap.kv_cache, cap.meta, eager_out)
        n = batch.num_actual_tokens
        what = f"replay {step}, mix {[(s.query_len, s.context_len) for s in shapes]}"
        assert torch.equal(replayed[:n].view(torch.int16), eager_out[:n].view(torch.int16)), f"{what}: output"
        assert torch.equal(replayed_cache.view(torch.uint8), cap.kv_cache.view(torch.uint8)), f"{what}: cache"
        if step % 25 == 0:
            assert_close_to_oracle(replayed[:n], oracle_attention(batch), tol, what=f"{what} vs oracle")
