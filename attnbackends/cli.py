"""Command line: `attnbackends list | explain | demo | bench | tune | warmup`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from .cli_tune import COMMANDS as TUNE_COMMANDS
from .cli_tune import add_parsers as add_tune_parsers
from .platform import DeviceInfo, package_available
from .registry import BackendNotSupportedError, backend_names, explain
from .registry import _resolve as resolve_backend  # noqa: PLC2701 - the CLI shows import failures as reasons
from .spec import KV_CACHE_DTYPES, AttentionConfig, AttentionSpec, AttentionType

__all__ = ["BENCH_COMMAND", "main"]

BENCH_COMMAND = "python -m benchmarks.run [--suites triton,flashinfer_adapter,mla] [--outdir DIR]"


def _cmd_list(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="attnbackends: registered backends", show_lines=True)
    table.add_column("backend", no_wrap=True)
    table.add_column("status")
    table.add_column("supports")
    for name in backend_names():
        cls, reasons = resolve_backend(name)
        if cls is None:
            table.add_row(name, "[red]unavailable[/]", "; ".join(reasons))
            continue
        caps = cls.capabilities()
        missing = [p for p in caps["packages"] if not package_available(p)]
        status = "[yellow]needs " + ", ".join(missing) + "[/]" if missing else "[green]installed[/]"
        lo, hi = caps["compute_capability"]
        cc = "any GPU" if lo is None and hi is None else f"compute capability {lo or '?'}..{hi or ''}"
        lines = [
            f"dtypes: {', '.join(caps['dtypes'])}",
            f"kv cache: {', '.join(caps['kv_cache_dtypes'])}",
            f"head sizes: {caps['head_sizes']}; block size multiple of {caps['block_size_multiple']}",
            cc + ("; runs on CPU" if caps["cpu"] else ""),
            f"attention: {', '.join(caps['attn_types'])}; features: {', '.join(caps['features']) or '-'}",
            f"CUDA graphs: {caps['cudagraph']}",
        ]
        table.add_row(name, status, "\n".join(lines))
    console.print(table)
    return 0


def _spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    common = dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        sliding_window=args.sliding_window,
        logits_soft_cap=args.soft_cap,
        has_sinks=args.sinks,
    )
    if args.mla:
        return AttentionSpec.mla(num_heads=args.num_heads, **common)
    alibi = tuple(2.0 ** (-(i + 1)) for i in range(args.num_heads)) if args.alibi else None
    return AttentionSpec(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        attn_type=args.attn_type,
        alibi_slopes=alibi,
        **common,
    )


def _device_from_args(args: argparse.Namespace) -> DeviceInfo:
    if args.cpu:
        return DeviceInfo.cpu()
    if args.compute_capability:
        major, _, minor = args.compute_capability.partition(".")
        return DeviceInfo.cuda(int(major), int(minor or 0), sm_count=args.sm_count)
    return DeviceInfo.current()


def _cmd_explain(args: argparse.Namespace, console: Console) -> int:
    spec = _spec_from_args(args)
    device = _device_from_args(args)
    config = AttentionConfig.from_env(AttentionConfig(
        backend=args.backend, selection=args.selection, decode_backend=args.decode_backend,
        prefill_backend=args.prefill_backend, profile_dir=args.profile_dir))
    result = explain(spec, device, config)
    table = Table(title=f"{device.describe()}; requested: {result.requested}")
    for col in ("backend", "status", "reasons"):
        table.add_column(col)
    for name, status, reasons in result.as_table():
        style = {"chosen": "bold green", "rejected": "red"}.get(status, "yellow")
        table.add_row(name, f"[{style}]{status}[/]", reasons)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    if result.measured is not None:
        console.print(result.measured.render())
    if result.chosen is None:
        console.print("[bold red]no backend fits this spec on this device[/]")
        return 1
    console.print(f"chosen: [bold]{result.chosen}[/]")
    return 0


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    config = AttentionConfig.from_env(AttentionConfig(backend=args.backend))
    try:
        report = run_demo(device=args.device, num_prompts=args.prompts, max_new_tokens=args.new_tokens, attention_config=config)
    except BackendNotSupportedError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    console.print(f"backend chosen: [bold]{report.backend}[/] on {report.device} ({report.dtype})")
    console.print(f"warm-up (kernel compilation on first use): {report.warmup_seconds:.1f} s, not counted below")
    console.print(
        f"{report.num_prompts} prompts, {report.new_tokens} new tokens in {report.steps} steps: "
        f"{report.tokens_per_second:.1f} tokens/s"
    )
    console.print(
        f"agreement with the dense reference: {100 * report.token_agreement:.1f}% of tokens identical, "
        f"max |logit diff| {report.max_logit_diff:.3g}"
    )
    ok = report.token_agreement >= (1.0 if report.dtype == "float32" else 0.9)
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnbackends", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every registered backend and what it supports")

    ex = sub.add_parser("explain", help="which backend would be chosen for a layer, and why each other one was not")
    ex.add_argument("--num-heads", type=int, default=32)
    ex.add_argument("--num-kv-heads", type=int, default=8)
    ex.add_argument("--head-size", type=int, default=128)
    ex.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ex.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    ex.add_argument("--block-size", type=int, default=16)
    ex.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType])
    ex.add_argument("--sliding-window", type=int, default=None)
    ex.add_argument("--soft-cap", type=float, default=None)
    ex.add_argument("--alibi", action="store_true")
    ex.add_argument("--sinks", action="store_true")
    ex.add_argument("--mla", action="store_true", help="a DeepSeek-V3 MLA layer (latent 512 + rope 64)")
    ex.add_argument("--compute-capability", help="pretend to run on a CUDA GPU of this compute capability, e.g. 9.0")
    ex.add_argument("--sm-count", type=int, default=132)
    ex.add_argument("--cpu", action="store_true", help="pretend to run on the CPU")
    ex.add_argument("--backend", default="auto", help="explicit choice to validate instead of auto")
    ex.add_argument("--selection", default="static", choices=["static", "measured"])
    ex.add_argument("--decode-backend", default=None, help="backend for decodes (a phase composition)")
    ex.add_argument("--prefill-backend", default=None, help="backend for prefills (a phase composition)")
    ex.add_argument("--profile-dir", default=None, help="where `attnbackends tune` profiles live")

    demo = sub.add_parser("demo", help="serve a tiny random-weight model through the auto-selected backend")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--prompts", type=int, default=6)
    demo.add_argument("--new-tokens", type=int, default=16)
    demo.add_argument("--backend", default="auto")
    sub.add_parser("bench", help="benchmarks are tooling in the checkout: says how to run them")
    add_tune_parsers(sub)
    return parser


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    console.print(f"benchmarks are not installed with the library: from a checkout's root run {BENCH_COMMAND}",
                  markup=False, soft_wrap=True)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":  # bench takes the benchmarks' own arguments and points at them
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    try:
        commands = {"list": _cmd_list, "explain": _cmd_explain, "demo": _cmd_demo, "bench": _cmd_bench, **TUNE_COMMANDS}
        return commands[args.command](args, console)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
