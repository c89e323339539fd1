"""`attnbackends demo`: serve a tiny seeded random-weight Llama through the auto-selected backend, and check it
against a dense recompute of the same model."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig
from .spec import AttentionConfig, torch_dtype_of
from .validation import check_device_available

__all__ = ["DemoReport", "run_demo"]

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
    device = str(check_device_available(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = torch_dtype_of(dtype)
    model = TinyLlama(TinyLlamaConfig(), seed=seed)
    engine = PagedEngine(
        model, EngineConfig(block_size=16, max_num_batched_tokens=64), device=device, dtype=dtype,
        attention_config=attention_config,
    )
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 40, 90][:num_prompts] + [rng.randint(2, 70) for _ in range(max(0, num_prompts - 6))]
    prompts = [[rng.randrange(model.cfg.vocab_size) for _ in range(n)] for n in lengths]
    if engine.device.type == "cuda":
        say(f"warm-up: the first steps on {engine.backend.name} compile its kernels on first use on this machine "
            f"(FlashInfer: tens of seconds per module; `attnbackends warmup` builds them ahead) ...")
    start = time.perf_counter()
    engine.generate(prompts[:2], 2)  # a decode, a prefill and a mixed step: the timing below is steady-state
    warmup_seconds = time.perf_counter() - start
    result = engine.generate(prompts, max_new_tokens)
    agree, total, worst = 0, 0, 0.0
    with torch.inference_mode():
        for prompt, out, logits in zip(prompts, result.tokens, result.logits):
            seq = torch.tensor(prompt + out, device=engine.device)
            dense = engine.model.forward_dense(seq)[len(prompt) - 1 : -1].cpu()  # logits that chose each new token
            agree += int((dense.argmax(-1) == torch.tensor(out)).sum())
            total += len(out)
            worst = max(worst, float((dense - logits).abs().max()))
    return DemoReport(
        backend=result.backend,
        device=str(engine.device),
        dtype=str(dtype).replace("torch.", ""),
        num_prompts=len(prompts),
        new_tokens=total,
        steps=result.num_steps,
        tokens_per_second=result.tokens_per_second,
        token_agreement=agree / max(total, 1),
        max_logit_diff=worst,
        warmup_seconds=warmup_seconds,
    )
