"""Hugging Face ``transformers`` models served on the paged engine (:mod:`attnbackends.engine`), and the seeded
fixtures that compare the engine with transformers' own ``generate`` (used by ``examples/engine/generate.py`` and
``tests/test_engine_hf.py``; needs ``transformers``)."""

from .hf import HFComparison, build_hf_model, compare_with_transformers, transformers_greedy, wrap_hf_model
from .hf_deepseek import HFDeepseekV3Model
from .hf_llama import HFLlamaModel

__all__ = [
    "HFDeepseekV3Model",
    "HFComparison",
    "HFLlamaModel",
    "build_hf_model",
    "compare_with_transformers",
    "transformers_greedy",
    "wrap_hf_model",
]
