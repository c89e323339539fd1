"""`attnbackends bench`: the benchmarks are tooling in the checkout (``benchmarks/``), not installed with the
library. With arguments, run from a checkout's root, it hands them to ``python -m benchmarks.run``; without, it
prints how to run them and exits 0."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from rich.console import Console

__all__ = ["BENCH_COMMAND", "add_parser", "run"]

BENCH_COMMAND = "python -m benchmarks.run [--suites triton,flashinfer_adapter,mla] [--outdir DIR]"

_HELP = f"""usage: attnbackends bench [--list | --suite NAME ... | --suites A,B | ...]

Runs the checkout's benchmarks (GPU timings against their peers; see docs/PERF.md): from a checkout's root,
`attnbackends bench ARGS` is `{BENCH_COMMAND.split(' [')[0]} ARGS`. `attnbackends bench --list` lists the suites and
the GPU test groups; `attnbackends bench --help` prints the benchmark tool's own options. The benchmarks are not
installed with the library: outside a checkout, clone the repository and run {BENCH_COMMAND} from its root."""


def add_parser(sub: "argparse._SubParsersAction") -> None:
    bench = sub.add_parser("bench", help="run the checkout's benchmarks (python -m benchmarks.run); no arguments: how",
                           add_help=False)
    bench.set_defaults(bench_args=[])  # the command line's arguments after `bench` (attnbackends.cli.main sets them)


def run(args: argparse.Namespace, console: Console) -> int:
    bench_args = list(args.bench_args)
    if not bench_args:
        console.print(_HELP, markup=False, highlight=False, soft_wrap=True)
        return 0
    root = Path.cwd()
    if not (root / "benchmarks" / "run.py").is_file():
        console.print(f"no benchmarks/ here ({root}): the benchmarks are not installed with the library; from a "
                      f"checkout's root run {BENCH_COMMAND}", markup=False, soft_wrap=True)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    os.environ.setdefault("PYTHONPATH", str(root))  # GPU test groups run in child processes
    return int(importlib.import_module("benchmarks.run").main(bench_args) or 0)
