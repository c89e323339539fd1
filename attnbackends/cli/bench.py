"""`attnbackends bench`: benchmarks are tooling in the checkout, not installed with the library; says how to run
them."""

from __future__ import annotations

import argparse

from rich.console import Console

__all__ = ["BENCH_COMMAND", "add_parser", "run"]

BENCH_COMMAND = "python -m benchmarks.run [--suites triton,flashinfer_adapter,mla] [--outdir DIR]"


def add_parser(sub: "argparse._SubParsersAction") -> None:
    sub.add_parser("bench", help="benchmarks are tooling in the checkout: says how to run them")


def run(args: argparse.Namespace, console: Console) -> int:
    console.print(f"benchmarks are not installed with the library: from a checkout's root run {BENCH_COMMAND}",
                  markup=False, soft_wrap=True)
    return 2
