"""Layer groups: models whose attention layers differ (interleaved sliding-window and global layers, per-layer head
sizes, encoders beside decoders).

An engine describes its model as one :class:`~attnbackends.AttentionSpec` per layer. :func:`group_layers` puts
layers with equal specs into one :class:`LayerGroup` (named after its spec: ``"sliding_1024"``, ``"full"``, ...),
selects a backend per group through the registry (each group keeps its :class:`~attnbackends.Explanation`) and
applies the user's per-group pins (:class:`LayerGroupsConfig`: by group name or by layer index range, from YAML).
:class:`GroupedMetadataBuilder` then turns each step's one :class:`~attnbackends.CommonAttentionMetadata` into one
backend metadata per group, and :meth:`LayerGroups.make_impls` makes the impl of every layer.

Sliding-window groups read fewer pages (:func:`trim_to_window`): attention depends on positions only through the
distance ``j - p`` (causal mask, window, ALiBi) and RoPE is applied before keys are cached, so dropping the
``k`` leading pages of a request that no query of the step can see, and shifting that request's sequence length
down by ``k * block_size``, gives exactly the same output with a narrower block table.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport
from .metadata import CommonAttentionMetadata
from .platform import DeviceInfo
from .registry import BackendNotSupportedError, Explanation, explain, get_backend_class
from .spec import AttentionConfig, AttentionSpec, AttentionType, read_config_file

__all__ = [
    "GroupedMetadata",
    "GroupedMetadataBuilder",
    "LayerGroup",
    "LayerGroups",
    "LayerGroupsConfig",
    "LayerRangePin",
    "explain_layers",
    "group_layers",
    "parse_layer_ranges",
    "read_layer_specs",
    "trim_to_window",
    "window_pages_per_request",
]

logger = logging.getLogger(__name__)


def parse_layer_ranges(text: Union[str, int, Sequence[int]]) -> tuple[int, ...]:
    """Layer indices of ``"0-3,8"`` (ranges inclusive), an int or a list of ints, sorted and unique."""
    if isinstance(text, int):
        values = [text]
    elif isinstance(text, str):
        values = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                start, stop = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"layer range {part!r} is not 'N' or 'N-M' (inclusive), in {text!r}") from None
            if stop < start:
                raise ValueError(f"layer range {part!r} ends before it starts")
            values += range(start, stop + 1)
    else:
        values = [int(v) for v in text]
    if not values or min(values) < 0:
        raise ValueError(f"layers {text!r} must name at least one layer index >= 0")
    return tuple(sorted(set(values)))


def _as_attention_config(value: Any) -> Any:
    return {"backend": value} if isinstance(value, str) else value


class LayerRangePin(BaseModel):
    """A backend choice for the layers ``layers`` ("0-3,8": inclusive ranges, or a list of indices)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, ...]
    backend: AttentionConfig

    @field_validator("layers", mode="before")
    @classmethod
    def _parse_layers(cls, value: Any) -> tuple[int, ...]:
        return parse_layer_ranges(value)

    @field_validator("backend", mode="before")
    @classmethod
    def _backend(cls, value: Any) -> Any:
        return _as_attention_config(value)


