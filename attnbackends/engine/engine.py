"""A compact paged engine: block allocator, continuous batching with chunked prefill, one metadata build per step
shared by every layer, and each layer's impl called through the selected backend.

The engine knows nothing about a model's architecture. A model (see :class:`EngineModel`) tells it the attention
spec of its layers and any per-layer impl arguments (MLA impls need ``kv_b_proj``), and its ``forward`` calls the
:class:`StepAttention` it is handed once per layer: ``attn(layer, q, k, v)`` for standard attention,
``attn.mla(layer, q, kv_c, k_pe)`` for MLA (plus the indexer's ``index_q``, ``index_k`` and ``index_weights`` for
sparse MLA, whose layers each get a :class:`~attnbackends.ops.sparse_mla_cache.SparseMLACache` from the backend).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..interface import AttentionBackend, CudaGraphSupport
from ..masks import check_spans, with_spans
from ..metadata import CommonAttentionMetadata, decode_first_order
from ..persistent_batch import PersistentBatch
from ..platform import DeviceInfo
from ..selection.registry import select
from ..spec import AttentionConfig, AttentionSpec, MaskKind
from ..speculative.tree_mask import with_tree_mask
from .cuda_graphs import DecodeGraphs, capture_sizes
from .kv_cache import KVScales, check_kv_cache_dtype, check_kv_scales, kv_scale_kwargs, with_kv_cache_dtype
from .speculative import DraftTree, SpeculativeConfig, accept_greedy

__all__ = [
    "BlockAllocator",
    "EngineConfig",
    "EngineModel",
    "GenerationResult",
    "PagedEngine",
    "SpeculativeStats",
    "StepAttention",
    "zero_cache",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine.

    block_size : tokens per KV-cache page.
    num_blocks : pages per layer.
    max_num_batched_tokens : token budget per step; prefills are chunked to fit it (decodes go first).
    max_num_reqs : requests running at once; the others wait and join as running ones finish.
    cudagraph_capture_sizes : the padded batch sizes whose decode steps are captured in CUDA graphs (those up to
        ``max_num_reqs`` and ``max_num_batched_tokens``); None: 1, 2, 4, ..., 512
        (:data:`~attnbackends.engine.cuda_graphs.DEFAULT_CAPTURE_SIZES`).
    kv_cache_dtype : how every layer's KV cache stores keys and values (``AttentionSpec.kv_cache_dtype``:
        "int8_per_token_head", "nvfp4", "fp8", ...; docs/KV_FORMATS.md); "auto" keeps the model's spec (16 bits
        for the built-in models). An unknown name is a ValueError listing the allowed ones.
    kv_scales : per-tensor ``(k_scale, v_scale)`` for fp8 per tensor and NVFP4's global scale, one pair per layer
        or one for every layer (:func:`~attnbackends.engine.kv_cache.calibrated_kv_scales` measures them); None:
        the impls' 1.0. Per-token-head formats compute their scales on write and take none.
    """

    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 64
    max_num_reqs: int = 64
    cudagraph_capture_sizes: Optional[tuple[int, ...]] = None
    kv_cache_dtype: str = "auto"
    kv_scales: Optional[KVScales] = None

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "kv_scales", check_kv_scales(self.kv_scales, self.kv_cache_dtype))


def zero_cache(cache: Any) -> Any:
    """Zero a layer's cache as the backend allocated it (one tensor, or a tuple of tensors such as a sparse MLA
    layer's latent and index caches) and return it."""
    if isinstance(cache, torch.Tensor):
        return cache.zero_()
    for part in cache:
        part.zero_()
    return cache


