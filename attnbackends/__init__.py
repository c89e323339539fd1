"""attnbackends: pluggable, tested paged-KV attention backends for LLM inference engines.

An engine describes a layer once (:class:`AttentionSpec`), asks :func:`select` for a backend, and drives the
backend's metadata builder (once per batch) and impl (once per layer).
"""

from importlib import metadata as _metadata

from .interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport, QueryLenSupport
from .layer_groups import (
    GroupedMetadata,
    GroupedMetadataBuilder,
    LayerGroup,
    LayerGroups,
    LayerGroupsConfig,
    explain_layers,
    group_layers,
    trim_to_window,
)
from .metadata import (
    CommonAttentionMetadata,
    DecodePrefillSplit,
    build_common_metadata,
    build_cross_attention_metadata,
    decode_first_order,
    encoder_slot_mapping,
    split_decodes_and_prefills,
    validate_common_metadata,
)
from .persistent_batch import PersistentBatch
from .platform import DeviceInfo
from .selection.registry import (
    BackendNotSupportedError,
    Explanation,
    backend_names,
    explain,
    get_backend_class,
    priority_list,
    register_backend,
    select,
    unregister_backend,
)
from .spec import BACKEND_ENV_VAR, AttentionConfig, AttentionSpec, AttentionType, SparseIndexerSpec

# pyproject.toml's version as installed: one source, which tune profile keys read too (through importlib.metadata:
# a module of the package importing this one would close an import loop)
try:
    __version__ = _metadata.version("attnbackends")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "CudaGraphSupport",
    "QueryLenSupport",
    "CommonAttentionMetadata",
    "GroupedMetadata",
    "GroupedMetadataBuilder",
    "LayerGroup",
    "LayerGroups",
    "LayerGroupsConfig",
    "explain_layers",
    "group_layers",
    "trim_to_window",
    "DecodePrefillSplit",
    "build_common_metadata",
    "build_cross_attention_metadata",
    "decode_first_order",
    "encoder_slot_mapping",
    "split_decodes_and_prefills",
    "validate_common_metadata",
    "PersistentBatch",
    "DeviceInfo",
    "BackendNotSupportedError",
    "Explanation",
    "backend_names",
    "explain",
    "get_backend_class",
    "priority_list",
    "register_backend",
    "select",
    "unregister_backend",
    "BACKEND_ENV_VAR",
    "AttentionConfig",
    "AttentionSpec",
    "SparseIndexerSpec",
    "AttentionType",
]
