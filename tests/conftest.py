"""Test session setup: `gpu` tests skip cleanly where CUDA is missing; the CPU runs Triton interpreted; property
tests report how many cases they ran (the `case_counter` fixture, printed at the end of the session)."""

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CASE_COUNTS = pytest.StashKey[collections.Counter]()


def pytest_configure(config):
    config.stash[_CASE_COUNTS] = collections.Counter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def case_counter(pytestconfig) -> collections.Counter:
    """Counter of cases run, by label (e.g. "triton vs oracle"); printed in the terminal summary."""
    return pytestconfig.stash[_CASE_COUNTS]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = config.stash.get(_CASE_COUNTS, None)
    if not counts:
        return
    terminalreporter.write_sep("-", "property-test cases run")
    for label, n in sorted(counts.items()):
        terminalreporter.write_line(f"{label}: {n}")
    terminalreporter.write_line(f"total: {sum(counts.values())}")
