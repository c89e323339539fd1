"""`attnbackends tune`: time every backend and phase composition that fits a layer on this machine and store the
profile that ``AttentionConfig(selection="measured")`` reads (see :mod:`attnbackends.selection.tune_timing`)."""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from .args import add_config_arguments, add_spec_arguments, config_from_args, plain, spec_from_args

__all__ = ["add_parser", "run"]


def add_parser(sub: "argparse._SubParsersAction") -> None:
    from ..selection.tune_timing import LAYERS_PER_STEP, TUNE_ROUNDS

    tune = sub.add_parser("tune", help="time every fitting backend and phase composition here; store the profile")
    add_spec_arguments(tune)
    add_config_arguments(tune)
    tune.add_argument("--grid", default=None, choices=["small", "tiny"],
                      help="the shapes timed: small (serving-sized steps; the default on a GPU) or tiny (a few "
                           "tokens; the default on a CPU, where the profile is not stored)")
    tune.add_argument("--candidates", default=None, help="comma-separated backend names (default: all that fit)")
    tune.add_argument("--layers-per-step", type=int, default=LAYERS_PER_STEP,
                      help="layers sharing one build() in a timed step (the model's layer count weighs the build as "
                           "serving does)")
    tune.add_argument("--rounds", type=int, default=TUNE_ROUNDS,
                      help="rounds over every (candidate, shape); each keeps its fastest (host speed drifts)")


def run(args: argparse.Namespace, console: Console) -> int:
    from ..platform import DeviceInfo
    from ..selection.registry import get_backend_class, priority_list
    from ..selection.tune_timing import run_tune
    from ..selection.tuning import choose, default_profile_dir

    spec, config = spec_from_args(args), config_from_args(args)
    device = DeviceInfo.current()
    candidates = [c.strip() for c in args.candidates.split(",")] if args.candidates else None
    grid = args.grid or ("small" if device.is_cuda else "tiny")
    if device.is_cuda:
        console.print(f"tuning on {plain(device.describe())}, grid {grid} (first calls compile kernels: expect "
                      "minutes on a fresh machine)")
    else:
        console.print(f"tuning on {plain(device.describe())}, grid {grid}: without a GPU this only shows what tune "
                      "does (a smoke run of the timing on tiny steps, well under a minute); the profile it measures "
                      "is not stored, since selection='measured' reads profiles of CUDA devices only")
    start = time.perf_counter()
    profile = run_tune(spec, device, grid=grid, candidates=candidates,
                       layers_per_step=args.layers_per_step, rounds=args.rounds)
    console.print(f"timed in {time.perf_counter() - start:.1f} s")
    if device.is_cuda:
        path = profile.save(default_profile_dir(config))
        console.print(f"profile stored: {plain(path)}")
    else:
        console.print("[yellow]not stored: profiles are for CUDA devices (selection=measured ignores the CPU)[/]")
    reasons = {name: get_backend_class(name).not_supported_reasons(spec, device) for name in profile.times_us}
    choice = choose(profile, reasons, priority_list(device, spec), source="this run")
    table = Table(title="measured")
    for col in ("candidate", "decode µs", "prefill µs", "mixed µs", "score", "status"):
        table.add_column(col)
    for row in choice.rows:
        table.add_row(plain(row.name), *(f"{row.phase_us[p]:.1f}" if row.phase_us.get(p) is not None else "-"
                                         for p in ("decode", "prefill", "mixed")),
                      f"{row.score:.3f}" if row.score is not None else "-", plain(row.status))
    console.print(table)
    console.print(plain(choice.why))
    console.print("use it: AttentionConfig(selection='measured'); see it: attnbackends explain --selection measured")
    return 0 if choice.winner else 1
