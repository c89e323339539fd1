"""What an attention layer needs (:class:`AttentionSpec`) and what the user asks for (:class:`AttentionConfig`).

Both are frozen pydantic models: invalid values and combinations raise a ``pydantic.ValidationError`` (a subclass
of ``ValueError``) whose message names the field and the allowed values.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AttentionMask",
    "AttentionType",
    "MaskKind",
    "AttentionSpec",
    "AttentionConfig",
    "SparseIndexerSpec",
    "KV_CACHE_DTYPES",
    "DTYPES",
    "BACKEND_ENV_VAR",
    "MAX_BLOCK_SIZE",
    "dtype_name",
    "torch_dtype_of",
    "kv_cache_torch_dtype",
    "KVCacheFormat",
    "QUANTIZED_KV_CACHE_DTYPES",
    "kv_cache_format",
]

BACKEND_ENV_VAR = "ATTNBACKENDS_BACKEND"

#: The largest KV-cache page, in tokens: larger pages waste memory on every request's last page and exceed what
#: the kernels tile.
MAX_BLOCK_SIZE = 1024

DTYPES = ("float16", "bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")  # extended below (formats)

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_FP8_TORCH_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class AttentionType(str, Enum):
    """Which tokens a query may see and whether a KV cache is involved."""

    DECODER = "decoder"  # causal self-attention over a paged KV cache
    ENCODER = "encoder"  # bidirectional self-attention of an encoder-decoder model, no KV cache
    ENCODER_ONLY = "encoder_only"  # bidirectional self-attention (BERT-like), no KV cache
    ENCODER_DECODER = "encoder_decoder"  # cross-attention: decoder queries over encoder keys, non-causal, cached

    @property
    def is_causal(self) -> bool:
        return self is AttentionType.DECODER

    @property
    def uses_kv_cache(self) -> bool:
        return self in (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


def torch_dtype_of(name: "str | torch.dtype") -> torch.dtype:
    """torch dtype of a model dtype name ("float16", "bfloat16", "float32", or an alias such as "bf16")."""
    return _TORCH_DTYPES[dtype_name(name)]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: str) -> torch.dtype:
    """torch dtype the KV cache is stored in: the model dtype for "auto", else the named one."""
    if kv_cache_dtype == "auto":
        return _TORCH_DTYPES[model_dtype]
    if kv_cache_dtype in _FP8_TORCH_DTYPES:
        return _FP8_TORCH_DTYPES[kv_cache_dtype]
    if kv_cache_dtype in _QUANTIZED_TORCH_DTYPES:
        return _QUANTIZED_TORCH_DTYPES[kv_cache_dtype]
    return _TORCH_DTYPES[kv_cache_dtype]


def dtype_name(value: "str | torch.dtype") -> str:
    """The model dtype's name ("float16", "bfloat16", "float32") of a torch dtype, a name or an alias ("fp16",
    "half", "bf16", "fp32"); ValueError naming the allowed values otherwise."""
    name = _dtype_name(value)
    if name not in DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; allowed: {', '.join(DTYPES)} (or the torch dtypes)")
    return name


def _dtype_name(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        for name, dt in _TORCH_DTYPES.items():
            if dt == value:
                return name
        raise ValueError(f"dtype {value} is not supported; allowed: {', '.join(DTYPES)}")
    if isinstance(value, str):
        return {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(value, value)
    return value


# ------------------------------------------------------------------------------------ sparse MLA (DeepSeek V3.2)

#: Values per fp32 scale in the sparse indexer's fp8 key cache and in the fp8_ds_mla latent format's nope part.
SPARSE_QUANT_BLOCK = 128


class SparseIndexerSpec(BaseModel):
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2) on an MLA layer (:attr:`AttentionSpec.sparse_indexer`).

    Per query token t at position p the indexer scores every cached token j <= p of its request:
    ``score(t, j) = index_scale * sum_h w[t, h] * relu(q_idx[t, h] . k_idx[j])`` over ``num_index_heads`` heads of
    ``index_head_dim``, with q_idx and k_idx read as fp8 e4m3 times one fp32 scale per ``quant_block`` values; the
    ``topk`` best tokens (ties: the lower position first) are the only ones the query's MLA attention sees. The exact
    arithmetic is :mod:`attnbackends.reference.sparse_mla`'s; the caches' layouts are
    :mod:`attnbackends.ops.sparse_mla_cache`'s.

    ``latent_format``: "auto" keeps the latent cache in the model dtype ([Lkv + R] per token); "fp8_ds_mla" is
    DeepSeek's format: Lkv fp8 e4m3 nope values with one fp32 scale per 128, then R values in bf16 (656 bytes per
    token at Lkv 512, R 64).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_index_heads: int = Field(default=64, gt=0, description="indexer query heads")
    index_head_dim: int = Field(default=128, gt=0, description="indexer head size (q_idx and k_idx)")
    topk: int = Field(default=2048, gt=0, description="tokens each query attends over")
    quant_block: int = Field(default=SPARSE_QUANT_BLOCK, gt=0, description="values per fp32 scale of q_idx, k_idx")
    index_cache_dtype: Literal["fp8_e4m3"] = "fp8_e4m3"
    index_scale: Optional[float] = Field(default=None, gt=0, description="score scale; default 1/sqrt(index_head_dim)")
    latent_format: Literal["auto", "fp8_ds_mla"] = "auto"

    @model_validator(mode="after")
    def _check_blocks(self) -> "SparseIndexerSpec":
        if self.index_head_dim % self.quant_block:
            raise ValueError(f"index_head_dim ({self.index_head_dim}) must be a multiple of quant_block "
                             f"({self.quant_block})")
        if self.index_scale is not None and not math.isfinite(self.index_scale):
            raise ValueError(f"index_scale must be a positive finite number, got {self.index_scale}")
        return self

    @property
    def softmax_scale(self) -> float:
        """The score scale: index_scale, default 1/sqrt(index_head_dim)."""
        return self.index_scale if self.index_scale is not None else 1.0 / math.sqrt(self.index_head_dim)

    @property
    def num_quant_blocks(self) -> int:
        return self.index_head_dim // self.quant_block


def _sparse_indexer_reasons(spec: "AttentionSpec") -> list[str]:
    """What makes a sparse indexer invalid on ``spec`` (empty: valid or none)."""
    sparse = spec.sparse_indexer
    if sparse is None:
        return []
    if not spec.is_mla:
        return ["sparse_indexer needs an MLA spec (AttentionSpec.mla(..., sparse_indexer=...))"]
    reasons = []
    if spec.kv_cache_dtype not in ("auto", spec.dtype):
        reasons.append(f"kv_cache_dtype of a sparse MLA spec must be 'auto' (the latent cache's format is "
                       f"sparse_indexer.latent_format), got {spec.kv_cache_dtype!r}")
    if sparse.latent_format == "fp8_ds_mla" and spec.kv_lora_rank % SPARSE_QUANT_BLOCK:
        reasons.append(f"latent_format 'fp8_ds_mla' needs kv_lora_rank a multiple of {SPARSE_QUANT_BLOCK}, "
                       f"got {spec.kv_lora_rank}")
    return reasons

# ------------------------------------------------------------------------------------------------------------------


class AttentionSpec(BaseModel):
    """Everything a backend must know about one attention layer, fixed for the model's lifetime.

    MLA layers (DeepSeek-V2/V3) set all four of ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
    ``v_head_dim``; their cache holds one latent "KV head" of ``head_size = kv_lora_rank + qk_rope_head_dim``
    (576 for DeepSeek-V3), so ``num_kv_heads`` must be 1. Build them with :meth:`AttentionSpec.mla`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    num_heads: int = Field(gt=0, description="query heads of this layer (on this rank)")
    num_kv_heads: int = Field(gt=0, description="key/value heads; num_heads must be a multiple")
    head_size: int = Field(gt=0, description="query/key head size (MLA: kv_lora_rank + qk_rope_head_dim)")
    head_size_v: Optional[int] = Field(default=None, gt=0, description="value head size where it differs")
    dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head",
                            "int8_per_token_head", "int4_per_token_head", "nvfp4"] = "auto"
    block_size: int = Field(default=16, description=f"tokens per KV-cache page, 1 to {MAX_BLOCK_SIZE}")
    attn_type: AttentionType = AttentionType.DECODER
    sliding_window: Optional[int] = Field(default=None, gt=0, description="keys visible per query, self included")
    logits_soft_cap: Optional[float] = Field(default=None, gt=0)
    alibi_slopes: Optional[tuple[float, ...]] = None
    has_sinks: bool = Field(default=False, description="one learned sink logit per query head (gpt-oss)")
    scale: Optional[float] = Field(default=None, gt=0, description="softmax scale; default 1/sqrt(head size)")
    kv_lora_rank: Optional[int] = Field(default=None, gt=0)
    qk_nope_head_dim: Optional[int] = Field(default=None, gt=0)
    qk_rope_head_dim: Optional[int] = Field(default=None, gt=0)
    v_head_dim: Optional[int] = Field(default=None, gt=0)
    num_speculative_tokens: int = Field(
        default=0, ge=0, description="draft tokens verified per request and step: decodes of up to 1 + this many tokens"
    )
    speculative_tree: bool = Field(
        default=False, description="draft tokens form a tree: verify batches carry CommonAttentionMetadata.spec_tree_mask"
    )
    mask: "AttentionMask" = Field(
        default_factory=lambda: AttentionMask(), description="which keys a query sees (decoder layers; see AttentionMask)"
    )
    sparse_indexer: Optional[SparseIndexerSpec] = Field(
        default=None, description="MLA only: DeepSeek sparse attention's indexer (V3.2); None: dense attention"
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _normalise_dtype(cls, value: Any) -> Any:
        return _dtype_name(value)

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if not 1 <= value <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}] tokens per page, got {value}")
        return value

    @field_validator("scale", "logits_soft_cap")
    @classmethod
    def _check_finite(cls, value: Optional[float], info: Any) -> Optional[float]:
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{info.field_name} must be a positive finite number, got {value}")
        return value

    @field_validator("attn_type", mode="before")
    @classmethod
    def _normalise_attn_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in {t.value for t in AttentionType}:
            allowed = ", ".join(t.value for t in AttentionType)
            raise ValueError(f"attn_type {value!r} is not one of: {allowed}")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> "AttentionSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.alibi_slopes is not None and len(self.alibi_slopes) != self.num_heads:
            raise ValueError(
                f"alibi_slopes has {len(self.alibi_slopes)} values; it needs one per query head (num_heads={self.num_heads})"
            )
        if self.alibi_slopes is not None and not all(math.isfinite(s) for s in self.alibi_slopes):
            raise ValueError("alibi_slopes must be finite numbers")
        mla_fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        given = [f for f in mla_fields if getattr(self, f) is not None]
        if given and len(given) != len(mla_fields):
            missing = [f for f in mla_fields if f not in given]
            raise ValueError(f"MLA specs need all of {', '.join(mla_fields)}; missing: {', '.join(missing)}")
        if given:
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            if self.head_size != latent:
                raise ValueError(
                    f"head_size ({self.head_size}) of an MLA spec must be kv_lora_rank + qk_rope_head_dim ({latent})"
                )
            if self.num_kv_heads != 1:
                raise ValueError(f"num_kv_heads of an MLA spec must be 1 (one latent head), got {self.num_kv_heads}")
            if self.head_size_v is not None and self.head_size_v != self.kv_lora_rank:
                raise ValueError(
                    f"head_size_v of an MLA spec is the latent value size kv_lora_rank ({self.kv_lora_rank}); "
                    f"got {self.head_size_v}"
                )
            if self.attn_type is not AttentionType.DECODER:
                raise ValueError(f"attn_type of an MLA spec must be 'decoder', got {self.attn_type.value!r}")
        sparse_reasons = _sparse_indexer_reasons(self)
        if sparse_reasons:
            raise ValueError("; ".join(sparse_reasons))
        if self.sliding_window is not None and not self.attn_type.is_causal:
            raise ValueError(
                f"sliding_window is defined for causal decoder layers only (attn_type={self.attn_type.value!r})"
            )
        return self

    @classmethod
    def mla(
        cls,
        num_heads: int,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        **kwargs: Any,
    ) -> "AttentionSpec":
        """An MLA layer spec (defaults: DeepSeek-V3) with the model's scale 1/sqrt(P + R) unless given.

        The four sizes must be positive ints (checked here, before the head size and the scale are derived from
        them; ValueError naming the size otherwise)."""
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} of an MLA spec must be a positive int, got {value!r}")
        kwargs.setdefault("scale", 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim))
        return cls(
            num_heads=num_heads,
            num_kv_heads=1,
            head_size=kv_lora_rank + qk_rope_head_dim,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            **kwargs,
        )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_sparse_mla(self) -> bool:
        """An MLA layer with DeepSeek's sparse indexer (:attr:`sparse_indexer`)."""
        return self.sparse_indexer is not None

    @property
    def value_head_size(self) -> int:
        """Head size of the output (and of V): v_head_dim for MLA, else head_size_v or head_size. (MLA's cached
        value is the latent, kv_lora_rank wide; the output is up-projected to v_head_dim.)"""
        if self.is_mla:
            return self.v_head_dim
        return self.head_size_v if self.head_size_v is not None else self.head_size

    @property
    def softmax_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        if self.is_mla:
            return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        return 1.0 / math.sqrt(self.head_size)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def is_fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype in _FP8_TORCH_DTYPES

    @property
    def kv_cache_format(self) -> "KVCacheFormat":
        """How the cache stores keys and values (:class:`KVCacheFormat`, from ``kv_cache_dtype``)."""
        return kv_cache_format(self.kv_cache_dtype)

    @property
    def causal(self) -> bool:
        """Whether the layer's mask has a causal part (causal, block-causal, causal plus spans): what
        ``CommonAttentionMetadata.causal`` must say. False for encoders, non-causal decoders and custom masks."""
        return self.attn_type.is_causal and self.mask.kind in _CAUSAL_KINDS

    @property
    def window(self) -> "Optional[tuple[int, int]]":
        """The layer's window as (left, right): key j is visible from position p only if p - left <= j <= p + right
        (``sliding_window`` W is (W - 1, 0)); None: no window."""
        if self.mask.window is not None:
            return self.mask.window
        return (self.sliding_window - 1, 0) if self.sliding_window is not None else None

    @property
    def has_extended_mask(self) -> bool:
        """Whether the layer's mask is beyond causal with a one-sided window (a kind other than causal, or a window
        that looks ahead): the backends that serve it declare it (``AttentionBackend.supported_mask_kinds``)."""
        return self.mask.kind is not MaskKind.CAUSAL or (self.mask.window is not None and self.mask.window[1] > 0)

    @model_validator(mode="after")
    def _check_mask(self) -> "AttentionSpec":
        mask = self.mask
        if mask != AttentionMask() and self.attn_type is not AttentionType.DECODER:
            raise ValueError(f"mask {mask.describe()!r} is for decoder layers over a KV cache; attn_type "
                             f"{self.attn_type.value!r} already sees every key of its sequence")
        if mask.window is not None and self.sliding_window is not None:
            raise ValueError(f"sliding_window ({self.sliding_window}) and mask.window {mask.window} both set: give "
                             f"one (sliding_window W is mask.window ({self.sliding_window - 1}, 0))")
        return self


