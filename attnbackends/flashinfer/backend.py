"""The FlashInfer backend: a thin adapter over flashinfer's plan()/run() wrappers.

One :class:`FlashInferMetadataBuilder` per group of layers that share a plan (same heads, head size, dtypes,
page size, scale, sliding window and soft-cap). ``build()`` runs once per batch: it translates the common metadata
into FlashInfer's page table (:mod:`.plan_inputs`), then plans

- ``BatchDecodeWithPagedKVCacheWrapper`` for the leading decode requests (tensor cores for grouped heads), or a
  CUDA-graph decode wrapper on persistent buffers when the batch is a captured pure-decode size;
- ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for the trailing prefill / chunked-prefill requests, and for
  the whole batch when it holds multi-token decodes (speculative verify: the decode wrapper takes one query token
  per request) or a tree mask (planned as FlashInfer's ``custom_mask``, expanded to [query, key] per request by
  :func:`attnbackends.speculative.tree_mask.expand_tree_mask`);
- or, instead of both, ``MultiLevelCascadeAttentionWrapper`` when the builder's cascade policy is on (it is off by
  default: see :mod:`.cascade`), the engine reports a shared prefix and :func:`.cascade.cascade_prefix_blocks` says
  it pays.

Each is a step of ``build()`` returning its typed part of a frozen :class:`FlashInferStepPlan`
(:class:`DecodePart`, :class:`PrefillPart`, :class:`CascadePart`: the planned wrapper and the output rows it
writes); every layer's :class:`FlashInferImpl` then runs the plan's parts in order into slices of the caller's
output, along one path, and writes nothing to the metadata.

Page ids FlashInfer reads never point outside the cache. A block table with a host copy is range-checked before any
kernel runs (:mod:`attnbackends.ops.page_guard`). From a device-only table the page ids are gathered on the GPU and
contained there (an id outside the cache becomes page 0 and is recorded as a fault, :mod:`.page_ids`), against the
builder's ``num_blocks``; a builder made without it leaves them to every ``forward``, which contains them to its
cache in place (:attr:`FlashInferStepPlan.uncontained_page_ids`).

Plans fix the softmax scale, the window and the soft-cap, so all layers sharing a builder must agree on them. A
disagreement is caught twice: at builder construction when the engine passes ``layer_specs`` (a ValueError that
names the layer and the fields), and in every ``forward`` (the impl compares its own :class:`PlanKey` with the one
the metadata was planned for, a tuple comparison, and raises a ValueError naming the fields).

flashinfer is imported lazily, inside the builder, so this module imports (and ``not_supported_reasons`` answers)
on machines without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch

from ..compat import import_flashinfer
from ..interface import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CudaGraphSupport, QueryLenSupport
from ..metadata import CommonAttentionMetadata, split_decodes_and_prefills, validate_common_metadata
from ..platform import DeviceInfo
from ..spec import AttentionSpec, AttentionType, MaskKind
from ..masks import unpack_custom_masks
from ..speculative.tree_mask import expand_tree_mask
from ..validation import check_forward_inputs
from .cascade import CascadePolicy, cascade_prefix_blocks
from ..ops.flashinfer.plan_guard import planning
from ..ops.flashinfer.wrapper_pool import WrapperPool
from .lse_forward import forward_with_lse
from ..ops.kv_cache_write import reshape_and_cache
from ..ops.page_guard import contain_page_ids, has_host_table
from ..ops.flashinfer.page_ids import DECODE_TABLE_MAX_REQS
from ..ops.flashinfer.plan_inputs import DEFAULT_HOST_GATHER_MAX_PAGES, DevicePlanBuffer, PagedKVPlanInputs, paged_kv_plan_inputs
from ..ops.flashinfer.workspace import DEFAULT_WORKSPACE_BYTES

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "PlanKey",
]

logger = logging.getLogger(__name__)

class PlanKey(NamedTuple):
    """What a FlashInfer plan fixes for every layer that runs it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_cache_dtype: str  # the cache's torch dtype ("fp8" and "fp8_e4m3" are the same plan)
    block_size: int
    scale: float
    sliding_window: Optional[int]
    logits_soft_cap: Optional[float]

    @classmethod
    def of(cls, spec: AttentionSpec) -> "PlanKey":
        return cls(
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            kv_cache_dtype=str(spec.kv_cache_torch_dtype).removeprefix("torch."),
            block_size=spec.block_size,
            scale=float(spec.softmax_scale),
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
        )

    def differences(self, other: "PlanKey") -> list[str]:
        """``"field: planned X, layer Y"`` for every field where ``other`` (a layer) differs from this plan."""
        return [
            f"{name}: planned {mine!r}, layer {theirs!r}"
            for name, mine, theirs in zip(self._fields, self, other)
            if mine != theirs
        ]


