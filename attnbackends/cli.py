"""Command line: `attnbackends list | explain | demo | bench | tune | warmup`."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Optional, Sequence

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from .cli_tune import COMMANDS as TUNE_COMMANDS
from .cli_tune import add_parsers as add_tune_parsers
from .layer_groups import LayerGroupsConfig, read_layer_specs
from .layer_groups import explain_groups, format_layers
from .platform import DeviceInfo, package_available
from .selection.registry import BackendNotSupportedError, backend_names, explain
from .selection.registry import _resolve as resolve_backend  # noqa: PLC2701 - the CLI shows import failures as reasons
from .spec import KV_CACHE_DTYPES, AttentionConfig, AttentionSpec, AttentionType
from .validation import check_device_available

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
            f"speculative decoding: {caps['speculative']}",
        ]
        table.add_row(name, status, "\n".join(lines))
    console.print(table)
    return 0


#: SM counts of common GPUs, for `explain --gpu`: (compute capability, SMs).
KNOWN_GPUS = {
    "a100": ((8, 0), 108),
    "a10g": ((8, 6), 80),
    "l4": ((8, 9), 58),
    "l40s": ((8, 9), 142),
    "h100": ((9, 0), 132),
    "h200": ((9, 0), 132),
    "b200": ((10, 0), 148),
}

_COMPUTE_CAPABILITY = re.compile(r"^(\d{1,2})\.(\d)$")


class UsageError(ValueError):
    """A command-line mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: `--help` shows it)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
        for flag, value in (("--head-size", args.head_size), ("--num-kv-heads", args.num_kv_heads)):
            if value is not None:
                raise UsageError(f"{flag} does not apply with --mla: an MLA layer caches one latent head of "
                                 "kv_lora_rank + qk_rope_head_dim; set those with --kv-lora-rank and --qk-rope-head-dim")
        return AttentionSpec.mla(num_heads=args.num_heads, kv_lora_rank=args.kv_lora_rank,
                                 qk_rope_head_dim=args.qk_rope_head_dim, **common)
    alibi = tuple(2.0 ** (-(i + 1)) for i in range(args.num_heads)) if args.alibi else None
    return AttentionSpec(
        num_heads=args.num_heads,
        num_kv_heads=8 if args.num_kv_heads is None else args.num_kv_heads,
        head_size=128 if args.head_size is None else args.head_size,
        attn_type=args.attn_type,
        alibi_slopes=alibi,
        **common,
    )


def _device_from_args(args: argparse.Namespace) -> DeviceInfo:
    pretend_gpu = args.compute_capability is not None or args.gpu is not None or args.sm_count is not None
    if args.cpu and pretend_gpu:
        raise UsageError("--cpu cannot be combined with --gpu, --compute-capability or --sm-count: pick one device")
    if args.cpu:
        return DeviceInfo.cpu()
    if not pretend_gpu:
        return DeviceInfo.current()
    cc, sm_count, name = None, args.sm_count, ""
    if args.gpu is not None:
        cc, known_sms = KNOWN_GPUS[args.gpu]
        sm_count = known_sms if sm_count is None else sm_count
        name = args.gpu.upper()
    if args.compute_capability is not None:
        match = _COMPUTE_CAPABILITY.match(args.compute_capability.strip())
        if not match:
            raise UsageError(f"--compute-capability must be major.minor, e.g. 9.0 or 8.9; got {args.compute_capability!r}")
        given = (int(match.group(1)), int(match.group(2)))
        if cc is not None and given != cc:
            raise UsageError(f"--gpu {args.gpu} has compute capability {cc[0]}.{cc[1]}, not {args.compute_capability}")
        cc = given
    if cc is None:
        raise UsageError("--sm-count needs --gpu or --compute-capability")
    if sm_count is not None and sm_count < 1:
        raise UsageError(f"--sm-count must be >= 1, got {sm_count}")
    return DeviceInfo.cuda(cc[0], cc[1], sm_count=sm_count or 0, name=name)