class LayerGroupsConfig(BaseModel):
    """Backend choices of a model with layer groups.

    ``default`` applies to every group; ``groups`` pins a group by name (``{"sliding_1024": "triton"}`` or a full
    :class:`~attnbackends.AttentionConfig` mapping); ``layers`` pins layer index ranges. Layers of one spec that
    different range pins send to different backends form separate groups. Pinning a layer both by range and by its
    group's name to different backends is an error. YAML (see :meth:`from_file`)::

        attention: {backend: auto}          # the default
        layer_groups:
          groups: {sliding_1024: triton, full: reference}
          layers:
            - {layers: "0-3", backend: triton}
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: AttentionConfig = Field(default_factory=AttentionConfig)
    groups: dict[str, AttentionConfig] = Field(default_factory=dict)
    layers: tuple[LayerRangePin, ...] = ()

    @field_validator("default", mode="before")
    @classmethod
    def _default(cls, value: Any) -> Any:
        return _as_attention_config(value)

    @field_validator("groups", mode="before")
    @classmethod
    def _groups(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"groups must map group names to backends, got {type(value).__name__}")
        return {str(k): _as_attention_config(v) for k, v in value.items()}

    @classmethod
    def from_file(cls, path: "str | os.PathLike") -> "LayerGroupsConfig":
        """Read the ``attention:`` section (the default) and the ``layer_groups:`` section of a YAML/JSON file."""
        data = read_config_file(path)
        groups = data.get("layer_groups") or {}
        if not isinstance(groups, dict):
            raise ValueError(f"layer_groups in {path} must be a mapping, got {type(groups).__name__}")
        return cls.model_validate({"default": data.get("attention", {}), **groups})


def read_layer_specs(path: "str | os.PathLike") -> list[AttentionSpec]:
    """A model's per-layer specs from the ``layers:`` list of a ``.yaml``/``.yml``/``.json`` file (the file may
    also hold the ``attention:`` and ``layer_groups:`` sections :meth:`LayerGroupsConfig.from_file` reads)::

        layer_defaults: {num_heads: 8, num_kv_heads: 8, head_size: 64, dtype: bfloat16}
        layers:
          - {attn_type: encoder, count: 4}      # layers 0-3
          - {attn_type: decoder, count: 4}      # layers 4-7
          - {attn_type: encoder_decoder, count: 4}

    Each entry is an :class:`~attnbackends.AttentionSpec` mapping over ``layer_defaults`` (its own fields win);
    ``count`` (default 1) repeats it. ValueError names the entry and the field for anything invalid."""
    data = read_config_file(path)
    entries, defaults = data.get("layers"), data.get("layer_defaults") or {}
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path} needs a non-empty `layers:` list of layer specs (mappings)")
    if not isinstance(defaults, dict):
        raise ValueError(f"layer_defaults in {path} must be a mapping of AttentionSpec fields")
    specs: list[AttentionSpec] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"layers[{i}] in {path} must be a mapping of AttentionSpec fields, got {entry!r}")
        fields = {**defaults, **entry}
        count = fields.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"layers[{i}].count in {path} must be a positive integer, got {count!r}")
        try:
            spec = AttentionSpec.model_validate(fields)
        except ValidationError as exc:
            why = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                            if e["loc"] else e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise ValueError(f"layers[{i}] in {path}: {why}") from None
        specs += [spec] * count
    return specs


@dataclass
class LayerGroup:
    """Layers sharing one spec and one backend.

    Attributes
    ----------
    index : position in :attr:`LayerGroups.groups`.
    name : "full", "sliding_<window>", "encoder", "cross" (a suffix tells apart groups that would share a name).
    layers : the model's layer indices in this group, ascending.
    config : the configuration its backend was selected with (the group's pin, else the default).
    explanation : the registry's explanation of the choice (``str()`` prints the table).
    """

    index: int
    name: str
    spec: AttentionSpec
    layers: tuple[int, ...]
    backend: type[AttentionBackend]
    config: AttentionConfig
    explanation: Explanation

    @property
    def window(self) -> Optional[int]:
        return self.spec.sliding_window


def _base_name(spec: AttentionSpec) -> str:
    if spec.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
        return "encoder"
    if spec.attn_type is AttentionType.ENCODER_DECODER:
        return "cross"
    return f"sliding_{spec.sliding_window}" if spec.sliding_window is not None else "full"


def _distinct_names(specs: list[AttentionSpec]) -> list[str]:
    """One name per distinct spec: the base name, plus the head size or a counter where bases collide."""
    bases = [_base_name(s) for s in specs]
    names = []
    for spec, base in zip(specs, bases):
        same = [s for s, b in zip(specs, bases) if b == base]
        if len(same) == 1:
            names.append(base)
        elif len({s.head_size for s in same}) == len(same):
            names.append(f"{base}_h{spec.head_size}")
        else:
            names.append(f"{base}_{same.index(spec)}" if same.index(spec) else base)
    return names


@dataclass
class LayerGroups:
    """A model's layers partitioned into groups, each with its backend.

    Attributes
    ----------
    groups : in order of each group's first layer.
    layer_group : [num_layers] the group index of every layer.
    device : the device the backends were selected for.
    """

    groups: list[LayerGroup]
    layer_group: list[int]
    device: DeviceInfo

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def __getitem__(self, name: str) -> LayerGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"no layer group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    def spec_of(self, layer: int) -> AttentionSpec:
        return self.groups[self.layer_group[layer]].spec

    def backend_of(self, layer: int) -> type[AttentionBackend]:
        return self.groups[self.layer_group[layer]].backend

    @property
    def cudagraph_support(self) -> CudaGraphSupport:
        """What a CUDA graph of a whole step may hold: the least any group's backend supports."""
        return min((g.backend.cudagraph_support for g in self.groups), default=CudaGraphSupport.NEVER)

    @property
    def reorder_batch_threshold(self) -> int:
        """Decode threshold every group's builder accepts; groups that disagree need batches ordered by query
        length (which satisfies every threshold)."""
        return max(g.backend.get_builder_cls().reorder_batch_threshold for g in self.groups)

    def make_impls(
        self, impl_kwargs: Optional[Callable[[int], dict[str, Any]]] = None, **common_kwargs: Any
    ) -> list[AttentionImpl]:
        """One impl per layer, of its group's backend; ``impl_kwargs(layer)`` adds per-layer arguments (sinks,
        ``kv_b_proj``), ``common_kwargs`` those every layer shares (``debug``)."""
        impls = []
        for layer, g in enumerate(self.layer_group):
            group = self.groups[g]
            kwargs = {**common_kwargs, **(impl_kwargs(layer) if impl_kwargs is not None else {})}
            impls.append(group.backend.get_impl_cls()(group.spec, **kwargs))
        return impls

    def allocate_kv_caches(
        self, num_blocks: "int | Mapping[str, int]", device: "torch.device | str" = "cpu"
    ) -> list[Optional[torch.Tensor]]:
        """One cache per layer in its backend's layout (None for layers without a cache); ``num_blocks`` per group
        name or one count for all."""
        caches: list[Optional[torch.Tensor]] = []
        for g in self.layer_group:
            group = self.groups[g]
            if not group.spec.attn_type.uses_kv_cache:
                caches.append(None)
                continue
            n = num_blocks[group.name] if isinstance(num_blocks, Mapping) else num_blocks
            caches.append(group.backend.allocate_kv_cache(n, group.spec, device))
        return caches

    def __str__(self) -> str:
        lines = []
        for group in self.groups:
            lines.append(
                f"group {group.name}: layers {_format_layers(group.layers)}, backend {group.backend.name}\n"
                + "\n".join("  " + line for line in str(group.explanation).splitlines())
            )
        return "\n".join(lines)


def _format_layers(layers: Sequence[int]) -> str:
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def _partition(
    specs: Sequence[AttentionSpec], config: LayerGroupsConfig
) -> list[tuple[str, AttentionSpec, tuple[int, ...], AttentionConfig]]:
    """(name, spec, layers, config) per group, checking every pin against the model."""
    num_layers = len(specs)
    layer_pin: dict[int, AttentionConfig] = {}
    for pin in config.layers:
        for layer in pin.layers:
            if layer >= num_layers:
                raise ValueError(f"layer_groups.layers pins layer {layer}; the model has layers 0-{num_layers - 1}")
            if layer in layer_pin and layer_pin[layer] != pin.backend:
                raise ValueError(f"layer {layer} is pinned to two backends: {layer_pin[layer].backend!r} and "
                                 f"{pin.backend.backend!r}")
            layer_pin[layer] = pin.backend
    distinct = list(dict.fromkeys(specs))
    names = dict(zip(distinct, _distinct_names(distinct)))
    unknown = sorted(set(config.groups) - set(names.values()))
    if unknown:
        raise ValueError(f"layer_groups.groups names unknown groups {unknown}; this model's groups: "
                         f"{', '.join(names[s] for s in distinct)}")
    parts: dict[tuple[AttentionSpec, Optional[AttentionConfig]], list[int]] = {}
    for layer, spec in enumerate(specs):
        parts.setdefault((spec, layer_pin.get(layer)), []).append(layer)
    out = []
    for (spec, pin), layers in parts.items():
        name = names[spec]
        by_name = config.groups.get(name)
        if pin is not None and by_name is not None and pin != by_name:
            raise ValueError(f"layers {_format_layers(layers)} of group {name!r} are pinned by range to "
                             f"{pin.backend!r} and by name to {by_name.backend!r}")
        split = sum(1 for s, _ in parts if s == spec) > 1
        chosen = pin or by_name or config.default
        out.append((f"{name}:{chosen.backend}" if split else name, spec, tuple(layers), chosen))
    return out


def _explain_groups(
    specs: Sequence[AttentionSpec], device: Optional[DeviceInfo], config: "LayerGroupsConfig | AttentionConfig | None"
) -> tuple[list[tuple[str, AttentionSpec, tuple[int, ...], AttentionConfig, Explanation]], list[int], DeviceInfo]:
    if not specs:
        raise ValueError("specs must hold one AttentionSpec per layer; got none")
    for i, spec in enumerate(specs):
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"specs[{i}] is a {type(spec).__name__}, not an AttentionSpec")
    if config is None:
        config = LayerGroupsConfig()
    elif isinstance(config, AttentionConfig):
        config = LayerGroupsConfig(default=config)
    device = device or DeviceInfo.current()
    rows, layer_group = [], [0] * len(specs)
    for index, (name, spec, layers, cfg) in enumerate(_partition(specs, config)):
        rows.append((name, spec, layers, cfg, explain(spec, device, cfg)))
        for layer in layers:
            layer_group[layer] = index
    return rows, layer_group, device