class BlockAllocator:
    """Hands out KV-cache pages from a free list."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV-cache pages: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


@runtime_checkable
class EngineModel(Protocol):
    """What the engine needs from a model (:class:`~attnbackends.engine.TinyLlama`, the HF adapters)."""

    num_layers: int

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """The spec shared by every attention layer."""

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        """Extra keyword arguments of layer ``layer``'s impl (``kv_b_proj`` for MLA; {} otherwise)."""

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attn: "StepAttention", logits_rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """tokens, positions : [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""


class StepAttention:
    """One step's attention for every layer: the backend metadata (built once) and each layer's impl and cache."""

    def __init__(self, engine: "PagedEngine", metadata: Any) -> None:
        self._impls = engine.impls
        self._caches = engine.kv_caches
        self.metadata = metadata
        self.spec = engine.spec

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Standard attention: q [T, Hq, D], k and v [T, Hkv, D] (written to the cache) -> [T, Hq, D]."""
        out = torch.empty((q.shape[0], self.spec.num_heads, self.spec.value_head_size), dtype=q.dtype, device=q.device)
        return self._impls[layer].forward(q, k, v, self._caches[layer], self.metadata, out)

    def mla(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
            **indexer: torch.Tensor) -> torch.Tensor:
        """MLA: q [T, N, P + R], kv_c [T, Lkv] (normalised latent), k_pe [T, R] (rotated) -> [T, N, V].

        Sparse MLA layers also take the indexer's inputs as keywords: index_q [T, H, D], index_k [T, D] and
        index_weights [T, H] (:mod:`attnbackends.ops.sparse_mla_inputs`)."""
        out = torch.empty((q.shape[0], self.spec.num_heads, self.spec.v_head_dim), dtype=q.dtype, device=q.device)
        return self._impls[layer].forward(q, kv_c, k_pe, self._caches[layer], self.metadata, out, **indexer)


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: Optional[int] = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)
    spans: tuple[tuple[int, int], ...] = ()  # bidirectional spans of the prompt (absolute positions)
    forced: Optional[list[int]] = None  # teacher forcing: the tokens fed back instead of the greedy choices

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def finished(self) -> bool:
        if self.output and self.eos_token_id is not None and self.output[-1] == self.eos_token_id:
            return True
        return len(self.output) >= self.max_new_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass
class SpeculativeStats:
    """Verify steps (one request, one step), those whose draft tree branched, draft tokens proposed and accepted,
    tokens emitted (accepted + bonus)."""

    verify_steps: int = 0
    branching_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step (1.0: nothing accepted; 1 + k: every draft of a chain accepted)."""
        return self.emitted_tokens / max(self.verify_steps, 1)


@dataclass
class GenerationResult:
    """Generated tokens per prompt, the logits that chose each of them ([new_tokens, vocab] float32), and timing."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    num_steps: int
    seconds: float
    backend: str
    speculative: Optional[SpeculativeStats] = None

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.seconds, 1e-9)


