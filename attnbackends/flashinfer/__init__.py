"""FlashInfer backend: an adapter over flashinfer's plan()/run() wrappers (imported lazily: this package imports,
and reports "flashinfer is not installed", on machines without flashinfer)."""

from .backend import FlashInferBackend, FlashInferImpl, FlashInferMetadata, FlashInferMetadataBuilder, PlanKey
from .cascade import CascadePolicy, cascade_prefix_blocks
from ..ops.flashinfer.plan_inputs import PagedKVPlanInputs, paged_kv_plan_inputs, shared_prefix_blocks
from .warmup import precompile

__all__ = [
    "CascadePolicy",
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "PagedKVPlanInputs",
    "PlanKey",
    "cascade_prefix_blocks",
    "paged_kv_plan_inputs",
    "precompile",
    "shared_prefix_blocks",
]
