"""`attnbackends list`: every registered backend, whether it can be used here, and what it supports."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ..selection.registry import resolve_backend
from ..selection.registry import backend_names
from .args import plain

__all__ = ["add_parser", "run"]


def add_parser(sub: "argparse._SubParsersAction") -> None:
    sub.add_parser("list", help="every registered backend and what it supports")


def run(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="attnbackends: registered backends", show_lines=True)
    table.add_column("backend", no_wrap=True)
    table.add_column("status")
    table.add_column("supports")
    for name in backend_names():
        cls, reasons = resolve_backend(name)
        if cls is None:
            table.add_row(name, "[red]unavailable[/]", plain("; ".join(reasons)))
            continue
        missing = cls.missing_packages()  # the same check as the "not installed" reasons of `explain`
        if missing:
            hint = cls.install_hint()
            status = "[yellow]" + plain("; ".join(missing) + (f" ({hint})" if hint else "")) + "[/]"
        else:
            status = "[green]installed[/]"
        caps = cls.capabilities()
        lo, hi = caps["compute_capability"]
        cc = "any GPU" if lo is None and hi is None else f"compute capability {lo or '?'}..{hi or ''}"
        lines = [
            f"dtypes: {', '.join(caps['dtypes'])}",
            f"kv cache: {', '.join(caps['kv_cache_dtypes'])}",
            f"head sizes: {caps['head_sizes']}; block size multiple of {caps['block_size_multiple']}",
            cc + ("; runs on CPU" if caps["cpu"] else ""),
            f"attention: {', '.join(caps['attn_types'])}; features: {', '.join(caps['features']) or '-'}",
            f"CUDA graphs: {caps['cudagraph']}",
            f"speculative decoding: {caps['speculative']}",
        ]
        table.add_row(name, status, plain("\n".join(lines)))
    console.print(table)
    return 0
