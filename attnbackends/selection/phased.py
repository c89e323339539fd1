"""Per-phase composition: decodes through one backend, prefills and chunked prefills through another, in one step.

:func:`compose_phased` makes the backend class for a pair (``phased(decode=triton,prefill=flash_attn)``). Both parts
share one KV cache, so their cache layouts, shapes and dtypes must agree (``not_supported_reasons`` says where they
do not). One ``build()`` per step splits the decode-first batch on the host copies (no device sync) and builds each
part's metadata from views of the common tensors: the decode part is the leading ``num_decodes`` requests, the
prefill part the rest (its ``query_start_loc`` rebased to 0 by one device subtraction). ``forward`` writes the new
K/V once, then runs each part into its rows of the caller's output. A pure-decode batch goes whole to the decode
backend, so CUDA graphs of pure-decode steps work as far as the decode backend supports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from ..interface import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CudaGraphSupport,
)
from ..metadata import CommonAttentionMetadata, split_decodes_and_prefills
from ..platform import DeviceInfo
from ..spec import AttentionSpec

__all__ = ["PhasedMetadata", "is_phased_name", "parse_phased_name", "compose_phased", "phased_name"]

_NAME = re.compile(r"^phased\(decode=([\w.\-]+),prefill=([\w.\-]+)\)$")


def phased_name(decode: str, prefill: str) -> str:
    """The registry name of the composition: ``phased(decode=<decode>,prefill=<prefill>)``."""
    return f"phased(decode={decode},prefill={prefill})"


def is_phased_name(name: str) -> bool:
    return _NAME.match(name) is not None


def parse_phased_name(name: str) -> tuple[str, str]:
    """(decode, prefill) of a composition's name; ValueError for anything else."""
    match = _NAME.match(name.replace(" ", ""))
    if match is None:
        raise ValueError(f"{name!r} is not a phased backend name; expected {phased_name('<decode>', '<prefill>')}")
    return match.group(1), match.group(2)


@dataclass
class PhasedMetadata:
    """One step: each part's own metadata (None where the batch has no such part) and where the parts meet.

    num_decode_tokens : rows ``[:num_decode_tokens]`` are decodes, ``[num_decode_tokens:num_actual_tokens]`` prefills.
    """

    common: CommonAttentionMetadata
    num_actual_tokens: int
    num_decode_tokens: int
    decode: Any = None
    prefill: Any = None


def _decode_part(common: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int) -> CommonAttentionMetadata:
    seq_lens_cpu = common.seq_lens_cpu[:num_decodes]
    return replace(
        common,
        query_start_loc=common.query_start_loc[: num_decodes + 1],
        query_start_loc_cpu=common.query_start_loc_cpu[: num_decodes + 1],
        seq_lens=common.seq_lens[:num_decodes],
        seq_lens_cpu=seq_lens_cpu,
        block_table=common.block_table[:num_decodes],
        slot_mapping=common.slot_mapping[:num_decode_tokens],
        num_reqs=num_decodes,
        num_actual_tokens=num_decode_tokens,
        max_query_len=int(common.query_lens_cpu[:num_decodes].max()),
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_cpu=common.block_table_cpu[:num_decodes] if common.block_table_cpu is not None else None,
    )


def _prefill_part(common: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int) -> CommonAttentionMetadata:
    seq_lens_cpu = common.seq_lens_cpu[num_decodes:]
    return replace(
        common,
        query_start_loc=common.query_start_loc[num_decodes:] - num_decode_tokens,
        query_start_loc_cpu=common.query_start_loc_cpu[num_decodes:] - num_decode_tokens,
        seq_lens=common.seq_lens[num_decodes:],
        seq_lens_cpu=seq_lens_cpu,
        block_table=common.block_table[num_decodes:],
        slot_mapping=common.slot_mapping[num_decode_tokens:],
        num_reqs=common.num_reqs - num_decodes,
        num_actual_tokens=common.num_actual_tokens - num_decode_tokens,
        max_seq_len=int(seq_lens_cpu.max()),
        block_table_cpu=common.block_table_cpu[num_decodes:] if common.block_table_cpu is not None else None,
    )


