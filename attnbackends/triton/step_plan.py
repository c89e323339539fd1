"""The step plan: every launch of one Triton batch, in order, with the stream each runs on, made by the builder.

:meth:`attnbackends.triton.backend.TritonMetadataBuilder.build` makes one :class:`TritonStepPlan` per batch
(:func:`make_step_plan`); :class:`attnbackends.triton.runner.TritonStepRunner` runs it for every layer, and
re-derives nothing. A plan is a handful of :class:`StepProgram` s, one per case the forward's arguments can bring,
all made in ``build``; :meth:`TritonStepPlan.program_for` picks one with a few attribute reads:

==========================  =========================================================================================
``no_cache``                ``kv_cache`` is None (encoder attention): the unified kernel over ``key``/``value``.
``no_new_kv``               ``key``/``value`` are None (the cache already holds the step's tokens): unified kernel.
``new_kv``                  the write kernel, then the unified kernel (also where ``new_kv_rows`` cannot run).
``new_kv_rows``             ``key``/``value`` (and query, output) in the row layout the prefill kernels' descriptors
                            take (:func:`.prefill_launch.tma_compatible`): the split the builder planned, decodes on
                            the unified kernel and prefills on a prefill kernel. None: no split for this batch.
``new_kv_rows_other_cache`` where the split's prefill kernel writes the cache itself: the split for a cache or slot
                            mapping that write cannot take (:func:`kernel_write_fits`). None: no such write.
``paged_no_new_kv``         ``key``/``value`` None, where the builder planned the paged Gluon prefill: the decodes on
                            the unified kernel, the prefills on the paged kernel (where the query / output rows and
                            the cache fit its TMA views, :func:`paged_fits`; else ``no_new_kv``).
``paged_new_kv``            the same after the write kernel, for new keys that ``new_kv_rows`` does not take (a split
                            other than the fresh-prompt Gluon kernel's is not planned beside it); else ``new_kv``.
==========================  =========================================================================================

A layer whose cache has page scales plans its prefills over dequantised pages (:mod:`.dequant_prefill`; the plan's
``dequant``): its ``paged_*`` programs then run the decodes on the unified kernel over the quantised cache, the
page dequantisation (``DEQUANT_PAGES``) and the prefill kernel over the builder's 16-bit scratch and the rewritten
block table (``GLUON_PAGED_PREFILL_SCRATCH``, or ``ATTENTION_SCRATCH`` where the builder was asked for the path
without the Gluon kernel); they are picked where the query / output rows fit the kernel's TMA views (the scratch
always fits), else ``no_new_kv`` / ``new_kv`` (the unified kernel over the quantised cache).

Each program is a tuple of :class:`Launch` es in issue order: a kernel launch (:class:`LaunchKind`) on the forward's
stream or on one of the runner's two side streams (:class:`StreamRole`), or a fork (``FORK``: the side stream waits
for the forward's) or join (``JOIN``: the forward's stream waits for the side stream). Its :class:`WritePolicy` says
how the step's keys and values reach the cache.

Adding a prefill kernel kind: one :class:`LaunchKind` member (the builder plans ``Launch(kind, its_plan)`` and
passes it as ``prefill`` to :func:`make_step_plan`, which places it in the split programs with the decodes, the
streams and the write), and one case in :mod:`attnbackends.triton.runner` (a function that launches it and its
entry in the runner's ``_CASES``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from .prefill_hopper_paged import paged_cache_reason
from .prefill_launch import tma_compatible

if TYPE_CHECKING:
    from .dequant_prefill import DequantPagesPlan
    from .launch import LaunchPlan

__all__ = [
    "Launch",
    "LaunchKind",
    "StepProgram",
    "StreamRole",
    "TritonStepPlan",
    "WritePolicy",
    "kernel_write_fits",
    "make_step_plan",
    "paged_fits",
]


class LaunchKind(str, enum.Enum):
    """What one entry of a step program does (``Launch.plan`` holds, per kind, what it runs). A ``str`` enum: the
    runner looks its cases up by kind on every launch, and ``str`` hashes in C where ``Enum`` hashes in Python."""

    #: The step's keys and values into the paged cache (:func:`attnbackends.ops.kv_cache_write.reshape_and_cache`).
    CACHE_WRITE = "cache_write"
    #: The tokens a prefill kernel's own cache write left to the write kernel (plan: that prefill's plan).
    FINISH_CACHE_WRITE = "finish_cache_write"
    #: The unified kernel over the paged cache (plan: :class:`.launch.LaunchPlan`).
    ATTENTION = "attention"
    #: The unified kernel over ``key``/``value``, no cache (plan: an unpaged :class:`.launch.LaunchPlan`).
    ATTENTION_NO_CACHE = "attention_no_cache"
    #: The Triton prefill kernel: new tokens from ``key``/``value``, context from the pages (plan:
    #: :class:`.prefill_launch.PrefillPlan`).
    TRITON_PREFILL = "triton_prefill"
    #: The Gluon Hopper prefill kernel over fresh prefills (plan: :class:`.prefill_hopper.HopperPrefillPlan`; it
    #: writes the cache itself where the plan ``writes_cache``).
    GLUON_PREFILL = "gluon_prefill"
    #: The prefills on the paged Gluon Hopper kernel (:mod:`.prefill_hopper_paged`): every key from the pages.
    GLUON_PAGED_PREFILL = "gluon_paged_prefill"
    #: The pages the prefills read, dequantised into the scratch (plan: :class:`.dequant_prefill.DequantPagesPlan`).
    DEQUANT_PAGES = "dequant_pages"
    #: The paged Gluon Hopper kernel over the scratch and block table of the step's ``dequant`` (plan:
    #: :class:`.prefill_hopper_paged.PagedPrefillPlan`).
    GLUON_PAGED_PREFILL_SCRATCH = "gluon_paged_prefill_scratch"
    #: The unified kernel's prefill programs over the scratch and block table of the step's ``dequant`` (plan: a
    #: :class:`.launch.LaunchPlan` of the prefills alone, requests ``dequant.first_seq`` onwards).
    ATTENTION_SCRATCH = "attention_scratch"
    #: The entry's stream waits for the forward's stream (nothing launched).
    FORK = "fork"
    #: The forward's stream waits for the entry's stream (nothing launched).
    JOIN = "join"


#: The kinds that are a prefill kernel (the plan's ``prefill`` launch is one of these).
PREFILL_KINDS = frozenset({LaunchKind.TRITON_PREFILL, LaunchKind.GLUON_PREFILL, LaunchKind.GLUON_PAGED_PREFILL})
#: The prefill kinds that read the dequantised scratch.
SCRATCH_PREFILL_KINDS = frozenset({LaunchKind.GLUON_PAGED_PREFILL_SCRATCH, LaunchKind.ATTENTION_SCRATCH})


class StreamRole(str, enum.Enum):
    """Which stream an entry runs on (the runner owns the two side streams, one pair per device)."""

    #: The forward's current stream.
    MAIN = "main"
    #: A second stream of default priority: the prefill kernel beside the decodes' launch.
    SIDE = "side"
    #: A second stream of the highest priority: a prefill whose programs must take their SMs before the cache
    #: write's, which then runs on the SMs left free.
    PRIORITY = "priority"


class WritePolicy(str, enum.Enum):
    """How a program puts the step's keys and values into the cache."""

    #: No write: there is no cache, or the forward brings no keys (the cache already holds them).
    NONE = "none"
    #: The write kernel first, then the attention launches.
    FIRST = "first"
    #: The write kernel on the forward's stream beside the prefill on the priority stream (:mod:`.write_beside`).
    BESIDE = "beside"
    #: The prefill kernel writes whole pages itself; the write kernel then the tokens it flagged.
    KERNEL = "kernel"


