"""A compact paged inference engine over the registry: the integration example behind `attnbackends demo`.

``PagedEngine`` serves any :class:`EngineModel`: the built-in :class:`TinyLlama`, or a Hugging Face ``transformers``
model through :class:`HFLlamaModel` / :class:`HFDeepseekV3Model` (see :mod:`attnbackends.engine.hf` for building a
small seeded one and comparing with transformers' ``generate``; transformers is needed only there).
"""

from .engine import BlockAllocator, EngineConfig, EngineModel, GenerationResult, PagedEngine, StepAttention
from .groups import GroupedEngineModel, GroupedPagedEngine, GroupedStepAttention
from .hybrid_model import TinyHybrid, TinyHybridConfig
from .hf import HFComparison, build_hf_model, compare_with_transformers, transformers_greedy, wrap_hf_model
from .hf_deepseek import HFDeepseekV3Model
from .hf_llama import HFLlamaModel
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
    "HFLlamaModel",
    "HFDeepseekV3Model",
    "HFComparison",
    "build_hf_model",
    "compare_with_transformers",
    "transformers_greedy",
    "wrap_hf_model",
]
