"""A pytest plugin for the GPU test groups: each failure's traceback written to stderr as soon as it happens.

pytest prints tracebacks in its closing summary; a group stopped at its time limit never reaches it, and its log
then says which tests failed but not why. With ``-p benchmarks.pytest_failures_now`` (what
:func:`benchmarks.gpu_tests.pytest_command` passes) a ``FAILURE NOW <node id>`` block follows each failure, the
last ``MAX_CHARS`` characters of its report (under pytest-xdist, the controller writes the workers' reports).
"""

from __future__ import annotations

import sys

MAX_CHARS = 2500


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        sys.stderr.write(f"\nFAILURE NOW {report.nodeid} ({report.when})\n{report.longreprtext[-MAX_CHARS:]}\n")
        sys.stderr.flush()