@dataclass(frozen=True)
class Launch:
    """One entry of a step program: ``kind`` with its ``plan`` (see :class:`LaunchKind`) on ``stream``."""

    kind: LaunchKind
    plan: Any = None
    stream: StreamRole = StreamRole.MAIN


@dataclass(frozen=True)
class StepProgram:
    """The entries one forward issues, in order, and how they write the cache."""

    launches: tuple[Launch, ...]
    write: WritePolicy

    def kinds(self) -> tuple[LaunchKind, ...]:
        """The entries' kinds, in order (for tests and logs)."""
        return tuple(launch.kind for launch in self.launches)


@dataclass(frozen=True)
class TritonStepPlan:
    """Every launch of one batch, per case of the forward's arguments (the module docstring's table).

    Attributes
    ----------
    no_cache, no_new_kv, new_kv : the programs without a cache, without new keys, with new keys (never None).
    new_kv_rows : the split program for new keys in the prefill kernels' row layout; None: the batch runs unsplit.
    new_kv_rows_other_cache : the split program where the prefill kernel's own cache write does not fit the cache
        (:func:`kernel_write_fits`); None: ``new_kv_rows`` fits any cache.
    kernel_write_tokens : tokens the prefill kernel's own write covers (0: no such write).
    cache_write_sms : SMs the prefill leaves to the cache write beside it (``WritePolicy.BESIDE``), else 0.
    write_todo : [max_num_tokens] int8, the builder's to-do flags of the prefill kernel's own write
        (``WritePolicy.KERNEL``), else None.
    tree_mask : [sum n_i^2] uint8 view of the batch's ``spec_tree_mask`` for the unified launches (planned with
        ``use_tree``), else None.
    paged_no_new_kv, paged_new_kv : the programs on the paged Gluon prefill without / with new keys; None: not
        planned for this batch.
    span_key_end : [num_tokens] int32, the batch's spans as per-token key ends for unified launches planned with
        the spans mask (:attr:`attnbackends.masks.BatchMasks.span_key_end`), else None.
    custom_mask, custom_mask_indptr : [sum_i ceil(Q_i L_i / 8)] uint8 packed bits and [num_reqs + 1] int32 byte
        offsets of the batch's custom masks for unified launches planned with the custom mask
        (:attr:`attnbackends.masks.BatchMasks.custom_mask`), else None.
    dequant : the page dequantisation of a batch whose ``paged_*`` programs run the prefills over the 16-bit scratch
        (:class:`.dequant_prefill.DequantPagesPlan`: the pages, the scratch, the rewritten block table), else None.
    """

    no_cache: StepProgram
    no_new_kv: StepProgram
    new_kv: StepProgram
    new_kv_rows: Optional[StepProgram] = None
    new_kv_rows_other_cache: Optional[StepProgram] = None
    kernel_write_tokens: int = 0
    cache_write_sms: int = 0
    write_todo: Optional[torch.Tensor] = None
    tree_mask: Optional[torch.Tensor] = None
    paged_no_new_kv: Optional[StepProgram] = None
    paged_new_kv: Optional[StepProgram] = None
    span_key_end: Optional[torch.Tensor] = None
    custom_mask: Optional[torch.Tensor] = None
    custom_mask_indptr: Optional[torch.Tensor] = None
    dequant: "Optional[DequantPagesPlan]" = None

    def program_for(self, query: torch.Tensor, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                    output: torch.Tensor, kv_cache: Optional[torch.Tensor],
                    slot_mapping: torch.Tensor) -> StepProgram:
        """The program for this forward's tensors (shapes as in :meth:`attnbackends.interface.AttentionImpl.forward`;
        ``slot_mapping`` the batch's [>= num_tokens] int64): four attribute reads and, for a split batch, four
        stride comparisons."""
        if kv_cache is None:
            return self.no_cache
        if key is None:
            paged = self.paged_no_new_kv
            return paged if paged is not None and self._paged_takes(query, output, kv_cache) else self.no_new_kv
        rows = self.new_kv_rows
        if rows is None or not tma_compatible(query, key, value, output):
            paged = self.paged_new_kv
            return paged if paged is not None and self._paged_takes(query, output, kv_cache) else self.new_kv
        other = self.new_kv_rows_other_cache
        if other is not None and not kernel_write_fits(kv_cache, slot_mapping, self.kernel_write_tokens):
            return other
        return rows

    def _paged_takes(self, query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether the ``paged_*`` programs take these rows and cache (:func:`paged_fits`; over the scratch, the
        rows alone: the kernel reads the scratch, not ``kv_cache``)."""
        if self.dequant is not None:
            return tma_compatible(query, query, query, output)
        return paged_fits(query, output, kv_cache)

    @property
    def split(self) -> Optional[StepProgram]:
        """The split program (``new_kv_rows``), None for a batch that runs unsplit."""
        return self.new_kv_rows

    @property
    def decode_plan(self) -> "Optional[LaunchPlan]":
        """The split's decode launch (the unified kernel's decode tiles); None: unsplit, or no decodes."""
        if self.new_kv_rows is None:
            return None
        for launch in self.new_kv_rows.launches:
            if launch.kind is LaunchKind.ATTENTION:
                return launch.plan
        return None

    @property
    def prefill(self) -> Optional[Launch]:
        """The split's prefill launch (kind and plan); None: unsplit."""
        if self.new_kv_rows is None:
            return None
        for launch in self.new_kv_rows.launches:
            if launch.kind in PREFILL_KINDS:
                return launch
        return None

    @property
    def paged(self) -> "Optional[tuple[Optional[LaunchPlan], Any]]":
        """(the decodes' plan or None, the paged Gluon prefill's plan) where planned; None: not planned."""
        if self.paged_no_new_kv is None:
            return None
        launches = self.paged_no_new_kv.launches
        decode = launches[0].plan if launches[0].kind is LaunchKind.ATTENTION else None
        return decode, launches[-1].plan

    @property
    def overlapped(self) -> bool:
        """Whether the split runs its decodes and its prefill kernel on two streams."""
        return self.new_kv_rows is not None and any(launch.stream is StreamRole.SIDE
                                                    for launch in self.new_kv_rows.launches)


