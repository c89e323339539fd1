"""The three objects an engine drives: the backend class (static facts), its metadata builder (once per batch,
shared by every layer) and its impl (one per layer). See DESIGN.md, "Contracts"."""

from __future__ import annotations

import enum
import functools
import math
import numbers
import typing
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Optional, TypeVar

import torch

from .metadata import CommonAttentionMetadata, MetadataOrigin

if TYPE_CHECKING:
    from .speculative.draft_steps import DraftSteps
from . import platform as _platform
from .platform import DeviceInfo
from .ops.kv_layout import allocate_kv_cache_pages, kv_page_layout
from .spec import AttentionSpec, AttentionType, MaskKind
from .ops.page_guard import guard_block_table
from .validation import (check_batch_for_spec, check_batch_limits, check_device_available, check_forward_inputs,
                         check_metadata_tensors, same_device)

__all__ = [
    "AttentionBackend",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionMetadataBuilder",
    "CudaGraphSupport",
    "MLAAttentionImpl",
    "QueryLenSupport",
    "STANDARD_KV_CACHE_LAYOUT",
]

STANDARD_KV_CACHE_LAYOUT = "[num_blocks, 2, block_size, num_kv_heads, head_size]"

#: The attnbackends extra (pyproject.toml's optional-dependencies) that installs each optional package.
INSTALL_EXTRAS = {"flashinfer": "flashinfer", "flash_attn": "flash-attn"}

M = TypeVar("M")