def _check_spec(spec: AttentionSpec) -> None:
    """NotImplementedError for specs FlashInferBackend declares unsupported on any GPU (see not_supported_reasons)."""
    reasons = FlashInferBackend.spec_reasons(spec)
    if reasons:
        raise NotImplementedError("the flashinfer backend cannot serve this spec: " + "; ".join(reasons))


@dataclass(frozen=True)
class DecodePart:
    """The batch's leading single-token decodes on a planned decode wrapper (output rows ``[:num_tokens]``).

    ``wrapper``: a ``BatchDecodeWithPagedKVCacheWrapper`` (eager, a draft step's, or a CUDA-graph one)."""

    wrapper: Any
    num_tokens: int

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, scales: dict) -> None:
        n = self.num_tokens
        if n == query.shape[0] and n == output.shape[0]:  # the common pure-decode step: no views to make
            self.wrapper.run(query, kv_cache, out=output, **scales)
        else:
            self.wrapper.run(query[:n], kv_cache, out=output[:n], **scales)


@dataclass(frozen=True)
class PrefillPart:
    """The requests after the decodes (prefills, chunked prefills, and every request of a batch with multi-token
    decodes or a tree mask) on a planned prefill wrapper (output rows ``[first_token:num_actual_tokens]``).

    ``wrapper``: a ``BatchPrefillWithPagedKVCacheWrapper`` (eager, with or without a custom mask, or a CUDA-graph
    one of a captured verify shape)."""

    wrapper: Any
    first_token: int
    end_token: int

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, scales: dict) -> None:
        start, end = self.first_token, self.end_token
        self.wrapper.run(query[start:end], kv_cache, out=output[start:end], **scales)


@dataclass(frozen=True)
class CascadePart:
    """The whole batch on a planned ``MultiLevelCascadeAttentionWrapper``: every query over ``shared_blocks``
    shared pages, then each request over its own (output rows ``[:num_tokens]``)."""

    wrapper: Any
    shared_blocks: int
    num_tokens: int

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, scales: dict) -> None:
        n = self.num_tokens
        output[:n].copy_(self.wrapper.run(query[:n], kv_cache))


@dataclass(frozen=True)
class FlashInferStepPlan:
    """Everything ``forward`` runs for one batch, planned by ``build()``: the parts in order, each a planned wrapper
    with the output rows it writes.

    Attributes
    ----------
    parts : (:class:`DecodePart`, :class:`PrefillPart`) where the batch has them, or (:class:`CascadePart`,).
    cuda_graph : the decode wrapper (or a verify batch's prefill wrapper) runs on the builder's persistent CUDA-graph
        buffers.
    plan_inputs : the page table the decode / prefill wrappers were planned with (None with cascade).
    uncontained_page_ids : page-id arrays the wrappers read that were gathered from a device-only block table by a
        builder that was not told ``num_blocks``: every ``forward`` contains them to its cache, in place (one small
        kernel each; idempotent), before any wrapper runs. Empty where the builder contained them (``num_blocks``
        given) or the table was on the host (checked before any kernel).
    """

    parts: tuple[Any, ...]
    cuda_graph: bool = False
    plan_inputs: Optional[PagedKVPlanInputs] = None
    uncontained_page_ids: tuple[torch.Tensor, ...] = ()

    def part(self, kind: type) -> Optional[Any]:
        """The part of type ``kind`` (:class:`DecodePart`, :class:`PrefillPart`, :class:`CascadePart`), or None."""
        return next((p for p in self.parts if type(p) is kind), None)


