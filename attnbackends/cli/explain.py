"""`attnbackends explain`: which backend would serve a layer (or every layer group of a model file) on this or a
pretend device, and why each other backend would not."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from ..layer_groups import LayerGroupsConfig, read_layer_specs
from ..layer_groups import explain_groups, format_layers
from ..selection.registry import Explanation, cudagraph_support_text, explain
from ..spec import AttentionConfig
from .args import (SPEC_OPTIONS, UsageError, add_device_arguments, add_spec_arguments, describe_spec, device_from_args,
                   error_line, given_options, plain, spec_from_args)

__all__ = ["add_parser", "run"]

#: explain's options that choose the backend; with --layers they apply to every group the file does not pin.
_CHOICE_OPTIONS = ("backend", "selection", "decode_backend", "prefill_backend", "profile_dir")


def add_parser(sub: "argparse._SubParsersAction") -> None:
    ex = sub.add_parser("explain", help="which backend would be chosen for a layer, and why each other one was not")
    add_spec_arguments(ex)
    add_device_arguments(ex)
    ex.add_argument("--backend", default="auto",
                    help="a backend name to validate instead of auto-selection (ATTNBACKENDS_BACKEND overrides it)")
    ex.add_argument("--selection", default="static", choices=["static", "measured"],
                    help="static priority lists, or a profile stored by `attnbackends tune`")
    ex.add_argument("--decode-backend", default=None, help="backend for decodes (a phase composition)")
    ex.add_argument("--prefill-backend", default=None, help="backend for prefills (a phase composition)")
    ex.add_argument("--profile-dir", default=None, help="where `attnbackends tune` profiles live")
    ex.add_argument("--layers", default=None, metavar="FILE",
                    help="explain a whole model's layer groups instead of one layer: a YAML/JSON file with a "
                         "`layers:` list of layer specs (and optional `layer_defaults:`, `attention:`, "
                         "`layer_groups:` pins); see examples/layer_groups_encdec.yaml")
    ex.set_defaults(parser=ex)


def print_explanation(result: Explanation, console: Console, title: str) -> None:
    """One explanation's table, notes and measured profile."""
    table = Table(title=plain(title))
    for col in ("backend", "status", "reasons"):
        table.add_column(col)
    for name, status, reasons in result.as_table():
        style = {"chosen": "bold green", "rejected": "red"}.get(status, "yellow")
        table.add_row(plain(name), f"[{style}]{plain(status)}[/]", plain(reasons))
    console.print(table)
    for note in result.notes:
        console.print(f"note: {plain(note)}")
    graphs_text = [f"{row.name}: {cudagraph_support_text(row.cudagraph)}" for row in result.rows
                   if row.cudagraph is not None]
    console.print(f"CUDA graphs: {plain('; '.join(graphs_text))}")
    if result.measured is not None:
        console.print(plain(result.measured.render()))


def _run_layers(args: argparse.Namespace, console: Console) -> int:
    """`explain --layers FILE`: the model's layer groups (the file's `layers:`, pins from its `attention:` and
    `layer_groups:` sections), each with the registry's table."""
    defaults = args.parser.parse_args([])
    given = given_options(args, defaults, SPEC_OPTIONS)
    if given:
        raise UsageError(f"--layers takes every layer's spec from the file; drop {', '.join(given)}")
    path = Path(args.layers)
    if not path.is_file():
        raise UsageError(f"--layers {args.layers}: no such file" if not path.exists() else
                         f"--layers {args.layers}: not a file")
    try:
        specs = read_layer_specs(path)
        config = LayerGroupsConfig.from_file(path)
    except yaml.YAMLError as exc:
        raise UsageError(f"--layers {args.layers}: {error_line(exc)}") from None
    update = {o: getattr(args, o) for o in _CHOICE_OPTIONS if getattr(args, o) != getattr(defaults, o)}
    default = AttentionConfig.from_env(AttentionConfig.model_validate({**config.default.model_dump(), **update}))
    config = config.model_copy(update={"default": default})
    device = device_from_args(args)
    rows, _, _ = explain_groups(specs, device, config)
    console.print(plain(f"{len(specs)} layers in {len(rows)} groups; device: {device.describe()}"))
    unserved = []
    for name, spec, layers, _, result in rows:
        print_explanation(result, console, f"group {name}: layers {format_layers(layers)}\n"
                                           f"{describe_spec(spec)}; backend requested: {result.requested}")
        console.print(f"group {plain(name)} chosen: [bold]{plain(result.chosen or 'none')}[/]")
        if result.chosen is None:
            unserved.append(name)
    if unserved:
        console.print(f"[bold red]no backend (or not the requested one) fits groups {plain(', '.join(unserved))}[/]")
        return 1
    return 0


def run(args: argparse.Namespace, console: Console) -> int:
    if args.layers is not None:
        return _run_layers(args, console)
    spec = spec_from_args(args)
    device = device_from_args(args)
    config = AttentionConfig.from_env(AttentionConfig(
        backend=args.backend, selection=args.selection, decode_backend=args.decode_backend,
        prefill_backend=args.prefill_backend, profile_dir=args.profile_dir))
    result = explain(spec, device, config)
    print_explanation(result, console, f"layer: {describe_spec(spec)}\ndevice: {device.describe()}; backend "
                                       f"requested: {result.requested}")
    if result.chosen is None:
        if result.requested != "auto":
            console.print(f"[bold red]the requested backend {plain(result.requested)} does not fit this spec on this "
                          "device[/] (its reasons are in the table)")
        else:
            console.print("[bold red]no backend fits this spec on this device[/]")
        return 1
    console.print(f"chosen: [bold]{plain(result.chosen)}[/]")
    return 0
