"""The demo's setup: its model's layer, its engine and its prompts (`attnbackends demo` runs them; `attnbackends
warmup` without layer options runs their first steps so the demo's kernels are compiled ahead)."""

from __future__ import annotations

import random
import time
from typing import Optional

import torch

from ..platform import check_device_available
from ..spec import AttentionConfig, AttentionSpec, torch_dtype_of
from .engine import EngineConfig, PagedEngine
from .kv_cache import KVScales
from .model import TinyLlama, TinyLlamaConfig

__all__ = ["BLOCK_SIZE", "default_device", "default_dtype", "demo_engine", "demo_prompts", "demo_spec",
           "warm_demo_engine"]

BLOCK_SIZE = 16


def default_device() -> str:
    """cuda when available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """The demo's model dtype on ``device``: bfloat16 on cuda, float32 on the cpu."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def demo_spec(device: Optional[str] = None, dtype: "str | torch.dtype | None" = None) -> AttentionSpec:
    """The attention spec of the demo's model on ``device`` (default: cuda when available) in ``dtype`` (default:
    the demo's for that device): what ``attnbackends warmup`` without spec options prepares."""
    device = device or default_device()
    dtype = default_dtype(device) if dtype is None else torch_dtype_of(dtype)
    return TinyLlama(TinyLlamaConfig(), seed=0).attention_spec(dtype, BLOCK_SIZE)


def demo_engine(device: str, dtype: torch.dtype, attention_config: Optional[AttentionConfig], seed: int,
                kv_cache_dtype: str = "auto", kv_scales: Optional[KVScales] = None,
                cuda_graphs: Optional[bool] = None) -> PagedEngine:
    """The demo's engine: its model (seeded random weights) on ``device`` in ``dtype``, its KV cache stored as
    ``kv_cache_dtype`` (with ``kv_scales`` where the format takes per-tensor scales; see ``EngineConfig``)."""
    model = TinyLlama(TinyLlamaConfig(), seed=seed)
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype,
                          kv_scales=kv_scales)
    return PagedEngine(model, config, device=device, dtype=dtype, attention_config=attention_config,
                       cuda_graphs=cuda_graphs)


def demo_prompts(vocab_size: int, num_prompts: int, seed: int) -> list[list[int]]:
    """``num_prompts`` seeded random prompts: lengths 1, 15, 16, 17, 40, 90 (pages partly filled, exactly filled,
    spilling over), then random ones."""
    rng = random.Random(seed)
    lengths = [1, 15, 16, 17, 40, 90][:num_prompts] + [rng.randint(2, 70) for _ in range(max(0, num_prompts - 6))]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def warm_demo_engine(device: Optional[str] = None, attention_config: Optional[AttentionConfig] = None,
                     dtype: "str | torch.dtype | None" = None) -> tuple[str, float]:
    """Run the demo engine's first steps (a prefill, a mixed and decode steps, the CUDA-graph captures of its
    batch sizes) so the kernels ``attnbackends demo`` compiles are in the compilers' caches; returns (the backend
    chosen, seconds)."""
    device = str(check_device_available(device or default_device()))
    dtype = default_dtype(device) if dtype is None else torch_dtype_of(dtype)
    engine = demo_engine(device, dtype, attention_config, seed=0)
    start = time.perf_counter()
    engine.generate(demo_prompts(engine.model.cfg.vocab_size, 6, 0), 3)
    return engine.backend.name, time.perf_counter() - start