# ----------------------------------------------------------------------------------------------------------------
# Attention masks: which keys a query sees, beyond the attention type (the exact definition: DESIGN.md and
# attnbackends.masks.dense_visibility, which the reference backend applies).
# ----------------------------------------------------------------------------------------------------------------
class MaskKind(str, Enum):
    """A decoder layer's mask over its sequence (query at position p, key at position j < seq_len)."""

    #: j <= p.
    CAUSAL = "causal"
    #: Every key of the sequence, cached context included (diffusion LMs, rerankers).
    NON_CAUSAL = "non_causal"
    #: Causal across blocks of ``block_len`` positions, bidirectional inside one: j // b <= p // b.
    BLOCK_CAUSAL = "block_causal"
    #: Causal, plus bidirectional inside each of a request's spans (image tokens): j <= p, or p and j in one span.
    #: The spans come per batch (``CommonAttentionMetadata.masks``).
    CAUSAL_SPANS = "causal_spans"
    #: A per-request [query, key] bit mask given per batch (``CommonAttentionMetadata.masks``), as FlashInfer's
    #: ``custom_mask``; nothing else is implied (no causality).
    CUSTOM = "custom"


_CAUSAL_KINDS = frozenset({MaskKind.CAUSAL, MaskKind.BLOCK_CAUSAL, MaskKind.CAUSAL_SPANS})


