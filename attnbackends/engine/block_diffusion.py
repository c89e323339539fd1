"""Block-diffusion decoding on the compact engine (SDAR / LLaDA-style semi-autoregressive generation).

The model's layers are ``block_causal`` (``AttentionMask(kind="block_causal", block_len=b)``): positions fall into
blocks of ``b``; a block sees the earlier blocks and itself in both directions. A request's new tokens are
decoded block by block: its active block holds the tokens decided so far and ``mask_token_id`` elsewhere, and each
step runs the active block (and everything before it not yet cached) and decides the undecided position the model
is most confident of (highest softmax probability) as its greedy token. Only whole blocks of final tokens stay in
the KV cache: a step writes the active block's keys and values, and the next step rewrites them (the request's
cached length goes back to the block's start); once a block is decided, the next step rewrites it with its final
tokens beside the next block. A prompt's last partial block is part of its first active block (its tokens see the
new tokens of their block). Prefills before the active block run in chunks of whole blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..metadata import decode_first_order
from ..spec import MaskKind
from .engine import GenerationResult, PagedEngine

__all__ = ["block_diffusion_generate"]


@dataclass
class _BlockRequest:
    index: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[Optional[int]]  # prompt + new positions, None where undecided
    num_computed: int = 0  # positions whose final keys and values are cached (a multiple of the block length)
    blocks: list[int] = field(default_factory=list)
    chosen_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def first_undecided(self) -> Optional[int]:
        return next((p for p in range(len(self.prompt), self.length) if self.tokens[p] is None), None)


def _check(engine: PagedEngine, prompts: list[list[int]], max_new_tokens: int, mask_token_id: int) -> int:
    """The block length, after checking the engine and the arguments (ValueError naming the wrong one)."""
    mask = engine.spec.mask
    if mask.kind is not MaskKind.BLOCK_CAUSAL:
        raise ValueError(f"block diffusion needs a block_causal model (AttentionMask(kind='block_causal', "
                         f"block_len=b)); the engine's layers have mask {mask.describe()!r}")
    if engine.speculative is not None:
        raise ValueError("block diffusion runs without speculative decoding (speculative must be None)")
    block = mask.block_len
    if engine.config.max_num_batched_tokens < 2 * block:
        raise ValueError(f"max_num_batched_tokens ({engine.config.max_num_batched_tokens}) must hold two blocks "
                         f"(2 x {block}): a step rewrites the decided block beside the active one")
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be a non-negative int, got {mask_token_id!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    return block


def block_diffusion_generate(engine: PagedEngine, prompts: list[list[int]], max_new_tokens: int, *,
                             mask_token_id: int) -> GenerationResult:
    """Decode ``max_new_tokens`` per prompt by block diffusion (module docstring) on ``engine``, whose model's
    layers are ``block_causal``; one token decided per request and step, requests batched as in
    :meth:`PagedEngine.generate`.

    Returns the new tokens per prompt (position order) and the logits row that decided each ([new, vocab]).

    Raises
    ------
    ValueError : the model is not block-causal, the step budget holds fewer than two blocks, a bad argument.
    """
    block = _check(engine, prompts, max_new_tokens, mask_token_id)
    requests = [_BlockRequest(i, list(p), max_new_tokens, list(p) + [None] * max_new_tokens)
                for i, p in enumerate(prompts)]
    waiting, running = list(requests), []
    steps = 0
    start = time.perf_counter()
    while waiting or running:
        _admit(engine, waiting, running)
        _step(engine, running, block, mask_token_id)
        steps += 1
        for req in [r for r in running if r.first_undecided() is None]:
            engine.batch.finish_request(req.index)
            engine.allocator.release(req.blocks)
            req.blocks = []
            running.remove(req)
    return GenerationResult(
        tokens=[[int(t) for t in r.tokens[len(r.prompt):]] for r in requests],
        logits=[torch.stack([r.chosen_logits[p] for p in range(len(r.prompt), r.length)]) for r in requests],
        num_steps=steps, seconds=time.perf_counter() - start, backend=engine.backend.name)


def _admit(engine: PagedEngine, waiting: list[_BlockRequest], running: list[_BlockRequest]) -> None:
    """Admit waiting requests while there is room; each reserves the pages of its whole sequence up front."""
    pages = engine._pages
    reserved = sum(pages(r.length) - len(r.blocks) for r in running)
    while waiting and len(running) < engine.config.max_num_reqs:
        need = pages(waiting[0].length)
        if need > engine.config.num_blocks:
            raise RuntimeError(f"request {waiting[0].index} needs {need} KV-cache pages; the engine has "
                               f"{engine.config.num_blocks}")
        if need > engine.allocator.num_free - reserved:
            break
        reserved += need
        req = waiting.pop(0)
        engine.batch.add_request(req.index, req.blocks, 0)
        running.append(req)


def _schedule(engine: PagedEngine, running: list[_BlockRequest], block: int) -> list[tuple[_BlockRequest, int, bool]]:
    """(request, tokens, whether the step runs its active block) per scheduled request: the active steps first
    (up to two blocks each), then prefill chunks of whole blocks in what budget is left."""
    budget = engine.config.max_num_batched_tokens
    batch, deferred = [], []
    for req in running:
        active_start = req.first_undecided() // block * block
        whole = min(active_start + block, req.length) - req.num_computed
        if whole <= budget:
            batch.append((req, whole, True))
            budget -= whole
        else:
            deferred.append((req, active_start))
    for req, active_start in deferred:
        n = min(budget, active_start - req.num_computed) // block * block
        if n > 0:
            batch.append((req, n, False))
            budget -= n
    order = decode_first_order([n for _, n, _ in batch], engine.builder.reorder_batch_threshold)
    return [batch[i] for i in order]


@torch.inference_mode()
def _step(engine: PagedEngine, running: list[_BlockRequest], block: int, mask_token_id: int) -> None:
    batch = _schedule(engine, running, block)
    for req, n, _ in batch:
        engine._reserve_pages(req, req.num_computed + n)
    by_index = {req.index: (req, n, active) for req, n, active in batch}
    common = engine.batch.prepare({req.index: n for req, n, _ in batch})
    batch = [by_index[i] for i in engine.batch.step_req_ids]
    tokens, positions, rows, row_positions = [], [], [], []
    for req, n, active in batch:
        span = range(req.num_computed, req.num_computed + n)
        for p in span:
            if active and req.tokens[p] is None:
                rows.append(len(tokens))
                row_positions.append((req, p))
            tokens.append(mask_token_id if req.tokens[p] is None else req.tokens[p])
            positions.append(p)
    device = engine.device
    attn = engine.step_attention_of(engine.builder.build(common))
    logits = engine.model.forward(torch.tensor(tokens, dtype=torch.long, device=device),
                                  torch.tensor(positions, device=device), attn,
                                  torch.tensor(rows, dtype=torch.long, device=device)).float().cpu()
    confidence, choice = torch.softmax(logits, dim=-1).max(dim=-1)
    best: dict[int, int] = {}  # request index -> the row of its most confident undecided position
    for r, (req, _) in enumerate(row_positions):
        if req.index not in best or confidence[r] > confidence[best[req.index]]:
            best[req.index] = r
    for req, n, active in batch:
        if active:
            r = best[req.index]
            position = row_positions[r][1]
            req.tokens[position] = int(choice[r])
            req.chosen_logits[position] = logits[r]
            req.num_computed = position // block * block  # the active block's keys stay provisional
        else:
            req.num_computed += n
        engine.batch.set_num_computed_tokens(req.index, req.num_computed)
    engine.num_steps += 1
    engine.scheduled_tokens.append(len(tokens))