def _describe_spec(spec: AttentionSpec) -> str:
    if spec.is_mla:
        shape = (f"MLA, {spec.num_heads} heads, latent {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim} "
                 f"(nope {spec.qk_nope_head_dim}, v {spec.v_head_dim})")
    else:
        shape = f"{spec.num_heads} q / {spec.num_kv_heads} kv heads, head size {spec.head_size}"
    extras = [f"dtype {spec.dtype}", f"kv cache {spec.kv_cache_dtype}", f"block size {spec.block_size}",
              spec.attn_type.value]
    for label, value in (("sliding window", spec.sliding_window), ("soft-cap", spec.logits_soft_cap)):
        if value is not None:
            extras.append(f"{label} {value}")
    if spec.alibi_slopes is not None:
        extras.append("ALiBi")
    if spec.has_sinks:
        extras.append("sinks")
    return shape + "; " + ", ".join(extras)


def _print_explanation(result, console: Console, title: str) -> None:
    """One explanation's table, notes and measured profile."""
    table = Table(title=title)
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


#: explain's options that describe one layer; --layers takes every layer's spec from its file instead.
_SPEC_OPTIONS = ("num_heads", "num_kv_heads", "head_size", "dtype", "kv_cache_dtype", "block_size", "attn_type",
                 "sliding_window", "soft_cap", "alibi", "sinks", "mla", "kv_lora_rank", "qk_rope_head_dim")
#: explain's options that choose the backend; with --layers they apply to every group the file does not pin.
_CHOICE_OPTIONS = ("backend", "selection", "decode_backend", "prefill_backend", "profile_dir")


def _cmd_explain_layers(args: argparse.Namespace, console: Console) -> int:
    """`explain --layers FILE`: the model's layer groups (the file's `layers:`, pins from its `attention:` and
    `layer_groups:` sections), each with the registry's table."""
    defaults = _parser().parse_args(["explain"])
    given = [f"--{o.replace('_', '-')}" for o in _SPEC_OPTIONS if getattr(args, o) != getattr(defaults, o)]
    if given:
        raise UsageError(f"--layers takes every layer's spec from the file; drop {', '.join(given)}")
    specs = read_layer_specs(args.layers)
    config = LayerGroupsConfig.from_file(args.layers)
    update = {o: getattr(args, o) for o in _CHOICE_OPTIONS if getattr(args, o) != getattr(defaults, o)}
    default = AttentionConfig.from_env(AttentionConfig.model_validate({**config.default.model_dump(), **update}))
    config = config.model_copy(update={"default": default})
    device = _device_from_args(args)
    rows, _, _ = explain_groups(specs, device, config)
    console.print(f"{len(specs)} layers in {len(rows)} groups; device: {device.describe()}")
    unserved = []
    for name, spec, layers, _, result in rows:
        _print_explanation(result, console, f"group {name}: layers {format_layers(layers)}\n"
                                            f"{_describe_spec(spec)}; backend requested: {result.requested}")
        console.print(f"group {name} chosen: [bold]{result.chosen or 'none'}[/]")
        if result.chosen is None:
            unserved.append(name)
    if unserved:
        console.print(f"[bold red]no backend (or not the requested one) fits groups {', '.join(unserved)}[/]")
        return 1
    return 0


