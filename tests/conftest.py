"""Test session setup: `gpu` tests skip cleanly where CUDA is missing; the CPU runs Triton interpreted."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