def explain_layers(
    specs: Sequence[AttentionSpec],
    device: Optional[DeviceInfo] = None,
    config: "LayerGroupsConfig | AttentionConfig | None" = None,
) -> dict[str, Explanation]:
    """The registry's explanation for every group of ``specs`` (by group name); never raises for a group that no
    backend fits (its explanation's ``chosen`` is None)."""
    rows, _, _ = _explain_groups(specs, device, config)
    return {name: ex for name, _, _, _, ex in rows}


def group_layers(
    specs: Sequence[AttentionSpec],
    device: Optional[DeviceInfo] = None,
    config: "LayerGroupsConfig | AttentionConfig | None" = None,
) -> LayerGroups:
    """Group the layers of a model by spec and select a backend per group.

    Parameters
    ----------
    specs : one spec per layer, in layer order.
    device : the device to select for (default: the current one).
    config : a :class:`LayerGroupsConfig`, or one :class:`~attnbackends.AttentionConfig` for every group.

    Raises
    ------
    BackendNotSupportedError
        naming the group whose spec no backend (or not its pinned one) can serve, with the reasons.
    ValueError
        for pins that name unknown groups, layers outside the model or conflicting backends.
    """
    rows, layer_group, device = _explain_groups(specs, device, config)
    groups = []
    for index, (name, spec, layers, cfg, ex) in enumerate(rows):
        if ex.chosen is None:
            what = f"the requested backend {ex.requested!r}" if ex.requested != "auto" else "no registered backend"
            raise BackendNotSupportedError(
                f"layer group {name!r} (layers {_format_layers(layers)}): {what} can serve its spec", ex)
        backend = get_backend_class(ex.chosen)
        if ex.requested == "auto" and backend.name in ("reference", "reference_mla") and device.is_cuda:
            logger.warning("layer group %s: no fast backend fits; using the slow reference backend", name)
        groups.append(LayerGroup(index, name, spec, layers, backend, cfg, ex))
    return LayerGroups(groups, layer_group, device)


