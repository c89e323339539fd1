"""What a Triton builder decides once, at construction: its options, validated here, and the kernel that serves
each kind of batch with prefills, each with the reason it was chosen.

:class:`TritonBuilderOptions` holds the builder's keyword options (a frozen dataclass that checks them);
:meth:`TritonKernelChoices.decide` turns them, the layer's spec and the device into one :class:`KernelChoice` per
decision: an enum member (which kernel, or which rule) and the reason in words. The builder plans every batch from
these (:meth:`attnbackends.triton.backend.TritonMetadataBuilder.build`), and ``attnbackends explain`` tells them
(:meth:`attnbackends.triton.backend.TritonAttentionBackend.kernel_notes`, from a default builder's choices).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

from .kv_load import quantised_cache_reason
from ..spec import AttentionSpec
from .dequant_prefill import default_max_pages
from .prefill_hopper import HopperPrefillConfig, cache_write_reason, hopper_prefill_reason
from .prefill_hopper_paged import PAGED_PREFILL_DEFAULT, paged_prefill_reason
from .prefill_launch import prefill_new_kv_unsupported_reason
from .decode_schedule import DECODE_SCHEDULE_MODES

__all__ = [
    "MaskPath",
    "FreshPrefillCacheWrite",
    "FreshPrefillKernel",
    "KernelChoice",
    "PagedPrefill",
    "PrefillSplit",
    "QuantisedPrefill",
    "TritonBuilderOptions",
    "TritonKernelChoices",
]


class PrefillSplit(enum.Enum):
    """Which batches with prefills run split: the decodes on the unified kernel, the prefills on a prefill kernel
    that reads the step's new keys and values from the forward (:mod:`.prefill_kernel`, or :mod:`.prefill_hopper`
    for fresh prompts: :class:`FreshPrefillKernel`)."""

    #: None: the unified kernel serves every batch's prefills (or the paged Gluon kernel: :class:`PagedPrefill`).
    OFF = "off"
    #: The batches whose new tokens' work is at least their cached context's
    #: (:func:`.heuristics.prefill_kernel_pays`).
    WHERE_IT_PAYS = "where it pays"
    #: Every batch with prefills.
    EVERY_BATCH = "every batch"


class FreshPrefillKernel(enum.Enum):
    """The kernel of a split batch whose prefills have no cached context (fresh prompts)."""

    #: The Gluon warp-specialised Hopper kernel (:mod:`.prefill_hopper`).
    GLUON_HOPPER = "gluon hopper"
    #: The kernel the batch's other prefills would run on: the paged Gluon kernel where the builder planned it, else
    #: the Triton prefill kernel.
    AS_OTHER_PREFILLS = "as other prefills"


class PagedPrefill(enum.Enum):
    """Whether batches with prefills plan the paged Gluon Hopper kernel (:mod:`.prefill_hopper_paged`: every key
    from the cache's pages; chunks on cached context and ``key=None`` steps included)."""

    #: Planned for every causal batch with prefills (used where the forward's rows and cache fit its TMA views).
    GLUON_HOPPER_PAGED = "gluon hopper paged"
    #: Not planned: such batches run split (:class:`PrefillSplit`) or on the unified kernel.
    OFF = "off"


class FreshPrefillCacheWrite(enum.Enum):
    """Who writes the step's keys and values into the cache for a batch of fresh prompts only (no decodes) on the
    Gluon Hopper kernel."""

    #: The kernel itself, whole pages by TMA stores from a writer warp; the write kernel the tokens it leaves.
    IN_KERNEL = "in kernel"
    #: The write kernel: first, or beside the prefill on the SMs it leaves (:mod:`.write_beside`).
    WRITE_KERNEL = "write kernel"


class QuantisedPrefill(enum.Enum):
    """How the prefills of a layer whose cache has page scales run (:mod:`.dequant_prefill`)."""

    #: The cache has no page scales: the choices above serve its prefills.
    NOT_QUANTISED = "not quantised"
    #: The pages they read dequantised into a 16-bit scratch, then the paged Gluon Hopper kernel over it.
    DEQUANTISED_GLUON_PAGED = "dequantised pages, paged gluon hopper"
    #: The pages they read dequantised into a 16-bit scratch, then the unified kernel over it (asked for where the
    #: Gluon kernel does not serve the layer: the CPU's interpreter runs this path end to end).
    DEQUANTISED_UNIFIED = "dequantised pages, unified"
    #: The unified kernel over the quantised pages.
    UNIFIED = "unified"


class MaskPath(enum.Enum):
    """Which kernels serve the layer's mask (:class:`attnbackends.spec.AttentionMask`)."""

    #: Causal (with a one-sided window or none): every kernel, the prefill kernels and the balanced decode schedule
    #: included.
    EVERY_KERNEL = "every kernel"
    #: Another kind or a window that looks ahead: the unified kernel serves every batch, its decodes on the uniform
    #: split (the Gluon and Triton prefill kernels and the balanced decode schedule serve causal masks only).
    UNIFIED_ONLY = "unified kernel only"


#: Why the prefill kernels and the balanced decode schedule decline a masked layer.
MASK_DECLINE = "the layer's mask ({}) is served by the unified kernel only (the prefill kernels and the balanced " \
               "decode schedule serve causal masks)"


def mask_reason(spec: AttentionSpec) -> Optional[str]:
    """Why the prefill kernels and the balanced decode schedule do not serve ``spec``'s mask; None where they do."""
    return MASK_DECLINE.format(spec.mask.describe()) if spec.has_extended_mask else None


E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True)
class KernelChoice(Generic[E]):
    """One decision of the builder: ``kernel`` (a member of the decision's enum) and why it was made, in words."""

    kernel: E
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, enum.Enum):
            raise TypeError(f"kernel must be an enum member, got {self.kernel!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError(f"a kernel choice needs its reason in words, got {self.reason!r}")

    def __str__(self) -> str:
        return f"{self.kernel.value}: {self.reason}"


def _optional_bool(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be None, True or False, got {value!r}")


@dataclass(frozen=True)
class TritonBuilderOptions:
    """The Triton builder's options (its keyword arguments; meanings in
    :class:`attnbackends.triton.backend.TritonMetadataBuilder`), checked when made: each a bool where a bool is
    meant, ``prefill_kernel``, ``hopper_paged_prefill`` and ``dequant_prefill`` also None (the default rule),
    ``cache_write_sms`` None (the rule's choice per batch) or an int >= 0 (the device's SM count bounds it:
    :meth:`TritonKernelChoices.decide`), ``decode_schedule`` one of :data:`~.decode_schedule.DECODE_SCHEDULE_MODES`,
    ``dequant_prefill_max_pages`` None (:func:`.dequant_prefill.default_max_pages`) or an int >= 0."""

    deterministic: bool = False
    prefill_kernel: Optional[bool] = None
    hopper_prefill: bool = True
    overlap_decodes: bool = False
    hopper_cache_write: bool = True
    cache_write_sms: Optional[int] = None
    hopper_paged_prefill: Optional[bool] = None
    decode_schedule: str = "auto"
    dequant_prefill: Optional[bool] = None
    dequant_prefill_max_pages: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("deterministic", "hopper_prefill", "overlap_decodes", "hopper_cache_write"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        _optional_bool("prefill_kernel", self.prefill_kernel)
        _optional_bool("hopper_paged_prefill", self.hopper_paged_prefill)
        _optional_bool("dequant_prefill", self.dequant_prefill)
        pages = self.dequant_prefill_max_pages
        if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < 0):
            raise ValueError(f"dequant_prefill_max_pages must be None or an int >= 0 (pages of the 16-bit scratch), "
                             f"got {pages!r}")
        sms = self.cache_write_sms
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 0):
            raise ValueError(f"cache_write_sms must be None or an int >= 0 (SMs left to the cache write), got {sms!r}")
        if self.decode_schedule not in DECODE_SCHEDULE_MODES or (self.deterministic
                                                                 and self.decode_schedule == "balanced"):
            raise ValueError(f"decode_schedule must be one of {DECODE_SCHEDULE_MODES} (not 'balanced' with "
                             f"deterministic=True: its schedule is fixed), got {self.decode_schedule!r}")


@dataclass(frozen=True)
class TritonKernelChoices:
    """Every decision a Triton builder makes at construction (:meth:`decide`), which its ``build`` follows per batch.

    Attributes
    ----------
    prefill_split : which batches with prefills run split (decodes on the unified kernel, prefills on a prefill
        kernel that reads the forward's keys).
    fresh_prefill : the kernel of a split batch of fresh prompts.
    paged_prefill : whether batches with prefills plan the paged Gluon kernel.
    fresh_cache_write : who writes the cache for a batch of fresh prompts only on the Gluon kernel.
    overlap_decodes : a split batch runs its decodes and its prefill kernel on two CUDA streams (the option, on a
        CUDA device).
    cache_write_sms : SMs a batch of fresh prompts on the Gluon kernel leaves to a cache write beside it: None, the
        rule's choice per batch (:func:`.write_beside.cache_write_sms`); 0, the write runs first; k, k SMs.
    mask : which kernels serve the layer's mask (a masked layer: the unified kernel, decodes unscheduled).
    quantised_prefill : how the prefills of a layer whose cache has page scales run.
    dequant_max_pages : the most pages the dequantised prefills' scratch holds (a batch reading more runs its
        prefills on the unified kernel).
    """

    prefill_split: KernelChoice[PrefillSplit]
    fresh_prefill: KernelChoice[FreshPrefillKernel]
    paged_prefill: KernelChoice[PagedPrefill]
    fresh_cache_write: KernelChoice[FreshPrefillCacheWrite]
    overlap_decodes: bool
    cache_write_sms: Optional[int]
    mask: KernelChoice[MaskPath] = KernelChoice(MaskPath.EVERY_KERNEL, "a causal mask")
    quantised_prefill: KernelChoice[QuantisedPrefill] = KernelChoice(QuantisedPrefill.NOT_QUANTISED,
                                                                     "a cache without page scales")
    dequant_max_pages: int = 0

    @classmethod
    def decide(cls, spec: AttentionSpec, options: TritonBuilderOptions,
               compute_capability: "tuple[int, int] | None", *, interpreted: bool, is_cuda: bool,
               num_sms: int) -> "TritonKernelChoices":
        """The choices of a builder with ``options`` for layers ``spec`` on a device of ``compute_capability`` (None:
        not a CUDA device) with ``num_sms`` SMs; ``interpreted``: kernels run under the Triton interpreter.
        Raises ValueError for a ``cache_write_sms`` the device does not have."""
        if options.cache_write_sms is not None and options.cache_write_sms >= max(num_sms, 1):
            raise ValueError(f"cache_write_sms must be None or in [0, {num_sms}) (the device's SMs), got "
                             f"{options.cache_write_sms}")
        return cls(
            prefill_split=_prefill_split(spec, options, compute_capability, interpreted),
            fresh_prefill=_fresh_prefill(spec, options, compute_capability, interpreted),
            paged_prefill=_paged_prefill(spec, options, compute_capability, interpreted),
            fresh_cache_write=_fresh_cache_write(spec, options),
            overlap_decodes=options.overlap_decodes and is_cuda,
            cache_write_sms=options.cache_write_sms,
            mask=(KernelChoice(MaskPath.UNIFIED_ONLY, mask_reason(spec)) if mask_reason(spec)
                  else KernelChoice(MaskPath.EVERY_KERNEL, f"the layer's mask is {spec.mask.describe()}")),
            quantised_prefill=_quantised_prefill(spec, options, compute_capability, interpreted),
            dequant_max_pages=(options.dequant_prefill_max_pages if options.dequant_prefill_max_pages is not None
                               else default_max_pages(spec.block_size)),
        )


def _prefill_split(spec: AttentionSpec, options: TritonBuilderOptions, compute_capability: "tuple[int, int] | None",
                   interpreted: bool) -> KernelChoice[PrefillSplit]:
    wanted = options.prefill_kernel
    if wanted is False:
        return KernelChoice(PrefillSplit.OFF, "turned off (prefill_kernel=False)")
    if wanted is None and compute_capability is None:
        return KernelChoice(PrefillSplit.OFF, "off by default on the CPU (pass prefill_kernel=True to use it there)")
    if not spec.attn_type.uses_kv_cache:
        return KernelChoice(PrefillSplit.OFF, "encoder attention")
    if mask_reason(spec):
        return KernelChoice(PrefillSplit.OFF, mask_reason(spec))
    if quantised_cache_reason(spec):
        return KernelChoice(PrefillSplit.OFF, quantised_cache_reason(spec))
    why = prefill_new_kv_unsupported_reason(
        head_size=spec.head_size, dtype=spec.torch_dtype, kv_fp8=spec.is_fp8_kv_cache, causal=spec.causal,
        use_alibi=spec.alibi_slopes is not None, compute_capability=compute_capability, interpreted=interpreted,
        deterministic=options.deterministic)
    if why is not None:
        return KernelChoice(PrefillSplit.OFF, why)
    if wanted:
        return KernelChoice(PrefillSplit.EVERY_BATCH, "asked for (prefill_kernel=True)")
    return KernelChoice(PrefillSplit.WHERE_IT_PAYS, "the default where the prefill kernel serves the layer: batches "
                                                    "whose new tokens' work is at least their cached context's")


def _fresh_prefill(spec: AttentionSpec, options: TritonBuilderOptions, compute_capability: "tuple[int, int] | None",
                   interpreted: bool) -> KernelChoice[FreshPrefillKernel]:
    if not options.hopper_prefill:
        return KernelChoice(FreshPrefillKernel.AS_OTHER_PREFILLS, "turned off (hopper_prefill=False)")
    if mask_reason(spec):
        return KernelChoice(FreshPrefillKernel.AS_OTHER_PREFILLS, mask_reason(spec))
    why = quantised_cache_reason(spec) or hopper_prefill_reason(spec, compute_capability, interpreted=interpreted,
                                                                deterministic=options.deterministic)
    if why:
        return KernelChoice(FreshPrefillKernel.AS_OTHER_PREFILLS, why)
    return KernelChoice(FreshPrefillKernel.GLUON_HOPPER, "the Gluon Hopper kernel serves the layer on this device")


def _paged_prefill(spec: AttentionSpec, options: TritonBuilderOptions, compute_capability: "tuple[int, int] | None",
                   interpreted: bool) -> KernelChoice[PagedPrefill]:
    asked = options.hopper_paged_prefill
    if asked is False:
        return KernelChoice(PagedPrefill.OFF, "turned off (hopper_paged_prefill=False)")
    if asked is None and options.prefill_kernel is False:
        return KernelChoice(PagedPrefill.OFF, "turned off (prefill_kernel=False; hopper_paged_prefill=True turns it "
                                              "on alone)")
    if asked is None and not PAGED_PREFILL_DEFAULT:
        return KernelChoice(PagedPrefill.OFF, "off unless asked for (hopper_paged_prefill=True)")
    if mask_reason(spec):
        return KernelChoice(PagedPrefill.OFF, mask_reason(spec))
    why = quantised_cache_reason(spec) or paged_prefill_reason(spec, compute_capability, interpreted=interpreted,
                                                               deterministic=options.deterministic)
    if why:
        return KernelChoice(PagedPrefill.OFF, why)
    return KernelChoice(PagedPrefill.GLUON_HOPPER_PAGED, "asked for (hopper_paged_prefill=True)" if asked else
                        "the default where the paged Gluon Hopper kernel serves the layer")


def _fresh_cache_write(spec: AttentionSpec, options: TritonBuilderOptions) -> KernelChoice[FreshPrefillCacheWrite]:
    if not options.hopper_cache_write:
        return KernelChoice(FreshPrefillCacheWrite.WRITE_KERNEL, "turned off (hopper_cache_write=False)")
    why = cache_write_reason(HopperPrefillConfig(), spec.block_size)
    if why:
        return KernelChoice(FreshPrefillCacheWrite.WRITE_KERNEL, why)
    return KernelChoice(FreshPrefillCacheWrite.IN_KERNEL, f"pages of {spec.block_size} tokens divide the kernel's "
                                                          "key tiles")


def _quantised_prefill(spec: AttentionSpec, options: TritonBuilderOptions,
                       compute_capability: "tuple[int, int] | None",
                       interpreted: bool) -> KernelChoice[QuantisedPrefill]:
    if not spec.kv_cache_format.scales_in_pages:
        return KernelChoice(QuantisedPrefill.NOT_QUANTISED, f"a {spec.kv_cache_dtype} cache has no page scales")
    if options.dequant_prefill is False:
        return KernelChoice(QuantisedPrefill.UNIFIED, "turned off (dequant_prefill=False)")
    if not spec.attn_type.uses_kv_cache:
        return KernelChoice(QuantisedPrefill.UNIFIED, "encoder attention")
    if mask_reason(spec):
        return KernelChoice(QuantisedPrefill.UNIFIED, mask_reason(spec))
    if spec.block_size & (spec.block_size - 1):
        return KernelChoice(QuantisedPrefill.UNIFIED, f"block_size {spec.block_size} (the page dequantisation "
                                                      "needs a power of two)")
    sixteen_bit = spec.model_copy(update={"kv_cache_dtype": "auto"})
    paged = _paged_prefill(sixteen_bit, options, compute_capability, interpreted)
    if paged.kernel is PagedPrefill.GLUON_HOPPER_PAGED:
        return KernelChoice(QuantisedPrefill.DEQUANTISED_GLUON_PAGED,
                            "the paged Gluon Hopper kernel serves the layer with a 16-bit cache")
    if options.dequant_prefill:
        return KernelChoice(QuantisedPrefill.DEQUANTISED_UNIFIED,
                            f"asked for (dequant_prefill=True); not the paged Gluon Hopper kernel: {paged.reason}")
    return KernelChoice(QuantisedPrefill.UNIFIED, f"the paged Gluon Hopper kernel, which dequantised prefills run, "
                                                  f"does not serve the layer: {paged.reason}")