@dataclass(frozen=True)
class FlashInferMetadata:
    """One batch, planned; shared by every layer of the builder's group, never written after ``build()``.

    The wrappers hold the plan: a builder keeps one set, so build the next batch only after the last layer of this
    one has been enqueued.

    Attributes
    ----------
    plan_key : what the plan fixed (checked against each layer's spec in forward).
    num_actual_tokens, num_decodes, num_decode_tokens, num_prefills : the batch's split (decodes first).
    slot_mapping : [num_tokens] int64 on the device (the common metadata's).
    plan : the planned wrappers ``forward`` runs (:class:`FlashInferStepPlan`).
    """

    plan_key: PlanKey
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    slot_mapping: torch.Tensor
    plan: FlashInferStepPlan
    debug: bool = False  # the builder's debug flag: impls validate inputs and the block table on every call
    common: Optional[CommonAttentionMetadata] = None  # the batch (read by the checks)

    # Views of the plan, read by tests and benchmarks.
    @property
    def decode_wrapper(self) -> Any:
        part = self.plan.part(DecodePart)
        return None if part is None else part.wrapper

    @property
    def prefill_wrapper(self) -> Any:
        part = self.plan.part(PrefillPart)
        return None if part is None else part.wrapper

    @property
    def cascade_wrapper(self) -> Any:
        part = self.plan.part(CascadePart)
        return None if part is None else part.wrapper

    @property
    def cascade_shared_blocks(self) -> int:
        part = self.plan.part(CascadePart)
        return 0 if part is None else part.shared_blocks

    @property
    def cuda_graph(self) -> bool:
        return self.plan.cuda_graph

    @property
    def plan_inputs(self) -> Optional[PagedKVPlanInputs]:
        return self.plan.plan_inputs