class AttentionMask(BaseModel):
    """The mask of a decoder layer: its ``kind`` (:class:`MaskKind`), the block length of a block-causal mask, and
    an optional two-sided ``window`` (left, right): key j is visible from position p only if
    p - left <= j <= p + right (flash-attn's ``window_size``; the spec's one-sided ``sliding_window`` W is
    (W - 1, 0)). The window intersects the kind's mask."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: MaskKind = MaskKind.CAUSAL
    block_len: Optional[int] = Field(default=None, description="positions per block of a block_causal mask")
    window: Optional[tuple[int, int]] = Field(default=None, description="(left, right) keys around the query")

    @field_validator("kind", mode="before")
    @classmethod
    def _normalise_kind(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in {k.value for k in MaskKind}:
            raise ValueError(f"mask kind {value!r} is not one of: {', '.join(k.value for k in MaskKind)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "AttentionMask":
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"mask.window (left, right) = {self.window}: both sides must be >= 0 keys")
            if right > 0 and self.kind is MaskKind.CAUSAL:
                raise ValueError(f"mask.window {self.window} looks {right} keys ahead, which a causal mask never "
                                 "shows: use kind 'non_causal', 'block_causal' or 'causal_spans', or right = 0")
        if (self.block_len is not None) != (self.kind is MaskKind.BLOCK_CAUSAL):
            raise ValueError(f"mask.block_len goes with kind 'block_causal' (and it needs one); got kind "
                             f"{self.kind.value!r} and block_len {self.block_len}")
        if self.block_len is not None and self.block_len < 1:
            raise ValueError(f"mask.block_len must be >= 1 position, got {self.block_len}")
        return self

    def describe(self) -> str:
        """The mask in words, e.g. ``block_causal(b=32) window (128, 0)``."""
        text = self.kind.value + (f"(b={self.block_len})" if self.block_len is not None else "")
        return text + (f" window {self.window}" if self.window is not None else "")


AttentionSpec.model_rebuild()


# ----------------------------------------------------------------------------------------------------------------
# KV-cache formats: 16-bit, fp8 with one scale per tensor, and the formats whose scales are written with the tokens
# ----------------------------------------------------------------------------------------------------------------
#: The ``kv_cache_dtype`` values whose scales are computed on write and stored beside their pages
#: (:mod:`attnbackends.ops.kv_layout` lays them out, :mod:`attnbackends.ops.kv_quant` defines their arithmetic).
QUANTIZED_KV_CACHE_DTYPES = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4")
KV_CACHE_DTYPES = KV_CACHE_DTYPES + QUANTIZED_KV_CACHE_DTYPES

_QUANTIZED_TORCH_DTYPES = {
    "fp8_per_token_head": torch.float8_e4m3fn,
    "int8_per_token_head": torch.int8,
    "int4_per_token_head": torch.uint8,  # two values a byte
    "nvfp4": torch.uint8,  # two e2m1 values a byte
}


class KVCacheFormat(str, Enum):
    """The storage format of a KV cache (``AttentionSpec.kv_cache_format``).

    ``SIXTEEN_BIT``: the model dtype or float16/bfloat16. ``FP8_PER_TENSOR``: fp8 with one scale per tensor (the
    impl's ``k_scale``/``v_scale``). ``FP8_PER_TOKEN_HEAD`` / ``INT8_PER_TOKEN_HEAD``: e4m3 / int8 values with one
    float32 scale per token and KV head (absmax / qmax, computed on write). ``INT4_PER_TOKEN_HEAD``: int4 values,
    two a byte, one float32 scale per token and KV head. ``NVFP4``: e2m1 values, two a byte, one e4m3 scale per
    16-element block, times one float32 global scale per tensor (the impl's ``k_scale``/``v_scale``).
    """

    SIXTEEN_BIT = "16bit"
    FP8_PER_TENSOR = "fp8_per_tensor"
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"
    NVFP4 = "nvfp4"

    @property
    def scales_in_pages(self) -> bool:
        """Scales are written with the tokens and stored beside their pages."""
        return self in _PAGE_SCALED

    @property
    def per_token_head(self) -> bool:
        """One float32 scale per token and KV head."""
        return self in (KVCacheFormat.FP8_PER_TOKEN_HEAD, KVCacheFormat.INT8_PER_TOKEN_HEAD,
                        KVCacheFormat.INT4_PER_TOKEN_HEAD)

    @property
    def packed(self) -> bool:
        """Two values a byte (the cache's last dimension is head_size // 2)."""
        return self in (KVCacheFormat.INT4_PER_TOKEN_HEAD, KVCacheFormat.NVFP4)

    @property
    def uses_tensor_scale(self) -> bool:
        """The impl's per-tensor ``k_scale``/``v_scale`` apply (fp8 per tensor; NVFP4's global scale)."""
        return self in (KVCacheFormat.FP8_PER_TENSOR, KVCacheFormat.NVFP4)


_PAGE_SCALED = (KVCacheFormat.FP8_PER_TOKEN_HEAD, KVCacheFormat.INT8_PER_TOKEN_HEAD,
                KVCacheFormat.INT4_PER_TOKEN_HEAD, KVCacheFormat.NVFP4)


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat:
    """The :class:`KVCacheFormat` of a ``kv_cache_dtype`` value (ValueError naming the allowed values otherwise)."""
    if kv_cache_dtype in ("auto", "float16", "bfloat16"):
        return KVCacheFormat.SIXTEEN_BIT
    if kv_cache_dtype in _FP8_TORCH_DTYPES:
        return KVCacheFormat.FP8_PER_TENSOR
    if kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES:
        return KVCacheFormat(kv_cache_dtype)
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of: {', '.join(KV_CACHE_DTYPES)}")


def read_config_file(path: "str | os.PathLike") -> dict:
    """The mapping in a ``.yaml``/``.yml`` or ``.json`` config file (ValueError for another suffix or a non-mapping)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"config file {path} must end in .yaml, .yml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return data


class AttentionConfig(BaseModel):
    """The user's choice: ``backend`` ("auto" or a registered name) and an optional priority override.

    Load it from a dict (``AttentionConfig.model_validate``), a YAML or JSON file (:meth:`from_file`), and the
    environment (:meth:`from_env`: ``ATTNBACKENDS_BACKEND`` overrides ``backend``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str = Field(default="auto", min_length=1, description='"auto" or a registered backend name')
    priority: Optional[tuple[str, ...]] = Field(
        default=None, description="backend names tried in this order instead of the platform's list"
    )
    debug: bool = Field(default=False, description="validate metadata on every build (slow; off the fast path)")
    decode_backend: Optional[str] = Field(default=None, description="backend for decodes (the rest: prefill_backend)")
    prefill_backend: Optional[str] = Field(default=None, description="backend for prefills and chunked prefills")
    selection: Literal["static", "measured"] = Field(
        default="static", description='"static": the priority lists; "measured": a stored `attnbackends tune` profile'
    )
    profile_dir: Optional[str] = Field(default=None, description="where tune profiles live (default: user cache)")

    @field_validator("decode_backend", "prefill_backend")
    @classmethod
    def _strip_phase(cls, value: Optional[str]) -> Optional[str]:
        return value.strip().lower() or None if value is not None else None

    @model_validator(mode="after")
    def _check_phases(self) -> "AttentionConfig":
        if self.backend != "auto" and (self.decode_backend or self.prefill_backend):
            raise ValueError(
                f"backend={self.backend!r} conflicts with decode_backend/prefill_backend: set backend='auto' to "
                "choose per phase"
            )
        return self

    @field_validator("backend")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = value.strip().lower()
        if not value:
            raise ValueError("backend must be 'auto' or a backend name, got an empty string")
        return value

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "AttentionConfig":
        """Read a config from a ``.yaml``/``.yml`` or ``.json`` file; an ``attention:`` section is used if present."""
        data = read_config_file(path)
        data = data.get("attention", data)
        return cls.model_validate(data)

    @classmethod
    def from_env(cls, base: "AttentionConfig | None" = None, environ: "dict[str, str] | None" = None) -> "AttentionConfig":
        """``base`` (default: an empty config) with ``ATTNBACKENDS_BACKEND`` applied when it is set."""
        environ = os.environ if environ is None else environ
        base = base or cls()
        name = environ.get(BACKEND_ENV_VAR, "").strip()
        if not name:
            return base
        return base.model_copy(update={"backend": cls._strip(name)})
