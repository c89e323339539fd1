"""The Triton backend: one unified paged-attention launch per layer for a whole mixed batch, or, for batches with
prefills where it pays, the decodes on the unified kernel and the prefills on a prefill kernel that reads the
step's new keys and values from the forward's ``key``/``value``: the Gluon Hopper kernel
(:mod:`.prefill_hopper`) when no prefill has cached context, else the Triton one (:mod:`.prefill_kernel`).

The builder decides, the impl executes: :meth:`TritonMetadataBuilder.build` makes every launch decision of a batch
once and carries it in the metadata as one step plan (:mod:`.step_plan`: which kernels, on which streams, how the
cache is written); :meth:`TritonImpl.forward` checks its inputs and hands the plan to the builder's runner
(:mod:`.runner`), which issues the launches (:mod:`.launch`, :mod:`.prefill_launch`, :mod:`.prefill_hopper`).

Split-KV decode buffers (the partials and the segment counters of launches that merge their own segments) live in
the builder (allocated once), so a pure-decode step can be captured in a CUDA graph and replayed with new sequence
lengths.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport, QueryLenSupport
from ..metadata import CommonAttentionMetadata, split_decodes_and_prefills, validate_common_metadata
from ..ops.kv_cache_write import check_reshape_and_cache_args, reshape_and_cache
from ..ops.page_guard import raise_pending_faults
from ..platform import DeviceInfo, is_triton_interpreted
from ..spec import QUANTIZED_KV_CACHE_DTYPES, AttentionSpec, AttentionType, MaskKind
from ..validation import (
    UNIFIED_MAX_HEAD_SIZE,
    UNIFIED_MIN_HEAD_SIZE,
    check_forward_inputs,
    check_unified_attention_args,
)
from .mask_math import MASK_CUSTOM, MASK_SPANS
from .heuristics import (
    MAX_DECODE_TILE_ROWS,
    MAX_KV_SPLITS,
    KernelConfig,
    choose_num_kv_splits,
    deterministic_kernel_config,
    prefill_kernel_pays,
)
from .decode_schedule import DecodeSchedule, DecodeScheduler, decode_schedule_note
from .launch import (
    LaunchPlan,
    MaskPlan,
    SplitKVWorkspace,
    causal_sliding_window,
    mask_plan,
    plan_attention,
    schedule_fits,
    unified_attention,
)
from .choices import (
    FreshPrefillCacheWrite,
    FreshPrefillKernel,
    MaskPath,
    PagedPrefill,
    PrefillSplit,
    QuantisedPrefill,
    TritonBuilderOptions,
    TritonKernelChoices,
)
from .prefill_hopper import fresh_prefills, hopper_prefill_items, plan_hopper_prefill
from .prefill_hopper_paged import PAGED_KERNEL_NOTE, plan_paged_decodes, plan_paged_split
from .dequant_prefill import DequantPagesPlan, DequantScratch, collect_prefill_pages, plan_dequant_pages
from .kv_dequant import dequant_config
from .prefill_launch import plan_prefill_new_kv
from .kv_load import KV_PLAIN, dots_in_fp16, kernel_kv_format, launch_tensor_scales
from .runner import CacheViews, LayerArgs, TritonStepRunner
from .step_plan import Launch, LaunchKind, TritonStepPlan, WritePolicy, make_step_plan
from .write_beside import cache_write_bytes, cache_write_sms

__all__ = ["TritonAttentionBackend", "TritonMetadata", "TritonMetadataBuilder", "TritonImpl"]


@dataclass(frozen=True)
class TritonMetadata:
    """One batch for the Triton kernels: the common tensors, the unified kernel's launch plan for the whole batch,
    and the step plan :meth:`TritonMetadataBuilder.build` made for it (every launch, its stream, the cache write),
    with the builder's runner that executes it; never written after ``build()``."""

    common: CommonAttentionMetadata
    plan: LaunchPlan  # the whole batch on the unified kernel (split-KV factor, tile config, grid, workspace views)
    step: TritonStepPlan
    runner: TritonStepRunner
    debug: bool = False  # the builder's debug flag: impls validate inputs and the block table on every call
    decode_schedule: Optional[DecodeSchedule] = None  # the decodes' balanced schedule, which the plans that run
    # the decodes carry (None: the uniform split)

    @property
    def num_decodes(self) -> int:
        """Leading requests with query_len 1, run on the decode tiles."""
        return self.plan.num_decodes

    @property
    def num_kv_splits(self) -> int:
        """KV segments per decode (1: no split-KV)."""
        return self.plan.num_kv_splits

    @property
    def workspace(self) -> Optional[SplitKVWorkspace]:
        return self.plan.workspace

    @property
    def decode_schedule_note(self) -> str:
        """How this batch's decodes are scheduled, in words."""
        if self.decode_schedule is not None:
            return self.decode_schedule.describe()
        return f"uniform split: {self.num_decodes} decodes x {self.num_kv_splits} KV segments"

    @property
    def config(self) -> KernelConfig:
        return self.plan.config

    # Summaries of the step plan, read by tests and benchmarks.
    @property
    def prefill_split(self) -> "Optional[tuple[Optional[LaunchPlan], object]]":
        """(the decodes' plan or None, the prefill kernel's plan) of a split batch; None: the batch runs unsplit."""
        prefill = self.step.prefill
        return None if prefill is None else (self.step.decode_plan, prefill.plan)

    @property
    def paged_prefill(self) -> "Optional[tuple[Optional[LaunchPlan], object]]":
        """(the decodes' plan or None, the paged Gluon prefill's plan) where the builder planned the batch's prefills
        on the paged kernel; None: not planned."""
        return self.step.paged

    @property
    def dequant_prefill(self) -> Optional[DequantPagesPlan]:
        """The page dequantisation of a batch whose prefills run over the 16-bit scratch (None: not planned)."""
        return self.step.dequant

    @property
    def overlap_streams(self) -> bool:
        """The split runs its decodes and its prefill kernel on two streams."""
        return self.step.overlapped

    @property
    def cache_write_sms(self) -> int:
        """SMs the Gluon prefill leaves to the cache write beside it (0: none runs beside)."""
        return self.step.cache_write_sms

    @property
    def write_todo(self) -> Optional[torch.Tensor]:
        """The to-do flags of the Gluon prefill's own cache write (None: it does not write)."""
        return self.step.write_todo