def _cmd_explain(args: argparse.Namespace, console: Console) -> int:
    if args.layers is not None:
        return _cmd_explain_layers(args, console)
    spec = _spec_from_args(args)
    device = _device_from_args(args)
    config = AttentionConfig.from_env(AttentionConfig(
        backend=args.backend, selection=args.selection, decode_backend=args.decode_backend,
        prefill_backend=args.prefill_backend, profile_dir=args.profile_dir))
    result = explain(spec, device, config)
    _print_explanation(result, console, f"layer: {_describe_spec(spec)}\ndevice: {device.describe()}; backend "
                                        f"requested: {result.requested}")
    if result.chosen is None:
        if result.requested != "auto":
            console.print(f"[bold red]the requested backend {result.requested} does not fit this spec on this "
                          "device[/] (its reasons are in the table)")
        else:
            console.print("[bold red]no backend fits this spec on this device[/]")
        return 1
    console.print(f"chosen: [bold]{result.chosen}[/]")
    return 0


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    if args.device is not None:
        check_device_available(args.device, name="--device")
    config = AttentionConfig.from_env(AttentionConfig(backend=args.backend))
    try:
        report = run_demo(device=args.device, num_prompts=args.prompts, max_new_tokens=args.new_tokens,
                          attention_config=config, dtype=args.dtype, progress=console.print)
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
    need = 1.0 if report.dtype == "float32" else 0.9
    if report.token_agreement < need:
        console.print(f"[red]fewer than {100 * need:.0f}% of the tokens agree with the dense reference[/]")
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="attnbackends", description=__doc__, formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every registered backend and what it supports", formatter_class=fmt)

    ex = sub.add_parser("explain", formatter_class=fmt,
                        help="which backend would be chosen for a layer, and why each other one was not")
    ex.add_argument("--num-heads", type=_positive, default=32, help="query heads of the layer")
    ex.add_argument("--num-kv-heads", type=_positive, default=None,
                    help="key/value heads (default 8; not with --mla: MLA caches one latent head)")
    ex.add_argument("--head-size", type=_positive, default=None,
                    help="query/key head size (default 128; not with --mla: see --kv-lora-rank)")
    ex.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"], help="model dtype")
    ex.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                    help="KV-cache dtype; auto: the model dtype; fp8 means e4m3")
    ex.add_argument("--block-size", type=_positive, default=16, help="tokens per KV-cache page")
    ex.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType],
                    help="decoder (causal, cached), encoder / encoder_only (bidirectional, no cache) or "
                         "encoder_decoder (cross-attention)")
    ex.add_argument("--sliding-window", type=_positive, default=None, help="keys visible per query, self included")
    ex.add_argument("--soft-cap", type=float, default=None, help="logit soft-cap: cap * tanh(s / cap)")
    ex.add_argument("--alibi", action="store_true", help="ALiBi slopes (one per query head)")
    ex.add_argument("--sinks", action="store_true", help="one learned sink logit per query head (gpt-oss)")
    ex.add_argument("--mla", action="store_true", help="a DeepSeek MLA layer (latent cache; see --kv-lora-rank)")
    ex.add_argument("--kv-lora-rank", type=_positive, default=512, help="MLA latent size (with --mla)")
    ex.add_argument("--qk-rope-head-dim", type=_positive, default=64, help="MLA rotary key size (with --mla)")
    ex.add_argument("--gpu", choices=sorted(KNOWN_GPUS),
                    help="pretend to run on this GPU (its compute capability and SM count)")
    ex.add_argument("--compute-capability", default=None,
                    help="pretend to run on a CUDA GPU of this compute capability, major.minor, e.g. 9.0")
    ex.add_argument("--sm-count", type=_positive, default=None,
                    help="SMs of the pretend GPU (default: from --gpu; omitted otherwise)")
    ex.add_argument("--cpu", action="store_true", help="pretend to run on the CPU")
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

    demo = sub.add_parser("demo", formatter_class=fmt,
                          help="serve a tiny random-weight model through the auto-selected backend")
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    demo.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                      help="model dtype (default: bfloat16 on cuda, float32 on cpu; the triton backend needs a "
                           "16-bit dtype)")
    demo.add_argument("--prompts", type=_positive, default=6, help="number of prompts")
    demo.add_argument("--new-tokens", type=_positive, default=16, help="tokens generated per prompt")
    demo.add_argument("--backend", default="auto",
                      help="backend name or auto (ATTNBACKENDS_BACKEND overrides it)")
    sub.add_parser("bench", formatter_class=fmt, help="benchmarks are tooling in the checkout: says how to run them")
    add_tune_parsers(sub)
    return parser


def _error_line(exc: ValueError) -> str:
    """The message of a user error without library boilerplate (pydantic's documentation URLs and input echo)."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            message = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if where and not message.startswith(where) else message)
        return "; ".join(parts)
    return str(exc)


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
        console.print(f"[red]error:[/] {_error_line(exc)}", highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
