"""Layer groups: models whose attention layers differ (interleaved sliding-window and global layers, per-layer head
sizes, encoders beside decoders).

An engine describes its model as one :class:`~attnbackends.AttentionSpec` per layer. :func:`group_layers` puts
layers with equal specs into one :class:`LayerGroup` (named after its spec: ``"sliding_1024"``, ``"full"``, ...),
selects a backend per group through the registry (each group keeps its :class:`~attnbackends.Explanation`) and
applies the user's per-group pins (:class:`LayerGroupsConfig`: by group name or by layer index range, from YAML).
:class:`GroupedMetadataBuilder` then turns each step's one :class:`~attnbackends.CommonAttentionMetadata` into one
backend metadata per group, and :meth:`LayerGroups.make_impls` makes the impl of every layer. Sliding-window groups
read only the pages their window can reach (:func:`trim_to_window`).

Modules: :mod:`.config` (pins, model files), :mod:`.grouping` (grouping, selection, explanation), :mod:`.window`
(window trimming), :mod:`.builder` (the grouped builder).
"""

from .builder import GroupedMetadata, GroupedMetadataBuilder
from .config import (
    LayerGroupsConfig,
    LayerRangePin,
    parse_layer_ranges,
    read_layer_specs,
)
from .grouping import (
    LayerGroup,
    LayerGroups,
    explain_groups,
    explain_layers,
    format_layers,
    group_layers,
)
from .window import trim_to_window, window_pages_per_request

__all__ = [
    "GroupedMetadata",
    "GroupedMetadataBuilder",
    "LayerGroup",
    "LayerGroups",
    "LayerGroupsConfig",
    "LayerRangePin",
    "explain_groups",
    "explain_layers",
    "format_layers",
    "group_layers",
    "parse_layer_ranges",
    "read_layer_specs",
    "trim_to_window",
    "window_pages_per_request",
]