@dataclass(frozen=True)
class _Split:
    """How ``build()`` serves a batch's requests (decodes first): ``num_decodes`` single-token decodes on the decode
    wrapper, the other ``num_prefills`` requests on the prefill wrapper; ``verify``: a batch of multi-token decodes
    only (speculative verify, which a captured CUDA graph may replay); ``tree``: it carries a tree mask."""

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    verify: bool
    tree: bool


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans FlashInfer's wrappers once per batch for a group of layers that share one plan.

    Parameters (besides the base class's)
    ----------
    layer_specs : the specs of every layer that will run this builder's metadata; each must agree with ``spec``
        on what a plan fixes (:class:`PlanKey`), else ValueError here rather than wrong numbers later.
    workspace_bytes : None (default): the device's shared float workspace (:func:`.workspace.shared_workspace`, one
        for every FlashInfer wrapper of the process: they run one after another on a stream); a size: a workspace of
        this builder's own (for builders whose layers run on concurrent streams).
    cascade_policy : when to use cascade attention (:class:`.cascade.CascadePolicy`); the default is off,
        ``CascadePolicy(enabled=True)`` lets its thresholds decide per batch.
    max_model_len : longest sequence, sizing the persistent page-index buffer of CUDA-graph decode.
    use_tensor_cores : decode on tensor cores; default: when query heads are grouped (num_heads > num_kv_heads).
    fast_plan : after a decode wrapper's first ``plan()``, re-plan it for later batches with
        :class:`.fast_plan.DecodeReplanner` (the same plan, less host time) where the installed flashinfer is a
        tested version; ``decode_replan_status`` says whether it is in use and why not. False: always ``plan()``.
    host_gather_max_pages : batches of up to this many pages gather their page ids on the host (from
        ``block_table_cpu``), larger ones on the GPU (:mod:`.page_ids`).
    num_blocks : pages of the KV caches of this builder's layers (the base class's: ``build()`` range-checks the
        batch's page ids against them); page ids gathered from a device-only block table are contained to them in
        ``build()``. None: every ``forward`` checks the page ids and contains the gathered ones to its cache.
    """

    reorder_batch_threshold = 1
    # Decodes of more than one token (speculative verify, with or without a tree mask) run on the prefill wrapper:
    # FlashInfer's decode wrapper takes one query token per request.
    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 128
    supports_tree_mask = True

    def __init__(
        self,
        spec: AttentionSpec,
        device: "torch.device | str" = "cpu",
        *,
        max_num_reqs: int = 256,
        max_num_tokens: int = 8192,
        debug: bool = False,
        layer_specs: Optional[Sequence[AttentionSpec]] = None,
        workspace_bytes: Optional[int] = None,
        cascade_policy: Optional[CascadePolicy] = None,
        max_model_len: int = 32768,
        use_tensor_cores: Optional[bool] = None,
        fast_plan: bool = True,
        host_gather_max_pages: int = DEFAULT_HOST_GATHER_MAX_PAGES,
        num_blocks: Optional[int] = None,
    ) -> None:
        super().__init__(spec, device, max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, debug=debug,
                         num_blocks=num_blocks)
        _check_spec(spec)
        self.plan_key = PlanKey.of(spec)
        for i, layer in enumerate(layer_specs or ()):
            diff = self.plan_key.differences(PlanKey.of(layer))
            if diff:
                raise ValueError(
                    f"layer_specs[{i}] cannot share this FlashInfer plan ({'; '.join(diff)}): a plan fixes the "
                    "scale, sliding window, soft-cap, heads, head size, dtypes and block size for every layer that "
                    "runs it; give layers that differ their own builder"
                )
        if workspace_bytes is not None and workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be None or positive, got {workspace_bytes}")
        self.workspace_bytes = workspace_bytes
        self.cascade_policy = cascade_policy if cascade_policy is not None else CascadePolicy()
        self.max_model_len = max_model_len
        self.use_tensor_cores = spec.num_queries_per_kv > 1 if use_tensor_cores is None else bool(use_tensor_cores)
        # FlashInfer's window_left counts the keys left of the query: W visible keys, self included -> W - 1.
        self.window_left = spec.window[0] if spec.window is not None else -1
        self._pin = self.device.type == "cuda"
        self._plan_kwargs = dict(
            window_left=self.window_left,
            logits_soft_cap=spec.logits_soft_cap,
            sm_scale=spec.softmax_scale,
            q_data_type=spec.torch_dtype,
            kv_data_type=spec.kv_cache_torch_dtype,
        )
        self.wrappers = WrapperPool(
            spec, self.device, import_flashinfer, workspace_bytes=workspace_bytes,
            use_tensor_cores=self.use_tensor_cores, max_num_reqs=self.max_num_reqs, max_model_len=max_model_len,
            window_left=self.window_left, fast_plan=fast_plan)
        self.host_gather_max_pages = host_gather_max_pages
        # Each batch's page table goes here by one copy (from a pinned host buffer of torch's caching host
        # allocator, which keeps a buffer out of use until the copies out of it have run).
        self._device_plan_buffer: Optional[DevicePlanBuffer] = None

    # -- wrappers (the pool), and what they report ----------------------------------------------------------------
    @property
    def decode_replan_status(self) -> dict[str, str]:
        """For each decode wrapper planned so far ("eager", or "graph B" for a CUDA-graph size): "replanned" when
        later batches skip ``plan()`` (:mod:`.fast_plan`), else why they go through it."""
        return self.wrappers.decode_replan_status

    @property
    def cudagraph_batch_sizes(self) -> list[int]:
        """The pure-decode batch sizes that have persistent CUDA-graph plans."""
        return self.wrappers.cudagraph_batch_sizes

    # -- building -----------------------------------------------------------------------------------------------
    def build(self, common: CommonAttentionMetadata, *, common_prefix_len: int = 0) -> FlashInferMetadata:
        """Plan one batch (decodes first, see ``reorder_batch_threshold``).

        common_prefix_len : tokens at the start of every request known to lie in the same pages (the engine's prefix
            cache knows; :func:`.plan_inputs.shared_prefix_blocks` computes it from host block tables). With 0 (the
            default, or an attribute ``common_prefix_len`` on ``common``) cascade attention is never used.
        """
        if common_prefix_len == 0:
            common_prefix_len = common.common_prefix_len
        return self._build(common, common_prefix_len)

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan a pure-decode batch on persistent buffers for capture; later ``build()`` calls with the same number
        of requests, all decodes, re-plan those buffers so the captured graph replays the new batch.

        Verify batches (decodes of up to ``reorder_batch_threshold`` tokens, with or without a tree mask) capture
        the same way on a CUDA-graph prefill wrapper: later batches with the same requests and tokens (and a tree
        mask where the captured one had one) re-plan its buffers."""
        split = split_decodes_and_prefills(common, self.reorder_batch_threshold)
        if split.num_prefills:
            raise ValueError(
                f"CUDA-graph capture takes pure-decode batches (query_len <= {self.reorder_batch_threshold}); this "
                f"one has {split.num_prefills} prefill requests"
            )
        custom = common.masks is not None and common.masks.custom_mask is not None
        if common.spec_tree_mask is not None or custom or common.num_actual_tokens > common.num_reqs:
            self.wrappers.graph_verify(common.num_reqs, common.num_actual_tokens,
                                       common.spec_tree_mask is not None or custom)
        else:
            self.wrappers.graph_decode(common.num_reqs)
        return self._build(common, 0)

    def build_draft_steps(self, draft) -> list[FlashInferMetadata]:
        """See :meth:`AttentionMetadataBuilder.build_draft_steps`: each step is planned on its own decode wrapper
        (the steps share the float workspace: they run one after another); each step's page ids are checked as a
        ``build()`` checks them."""
        steps = []
        for s, common in enumerate(draft.steps):
            self.check_page_ids(common)
            steps.append(self.mark_origin(self._build(common, 0, self.wrappers.draft_step(s))))
        return steps

    def _build(self, common: CommonAttentionMetadata, common_prefix_len: int,
               draft_step: Optional[tuple[Any, DevicePlanBuffer]] = None) -> FlashInferMetadata:
        """Plan one batch: the split, then either the cascade part or the decode and prefill parts over one page
        table. ``draft_step``: a draft step's decode wrapper and page-table buffer (no CUDA-graph wrapper, no
        cascade)."""
        step_wrapper, buffer = draft_step if draft_step is not None else (None, None)
        if self.debug:
            validate_common_metadata(common, block_size=self.spec.block_size)
        if bool(common.causal) != self.spec.causal:
            raise ValueError(f"common.causal is {common.causal}, the layer's mask ({self.spec.mask.describe()}) is "
                             f"{'causal' if self.spec.causal else 'non-causal'}")
        split = self._split(common, draft=step_wrapper is not None)
        num_reqs = common.num_reqs
        graph_decode = (self.wrappers.captured_decode(num_reqs)
                        if split.num_prefills == 0 and step_wrapper is None else None)
        graph_verify = (self.wrappers.captured_verify(num_reqs, common.num_actual_tokens, split.tree)
                        if split.verify else None)
        # a device-only table: the page ids are gathered on the device, contained to num_blocks where known
        contain = not has_host_table(common)
        bound = self.num_blocks if contain else None
        if (common_prefix_len > 0 and graph_decode is None and graph_verify is None and not split.tree
                and step_wrapper is None):
            cascade = self._plan_cascade(common, common_prefix_len, contain)
            if cascade is not None:
                return self._metadata(common, split, cascade)
        decode_wrapper = None
        if split.num_decodes:
            decode_wrapper = step_wrapper or (graph_decode if graph_decode is not None else self.wrappers.decode())
        inputs = self._page_table(common, split, decode_wrapper, buffer, bound)
        parts: list[Any] = []
        if decode_wrapper is not None:
            parts.append(self._plan_decode(common, split, inputs, decode_wrapper))
        if split.num_prefills:
            parts.append(self._plan_prefill(common, split, inputs, graph_verify))
        uncontained: tuple[torch.Tensor, ...] = ()
        if contain and bound is None:
            # CUDA-graph wrappers read a copy of the page ids in the builder's persistent buffer
            graph_ids = (self.wrappers.graph_page_ids(inputs.num_pages),) if graph_decode is not None else ()
            uncontained = (inputs.kv_indices, *graph_ids)
        plan = FlashInferStepPlan(tuple(parts), graph_decode is not None or graph_verify is not None, inputs,
                                  uncontained)
        return self._metadata(common, split, plan)

    def _metadata(self, common: CommonAttentionMetadata, split: _Split, plan: FlashInferStepPlan
                  ) -> FlashInferMetadata:
        return FlashInferMetadata(
            plan_key=self.plan_key, num_actual_tokens=common.num_actual_tokens, num_decodes=split.num_decodes,
            num_decode_tokens=split.num_decode_tokens, num_prefills=split.num_prefills,
            slot_mapping=common.slot_mapping, plan=plan, debug=self.debug, common=common)

    def _split(self, common: CommonAttentionMetadata, *, draft: bool) -> _Split:
        """Which requests run on which wrapper: the leading single-token decodes on the decode wrapper, the rest on
        the prefill wrapper; a batch with multi-token decodes or a tree mask entirely on the prefill wrapper
        (FlashInfer's decode wrapper takes one query token per request). ``draft``: a draft step (never a verify
        batch)."""
        num_reqs = common.num_reqs
        if common.max_query_len <= self.reorder_batch_threshold:  # all decodes: skip the split's tensor reads
            num_decodes, num_decode_tokens, num_prefills = num_reqs, common.num_actual_tokens, 0
        else:
            split = split_decodes_and_prefills(common, self.reorder_batch_threshold)
            num_decodes, num_decode_tokens, num_prefills = split.num_decodes, split.num_decode_tokens, split.num_prefills
        # a tree or a custom mask: FlashInfer's custom_mask on the prefill wrapper, for every request
        tree = common.spec_tree_mask is not None or (common.masks is not None and common.masks.custom_mask is not None)
        if tree or num_decode_tokens > num_decodes:
            return _Split(0, 0, num_reqs, verify=num_prefills == 0 and not draft, tree=tree)
        return _Split(num_decodes, num_decode_tokens, num_prefills, verify=False, tree=tree)

    def _page_table(self, common: CommonAttentionMetadata, split: _Split, decode_wrapper: Any,
                    buffer: Optional[DevicePlanBuffer], bound: Optional[int]) -> PagedKVPlanInputs:
        """The batch's page table for the decode and prefill wrappers: built on the GPU for the common decode step
        (a re-planned decode wrapper, a device block table; the host computes kv_indptr alone), else by
        :func:`.plan_inputs.paged_kv_plan_inputs`. Page ids gathered on the device are contained to ``bound``."""
        replanner = self.wrappers.replanner_for(decode_wrapper) if decode_wrapper is not None else None
        if (replanner is not None and split.num_prefills == 0 and common.num_reqs <= DECODE_TABLE_MAX_REQS
                and common.block_table.is_cuda and common.seq_lens.is_cuda):
            return (buffer or self._device_buffer()).decode_table(
                common.seq_lens_cpu, common.seq_lens, common.block_table, self.spec.block_size, common.max_seq_len,
                bound)
        return self._plan_inputs(common, buffer=buffer, bound=bound)

    def _plan_decode(self, common: CommonAttentionMetadata, split: _Split, inputs: PagedKVPlanInputs,
                     wrapper: Any) -> DecodePart:
        """The decodes' part: ``wrapper`` re-planned (:mod:`.fast_plan`) where it can be, else through ``plan()``."""
        spec, num_decodes = self.spec, split.num_decodes
        replanner = self.wrappers.replanner_for(wrapper)
        if replanner is not None:
            replanner.replan(inputs, num_decodes, common.seq_lens_cpu,
                             max_kv_len=common.max_seq_len if split.num_prefills == 0 else None)
            return DecodePart(wrapper, split.num_decode_tokens)
        part = inputs.select(0, num_decodes)
        with planning(wrapper):
            wrapper.plan(
                part.kv_indptr,
                part.kv_indices,
                part.kv_last_page_len,
                spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size,
                pos_encoding_mode="NONE",
                o_data_type=spec.torch_dtype,
                non_blocking=True,
                seq_lens=common.seq_lens_cpu[:num_decodes],  # spares plan() recomputing the KV lengths
                **self._plan_kwargs,
            )
        self.wrappers.after_public_plan(wrapper)
        return DecodePart(wrapper, split.num_decode_tokens)

    def _plan_prefill(self, common: CommonAttentionMetadata, split: _Split, inputs: PagedKVPlanInputs,
                      graph_wrapper: Any) -> PrefillPart:
        """The part after the decodes on the prefill wrapper: ``graph_wrapper`` (a captured verify shape's) or the
        eager one, with a custom mask for a tree."""
        spec, tree = self.spec, split.tree
        first, num_reqs = split.num_decodes, common.num_reqs
        wrapper = graph_wrapper or self.wrappers.prefill(custom_mask=tree)
        part = inputs.select(first, num_reqs)
        qo_indptr, kv_indptr, last_page_len = part.qo_indptr, part.kv_indptr, part.kv_last_page_len
        if tree:
            # plan() packs a custom mask on the device with an indptr it derives from these: they must be there
            # (plan() then copies them back to the host: tree batches pay one sync in build()).
            qo_indptr, kv_indptr, last_page_len = (t.to(self.device) for t in (qo_indptr, kv_indptr, last_page_len))
        with planning(wrapper):
            wrapper.plan(
                qo_indptr,
                kv_indptr,
                part.kv_indices,
                last_page_len,
                spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size,
                causal=spec.causal,
                custom_mask=self._custom_mask(common, first, num_reqs) if tree else None,
                pos_encoding_mode="NONE",
                o_data_type=spec.torch_dtype,
                non_blocking=True,
                seq_lens=common.seq_lens_cpu[first:num_reqs],
                **self._plan_kwargs,
            )
        return PrefillPart(wrapper, split.num_decode_tokens, common.num_actual_tokens)

    @staticmethod
    def _custom_mask(common: CommonAttentionMetadata, first: int, last: int) -> torch.Tensor:
        """The [sum query_len * seq_len] bool mask of requests ``first..last-1`` for the prefill wrapper's
        ``custom_mask``: the batch's custom masks (kind custom), else its tree mask expanded."""
        if common.masks is not None and common.masks.custom_mask is not None:
            return unpack_custom_masks(common, first, last)
        return expand_tree_mask(common, first, last)

    def _device_buffer(self) -> DevicePlanBuffer:
        if self._device_plan_buffer is None:
            self._device_plan_buffer = DevicePlanBuffer(self.device)
        return self._device_plan_buffer

    def _plan_inputs(self, common: CommonAttentionMetadata, skip_pages: int = 0,
                     buffer: Optional[DevicePlanBuffer] = None, bound: Optional[int] = None) -> PagedKVPlanInputs:
        """The batch's page table (without each request's first ``skip_pages`` pages), on the host and in the
        builder's device buffer (or ``buffer``); page ids gathered on the device are contained to ``bound`` pages
        when given."""
        return paged_kv_plan_inputs(
            common.query_start_loc_cpu,
            common.seq_lens_cpu,
            common.block_table,
            self.spec.block_size,
            skip_pages=skip_pages,
            pin_memory=self._pin,
            block_table_cpu=common.block_table_cpu,
            max_seq_len=common.max_seq_len,
            device_buffer=buffer or self._device_buffer(),
            host_gather_max_pages=self.host_gather_max_pages,
            num_blocks=bound,
        )

    def _plan_cascade(self, common: CommonAttentionMetadata, common_prefix_len: int,
                      contain: bool) -> Optional[FlashInferStepPlan]:
        """The cascade plan where :func:`.cascade.cascade_prefix_blocks` says it pays (None: it does not). Two levels:
        every query over the shared pages (one pseudo-request, no mask: they are all cached context), then each
        request over its own remaining pages (causal). ``contain``: the block table is device-only."""
        spec = self.spec
        bs = spec.block_size
        shared_blocks = cascade_prefix_blocks(
            self.cascade_policy,
            num_reqs=common.num_reqs,
            common_prefix_len=common_prefix_len,
            block_size=bs,
            min_context_len=int(common.context_lens_cpu.min()),
            total_kv_tokens=int(common.seq_lens_cpu.sum()),
            sliding_window=spec.sliding_window,
            fp8_kv_cache=spec.is_fp8_kv_cache,
        )
        if not shared_blocks:
            return None
        bound = self.num_blocks if contain else None
        unique = self._plan_inputs(common, skip_pages=shared_blocks, bound=bound)
        top_qo = torch.tensor([0, common.num_actual_tokens], dtype=torch.int32)
        top_kv = torch.tensor([0, shared_blocks], dtype=torch.int32)
        top_last = torch.tensor([bs], dtype=torch.int32)
        top_indices = common.block_table[0, :shared_blocks]
        uncontained: tuple[torch.Tensor, ...] = ()
        if contain:  # a copy: containment must not write the engine's block table
            top_indices = top_indices.to(torch.int32, copy=True)
            if bound is None:
                uncontained = (top_indices, unique.kv_indices)
            else:
                contain_page_ids(top_indices, bound)
        wrapper = self.wrappers.cascade()
        with planning(wrapper):
            wrapper.plan(
                [top_qo, unique.qo_indptr],
                [top_kv, unique.kv_indptr],
                [top_indices, unique.kv_indices],
                [top_last, unique.kv_last_page_len],
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_size,
                bs,
                causal=spec.causal,
                pos_encoding_mode="NONE",
                **self._plan_kwargs,
            )
        part = CascadePart(wrapper, shared_blocks, common.num_actual_tokens)
        return FlashInferStepPlan((part,), uncontained_page_ids=uncontained)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """One layer: writes its new K/V with the shared cache-write op, then runs the batch's planned wrappers into
    slices of the caller's output (decodes ``[:num_decode_tokens]``, prefills after them)."""

    can_return_lse = True
    forward_with_lse = forward_with_lse

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        _check_spec(spec)
        self.plan_key = PlanKey.of(spec)
        # FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale.
        self._run_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if spec.is_fp8_kv_cache else {}
        self._write_checked = False

    def update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if slot_mapping.shape[0] > key.shape[0]:
            slot_mapping = slot_mapping[: key.shape[0]]
        # The argument checks cost host time: once per layer is enough (shapes, dtypes, devices do not change).
        reshape_and_cache(key, value, kv_cache, slot_mapping, self.k_scale, self.v_scale, validate=not self._write_checked)
        self._write_checked = True

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor],
        value: Optional[torch.Tensor],
        kv_cache: Optional[torch.Tensor],
        metadata: FlashInferMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if metadata.plan_key != self.plan_key:
            raise ValueError(
                "this layer disagrees with the FlashInfer plan its metadata was built for ("
                + "; ".join(metadata.plan_key.differences(self.plan_key))
                + "): layers that differ need their own FlashInferMetadataBuilder"
            )
        if kv_cache is None:
            raise ValueError("the flashinfer backend needs a paged kv_cache (decoder self-attention)")
        check_forward_inputs(self, metadata, metadata.common, query, key, value, kv_cache, output,
                             backend=FlashInferBackend)
        plan = metadata.plan
        for page_ids in plan.uncontained_page_ids:  # a builder without num_blocks and a device-only table
            contain_page_ids(page_ids, kv_cache.shape[0])
        if key is not None:
            if value is None:
                raise ValueError("key and value must be given together (or both None when the cache holds them)")
            self.update_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        for part in plan.parts:
            part.run(query, kv_cache, output, self._run_scales)
        return output


