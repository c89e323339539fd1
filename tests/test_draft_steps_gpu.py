"""Draft steps on the GPU (`pytest -m gpu tests/test_draft_steps_gpu.py`): FlashInfer (one decode wrapper and
page-table buffer per step) and Triton build every step's metadata at once, then run the steps one after another,
each checked against the float64 oracle; plus long prefixes with EAGLE's topk 4 and a regular batch planned
between building the steps and running them."""

import random

import pytest
import torch

from attnbackends.flashinfer import FlashInferBackend
from attnbackends.compat import flashinfer_installed
from attnbackends.testing import SequenceShape, make_random_batch
from attnbackends.testing.conformance import DraftStepCase, check_backend_draft_case, draft_step_cases
from attnbackends.triton.backend import TritonAttentionBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = [TritonAttentionBackend, FlashInferBackend]
CASES = draft_step_cases("bfloat16", 128, 16) + draft_step_cases("float16", 64, 16)
LONG = DraftStepCase("draft_long_topk4", dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16",
                                                block_size=16),
                     tuple(random.Random(0).randint(200, 3000) for _ in range(8)), topk=4, num_steps=5, seed=9)


def _skip_without(backend):
    if backend is FlashInferBackend and not flashinfer_installed():
        pytest.skip("flashinfer is not installed")


@pytest.mark.parametrize("case", CASES + [LONG], ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_draft_steps_on_gpu(backend, case):
    _skip_without(backend)
    check_backend_draft_case(backend, case, device="cuda")


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_regular_build_between_does_not_disturb_the_steps(backend, monkeypatch):
    """The engine plans its verify batch while the draft steps' metadata is still to be used: the steps keep
    their own plans."""
    _skip_without(backend)
    builder_cls = backend.get_builder_cls()
    original = builder_cls.build_draft_steps

    def build_then_plan_another_batch(self, draft):
        metadata = original(self, draft)
        other = make_random_batch(self.spec, [SequenceShape(1, 700), SequenceShape(8, 90)], seed=5, device="cuda")
        self.build(other.common)
        return metadata

    monkeypatch.setattr(builder_cls, "build_draft_steps", build_then_plan_another_batch)
    check_backend_draft_case(backend, draft_step_cases("bfloat16", 128, 16)[1], device="cuda")
