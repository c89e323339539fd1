"""A compact paged inference engine over the registry: the integration example behind `attnbackends demo`.

``PagedEngine`` serves any :class:`EngineModel`: the built-in :class:`TinyLlama` or :class:`TinyDeepseekSparse`
(DeepSeek-V3.2-shaped, sparse MLA), or a Hugging Face ``transformers``
model (adapters and seeded fixtures in the checkout's ``examples/engine/hf_models``). ``GroupedPagedEngine`` serves
models whose layers differ (one backend per layer group), ``EncoderEngine`` encoder-only models (BERT-style) and
``EncoderDecoderEngine`` encoder-decoder models (Whisper-style; adapters in the checkout's
``examples/hf_encoder_models.py``). Masks beyond causal (docs/MASKS.md): ``PagedEngine.generate(..., spans=...)``
serves image spans on a ``causal_spans`` model, :func:`block_diffusion_generate` block-diffusion decoding on a
``block_causal`` one. ``EngineConfig(kv_cache_dtype=...)`` stores the KV cache quantised (docs/KV_FORMATS.md);
:func:`teacher_forced_agreement` measures how often two engines' greedy tokens agree.
"""

from .agreement import TokenAgreement, teacher_forced_agreement, token_agreement
from .block_diffusion import block_diffusion_generate
from .encoder import EncoderEngine, EncoderEngineModel
from .encoder_decoder import EncoderDecoderEngine, EncoderDecoderEngineModel
from .engine import BlockAllocator, EngineConfig, EngineModel, GenerationResult, PagedEngine, StepAttention
from .groups import GroupedEngineModel, GroupedPagedEngine, GroupedStepAttention
from .hybrid_model import TinyHybrid, TinyHybridConfig
from .kv_cache import calibrated_kv_scales
from .model import TinyLlama, TinyLlamaConfig
from .sparse_mla_model import TinyDeepseekSparse, TinyDeepseekSparseConfig

__all__ = [
    "BlockAllocator",
    "EncoderDecoderEngine",
    "EncoderDecoderEngineModel",
    "EncoderEngine",
    "EncoderEngineModel",
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
    "TinyDeepseekSparse",
    "TinyDeepseekSparseConfig",
    "TinyLlama",
    "TinyLlamaConfig",
    "TokenAgreement",
    "block_diffusion_generate",
    "calibrated_kv_scales",
    "teacher_forced_agreement",
    "token_agreement",
]