class _PhasedBuilder(AttentionMetadataBuilder[PhasedMetadata]):
    decode_backend: type[AttentionBackend]
    prefill_backend: type[AttentionBackend]

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", **kwargs: Any) -> None:
        base = {k: v for k, v in kwargs.items() if k in ("max_num_reqs", "max_num_tokens", "debug")}
        super().__init__(spec, device, **base)
        self.decode_builder = self.decode_backend.get_builder_cls()(spec, device, **kwargs)
        self.prefill_builder = self.prefill_backend.get_builder_cls()(spec, device, **kwargs)

    def build(self, common: CommonAttentionMetadata) -> PhasedMetadata:
        n = common.num_actual_tokens
        if common.max_query_len <= self.reorder_batch_threshold:
            return PhasedMetadata(common, n, n, decode=self.decode_builder.build(common))
        split = split_decodes_and_prefills(common, self.reorder_batch_threshold)
        if split.num_decodes == 0:
            return PhasedMetadata(common, n, 0, prefill=self.prefill_builder.build(common))
        nd, ndt = split.num_decodes, split.num_decode_tokens
        return PhasedMetadata(
            common, n, ndt,
            decode=self.decode_builder.build(_decode_part(common, nd, ndt)),
            prefill=self.prefill_builder.build(_prefill_part(common, nd, ndt)),
        )

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> PhasedMetadata:
        if common.max_query_len > self.reorder_batch_threshold:
            raise ValueError("CUDA-graph capture of a phased backend takes pure-decode batches (its decode part)")
        n = common.num_actual_tokens
        return PhasedMetadata(common, n, n, decode=self.decode_builder.build_for_cudagraph_capture(common))


