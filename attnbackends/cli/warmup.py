"""`attnbackends warmup`: compile the kernels a layer needs now, not on the first request (FlashInfer modules in
parallel; see :mod:`attnbackends.selection.warmup`). Without spec options it prepares what `attnbackends demo`
needs: the demo model's layer, and the demo engine's first steps (its CUDA-graph captures included)."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from .args import (SPEC_OPTIONS, add_config_arguments, add_spec_arguments, config_from_args, given_options, plain,
                   spec_from_args)

__all__ = ["add_parser", "run"]


def add_parser(sub: "argparse._SubParsersAction") -> None:
    warm = sub.add_parser("warmup", help="compile the kernels a spec needs now (FlashInfer modules in parallel); "
                                         "without spec options, what `attnbackends demo` needs")
    add_spec_arguments(warm)
    add_config_arguments(warm)
    warm.set_defaults(parser=warm)


def run(args: argparse.Namespace, console: Console) -> int:
    from ..selection.warmup import WarmupRecord, warmup

    config = config_from_args(args)
    for_demo = not given_options(args, args.parser.parse_args([]), SPEC_OPTIONS)
    start = time.perf_counter()
    if for_demo:
        from ..engine.demo_setup import demo_spec, warm_demo_engine

        console.print("no layer options given: preparing what `attnbackends demo` needs (its model's layer and "
                      "its engine's first steps)")
        records = warmup([demo_spec()], config=config)
        backend, seconds = warm_demo_engine(attention_config=config)
        records.append(WarmupRecord(f"{backend} demo engine steps", seconds, "prefill, mixed and decode steps, "
                                    "CUDA-graph captures"))
    else:
        records = warmup([spec_from_args(args)], config=config)
    table = Table(title=f"warm-up: {time.perf_counter() - start:.1f} s in all")
    for col in ("what", "seconds", "detail"):
        table.add_column(col)
    for record in records:
        table.add_row(plain(record.what), f"{record.seconds:.2f}", plain(record.detail))
    console.print(table)
    return 0
