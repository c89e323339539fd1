"""The `attnbackends tune` and `attnbackends warmup` subcommands (see :mod:`.tune_timing` and :mod:`.warmup`)."""

from __future__ import annotations

import argparse
import time
from typing import Callable

from rich.console import Console
from rich.table import Table

from .spec import KV_CACHE_DTYPES, AttentionConfig, AttentionSpec, AttentionType

__all__ = ["add_parsers", "COMMANDS"]


def _add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-heads", type=int, default=32, help="query heads of the layer")
    parser.add_argument("--num-kv-heads", type=int, default=8, help="KV heads of the layer")
    parser.add_argument("--head-size", type=int, default=128, help="head size of the layer")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"], help="model dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES), help="KV-cache dtype")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType],
                        help="attention type")
    parser.add_argument("--sliding-window", type=int, default=None, help="window in tokens")
    parser.add_argument("--soft-cap", type=float, default=None, help="logit soft-cap")
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes")
    parser.add_argument("--sinks", action="store_true", help="attention sinks")
    parser.add_argument("--mla", action="store_true", help="a DeepSeek-V3 MLA layer (latent 512 + rope 64)")
    parser.add_argument("--config", default=None, help="an AttentionConfig file (.yaml/.json; its attention section)")
    parser.add_argument("--profile-dir", default=None, help="where profiles live (default: the user cache dir)")


def add_parsers(sub: "argparse._SubParsersAction") -> None:
    tune = sub.add_parser("tune", help="time every fitting backend and phase composition here; store the profile")
    _add_spec_arguments(tune)
    tune.add_argument("--grid", default="small", choices=["small", "tiny"], help="tiny: a CPU smoke run")
    tune.add_argument("--candidates", default=None, help="comma-separated backend names (default: all that fit)")
    warm = sub.add_parser("warmup", help="compile the kernels a spec needs now (FlashInfer modules in parallel)")
    _add_spec_arguments(warm)


def _config(args: argparse.Namespace) -> AttentionConfig:
    config = AttentionConfig.from_file(args.config) if args.config else AttentionConfig()
    if args.profile_dir:
        config = config.model_copy(update={"profile_dir": args.profile_dir})
    return AttentionConfig.from_env(config)


def _spec(args: argparse.Namespace) -> AttentionSpec:
    from .cli import _spec_from_args

    return _spec_from_args(args)


def cmd_tune(args: argparse.Namespace, console: Console) -> int:
    from .platform import DeviceInfo
    from .selection.tune_timing import run_tune
    from .selection.tuning import choose, default_profile_dir

    spec, config = _spec(args), _config(args)
    device = DeviceInfo.current()
    candidates = [c.strip() for c in args.candidates.split(",")] if args.candidates else None
    console.print(f"tuning on {device.describe()} (first calls compile kernels: expect minutes on a fresh machine)")
    start = time.perf_counter()
    profile = run_tune(spec, device, grid=args.grid, candidates=candidates)
    console.print(f"timed in {time.perf_counter() - start:.1f} s")
    if device.is_cuda:
        path = profile.save(default_profile_dir(config))
        console.print(f"profile stored: {path}")
    else:
        console.print("[yellow]not stored: profiles are for CUDA devices (selection=measured ignores the CPU)[/]")
    from .selection.registry import get_backend_class, priority_list

    reasons = {name: get_backend_class(name).not_supported_reasons(spec, device) for name in profile.times_us}
    choice = choose(profile, reasons, priority_list(device, spec), source="this run")
    table = Table(title="measured")
    for col in ("candidate", "decode µs", "prefill µs", "mixed µs", "score", "status"):
        table.add_column(col)
    for row in choice.rows:
        table.add_row(row.name, *(f"{row.phase_us[p]:.1f}" if row.phase_us.get(p) is not None else "-"
                                  for p in ("decode", "prefill", "mixed")),
                      f"{row.score:.3f}" if row.score is not None else "-", row.status)
    console.print(table)
    console.print(choice.why)
    console.print("use it: AttentionConfig(selection='measured'); see it: attnbackends explain --selection measured")
    return 0 if choice.winner else 1


def cmd_warmup(args: argparse.Namespace, console: Console) -> int:
    from .selection.warmup import warmup

    spec, config = _spec(args), _config(args)
    start = time.perf_counter()
    records = warmup([spec], config=config)
    table = Table(title=f"warm-up: {time.perf_counter() - start:.1f} s in all")
    for col in ("what", "seconds", "detail"):
        table.add_column(col)
    for record in records:
        table.add_row(record.what, f"{record.seconds:.2f}", record.detail)
    console.print(table)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"tune": cmd_tune, "warmup": cmd_warmup}
