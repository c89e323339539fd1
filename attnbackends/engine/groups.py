"""The paged engine for models whose layers differ: one backend, builder and metadata per layer group, and one page
pool per group.

A model tells the engine one spec per layer (:meth:`GroupedEngineModel.layer_specs`). Every group gets its own
pages: a request's page list per group, allocated as its tokens arrive. Sliding-window groups cap a request's pages
at :func:`~attnbackends.layer_groups.window_pages_per_request` (so their pools hold ``max_num_reqs`` times that
at most) and, before each step, return to their pool the pages wholly before the window of the request's next
query: those entries of the request's block table then hold page 0, which the window trim drops before any
backend sees the table (:func:`~attnbackends.layer_groups.trim_to_window`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..layer_groups import GroupedMetadata, GroupedMetadataBuilder, LayerGroupsConfig, group_layers
from ..layer_groups import window_pages_per_request
from ..metadata import build_common_metadata
from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionSpec, AttentionType
from .engine import BlockAllocator, EngineConfig, PagedEngine, SpeculativeStats, StepAttention, _Request, zero_cache
from .kv_cache import kv_scale_kwargs, with_kv_cache_dtype

__all__ = ["GroupedEngineModel", "GroupedPagedEngine", "GroupedStepAttention"]


@runtime_checkable
class GroupedEngineModel(Protocol):
    """A model whose attention layers may differ (``EngineModel`` with one spec per layer)."""

    num_layers: int

    def layer_specs(self, dtype: torch.dtype, block_size: int) -> list[AttentionSpec]:
        """One spec per attention layer, in layer order."""

    def impl_kwargs(self, layer: int) -> dict[str, Any]:
        """Extra keyword arguments of layer ``layer``'s impl (``sinks`` for gpt-oss; {} otherwise)."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: "GroupedStepAttention",
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions : [T] int64 -> logits [len(logits_rows) or T, vocab] float32."""


class GroupedStepAttention(StepAttention):
    """One step's attention: each layer runs its group's impl on its group's metadata."""

    def __init__(self, engine: "GroupedPagedEngine", metadata: GroupedMetadata) -> None:
        self._impls = engine.impls
        self._caches = engine.kv_caches
        self._specs = engine.layer_specs
        self._per_layer = metadata.per_layer
        self.metadata = metadata

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] of layer ``layer`` (written to its cache) -> [T, Hq, Dv]."""
        spec = self._specs[layer]
        out = torch.empty((q.shape[0], spec.num_heads, spec.value_head_size), dtype=q.dtype, device=q.device)
        return self._impls[layer].forward(q, k, v, self._caches[layer], self._per_layer[layer], out)

    def mla(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
            **indexer: torch.Tensor) -> torch.Tensor:
        spec = self._specs[layer]
        out = torch.empty((q.shape[0], spec.num_heads, spec.v_head_dim), dtype=q.dtype, device=q.device)
        return self._impls[layer].forward(q, kv_c, k_pe, self._caches[layer], self._per_layer[layer], out, **indexer)


@dataclass(frozen=True)
class _BackendLabel:
    """What :class:`~attnbackends.engine.GenerationResult` reports as the backend: every group's choice."""

    name: str