class FlashInferBackend(AttentionBackend):
    """FlashInfer's paged decode / prefill / cascade wrappers behind the common interface (CUDA, sm80+)."""

    name = "flashinfer"
    description = "FlashInfer plan/run wrappers: paged decode (tensor cores for GQA), causal prefill, cascade"
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"})
    supported_head_sizes = frozenset({64, 128, 256})
    kv_cache_16bit_must_match_dtype = True
    min_compute_capability = (8, 0)
    required_packages = ("flashinfer",)
    supported_attn_types = frozenset({AttentionType.DECODER})
    supports_sliding_window = True
    supports_alibi = False
    supports_logits_soft_cap = True
    supports_sinks = False
    supports_separate_v_head_size = False
    # Custom masks on the prefill wrapper (custom_mask), every request there; non-causal: causal=False (a decode
    # sees its whole cache either way).
    supported_mask_kinds = frozenset({MaskKind.CAUSAL, MaskKind.NON_CAUSAL, MaskKind.CUSTOM})
    mask_decline_notes = {
        "window_right": "FlashInfer's window_right is ignored by its kernels (FlashInfer issue #4893)",
        "block_causal": "FlashInfer has no block-causal mask (a custom mask of kind 'custom' expresses it)",
        "causal_spans": "FlashInfer has no span mask (a custom mask of kind 'custom' expresses it)",
    }
    # Pure-decode batches of a captured size replay on the builder's persistent plan buffers (see
    # FlashInferMetadataBuilder.build_for_cudagraph_capture); prefills and cascade run eagerly.
    cudagraph_support = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_builder_cls(cls) -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[FlashInferImpl]:
        return FlashInferImpl

    @classmethod
    def warmup(cls, specs: Sequence[AttentionSpec], device: DeviceInfo) -> list[str]:
        """Build the JIT modules ``specs`` need, side by side (:func:`attnbackends.flashinfer.warmup.precompile`);
        on a CUDA device only (FlashInfer runs nowhere else)."""
        from .warmup import precompile

        if not device.is_cuda:
            return []
        return precompile(specs, device.torch_device, builder_cls=cls.get_builder_cls())

    @classmethod
    def environment_facts(cls) -> dict[str, Optional[str]]:
        """The installed flashinfer's version (None: not installed)."""
        from ..compat import package_version

        return {"flashinfer": package_version("flashinfer-python") or package_version("flashinfer")}
