"""The flash_attn backend: flash-attn's varlen paged forward over our cache, one launch per layer for a mixed batch.

K and V are read in place: ``kv_cache[:, 0]`` and ``kv_cache[:, 1]`` are [num_blocks, block_size, num_kv_heads,
head_size] views whose last dimension is contiguous and whose other strides are multiples of 16 bytes, which
flash-attn 4 takes without a copy. Decodes and prefills go through the same call (causal masks are aligned to the
end of each sequence, which is our position rule), with ``seq_lens`` as flash-attn's ``seqused_k`` and the block
table as its ``page_table``.

Which flash-attn generation runs (4, 3 or 2) is decided once by :func:`.library.installed_flash_attn`; what each
one accepts is data (:data:`GENERATION_CAPABILITIES`) and every mismatch is a reason in ``explain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport
from ..metadata import CommonAttentionMetadata, validate_common_metadata
from ..ops.kv_cache_write import reshape_and_cache
from ..platform import DeviceInfo
from ..spec import AttentionSpec, AttentionType, MaskKind
from ..validation import check_forward_inputs
from . import library

__all__ = [
    "GENERATION_CAPABILITIES",
    "FlashAttnBackend",
    "FlashAttnImpl",
    "FlashAttnMetadata",
    "FlashAttnMetadataBuilder",
    "GenerationCapabilities",
]

NOT_INSTALLED = "flash-attn is not installed (pip install 'attnbackends[flash-attn]' for flash-attn 4)"


@dataclass(frozen=True)
class GenerationCapabilities:
    """What one flash-attn generation accepts over a paged cache.

    head sizes: ``min_head_size..max_head_size`` in steps of ``head_size_multiple``; on compute capability 10.x/11.x
    (``blackwell_head_sizes``) only those up to 128 and the listed larger ones.
    """

    min_compute_capability: tuple[int, int]
    max_compute_capability: tuple[int, int]
    min_head_size: int
    max_head_size: int
    head_size_multiple: int
    block_size_multiple: int
    sinks: bool
    blackwell_large_head_sizes: frozenset[int] = frozenset()


GENERATION_CAPABILITIES: dict[int, GenerationCapabilities] = {
    # flash_attn.cute: paged KV on sm_90 (TMA loads when block_size equals the key tile, 128 at head size 128;
    # cp.async otherwise) and sm_100/sm_110; fp8 needs fp8 queries and sm_100, so no fp8 cache here.
    4: GenerationCapabilities((9, 0), (11, 9), 8, 256, 8, 16, sinks=True, blackwell_large_head_sizes=frozenset({256})),
    # flash_attn_interface (Hopper build): sm_90 only.
    3: GenerationCapabilities((9, 0), (9, 0), 8, 256, 8, 16, sinks=False),
    # flash_attn 2: paged KV needs pages of a multiple of 256 tokens.
    2: GenerationCapabilities((8, 0), (12, 9), 8, 256, 8, 256, sinks=False),
}


@dataclass(frozen=True)
class FlashAttnMetadata:
    """One batch for flash-attn: the common tensors it reads, and the host bounds it schedules with (never written
    after ``build()``).

    query_start_loc : [R + 1] int32 (flash-attn's cu_seqlens_q); seq_lens : [R] int32 (its seqused_k);
    block_table : [R, W] int32 (its page_table); cu_seqlens_k : [R + 1] int32, flash-attn 2 only.
    """

    common: CommonAttentionMetadata
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_k: Optional[torch.Tensor] = None
    debug: bool = False


class FlashAttnMetadataBuilder(AttentionMetadataBuilder[FlashAttnMetadata]):
    """Checks the batch's tensors once and hands them on; flash-attn plans nothing on the host."""

    reorder_batch_threshold = 1

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", **kwargs: Any) -> None:
        super().__init__(spec, device, **kwargs)
        install = library.installed_flash_attn()
        self.generation = install.generation if install is not None else 4

    def build(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        if self.debug:
            validate_common_metadata(common, block_size=self.spec.block_size)
        if bool(common.causal) != self.spec.causal:
            raise ValueError(f"common.causal is {common.causal}, the layer's mask ({self.spec.mask.describe()}) is "
                             f"{'causal' if self.spec.causal else 'non-causal'}")
        num_reqs = common.num_reqs
        block_table = common.block_table[:num_reqs]  # flash-attn takes exactly one row per request
        if block_table.dtype != torch.int32 or (block_table.shape[1] > 1 and block_table.stride(-1) != 1):
            raise ValueError(
                f"block_table must be int32 and contiguous in its last dimension for flash-attn; got "
                f"{block_table.dtype}, strides {tuple(block_table.stride())}"
            )
        cu_seqlens_k = None
        if self.generation == 2:
            lengths = torch.cumsum(common.seq_lens[:num_reqs], 0, dtype=torch.int32)
            cu_seqlens_k = torch.nn.functional.pad(lengths, (1, 0))
        return FlashAttnMetadata(
            common=common,
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc[: num_reqs + 1],
            seq_lens=common.seq_lens[:num_reqs],
            block_table=block_table,
            cu_seqlens_k=cu_seqlens_k,
            debug=self.debug,
        )


class FlashAttnImpl(AttentionImpl[FlashAttnMetadata]):
    """Writes K/V with the shared write op, then one flash-attn call for the whole batch."""

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        reasons = FlashAttnBackend.spec_reasons(spec)
        if reasons:
            raise NotImplementedError("the flash_attn backend cannot serve this spec: " + "; ".join(reasons))
        self._forward: Optional[library.PagedForward] = None
        self._write_checked = False

    def _bind(self, device: torch.device) -> library.PagedForward:
        """The flash-attn forward with this layer's scale, window, soft-cap and sinks bound (first call only)."""
        install = library.installed_flash_attn()
        if install is None:
            raise ImportError(NOT_INSTALLED)
        spec = self.spec
        call = library.PagedCall(
            softmax_scale=self.scale,
            causal=spec.causal,
            window_left=spec.window[0] if spec.window is not None else None,
            window_right=spec.window[1] if spec.window is not None else None,
            softcap=spec.logits_soft_cap,
            sinks=self.sinks.to(device).contiguous() if self.sinks is not None else None,
        )
        self._forward = library.paged_forward(install, call)
        return self._forward

    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        reshape_and_cache(key, value, kv_cache, slot_mapping, self.k_scale, self.v_scale,
                          validate=not self._write_checked)
        self._write_checked = True

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: FlashAttnMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise ValueError("the flash_attn backend needs a paged kv_cache (decoder self-attention)")
        check_forward_inputs(self, metadata, metadata.common, query, key, value, kv_cache, output,
                             backend=FlashAttnBackend)
        if key is not None:
            self.update_kv_cache(key, value, kv_cache, metadata.common.slot_mapping)
        run = self._forward or self._bind(query.device)
        n = metadata.num_actual_tokens
        if query.shape[0] != n:
            query, output_rows = query[:n], output[:n]
        else:
            output_rows = output
        run(query, kv_cache[:, 0], kv_cache[:, 1], output_rows, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_table, metadata.cu_seqlens_k, metadata.max_query_len, metadata.max_seq_len)
        return output


class FlashAttnBackend(AttentionBackend):
    """flash-attn's paged varlen forward (flash-attn 4 on sm_90/sm_100; flash-attn 3 or 2 where those are installed)."""

    name = "flash_attn"
    description = "flash-attn 4 (flash_attn.cute) paged varlen forward; flash-attn 3/2 where installed"
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16"})
    # The widest of the generations; GENERATION_CAPABILITIES narrows it to the installed one.
    min_head_size = 8
    max_head_size = 256
    head_size_multiple = 8
    block_size_multiple = 16
    min_compute_capability = (8, 0)
    max_compute_capability = (12, 9)
    kv_cache_16bit_must_match_dtype = True
    supported_attn_types = frozenset({AttentionType.DECODER})
    supports_sliding_window = True
    supports_alibi = False
    supports_logits_soft_cap = True
    supports_sinks = True
    supports_separate_v_head_size = False
    # flash-attn's API: causal or not, and window_size=(left, right).
    supported_mask_kinds = frozenset({MaskKind.CAUSAL, MaskKind.NON_CAUSAL})
    supports_window_right = True
    mask_decline_notes = {kind: "flash-attn's API takes causal=True/False and a (left, right) window only"
                          for kind in ("block_causal", "causal_spans", "custom")}
    cudagraph_support = CudaGraphSupport.NEVER

    @classmethod
    def spec_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Reasons of the spec alone (no device): the shared ones and the installed generation's rules (else 4's)."""
        return super().spec_reasons(spec) + cls.generation_reasons(spec)

    @classmethod
    def generation_reasons(cls, spec: AttentionSpec, generation: Optional[int] = None) -> list[str]:
        """Reasons of the spec alone against a generation's rules (default: the installed one, else 4)."""
        if generation is None:
            install = library.installed_flash_attn()
            generation = install.generation if install is not None else 4
        caps = GENERATION_CAPABILITIES[generation]
        reasons = []
        d = spec.head_size
        if not (caps.min_head_size <= d <= caps.max_head_size and d % caps.head_size_multiple == 0):
            reasons.append(
                f"head_size {d} not supported by flash-attn {generation} (supported: {caps.min_head_size}.."
                f"{caps.max_head_size}, multiple of {caps.head_size_multiple})"
            )
        if spec.block_size % caps.block_size_multiple:
            reasons.append(
                f"block_size {spec.block_size} is not a multiple of {caps.block_size_multiple} "
                f"(flash-attn {generation})"
            )
        if spec.has_sinks and not caps.sinks:
            reasons.append(f"attention sinks need flash-attn 4 (flash-attn {generation} is installed)")
        return reasons

    @classmethod
    def missing_packages(cls) -> list[str]:
        return [] if library.installed_flash_attn() is not None else [NOT_INSTALLED]

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        reasons = super().not_supported_reasons(spec, device)  # NOT_INSTALLED comes from missing_packages
        install = library.installed_flash_attn()
        generation = install.generation if install is not None else 4
        caps = GENERATION_CAPABILITIES[generation]
        if device.is_cuda:
            cc = device.compute_capability
            lo, hi = caps.min_compute_capability, caps.max_compute_capability
            if not lo <= cc <= hi:
                reasons.append(
                    f"flash-attn {generation} paged attention needs compute capability {lo[0]}.{lo[1]}..{hi[0]}.{hi[1]}"
                    f" (this device: {cc[0]}.{cc[1]})"
                )
            elif cc[0] in (10, 11) and spec.head_size > 128 and spec.head_size not in caps.blackwell_large_head_sizes:
                allowed = ", ".join(str(h) for h in sorted(caps.blackwell_large_head_sizes))
                reasons.append(f"head_size {spec.head_size} on compute capability {cc[0]}.x: flash-attn {generation} "
                               f"takes head sizes up to 128{' and ' + allowed if allowed else ''}")
        return reasons

    @classmethod
    def environment_facts(cls) -> dict[str, Optional[str]]:
        """The installed flash-attn generation and version (:func:`.library.installed_flash_attn`), None without one."""
        install = library.installed_flash_attn()
        return {"flash_attn": install.describe() if install is not None else None}

    @classmethod
    def allocate_kv_cache(
        cls, num_blocks: int, spec: AttentionSpec, device: "torch.device | str" = "cpu"
    ) -> torch.Tensor:
        """A zeroed cache: flash-attn 4's TMA page loads read whole pages, and a NaN in a page's unused rows would
        reach the output (0 * NaN), so unused slots must hold finite values."""
        return torch.zeros(cls.kv_cache_shape(num_blocks, spec), dtype=spec.kv_cache_torch_dtype, device=device)

    @classmethod
    def get_builder_cls(cls) -> type[FlashAttnMetadataBuilder]:
        return FlashAttnMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[FlashAttnImpl]:
        return FlashAttnImpl