class CudaGraphSupport(enum.IntEnum):
    """How much of a backend's forward can be captured in a CUDA graph and replayed with new metadata."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # batches where every request decodes exactly one token
    UNIFORM_BATCH = 2  # batches where every request has the same query length
    ALWAYS = 3  # any batch, mixed prefills and decodes included


class QueryLenSupport(enum.IntEnum):
    """Which decode query lengths a metadata builder serves on its decode path (speculative decoding verifies
    1 + k tokens per request as a decode)."""

    SINGLE = 0  # every decode has query_len 1
    UNIFORM = 1  # every decode of a batch has the same query_len, up to max_decode_query_len
    VARLEN = 2  # decodes of one batch may differ in query_len, each up to max_decode_query_len


class AttentionBackend(ABC):
    """Static facts about a backend: what it supports, its cache layout, and its builder and impl classes.

    Never instantiated. Capabilities are class attributes (data); :meth:`not_supported_reasons` checks a spec and a
    device against them, and subclasses extend it by calling ``super()`` and appending their own reasons.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Capabilities as data. None means "any".
    supported_dtypes: ClassVar[frozenset[str]] = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"auto", "float16", "bfloat16"})
    supported_head_sizes: ClassVar[Optional[frozenset[int]]] = None
    min_head_size: ClassVar[int] = 1
    max_head_size: ClassVar[Optional[int]] = None
    head_size_multiple: ClassVar[int] = 1
    block_size_multiple: ClassVar[int] = 1
    min_compute_capability: ClassVar[Optional[tuple[int, int]]] = None
    max_compute_capability: ClassVar[Optional[tuple[int, int]]] = None
    runs_on_cpu: ClassVar[bool] = False  # True: pure torch; "triton" also runs on the CPU under TRITON_INTERPRET=1
    needs_triton: ClassVar[bool] = False
    required_packages: ClassVar[tuple[str, ...]] = ()
    supported_attn_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    supports_sliding_window: ClassVar[bool] = False
    supports_alibi: ClassVar[bool] = False
    supports_logits_soft_cap: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    supports_separate_v_head_size: ClassVar[bool] = False
    #: The mask kinds (AttentionSpec.mask.kind) the backend serves, whether it serves a window that looks ahead
    #: (mask.window right > 0), and, per kind or "window_right" it declines, why (shown by `attnbackends explain`).
    supported_mask_kinds: ClassVar[frozenset[MaskKind]] = frozenset({MaskKind.CAUSAL})
    supports_window_right: ClassVar[bool] = False
    mask_decline_notes: ClassVar[dict[str, str]] = {}
    kv_cache_16bit_must_match_dtype: ClassVar[bool] = False  # True: a float16/bfloat16 cache must be the model dtype
    min_compute_capability_fp8_e4m3: ClassVar[Optional[tuple[int, int]]] = None  # e4m3 cache conversions need this
    is_mla: ClassVar[bool] = False  # True: serves MLA specs only; False: standard specs only
    supports_sparse_indexer: ClassVar[bool] = False  # True: serves sparse MLA specs (spec.sparse_indexer) only
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    kv_cache_layout: ClassVar[str] = STANDARD_KV_CACHE_LAYOUT

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The capability data as a plain dict (for `attnbackends list`)."""

        def fmt_cc(cc: Optional[tuple[int, int]]) -> Optional[str]:
            return None if cc is None else f"{cc[0]}.{cc[1]}"

        if cls.supported_head_sizes is not None:
            heads = ",".join(str(h) for h in sorted(cls.supported_head_sizes))
        else:
            upper = cls.max_head_size if cls.max_head_size is not None else "inf"
            heads = f"{cls.min_head_size}..{upper}" + (
                f" (multiple of {cls.head_size_multiple})" if cls.head_size_multiple > 1 else ""
            )
        features = [
            f
            for f, on in (
                ("sliding_window", cls.supports_sliding_window),
                ("alibi", cls.supports_alibi),
                ("soft_cap", cls.supports_logits_soft_cap),
                ("sinks", cls.supports_sinks),
                ("mla", cls.is_mla),
                ("sparse_mla", cls.supports_sparse_indexer),
            )
            if on
        ]
        return {
            "dtypes": sorted(cls.supported_dtypes),
            "kv_cache_dtypes": sorted(cls.supported_kv_cache_dtypes),
            "head_sizes": heads,
            "block_size_multiple": cls.block_size_multiple,
            "compute_capability": (fmt_cc(cls.min_compute_capability), fmt_cc(cls.max_compute_capability)),
            "cpu": cls.runs_on_cpu,
            "attn_types": sorted(t.value for t in cls.supported_attn_types),
            "features": features,
            "mask_kinds": [k.value for k in MaskKind if k in cls.supported_mask_kinds]
            + (["window_right"] if cls.supports_window_right else []),
            "cudagraph": cls.cudagraph_support.name,
            "packages": list(cls.required_packages),
            "speculative": cls.get_builder_cls().speculative_capability(),
        }

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        if cls.supported_head_sizes is not None:
            return head_size in cls.supported_head_sizes
        if head_size < cls.min_head_size or head_size % cls.head_size_multiple:
            return False
        return cls.max_head_size is None or head_size <= cls.max_head_size

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Every reason this backend cannot serve ``spec`` on ``device``; empty when it can."""
        reasons = cls.missing_packages()
        reasons += cls._device_reasons(device)
        reasons += cls.spec_reasons(spec)
        fp8_cc = cls.min_compute_capability_fp8_e4m3
        if (fp8_cc is not None and spec.kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_per_token_head", "nvfp4")
                and device.is_cuda):
            if device.compute_capability < fp8_cc:
                reasons.append(f"fp8 e4m3 values or scales in the KV cache ({spec.kv_cache_dtype}) need compute "
                               f"capability >= {fp8_cc[0]}.{fp8_cc[1]}")
        return reasons

    @classmethod
    def spec_reasons(cls, spec: AttentionSpec) -> list[str]:
        """The reasons this backend cannot serve ``spec`` on any device it runs on (no package or device checks)."""
        reasons: list[str] = []
        if spec.is_mla and not cls.is_mla:
            reasons.append("MLA specs need an MLA backend")
        if cls.is_mla and not spec.is_mla:
            reasons.append("serves MLA specs only (kv_lora_rank etc. unset)")
        if spec.is_sparse_mla and not cls.supports_sparse_indexer:
            reasons.append("sparse_indexer (DeepSeek sparse attention) set: this backend attends densely; a sparse "
                           "MLA backend serves it")
        if cls.supports_sparse_indexer and not spec.is_sparse_mla:
            reasons.append("serves sparse MLA specs only (sparse_indexer unset)")
        if spec.dtype not in cls.supported_dtypes:
            reasons.append(f"dtype {spec.dtype} not supported (supported: {', '.join(sorted(cls.supported_dtypes))})")
        if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            allowed = ", ".join(sorted(cls.supported_kv_cache_dtypes))
            why = (": its kernels do not read scales stored beside the pages" if spec.kv_cache_format.scales_in_pages
                   else "")
            reasons.append(f"kv_cache_dtype {spec.kv_cache_dtype} not supported{why} (supported: {allowed})")
        elif spec.kv_cache_format.scales_in_pages:
            try:
                kv_page_layout(spec)
            except ValueError as exc:
                reasons.append(str(exc))
        if not cls.supports_head_size(spec.head_size):
            reasons.append(f"head_size {spec.head_size} not supported (supported: {cls.capabilities()['head_sizes']})")
        if (
            not spec.is_mla
            and spec.head_size_v is not None
            and spec.head_size_v != spec.head_size
            and not cls.supports_separate_v_head_size
        ):
            reasons.append(f"head_size_v ({spec.head_size_v}) != head_size ({spec.head_size}) not supported")
        if (
            cls.kv_cache_16bit_must_match_dtype
            and not spec.is_fp8_kv_cache
            and not spec.kv_cache_format.scales_in_pages
            and spec.kv_cache_dtype not in ("auto", spec.dtype)
        ):
            reasons.append(
                f"kv_cache_dtype {spec.kv_cache_dtype} with dtype {spec.dtype}: a 16-bit cache must match the model "
                "dtype (use auto or fp8)"
            )
        if spec.block_size % cls.block_size_multiple:
            reasons.append(f"block_size {spec.block_size} is not a multiple of {cls.block_size_multiple}")
        if spec.attn_type not in cls.supported_attn_types:
            allowed = ", ".join(sorted(t.value for t in cls.supported_attn_types))
            reasons.append(f"attn_type {spec.attn_type.value} not supported (supported: {allowed})")
        if spec.num_speculative_tokens or spec.speculative_tree:
            reasons += cls.get_builder_cls().speculative_reasons(spec)
        for feature, wanted, supported in (
            ("sliding window", spec.sliding_window is not None, cls.supports_sliding_window),
            ("ALiBi", spec.alibi_slopes is not None, cls.supports_alibi),
            ("logit soft-cap", spec.logits_soft_cap is not None, cls.supports_logits_soft_cap),
            ("attention sinks", spec.has_sinks, cls.supports_sinks),
        ):
            if wanted and not supported:
                reasons.append(f"{feature} not supported")
        reasons += cls.mask_reasons(spec)
        return reasons

    @classmethod
    def mask_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Why the backend cannot serve the layer's mask (:class:`~attnbackends.spec.AttentionMask`): its kind, a
        window that looks ahead, or a window at all; empty when it can."""
        reasons = []
        kind, window = spec.mask.kind, spec.mask.window
        if kind not in cls.supported_mask_kinds:
            allowed = ", ".join(k.value for k in MaskKind if k in cls.supported_mask_kinds)
            note = cls.mask_decline_notes.get(kind.value)
            reasons.append(f"mask kind {kind.value!r} not supported (supported: {allowed})"
                           + (f": {note}" if note else ""))
        if window is not None and window[1] > 0 and not cls.supports_window_right:
            note = cls.mask_decline_notes.get("window_right")
            reasons.append(f"two-sided window {window} (keys after the query) not supported"
                           + (f": {note}" if note else ""))
        elif window is not None and not cls.supports_sliding_window:
            reasons.append("sliding window not supported")
        return reasons

    @classmethod
    def missing_packages(cls) -> list[str]:
        """What this backend needs installed and is not, one reason each ("flashinfer is not installed"); empty
        when everything is. The one check behind the package reasons of :meth:`not_supported_reasons` and the status
        `attnbackends list` shows. Default: the :attr:`required_packages` that cannot be imported; a backend whose
        package comes in several forms (flash-attn's generations) overrides it."""
        return [f"{pkg} is not installed" for pkg in cls.required_packages if not _platform.package_available(pkg)]

    @classmethod
    def install_hint(cls) -> str:
        """The command that installs :attr:`required_packages` (the attnbackends extra that brings them), or ""."""
        extras = sorted({INSTALL_EXTRAS[p] for p in cls.required_packages if p in INSTALL_EXTRAS})
        return f"pip install 'attnbackends[{','.join(extras)}]'" if extras else ""

    @classmethod
    def _device_reasons(cls, device: DeviceInfo) -> list[str]:
        if not device.is_cuda:
            if cls.runs_on_cpu:
                return []
            if cls.needs_triton and device.triton_interpreted:
                return []
            if cls.needs_triton:
                return ["needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"]
            return ["needs a CUDA GPU"]
        cc = device.compute_capability
        reasons = []
        if cls.min_compute_capability is not None and cc < cls.min_compute_capability:
            lo = cls.min_compute_capability
            reasons.append(f"compute capability {cc[0]}.{cc[1]} < {lo[0]}.{lo[1]}")
        if cls.max_compute_capability is not None and cc > cls.max_compute_capability:
            hi = cls.max_compute_capability
            reasons.append(f"compute capability {cc[0]}.{cc[1]} > {hi[0]}.{hi[1]}")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        """Shape of one layer's KV cache: [num_blocks, 2, block_size, num_kv_heads, head_size] by default
        (head_size // 2 for the formats that pack two values a byte)."""
        return (num_blocks, 2, spec.block_size, spec.num_kv_heads, kv_page_layout(spec).storage_head_size)

    @classmethod
    def allocate_kv_cache(
        cls, num_blocks: int, spec: AttentionSpec, device: "torch.device | str" = "cpu"
    ) -> torch.Tensor:
        """An UNINITIALISED KV cache for one layer, in this backend's layout and the spec's cache dtype.

        Its memory holds whatever was there before (possibly NaN): only slots the impls have written (through
        ``forward`` or ``update_kv_cache``) may be attended over; context a batch claims but never wrote is garbage.

        A format whose scales are written with the tokens (``kv_cache_dtype`` per token and head, or NVFP4) keeps
        them beside its pages: one page is its K values, its V values, then their scales
        (:mod:`attnbackends.ops.kv_layout` has the byte layout), and the tensor returned is the values' view
        ``[num_blocks, 2, block_size, num_kv_heads, head_size (or head_size // 2 packed)]`` whose block stride is
        the whole page (:func:`attnbackends.ops.kv_layout.kv_scale_views` gives the scales).
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        device = check_device_available(device)
        if spec.kv_cache_format.scales_in_pages:
            return allocate_kv_cache_pages(num_blocks, spec, device)
        return torch.empty(cls.kv_cache_shape(num_blocks, spec), dtype=spec.kv_cache_torch_dtype, device=device)

    @classmethod
    def kernel_notes(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """Which kernels serve ``spec`` on ``device`` where the backend has several (one line each; shown by
        :func:`attnbackends.explain` for the chosen backend). Default: none to tell."""
        return []

    @classmethod
    def warmup(cls, specs: typing.Sequence[AttentionSpec], device: DeviceInfo) -> list[str]:
        """Build ahead of time what serving ``specs`` on ``device`` would otherwise compile during the first steps and
        a first step of each kind does not already build (FlashInfer's JIT modules); returns the names of what was
        built, empty when there is nothing to build.

        :func:`attnbackends.selection.warmup.warmup` calls it in a background thread for every backend that
        overrides it, runs the warm-up steps of the other backends meanwhile, and those of this backend after it.
        Default: nothing to build (kernels compile on a step's first use)."""
        return []

    @classmethod
    def environment_facts(cls) -> dict[str, Optional[str]]:
        """What is installed behind this backend that changes its speed, as ``{library: version}`` (None: not
        installed), e.g. ``{"flashinfer": "0.6.13"}``; imports nothing. Facts are named by library, so backends
        over one library report the same fact. A tune profile's key holds the facts of every registered backend
        (:func:`attnbackends.selection.registry.environment_facts`): a profile measured with other versions is not
        used. Default: none (torch's and triton's versions are in every key)."""
        return {}

    @classmethod
    @abstractmethod
    def get_builder_cls(cls) -> type["AttentionMetadataBuilder"]:
        """The metadata builder class."""

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type["AttentionImplBase"]:
        """The per-layer impl class."""


def _scale_value(name: str, value: Any, spec: AttentionSpec) -> float:
    """An fp8 scale as a float: positive and finite, a number or a one-element tensor; other than 1 only for an fp8
    cache (a 16-bit cache stores values unscaled, so a scale there is a mix-up)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number (a per-tensor scale), got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive finite number, got {type(value).__name__}")
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    if value != 1.0 and not spec.kv_cache_format.uses_tensor_scale:
        raise ValueError(f"{name}={value} given but kv_cache_dtype is {spec.kv_cache_dtype!r}: per-tensor scales apply "
                         "to fp8 caches (kv_cache_dtype 'fp8', 'fp8_e4m3' or 'fp8_e5m2') and to NVFP4's global scale "
                         "only (per-token-head formats compute theirs on write); leave the scale at 1.0")
    return value


def _with_batch_checks(build: Callable) -> Callable:
    """``build`` that first checks the batch (:func:`~attnbackends.validation.check_batch_limits`,
    :func:`~attnbackends.validation.check_batch_for_spec`, :meth:`AttentionMetadataBuilder.check_page_ids`) and marks
    the metadata it returns with its origin (:meth:`AttentionMetadataBuilder.mark_origin`)."""

    @functools.wraps(build)
    def checked_build(self: "AttentionMetadataBuilder", common: CommonAttentionMetadata, *args: Any,
                      **kwargs: Any) -> Any:
        if not isinstance(common, CommonAttentionMetadata):
            raise ValueError(f"common must be a CommonAttentionMetadata (see build_common_metadata), got "
                             f"{type(common).__name__}")
        check_metadata_tensors(common, self.device)
        check_batch_limits(self, common)
        check_batch_for_spec(self.spec, common)
        self.check_page_ids(common)
        return self.mark_origin(build(self, common, *args, **kwargs))

    checked_build.checks_batch = True
    return checked_build


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Built once per model; :meth:`build` turns one batch's common metadata into this backend's metadata.

    Every subclass's ``build`` and ``build_for_cudagraph_capture`` first check the batch against the builder's
    limits (:func:`attnbackends.validation.check_batch_limits`, host integers only: an empty batch, more than
    ``max_num_reqs`` requests or ``max_num_tokens`` tokens is a ValueError), against its spec
    (:func:`attnbackends.validation.check_batch_for_spec`: the page size, causality, cached context of layers
    without a cache, and the slots against the block table where both are on the host) and, when the builder
    knows ``num_blocks``, the page ids against the cache (:meth:`check_page_ids`); they mark the metadata they
    return with its :class:`~attnbackends.metadata.MetadataOrigin` (``metadata.origin``: this builder's class, the
    spec fields that matter and ``num_blocks``), which every impl's ``forward`` compares with its own layer and
    cache; subclasses get this without code. Nothing writes to the metadata after ``build`` returns.

    Parameters
    ----------
    spec : the spec of the layers this builder serves (all layers sharing it must agree on it).
    device : where the batch tensors live.
    max_num_reqs, max_num_tokens : the largest batch ``build`` accepts (persistent buffers are sized by them: CUDA
        graphs replay on fixed addresses).
    num_blocks : pages of the KV cache of every layer this builder serves (``kv_cache.shape[0]``). Engines should
        pass it: ``build`` then range-checks the batch's page ids once per batch (every build: an engine's
        persistent block table may have been rewritten in place since the last one) and contains the page ids it
        gathers, and ``forward`` only compares its cache's page count with it (a ValueError naming both where they
        differ). None: ``build`` cannot check the page ids, so every layer's ``forward`` checks them (correct, but
        one block-table check per layer instead of one per batch).

    Speculative decoding: a spec with ``num_speculative_tokens = k`` raises this builder's
    ``reorder_batch_threshold`` to ``1 + k`` (an instance attribute set here), so verify requests of up to 1 + k
    tokens count as decodes; the class declares what it can serve (``query_len_support``,
    ``max_decode_query_len``, ``supports_tree_mask``) and :meth:`speculative_reasons` checks a spec against it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("build", "build_for_cudagraph_capture"):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "checks_batch", False):
                setattr(cls, name, _with_batch_checks(method))

    #: Requests with query_len <= this count as decodes; the engine puts them first in the batch.
    reorder_batch_threshold: ClassVar[int] = 1
    #: Decode query lengths the decode path serves, and the longest (1 + the deepest speculation).
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.SINGLE
    max_decode_query_len: ClassVar[int] = 1
    #: Whether ``build`` honours ``CommonAttentionMetadata.spec_tree_mask`` (tree verification).
    supports_tree_mask: ClassVar[bool] = False

    @classmethod
    def speculative_capability(cls) -> str:
        """The declared speculative support in words (for `attnbackends list`)."""
        if cls.query_len_support is QueryLenSupport.SINGLE:
            return "single-token decodes only"
        kind = "uniform" if cls.query_len_support is QueryLenSupport.UNIFORM else "any mix of"
        trees = "tree masks" if cls.supports_tree_mask else "no tree masks"
        return f"{kind} decodes of up to {cls.max_decode_query_len} tokens; {trees}"

    @classmethod
    def speculative_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Why this builder cannot serve ``spec``'s speculative decoding (empty when it can)."""
        reasons = []
        want = 1 + spec.num_speculative_tokens
        if want > 1 and (cls.query_len_support is QueryLenSupport.SINGLE or want > cls.max_decode_query_len):
            reasons.append(
                f"num_speculative_tokens {spec.num_speculative_tokens} needs decodes of {want} tokens; this backend "
                f"decodes {cls.query_len_support.name.lower()} query lengths up to {cls.max_decode_query_len}"
            )
        if spec.speculative_tree and not cls.supports_tree_mask:
            reasons.append("speculative_tree: tree verification (spec_tree_mask) not supported")
        return reasons

    def __init__(
        self,
        spec: AttentionSpec,
        device: "torch.device | str" = "cpu",
        *,
        max_num_reqs: int = 256,
        max_num_tokens: int = 8192,
        debug: bool = False,
        num_blocks: Optional[int] = None,
    ) -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_tokens", max_num_tokens)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral)
                                       or num_blocks < 1):
            raise ValueError(f"num_blocks must be None or a positive int (the KV cache's pages), got {num_blocks!r}")
        self.spec = spec
        self.device = check_device_available(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.debug = debug
        self.num_blocks: Optional[int] = None if num_blocks is None else int(num_blocks)
        if spec.num_speculative_tokens:
            reasons = self.speculative_reasons(spec)
            if reasons:
                raise NotImplementedError(f"{type(self).__name__}: " + "; ".join(reasons))
            self.reorder_batch_threshold = max(self.reorder_batch_threshold, 1 + spec.num_speculative_tokens)

    def check_page_ids(self, common: CommonAttentionMetadata) -> None:
        """Range-check the page ids ``common`` uses against :attr:`num_blocks` (nothing when it is None or the layers
        have no KV cache): raises a fault an earlier step recorded, then checks a host block table now
        (:class:`~attnbackends.ops.page_guard.PageTableError` naming the entry) or scans a device-only one on the
        device, recording a fault without a host-device sync (:func:`~attnbackends.ops.page_guard.guard_block_table`).
        Every checked ``build`` calls it; a builder that plans outside ``build`` (draft steps) calls it itself."""
        if self.num_blocks is not None and self.spec.attn_type.uses_kv_cache:
            guard_block_table(common, self.num_blocks, self.spec.block_size)

    def mark_origin(self, metadata: M) -> M:
        """``metadata`` with its :class:`~attnbackends.metadata.MetadataOrigin` set (``metadata.origin``; made once
        per builder); returns it. Only for metadata whose batch :meth:`check_page_ids` has checked: the origin's
        ``num_blocks`` tells ``forward`` that it need not check the page ids again."""
        origin = self.__dict__.get("_metadata_origin")
        if origin is None or origin.builder is not type(self) or origin.num_blocks != self.num_blocks:
            origin = self._metadata_origin = MetadataOrigin.of(type(self), self.spec, self.num_blocks, self.device)
        try:
            object.__setattr__(metadata, "origin", origin)
        except (AttributeError, TypeError):  # an object without a __dict__: nothing recorded, forward checks its type
            pass
        return metadata

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M:
        """This backend's metadata for one batch, shared by every layer.

        The host may build the next batch before the GPU has run this one's kernels (an engine schedules step N + 1
        while step N runs): the metadata must stay valid until the kernels that use it have run, whatever is built
        after it. A host buffer that the next build rewrites while an asynchronous copy from it is still pending
        breaks this; :func:`attnbackends.testing.check_backend_run_ahead` checks it.
        """

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> M:
        """Metadata for a capture-time batch; by default the same as :meth:`build`."""
        return self.build(common)

    def build_draft_steps(self, draft: "DraftSteps") -> list[M]:
        """The metadata of every draft step at once (:mod:`attnbackends.speculative.draft_steps`: ``topk`` branches per request
        over shared prefix pages, one single-token decode per branch and step), each valid until the next call.

        Made from host data only, so building them does not wait on the device; the steps then run one after
        another (they may share the builder's buffers, never each other's plans). By default one :meth:`build`
        per step; builders whose metadata holds a planned object (FlashInfer's wrappers) keep one per step.
        """
        return [self.build(common) for common in draft.steps]


class AttentionImplBase(ABC, Generic[M]):
    """What every impl shares (one per layer): the spec, the scales, the sinks, the validation state. Each kind of
    layer has its own contract on top: :class:`AttentionImpl` (query, key, value) and
    :class:`MLAAttentionImpl` (latent MLA).

    Parameters
    ----------
    spec : the layer's spec.
    sinks : [num_heads] float32, the learned sink logits, when ``spec.has_sinks``.
    k_scale, v_scale : per-tensor fp8 KV-cache scales (stored = saturate(x / scale)), positive and finite; must stay
        1.0 for a 16-bit cache.
    debug : check the inputs and the batch's block table on every ``forward`` (see :mod:`attnbackends.validation`);
        without it, inputs are checked on the first call only (and on every call whose metadata a builder made
        with ``debug=True``).

    Capabilities (class attributes, data like the backend's):

    can_return_lse : the impl implements :meth:`forward_with_lse`, the partial attention with its log-sum-exp that
        context-parallel decode (:mod:`attnbackends.parallel.decode_cp`) merges across ranks.
    """

    can_return_lse: ClassVar[bool] = False
    #: The origin (``metadata.origin``) of the last metadata this impl accepted: later metadata of the same origin
    #: pass the per-call check with one identity comparison.
    _accepted_origin: Any = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("forward")
        if callable(method) and not getattr(method, "__isabstractmethod__", False) \
                and not getattr(method, "checks_metadata", False):
            cls.forward = _with_metadata_check(method)

    def check_metadata(self, metadata: Any) -> None:
        """What every ``forward`` checks first (subclasses get it without code): ``metadata`` is what this layer's
        backend's builder built for this layer's spec. A :class:`~attnbackends.CommonAttentionMetadata`, another
        backend's metadata, or metadata built for a spec that differs in a field its plan depends on (block size,
        heads, head sizes, dtype, attention type; see :class:`~attnbackends.metadata.MetadataOrigin`) is a
        ValueError naming what was expected. Costs one identity comparison per call once an origin was accepted."""
        impl_cls = type(self)
        expected = _metadata_type(impl_cls)
        origin = getattr(metadata, "origin", None)
        built_by = f" built by {origin.builder.__name__}" if isinstance(origin, MetadataOrigin) else ""
        builders = _builders_of(impl_cls)
        takes = expected.__name__ if expected is not None else "metadata"
        if builders:
            takes += " from " + " or ".join(f"{b.__name__}.build(common)" for b in builders)
        if isinstance(metadata, CommonAttentionMetadata):
            raise ValueError(f"metadata is a CommonAttentionMetadata, but {impl_cls.__name__}.forward takes the "
                             f"{takes}: build it once per step with this layer's backend's builder")
        if expected is not None and not isinstance(metadata, expected):
            raise ValueError(f"metadata of type {type(metadata).__name__}{built_by} is another backend's metadata: "
                             f"{impl_cls.__name__}.forward takes the {takes}")
        if not isinstance(origin, MetadataOrigin):
            return  # not made by a builder's build(): no origin to compare (the type matched)
        if builders and not issubclass(origin.builder, builders):
            raise ValueError(f"metadata was built by {origin.builder.__name__}, another backend's builder: "
                             f"{impl_cls.__name__}.forward takes the {takes}")
        diffs = origin.differences(self.spec)
        if diffs:
            raise ValueError(f"metadata was built for another layer's spec ({'; '.join(diffs)}): build this "
                             "layer's metadata with a builder made for its spec (one builder per group of equal "
                             "specs)")
        layout = getattr(self, "_input_layout", None)  # the device of the query the last full validation saw
        if origin.device is not None and layout is not None and not same_device(layout[0][4], origin.device):
            raise ValueError(f"metadata was built on {origin.device} (its builder's device: block_table, seq_lens "
                             f"and the rest live there), but this layer's query and kv_cache are on "
                             f"{layout[0][4]}: build it with a builder on the layer's device")
        self._accepted_origin = origin

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        sinks: Optional[torch.Tensor] = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        debug: bool = False,
    ) -> None:
        if spec.has_sinks and sinks is None:
            raise ValueError("spec.has_sinks is set: pass sinks, a [num_heads] tensor of sink logits")
        if sinks is not None:
            if not spec.has_sinks:
                raise ValueError("sinks given but spec.has_sinks is False")
            if sinks.shape != (spec.num_heads,):
                raise ValueError(f"sinks must have shape ({spec.num_heads},), got {tuple(sinks.shape)}")
            sinks = sinks.float()
        k_scale, v_scale = _scale_value("k_scale", k_scale, spec), _scale_value("v_scale", v_scale, spec)
        self.spec = spec
        self.sinks = sinks
        self.k_scale = float(k_scale)
        self.v_scale = float(v_scale)
        self.scale = spec.softmax_scale
        self.debug = bool(debug)
        self._input_layout: Optional[tuple] = None  # recorded by the first forward's full validation


def _with_metadata_check(forward: Callable) -> Callable:
    """``forward`` that first checks its ``metadata`` argument (the fifth, in every impl's contract) with
    :meth:`AttentionImplBase.check_metadata`, unless it carries the origin this impl accepted last."""

    @functools.wraps(forward)
    def checked_forward(self: "AttentionImplBase", *args: Any, **kwargs: Any) -> Any:
        metadata = args[4] if len(args) > 4 else kwargs.get("metadata")
        if getattr(metadata, "origin", None) is not self._accepted_origin or self._accepted_origin is None:
            self.check_metadata(metadata)
        return forward(self, *args, **kwargs)

    checked_forward.checks_metadata = True
    return checked_forward


@functools.lru_cache(maxsize=None)
def _metadata_type(impl_cls: type) -> Optional[type]:
    """The metadata class an impl class declares (``AttentionImpl[ReferenceMetadata]``), None if it declares none."""
    for klass in impl_cls.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, AttentionImplBase):
                args = typing.get_args(base)
                if args and isinstance(args[0], type):
                    return args[0]
    return None


def _builders_of(impl_cls: type) -> tuple[type, ...]:
    """The builder classes of the backends whose impl is ``impl_cls`` (the backend classes defined so far); read
    on the slow path only (a new metadata origin, a mismatch)."""
    found: list[type] = []
    stack = list(AttentionBackend.__subclasses__())
    seen: set[type] = set()
    while stack:
        backend = stack.pop()
        if backend in seen:
            continue
        seen.add(backend)
        stack.extend(backend.__subclasses__())
        try:
            if backend.get_impl_cls() is impl_cls:
                builder = backend.get_builder_cls()
                if isinstance(builder, type) and builder not in found:
                    found.append(builder)
        except Exception:  # an abstract or half-configured backend class (e.g. a base without its parts)
            continue
    return tuple(found)


class AttentionImpl(AttentionImplBase[M]):
    """One standard attention layer: writes its new K/V into its cache and computes attention (parameters as in
    :class:`AttentionImplBase`)."""

    @abstractmethod
    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write new tokens into the cache.

        key : [num_tokens, num_kv_heads, head_size]; value : [num_tokens, num_kv_heads, value_head_size];
        slot_mapping : [num_tokens] int64, -1 = padding (skipped).
        """

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: M,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Attention for one batch, written into ``output``.

        query : [num_tokens, num_heads, head_size]
        key, value : [num_tokens, num_kv_heads, head_size] new tokens' K and V (written to the cache first), or
            None when the cache already holds them (cross-attention after its first step).
        kv_cache : this layer's cache in the backend's layout, or None for encoder layers without a cache.
        output : [num_tokens, num_heads, value_head_size]; rows past num_actual_tokens are left untouched.
        Returns ``output``.
        """

    def forward_with_lse(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        common: CommonAttentionMetadata,
        output: torch.Tensor,
        lse: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode queries over every key the cache holds for them, with the log-sum-exp (impls with
        ``can_return_lse``).

        Every cached key of a request precedes its queries (a context-parallel rank's shard), so all are visible:
        no causal mask, no sinks (they join the merged softmax once), nothing is written to the cache.

        Parameters
        ----------
        query : [num_tokens, num_heads, head_size]
        kv_cache : this layer's cache in the backend's layout.
        common : the batch over this cache's keys; a request's seq_len may be 0 (no key here).
        output : [num_tokens, num_heads, value_head_size] float32 or the query dtype; normalised over the keys.
        lse : [num_heads, num_tokens] float32; natural-log log-sum-exp of the scaled (soft-capped) logits.

        Returns
        -------
        (output, lse); a request without keys gets output 0 and lse -inf.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot return its log-sum-exp (can_return_lse is False)"
        )


class MLAAttentionImpl(AttentionImplBase[M]):
    """One multi-head latent attention layer (DeepSeek-V2/V3): writes its new tokens' latent vectors into its
    latent cache and computes attention from it (the MLA semantics of DESIGN.md).

    Notation: N query heads, latent Lkv = kv_lora_rank, rope R = qk_rope_head_dim, nope P = qk_nope_head_dim,
    V = v_head_dim. The cache is [num_blocks, block_size, Lkv + R], one latent vector c = [kv_c ; k_pe] per token.

    Parameters
    ----------
    spec : an MLA spec (:meth:`AttentionSpec.mla`).
    kv_b_proj : [N * (P + V), Lkv] up-projection weight (nn.Linear layout: [k_nope ; v] of head n are rows
        n * (P + V) ... of ``kv_c @ kv_b_proj.T``), in the model dtype.
    k_scale : fp8 scale of the latent cache (stored = saturate(c / k_scale)); ignored for other cache dtypes.
    v_scale : the cache holds one latent per token, read with k_scale alone: None, 1.0 or equal to k_scale;
        anything else is a ValueError.
    """

    def __init__(self, spec: AttentionSpec, *, kv_b_proj: torch.Tensor, k_scale: float = 1.0,
                 v_scale: Optional[float] = None, **kwargs: Any) -> None:
        if not spec.is_mla:
            raise ValueError("MLA impls need an MLA spec (AttentionSpec.mla(...))")
        if v_scale is not None and float(v_scale) not in (1.0, float(k_scale)):
            raise ValueError(
                f"v_scale={v_scale} is not supported by MLA: the latent cache has one scale, k_scale={k_scale} "
                "(values are read from the same latent); pass v_scale=None, 1.0 or k_scale"
            )
        super().__init__(spec, k_scale=k_scale, v_scale=k_scale, **kwargs)
        n, p, v, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
        if kv_b_proj.shape != (n * (p + v), lkv):
            raise ValueError(
                f"kv_b_proj must have shape ({n * (p + v)}, {lkv}) = (N * (P + V), Lkv), got {tuple(kv_b_proj.shape)}"
            )
        self.kv_b_proj = kv_b_proj

    def process_weights_after_loading(self) -> None:
        """Called once after the weights are final (``kv_b_proj`` included); impls derive their weights here."""

    @abstractmethod
    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        """Write latent tokens into the cache.

        kv_c_normed : [T, Lkv]; k_pe : [T, R] (model dtype); kv_cache : [num_blocks, block_size, Lkv + R];
        slot_mapping : [T] int64, -1 = padding (skipped).
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        kv_c_normed: Optional[torch.Tensor],
        k_pe: Optional[torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: M,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """MLA attention for one batch, written into ``output``.

        Parameters
        ----------
        q : [T, N, P + R] queries, [q_nope ; q_pe] per head, model dtype.
        kv_c_normed : [T, Lkv] the new tokens' normalised latent KV (written to the cache first), or None when the
            cache already holds them.
        k_pe : [T, R] their rotary key part (one per token, shared by the heads), or None with kv_c_normed.
        kv_cache : [num_blocks, block_size, Lkv + R] in the cache dtype.
        metadata : from this backend's builder; decodes come first.
        output : [T, N, V]; rows past num_actual_tokens are left untouched.

        Returns
        -------
        output
        """

    def check_inputs(self, q, kv_c_normed, k_pe, kv_cache, metadata, output) -> None:
        """The validation hook (:func:`attnbackends.validation.check_forward_inputs`): tensors on the first call,
        tensors and the block table on every call in debug mode. Every ``forward`` calls it first."""
        check_forward_inputs(self, metadata, metadata.common, q, kv_c_normed, k_pe, kv_cache, output, mla=True)
