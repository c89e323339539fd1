"""Speculative decoding through FlashInfer on a GPU (`pytest -m gpu`): uniform multi-token decodes and tree
verification (the prefill wrapper's ``custom_mask``) against the float64 oracle."""

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.flashinfer import FlashInferBackend
from attnbackends.compat import flashinfer_installed
from attnbackends.testing import (
    CaseNotSupported,
    SequenceShape,
    check_backend_case,
    check_backend_on_batch,
    conformance_cases,
    make_random_batch,
)
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed"),
]

CASES = [c for c in conformance_cases("bfloat16", 128, 16) + conformance_cases("float16", 64, 16)
         if "tree" in c.name or "multi_token" in c.name]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_speculative_conformance(case):
    try:
        check_backend_case(FlashInferBackend, case, device="cuda")
    except CaseNotSupported as exc:
        pytest.skip(f"flashinfer declines: {exc}")


@pytest.mark.parametrize("seed", range(3))
def test_verify_batch_of_random_trees_at_long_context(seed):
    import random

    rng = random.Random(seed)
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                         num_speculative_tokens=7, speculative_tree=True)
    shapes = [SequenceShape(8, rng.randint(100, 3000)) for _ in range(8)]
    trees = [random_tree_parents(rng, 8) if i % 3 else list(EAGLE_TREE_8) for i in range(8)]
    check_backend_on_batch(FlashInferBackend, make_random_batch(spec, shapes, seed=seed, device="cuda",
                                                                tree_parents=trees))
