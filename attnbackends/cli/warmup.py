"""`attnbackends warmup`: compile the kernels a layer needs now, not on the first request (FlashInfer modules in
parallel; see :mod:`attnbackends.selection.warmup`)."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from .args import add_config_arguments, add_spec_arguments, config_from_args, plain, spec_from_args

__all__ = ["add_parser", "run"]


def add_parser(sub: "argparse._SubParsersAction") -> None:
    warm = sub.add_parser("warmup", help="compile the kernels a spec needs now (FlashInfer modules in parallel)")
    add_spec_arguments(warm)
    add_config_arguments(warm)


def run(args: argparse.Namespace, console: Console) -> int:
    from ..selection.warmup import warmup

    spec, config = spec_from_args(args), config_from_args(args)
    start = time.perf_counter()
    records = warmup([spec], config=config)
    table = Table(title=f"warm-up: {time.perf_counter() - start:.1f} s in all")
    for col in ("what", "seconds", "detail"):
        table.add_column(col)
    for record in records:
        table.add_row(plain(record.what), f"{record.seconds:.2f}", plain(record.detail))
    console.print(table)
    return 0