#: A batch's mask on the unified kernel: (its plan, the spans' per-token key ends, a custom mask's (bits, offsets)).
BatchMaskData = tuple[Optional[MaskPlan], Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """Makes every launch decision of a batch (one :class:`~attnbackends.triton.step_plan.TritonStepPlan` over
    :class:`~attnbackends.triton.launch.LaunchPlan` s and prefill plans) and owns the split-KV workspace
    (``max_num_reqs`` decode rows).

    Speculative decoding: decodes of up to ``reorder_batch_threshold`` tokens (1 + the spec's
    ``num_speculative_tokens``) run on the decode path, one program per (request, KV head) holding all the
    request's query tokens x query heads (the keys are read once); deeper ones than
    :data:`.heuristics.MAX_DECODE_TILE_ROWS` rows allow run on the generic path. A tree mask is honoured on both
    paths: only the tiles over each request's draft segment are masked.

    Parameters (beyond the base class)
    ----------
    deterministic : batch-invariant mode. Every batch runs with ``num_kv_splits=1`` (no split-KV, so no
        batch-dependent reduction order) and one tile config fixed by the spec
        (:func:`.heuristics.deterministic_kernel_config`) instead of one picked from the batch's max query/sequence
        length. A request's output then depends only on its own query, keys and values: bitwise the same whatever
        else shares its batch (given the same position in the decode/prefill split: decodes first). Costs decode
        speed on small batches (no split-KV), and the fixed tiles are not the fastest for every shape.
    prefill_kernel : run the prefills and chunked prefills of a batch on the prefill kernel
        (:mod:`attnbackends.triton.prefill_kernel`: the new tokens' keys and values read from the forward's
        ``key``/``value``, the context from the pages) when the forward brings them. None (default): on for CUDA
        devices where the kernel applies (sm_90, head 64/128), for the batches where it pays
        (:func:`.heuristics.prefill_kernel_pays`: new-token work at least the cached-context work), off on
        the CPU so the interpreter keeps covering the unified path that other GPUs and head sizes run;
        True: every batch with prefills, wherever the kernel applies; False: off (also for the Gluon kernel below).
        ``choices.prefill_split`` says which and why.
    hopper_prefill : where the batch runs split and none of its prefills has cached context, run them on the
        Gluon warp-specialised Hopper kernel (:mod:`attnbackends.triton.prefill_hopper`) in place of the Triton
        prefill kernel, where it serves the layer (:func:`.prefill_hopper.hopper_prefill_reason`); False: never.
        ``choices.fresh_prefill`` says which kernel such batches get and why.
    hopper_cache_write : for a batch of fresh prefills only (no decodes) on the Gluon kernel, the kernel writes
        the step's keys and values into the cache itself, from the tiles it loads: whole pages by TMA stores from a
        writer warp, the tokens whose slots do not form whole pages in order by the write kernel after it
        (:func:`attnbackends.ops.kv_cache_write.finish_cache_write`). Where the kernel cannot
        (:func:`.prefill_hopper.cache_write_reason`) or False: the separate write (first, or beside the kernel).
        ``choices.fresh_cache_write`` says which and why.
    cache_write_sms : for a batch of fresh prefills only on the Gluon kernel that does not write the cache
        itself: the SMs its persistent grid leaves to the step's cache write, which then runs beside it
        (:mod:`attnbackends.triton.write_beside`). None (default): the rule's choice per batch
        (:func:`.write_beside.cache_write_sms`); 0: the write runs first, alone; k > 0: k SMs for every such batch.
    hopper_paged_prefill : run the prefills of batches with prefills on the paged Gluon Hopper kernel
        (:mod:`attnbackends.triton.prefill_hopper_paged`: every key from the cache's pages, the step's keys written
        first; chunks on context and ``key=None`` steps included), except batches of fresh prompts whose forward
        brings keys (the fresh-prompt kernel above). None: :data:`.prefill_hopper_paged.PAGED_PREFILL_DEFAULT`
        (on), unless ``prefill_kernel=False``. ``choices.paged_prefill`` says whether and why.
    overlap_decodes : when a batch runs split (decodes on the unified kernel, prefills on the prefill kernel), run
        the two launches on two CUDA streams, so the bandwidth-bound decodes and the compute-bound prefills share
        the GPU instead of following each other. Off by default (``benchmarks/triton_api.py --prefill-sweep``
        times both: its ``mixed_sweep`` rows).
    decode_schedule : how the decodes' keys are cut across programs (:mod:`attnbackends.triton.decode_schedule`):
        ``"balanced"`` into work units of near-equal size sized to the GPU (long requests many, short ones one,
        merged in the launch), ``"uniform"`` the same number of KV segments for every decode
        (:func:`.heuristics.choose_num_kv_splits`), ``"auto"`` (default) balanced where the decodes' lengths are
        ragged (:func:`.decode_schedule.balanced_reason`). Also for the decodes of a mixed batch; needs the split-KV
        workspace (CUDA, or ``"balanced"`` on the CPU); deterministic mode keeps its fixed schedule.
    dequant_prefill : for a layer whose cache has page scales (per-token-head fp8 / int8 / int4, NVFP4), run the
        prefills of batches with prefills over their pages dequantised into a 16-bit scratch
        (:mod:`attnbackends.triton.dequant_prefill`) on the prefill kernel that serves the layer with a 16-bit cache
        (the paged Gluon Hopper kernel; fresh prompts too, so every prefill sees the values the cache holds), the
        decodes on the unified kernel over the quantised cache. None (default): where the paged Gluon kernel serves
        the layer; True: also elsewhere, the unified kernel then running over the scratch (correct, not faster: the
        CPU's interpreter tests the path with it); False: never (the unified kernel reads the quantised pages).
        ``choices.quantised_prefill`` says which and why.
    dequant_prefill_max_pages : the most pages the scratch holds (grown on demand up to it, one per builder, shared
        by its layers); a batch whose prefills read more runs them on the unified kernel. None:
        :func:`.dequant_prefill.default_max_pages` (256k tokens' pages).

    The options are checked once, as a :class:`~.choices.TritonBuilderOptions` (``options``), and decided once, as
    :class:`~.choices.TritonKernelChoices` (``choices``: each decision an enum member with its reason). Every
    batch's launches, their streams and the cache write are one :class:`~.step_plan.TritonStepPlan` in the
    metadata; ``runner`` (:class:`~.runner.TritonStepRunner`, one per builder) runs it and owns its side streams.
    """

    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 64
    supports_tree_mask = True

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", *, deterministic: bool = False,
                 prefill_kernel: Optional[bool] = None, hopper_prefill: bool = True, overlap_decodes: bool = False,
                 hopper_cache_write: bool = True, cache_write_sms: Optional[int] = None,
                 hopper_paged_prefill: Optional[bool] = None, decode_schedule: str = "auto",
                 dequant_prefill: Optional[bool] = None, dequant_prefill_max_pages: Optional[int] = None,
                 **kwargs) -> None:
        super().__init__(spec, device, **kwargs)
        self.options = TritonBuilderOptions(
            deterministic=deterministic, prefill_kernel=prefill_kernel, hopper_prefill=hopper_prefill,
            overlap_decodes=overlap_decodes, hopper_cache_write=hopper_cache_write, cache_write_sms=cache_write_sms,
            hopper_paged_prefill=hopper_paged_prefill,
            decode_schedule=decode_schedule, dequant_prefill=dequant_prefill,
            dequant_prefill_max_pages=dequant_prefill_max_pages)
        self.kernel_config: Optional[KernelConfig] = deterministic_kernel_config(spec) if deterministic else None
        info = DeviceInfo.current(self.device)
        self.num_sms = info.sm_count if info.is_cuda else 1
        interpreted = info.triton_interpreted or is_triton_interpreted()  # the process's kernels, whatever the device
        self.choices = TritonKernelChoices.decide(spec, self.options, info.compute_capability,
                                                  interpreted=interpreted, is_cuda=self.device.type == "cuda",
                                                  num_sms=self.num_sms)
        self._write_todo: Optional[torch.Tensor] = None  # [max_num_tokens] int8 to-do flags of the kernel's write
        #: The 16-bit pages the prefills of a quantised layer read (None: its prefills never run over one).
        self.dequant_scratch: Optional[DequantScratch] = None
        if self.choices.quantised_prefill.kernel in _DEQUANTISED:
            self.dequant_scratch = DequantScratch(self.choices.dequant_max_pages, spec.block_size, spec.num_kv_heads,
                                                  spec.head_size, spec.torch_dtype, self.device)
            self._dequant_config = dequant_config(spec.kv_cache_format, spec.head_size, spec.block_size)
        #: Runs the step plans of this builder's metadata for every layer; owns their side streams.
        self.runner = TritonStepRunner()
        self.workspace: Optional[SplitKVWorkspace] = None
        if (self.device.type == "cuda" or decode_schedule == "balanced") and not deterministic:
            self.workspace = SplitKVWorkspace.allocate(
                self.max_num_reqs, spec.num_heads, spec.head_size, MAX_KV_SPLITS, device=self.device
            )
        #: The decodes' balanced schedules (None: every batch's decodes run the uniform split).
        self.decode_scheduler: Optional[DecodeScheduler] = None
        #: The layer's mask on the unified kernel (None: the causal / sliding-window path).
        self.mask = mask_plan(spec)
        masked = self.choices.mask.kernel is MaskPath.UNIFIED_ONLY
        if decode_schedule != "uniform" and self.workspace is not None and not masked:
            self.decode_scheduler = DecodeScheduler.for_spec(decode_schedule, spec, self.device, num_sms=self.num_sms,
                                                             workspace_segments=self.workspace.max_segments)
        self._plan_args = dict(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            kv_fp8=dots_in_fp16(spec), kv_format=kernel_kv_format(spec.kv_cache_format),
            sliding_window=causal_sliding_window(spec), logits_soft_cap=spec.logits_soft_cap,
            use_alibi=spec.alibi_slopes is not None, use_sinks=spec.has_sinks, config=self.kernel_config,
            device=self.device,
        )

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        if self.debug:
            paged = self.spec.attn_type.uses_kv_cache  # encoder batches have no block table to check
            validate_common_metadata(common, block_size=self.spec.block_size if paged else None)
        raise_pending_faults(self.device)
        mask, key_end, custom = self._batch_mask(common)
        causal = self.spec.causal and common.causal and mask is None
        if not self.spec.attn_type.uses_kv_cache:
            plan = plan_attention(  # encoder attention: no cache, no decodes, one varlen launch
                num_tokens=common.num_actual_tokens, block_size=16, num_seqs=common.num_reqs,
                max_query_len=max(common.max_seq_len, 2), max_seq_len=common.max_seq_len, causal=causal,
                paged=False, num_decodes=0, num_kv_splits=1, **self._plan_args)
            return TritonMetadata(common, plan, make_step_plan(plan), self.runner, self.debug)
        split = split_decodes_and_prefills(common, self.reorder_batch_threshold)
        decode_q = self.reorder_batch_threshold
        num_decodes = split.num_decodes
        if decode_q * self.spec.num_queries_per_kv > MAX_DECODE_TILE_ROWS:
            num_decodes = 0  # too many rows for one decode tile: the generic path takes these verify requests
        tree = common.spec_tree_mask
        schedule = self._schedule_decodes(common, num_decodes, split.num_prefills == 0)
        num_kv_splits = 1
        if split.num_decodes and split.num_prefills == 0 and schedule is None:
            num_kv_splits = self.decode_kv_splits(split.num_decodes, common.max_seq_len, common.max_query_len)
        plan = plan_attention(
            num_tokens=common.num_actual_tokens, block_size=self.spec.block_size, num_seqs=common.num_reqs,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len, causal=causal,
            num_decodes=num_decodes, num_kv_splits=num_kv_splits, workspace=self.workspace,
            decode_query_len=decode_q, use_tree=tree is not None, decode_schedule=schedule, mask=mask,
            **self._plan_args)
        prefills = causal and split.num_prefills > 0 and tree is None  # a prefill kernel may serve them
        paged = None  # (decodes' plan, the paged Gluon prefill's plan): the prefills with keys from the pages
        dequant = None  # (the page dequantisation, the scratch prefill's kind): the prefills over the scratch
        if prefills and self.choices.paged_prefill.kernel is PagedPrefill.GLUON_HOPPER_PAGED:
            paged = plan_paged_split(self, common, num_decodes, split.num_decode_tokens, causal)
        elif prefills and self.dequant_scratch is not None:
            paged, dequant = self._plan_dequant(common, num_decodes, split.num_decode_tokens, causal)
        if paged is not None and schedule is not None and paged[0] is not None:
            paged = (self._scheduled_decode_plan(common, schedule, split.num_decode_tokens, causal), paged[1])
        rule = self.choices.prefill_split.kernel
        if prefills and (rule is PrefillSplit.EVERY_BATCH or (
                rule is PrefillSplit.WHERE_IT_PAYS
                and prefill_kernel_pays(common.query_lens_cpu, common.seq_lens_cpu, num_decodes))):
            step = self._plan_split(common, plan, num_decodes, split.num_decode_tokens, causal, paged, schedule)
        else:
            step = make_step_plan(plan, tree_mask=tree.view(torch.uint8) if tree is not None else None, paged=paged,
                                  span_key_end=key_end, custom_mask=custom, dequant=dequant)
        return TritonMetadata(common, plan, step, self.runner, self.debug, schedule)

    def _plan_dequant(self, common: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int,
                      causal: bool) -> tuple[Optional[tuple], Optional[tuple[DequantPagesPlan, LaunchKind]]]:
        """The prefills of a quantised layer over their pages dequantised into the scratch
        (:mod:`.dequant_prefill`): ((the decodes' plan or None, the scratch prefill's plan), (the page
        dequantisation, the scratch prefill's kind)); (None, None) where the batch's prefills read more pages than
        the scratch holds or the batch has no host block table (they run on the unified kernel)."""
        table = common.block_table_cpu
        if table is None:
            return None, None
        host = collect_prefill_pages(table.numpy(), common.seq_lens_cpu.numpy(), num_decodes, common.num_reqs,
                                     self.spec.block_size)
        scratch = self.dequant_scratch.view(host.pages.size)
        if scratch is None:
            return None, None
        pages = plan_dequant_pages(host, scratch, self._dequant_config, num_decodes, self.device)
        if self.choices.quantised_prefill.kernel is QuantisedPrefill.DEQUANTISED_GLUON_PAGED:
            return (plan_paged_split(self, common, num_decodes, num_decode_tokens, causal),
                    (pages, LaunchKind.GLUON_PAGED_PREFILL_SCRATCH))
        decode = plan_paged_decodes(self, common, num_decodes, num_decode_tokens, causal)
        qsl = common.query_start_loc_cpu
        prefill = plan_attention(  # the unified kernel's prefill programs over the scratch's 16-bit pages
            num_tokens=int(qsl[common.num_reqs] - qsl[num_decodes]), block_size=self.spec.block_size,
            num_seqs=common.num_reqs - num_decodes, max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len, causal=causal, num_decodes=0, num_kv_splits=1,
            **{**self._plan_args, "kv_fp8": False, "kv_format": KV_PLAIN})
        return (decode, prefill), (pages, LaunchKind.ATTENTION_SCRATCH)

    def _batch_mask(self, common: CommonAttentionMetadata) -> "BatchMaskData":
        """The batch's mask on the unified kernel and the data it reads: the spans' per-token key ends, or a custom
        mask's (packed bits, byte offsets). (None, None, None) for a causal layer, and for a spans layer whose batch
        has no spans (then plainly causal). The batch was checked against the layer (a custom-mask layer's batch
        carries its masks)."""
        mask = self.mask
        if mask is None:
            return None, None, None
        masks = common.masks
        if mask.kind == MASK_CUSTOM:
            if common.spec_tree_mask is not None:
                raise ValueError("a custom-mask layer's batch carries a tree mask: the triton backend takes the "
                                 "draft tree in the custom mask itself (attnbackends.masks.with_custom_masks)")
            return mask, None, (masks.custom_mask, masks.custom_mask_indptr)
        if mask.kind != MASK_SPANS:
            return mask, None, None
        if masks is None or masks.span_key_end is None:
            return None, None, None
        return mask, masks.span_key_end, None

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> TritonMetadata:
        """The metadata a CUDA graph captures for ``common``'s shape (``num_reqs`` requests, ``num_actual_tokens``
        tokens, padding included), whose launches read every per-step value (query_start_loc, seq_lens,
        block_table, slot_mapping) from those tensors at replay:

        - a decode-only batch (every query at most ``reorder_batch_threshold`` tokens): :meth:`build`'s plan; a
          batch scheduled balanced gets a persistent unit table of fixed size that every later :meth:`build` of its
          shape rewrites (so call :meth:`build` on each replayed batch before the replay). It replays decode-only
          batches of the same shape;
        - any other batch of a paged causal layer without a tree mask or a mask kind beyond causal: :meth:`_capture_plan_mixed`, one unified
          launch whose grid depends only on the shape, replaying any batch of the same shape, prefills, chunks and
          decodes in any mix;
        - otherwise (encoders, tree masks): :meth:`build`.
        """
        split = split_decodes_and_prefills(common, self.reorder_batch_threshold)
        if (split.num_prefills and self.spec.attn_type.uses_kv_cache and common.spec_tree_mask is None
                and self.spec.causal and common.causal and self.mask is None):
            return self._capture_plan_mixed(common)
        if self.decode_scheduler is None:
            return self.build(common)
        with self.decode_scheduler.capturing():
            return self.build(common)

    def _capture_plan_mixed(self, common: CommonAttentionMetadata) -> TritonMetadata:
        """A whole-batch plan fixed by ``common``'s shape alone: every request on the unified kernel's generic path
        (no decode programs, whose count would change per step; no KV split; no prefill kernel, whose grids follow
        the query lengths). Its grid, ``num_actual_tokens // BLOCK_Q + num_reqs`` programs, covers every way of
        sharing the tokens among the requests: each program finds its request by a search over query_start_loc at
        run time, and the ones past a request's queries (padding, requests with fewer tokens) exit."""
        if self.debug:
            validate_common_metadata(common, block_size=self.spec.block_size)
        raise_pending_faults(self.device)
        plan = plan_attention(
            num_tokens=common.num_actual_tokens, block_size=self.spec.block_size, num_seqs=common.num_reqs,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len, causal=True, num_decodes=0,
            num_kv_splits=1, **self._plan_args)
        return TritonMetadata(common, plan, make_step_plan(plan), self.runner, self.debug)

    def _schedule_decodes(self, common: CommonAttentionMetadata, num_decodes: int,
                          decode_only: bool) -> Optional[DecodeSchedule]:
        """The balanced schedule of the batch's ``num_decodes`` decodes (:mod:`.decode_schedule`), or None: the
        uniform split (the rule's choice, or no workspace to hold the units' partials)."""
        if self.decode_scheduler is None or not num_decodes or not schedule_fits(
                self.workspace, num_decode_tokens=num_decodes * self.reorder_batch_threshold,
                num_decodes=num_decodes, num_heads=self.spec.num_heads, num_kv_heads=self.spec.num_kv_heads,
                head_size=self.spec.head_size, max_units_per_request=self.decode_scheduler.max_units_per_request):
            return None
        return self.decode_scheduler.schedule(common, num_decodes, decode_only=decode_only)

    def _scheduled_decode_plan(self, common: CommonAttentionMetadata, schedule: DecodeSchedule,
                               num_decode_tokens: int, causal: bool) -> LaunchPlan:
        """The decodes of a split batch alone, on ``schedule``'s units."""
        return plan_attention(
            num_tokens=num_decode_tokens, block_size=self.spec.block_size, num_seqs=schedule.num_decodes,
            max_query_len=self.reorder_batch_threshold, max_seq_len=common.max_seq_len, causal=causal,
            num_decodes=schedule.num_decodes, workspace=self.workspace, decode_query_len=self.reorder_batch_threshold,
            decode_schedule=schedule, **self._plan_args)

    def decode_kv_splits(self, num_decodes: int, max_seq_len: int, max_query_len: int) -> int:
        """KV segments for ``num_decodes`` decodes that have the GPU to themselves
        (:func:`.heuristics.choose_num_kv_splits`); 1 where this builder has no split-KV workspace."""
        if self.workspace is None:
            return 1
        return choose_num_kv_splits(num_decodes, self.spec.num_kv_heads, self.spec.num_heads, self.num_sms,
                                    max_seq_len, max_query_len=max_query_len)

    def _todo_flags(self) -> torch.Tensor:
        """The to-do flags of the Gluon kernel's own cache write ([max_num_tokens] int8, zero between forwards:
        the write kernel clears what the prefill set), made once."""
        if self._write_todo is None:
            self._write_todo = torch.zeros(self.max_num_tokens, dtype=torch.int8, device=self.device)
        return self._write_todo

    def _plan_split(self, common: CommonAttentionMetadata, attention: LaunchPlan, num_decodes: int,
                    num_decode_tokens: int, causal: bool, paged: Optional[tuple] = None,
                    schedule: Optional[DecodeSchedule] = None) -> TritonStepPlan:
        """The step plan of a batch that runs split: the decodes on the unified kernel's decode tiles, the rest on
        the prefill kernel that serves them (the Gluon kernel when none of them has cached context and it serves the
        layer; else the paged Gluon kernel where ``paged`` is planned; else the Triton one); ``attention`` (the whole
        batch unsplit) where the forward's tensors do not take the split."""
        decode = None
        if schedule is not None:
            decode = self._scheduled_decode_plan(common, schedule, num_decode_tokens, causal)
        elif num_decodes:
            decode = plan_attention(
                num_tokens=num_decode_tokens, block_size=self.spec.block_size, num_seqs=num_decodes,
                max_query_len=self.reorder_batch_threshold, max_seq_len=common.max_seq_len, causal=causal,
                num_decodes=num_decodes, num_kv_splits=1, decode_query_len=self.reorder_batch_threshold,
                **self._plan_args)
        if (self.choices.fresh_prefill.kernel is FreshPrefillKernel.GLUON_HOPPER
                and fresh_prefills(common.query_lens_cpu, common.seq_lens_cpu, num_decodes)):
            return self._plan_gluon_split(common, attention, decode, num_decodes, paged)
        if paged is not None:
            return make_step_plan(attention, paged=paged)
        prefill = Launch(LaunchKind.TRITON_PREFILL, plan_prefill_new_kv(
            num_heads=self.spec.num_heads, num_kv_heads=self.spec.num_kv_heads, head_size=self.spec.head_size,
            block_size=self.spec.block_size, num_seqs=common.num_reqs, first_seq=num_decodes,
            max_query_len=common.max_query_len, sliding_window=self.spec.sliding_window,
            use_softcap=bool(self.spec.logits_soft_cap), use_sinks=self.spec.has_sinks))
        return make_step_plan(attention, decode=decode, prefill=prefill, overlap=self.choices.overlap_decodes)

    def _plan_gluon_split(self, common: CommonAttentionMetadata, attention: LaunchPlan, decode: Optional[LaunchPlan],
                          num_decodes: int, paged: Optional[tuple] = None) -> TritonStepPlan:
        """The split with the fresh prefills on the Gluon kernel, and the cache write it gets: without decodes, the
        kernel's own (where it can write this layer's cache) or, else, beside it on the SMs the kernel leaves
        (:meth:`_cache_write_sms`; 0: first); with decodes, first."""
        spec = self.spec
        writes_cache = decode is None and self.choices.fresh_cache_write.kernel is FreshPrefillCacheWrite.IN_KERNEL
        write_sms = self._cache_write_sms(common) if decode is None and not writes_cache else 0
        plan = plan_hopper_prefill(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            num_seqs=common.num_reqs, first_seq=num_decodes, max_query_len=common.max_query_len,
            num_tokens=common.num_actual_tokens, num_sms=self.num_sms - write_sms, writes_cache=writes_cache,
            block_size=spec.block_size)
        prefill = Launch(LaunchKind.GLUON_PREFILL, plan)
        if writes_cache:  # a cache the kernel cannot address falls back to the write first, then the same grid
            unwritten = Launch(LaunchKind.GLUON_PREFILL, dataclasses.replace(plan, writes_cache=False))
            return make_step_plan(attention, prefill=prefill, write=WritePolicy.KERNEL, unwritten_prefill=unwritten,
                                  write_todo=self._todo_flags(), paged=paged)
        if write_sms:
            return make_step_plan(attention, prefill=prefill, write=WritePolicy.BESIDE, cache_write_sms=write_sms,
                                  paged=paged)
        return make_step_plan(attention, decode=decode, prefill=prefill, overlap=self.choices.overlap_decodes,
                              paged=paged)

    def _cache_write_sms(self, common: CommonAttentionMetadata) -> int:
        """SMs a batch of fresh prefills (no decodes) leaves to its cache write: the builder's ``cache_write_sms``,
        else :func:`.write_beside.cache_write_sms`'s rule."""
        if self.choices.cache_write_sms is not None:
            return self.choices.cache_write_sms
        q_lens = common.query_lens_cpu.tolist()
        spec = self.spec
        flops = 4.0 * spec.num_heads * spec.head_size * sum(q * (q + 1) // 2 for q in q_lens)
        write_bytes = cache_write_bytes(common.num_actual_tokens, spec.num_kv_heads, spec.head_size,
                                        spec.torch_dtype.itemsize, spec.kv_cache_torch_dtype.itemsize)
        items = hopper_prefill_items(spec.num_heads, common.num_reqs, common.max_query_len)
        return cache_write_sms(flops=flops, write_bytes=write_bytes, items=items, num_sms=self.num_sms)


#: The quantised-prefill choices that run over the dequantised scratch.
_DEQUANTISED = (QuantisedPrefill.DEQUANTISED_GLUON_PAGED, QuantisedPrefill.DEQUANTISED_UNIFIED)


class TritonImpl(AttentionImpl[TritonMetadata]):
    """Runs the batch's step plan (:mod:`.step_plan`, made by the builder) through the builder's runner: the cache
    write and one unified-attention launch (plus a reduction launch for split-KV beside prefill programs; a
    decode-only split merges in its own launch), or the split the builder planned (the
    decodes' launch and a prefill kernel, the cache write first, beside or in the kernel) where the forward brings
    the step's keys and values in a layout the prefill kernels' descriptors take."""

    can_return_lse = True

    def __init__(self, spec: AttentionSpec, **kwargs) -> None:
        super().__init__(spec, **kwargs)
        self._alibi_host = (
            torch.tensor(spec.alibi_slopes, dtype=torch.float32) if spec.alibi_slopes is not None else None
        )
        self._soft_cap = float(spec.logits_soft_cap or 0.0)
        self._layer_args: dict[torch.device, LayerArgs] = {}
        self._cache_views: Optional[tuple[weakref.ref, CacheViews]] = None  # (the cache, its views)
        self._validated = False

    def _args_on(self, device: torch.device) -> LayerArgs:
        """This layer's launch constants on ``device``: ALiBi slopes and sinks copied there once (never on the hot
        path after the first step), the scales as set at the first forward on the device."""
        args = self._layer_args.get(device)
        if args is None:
            alibi = self._alibi_host.to(device) if self._alibi_host is not None else None
            sinks = self.sinks.to(device).contiguous() if self.sinks is not None else None
            fmt = self.spec.kv_cache_format
            k_scale, v_scale = launch_tensor_scales(fmt, self.k_scale, self.v_scale)
            args = self._layer_args[device] = LayerArgs(self.scale, self._soft_cap, alibi, sinks, k_scale, v_scale,
                                                        fmt)
        return args

    def _views_of(self, kv_cache: Optional[torch.Tensor]) -> Optional[CacheViews]:
        """The key and value views of ``kv_cache`` and their launch key, made once per cache tensor."""
        if kv_cache is None:
            return None
        held = self._cache_views
        if held is None or held[0]() is not kv_cache:
            held = self._cache_views = (weakref.ref(kv_cache), CacheViews.of(kv_cache))
        return held[1]

    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        reshape_and_cache(key, value, kv_cache, slot_mapping, self.k_scale, self.v_scale, validate=not self._validated,
                          kv_format=self.spec.kv_cache_format)

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: TritonMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        common = metadata.common
        check_forward_inputs(self, metadata, common, query, key, value, kv_cache, output,
                             backend=TritonAttentionBackend)
        if not self._validated:
            self._check_first_call(query, key, value, kv_cache, metadata, output)
        return metadata.runner.run(metadata.step, query, key, value, kv_cache, output, common,
                                   self._args_on(query.device), self._views_of(kv_cache))

    def forward_with_lse(self, query: torch.Tensor, kv_cache: torch.Tensor, common: CommonAttentionMetadata,
                         output: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attnbackends.interface.AttentionImpl.forward_with_lse` (shapes there): every cached key is visible
        (non-causal), no sinks, no cache write; one launch with the log-sum-exp output."""
        unified_attention(
            query, kv_cache[:, 0], kv_cache[:, 1], output, common.query_start_loc, common.seq_lens,
            common.block_table, common.max_query_len, common.max_seq_len, self.scale, causal=False,
            logits_soft_cap=self.spec.logits_soft_cap, k_scale=self.k_scale, v_scale=self.v_scale,
            num_decodes=common.num_reqs, return_lse=lse, kv_format=self.spec.kv_cache_format,
        )
        return output, lse

    def _check_first_call(self, query, key, value, kv_cache, metadata: TritonMetadata, output) -> None:
        """The functional launcher's argument checks, once: the tensors against each other and the plan."""
        spec, common = self.spec, metadata.common
        args = self._args_on(query.device)
        if kv_cache is None:
            if key is None or value is None:
                raise ValueError("key and value are required when there is no kv_cache (encoder attention)")
        else:
            check_unified_attention_args(
                query, kv_cache[:, 0], kv_cache[:, 1], output, common.query_start_loc, common.seq_lens,
                common.block_table, common.max_query_len, common.max_seq_len, self.scale,
                causal=spec.causal and common.causal, sliding_window=spec.sliding_window,
                logits_soft_cap=spec.logits_soft_cap, alibi_slopes=args.alibi, sinks=args.sinks, k_scale=self.k_scale,
                v_scale=self.v_scale, workspace=metadata.workspace, kv_format=spec.kv_cache_format)
            if key is not None:
                check_reshape_and_cache_args(key, value, kv_cache, common.slot_mapping, self.k_scale, self.v_scale,
                                             spec.kv_cache_format)
        planned = metadata.plan.constexprs[:2]
        if planned != (spec.num_queries_per_kv, spec.head_size):
            raise ValueError(f"metadata was planned for {planned[0]} query heads per KV head and head_size "
                             f"{planned[1]}, this layer has {spec.num_queries_per_kv} and {spec.head_size}: build it "
                             "with a builder of this layer's spec")
        self._validated = True


#: What a CUDA graph of a Triton layer runs (the kernel notes' last line).
CUDA_GRAPH_NOTE = ("CUDA graphs: a decode-only step replays build()'s plan (its balanced table rewritten in place); a "
                   "mixed step replays one unified launch fixed by its shape, without the prefill kernels, KV splits "
                   "or the balanced schedule, so it runs slower than eager where chunks are long: capture decode "
                   "steps, run mixed steps eager")


class TritonAttentionBackend(AttentionBackend):
    """Our unified paged-attention kernels (Triton): mixed batches in one launch, split-KV decode, fp8 KV."""

    name = "triton"
    description = "Triton unified paged attention: mixed batches in one launch, split-KV decode, fp8 KV"
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                                           *QUANTIZED_KV_CACHE_DTYPES})
    min_head_size = UNIFIED_MIN_HEAD_SIZE
    max_head_size = UNIFIED_MAX_HEAD_SIZE
    block_size_multiple = 16
    kv_cache_16bit_must_match_dtype = True
    min_compute_capability = (8, 0)
    min_compute_capability_fp8_e4m3 = (8, 9)  # Triton converts e4m3 natively from sm_89 on
    needs_triton = True
    supported_attn_types = frozenset(AttentionType)
    supports_sliding_window = True
    supports_alibi = True
    supports_logits_soft_cap = True
    supports_sinks = True
    supported_mask_kinds = frozenset(MaskKind)
    supports_window_right = True
    # Any step: decode-only shapes from build()'s plan (balanced tables rewritten in place), others from one unified
    # launch whose grid depends only on the shape (TritonMetadataBuilder.build_for_cudagraph_capture).
    cudagraph_support = CudaGraphSupport.ALWAYS

    @classmethod
    def kernel_notes(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """The prefill kernel a default builder runs for batches with prefills (the paged Gluon kernel for chunks
        on cached context and ``key=None`` steps, the fresh-prompt Gluon kernel for fresh prompts with keys), with
        the reason where a kernel is ruled out (a default builder's :class:`~.choices.TritonKernelChoices`); then how
        a default builder schedules the decodes; then what a CUDA graph captures."""
        return cls._prefill_notes(spec, device) + [decode_schedule_note(cuda=device.is_cuda), CUDA_GRAPH_NOTE]

    @classmethod
    def _prefill_notes(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        choices = TritonKernelChoices.decide(spec, TritonBuilderOptions(), device.compute_capability,
                                             interpreted=device.triton_interpreted, is_cuda=device.is_cuda,
                                             num_sms=device.sm_count if device.is_cuda else 1)
        quantised = choices.quantised_prefill
        if quantised.kernel is not QuantisedPrefill.NOT_QUANTISED:
            return [cls._quantised_prefill_note(spec, quantised, choices.dequant_max_pages)]
        split, fresh, paged = choices.prefill_split, choices.fresh_prefill, choices.paged_prefill
        splits = split.kernel is not PrefillSplit.OFF
        gluon = fresh.kernel is FreshPrefillKernel.GLUON_HOPPER
        triton = ("the Triton prefill kernel (new tokens' keys from the forward, cached context from the pages) where "
                  "the new tokens' work is at least the cached context's, else the unified kernel")
        gluon_fresh = ("the Gluon warp-specialised Hopper kernel (a TMA loader warp, two ping-pong consumer "
                       "warpgroups, persistent) for batches whose prefills have no cached context")
        if choices.fresh_cache_write.kernel is FreshPrefillCacheWrite.IN_KERNEL:
            writes = ("the kernel writes the step's keys and values into the cache itself, a writer warp TMA-storing "
                      "whole pages")
        else:
            writes = f"the cache write runs before or beside it, not in it: {choices.fresh_cache_write.reason}"
        if paged.kernel is PagedPrefill.GLUON_HOPPER_PAGED:
            on_pages = (f"{PAGED_KERNEL_NOTE}; where the query or cache rows do not fit its TMA views, "
                        f"{triton if splits else 'the unified kernel'}")
            if not gluon:
                return [f"prefill kernel: {on_pages}; fresh prompts too (not the Gluon Hopper kernel: {fresh.reason})"]
            return [f"prefill kernel: {gluon_fresh} and whose forward brings their keys; {writes}; for others "
                    f"{on_pages}"]
        not_paged = f"not the paged Gluon Hopper kernel: {paged.reason}"
        if not splits:
            return [f"prefill kernel: the unified kernel (the prefill kernels are not used: {split.reason}; "
                    f"{not_paged})"]
        if not gluon:
            return [f"prefill kernel: {triton}; not the Gluon Hopper kernel: {fresh.reason}; {not_paged}"]
        return [f"prefill kernel: {gluon_fresh}; {writes}; for others {triton}; {not_paged}"]

    @staticmethod
    def _quantised_prefill_note(spec: AttentionSpec, choice, max_pages: int) -> str:
        """Which path the prefills of a layer whose cache has page scales take, and why."""
        cache = f"the {spec.kv_cache_dtype} cache (scales beside its pages)"
        if choice.kernel is QuantisedPrefill.UNIFIED:
            return f"prefill kernel: the unified kernel, reading {cache} directly ({choice.reason})"
        kernel = ("the paged Gluon Hopper kernel (every key from the scratch's pages by TMA)"
                  if choice.kernel is QuantisedPrefill.DEQUANTISED_GLUON_PAGED else "the unified kernel")
        return (f"prefill kernel: for {cache}, the pages a batch's prefills read are dequantised into a "
                f"{spec.dtype} scratch (at most {max_pages} pages, dequant_prefill_max_pages) and the prefills, fresh "
                f"prompts included, run on {kernel} over it ({choice.reason}); the decodes read the quantised pages "
                "on the unified kernel, as do the prefills of a batch needing more pages or captured in a CUDA graph")

    @classmethod
    def get_builder_cls(cls) -> type[TritonMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[TritonImpl]:
        return TritonImpl
