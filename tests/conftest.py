"""Test setup: `gpu` tests skip cleanly where CUDA is missing; the CPU runs Triton interpreted; property
tests report how many cases they ran (the `case_counter` fixture) and the bad-input catalogue how many kinds it ran
(the `bad_input_catalogue` fixture), both printed at the end of the run."""

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CASE_COUNTS = pytest.StashKey[collections.Counter]()
_BAD_INPUT_KINDS = pytest.StashKey[set]()


def pytest_configure(config):
    config.stash[_CASE_COUNTS] = collections.Counter()
    config.stash[_BAD_INPUT_KINDS] = set()


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


@pytest.fixture(scope="session")
def bad_input_catalogue(pytestconfig) -> set:
    """Names of the bad-input kinds run (tests/test_bad_input_catalogue.py); their number is printed at the end."""
    return pytestconfig.stash[_BAD_INPUT_KINDS]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kinds = config.stash.get(_BAD_INPUT_KINDS, None)
    if kinds:
        terminalreporter.write_sep("-", "bad-input catalogue")
        terminalreporter.write_line(f"bad-input catalogue: {len(kinds)} kinds of bad input run")
    counts = config.stash.get(_CASE_COUNTS, None)
    if not counts:
        return
    terminalreporter.write_sep("-", "property-test cases run")
    for label, n in sorted(counts.items()):
        terminalreporter.write_line(f"{label}: {n}")
    terminalreporter.write_line(f"total: {sum(counts.values())}")
