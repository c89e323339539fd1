"""A compact paged inference engine over the registry: the integration example behind `attnbackends demo`."""

from .engine import EngineConfig, GenerationResult, PagedEngine
from .model import TinyLlama, TinyLlamaConfig

__all__ = ["EngineConfig", "GenerationResult", "PagedEngine", "TinyLlama", "TinyLlamaConfig"]