class PagedEngine:
    """Serves an :class:`EngineModel` through the attention backend the registry selects for it.

    Parameters
    ----------
    model : the model; it is moved to ``device`` and ``dtype`` in place (``nn.Module.to``).
    config : engine sizes.
    device, dtype : where and in which precision the model runs (the spec's dtype).
    attention_config : the user's backend choice (``AttentionConfig(backend="triton")``, a config file, ...);
        ``ATTNBACKENDS_BACKEND`` applies on top of it. An explicit choice that does not fit raises
        :class:`~attnbackends.BackendNotSupportedError`.
    speculative : speculative decoding (:class:`~attnbackends.engine.speculative.SpeculativeConfig`): each decode
        step verifies the drafter's token tree in one forward (the spec asks the backend for decodes of
        1 + ``num_speculative_tokens`` tokens with a tree mask) and keeps the longest path the model agrees with;
        greedy outputs are the same as without it.
    cuda_graphs : run decode steps from CUDA graphs (:mod:`attnbackends.engine.cuda_graphs`: the model's whole
        forward captured per padded batch size, ``config.cudagraph_capture_sizes``), other steps eagerly. None
        (default): on where the engine runs on a CUDA device, the backend declares CUDA-graph support and there is
        no speculative decoding; True asks for them (where they cannot run, the engine runs eagerly and logs why);
        False: every step eager. ``cuda_graphs_reason`` says why they are off.
    builder_options : keyword arguments of the selected backend's metadata builder (e.g. the Triton builder's
        ``deterministic=True``).

    Attributes
    ----------
    graphs : the :class:`~attnbackends.engine.cuda_graphs.DecodeGraphs` (None: every step eager).
    cuda_graphs_reason : why decode steps run eagerly ("" when they run from graphs).
    graph_steps, eager_steps : steps run from a graph and eagerly.
    """

    graphs: Optional[DecodeGraphs] = None
    cuda_graphs_reason = "the engine runs every step eagerly"
    graph_steps = 0
    eager_steps = 0

    def __init__(
        self,
        model: EngineModel,
        config: EngineConfig = EngineConfig(),
        *,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_config: Optional[AttentionConfig] = None,
        speculative: Optional[SpeculativeConfig] = None,
        cuda_graphs: Optional[bool] = None,
        builder_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if cuda_graphs not in (None, True, False):
            raise ValueError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = config
        spec = with_kv_cache_dtype(model.attention_spec(dtype, config.block_size), config.kv_cache_dtype)
        self.speculative = speculative
        self.extra_tokens = 0  # positions a request may use past its longest sequence (rejected drafts)
        if speculative is not None:
            spec = type(spec).model_validate({
                **spec.model_dump(), "num_speculative_tokens": speculative.num_speculative_tokens,
                "speculative_tree": True,
            })
            self.extra_tokens = speculative.num_speculative_tokens
            if spec.is_sparse_mla:
                raise NotImplementedError("speculative decoding with sparse MLA layers: the engine does not move "
                                          "accepted draft tokens' index-cache entries")
            if spec.kv_cache_format.scales_in_pages:
                raise NotImplementedError(f"speculative decoding with kv_cache_dtype {spec.kv_cache_dtype!r}: the "
                                          "engine does not move accepted draft tokens' scales")
        self.spec = spec
        self.spec_stats = SpeculativeStats()
        self.backend: type[AttentionBackend] = select(self.spec, DeviceInfo.current(self.device), attention_config)
        debug = bool(attention_config.debug) if attention_config is not None else False
        self.builder = self.backend.get_builder_cls()(
            self.spec, self.device, max_num_reqs=config.max_num_reqs, max_num_tokens=config.max_num_batched_tokens,
            debug=debug, num_blocks=config.num_blocks, **(builder_options or {}),
        )
        self.impls = [
            self.backend.get_impl_cls()(
                self.spec, **model.impl_kwargs(i), **kv_scale_kwargs(self.spec, config.kv_scales, i, model.num_layers)
            )
            for i in range(model.num_layers)
        ]
        self.kv_caches = [
            zero_cache(self.backend.allocate_kv_cache(config.num_blocks, self.spec, self.device))
            for _ in range(model.num_layers)
        ]
        self.allocator = BlockAllocator(config.num_blocks)
        # the running requests' page tables, kept across steps: each step's metadata is prepared from it
        self.batch = PersistentBatch(
            config.max_num_reqs, config.max_num_batched_tokens, config.num_blocks, config.block_size, self.device,
            num_blocks=config.num_blocks, decode_threshold=self.builder.reorder_batch_threshold, exclusive_pages=True,
        )
        self.num_steps = 0
        self.scheduled_tokens: list[int] = []  # tokens per step, to show the budget at work
        self.graph_steps = self.eager_steps = 0
        sizes = capture_sizes(config.cudagraph_capture_sizes, config.max_num_reqs, config.max_num_batched_tokens)
        self.cuda_graphs_reason = self._graphs_off_reason(cuda_graphs, sizes)
        if self.cuda_graphs_reason:
            if cuda_graphs:
                logger.warning("cuda_graphs=True, but decode steps run eagerly: %s", self.cuda_graphs_reason)
        else:
            self.graphs = DecodeGraphs(self, sizes)

    def _graphs_off_reason(self, asked: Optional[bool], sizes: tuple[int, ...]) -> str:
        """Why decode steps cannot (or were asked not to) run from CUDA graphs; "" where they can."""
        if asked is False:
            return "turned off (cuda_graphs=False)"
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device; the engine runs on {self.device.type}"
        if self.backend.cudagraph_support < CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            return f"the {self.backend.name} backend declares no CUDA-graph support ({self.backend.cudagraph_support.name})"
        if self.speculative is not None:
            return "speculative decoding: its verify steps carry tree masks and run eagerly"
        if not sizes:
            return (f"no capture size fits max_num_reqs={self.config.max_num_reqs} and max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens}")
        return ""

    def step_attention_of(self, metadata: Any) -> StepAttention:
        """The attention every layer of a step runs over ``metadata`` (built once per step)."""
        return StepAttention(self, metadata)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _admit(self, waiting: deque, running: list[_Request]) -> None:
        """Move waiting requests in while there is room: a request reserves the pages of its longest sequence up
        front, so a running request never runs out of pages (no preemption needed)."""
        reserved = sum(self._pages(r.max_len + self.extra_tokens) - len(r.blocks) for r in running)
        while waiting and len(running) < self.config.max_num_reqs:
            need = self._pages(waiting[0].max_len + self.extra_tokens)
            if need > self.config.num_blocks:
                raise RuntimeError(
                    f"request {waiting[0].index} needs {need} KV-cache pages; the engine has {self.config.num_blocks}"
                )
            if need > self.allocator.num_free - reserved:
                break
            reserved += need
            req = waiting.popleft()
            self.batch.add_request(req.index, req.blocks, req.num_computed)
            running.append(req)

    def _schedule(self, running: list[_Request]) -> list[tuple[_Request, int, Optional[DraftTree]]]:
        """Decodes first (one token each, plus the drafter's tree with speculation), then prefill chunks within the
        step's token budget, in the order the backend's builder wants (queries of at most
        ``reorder_batch_threshold`` tokens first)."""
        budget = self.config.max_num_batched_tokens
        batch = []
        for req in sorted(running, key=lambda r: not r.is_decode):
            if budget == 0:
                break
            n = self._chunk_at_span_boundary(req, min(len(req.tokens) - req.num_computed, budget))
            if n == 0:
                continue
            draft = None
            if self.speculative is not None and req.is_decode and budget > 1:
                limit = min(self.speculative.num_speculative_tokens, budget - 1)
                draft = self.speculative.drafter.propose(req.tokens, limit) or None
                if draft is not None:
                    n += len(draft)
            batch.append((req, n, draft))
            budget -= n
        order = decode_first_order([n for _, n, _ in batch], self.builder.reorder_batch_threshold)
        return [batch[i] for i in order]

    def _chunk_at_span_boundary(self, req: _Request, n: int) -> int:
        """``n`` scheduled tokens of ``req``, shortened so that a prefill chunk does not end inside a span: the
        span's tokens then see the whole span, as a dense recompute does (vLLM ends chunks at multimodal items the
        same way). A chunk that starts at a span which does not fit this step's budget waits for a step with room
        (0); a span longer than ``max_num_batched_tokens`` is split, its earlier chunks seeing the span up to
        their end (docs/MASKS.md)."""
        first, last = req.num_computed, req.num_computed + n
        for start, stop in req.spans:
            if start < last < stop:
                if start > first:
                    return start - first
                if stop - first <= self.config.max_num_batched_tokens:
                    return 0
        return n

    def _reserve_pages(self, req: _Request, num_tokens: int) -> None:
        """Give ``req`` the pages its first ``num_tokens`` tokens need (``req.blocks`` is its block table)."""
        need = self._pages(num_tokens) - len(req.blocks)
        if need > 0:
            pages = self.allocator.allocate(need)
            req.blocks += pages
            self.batch.append_pages(req.index, pages)

    def _release_pages(self, req: _Request) -> None:
        self.batch.finish_request(req.index)
        self.allocator.release(req.blocks)
        req.blocks = []

    def _step_attention(self, batch: list[tuple], common) -> StepAttention:
        """The step's attention: one build per step, shared by every layer."""
        return self.step_attention_of(self.builder.build(common))

    def _graph_size(self, batch: list[tuple], common: CommonAttentionMetadata) -> Optional[int]:
        """The capture size this step runs on: one new token per request, no draft, a size that holds it; else
        None (eager)."""
        if self.graphs is None or common.num_actual_tokens != common.num_reqs or common.masks is not None:
            return None
        if any(draft is not None for _, _, draft in batch):
            return None
        return self.graphs.size_for(common.num_reqs)

    def _prepare_step(self, batch: list[tuple]) -> tuple[CommonAttentionMetadata, list[tuple]]:
        """The step's common metadata, prepared by the persistent batch (which advances each request's cached
        tokens there by its scheduled ones), and ``batch`` in the metadata's request order."""
        by_index = {entry[0].index: entry for entry in batch}
        common = self.batch.prepare({req.index: n for req, n, _ in batch})
        return common, [by_index[i] for i in self.batch.step_req_ids]

    @torch.inference_mode()
    def step(self, running: list[_Request]) -> None:
        """One forward pass over the scheduled tokens of ``running``; samples where a sequence is fully cached."""
        batch = self._schedule(running)
        for req, n, _ in batch:
            self._reserve_pages(req, req.num_computed + n)
        common, batch = self._prepare_step(batch)
        tokens, positions, trees = [], [], []
        for req, n, draft in batch:
            if draft is not None:  # verify: the root (last token, uncached) and the draft tree below it
                tokens += [req.tokens[-1]] + draft.tokens
                positions += [req.num_computed] + [req.num_computed + d for d in draft.depths()]
                trees.append(draft.segment_parents())
            else:
                tokens += req.tokens[req.num_computed : req.num_computed + n]
                positions += range(req.num_computed, req.num_computed + n)
                trees.append(None)
        if any(t is not None for t in trees):
            common = with_tree_mask(common, trees)
        if self._step_meets_a_span(batch):
            common = with_spans(common, [req.spans for req, _, _ in batch])
        qsl = common.query_start_loc_cpu.tolist()
        rows = []  # logits rows: every verify token, else the last token of a request whose sequence is cached
        for i, (req, n, draft) in enumerate(batch):
            if draft is not None:
                rows += range(qsl[i], qsl[i + 1])
            elif req.num_computed + n == len(req.tokens):
                rows.append(qsl[i + 1] - 1)
        if self._graph_size(batch, common) is not None:
            logits = self.graphs.run(common, tokens, positions)[rows]  # one token per request: row i is request i
            self.graph_steps += 1
        else:
            attn = self._step_attention(batch, common)
            token_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            logits = self.model.forward(token_ids, torch.tensor(positions, device=self.device), attn,
                                        torch.tensor(rows, dtype=torch.long, device=self.device))
            self.eager_steps += 1
        logits = logits.float().cpu()  # one copy per step; the sampling below reads the host rows
        at = 0
        for req, n, draft in batch:
            if draft is not None:
                self._accept(req, draft, logits[at : at + n])
                at += n
                continue
            req.num_computed += n
            if req.num_computed == len(req.tokens):  # the whole known sequence is cached: greedy next token
                req.step_logits.append(logits[at])
                req.output.append(int(logits[at].argmax()) if req.forced is None else req.forced[len(req.output)])
                at += 1
        self.num_steps += 1
        self.scheduled_tokens.append(len(tokens))

    @staticmethod
    def _step_meets_a_span(batch: list[tuple]) -> bool:
        """Whether a scheduled token of the step lies inside its request's spans (only then does the step carry
        them: the other tokens of a spans layer see exactly their causal keys)."""
        for req, n, _ in batch:
            first, last = req.num_computed, req.num_computed + n
            if any(start < last and first < end for start, end in req.spans):
                return True
        return False

    def _accept(self, req: _Request, draft: DraftTree, logits: torch.Tensor) -> None:
        """Keep the longest draft path the model agrees with plus its next token; roll the cache back to it.

        logits : [1 + len(draft), vocab], the rows of the root and of each draft token.
        """
        path, bonus = accept_greedy(draft, logits.argmax(dim=-1).tolist())
        context = req.num_computed
        self._move_cached_tokens([context + 1 + a for a in path], [context + 1 + j for j in range(len(path))], req)
        emitted = 0
        for token, row in zip([draft.tokens[a] for a in path] + [bonus], [0] + [1 + a for a in path]):
            if req.finished:
                break
            req.step_logits.append(logits[row])
            req.output.append(token)
            emitted += 1
        req.num_computed = context + min(emitted, 1 + len(path))  # the root and the accepted drafts are cached
        self.batch.set_num_computed_tokens(req.index, req.num_computed)
        keep = self._pages(req.num_computed)
        if len(req.blocks) > keep:  # pages that held only rejected drafts go back to the pool
            self.allocator.release(self.batch.truncate_pages(req.index, keep).tolist())
            del req.blocks[keep:]
        stats = self.spec_stats
        stats.verify_steps += 1
        stats.branching_steps += draft.num_branches > 1 or len(set(draft.parents)) < len(draft.parents)
        stats.draft_tokens += len(draft)
        stats.accepted_tokens += len(path)
        stats.emitted_tokens += emitted

    def _move_cached_tokens(self, src: list[int], dst: list[int], req: _Request) -> None:
        """Copy the cached K/V of positions ``src`` to positions ``dst`` of ``req`` in every layer (an accepted tree
        path moves to consecutive positions; a chain is already in place)."""
        moves = [(s, d) for s, d in zip(src, dst) if s != d]
        if not moves:
            return
        bs = self.config.block_size
        table = torch.tensor(req.blocks, dtype=torch.long, device=self.device)
        src_t = torch.tensor([s for s, _ in moves], device=self.device)
        dst_t = torch.tensor([d for _, d in moves], device=self.device)
        sb, so, db, do = table[src_t // bs], src_t % bs, table[dst_t // bs], dst_t % bs
        for cache in self.kv_caches:
            if cache.dim() == 5:  # [num_blocks, 2, block_size, num_kv_heads, head_size]
                cache[db, :, do] = cache[sb, :, so]
            else:  # MLA: [num_blocks, block_size, head_size]
                cache[db, do] = cache[sb, so]

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: Optional[int] = None, *,
        spans: Optional[list[Optional[list[tuple[int, int]]]]] = None,
    ) -> GenerationResult:
        """Greedy generation of up to ``max_new_tokens`` per prompt with continuous batching.

        Requests beyond ``max_num_reqs`` (or beyond the free pages) wait and join as running ones finish.
        ``spans``: per prompt, its bidirectional spans ``[(start, end), ...]`` inside the prompt (an image's tokens;
        None or [] for none), for a model whose layers are ``causal_spans`` (docs/MASKS.md). Each step carries the
        spans of its requests where a scheduled token lies in one (``attnbackends.masks.with_spans``); a prefill
        chunk may end inside a span, and its span tokens then see the span's keys up to the chunk's end.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        requests = [_Request(i, list(p), max_new_tokens, eos_token_id) for i, p in enumerate(prompts)]
        for req in requests:
            if not req.prompt:
                raise ValueError(f"prompt {req.index} is empty; every prompt needs at least one token")
        if spans is not None:
            if self.spec.mask.kind is not MaskKind.CAUSAL_SPANS:
                raise ValueError(f"spans were given, but the model's layers have mask kind "
                                 f"{self.spec.mask.kind.value!r}: spans need AttentionMask(kind='causal_spans')")
            for req, checked in zip(requests, check_spans(spans, len(requests))):
                if checked and checked[-1][1] > len(req.prompt):
                    raise ValueError(f"spans[{req.index}] ends at {checked[-1][1]}, past its prompt of "
                                     f"{len(req.prompt)} tokens: spans lie inside the prompt")
                req.spans = checked
        return self._run(requests)

    def generate_teacher_forced(self, prompts: list[list[int]], forced_tokens: list[list[int]]) -> GenerationResult:
        """Run each prompt on, feeding ``forced_tokens[i]`` (e.g. another engine's greedy output) as its continuation
        instead of this engine's greedy choices, so that one early disagreement does not change what follows.

        The result's ``tokens`` are ``forced_tokens``; ``logits[i]`` ([len(forced_tokens[i]), vocab] float32) are
        this engine's logits at each continuation position: their argmax is its own greedy choice there
        (:func:`~attnbackends.engine.agreement.teacher_forced_agreement` compares them).
        """
        if len(forced_tokens) != len(prompts):
            raise ValueError(f"forced_tokens holds {len(forced_tokens)} continuations for {len(prompts)} prompts")
        if self.speculative is not None:
            raise NotImplementedError("teacher forcing with speculative decoding: verify steps choose their own "
                                      "tokens; build the engine without speculative=")
        requests = []
        for i, (prompt, forced) in enumerate(zip(prompts, forced_tokens)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if not forced:
                raise ValueError(f"forced_tokens[{i}] is empty; every prompt needs at least one forced token")
            requests.append(_Request(i, list(prompt), len(forced), forced=[int(t) for t in forced]))
        return self._run(requests)

    def _run(self, requests: list[_Request]) -> GenerationResult:
        """Serve ``requests`` to the end: admit, step, release the finished, until none is left."""
        self.spec_stats = SpeculativeStats()
        waiting = deque(requests)
        running: list[_Request] = []
        steps = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        while waiting or running:
            self._admit(waiting, running)
            self.step(running)
            steps += 1
            for req in [r for r in running if r.finished]:
                self._release_pages(req)
                running.remove(req)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return GenerationResult(
            tokens=[r.output for r in requests],
            logits=[torch.stack(r.step_logits) for r in requests],
            num_steps=steps,
            seconds=time.perf_counter() - start,
            backend=self.backend.name,
            speculative=self.spec_stats if self.speculative is not None else None,
        )