class GroupedPagedEngine(PagedEngine):
    """Serves a :class:`GroupedEngineModel` with one backend per layer group (see the module docstring).

    Parameters
    ----------
    model, config, device, dtype : as for :class:`~attnbackends.engine.PagedEngine` (``config.kv_cache_dtype``
        applies to every layer).
    attention_config : a :class:`~attnbackends.LayerGroupsConfig` (pins per group name or layer range; its
        ``kv_cache_16bit_layers`` keep those layers' caches in 16 bits, in their own group) or one
        :class:`~attnbackends.AttentionConfig` for every group.
    """

    #: Attention types of the layers this engine serves (a subclass serving encoders widens it).
    served_attn_types: frozenset[AttentionType] = frozenset({AttentionType.DECODER})

    def __init__(
        self,
        model: GroupedEngineModel,
        config: EngineConfig = EngineConfig(),
        *,
        device: "torch.device | str" = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_config: "LayerGroupsConfig | AttentionConfig | None" = None,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = config
        self.speculative = None  # speculative decoding runs on PagedEngine's single page pool only
        self.extra_tokens = 0
        self.spec_stats = SpeculativeStats()
        self.layer_specs = [with_kv_cache_dtype(s, config.kv_cache_dtype)
                            for s in model.layer_specs(dtype, config.block_size)]
        if len(self.layer_specs) != model.num_layers:
            raise ValueError(f"layer_specs gave {len(self.layer_specs)} specs for {model.num_layers} layers")
        unserved = [i for i, s in enumerate(self.layer_specs) if s.attn_type not in self.served_attn_types]
        if unserved:
            kinds = ", ".join(sorted({self.layer_specs[i].attn_type.value for i in unserved}))
            served = ", ".join(sorted(t.value for t in self.served_attn_types))
            raise NotImplementedError(f"layers {unserved} are {kinds} layers; {type(self).__name__} serves {served} "
                                      "layers only (encoders have no KV cache: EncoderEngine serves encoder-only "
                                      "models, EncoderDecoderEngine encoder-decoder models)")
        self.groups = group_layers(self.layer_specs, DeviceInfo.current(self.device), attention_config)
        # groups whose pages follow the decoder sequence (self-attention); the first one's table is req.blocks
        self.sequence_groups = [g.index for g in self.groups.groups if g.spec.attn_type is AttentionType.DECODER]
        if not self.sequence_groups:
            raise ValueError("the model has no decoder (causal self-attention) layers; the engine generates with them")
        # pages per request a group can need at once: all of a sequence's, or a window's worth
        self.page_caps: list[Optional[int]] = [
            None if g.window is None
            else window_pages_per_request(g.window, config.block_size, config.max_num_batched_tokens)
            for g in self.groups.groups
        ]
        pool_sizes = [0 if not g.spec.attn_type.uses_kv_cache
                      else config.num_blocks if cap is None else min(config.num_blocks, config.max_num_reqs * cap)
                      for g, cap in zip(self.groups.groups, self.page_caps)]
        pages = {g.name: n for g, n in zip(self.groups.groups, pool_sizes)}
        debug = any(g.config.debug for g in self.groups.groups)
        self.builder = GroupedMetadataBuilder(self.groups, self.device, max_num_reqs=config.max_num_reqs,
                                              max_num_tokens=config.max_num_batched_tokens, debug=debug,
                                              num_blocks={name: n for name, n in pages.items() if n})
        self.spec = self.groups.groups[self.sequence_groups[0]].spec
        self.backend = _BackendLabel(",".join(f"{g.name}={g.backend.name}" for g in self.groups.groups))
        self.impls = self.groups.make_impls(self._impl_kwargs)
        self.pools = [BlockAllocator(n) for n in pool_sizes]
        self.allocator = self.pools[self.sequence_groups[0]]
        caches = self.groups.allocate_kv_caches(pages, self.device)
        self.kv_caches = [None if c is None else zero_cache(c) for c in caches]
        self.num_steps = 0
        self.scheduled_tokens: list[int] = []
        self._pages_of: dict[int, list[list[Optional[int]]]] = {}  # request -> per group, page per logical index

    def _impl_kwargs(self, layer: int) -> dict[str, Any]:
        """The model's arguments of layer ``layer``'s impl plus its per-tensor KV scales where its group's cache
        takes them (a layer that ``kv_cache_16bit_layers`` keeps in 16 bits takes none)."""
        spec = self.groups.groups[self.groups.layer_group[layer]].spec
        return {**self.model.impl_kwargs(layer),
                **kv_scale_kwargs(spec, self.config.kv_scales, layer, self.model.num_layers)}

    def _group_need(self, g: int, req: _Request) -> int:
        """Pages of group ``g`` that ``req`` can hold at once: all of its longest sequence's, or a window's worth."""
        pages, cap = self._pages(req.max_len), self.page_caps[g]
        return pages if cap is None else min(pages, cap)

    def _live(self, req: _Request, g: int) -> int:
        return sum(p is not None for p in self._pages_of.get(req.index, [[]] * len(self.pools))[g])

    def _admit(self, waiting: deque, running: list[_Request]) -> None:
        """Like the base engine, per group: a request reserves, in every group's pool, the pages its longest
        sequence can hold at once there."""
        reserved = [sum(self._group_need(g, r) - self._live(r, g) for r in running)
                    for g in range(len(self.pools))]
        while waiting and len(running) < self.config.max_num_reqs:
            needs = [self._group_need(g, waiting[0]) for g in range(len(self.pools))]
            for g, (need, pool) in enumerate(zip(needs, self.pools)):
                if need > pool.num_blocks:
                    raise RuntimeError(f"request {waiting[0].index} needs {need} pages of group "
                                       f"{self.groups.groups[g].name}; its pool has {pool.num_blocks}")
            if any(need > pool.num_free - res for need, pool, res in zip(needs, self.pools, reserved)):
                break
            reserved = [res + need for res, need in zip(reserved, needs)]
            running.append(waiting.popleft())

    def _reserve_pages(self, req: _Request, num_tokens: int) -> None:
        """Free each sliding group's pages wholly before the window of the request's next query (position
        ``req.num_computed``), then allocate the pages ``num_tokens`` tokens need in every group."""
        tables = self._pages_of.setdefault(req.index, [[] for _ in self.pools])
        for g in self.sequence_groups:
            group, pool, pages = self.groups.groups[g], self.pools[g], tables[g]
            if group.window is not None:
                gone = max(0, req.num_computed - group.window + 1) // self.config.block_size
                freed = [p for p in pages[:gone] if p is not None]
                if freed:
                    pool.release(freed)
                    pages[:gone] = [None] * gone
            need = self._pages(num_tokens) - len(pages)
            if need > 0:
                pages += pool.allocate(need)
        req.blocks = [0 if p is None else p for p in tables[self.sequence_groups[0]]]

    def _release_pages(self, req: _Request) -> None:
        for pool, pages in zip(self.pools, self._pages_of.pop(req.index, [])):
            pool.release([p for p in pages if p is not None])
        req.blocks = []

    def _prepare_step(self, batch: list[tuple]) -> tuple:
        """The first sequence group's common metadata built from the requests' page lists, and ``batch`` unchanged.
        Sliding groups rewrite freed pages in place (``req.blocks`` reads them as page 0), which the base engine's
        persistent batch has no update for, so this engine keeps no ``self.batch``."""
        common = build_common_metadata([n for _, n, _ in batch], [req.num_computed for req, _, _ in batch],
                                       [req.blocks for req, _, _ in batch], self.config.block_size, self.device)
        return common, batch

    def _step_commons(self, batch: list[tuple], common) -> list:
        """The common metadata of every group for a decoder step: the first sequence group reads ``common`` (built
        from its pages), every other one the same batch over its own pages; None for the other groups."""
        commons: list = [None] * len(self.pools)
        first, *others = self.sequence_groups
        commons[first] = common
        query_lens = [entry[1] for entry in batch]
        reqs = [entry[0] for entry in batch]
        contexts = [req.num_computed for req in reqs]
        for g in others:
            tables = [[0 if p is None else p for p in self._pages_of[req.index][g]] for req in reqs]
            commons[g] = build_common_metadata(query_lens, contexts, tables, self.config.block_size, self.device)
        return commons

    def _step_attention(self, batch: list[tuple], common) -> GroupedStepAttention:
        """One metadata per group (:meth:`_step_commons`)."""
        return GroupedStepAttention(self, self.builder.build(self._step_commons(batch, common)))
