"""A compact paged engine: block allocator, continuous batching with chunked prefill, one metadata build per step
shared by every layer, and each layer's impl called through the selected backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..metadata import build_common_metadata
from ..platform import DeviceInfo
from ..registry import select
from ..spec import AttentionConfig, AttentionSpec
from .model import TinyLlama

__all__ = ["EngineConfig", "GenerationResult", "PagedEngine", "BlockAllocator"]


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 64  # token budget per step: prefills are chunked to fit
    max_num_reqs: int = 64


class BlockAllocator:
    """Hands out KV-cache pages from a free list."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV-cache pages: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass
class GenerationResult:
    """Generated tokens per prompt, the logits that chose each of them ([new_tokens, vocab] float32), and timing."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    num_steps: int
    seconds: float
    backend: str

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


class PagedEngine:
    """Serves a :class:`TinyLlama` through the attention backend the registry selects for it."""

    def __init__(
        self,
        model: TinyLlama,
        config: EngineConfig = EngineConfig(),
        *,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_config: Optional[AttentionConfig] = None,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = config
        cfg = model.cfg
        self.spec = AttentionSpec(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_size=cfg.head_size,
            dtype=dtype,
            block_size=config.block_size,
        )
        self.backend = select(self.spec, DeviceInfo.current(self.device), attention_config)
        self.builder = self.backend.get_builder_cls()(
            self.spec, self.device, max_num_reqs=config.max_num_reqs, max_num_tokens=config.max_num_batched_tokens
        )
        self.impls = [self.backend.get_impl_cls()(self.spec) for _ in range(cfg.num_layers)]
        self.kv_caches = [
            self.backend.allocate_kv_cache(config.num_blocks, self.spec, self.device).zero_()
            for _ in range(cfg.num_layers)
        ]
        self.allocator = BlockAllocator(config.num_blocks)

    def _schedule(self, running: list[_Request]) -> list[tuple[_Request, int]]:
        """Decodes first (one token each), then prefill chunks within the step's token budget."""
        budget = self.config.max_num_batched_tokens
        batch = []
        for req in sorted(running, key=lambda r: not r.is_decode):
            if budget == 0 or len(batch) == self.config.max_num_reqs:
                break
            n = min(len(req.tokens) - req.num_computed, budget)
            batch.append((req, n))
            budget -= n
        return batch

    @torch.inference_mode()
    def step(self, running: list[_Request]) -> None:
        batch = self._schedule(running)
        block_size = self.config.block_size
        tokens, positions, block_tables = [], [], []
        for req, n in batch:
            need = -(-(req.num_computed + n) // block_size) - len(req.blocks)
            if need > 0:
                req.blocks += self.allocator.allocate(need)
            tokens += req.tokens[req.num_computed : req.num_computed + n]
            positions += range(req.num_computed, req.num_computed + n)
            block_tables.append(req.blocks)
        common = build_common_metadata(
            [n for _, n in batch],
            [req.num_computed for req, _ in batch],
            block_tables,
            block_size,
            self.device,
        )
        metadata = self.builder.build(common)
        num_heads, head_size = self.spec.num_heads, self.spec.head_size

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = torch.empty((q.shape[0], num_heads, head_size), dtype=q.dtype, device=q.device)
            return self.impls[layer].forward(q, k, v, self.kv_caches[layer], metadata, out)

        token_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        logits = self.model(token_ids, torch.tensor(positions, device=self.device), attend)
        last = (common.query_start_loc_cpu[1:] - 1).tolist()
        for (req, n), row in zip(batch, last):
            req.num_computed += n
            if req.num_computed == len(req.tokens):  # the whole known sequence is cached: sample the next token
                req.step_logits.append(logits[row].cpu())
                req.output.append(int(logits[row].argmax()))

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> GenerationResult:
        """Greedy generation of ``max_new_tokens`` per prompt with continuous batching."""
        requests = [_Request(list(p), max_new_tokens) for p in prompts]
        running = list(requests)
        steps = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        while running:
            self.step(running)
            steps += 1
            for req in [r for r in running if r.finished]:
                self.allocator.release(req.blocks)
                req.blocks = []
                running.remove(req)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return GenerationResult(
            tokens=[r.output for r in requests],
            logits=[torch.stack(r.step_logits) for r in requests],
            num_steps=steps,
            seconds=time.perf_counter() - start,
            backend=self.backend.name,
        )
