"""Grouping a model's layers by spec, one backend per group (:func:`group_layers`), and the explanation of that
choice per group (:func:`explain_layers`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..interface import AttentionBackend, AttentionImpl, CudaGraphSupport
from ..platform import DeviceInfo
from ..selection.registry import (
    BackendNotSupportedError,
    Explanation,
    explain,
    get_backend_class,
)
from ..spec import AttentionConfig, AttentionSpec, AttentionType
from .config import LayerGroupsConfig

logger = logging.getLogger(__name__)


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
        elif len({s.kv_cache_dtype for s in same}) == len(same):
            names.append(base if spec.kv_cache_dtype in ("auto", "float16", "bfloat16") else
                         f"{base}_{spec.kv_cache_dtype}")
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
                f"group {group.name}: layers {format_layers(group.layers)}, backend {group.backend.name}\n"
                + "\n".join("  " + line for line in str(group.explanation).splitlines())
            )
        return "\n".join(lines)


def format_layers(layers: Sequence[int]) -> str:
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
            raise ValueError(f"layers {format_layers(layers)} of group {name!r} are pinned by range to "
                             f"{pin.backend!r} and by name to {by_name.backend!r}")
        split = sum(1 for s, _ in parts if s == spec) > 1
        chosen = pin or by_name or config.default
        out.append((f"{name}:{chosen.backend}" if split else name, spec, tuple(layers), chosen))
    return out


def explain_groups(
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
    specs = config.apply_kv_cache_overrides(specs)
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
    rows, _, _ = explain_groups(specs, device, config)
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
    rows, layer_group, device = explain_groups(specs, device, config)
    groups = []
    for index, (name, spec, layers, cfg, ex) in enumerate(rows):
        if ex.chosen is None:
            what = (f"the requested backend {ex.requested!r} cannot" if ex.requested != "auto"
                    else "no registered backend can")
            raise BackendNotSupportedError(
                f"layer group {name!r} (layers {format_layers(layers)}): {what} serve its spec", ex)
        backend = get_backend_class(ex.chosen)
        if ex.requested == "auto" and backend.name in ("reference", "reference_mla") and device.is_cuda:
            logger.warning("layer group %s: no fast backend fits; using the slow reference backend", name)
        groups.append(LayerGroup(index, name, spec, layers, backend, cfg, ex))
    return LayerGroups(groups, layer_group, device)
