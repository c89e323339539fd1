"""`attnbackends demo`: serve a tiny seeded random-weight Llama through the auto-selected backend, and check it
against a dense recompute of the same model."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from rich.console import Console

from ..engine import TinyLlamaConfig, token_agreement
from ..engine.demo_setup import BLOCK_SIZE, default_device as _default_device, default_dtype as _default_dtype
from ..engine.demo_setup import demo_engine, demo_prompts
from ..platform import DeviceInfo, check_device_available, is_triton_interpreted
from ..selection.registry import BackendNotSupportedError, get_backend_class
from ..spec import AttentionConfig, AttentionSpec, dtype_name, torch_dtype_of
from .args import plain, positive

__all__ = ["DemoReport", "add_parser", "run", "run_demo"]

logger = logging.getLogger(__name__)

@dataclass
class DemoReport:
    backend: str
    device: str
    dtype: str
    num_prompts: int
    new_tokens: int
    steps: int
    tokens_per_second: float
    token_agreement: float  # share of generated tokens the dense reference picks too (teacher-forced)
    max_logit_diff: float  # largest |engine - dense| over every generated position's logits
    warmup_seconds: float = 0.0  # the first steps, kernel compilation included; not in tokens_per_second


def run_demo(
    device: Optional[str] = None,
    num_prompts: int = 6,
    max_new_tokens: int = 16,
    seed: int = 0,
    attention_config: Optional[AttentionConfig] = None,
    dtype: "str | torch.dtype | None" = None,
    progress: Optional[Callable[[str], None]] = None,
) -> DemoReport:
    """Generate greedily for prompts of different lengths, then recompute every sequence densely and compare.

    device : "cpu", "cuda" or "cuda:N" (default: cuda when available); dtype : the model dtype, a name or a torch
    dtype (default: bfloat16 on cuda, float32 on the cpu). ``num_prompts`` and ``max_new_tokens`` must be >= 1.
    ``progress``: called with a line before the warm-up steps on a GPU (default: logged at INFO level).
    """
    say = progress or logger.info
    for name, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    device = str(check_device_available(device or _default_device()))
    dtype = _default_dtype(device) if dtype is None else torch_dtype_of(dtype)
    engine = demo_engine(device, dtype, attention_config, seed)
    model = engine.model
    prompts = demo_prompts(model.cfg.vocab_size, num_prompts, seed)
    if engine.device.type == "cuda":
        say(f"warm-up: the first steps on {engine.backend.name} compile its kernels on first use on this machine "
            f"(FlashInfer: tens of seconds per module; `attnbackends warmup` builds them ahead) ...")
    start = time.perf_counter()
    engine.generate(prompts[:2], 2)  # a decode, a prefill and a mixed step: the timing below is steady-state
    warmup_seconds = time.perf_counter() - start
    result = engine.generate(prompts, max_new_tokens)
    dense_choices, worst = [], 0.0
    with torch.inference_mode():
        for prompt, out, logits in zip(prompts, result.tokens, result.logits):
            seq = torch.tensor(prompt + out, device=engine.device)
            dense = engine.model.forward_dense(seq)[len(prompt) - 1 : -1].cpu()  # logits that chose each new token
            dense_choices.append(dense.argmax(-1).tolist())
            worst = max(worst, float((dense - logits).abs().max()))
    agreement = token_agreement(dense_choices, result.tokens)
    return DemoReport(
        backend=result.backend,
        device=str(engine.device),
        dtype=dtype_name(dtype),
        num_prompts=len(prompts),
        new_tokens=agreement.positions,
        steps=result.num_steps,
        tokens_per_second=result.tokens_per_second,
        token_agreement=agreement.agreement,
        max_logit_diff=worst,
        warmup_seconds=warmup_seconds,
    )


def add_parser(sub: "argparse._SubParsersAction") -> None:
    demo = sub.add_parser("demo", help="serve a tiny random-weight model through the auto-selected backend")
    demo.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    demo.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                      help="model dtype (default: bfloat16 on cuda, float32 on cpu; the triton backend needs a "
                           "16-bit dtype)")
    demo.add_argument("--prompts", type=positive, default=6, help="number of prompts")
    demo.add_argument("--new-tokens", type=positive, default=16, help="tokens generated per prompt")
    demo.add_argument("--backend", default="auto", help="backend name or auto (ATTNBACKENDS_BACKEND overrides it)")


def how_to_fit(backend: str, device: str, dtype: Optional[str]) -> Optional[str]:
    """The demo command line that lets ``backend`` run on this ``device`` (another ``--dtype``, Triton's CPU
    interpreter), or None when neither change makes it fit."""
    try:
        cls = get_backend_class(backend)
    except ValueError:
        return None
    on_cpu = not device.startswith("cuda")
    info = DeviceInfo.cpu(triton_interpreted=True) if on_cpu and cls.needs_triton else DeviceInfo.current(device)
    dtype = dtype or dtype_name(_default_dtype(device))
    dtypes = [dtype] + [d for d in ("bfloat16", "float16", "float32") if d != dtype and d in cls.supported_dtypes]
    cfg = TinyLlamaConfig()
    for candidate in dtypes:
        spec = AttentionSpec(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size,
                             dtype=candidate, block_size=BLOCK_SIZE)
        if cls.not_supported_reasons(spec, info):
            continue
        env = "TRITON_INTERPRET=1 " if on_cpu and cls.needs_triton and not is_triton_interpreted() else ""
        default = dtype_name(_default_dtype(device))
        flags = f" --device {device}" + (f" --dtype {candidate}" if candidate != default else "")
        return f"{env}attnbackends demo --backend {backend}{flags}"
    return None


def run(args: argparse.Namespace, console: Console) -> int:
    device = str(check_device_available(args.device, name="--device")) if args.device else _default_device()
    config = AttentionConfig.from_env(AttentionConfig(backend=args.backend))
    try:
        report = run_demo(device=device, num_prompts=args.prompts, max_new_tokens=args.new_tokens,
                          attention_config=config, dtype=args.dtype, progress=lambda line: console.print(plain(line)))
    except BackendNotSupportedError as exc:
        console.print(f"[red]{plain(exc)}[/]")
        fix = how_to_fit(config.backend, device, args.dtype) if config.backend != "auto" else None
        if fix is not None:
            console.print(f"to run it here: {plain(fix)}", soft_wrap=True)
        return 1
    console.print(f"backend chosen: [bold]{plain(report.backend)}[/] on {plain(report.device)} ({report.dtype})")
    console.print(f"warm-up (the first steps, kernel compilation included where the backend compiles): "
                  f"{report.warmup_seconds:.1f} s, not counted below")
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
