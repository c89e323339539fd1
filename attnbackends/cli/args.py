"""What the commands share: the parser with one-line errors, the layer-spec and pretend-device options, and how
errors and library text are printed (library text is never read as rich markup: ``[flash-attn]`` stays)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Sequence

import yaml
from pydantic import ValidationError
from rich.markup import escape

from ..platform import DeviceInfo
from ..spec import KV_CACHE_DTYPES, AttentionConfig, AttentionSpec, AttentionType

__all__ = [
    "KNOWN_GPUS",
    "HelpFormatter",
    "Parser",
    "UsageError",
    "add_config_arguments",
    "add_device_arguments",
    "add_spec_arguments",
    "config_from_args",
    "describe_spec",
    "device_from_args",
    "error_line",
    "plain",
    "positive",
    "spec_from_args",
]

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

#: The layer-spec options (attribute names) that describe one layer.
SPEC_OPTIONS = ("num_heads", "num_kv_heads", "head_size", "dtype", "kv_cache_dtype", "block_size", "attn_type",
                "sliding_window", "soft_cap", "alibi", "sinks", "mla", "kv_lora_rank", "qk_rope_head_dim")


class UsageError(ValueError):
    """A command-line mistake: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: `--help` shows it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(value: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def plain(text: Any) -> str:
    """``text`` for a rich console or table cell, printed as written (square brackets are not markup)."""
    return escape(str(text))


def error_line(exc: BaseException) -> str:
    """The message of a user error without library boilerplate (pydantic's documentation URLs and input echo)."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            message = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if where and not message.startswith(where) else message)
        return "; ".join(parts)
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"not valid YAML: {problem}{where}"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that describe one attention layer (read back by :func:`spec_from_args`)."""
    parser.add_argument("--num-heads", type=positive, default=32, help="query heads of the layer")
    parser.add_argument("--num-kv-heads", type=positive, default=None,
                        help="key/value heads (default 8; not with --mla: MLA caches one latent head)")
    parser.add_argument("--head-size", type=positive, default=None,
                        help="query/key head size (default 128; not with --mla: see --kv-lora-rank)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"], help="model dtype")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV-cache dtype; auto: the model dtype; fp8 means e4m3")
    parser.add_argument("--block-size", type=positive, default=16, help="tokens per KV-cache page")
    parser.add_argument("--attn-type", default="decoder", choices=[t.value for t in AttentionType],
                        help="decoder (causal, cached), encoder / encoder_only (bidirectional, no cache) or "
                             "encoder_decoder (cross-attention)")
    parser.add_argument("--sliding-window", type=positive, default=None,
                        help="keys visible per query, self included")
    parser.add_argument("--soft-cap", type=float, default=None, help="logit soft-cap: cap * tanh(s / cap)")
    parser.add_argument("--alibi", action="store_true", help="ALiBi slopes (one per query head)")
    parser.add_argument("--sinks", action="store_true", help="one learned sink logit per query head (gpt-oss)")
    parser.add_argument("--mla", action="store_true", help="a DeepSeek MLA layer (latent cache; see --kv-lora-rank)")
    parser.add_argument("--kv-lora-rank", type=positive, default=512, help="MLA latent size (with --mla)")
    parser.add_argument("--qk-rope-head-dim", type=positive, default=64, help="MLA rotary key size (with --mla)")


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    """The layer spec of :func:`add_spec_arguments`' options; UsageError for options that do not combine."""
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


def given_options(args: argparse.Namespace, defaults: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The ``--flag`` of each option in ``names`` whose value differs from ``defaults``."""
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != getattr(defaults, n)]


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that pretend to run on another device (read back by :func:`device_from_args`)."""
    parser.add_argument("--gpu", choices=sorted(KNOWN_GPUS),
                        help="pretend to run on this GPU (its compute capability and SM count)")
    parser.add_argument("--compute-capability", default=None,
                        help="pretend to run on a CUDA GPU of this compute capability, major.minor, e.g. 9.0")
    parser.add_argument("--sm-count", type=positive, default=None,
                        help="SMs of the pretend GPU (default: from --gpu; omitted otherwise)")
    parser.add_argument("--cpu", action="store_true", help="pretend to run on the CPU")


def device_from_args(args: argparse.Namespace) -> DeviceInfo:
    """The device of :func:`add_device_arguments`' options (this machine's when none is given)."""
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
    return DeviceInfo.cuda(cc[0], cc[1], sm_count=sm_count or 0, name=name)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and ``--profile-dir`` (read back by :func:`config_from_args`)."""
    parser.add_argument("--config", default=None, help="an AttentionConfig file (.yaml/.json; its attention section)")
    parser.add_argument("--profile-dir", default=None, help="where profiles live (default: the user cache dir)")


def config_from_args(args: argparse.Namespace) -> AttentionConfig:
    """The AttentionConfig of a ``--config`` file (its ``attention:`` section) and ``--profile-dir``, with
    ``ATTNBACKENDS_BACKEND`` applied."""
    config = AttentionConfig.from_file(args.config) if args.config else AttentionConfig()
    if args.profile_dir:
        config = config.model_copy(update={"profile_dir": args.profile_dir})
    return AttentionConfig.from_env(config)


def describe_spec(spec: AttentionSpec) -> str:
    """One line: the layer's heads and sizes, then its dtypes, page size, kind and features."""
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
