"""One builder and one impl serve an engine's steps of every kind in turn (plain prefill, tree verify, uniform
multi-token decode, plain prefill again), each step against the float64 oracle: nothing a builder keeps between steps
may carry one step's kind into the next (FlashInfer fixes a prefill wrapper's kernel family at its first plan, and
the family chosen without a custom mask cannot take one)."""

import random

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.compat import flashinfer_installed
from attnbackends.flashinfer.backend import FlashInferBackend
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import SequenceShape, check_backend_on_batches, make_random_batch
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents
from attnbackends.triton.backend import TritonAttentionBackend

NUM_BLOCKS = 48


def step_sequence(spec: AttentionSpec, device: str) -> list:
    """Plain prefill, tree verify (next to a plain prefill), multi-token decode, a short decode next to a prefill:
    random data, decodes first as engines order them."""
    depth = spec.num_speculative_tokens
    rng = random.Random(0)
    steps = [
        ([SequenceShape(21, 0), SequenceShape(9, 30)], None),
        ([SequenceShape(1 + depth, 40), SequenceShape(1 + depth, 17), SequenceShape(12, 5)],
         [random_tree_parents(rng, 1 + depth), list(EAGLE_TREE_8[: 1 + depth]), None]),
        ([SequenceShape(1 + depth, c) for c in (3, 16, 50)], None),
        ([SequenceShape(5, 61), SequenceShape(17, 0)], None),
    ]
    return [make_random_batch(spec, shapes, seed=index, device=device, num_blocks=NUM_BLOCKS, tree_parents=trees)
            for index, (shapes, trees) in enumerate(steps)]


def tree_spec(dtype: str, head_size: int) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, block_size=16,
                         num_speculative_tokens=7, speculative_tree=True)


@pytest.mark.parametrize("backend", [ReferenceBackend, TritonAttentionBackend], ids=lambda b: b.name)
def test_step_kinds_through_one_builder_on_cpu(backend):
    dtype = "float32" if backend is ReferenceBackend else "float16"  # Triton: interpreted, 16-bit dtypes only
    check_backend_on_batches(backend, step_sequence(tree_spec(dtype, 32), "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", [TritonAttentionBackend, FlashInferBackend], ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_step_kinds_through_one_builder_on_gpu(backend, dtype):
    if backend is FlashInferBackend and not flashinfer_installed():
        pytest.skip("flashinfer is not installed")
    check_backend_on_batches(backend, step_sequence(tree_spec(dtype, 64), "cuda"))
