"""flash_attn backend: flash-attn's paged varlen forward over our cache (flash-attn is imported lazily: this package
imports, and reports "flash-attn is not installed", on machines without it)."""

from .backend import (
    GENERATION_CAPABILITIES,
    FlashAttnBackend,
    FlashAttnImpl,
    FlashAttnMetadata,
    FlashAttnMetadataBuilder,
    GenerationCapabilities,
)
from .library import FlashAttnInstall, installed_flash_attn

__all__ = [
    "GENERATION_CAPABILITIES",
    "FlashAttnBackend",
    "FlashAttnImpl",
    "FlashAttnInstall",
    "FlashAttnMetadata",
    "FlashAttnMetadataBuilder",
    "GenerationCapabilities",
    "installed_flash_attn",
]
