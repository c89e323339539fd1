"""A compact paged inference engine over the registry: the integration example behind `attnbackends demo`.

``PagedEngine`` serves any :class:`EngineModel`: the built-in :class:`TinyLlama`, or a Hugging Face ``transformers``
model (adapters and seeded fixtures in the checkout's ``examples/engine/hf_models``).
"""

from .engine import BlockAllocator, EngineConfig, EngineModel, GenerationResult, PagedEngine, StepAttention
from .groups import GroupedEngineModel, GroupedPagedEngine, GroupedStepAttention
from .hybrid_model import TinyHybrid, TinyHybridConfig
from .model import TinyLlama, TinyLlamaConfig

__all__ = [
    "BlockAllocator",
    "EngineConfig",
    "EngineModel",
    "GenerationResult",
    "PagedEngine",
    "StepAttention",
    "GroupedEngineModel",
    "GroupedPagedEngine",
    "GroupedStepAttention",
    "TinyHybrid",
    "TinyHybridConfig",
    "TinyLlama",
    "TinyLlamaConfig",
]
