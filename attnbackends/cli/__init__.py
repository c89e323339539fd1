"""Command line: `attnbackends list | explain | tune | warmup | demo | bench`, one module per command over the
shared options and printing of :mod:`.args` (`list` lives in :mod:`.list_backends`: a submodule named ``list``
would shadow the builtin inside this package)."""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

import yaml
from rich.console import Console

from . import bench, demo, explain, list_backends, tune, warmup
from .args import Parser, error_line, plain
from .bench import BENCH_COMMAND

__all__ = ["BENCH_COMMAND", "build_parser", "main"]

#: Every command's module: ``add_parser(subparsers)`` and ``run(args, console) -> exit status``.
COMMANDS = {"list": list_backends, "explain": explain, "tune": tune, "warmup": warmup, "demo": demo, "bench": bench}

_TOP_LEVEL_OPTIONS = ("-v", "--verbose", "-h", "--help")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="attnbackends", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser,
                                help=", ".join(COMMANDS))
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def _unknown_before_command(argv: Sequence[str]) -> list[str]:
    """Options before the command that the top-level parser does not know (argparse would only say that the
    command is missing)."""
    unknown = []
    for token in argv:
        if not token.startswith("-"):
            break
        if token not in _TOP_LEVEL_OPTIONS:
            unknown.append(token)
    return unknown


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    unknown = _unknown_before_command(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (commands: {', '.join(COMMANDS)}; options go "
                     "after the command: attnbackends COMMAND --help)")
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":  # bench hands the benchmarks' own arguments to them
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    try:
        return COMMANDS[args.command].run(args, console)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        console.print(f"[red]error:[/] {plain(error_line(exc))}", highlight=False, soft_wrap=True)
        return 2
