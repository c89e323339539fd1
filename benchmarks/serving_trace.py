"""Serving traces: engine step sequences from a seeded request model, replayed through the attention layers of five
open models for each backend, total attention time per trace side by side (PERF.md row ``serving_trace``).

    python -m benchmarks.serving_trace --out st.json                     # GPU: triton, flashinfer, auto
    python -m benchmarks.serving_trace --device cpu --backends reference --tiny --out st.json    # CPU check

The request model (pure Python, seeded) simulates a continuous-batching scheduler over one shared page pool: every
step it schedules the running decodes first (one token each), then continues chunked prefills, then admits waiting
requests, within ``max_num_tokens`` new tokens per step (8192) and at most ``max_chunk`` (2048) new tokens per request
per step; a batch is put in :func:`attnbackends.decode_first_order`. A request's pages are allocated as its tokens
need them, from a free list in random order; prefix caching shares whole pages: a request whose prompt starts with
cached pages reuses them (context) and computes only the rest (a partial last page is recomputed into a page of its
own, as engines do). Each trace is a window of a server in steady state: some requests are already running when it
opens, others arrive during it.

- ``chat``: a 1000-token system prompt cached once and shared by every conversation; returning conversations bring
  their earlier turns as cached pages, and a turn that finishes inside the window comes back a few steps later as
  the next turn on all of its pages: most prefills are short chunks on long cached context, beside many decodes.
- ``docs``: documents of 12k-32k tokens prefilled in chunks of 2048 on up to 32k of context, interleaved with
  the decodes of other requests.
- ``short``: many short fresh prompts (16-512 tokens, nothing cached) and their short answers.
- ``decode``: a large stream of decodes (224 running, 256-4096 context) with an occasional prompt.

The replay runs each model's attention layer shapes (bf16, page 16): Llama-3-8B (32 q / 8 kv heads, head 128),
Qwen2.5-7B (28/4/128), gpt-oss-20b (64/8/64, sinks, a 128-token window on alternate layers), Gemma-3-12B (16/8/256,
a 1024-token window on 5 of 6 layers), Mistral-7B (32/8/128, window 4096). ``--layers-per-group`` layers (2) of each
distinct layer spec are replayed, each with its own cache of random values (never zeros) over the trace's page pool,
grouped by :func:`attnbackends.group_layers`; every step is what an engine runs: one
:class:`attnbackends.GroupedMetadataBuilder` ``build()`` (one backend metadata per group, sliding groups trimmed to
their window) and one ``impl.forward`` per layer with the step's new K/V (written into the cache).

Backends: any registered name, and ``auto``: the measured per-group selection (``AttentionConfig(selection=
"measured")``, from the stored ``attnbackends tune`` profile of each layer spec). A spec without a stored profile in
``--profile-dir`` (default: the user cache, where ``attnbackends tune`` stores them) is tuned in-process first, as
``attnbackends tune`` does (``run_tune`` on the ``small`` grid, over the single backends compared here and their
per-phase compositions; a spec that only one of them fits is not tuned: the static list picks that one), and the
profile is stored for later runs; ``--tune never`` uses only stored profiles (where there is none, each group's
explanation says the static list chose). A backend that cannot serve a model is reported with the reasons
:func:`attnbackends.explain` gives, never dropped.

Timing: for each (trace, model, backend) one warm-up pass over the trace, then ``--repeats`` timed passes; in a pass
each step is bracketed by CUDA events (before the builds, after them, after each layer's forward) and followed by a
synchronize, as an engine waits for the step's sampled tokens. The span between a step's first and last event is
its attention time as the engine sees it: the GPU's work, or the host's launch time where the step is host-bound
(the GPU then waits between kernels). The host wall time from the step's first call to its last launch is kept
beside it. ``us`` is the sum over the trace's steps in the median pass. Kernels compile before any timed pass:
FlashInfer's modules build in the background (all at once) while the Triton kernels compile on warm-up passes;
then the tune runs (for ``auto``), and every backend, ``auto`` included, is timed model by model in one stretch.
The JSON is rewritten after each model, so a run cut short keeps what it measured (``"complete": false``).

Rows: ``{"case": "serving_trace", "backend", "peer", "trace", "model", "us", "peer_us", "ratio", "steps", "tokens",
...}`` with the build time, the host time, per-layer averages and ``model_us``: the builds plus each group's forward
time scaled to the model's real layer count of that group (the whole model's attention over the trace, estimated).
``auto`` rows name each group's choice and the best single backend. A plot of the ratio per trace and model goes
next to ``--out`` (or to ``--plot``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import random
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from attnbackends import (
    AttentionConfig,
    AttentionSpec,
    CommonAttentionMetadata,
    DeviceInfo,
    GroupedMetadataBuilder,
    LayerGroups,
    backend_names,
    build_common_metadata,
    decode_first_order,
    explain_layers,
    group_layers,
)
from attnbackends.flashinfer.cascade import CascadePolicy
from benchmarks.report import library_versions

__all__ = [
    "FULL_LIMITS",
    "MODELS",
    "TINY_LIMITS",
    "TINY_MODELS",
    "TRACE_KINDS",
    "BackendReplay",
    "ModelShape",
    "SchedulerLimits",
    "StepRequest",
    "Trace",
    "TraceStep",
    "check_step_against_oracle",
    "generate_trace",
    "main",
    "replay_layer_specs",
]

logger = logging.getLogger("benchmarks.serving_trace")

TRACE_KINDS = ("chat", "docs", "short", "decode")


# ------------------------------------------------------------------------------------------------- request model
@dataclass(frozen=True)
class SchedulerLimits:
    """What the simulated scheduler may put in one step."""

    block_size: int = 16
    max_num_tokens: int = 8192  # new tokens per step (decodes count one each)
    max_chunk: int = 2048  # new tokens per request per step (chunked prefill)
    max_num_reqs: int = 256  # requests running at once
    pool_growth: int = 2048  # pages added to the pool (in random order) whenever it runs dry


FULL_LIMITS = SchedulerLimits()
TINY_LIMITS = SchedulerLimits(max_num_tokens=160, max_chunk=48, max_num_reqs=24, pool_growth=32)

# Per trace kind: the window length in steps and the distributions (inclusive ranges of tokens) of the requests.
_FULL_PARAMS: dict[str, dict[str, Any]] = {
    "chat": dict(steps=32, system_prompt=1000, running=64, running_history=(200, 6000), running_output=(1, 60),
                 arrivals=4.0, new_conversation=0.3, history=(200, 6000), user=(30, 400), output=(40, 300),
                 follow_up=0.7, think_steps=(1, 4)),
    "docs": dict(steps=24, background=32, background_context=(256, 4096), background_output=(100, 400),
                 first_doc=(30000, 18432), doc_every=4, doc_prompt=(12288, 32512), doc_output=(32, 256)),
    "short": dict(steps=24, running=64, running_context=(64, 1024), running_output=(2, 24), arrivals=12.0,
                  prompt=(16, 512), output=(2, 24)),
    "decode": dict(steps=32, running=224, running_context=(256, 4096), running_output=(64, 1024),
                   arrival_prob=0.25, prompt=(512, 2048), output=(128, 512)),
}
_TINY_PARAMS: dict[str, dict[str, Any]] = {
    "chat": dict(steps=4, system_prompt=40, running=3, running_history=(0, 100), running_output=(1, 3),
                 arrivals=1.5, new_conversation=0.3, history=(10, 100), user=(4, 30), output=(2, 4),
                 follow_up=1.0, think_steps=(1, 1)),
    "docs": dict(steps=4, background=2, background_context=(16, 80), background_output=(8, 8),
                 first_doc=(180, 96), doc_every=2, doc_prompt=(100, 200), doc_output=(2, 3)),
    "short": dict(steps=3, running=2, running_context=(8, 40), running_output=(2, 3), arrivals=2.0,
                  prompt=(4, 40), output=(2, 3)),
    "decode": dict(steps=3, running=6, running_context=(16, 120), running_output=(4, 8), arrival_prob=0.5,
                   prompt=(20, 60), output=(4, 8)),
}


@dataclass(frozen=True)
class StepRequest:
    """One request of one step: ``query_len`` new tokens after ``context_len`` cached ones, in the pages
    ``block_table`` (exactly ``ceil((context_len + query_len) / block_size)`` of them)."""

    rid: int
    query_len: int
    context_len: int
    block_table: tuple[int, ...]


@dataclass(frozen=True)
class TraceStep:
    """One engine step: its requests, decodes first (:func:`attnbackends.decode_first_order`)."""

    requests: tuple[StepRequest, ...]
    block_size: int

    @property
    def query_lens(self) -> list[int]:
        return [r.query_len for r in self.requests]

    @property
    def context_lens(self) -> list[int]:
        return [r.context_len for r in self.requests]

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.requests)

    @property
    def num_decodes(self) -> int:
        return sum(1 for r in self.requests if r.query_len == 1)

    @property
    def common_prefix_len(self) -> int:
        """Tokens at the start of every request that lie in the same pages and are context for all of them (whole
        pages; 0 for a single request): what an engine's prefix cache tells the backends (cascade attention)."""
        if len(self.requests) < 2:
            return 0
        limit = min(r.context_len // self.block_size for r in self.requests)
        first = self.requests[0].block_table
        pages = 0
        while pages < limit and all(r.block_table[pages] == first[pages] for r in self.requests):
            pages += 1
        return pages * self.block_size

    def common(self, device: "torch.device | str") -> CommonAttentionMetadata:
        """The step's :class:`attnbackends.CommonAttentionMetadata` on ``device`` (with its host copies)."""
        common = build_common_metadata(self.query_lens, self.context_lens, [r.block_table for r in self.requests],
                                       self.block_size, device)
        return dataclasses.replace(common, common_prefix_len=self.common_prefix_len)


@dataclass(frozen=True)
class Trace:
    """A window of engine steps over one page pool of ``num_blocks`` pages.

    Attributes
    ----------
    cached_prompt_tokens : prompt tokens served from cached pages (prefix hits) by the requests that arrived in the
        window.
    """

    kind: str
    steps: tuple[TraceStep, ...]
    limits: SchedulerLimits
    num_blocks: int
    cached_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.steps)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_decodes for s in self.steps)

    @property
    def max_num_reqs(self) -> int:
        return max((len(s.requests) for s in self.steps), default=1)

    def stats(self) -> dict[str, int]:
        """Totals for the results rows: steps, new tokens (decode and prefill), the keys read (sum of sequence
        lengths over steps) and the prompt tokens that came from cached pages."""
        return {
            "steps": len(self.steps),
            "tokens": self.num_tokens,
            "decode_tokens": self.num_decode_tokens,
            "prefill_tokens": self.num_tokens - self.num_decode_tokens,
            "kv_tokens": sum(r.context_len + r.query_len for s in self.steps for r in s.requests),
            "max_seq_len": max((r.context_len + r.query_len for s in self.steps for r in s.requests), default=0),
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


class _PagePool:
    """Reference-counted pages handed out in random order; the pool grows (by ``growth`` pages, shuffled) when its
    free list runs dry, so the trace decides how many pages the caches need."""

    def __init__(self, rng: random.Random, growth: int) -> None:
        self.rng, self.growth = rng, growth
        self.capacity = 0
        self.free: deque[int] = deque()
        self.refs: dict[int, int] = {}

    def alloc(self, n: int) -> list[int]:
        while len(self.free) < n:
            fresh = list(range(self.capacity, self.capacity + self.growth))
            self.rng.shuffle(fresh)
            self.free.extend(fresh)
            self.capacity += self.growth
        pages = [self.free.popleft() for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def ref(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] += 1

    def unref(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                self.free.append(page)


@dataclass
class _Request:
    """A request as the scheduler tracks it: tokens whose K/V is cached (``computed``), its prompt (of which the
    first ``computed`` tokens may come from cached pages) and how many tokens it generates."""

    rid: int
    table: list[int]
    computed: int
    prompt_len: int
    output_len: int
    generated: int = 0
    arrival: int = 0
    conversation: Optional[int] = None

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


class _Scheduler:
    """Continuous batching: decodes first, then chunked prefills in admission order, then new requests (FIFO)."""

    def __init__(self, rng: random.Random, limits: SchedulerLimits,
                 on_finish: Optional[Callable[[_Request, int], None]] = None) -> None:
        self.limits = limits
        self.pool = _PagePool(rng, limits.pool_growth)
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.on_finish = on_finish
        self.next_rid = 0
        self.cached_prompt_tokens = 0

    def new_request(self, *, computed: int, prompt_len: int, output_len: int, prefix: Sequence[int] = (),
                    generated: int = 0, arrival: int = 0, conversation: Optional[int] = None) -> _Request:
        """A request whose first ``len(prefix)`` pages are cached pages it shares (referenced here) and whose
        remaining ``computed`` tokens (if any) sit in pages of its own (allocated here: context from before the
        window)."""
        bs = self.limits.block_size
        if len(prefix) * bs > computed:
            raise ValueError(f"{len(prefix)} cached pages hold more than the request's {computed} computed tokens")
        self.pool.ref(prefix)
        table = list(prefix) + self.pool.alloc(-(-computed // bs) - len(prefix))
        req = _Request(self.next_rid, table, computed, prompt_len, output_len, generated, arrival, conversation)
        self.next_rid += 1
        return req

    def start_running(self, req: _Request) -> None:
        self.running.append(req)

    def arrive(self, req: _Request) -> None:
        self.cached_prompt_tokens += req.computed
        self.waiting.append(req)

    def step(self, now: int) -> Optional[TraceStep]:
        lim = self.limits
        budget = lim.max_num_tokens
        scheduled: list[tuple[_Request, int]] = []
        for req in self.running:
            if not req.prefilling and budget > 0:
                scheduled.append((req, 1))
                budget -= 1
        for req in self.running:
            if req.prefilling and budget > 0:
                chunk = min(req.prompt_len - req.computed, lim.max_chunk, budget)
                scheduled.append((req, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < lim.max_num_reqs:
            req = self.waiting.popleft()
            self.running.append(req)
            chunk = min(req.prompt_len - req.computed, lim.max_chunk, budget)
            scheduled.append((req, chunk))
            budget -= chunk
        if not scheduled:
            return None
        order = decode_first_order([q for _, q in scheduled])
        scheduled = [scheduled[i] for i in order]
        step_requests = []
        for req, q in scheduled:
            need = -(-(req.computed + q) // lim.block_size)
            if need > len(req.table):
                req.table += self.pool.alloc(need - len(req.table))
            step_requests.append(StepRequest(req.rid, q, req.computed, tuple(req.table[:need])))
        for req, q in scheduled:
            was_prefilling = req.prefilling
            req.computed += q
            if not was_prefilling or not req.prefilling:  # a decode, or the prompt's last chunk: one token sampled
                req.generated += 1
            if req.generated >= req.output_len:
                self.running.remove(req)
                if self.on_finish is not None:
                    self.on_finish(req, now)
                self.pool.unref(req.table)
        return TraceStep(tuple(step_requests), lim.block_size)


def _uniform(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: fine for the small means used here.
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _run(sched: _Scheduler, kind: str, steps: int, arrivals: Callable[[int], None]) -> Trace:
    out = []
    for now in range(steps):
        arrivals(now)
        step = sched.step(now)
        if step is not None:
            out.append(step)
    return Trace(kind, tuple(out), sched.limits, sched.pool.capacity, sched.cached_prompt_tokens)


def _chat(rng: random.Random, p: dict[str, Any], limits: SchedulerLimits, steps: int) -> Trace:
    bs = limits.block_size
    pending: dict[int, list[tuple[list[int], int, int]]] = {}  # step -> (cached pages, tokens so far, conversation)

    def finished(req: _Request, now: int) -> None:
        if rng.random() < p["follow_up"]:
            # The turn's whole pages stay cached for the conversation's next turn (a reference held until then);
            # its last sampled token and the partial last page are recomputed by that turn.
            full = req.table[: req.computed // bs]
            sched.pool.ref(full)
            pending.setdefault(now + 1 + _uniform(rng, p["think_steps"]), []).append(
                (full, req.computed + 1, req.conversation))

    sched = _Scheduler(rng, limits, finished)
    system_pages = sched.pool.alloc(p["system_prompt"] // bs)  # the prefix cache's own reference: never freed
    conversations = iter(range(10**9))
    for _ in range(p["running"]):
        computed = p["system_prompt"] + _uniform(rng, p["running_history"])
        req = sched.new_request(computed=computed, prompt_len=computed, prefix=system_pages, generated=1,
                                output_len=1 + _uniform(rng, p["running_output"]), conversation=next(conversations))
        sched.start_running(req)

    def turn(prefix: list[int], tokens: int, conversation: int, now: int, cached: Optional[int] = None) -> None:
        """A turn of a conversation that holds ``tokens`` so far: it shares the cached pages ``prefix``; ``cached``
        tokens (default: every whole page of ``tokens``) are in the cache, the pages past ``prefix`` its own from
        before the window; the rest (the partial last page, the last sampled token) is recomputed."""
        cached = tokens // bs * bs if cached is None else cached
        sched.arrive(sched.new_request(computed=cached, prompt_len=tokens + _uniform(rng, p["user"]), prefix=prefix,
                                       output_len=_uniform(rng, p["output"]), arrival=now, conversation=conversation))

    def arrivals(now: int) -> None:
        for prefix, tokens, conversation in pending.pop(now, []):
            turn(prefix, tokens, conversation, now, cached=len(prefix) * bs)
            sched.pool.unref(prefix)  # the new turn holds its own reference now
        for _ in range(_poisson(rng, p["arrivals"])):
            history = 0 if rng.random() < p["new_conversation"] else _uniform(rng, p["history"])
            turn(system_pages, p["system_prompt"] + history, next(conversations), now)

    return _run(sched, "chat", steps, arrivals)


def _docs(rng: random.Random, p: dict[str, Any], limits: SchedulerLimits, steps: int) -> Trace:
    sched = _Scheduler(rng, limits)
    for _ in range(p["background"]):
        context = _uniform(rng, p["background_context"])
        sched.start_running(sched.new_request(computed=context, prompt_len=context, generated=1,
                                              output_len=1 + _uniform(rng, p["background_output"])))
    prompt, computed = p["first_doc"]
    sched.start_running(sched.new_request(computed=computed, prompt_len=prompt,
                                          output_len=_uniform(rng, p["doc_output"])))

    def arrivals(now: int) -> None:
        if now % p["doc_every"] == 0:
            sched.arrive(sched.new_request(computed=0, prompt_len=_uniform(rng, p["doc_prompt"]), arrival=now,
                                           output_len=_uniform(rng, p["doc_output"])))

    return _run(sched, "docs", steps, arrivals)


def _start_running_decodes(sched: "_Scheduler", rng: random.Random, p: dict[str, Any]) -> None:
    """``p["running"]`` requests already decoding when the window opens (context ``p["running_context"]``)."""
    for _ in range(p["running"]):
        context = _uniform(rng, p["running_context"])
        sched.start_running(sched.new_request(computed=context, prompt_len=context, generated=1,
                                              output_len=1 + _uniform(rng, p["running_output"])))


def _short(rng: random.Random, p: dict[str, Any], limits: SchedulerLimits, steps: int) -> Trace:
    sched = _Scheduler(rng, limits)
    _start_running_decodes(sched, rng, p)

    def arrivals(now: int) -> None:
        for _ in range(_poisson(rng, p["arrivals"])):
            sched.arrive(sched.new_request(computed=0, prompt_len=_uniform(rng, p["prompt"]), arrival=now,
                                           output_len=_uniform(rng, p["output"])))

    return _run(sched, "short", steps, arrivals)


def _decode(rng: random.Random, p: dict[str, Any], limits: SchedulerLimits, steps: int) -> Trace:
    sched = _Scheduler(rng, limits)
    _start_running_decodes(sched, rng, p)

    def arrivals(now: int) -> None:
        if rng.random() < p["arrival_prob"]:
            sched.arrive(sched.new_request(computed=0, prompt_len=_uniform(rng, p["prompt"]), arrival=now,
                                           output_len=_uniform(rng, p["output"])))

    return _run(sched, "decode", steps, arrivals)


_GENERATORS = {"chat": _chat, "docs": _docs, "short": _short, "decode": _decode}


def generate_trace(kind: str, *, seed: int = 0, scale: float = 1.0, tiny: bool = False) -> Trace:
    """The step sequence of trace ``kind`` (one of :data:`TRACE_KINDS`), the same for the same arguments.

    scale : multiplies the window's length in steps (the request mix stays the same).
    tiny : a few small steps (CPU checks), with :data:`TINY_LIMITS`.
    """
    if kind not in _GENERATORS:
        raise ValueError(f"trace {kind!r} is unknown; allowed: {', '.join(TRACE_KINDS)}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    params = (_TINY_PARAMS if tiny else _FULL_PARAMS)[kind]
    limits = TINY_LIMITS if tiny else FULL_LIMITS
    rng = random.Random(f"serving_trace:{kind}:{seed}")
    return _GENERATORS[kind](rng, params, limits, max(1, round(params["steps"] * scale)))


# ------------------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    """A model's attention layers: ``num_layers`` layers of one head layout; ``window`` on every layer, or (with
    ``global_every``) on every layer but each ``global_every``-th; sinks on every layer when ``has_sinks``."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    window: Optional[int] = None
    global_every: Optional[int] = None
    has_sinks: bool = False

    def layer_spec(self, layer: int, dtype: str, block_size: int) -> AttentionSpec:
        sliding = self.window is not None and (self.global_every is None or (layer + 1) % self.global_every != 0)
        return AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                             dtype=dtype, block_size=block_size, sliding_window=self.window if sliding else None,
                             has_sinks=self.has_sinks)


MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3-8b", 32, 8, 128, 32),
    ModelShape("qwen2.5-7b", 28, 4, 128, 28),
    ModelShape("gpt-oss-20b", 64, 8, 64, 24, window=128, global_every=2, has_sinks=True),
    ModelShape("gemma-3-12b", 16, 8, 256, 48, window=1024, global_every=6),
    ModelShape("mistral-7b", 32, 8, 128, 32, window=4096),
)}

# The same layer layouts (GQA ratio, windows relative to the tiny traces' contexts, sinks) at CPU-check sizes.
TINY_MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3-8b", 4, 1, 32, 32),
    ModelShape("qwen2.5-7b", 7, 1, 32, 28),
    ModelShape("gpt-oss-20b", 8, 1, 32, 24, window=16, global_every=2, has_sinks=True),
    ModelShape("gemma-3-12b", 2, 1, 64, 48, window=32, global_every=6),
    ModelShape("mistral-7b", 4, 1, 32, 32, window=64),
)}


def replay_layer_specs(model: ModelShape, layers_per_group: int, dtype: str = "bfloat16",
                       block_size: int = 16) -> tuple[list[AttentionSpec], dict[AttentionSpec, int]]:
    """The layers to replay: the model's first layers, in model order, until every distinct layer spec has
    ``layers_per_group`` of them; and the model's layer count per spec (to scale a group's time to the model)."""
    if layers_per_group < 1:
        raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
    every = [model.layer_spec(i, dtype, block_size) for i in range(model.num_layers)]
    counts: dict[AttentionSpec, int] = {}
    for spec in every:
        counts[spec] = counts.get(spec, 0) + 1
    picked, taken = [], dict.fromkeys(counts, 0)
    for spec in every:
        if taken[spec] < layers_per_group:
            picked.append(spec)
            taken[spec] += 1
    return picked, counts


# ------------------------------------------------------------------------------------------------- replay
class BackendReplay:
    """One backend configuration serving a model's replayed layers, as an engine holds them: the layer groups, one
    :class:`attnbackends.GroupedMetadataBuilder`, one impl per layer, one KV cache per layer (random values over the
    whole page pool) and per-layer query/key/value/output buffers of ``max_num_tokens`` rows (random; a step uses
    the leading rows).

    Attributes
    ----------
    caches : per layer [num_blocks, 2, block_size, num_kv_heads, head_size] (the backend's layout) in the cache dtype.
    query, key, value, output : per layer [max_num_tokens, heads, head_size] in the model dtype.
    sinks : per layer [num_heads] float32, or None for layers without sinks.
    """

    def __init__(self, specs: Sequence[AttentionSpec], config: AttentionConfig, device: torch.device, *,
                 num_blocks: int, max_num_tokens: int, max_num_reqs: int, seed: int = 0) -> None:
        self.specs = list(specs)
        self.device = device
        self.groups: LayerGroups = group_layers(self.specs, DeviceInfo.current(device), config)
        self.builder = GroupedMetadataBuilder(self.groups, device, max_num_reqs=max_num_reqs,
                                              max_num_tokens=max_num_tokens, num_blocks=num_blocks)
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

        self.sinks = [randn(s.num_heads, dtype=torch.float32) * 2.0 if s.has_sinks else None for s in self.specs]
        self.impls = self.groups.make_impls(lambda layer: {"sinks": self.sinks[layer]} if self.sinks[layer] is not None
                                            else {})
        self.caches = self.groups.allocate_kv_caches(num_blocks, device)
        for cache in self.caches:
            for part in cache.view(cache.shape[0], -1).split(4096):  # bounded float32 temporaries
                part.copy_(torch.randn(part.shape, generator=gen, device=device, dtype=torch.float32))
        self.query, self.key, self.value, self.output = [], [], [], []
        for s in self.specs:
            self.query.append(randn(max_num_tokens, s.num_heads, s.head_size, dtype=s.torch_dtype))
            self.key.append(randn(max_num_tokens, s.num_kv_heads, s.head_size, dtype=s.torch_dtype))
            self.value.append(randn(max_num_tokens, s.num_kv_heads, s.value_head_size, dtype=s.torch_dtype))
            self.output.append(torch.empty(max_num_tokens, s.num_heads, s.value_head_size, device=device,
                                           dtype=s.torch_dtype))

    @property
    def choice(self) -> dict[str, str]:
        """The backend serving each group, by group name."""
        return {g.name: g.backend.name for g in self.groups.groups}

    def step(self, common: CommonAttentionMetadata, marks: Optional[Callable[[int], None]] = None) -> None:
        """One engine step: the builds, then every layer's forward; ``marks(i)`` after the builds (i = 0) and
        after layer i - 1's forward."""
        n = common.num_actual_tokens
        metadata = self.builder.build(common)
        if marks is not None:
            marks(0)
        for layer, impl in enumerate(self.impls):
            impl.forward(self.query[layer][:n], self.key[layer][:n], self.value[layer][:n], self.caches[layer],
                         metadata.per_layer[layer], self.output[layer][:n])
            if marks is not None:
                marks(layer + 1)


@dataclass
class PassTimes:
    """One pass over a trace: per step the GPU time (µs) of the builds and of each layer's forward, and the host
    wall time (µs) from the step's first call to its last launch."""

    build_us: list[float] = field(default_factory=list)
    layer_us: list[list[float]] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)

    @property
    def total_us(self) -> float:
        return sum(self.build_us) + sum(map(sum, self.layer_us))


def time_pass(replay: BackendReplay, commons: Sequence[CommonAttentionMetadata]) -> PassTimes:
    """Run every step of a trace once, timing each (CUDA events on a GPU, the wall clock on the CPU)."""
    cuda = replay.device.type == "cuda"
    marks_count = len(replay.impls) + 2
    times = PassTimes()
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(marks_count)]
    stamps = [0.0] * marks_count

    def mark(i: int) -> None:
        if cuda:
            events[i + 1].record()
        else:
            stamps[i + 1] = time.perf_counter()

    for shared in commons:
        # A fresh object per step, as an engine builds each step's metadata: nothing a backend caches on it (the
        # page-id range check) carries over from another pass or backend.
        common = dataclasses.replace(shared)
        host_start = time.perf_counter()
        if cuda:
            events[0].record()
        else:
            stamps[0] = host_start
        replay.step(common, mark)
        host = time.perf_counter() - host_start
        if cuda:
            torch.cuda.synchronize(replay.device)
            spans = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(marks_count - 1)]
        else:
            spans = [(stamps[i + 1] - stamps[i]) * 1e6 for i in range(marks_count - 1)]
        times.build_us.append(spans[0])
        times.layer_us.append(spans[1:])
        times.host_us.append(host * 1e6)
    return times


def _requests_to_check(step: TraceStep, max_requests: int, max_cost: int) -> list[int]:
    """Up to ``max_requests`` of the step's requests, half decodes and half prefills where it has both, cheapest
    first, each with ``query_len * seq_len <= max_cost`` (the float64 oracle runs on the host)."""
    def cost(i: int) -> int:
        r = step.requests[i]
        return r.query_len * (r.query_len + r.context_len)

    fits = sorted((i for i in range(len(step.requests)) if cost(i) <= max_cost), key=cost)
    decodes = [i for i in fits if step.requests[i].query_len == 1]
    prefills = [i for i in fits if step.requests[i].query_len > 1]
    half = max_requests // 2
    picked = decodes[: max(half, max_requests - len(prefills))] + prefills[: max(half, max_requests - len(decodes))]
    return sorted(picked[:max_requests])


def check_step_against_oracle(replay: BackendReplay, step: TraceStep, common: CommonAttentionMetadata, *,
                              layers: Optional[Sequence[int]] = None, max_requests: int = 8,
                              max_cost: int = 1 << 21) -> list[int]:
    """Run one step through ``replay`` (builds and every layer's forward, into poisoned outputs) and compare the
    outputs of ``layers`` (default: the first layer of each group) with the float64 oracle, for the requests
    :func:`_requests_to_check` picks; their keys and values are read from their pages before the step (the
    context) and from the step's new tokens. Also checks, bitwise, that every new key and value of the step sits in
    its slot afterwards. Returns the request indices compared; raises AssertionError naming the layer and group."""
    from attnbackends.testing import RandomBatch, SequenceShape, assert_close_to_oracle, oracle_attention
    from attnbackends.testing import tolerance_for

    groups = replay.groups
    if layers is None:
        layers = [g.layers[0] for g in groups.groups]
    picked = _requests_to_check(step, max_requests, max_cost)
    if not picked:
        raise ValueError(f"no request of the step is cheap enough for the oracle (max_cost {max_cost})")
    n = step.num_tokens
    starts = [0]
    for r in step.requests:
        starts.append(starts[-1] + r.query_len)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in picked]).to(common.slot_mapping.device)
    expected = {}
    for layer in layers:
        spec, cache = replay.specs[layer], replay.caches[layer]
        if tuple(cache.shape[1:]) != (2, spec.block_size, spec.num_kv_heads, spec.head_size):
            raise NotImplementedError(f"the oracle check reads the standard cache layout; layer {layer} has "
                                      f"{tuple(cache.shape)}")
        dense_k, dense_v = [], []
        for i in picked:
            r, start, stop = step.requests[i], starts[i], starts[i + 1]
            pages = cache[torch.tensor(r.block_table, device=cache.device)].double().cpu()  # [P, 2, bs, Hkv, D]
            dense_k.append(torch.cat([pages[:, 0].flatten(0, 1)[: r.context_len],
                                      replay.key[layer][start:stop].double().cpu()]))
            dense_v.append(torch.cat([pages[:, 1].flatten(0, 1)[: r.context_len],
                                      replay.value[layer][start:stop].double().cpu()]))
        batch = RandomBatch(
            spec=spec, shapes=[SequenceShape(step.requests[i].query_len, step.requests[i].context_len) for i in picked],
            query=replay.query[layer][rows], key=replay.key[layer][rows], value=replay.value[layer][rows],
            kv_cache=cache, common=common, sinks=replay.sinks[layer], k_scale=1.0, v_scale=1.0, dense_keys=dense_k,
            dense_values=dense_v)
        expected[layer] = oracle_attention(batch)
        replay.output[layer][:n].fill_(float("nan"))
    replay.step(dataclasses.replace(common))
    slots = common.slot_mapping[:n]
    for layer in layers:
        group = groups.groups[groups.layer_group[layer]]
        what = f"layer {layer} (group {group.name}, backend {group.backend.name})"
        spec, cache = replay.specs[layer], replay.caches[layer]
        assert_close_to_oracle(replay.output[layer][rows], expected[layer], tolerance_for(spec.dtype), what=what)
        flat = cache.view(cache.shape[0], 2, spec.block_size, -1)
        page, offset = slots // spec.block_size, slots % spec.block_size
        if not (torch.equal(flat[page, 0, offset], replay.key[layer][:n].reshape(n, -1))
                and torch.equal(flat[page, 1, offset], replay.value[layer][:n].reshape(n, -1))):
            raise AssertionError(f"{what}: the cache does not hold the step's new keys and values at its slots")
    return picked


# ------------------------------------------------------------------------------------------------- the suite
AUTO = "auto"


def _config_for(name: str, profile_dir: Optional[str]) -> AttentionConfig:
    if name == AUTO:
        return AttentionConfig(selection="measured", profile_dir=profile_dir)
    return AttentionConfig(backend=name)


def unsupported_reason(specs: Sequence[AttentionSpec], device: DeviceInfo, name: str,
                       profile_dir: Optional[str] = None) -> Optional[str]:
    """Why backend ``name`` (or ``auto``) cannot serve some layer group of ``specs``, in
    :func:`attnbackends.explain`'s words ("<group>: <reasons>", groups joined by " | "); None when it serves all."""
    explained = explain_layers(specs, device, _config_for(name, profile_dir))
    parts = []
    for group, explanation in explained.items():
        if explanation.chosen is None:
            row = next((r for r in explanation.rows if r.name == name), None)
            why = "; ".join(row.reasons) if row is not None and row.reasons else "no registered backend fits"
            parts.append(f"{group}: {why}")
    return " | ".join(parts) or None


def _oracle_step(trace: Trace) -> int:
    """The step the --check compares with the oracle: the cheapest (queries x keys) of those with a prefill."""
    def cost(i: int) -> int:
        return sum(r.query_len * (r.context_len + r.query_len) for r in trace.steps[i].requests)

    mixed = [i for i, s in enumerate(trace.steps) if s.num_decodes < len(s.requests)]
    return min(mixed or range(len(trace.steps)), key=cost)


def _start_flashinfer_build(specs: list[AttentionSpec], device: torch.device,
                            cascade: bool) -> Optional[threading.Thread]:
    """FlashInfer's JIT modules for ``specs``, built side by side in a background thread (their first use would
    build them one after another); None when there is nothing to build."""
    if not specs or device.type != "cuda":
        return None
    from attnbackends.flashinfer import FlashInferMetadataBuilder, precompile

    def build() -> None:
        start = time.perf_counter()
        try:
            modules = precompile(specs, device, builder_cls=FlashInferMetadataBuilder, cascade=cascade)
            logger.info("FlashInfer modules built in %.0f s: %s", time.perf_counter() - start, ", ".join(modules))
        except Exception as exc:  # the kernels then compile on first use, inside the warm-up passes
            logger.warning("FlashInfer ahead-of-time build failed (%s: %s); modules compile on first use",
                           type(exc).__name__, exc)

    thread = threading.Thread(target=build, name="flashinfer-build", daemon=True)
    thread.start()
    return thread


def _tune_missing(specs: list[AttentionSpec], device: DeviceInfo, profile_dir: str, compared: set[str],
                  grid: str, which: str) -> dict[str, str]:
    """Store an `attnbackends tune` profile for every spec that has none in ``profile_dir`` (as the CLI does);
    returns how each spec's profile came about, by a short description of the spec."""
    from attnbackends.selection.phased import is_phased_name, parse_phased_name
    from attnbackends.selection.tune_timing import run_tune, tune_candidates
    from attnbackends.selection.registry import environment_facts
    from attnbackends.selection.tuning import choose, load_profile

    status = {}
    for spec in specs:
        label = _spec_label(spec)
        found = load_profile(spec, device, profile_dir, environment_facts())
        if found is not None:
            status[label] = f"stored profile {found[0]}"
            continue
        names = tune_candidates(spec, device)
        if which == "compared":
            names = [n for n in names if all(part in compared for part in
                                             (parse_phased_name(n) if is_phased_name(n) else (n,)))]
        if len(names) < 2:  # nothing to choose between: the static list picks the one that fits
            status[label] = f"not tuned: candidates {names or 'none'}"
            continue
        start = time.perf_counter()
        profile = run_tune(spec, device, grid=grid, candidates=names)
        path = profile.save(profile_dir)
        status[label] = f"tuned here in {time.perf_counter() - start:.0f} s ({', '.join(names)}): {path}"
        choice = choose(profile, {n: [] for n in names}, names, source=str(path))
        logger.info("tune %s: %s\n%s", label, status[label], choice.render())
    return status


def _spec_label(spec: AttentionSpec) -> str:
    text = f"{spec.num_heads}/{spec.num_kv_heads}/{spec.head_size}"
    if spec.sliding_window is not None:
        text += f" window {spec.sliding_window}"
    return text + (" sinks" if spec.has_sinks else "")


@dataclass
class _Result:
    """What one (model, trace, backend) gave: timed passes, or why there are none."""

    passes: list[PassTimes] = field(default_factory=list)
    layer_group: list[int] = field(default_factory=list)
    group_specs: list[AttentionSpec] = field(default_factory=list)
    choice: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    unsupported: Optional[str] = None
    error: Optional[str] = None
    checked: Optional[bool] = None

    @property
    def median(self) -> Optional[PassTimes]:
        if not self.passes:
            return None
        return sorted(self.passes, key=lambda p: p.total_us)[len(self.passes) // 2]

    def numbers(self, model_counts: dict[AttentionSpec, int]) -> dict[str, Any]:
        p = self.median
        forward = [sum(col) for col in zip(*p.layer_us)]  # per layer, over the trace
        build = sum(p.build_us)
        model_us = build
        for g, spec in enumerate(self.group_specs):
            own = [us for us, grp in zip(forward, self.layer_group) if grp == g]
            model_us += sum(own) / len(own) * model_counts[spec]
        totals = sorted(x.total_us for x in self.passes)
        return {
            "us": round(p.total_us, 1), "build_us": round(build, 1), "forward_us": round(sum(forward), 1),
            "us_per_layer": round(sum(forward) / len(forward), 1), "model_us": round(model_us, 1),
            "host_us": round(sum(p.host_us), 1), "host_us_per_step": round(statistics.mean(p.host_us), 1),
            "passes": len(self.passes), "pass_spread": round((totals[-1] - totals[0]) / totals[len(totals) // 2], 4),
        }


def _replay_all(models: dict[str, ModelShape], traces: dict[str, Trace], commons: dict[str, list],
                backends: list[str], device: torch.device, args: argparse.Namespace,
                unsupported: dict[tuple[str, str], Optional[str]], timed: bool,
                results: Optional[dict[tuple[str, str, str], _Result]] = None,
                on_model: Optional[Callable[[], object]] = None) -> dict[tuple[str, str, str], _Result]:
    """Replay every trace for every model and backend (warm-up pass, then ``args.repeats`` timed passes) into
    ``results``; with ``timed`` False only the warm-up pass (kernels compile). ``on_model()`` after each model."""
    results = {} if results is None else results
    num_blocks = max(t.num_blocks for t in traces.values())
    max_tokens = max(t.limits.max_num_tokens for t in traces.values())
    max_reqs = max(t.max_num_reqs for t in traces.values())
    for model in models.values():
        specs, counts = replay_layer_specs(model, args.layers_per_group, args.dtype)
        for backend in backends:
            reason = unsupported.get((model.name, backend))
            if reason is not None:
                for kind in traces:
                    results[(model.name, kind, backend)] = _Result(unsupported=reason)
                continue
            start = time.perf_counter()
            try:
                replay = BackendReplay(specs, _config_for(backend, args.profile_dir), device, num_blocks=num_blocks,
                                       max_num_tokens=max_tokens, max_num_reqs=max_reqs, seed=args.seed)
            except Exception as exc:  # a backend failing is a result, not the end of the run
                logger.exception("%s on %s: setup failed", backend, model.name)
                for kind in traces:
                    results[(model.name, kind, backend)] = _Result(error=f"{type(exc).__name__}: {exc}")
                continue
            notes = [f"{g.name}: {note}" for g in replay.groups.groups for note in g.explanation.notes]
            for kind, trace in traces.items():
                result = _Result(layer_group=list(replay.groups.layer_group),
                                 group_specs=[g.spec for g in replay.groups.groups], choice=replay.choice, notes=notes)
                results[(model.name, kind, backend)] = result
                try:
                    if timed and args.check:
                        i = _oracle_step(trace)
                        result.checked = False
                        check_step_against_oracle(replay, trace.steps[i], commons[kind][i])
                        result.checked = True
                    time_pass(replay, commons[kind])  # warm-up: compiles, plans, fills caches and allocators
                    if timed:
                        gc.collect()
                        gc.disable()  # no collector pauses inside a timed pass
                        try:
                            result.passes = [time_pass(replay, commons[kind]) for _ in range(args.repeats)]
                        finally:
                            gc.enable()
                except Exception as exc:
                    logger.exception("%s on %s, trace %s failed", backend, model.name, kind)
                    result.error = f"{type(exc).__name__}: {exc}"
            logger.info("%s %s on %s: %.1f s (%s)", "timed" if timed else "warm-up", backend, model.name,
                        time.perf_counter() - start, ", ".join(f"{g} -> {b}" for g, b in replay.choice.items()))
            del replay
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if on_model is not None:
            on_model()
    return results


def _rows(models: dict[str, ModelShape], traces: dict[str, Trace], backends: list[str],
          results: dict[tuple[str, str, str], _Result], args: argparse.Namespace) -> list[dict[str, Any]]:
    peer = args.peer if args.peer in backends else None
    ours = [b for b in backends if b != peer] or backends
    singles = [b for b in backends if b != AUTO]
    rows = []
    for kind, trace in traces.items():
        for model in models.values():
            _, counts = replay_layer_specs(model, args.layers_per_group, args.dtype)
            numbers = {b: results[(model.name, kind, b)].numbers(counts) for b in backends
                       if (model.name, kind, b) in results and results[(model.name, kind, b)].passes}
            for backend in ours:
                result = results.get((model.name, kind, backend))
                if result is None:  # not run yet
                    continue
                row: dict[str, Any] = {
                    "case": "serving_trace", "backend": backend, "peer": peer if backend != peer else None,
                    "trace": kind, "model": model.name, "dtype": args.dtype, "kv_dtype": "auto",
                    "layers": len(result.layer_group) or None, "model_layers": model.num_layers,
                    **trace.stats(), "us": None, "peer_us": None, "ratio": None,
                }
                if backend in numbers:
                    row.update(numbers[backend])
                    row["groups"] = result.choice
                if result.checked is not None:
                    row["oracle_checked"] = result.checked
                if result.unsupported:
                    row["unsupported"] = result.unsupported
                if result.error:
                    row["error"] = result.error
                peer_result = results.get((model.name, kind, peer), _Result())
                if row["peer"] is not None:
                    if peer in numbers:
                        row["peer_us"] = numbers[peer]["us"]
                        row["peer_model_us"] = numbers[peer]["model_us"]
                        row["peer_host_us"] = numbers[peer]["host_us"]
                        if row["us"] is not None:
                            row["ratio"] = round(row["us"] / row["peer_us"], 4)
                            row["model_ratio"] = round(row["model_us"] / row["peer_model_us"], 4)
                    elif peer_result.unsupported:
                        row["peer_unsupported"] = peer_result.unsupported
                    elif peer_result.error:
                        row["peer_error"] = peer_result.error
                if backend == AUTO:
                    row["choice_notes"] = result.notes
                    timed_singles = {b: numbers[b]["us"] for b in singles if b in numbers}
                    if timed_singles and row["us"] is not None:
                        best = min(timed_singles, key=timed_singles.get)
                        row.update(best_single=best, best_single_us=timed_singles[best],
                                   ratio_best=round(row["us"] / timed_singles[best], 4))
                rows.append(row)
    return rows


def write_plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Bars of ``ratio`` (time / the peer's) per model, one panel per trace, one bar per backend; where no row has
    a ratio (no peer ran), the absolute times. Returns False (and writes nothing) without rows to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("case") == "serving_trace"]
    use_ratio = any(r.get("ratio") is not None for r in rows)
    key = "ratio" if use_ratio else "us"
    kinds = list(dict.fromkeys(r["trace"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    if not kinds or not any(r.get(key) is not None for r in rows):
        return False
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 4.2), squeeze=False, sharey=use_ratio)
    width = 0.8 / len(backends)
    for ax, kind in zip(axes[0], kinds):
        for b, backend in enumerate(backends):
            for m, model in enumerate(models):
                row = next((r for r in rows if r["trace"] == kind and r["model"] == model and r["backend"] == backend),
                           None)
                x = m + (b - (len(backends) - 1) / 2) * width
                value = row.get(key) if row else None
                if value is None:
                    ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7,
                            transform=ax.get_xaxis_transform())
                    continue
                ax.bar(x, value, width, color=f"C{b}", label=backend if m == 0 else None)
        if use_ratio:
            ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        else:
            ax.set_yscale("log")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"trace: {kind}")
        ax.grid(True, axis="y", alpha=0.3)
    peer = next((r["peer"] for r in rows if r.get("peer")), None)
    axes[0][0].set_ylabel(f"attention time / {peer}'s (lower is better)" if use_ratio else "attention time (us)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("serving traces: total attention time (builds + forwards) per trace")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _csv(value: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--{what} {value!r}: unknown {unknown}; allowed: {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the rows ({\"rows\": [...]})")
    parser.add_argument("--plot", default=None, help="PNG of the ratios (default: --out with the suffix .png)")
    parser.add_argument("--backends", default="triton,flashinfer,auto",
                        help="comma-separated registered backend names, and 'auto' (the measured selection)")
    parser.add_argument("--peer", default="flashinfer", help="the backend every other one is compared with")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--traces", default=",".join(TRACE_KINDS),
                        help=f"comma-separated, from: {', '.join(TRACE_KINDS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--tiny", action="store_true", help="tiny traces and head counts (a CPU check)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every trace's length in steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers-per-group", type=int, default=2, help="layers replayed per distinct layer spec")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per trace (the median pass is kept)")
    parser.add_argument("--check", action="store_true",
                        help="compare one step per trace, model and backend with the float64 oracle first")
    parser.add_argument("--tune", default="missing", choices=["missing", "never"],
                        help="auto: tune the layer specs without a stored profile here first, or never tune")
    parser.add_argument("--tune-grid", default="small", choices=["small", "tiny"])
    parser.add_argument("--tune-candidates", default="compared", choices=["compared", "all"],
                        help="compared: the single backends of --backends and their per-phase compositions; "
                             "all: everything `attnbackends tune` would time")
    parser.add_argument("--profile-dir", default=None, help="where tune profiles live (default: the user cache)")
    parser.add_argument("--no-common-prefix", action="store_true",
                        help="replay without telling the backends each step's common prefix (as an engine without "
                             "a prefix cache would): FlashInfer then runs no cascade attention")
    args = parser.parse_args(argv)
    try:
        backends = _csv(args.backends, backend_names() + [AUTO], "backends")
        args.peer = _csv(args.peer, backend_names(), "peer")[0]
        model_names = _csv(args.models, list(MODELS), "models")
        kinds = _csv(args.traces, list(TRACE_KINDS), "traces")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.layers_per_group < 1:
        parser.error("--repeats and --layers-per-group must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --backends reference --tiny)")
    info = DeviceInfo.current(device)
    from attnbackends.selection.tuning import default_profile_dir

    args.profile_dir = str(default_profile_dir(AttentionConfig(profile_dir=args.profile_dir)))
    wall = time.perf_counter()
    models = {n: (TINY_MODELS if args.tiny else MODELS)[n] for n in model_names}
    traces = {k: generate_trace(k, seed=args.seed, scale=args.scale, tiny=args.tiny) for k in kinds}
    commons = {k: [s.common(device) for s in t.steps] for k, t in traces.items()}
    if args.no_common_prefix:
        commons = {k: [dataclasses.replace(c, common_prefix_len=0) for c in cs] for k, cs in commons.items()}
    for k, t in traces.items():
        logger.info("trace %s: %s, %d pages", k, t.stats(), t.num_blocks)

    explicit = [b for b in backends if b != AUTO]
    all_specs = list(dict.fromkeys(s for m in models.values()
                                   for s in replay_layer_specs(m, args.layers_per_group, args.dtype)[0]))
    unsupported = {}
    for model in models.values():
        specs = replay_layer_specs(model, args.layers_per_group, args.dtype)[0]
        for backend in explicit:
            unsupported[(model.name, backend)] = unsupported_reason(specs, info, backend)
            if unsupported[(model.name, backend)]:
                logger.info("%s cannot serve %s: %s", backend, model.name, unsupported[(model.name, backend)])
    compared = set(explicit)
    uses_flashinfer = "flashinfer" in compared or (AUTO in backends and args.tune_candidates == "all")
    flashinfer_specs = [s for s in all_specs if uses_flashinfer and unsupported_reason([s], info, "flashinfer") is None]
    cascade = "chat" in traces and not args.no_common_prefix and CascadePolicy().enabled
    build = _start_flashinfer_build(flashinfer_specs, device, cascade=cascade)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str, str], _Result] = {}
    tune_status: dict[str, str] = {}

    def write(complete: bool) -> list[dict[str, Any]]:
        """The rows so far (a run cut short still leaves the numbers it measured)."""
        rows = _rows(models, traces, backends, results, args)
        header = {"gpu": info.name, "suite": "serving_trace", "device": info.describe(), **library_versions(),
                  "date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.serving_trace "
                  + " ".join(argv if argv is not None else sys.argv[1:]), "complete": complete,
                  "seconds": round(time.perf_counter() - wall, 1), "tune": tune_status}
        out.write_text(json.dumps({**header, "rows": rows}, indent=1))
        return rows

    # Triton (and the others without FlashInfer) compile on warm-up passes while FlashInfer's modules build.
    early = [b for b in explicit if b != "flashinfer"]
    if build is not None and early:
        _replay_all(models, traces, commons, early, device, args, unsupported, timed=False)
    if build is not None:
        build.join()
        logger.info("kernels ready after %.0f s", time.perf_counter() - wall)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny CPU replays: intra-op threads only contend
    try:
        # Tuning comes first, so that every backend (auto too) is timed in the same stretch of the run, model by
        # model: the host's state after a tune would otherwise favour the backends timed before it.
        if AUTO in backends:
            start = time.perf_counter()
            if args.tune == "missing" and info.is_cuda:
                tune_status.update(_tune_missing(all_specs, info, args.profile_dir, compared, args.tune_grid,
                                                 args.tune_candidates))
            elif not info.is_cuda:
                tune_status["all"] = "not tuned: profiles are for CUDA devices (the static priority list chooses)"
            logger.info("tune: %.0f s", time.perf_counter() - start)
            for model in models.values():
                specs = replay_layer_specs(model, args.layers_per_group, args.dtype)[0]
                unsupported[(model.name, AUTO)] = unsupported_reason(specs, info, AUTO, args.profile_dir)
        _replay_all(models, traces, commons, backends, device, args, unsupported, timed=True, results=results,
                    on_model=lambda: write(False))
    finally:
        torch.set_num_threads(threads)
    rows = write(True)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    try:
        plotted = write_plot(rows, plot)
    except ImportError as exc:  # matplotlib comes with the dev extra; the rows are the result
        logger.warning("no plot: %s", exc)
        plotted = False
    for row in rows:
        logger.info("%-6s %-12s %-10s us %10s  peer %10s  ratio %6s%s", row["trace"], row["model"], row["backend"],
                    row["us"], row["peer_us"], row["ratio"],
                    "".join(f"  {k}: {row[k]}" for k in ("unsupported", "peer_unsupported", "error") if k in row))
    logger.info("wrote %s%s in %.0f s", out, f" and {plot}" if plotted else "", time.perf_counter() - wall)
    failed = [r for r in rows if "error" in r or r.get("oracle_checked") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