def paged_fits(query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the paged Gluon prefill's TMA views take these query / output rows and this cache
    (:func:`.prefill_launch.tma_compatible`, :func:`.prefill_hopper_paged.paged_cache_reason`)."""
    return tma_compatible(query, query, query, output) and not paged_cache_reason(kv_cache)


def kernel_write_fits(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int) -> bool:
    """Whether a prefill kernel's own cache write of ``num_tokens`` tokens can address this cache: contiguous, fewer
    slots than int32 holds, and a slot for each of the tokens. kv_cache [num_blocks, 2, block_size, num_kv_heads,
    head_size]; slot_mapping [>= num_tokens] int64."""
    return (kv_cache.is_contiguous() and kv_cache.shape[0] * kv_cache.shape[2] < 2 ** 31
            and slot_mapping.shape[0] >= num_tokens)


_WRITE = Launch(LaunchKind.CACHE_WRITE)


def make_step_plan(attention: "LaunchPlan", *, decode: "Optional[LaunchPlan]" = None,
                   prefill: Optional[Launch] = None, write: WritePolicy = WritePolicy.FIRST, overlap: bool = False,
                   cache_write_sms: int = 0, unwritten_prefill: Optional[Launch] = None,
                   write_todo: Optional[torch.Tensor] = None,
                   tree_mask: Optional[torch.Tensor] = None,
                   paged: "Optional[tuple[Optional[LaunchPlan], Any]]" = None,
                   span_key_end: Optional[torch.Tensor] = None,
                   custom_mask: "Optional[tuple[torch.Tensor, torch.Tensor]]" = None,
                   dequant: "Optional[tuple[DequantPagesPlan, LaunchKind]]" = None) -> TritonStepPlan:
    """The step plan of a batch whose unified launch is ``attention`` and, where the builder split it, whose
    decodes run ``decode`` (None: no decodes) and whose prefills run ``prefill`` (a launch of a prefill kind).

    Parameters
    ----------
    attention : the whole batch on the unified kernel (every program without a split runs it).
    decode, prefill : the split (``prefill`` None: no split; then the other arguments must keep their defaults).
    write : how the split writes the cache. ``FIRST``: the write, then the decodes and the prefill (on two streams
        with ``overlap`` and decodes: the prefill on the side stream, forked after the write, joined after the
        decodes). ``BESIDE`` (no decodes): the prefill on the priority stream, planned to leave ``cache_write_sms``
        SMs to the write on the forward's stream. ``KERNEL`` (no decodes): ``prefill`` writes the cache itself,
        flagging in ``write_todo`` what it leaves to the write kernel after it; ``unwritten_prefill`` (the same
        launch without the kernel's write) runs after the write where the cache cannot take the kernel's write.
    tree_mask : the batch's packed tree mask as uint8, for an ``attention`` planned with ``use_tree`` (a batch with
        one never splits).
    paged : (the decodes' unified plan or None, the paged Gluon prefill's plan) where the builder planned the
        batch's prefills on the paged kernel: the ``paged_*`` programs.
    span_key_end : the spans' per-token key ends for an ``attention`` planned with the spans mask (a masked batch
        never splits).
    custom_mask : (packed bits, byte offsets) of the batch's custom masks for an ``attention`` planned with the
        custom mask (never split either).
    dequant : (the page dequantisation, the scratch prefill's kind: one of :data:`SCRATCH_PREFILL_KINDS`) where the
        ``paged`` prefill plan reads the dequantised scratch: the ``paged_*`` programs run the decodes, then
        ``DEQUANT_PAGES``, then that prefill (never beside a ``prefill`` split).
    """
    if span_key_end is not None and (prefill is not None or paged is not None):
        raise ValueError("a batch with bidirectional spans runs unsplit (the prefill kernels serve causal masks)")
    if custom_mask is not None and (prefill is not None or paged is not None or tree_mask is not None):
        raise ValueError("a batch with a custom mask runs unsplit and without a tree mask (the prefill kernels "
                         "serve causal masks; the custom mask holds any tree)")
    bits, bits_indptr = custom_mask if custom_mask is not None else (None, None)
    no_cache = StepProgram((Launch(LaunchKind.ATTENTION_NO_CACHE, attention),), WritePolicy.NONE)
    no_new_kv = StepProgram((Launch(LaunchKind.ATTENTION, attention),), WritePolicy.NONE)
    new_kv = StepProgram((_WRITE, Launch(LaunchKind.ATTENTION, attention)), WritePolicy.FIRST)
    paged_programs: dict[str, Any] = {}
    if paged is not None:
        if tree_mask is not None:
            raise ValueError("a batch with a tree mask runs unsplit (the prefill kernels take no tree mask)")
        paged_decode, paged_plan = paged
        decodes = (Launch(LaunchKind.ATTENTION, paged_decode),) if paged_decode is not None else ()
        if dequant is None:
            launches = decodes + (Launch(LaunchKind.GLUON_PAGED_PREFILL, paged_plan),)
        else:
            pages, kind = dequant
            if kind not in SCRATCH_PREFILL_KINDS or prefill is not None:
                raise ValueError(f"the prefills over the scratch run a scratch prefill kind, unsplit; got {kind}")
            launches = decodes + (Launch(LaunchKind.DEQUANT_PAGES, pages), Launch(kind, paged_plan))
            paged_programs["dequant"] = pages
        paged_programs.update(paged_no_new_kv=StepProgram(launches, WritePolicy.NONE),
                              paged_new_kv=StepProgram((_WRITE,) + launches, WritePolicy.FIRST))
    elif dequant is not None:
        raise ValueError("dequant goes with the paged prefill plan that reads the scratch (paged)")
    if prefill is None:
        if decode is not None or write is not WritePolicy.FIRST or overlap or cache_write_sms or unwritten_prefill:
            raise ValueError("decode, write, overlap, cache_write_sms and unwritten_prefill describe a split: "
                             "pass the split's prefill launch too")
        return TritonStepPlan(no_cache, no_new_kv, new_kv, tree_mask=tree_mask, span_key_end=span_key_end,
                              custom_mask=bits, custom_mask_indptr=bits_indptr, **paged_programs)
    if tree_mask is not None:
        raise ValueError("a batch with a tree mask runs unsplit (the prefill kernels take no tree mask)")
    if prefill.kind not in PREFILL_KINDS or prefill.stream is not StreamRole.MAIN:
        raise ValueError(f"prefill must be a launch of a prefill kind on the forward's stream, got {prefill}")
    if write is not WritePolicy.FIRST and decode is not None:
        raise ValueError(f"write={write.name} runs a split without decodes; got a decode plan")
    if (write is WritePolicy.BESIDE) != (cache_write_sms > 0):
        raise ValueError(f"write=BESIDE goes with cache_write_sms > 0; got write={write.name}, "
                         f"cache_write_sms={cache_write_sms}")
    if (write is WritePolicy.KERNEL) != (unwritten_prefill is not None and write_todo is not None):
        raise ValueError("write=KERNEL goes with unwritten_prefill and write_todo (and only it)")
    other_cache, kernel_tokens = None, 0
    if write is WritePolicy.KERNEL:
        split = (prefill, Launch(LaunchKind.FINISH_CACHE_WRITE, prefill.plan))
        other_cache = StepProgram((_WRITE, unwritten_prefill), WritePolicy.FIRST)
        kernel_tokens = prefill.plan.num_tokens
    elif write is WritePolicy.BESIDE:
        beside = Launch(prefill.kind, prefill.plan, StreamRole.PRIORITY)
        split = (Launch(LaunchKind.FORK, stream=StreamRole.PRIORITY), beside, _WRITE,
                 Launch(LaunchKind.JOIN, stream=StreamRole.PRIORITY))
    elif decode is not None and overlap:
        side = Launch(prefill.kind, prefill.plan, StreamRole.SIDE)
        split = (_WRITE, Launch(LaunchKind.FORK, stream=StreamRole.SIDE), side, Launch(LaunchKind.ATTENTION, decode),
                 Launch(LaunchKind.JOIN, stream=StreamRole.SIDE))
    elif decode is not None:
        split = (_WRITE, Launch(LaunchKind.ATTENTION, decode), prefill)
    else:
        split = (_WRITE, prefill)
    return TritonStepPlan(no_cache, no_new_kv, new_kv, StepProgram(split, write), other_cache, kernel_tokens,
                          cache_write_sms, write_todo, **paged_programs)