class _PhasedImpl(AttentionImpl[PhasedMetadata]):
    decode_backend: type[AttentionBackend]
    prefill_backend: type[AttentionBackend]

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.decode_impl = self.decode_backend.get_impl_cls()(spec, **kwargs)
        self.prefill_impl = self.prefill_backend.get_impl_cls()(spec, **kwargs)

    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self.decode_impl.update_kv_cache(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: PhasedMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if metadata.prefill is None:
            return self.decode_impl.forward(query, key, value, kv_cache, metadata.decode, output)
        if metadata.decode is None:
            return self.prefill_impl.forward(query, key, value, kv_cache, metadata.prefill, output)
        if kv_cache is None:
            raise ValueError("a phased backend needs a paged kv_cache (decoder self-attention)")
        if key is not None:
            if value is None:
                raise ValueError("key and value must be given together (or both None when the cache holds them)")
            self.decode_impl.update_kv_cache(key, value, kv_cache, metadata.common.slot_mapping)
        nd, n = metadata.num_decode_tokens, metadata.num_actual_tokens
        self.decode_impl.forward(query[:nd], None, None, kv_cache, metadata.decode, output[:nd])
        self.prefill_impl.forward(query[nd:n], None, None, kv_cache, metadata.prefill, output[nd:n])
        return output


class PhasedBackend(AttentionBackend):
    """Base of the per-pair classes :func:`compose_phased` makes; capabilities are what both parts support."""

    name = "phased"
    decode_backend: type[AttentionBackend]
    prefill_backend: type[AttentionBackend]

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        reasons = []
        for phase, part in (("decode", cls.decode_backend), ("prefill", cls.prefill_backend)):
            reasons += [f"{phase} ({part.name}): {r}" for r in part.not_supported_reasons(spec, device)]
        decode, prefill = cls.decode_backend, cls.prefill_backend
        if decode.kv_cache_layout != prefill.kv_cache_layout:
            reasons.append(f"KV-cache layouts differ: {decode.name} {decode.kv_cache_layout}, "
                           f"{prefill.name} {prefill.kv_cache_layout}")
        elif decode.kv_cache_shape(1, spec) != prefill.kv_cache_shape(1, spec):
            reasons.append(f"KV-cache shapes differ: {decode.name} {decode.kv_cache_shape(1, spec)}, "
                           f"{prefill.name} {prefill.kv_cache_shape(1, spec)}")
        if decode.is_mla != prefill.is_mla:
            reasons.append(f"{decode.name} and {prefill.name} serve different kinds of layer (MLA and standard)")
        return reasons

    @classmethod
    def warmup(cls, specs: Sequence[AttentionSpec], device: DeviceInfo) -> list[str]:
        """Both parts' ahead-of-time builds."""
        built = cls.decode_backend.warmup(specs, device) + cls.prefill_backend.warmup(specs, device)
        return list(dict.fromkeys(built))

    @classmethod
    def environment_facts(cls) -> dict[str, Optional[str]]:
        return {**cls.decode_backend.environment_facts(), **cls.prefill_backend.environment_facts()}

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return cls.decode_backend.kv_cache_shape(num_blocks, spec)

    @classmethod
    def allocate_kv_cache(
        cls, num_blocks: int, spec: AttentionSpec, device: "torch.device | str" = "cpu"
    ) -> torch.Tensor:
        """A zeroed cache (some prefill kernels read whole pages, unused rows included; they must be finite)."""
        return torch.zeros(cls.kv_cache_shape(num_blocks, spec), dtype=spec.kv_cache_torch_dtype, device=device)

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return cls._builder_cls

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return cls._impl_cls


def _both(a: type[AttentionBackend], b: type[AttentionBackend], attr: str) -> bool:
    return bool(getattr(a, attr)) and bool(getattr(b, attr))


def compose_phased(decode_cls: type[AttentionBackend], prefill_cls: type[AttentionBackend]) -> type[PhasedBackend]:
    """The composition running decodes on ``decode_cls`` and the rest on ``prefill_cls`` (two plain backends; the
    registry resolves names and caches the result: :func:`attnbackends.selection.registry.phased_backend`)."""
    name = phased_name(decode_cls.name, prefill_cls.name)
    parts = dict(decode_backend=decode_cls, prefill_backend=prefill_cls)
    builder_cls = type("PhasedMetadataBuilder", (_PhasedBuilder,), dict(
        parts, reorder_batch_threshold=decode_cls.get_builder_cls().reorder_batch_threshold))
    impl_cls = type("PhasedImpl", (_PhasedImpl,), parts)
    graphs = min(decode_cls.cudagraph_support, CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    attrs = dict(
        parts,
        name=name,
        description=f"decodes on {decode_cls.name}, prefills and chunked prefills on {prefill_cls.name}",
        _builder_cls=builder_cls,
        _impl_cls=impl_cls,
        supported_dtypes=decode_cls.supported_dtypes & prefill_cls.supported_dtypes,
        supported_kv_cache_dtypes=decode_cls.supported_kv_cache_dtypes & prefill_cls.supported_kv_cache_dtypes,
        supported_attn_types=decode_cls.supported_attn_types & prefill_cls.supported_attn_types,
        block_size_multiple=max(decode_cls.block_size_multiple, prefill_cls.block_size_multiple),
        supports_sliding_window=_both(decode_cls, prefill_cls, "supports_sliding_window"),
        supports_alibi=_both(decode_cls, prefill_cls, "supports_alibi"),
        supports_logits_soft_cap=_both(decode_cls, prefill_cls, "supports_logits_soft_cap"),
        supports_sinks=_both(decode_cls, prefill_cls, "supports_sinks"),
        is_mla=decode_cls.is_mla,
        runs_on_cpu=_both(decode_cls, prefill_cls, "runs_on_cpu"),
        cudagraph_support=graphs,
        kv_cache_layout=decode_cls.kv_cache_layout,
    )
    return type("PhasedBackend", (PhasedBackend,), attrs)