def window_pages_per_request(window: int, block_size: int, max_query_len: int) -> int:
    """The most pages a request of a ``window``-token sliding layer needs in one step of up to ``max_query_len``
    new tokens, after :func:`trim_to_window`: the window of the step's first query starts inside the first kept
    page, so at most ``window - 1 + block_size - 1`` context tokens plus the new ones remain."""
    return -(-(window + block_size + max_query_len - 2) // block_size)


def _dropped_pages(seq_lens: torch.Tensor, query_lens: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """[num_reqs] pages wholly before the window of each request's first new query (position = its context)."""
    first_visible = seq_lens - query_lens - (window - 1)
    return torch.div(first_visible.clamp(min=0), block_size, rounding_mode="floor")


def trim_to_window(
    common: CommonAttentionMetadata,
    window: int,
    block_size: int,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> CommonAttentionMetadata:
    """The batch as a sliding-window layer of ``window`` keys needs it, with the pages nobody sees dropped.

    For request r with context C (its first new query sits at position C) the keys visible to any of its queries
    are j >= C - window + 1, so its first ``k_r = max(0, C - window + 1) // block_size`` pages are wholly outside
    every query's window. The result keeps everything else and changes:

    - ``block_table[r]`` starts at the request's page ``k_r`` (row r = old row r shifted left by ``k_r``);
    - ``seq_lens[r]`` becomes ``seq_len - k_r * block_size`` (so positions shift down by the same amount; the
      window, the causal mask and ALiBi see only distances, RoPE is already in the cached keys, so outputs are
      unchanged);
    - ``max_seq_len`` and the host copies follow; ``query_start_loc``, ``slot_mapping`` (physical slots) and
      ``causal`` are untouched.

    The new table is ``min(old width, needed)`` pages wide (needed: the longest trimmed request), and columns past
    a request's pages repeat its last entries (in range; no backend reads them). The device part is a few torch
    ops on the device tensors (no host-device sync); the host copies are computed on the host.

    Parameters
    ----------
    out : persistent (seq_lens [>= num_reqs] int32, block_table [>= num_reqs, width] int32) device buffers to
        write into (CUDA graphs replay on fixed addresses); the table then has the buffer's width, which must be
        at least :func:`window_pages_per_request` of the batch's ``max_query_len``.
    """
    if window <= 0 or block_size <= 0:
        raise ValueError(f"window ({window}) and block_size ({block_size}) must be positive")
    n = common.num_reqs
    qsl_cpu = common.query_start_loc_cpu
    drop_cpu = _dropped_pages(common.seq_lens_cpu[:n], qsl_cpu[1:] - qsl_cpu[:-1], window, block_size)
    seq_lens_cpu = (common.seq_lens_cpu[:n] - drop_cpu * block_size).to(torch.int32)
    old_width = common.block_table.shape[1]
    needed = int((seq_lens_cpu + block_size - 1).div(block_size, rounding_mode="floor").max()) if n else 0
    if out is not None:
        seq_buf, table_buf = out
        width = table_buf.shape[1]
        if width < needed:
            raise ValueError(f"the trim buffer holds {width} pages per request; this batch needs {needed}")
    else:
        width = max(1, min(old_width, needed))
    qsl = common.query_start_loc
    drop = _dropped_pages(common.seq_lens[:n], qsl[1 : n + 1] - qsl[:n], window, block_size)
    columns = torch.arange(width, device=drop.device, dtype=torch.int64)
    index = (drop.long()[:, None] + columns[None, :]).clamp_(max=old_width - 1)  # [n, width]
    if out is not None:
        seq_lens = torch.sub(common.seq_lens[:n], drop * block_size, out=seq_buf[:n])
        block_table = torch.gather(common.block_table[:n], 1, index, out=table_buf[:n])
    else:
        seq_lens = (common.seq_lens[:n] - drop * block_size).to(torch.int32)
        block_table = torch.gather(common.block_table[:n], 1, index)
    table_cpu = None
    if common.block_table_cpu is not None:
        index_cpu = (drop_cpu.long()[:, None] + torch.arange(width)[None, :]).clamp_(max=old_width - 1)
        table_cpu = torch.gather(common.block_table_cpu[:n], 1, index_cpu)
    return dataclasses.replace(
        common,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        block_table=block_table,
        block_table_cpu=table_cpu,
        max_seq_len=int(seq_lens_cpu.max()) if n else 0,
    )


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
        builder_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
        cudagraph_max_query_len: Optional[int] = None,
    ) -> None:
        self.groups = groups
        self.device = torch.device(device)
        builder_kwargs = dict(builder_kwargs or {})
        unknown = sorted(set(builder_kwargs) - {g.name for g in groups.groups})
        if unknown:
            raise ValueError(f"builder_kwargs names unknown groups {unknown}")
        self.builders: list[AttentionMetadataBuilder] = [
            g.backend.get_builder_cls()(g.spec, self.device, max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                                        debug=debug, **builder_kwargs.get(g.name, {}))
            for g in groups.groups
        ]
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
