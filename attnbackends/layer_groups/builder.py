"""One metadata per layer group per step: :class:`GroupedMetadataBuilder` turns a step's one common metadata into
each group's backend metadata (:class:`GroupedMetadata`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from ..interface import AttentionMetadataBuilder, CudaGraphSupport
from ..metadata import CommonAttentionMetadata
from .grouping import LayerGroups
from .window import trim_to_window, window_pages_per_request

logger = logging.getLogger(__name__)


@dataclass
class GroupedMetadata:
    """One step's metadata: ``per_group[g]`` is group g's backend metadata, ``per_layer[i]`` that of layer i's
    group (the same objects), and ``commons[g]`` the common metadata group g was built from (None, in both, for a
    group the step does not run)."""

    per_group: list[Any]
    per_layer: list[Any]
    commons: list[Optional[CommonAttentionMetadata]] = field(repr=False)


class GroupedMetadataBuilder:
    """One metadata builder per group; :meth:`build` makes one metadata per group per step.

    Parameters
    ----------
    groups : the model's layer groups.
    device : where the batch tensors live.
    max_num_reqs, max_num_tokens, debug : passed to every group's builder.
    num_blocks : pages of each group's KV caches, as :meth:`.grouping.LayerGroups.allocate_kv_caches` takes them (one
        count for every group, or one per group name), passed to the builders of the groups with a KV cache: each
        ``build`` then checks the page ids once per step (see
        :class:`~attnbackends.interface.AttentionMetadataBuilder`). None, or a group left out: that group's layers
        check them in every ``forward``.
    builder_kwargs : extra arguments per group name (e.g. ``{"full": {"deterministic": True}}``).
    cudagraph_max_query_len : when set, every sliding-window group owns persistent trim buffers (seq_lens and a
        block table :func:`window_pages_per_request` pages wide for this query length) that every batch with
        ``max_query_len`` up to it is trimmed into. A captured decode step then reads fixed addresses in every
        group: to replay, copy the new batch into the engine's captured common tensors, call :meth:`build` on
        them (the trims and every builder's re-planning write into their persistent buffers), then replay.
    """

    def __init__(
        self,
        groups: LayerGroups,
        device: "torch.device | str" = "cpu",
        *,
        max_num_reqs: int = 256,
        max_num_tokens: int = 8192,
        debug: bool = False,
        num_blocks: "int | Mapping[str, int] | None" = None,
        builder_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
        cudagraph_max_query_len: Optional[int] = None,
    ) -> None:
        self.groups = groups
        self.device = torch.device(device)
        builder_kwargs = dict(builder_kwargs or {})
        names = {g.name for g in groups.groups}
        for what, given in (("builder_kwargs", builder_kwargs),
                            ("num_blocks", num_blocks if isinstance(num_blocks, Mapping) else {})):
            unknown = sorted(set(given) - names)
            if unknown:
                raise ValueError(f"{what} names unknown groups {unknown}")
        self.builders: list[AttentionMetadataBuilder] = []
        for g in groups.groups:
            kwargs = dict(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, debug=debug)
            pages = num_blocks.get(g.name) if isinstance(num_blocks, Mapping) else num_blocks
            if pages is not None and g.spec.attn_type.uses_kv_cache:
                kwargs["num_blocks"] = pages
            kwargs.update(builder_kwargs.get(g.name, {}))
            self.builders.append(g.backend.get_builder_cls()(g.spec, self.device, **kwargs))
        self.reorder_batch_threshold = groups.reorder_batch_threshold
        self._windows = [(g.index, g.window, g.spec.block_size) for g in groups.groups if g.window is not None]
        self._layer_group = list(groups.layer_group)
        self.cudagraph_max_query_len = cudagraph_max_query_len
        self._trim_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if cudagraph_max_query_len is not None:
            for g, window, block_size in self._windows:
                width = window_pages_per_request(window, block_size, cudagraph_max_query_len)
                self._trim_buffers[g] = (
                    torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device),
                    torch.zeros(max_num_reqs, width, dtype=torch.int32, device=self.device),
                )

    def group_commons(
        self, common: "CommonAttentionMetadata | Sequence[Optional[CommonAttentionMetadata]]"
    ) -> list[Optional[CommonAttentionMetadata]]:
        """The common metadata of every group: ``common`` (or ``common[g]`` where the engine keeps one page table per
        group, None for a group the step does not run), trimmed to the window for sliding-window groups."""
        if isinstance(common, CommonAttentionMetadata):
            commons = [common] * len(self.builders)
        else:
            commons = list(common)
            if len(commons) != len(self.builders):
                raise ValueError(f"got {len(commons)} common metadata; the model has {len(self.builders)} groups")
        for g, window, block_size in self._windows:
            c = commons[g]
            if c is None:
                continue
            buffers = self._trim_buffers.get(g)
            if buffers is not None and c.max_query_len > self.cudagraph_max_query_len:
                buffers = None
            commons[g] = trim_to_window(c, window, block_size, out=buffers)
        return commons

    def _assemble(self, metas: list[Any], commons: list[CommonAttentionMetadata]) -> GroupedMetadata:
        return GroupedMetadata(metas, [metas[g] for g in self._layer_group], commons)

    def build(self, common: "CommonAttentionMetadata | Sequence[Optional[CommonAttentionMetadata]]") -> GroupedMetadata:
        """One metadata per group for this batch (see :meth:`group_commons` for ``common``). A group given None gets
        None: a step that runs only some groups (an encoder-decoder model's encoder pass, its decoder steps) builds
        only theirs."""
        commons = self.group_commons(common)
        return self._assemble([None if c is None else b.build(c) for b, c in zip(self.builders, commons)], commons)

    def build_for_cudagraph_capture(
        self, common: "CommonAttentionMetadata | Sequence[CommonAttentionMetadata]"
    ) -> GroupedMetadata:
        """Metadata for a capture-time batch: every group's ``build_for_cudagraph_capture``. Needs
        ``cudagraph_max_query_len`` (persistent trim buffers) when the model has sliding-window groups."""
        if self._windows and self.cudagraph_max_query_len is None:
            raise ValueError("capturing sliding-window groups needs cudagraph_max_query_len (persistent trim buffers)")
        unsupported = [g.name for g in self.groups.groups if g.backend.cudagraph_support == CudaGraphSupport.NEVER]
        if unsupported:
            raise ValueError(f"groups {unsupported} use backends without CUDA-graph support")
        commons = self.group_commons(common)
        metas = [None if c is None else b.build_for_cudagraph_capture(c) for b, c in zip(self.builders, commons)]
        return self._assemble(metas, commons)
