"""The fast MLA backends: ``triton_mla`` (our split-KV Triton decode kernel) and ``flashinfer_mla`` (FlashInfer's
BatchMLAPagedAttentionWrapper). Both share the prefill path of :class:`~attnbackends.mla.common.MLAImpl`."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional

import torch

from ..compat import fallback_reason, import_flashinfer, surface_unsupported_reason
from ..ops.launch import launch_prepared_sequence
from ..ops.flashinfer.plan_guard import planning
from ..ops.flashinfer.plan_inputs import paged_kv_plan_inputs
from ..ops.flashinfer.wrapper_pool import mla_paged_wrapper
from ..interface import AttentionBackend, CudaGraphSupport, QueryLenSupport
from ..ops.page_guard import PageTableError, contain_page_ids, has_host_table, raise_pending_faults
from ..platform import DeviceInfo, is_triton_interpreted
from ..spec import AttentionSpec
from ..ops.mla_cache import MLA_KV_CACHE_LAYOUT, mla_kv_cache_shape
from .common import MLADecodeMetadata, MLAImpl, MLAMetadataBuilder
from .decode_plan import (
    Absorption, DecodePlanKey, FlashInferMLADecodePlan, HeadMajor, PreparedStep, TensorFacts, TokenMajor,
    TritonMLADecodePlan, UpProjection,
)
from .decode_hopper import hopper_reason
from ..ops.quant import FP8_DTYPES
from .decode_kernel import MLADecodeConfig, choose_num_splits, default_decode_config
from .decode_launch import (
    LOG2E, CacheStates, MLACacheState, launch_mla_absorb, launch_mla_absorb_and_write, launch_mla_decode,
    launch_mla_up_projection, plan_mla_absorb, plan_mla_decode, prepared_decode_launches, tensor_key,
    weight_launch_state,
)

__all__ = [
    "TritonMLABackend",
    "TritonMLAMetadataBuilder",
    "TritonMLAImpl",
    "FlashInferMLABackend",
    "FlashInferMLAMetadataBuilder",
    "FlashInferMLAImpl",
]


class _MLABackendBase(AttentionBackend):
    is_mla = True
    kv_cache_layout = MLA_KV_CACHE_LAYOUT
    cudagraph_support = CudaGraphSupport.NEVER
    # Causal only: the latent decode kernels and the chunked-context prefill have no mask beyond causal and windows.
    mask_decline_notes = {kind: "MLA's decode kernels and chunked-context prefill are causal only"
                          for kind in ("non_causal", "block_causal", "causal_spans", "custom")}

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return mla_kv_cache_shape(num_blocks, spec.block_size, spec.head_size)


# ---------------------------------------------------------------------------------------------------- triton_mla


class TritonMLAMetadataBuilder(MLAMetadataBuilder):
    """Plans the decode once per batch for every layer, as a
    :class:`~attnbackends.mla.decode_plan.TritonMLADecodePlan` (``metadata.decode.plan``): the decode kernel's
    launch (:func:`~attnbackends.mla.decode_launch.plan_mla_decode`: the kernel, the KV split count from host data
    only, grid, constexprs) over views of the builder's persistent decode buffers, shared by every layer of a batch:
    the absorbed queries and the latent output ([N, T, Lkv] each, the layouts the absorption and up-projection
    matmuls write and read without copies) and the split-KV partials. A plan is kept for later batches under its
    :class:`~attnbackends.mla.decode_plan.DecodePlanKey` (whose docstring says when it is stale), so an engine that
    reuses its metadata buffers plans each batch shape once.

    The query absorption (q_nope -> Lkv per head) is planned here (``absorb``; the plan's ``absorption`` and
    ``absorption_reason``): "triton" runs it as one cached Triton launch
    (:func:`~attnbackends.mla.projection_kernels._mla_absorb_kernel`) that also copies the rotary queries into a
    planned buffer, "bmm" as ``torch.bmm``; "auto" takes Triton for at most :attr:`TRITON_ABSORB_MAX_TOKENS` decode
    tokens (cuBLAS for more). In a decode-only batch the Triton absorption's launch also writes the new tokens into
    the latent cache (the plan's ``writes_cache``, :func:`~attnbackends.mla.decode_launch.launch_mla_absorb_and_write`),
    so ``forward`` issues no separate cache-write launch; batches with prefills, and the bmm absorption, write
    through ``update_kv_cache``.

    The up-projection (latent -> V per head) is planned here too (``up_projection``; the plan's ``up_projection``
    and ``up_projection_reason``): "fused" runs it as one Triton launch that also merges the KV splits
    (:mod:`~attnbackends.mla.projection_kernels`), "bmm" as the split reduction's launch (if any) then
    ``torch.bmm``; "auto" fuses split decodes of at most :attr:`FUSED_SPLIT_MAX_TOKENS` query tokens and unsplit
    decodes of at most :attr:`FUSED_UP_MAX_TOKENS` (a few host microseconds per torch op and cuBLAS call saved).
    The fused kernel merges a program's tokens one after another (a head and a block of tokens per program), so a
    split decode of several tokens runs faster as the parallel reduction and a cuBLAS matmul.

    Speculative decoding: decodes of up to ``max_decode_query_len`` tokens (any mix of lengths) run on the decode
    kernel, a request's query tokens x heads as the rows of its programs (the cache is read once per request), with
    the tree mask honoured over each request's draft segment.
    """

    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 64
    supports_tree_mask = True
    #: Unsplit decodes of at most this many query tokens run the fused Triton up-projection under "auto".
    FUSED_UP_MAX_TOKENS = 16
    #: Split decodes of at most this many query tokens run the fused Triton up-projection under "auto".
    FUSED_SPLIT_MAX_TOKENS = 1
    UP_PROJECTIONS = ("auto", "fused", "bmm")
    #: Decodes of at most this many query tokens run the Triton absorption under "auto".
    TRITON_ABSORB_MAX_TOKENS = 16
    ABSORBS = ("auto", "triton", "bmm")
    #: Decode plans kept for later batches with the same planning inputs (the oldest dropped first).
    KEPT_PLANS = 8

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", *,
                 decode_config: Optional[MLADecodeConfig] = None, num_splits: Optional[int] = None,
                 up_projection: str = "auto", absorb: str = "auto", **kwargs: Any) -> None:
        super().__init__(spec, device, **kwargs)
        if up_projection not in self.UP_PROJECTIONS:
            raise ValueError(f"up_projection must be one of {self.UP_PROJECTIONS}, got {up_projection!r}")
        if absorb not in self.ABSORBS:
            raise ValueError(f"absorb must be one of {self.ABSORBS}, got {absorb!r}")
        self.up_projection = up_projection
        self.absorb = absorb
        self.decode_config = decode_config or default_decode_config(
            spec.num_heads, interpreted=is_triton_interpreted())
        self.num_splits = num_splits
        self._decode_buffer = torch.empty(0, dtype=torch.float32, device=self.device)
        self._kept_plans: dict[DecodePlanKey, TritonMLADecodePlan] = {}

    def build_decode_plan(self, decode: MLADecodeMetadata, common) -> TritonMLADecodePlan:
        spec = self.spec
        splits = self.num_splits or choose_num_splits(
            decode.num_decodes, spec.num_heads * decode.max_query_len, decode.max_seq_len, self.device_info.sm_count,
            self.decode_config,
        )
        decode_only = decode.num_decode_tokens == common.num_actual_tokens
        facts = TensorFacts.of
        key = DecodePlanKey(decode.num_decode_tokens, splits, decode.max_query_len, decode_only,
                            facts(decode.block_table), facts(decode.seq_lens), facts(decode.query_start_loc),
                            facts(decode.tree_mask), facts(decode.tree_indptr),
                            facts(common.slot_mapping) if decode_only else None)
        plan = self._kept_plans.get(key)
        if plan is None:
            plan = self._plan_decode(decode, common, splits, decode_only)
            if len(self._kept_plans) >= self.KEPT_PLANS:
                self._kept_plans.pop(next(iter(self._kept_plans)))
            self._kept_plans[key] = plan
        return plan

    def _plan_decode(self, decode: MLADecodeMetadata, common, splits: int, decode_only: bool) -> TritonMLADecodePlan:
        """This batch's decode plan (see the class docstring)."""
        spec = self.spec
        t, n, lkv = decode.num_decode_tokens, spec.num_heads, spec.kv_lora_rank
        p, r, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        # float32 elements: [N, T, Lkv] absorbed queries, [N, T, Lkv] latent output and [T, N, R] rotary queries
        # in the model dtype, then the [T, N, S, Lkv] and [T, N, S] float32 partials; every part starts 256-byte
        # aligned
        part16 = -(-t * n * lkv * spec.torch_dtype.itemsize // 256) * 64
        pe16 = -(-t * n * r * spec.torch_dtype.itemsize // 256) * 64
        part_elems = t * n * splits * (lkv + 1) if splits > 1 else 0
        if self._decode_buffer.numel() < 2 * part16 + pe16 + part_elems:
            self._decode_buffer = torch.empty(2 * part16 + pe16 + part_elems, dtype=torch.float32, device=self.device)
        buf = self._decode_buffer
        ql = buf[:part16].view(spec.torch_dtype)[: t * n * lkv].view(n, t, lkv)
        latent = buf[part16: 2 * part16].view(spec.torch_dtype)[: t * n * lkv].view(n, t, lkv)
        q_pe = buf[2 * part16: 2 * part16 + pe16].view(spec.torch_dtype)[: t * n * r].view(t, n, r)
        partials = None
        if splits > 1:
            at = 2 * part16 + pe16
            partials = (buf[at: at + t * n * splits * lkv].view(t, n, splits, lkv),
                        buf[at + t * n * splits * lkv: at + part_elems].view(t, n, splits))
        up_projection, up_reason = self._up_projection(splits, t)
        absorption, absorb_reason = self._absorption(t)
        launch = plan_mla_decode(
            num_tokens=t, num_heads=n, kv_lora=lkv, rope=spec.qk_rope_head_dim, page=spec.block_size,
            cache_dtype=spec.kv_cache_torch_dtype, q_dtype=spec.torch_dtype, block_table=decode.block_table,
            seq_lens=decode.seq_lens, output=latent.transpose(0, 1), num_splits=splits, config=self.decode_config,
            compute_capability=self.device_info.compute_capability, partials=partials,
            query_start_loc=decode.query_start_loc, max_query_len=decode.max_query_len, tree_mask=decode.tree_mask,
            tree_indptr=decode.tree_indptr, fuse_up_projection=up_projection is UpProjection.FUSED,
            v_dim=spec.v_head_dim,
        )
        ql_t = ql.transpose(0, 1)
        # the Triton absorption writes ql and a copy of the rotary queries: the decode launch reads planned buffers;
        # in a decode-only batch its launch writes the new tokens into the cache too
        absorb_launch = None
        if absorption is Absorption.TRITON:
            absorb_launch = plan_mla_absorb(num_tokens=t, num_heads=n, nope=p, rope=r, kv_lora=lkv, ql=ql_t,
                                            q_pe=q_pe, slot_mapping=common.slot_mapping if decode_only else None)
        # the views of the call's q and output the matmuls need are one as_strided each, whatever rows they have
        return TritonMLADecodePlan(
            writes_cache=absorb_launch is not None and decode_only, num_splits=splits, launch=launch,
            absorption=absorption, absorption_reason=absorb_reason, absorb_launch=absorb_launch,
            up_projection=up_projection, up_projection_reason=up_reason, ql=ql, ql_t=ql_t, ql_key=tensor_key(ql_t),
            q_pe=q_pe, q_pe_key=tensor_key(q_pe), latent=latent, q_nope_view=HeadMajor(n, t, p),
            q_pe_view=TokenMajor(t, n, r), out_view=HeadMajor(n, t, v),
        )

    def _absorption(self, num_tokens: int) -> tuple[Absorption, str]:
        """How the query absorption runs, and why (see the class docstring)."""
        if self.absorb != "auto":
            return Absorption(self.absorb), f"absorb={self.absorb!r}"
        limit = self.TRITON_ABSORB_MAX_TOKENS
        if num_tokens <= limit:
            return Absorption.TRITON, f"auto: {num_tokens} decode tokens <= TRITON_ABSORB_MAX_TOKENS ({limit})"
        return Absorption.BMM, f"auto: {num_tokens} decode tokens > TRITON_ABSORB_MAX_TOKENS ({limit})"

    def _up_projection(self, splits: int, num_tokens: int) -> tuple[UpProjection, str]:
        """How the decode's up-projection runs, and why (see the class docstring)."""
        if self.up_projection != "auto":
            return UpProjection(self.up_projection), f"up_projection={self.up_projection!r}"
        if splits > 1:
            name, limit, what = "FUSED_SPLIT_MAX_TOKENS", self.FUSED_SPLIT_MAX_TOKENS, f"{splits} KV splits"
        else:
            name, limit, what = "FUSED_UP_MAX_TOKENS", self.FUSED_UP_MAX_TOKENS, "one KV split"
        if num_tokens <= limit:
            return UpProjection.FUSED, f"auto: {num_tokens} query tokens <= {name} ({limit}) with {what}"
        return UpProjection.BMM, f"auto: {num_tokens} query tokens > {name} ({limit}) with {what}"


class KeptLaunches(NamedTuple):
    """What a :class:`TritonMLAImpl` keeps per (plan, cache tensor, call size) slot: the cache tensor (held, so the
    ``id`` its slot names it by stays its own) and its launch state, the input layout ``check_inputs`` recorded when
    they were launched, and the launches prepared for 16-byte aligned call tensors (None: not prepared)."""

    kv_cache: torch.Tensor
    cache: MLACacheState
    input_layout: Optional[tuple]
    steps: Optional[tuple[PreparedStep, ...]]


class TritonMLAImpl(MLAImpl):
    """MLA with the split-KV decode kernels of :mod:`~attnbackends.mla.decode_launch`, running the builder's
    :class:`~attnbackends.mla.decode_plan.TritonMLADecodePlan`: per decode, the absorption (the planned Triton
    launch, which in a decode-only batch also writes the new tokens into the cache, or a matmul) into the planned
    query buffer, the planned decode launch (its TMA descriptors built once per cache), the up-projection straight
    into ``output``: the planned fused launch (split reduction + per-head matmul) or, where the builder planned
    none, the split reduction (inside the decode launch) and a batched matmul.

    Where every one of those is a Triton launch, the second forward of a plan over a cache prepares them
    (:meth:`~attnbackends.ops.launch.DescriptorLauncher.prepare`), and later forwards whose tensors have the same
    layout (shapes, strides, dtypes: the layout ``check_inputs`` recorded) and 16-byte aligned addresses launch
    them back to back with only the call's tensors' addresses passed
    (:func:`~attnbackends.ops.launch.launch_prepared_sequence`, one :class:`~attnbackends.mla.decode_plan.PreparedStep`
    per launch). They are kept per (plan, cache tensor, call size) (:class:`KeptLaunches`); a builder keeps the plan
    of a batch whose metadata tensors an engine reuses (its persistent input buffers), so steady-state decode steps
    take this path.
    """

    #: (plan, cache) pairs whose launches an impl keeps prepared (all dropped when full).
    KEPT_LAUNCHES = 64

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self._caches = CacheStates()  # this layer's per-cache launch state (TMA descriptors)
        fp8 = spec.kv_cache_torch_dtype in FP8_DTYPES
        self._qk_scale_log2 = self.scale * LOG2E * (self.k_scale if fp8 else 1.0)
        self._v_scale = self.k_scale if fp8 else 1.0
        self._nope = spec.qk_nope_head_dim
        self._w_uv_state: Optional[tuple] = None
        self._w_uk_state: Optional[tuple] = None
        # slot (the plan itself, id(cache tensor), call size) -> what was launched there: the plan compares by
        # identity and the cache tensor is held by the entry, so neither can stand for another object while kept
        self._kept_launches: dict[tuple[TritonMLADecodePlan, int, int], KeptLaunches] = {}

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        self._weights_launch_state()

    def _weights_launch_state(self) -> None:
        """The launch state of W_UV and W_UK_T (:func:`~attnbackends.mla.decode_launch.weight_launch_state`); the
        launches prepared with the previous weights are dropped."""
        self._w_uv_state = weight_launch_state(self.W_UV, "W_UV")
        self._w_uk_state = weight_launch_state(self.W_UK_T, "W_UK_T")
        self._kept_launches.clear()

    def _forward_decode(self, q, kv_cache, decode, output, new_tokens=None) -> None:
        # q [>= T, N, P + R] and output [>= T, N, V] as the caller passed them (new_tokens' kv_c and k_pe too): the
        # Triton launches read them through their strides (the first T rows); each view the matmuls need is one
        # as_strided over the planned sizes (it slices the first T rows and transposes in one torch op)
        plan: TritonMLADecodePlan = decode.plan
        if self._w_uv_state is None:  # the weights were set without process_weights_after_loading
            self._weights_launch_state()
        # the call's tensors by address: (q, output) or (q, kv_c, k_pe, output)
        if new_tokens is None:
            call = (q.data_ptr(), output.data_ptr())
            aligned = not (call[0] | call[1]) & 15
        else:
            call = (q.data_ptr(), new_tokens[0].data_ptr(), new_tokens[1].data_ptr(), output.data_ptr())
            aligned = not (call[0] | call[1] | call[2] | call[3]) & 15
        slot = (plan, id(kv_cache), len(call))
        kept = self._kept_launches.get(slot)
        # check_inputs records a new layout object whenever the call's tensors change shape, strides or dtype
        if (kept is not None and kept.steps is not None and kept.input_layout is self._input_layout and aligned
                and launch_prepared_sequence(kept.steps, call)):
            return
        cache = self._caches.get(kv_cache)
        steps = self._launch_decode(q, cache, plan, output, new_tokens, prepare=kept is not None and aligned)
        if kept is None or steps is not None:
            if len(self._kept_launches) >= self.KEPT_LAUNCHES:
                self._kept_launches.clear()
            self._kept_launches[slot] = KeptLaunches(kv_cache, cache, self._input_layout, steps)

    def _launch_decode(self, q, cache: MLACacheState, plan: TritonMLADecodePlan, output, new_tokens,
                       prepare: bool) -> Optional[tuple[PreparedStep, ...]]:
        """The decode's launches (see the class docstring); with ``prepare``, returns them prepared as
        :func:`~attnbackends.ops.launch.launch_prepared_sequence` takes them for the call (q, output) or
        (q, kv_c, k_pe, output), or None where one of them cannot be (a matmul, the interpreter)."""
        absorb, launch = plan.absorb_launch, plan.launch
        steps: Optional[list[PreparedStep]] = []
        if new_tokens is not None:  # the builder planned the write into the absorption's launch
            steps.append(PreparedStep(
                launch_mla_absorb_and_write(absorb, q, self.W_UK_T, self._w_uk_state, new_tokens[0], new_tokens[1],
                                            cache, self.k_scale, prepare),
                absorb.write_grid, 0, 3))
            q_pe, q_pe_key = plan.q_pe, plan.q_pe_key
        elif absorb is not None:
            steps.append(PreparedStep(launch_mla_absorb(absorb, q, self.W_UK_T, self._w_uk_state, prepare),
                                      absorb.grid, 0, 1))
            q_pe, q_pe_key = plan.q_pe, plan.q_pe_key
        else:
            qs_t, qs_n, qs_d = q.stride()
            q_at = q.storage_offset()
            # [N, T, P] @ [N, P, Lkv] -> the planned [N, T, Lkv] buffer
            torch.bmm(q.as_strided(plan.q_nope_view, (qs_n, qs_t, qs_d), q_at), self.W_UK_T, out=plan.ql)
            q_pe, q_pe_key = q.as_strided(plan.q_pe_view, (qs_t, qs_n, qs_d), q_at + self._nope * qs_d), None
            steps = None
        launch_mla_decode(launch, plan.ql_t, q_pe, cache, self._qk_scale_log2, self._v_scale, plan.ql_key, q_pe_key)
        if steps is not None:
            decode_launches = prepared_decode_launches(launch, cache)
            if decode_launches is None:
                steps = None
            else:
                steps += [PreparedStep(p, grid, 0, 0) for p, grid in decode_launches]
        if plan.up_projection is UpProjection.FUSED:
            up = launch_mla_up_projection(launch, self.W_UV, self._w_uv_state, output, prepare)
            if steps is not None:
                last = 2 if new_tokens is None else 4
                steps.append(PreparedStep(up, launch.up_grid, last - 1, last))
        else:
            # [N, T, Lkv] @ [N, Lkv, V] -> [N, T, V], written through output's [T, N, V] strides
            os_t, os_n, os_d = output.stride()
            torch.bmm(plan.latent, self.W_UV,
                      out=output.as_strided(plan.out_view, (os_n, os_t, os_d), output.storage_offset()))
            steps = None
        if not prepare or steps is None or any(step.prepared is None for step in steps):
            return None
        return tuple(steps)


class TritonMLABackend(_MLABackendBase):
    """Triton MLA decode (split-KV, the LSE merge fused with the up-projection) with the shared chunked-context
    prefill; CUDA or the interpreter."""

    name = "triton_mla"
    description = "Triton MLA decode kernel over the latent cache (split-KV), chunked-context prefill"
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"})
    needs_triton = True
    min_compute_capability = (8, 0)
    min_compute_capability_fp8_e4m3 = (8, 9)  # Triton converts e4m3 natively from sm_89 on

    #: How the decode's projections run (see :class:`TritonMLAMetadataBuilder`).
    PROJECTION_NOTE = (f"projections: up to {TritonMLAMetadataBuilder.TRITON_ABSORB_MAX_TOKENS} decode tokens "
                       "absorb their queries in one Triton launch (else torch.bmm), which in a decode-only batch "
                       "also writes the new tokens into the latent cache (no separate cache-write launch); the "
                       "up-projection is one Triton launch that merges the KV splits by their LSE and multiplies "
                       "each head's latent by W_UV "
                       f"(split decodes of at most {TritonMLAMetadataBuilder.FUSED_SPLIT_MAX_TOKENS} query token "
                       f"and unsplit ones of at most {TritonMLAMetadataBuilder.FUSED_UP_MAX_TOKENS}; else the split "
                       "reduction and torch.bmm)")

    @classmethod
    def kernel_notes(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        """The decode kernel (the Gluon Hopper kernel where it applies, else the Triton kernels) and the
        projections around it."""
        return [cls._decode_kernel_note(spec, device), cls.PROJECTION_NOTE]

    @classmethod
    def _decode_kernel_note(cls, spec: AttentionSpec, device: DeviceInfo) -> str:
        if not device.is_cuda:
            return "decode kernel: the portable Triton kernel (interpreted)"
        why = hopper_reason(spec.kv_lora_rank or 0, spec.qk_rope_head_dim or 0, spec.block_size,
                            spec.kv_cache_torch_dtype, device.compute_capability)
        if not why and not default_decode_config(spec.num_heads).use_hopper:
            why = f"{spec.num_heads} heads (< 64)"
        if not why:
            return ("decode kernel: the Gluon Hopper kernel (warp-specialised: one warpgroup for scores, softmax and "
                    "half of P.V, one for the other half, one warp loading pages by TMA), for one or several query "
                    "tokens per request, 16-bit or fp8 e4m3 pages; tree-verify decodes on the Triton TMA kernel")
        return f"decode kernel: the Triton kernel ({why} rules out the Gluon Hopper kernel)"

    @classmethod
    def get_builder_cls(cls) -> type[TritonMLAMetadataBuilder]:
        return TritonMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[TritonMLAImpl]:
        return TritonMLAImpl


# ------------------------------------------------------------------------------------------------ flashinfer_mla


class FlashInferMLAMetadataBuilder(MLAMetadataBuilder):
    """Plans FlashInfer's MLA wrapper for the decode requests (once per batch, on the host), carried as a
    :class:`~attnbackends.mla.decode_plan.FlashInferMLADecodePlan` (``metadata.decode.plan``).

    Page ids gathered from a device-only block table (no host copy: the page guard checks it on the device, after
    the fact) are contained to the cache's pages before ``plan()`` where the builder knows them (``num_blocks``, a
    base-class parameter); otherwise the plan marks them ``unchecked`` and ``forward`` contains them to its cache's
    size (once per plan and cache size) before ``run()``.

    Speculative decoding: decodes of several tokens are planned causal (``qo_indptr`` per request, FlashInfer aligns
    the queries with the last keys). Tree verification is not offered: the MLA wrapper's plan() takes no custom mask.
    """

    query_len_support = QueryLenSupport.VARLEN
    max_decode_query_len = 64
    supports_tree_mask = False
    #: Why ``supports_tree_mask`` is False (the registry's explanation of a ``speculative_tree`` spec says it).
    tree_mask_unsupported_reason = ("speculative_tree: FlashInfer's BatchMLAPagedAttentionWrapper.plan() takes no "
                                    "custom mask, so tree verification is not supported (chains are: "
                                    "num_speculative_tokens without speculative_tree)")

    @classmethod
    def speculative_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = super().speculative_reasons(spec)
        return [cls.tree_mask_unsupported_reason if r.startswith("speculative_tree") else r for r in reasons]

    def __init__(self, spec: AttentionSpec, device: "torch.device | str" = "cpu", *, backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(spec, device, **kwargs)
        self.flashinfer_backend = backend
        self._wrapper = None
        self._pin = self.device.type == "cuda"

    @property
    def wrapper(self):
        if self._wrapper is None:
            self._wrapper = mla_paged_wrapper(import_flashinfer(), self.device, self.flashinfer_backend)
        return self._wrapper

    def build_decode_plan(self, decode: MLADecodeMetadata, common) -> FlashInferMLADecodePlan:
        spec = self.spec
        # no host table given: the page ids are gathered on the table's device, where the wrapper reads them, and
        # contained there when the cache size is known (a host table is checked before any kernel runs)
        contain = not has_host_table(common)
        bound = self.num_blocks if contain else None
        inputs = paged_kv_plan_inputs(decode.query_start_loc_cpu, decode.seq_lens_cpu, decode.block_table,
                                      spec.block_size, pin_memory=self._pin, max_seq_len=decode.max_seq_len,
                                      num_blocks=bound)
        with planning(self.wrapper):
            self.wrapper.plan(
                inputs.qo_indptr,
                inputs.kv_indptr,
                inputs.kv_indices,
                decode.seq_lens_cpu.to(torch.int32),
                spec.num_heads,
                spec.kv_lora_rank,
                spec.qk_rope_head_dim,
                spec.block_size,
                decode.max_query_len > 1,
                spec.softmax_scale,
                spec.torch_dtype,
                spec.kv_cache_torch_dtype,
            )
        return FlashInferMLADecodePlan(wrapper=self.wrapper, page_ids=inputs.kv_indices, page_ids_bound=bound,
                                       unchecked=contain and bound is None)


#: The cache size each plan's unchecked page ids were last contained to (or checked against) by a forward: held
#: beside the plans, which forward never changes, and dropped with them.
_CONTAINED: "weakref.WeakKeyDictionary[FlashInferMLADecodePlan, int]" = weakref.WeakKeyDictionary()


def _contain_planned_page_ids(plan: FlashInferMLADecodePlan, num_blocks: int) -> None:
    """Make the planned wrapper read no page outside the cache's ``num_blocks``: contain ``plan.page_ids`` (the
    device kv_indices given to ``plan()``) in place where FlashInfer is known to read that very tensor; elsewhere
    check them on the host (one sync) and raise the page guard's error (its scan has recorded the bad entry) before
    ``run()``. Once per plan and cache size: ids within a cache's pages are within any larger cache's."""
    done = _CONTAINED.get(plan)
    if done is not None and done <= num_blocks:
        return
    page_ids = plan.page_ids
    reason = surface_unsupported_reason("flashinfer_mla_kv_indices")
    if reason is None:
        contain_page_ids(page_ids, num_blocks)
    else:
        fallback_reason("flashinfer_mla_kv_indices", reason)
        if bool(((page_ids < 0) | (page_ids >= num_blocks)).any()):
            raise_pending_faults(page_ids.device)
            raise PageTableError(f"a decode request's page id lies outside the KV cache's {num_blocks} pages")
    _CONTAINED[plan] = num_blocks


class FlashInferMLAImpl(MLAImpl):
    """MLA with FlashInfer's BatchMLAPagedAttentionWrapper for the decode requests, planned by the builder as a
    :class:`~attnbackends.mla.decode_plan.FlashInferMLADecodePlan`: ``forward`` contains the plan's unchecked page
    ids to its cache's size (see :class:`FlashInferMLAMetadataBuilder`), then runs the wrapper."""

    def _decode_latent(self, ql, q_pe, kv_cache, decode):
        plan: FlashInferMLADecodePlan = decode.plan
        num_blocks = kv_cache.shape[0]
        # a cache of another size than the builder's num_blocks is refused by check_inputs (the metadata's origin)
        if plan.unchecked:
            _contain_planned_page_ids(plan, num_blocks)
        lkv = self.spec.kv_lora_rank
        out = torch.empty_like(ql)
        plan.wrapper.run(ql, q_pe, kv_cache[..., :lkv], kv_cache[..., lkv:], out=out)
        return out


class FlashInferMLABackend(_MLABackendBase):
    """FlashInfer's MLA decode (sm_90+, kv_lora_rank 512 and rope 64) with the shared chunked-context prefill."""

    name = "flashinfer_mla"
    description = "FlashInfer BatchMLAPagedAttentionWrapper decode, chunked-context prefill"
    supported_dtypes = frozenset({"float16", "bfloat16"})
    supported_kv_cache_dtypes = frozenset({"auto", "float16", "bfloat16"})
    supported_head_sizes = frozenset({576})
    required_packages = ("flashinfer",)
    min_compute_capability = (9, 0)

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, device: DeviceInfo) -> list[str]:
        reasons = super().not_supported_reasons(spec, device)
        if spec.is_mla and (spec.kv_lora_rank, spec.qk_rope_head_dim) != (512, 64):
            reasons.append(
                f"kv_lora_rank/qk_rope_head_dim {spec.kv_lora_rank}/{spec.qk_rope_head_dim} not supported (supported: 512/64)"
            )
        return reasons

    @classmethod
    def get_builder_cls(cls) -> type[FlashInferMLAMetadataBuilder]:
        return FlashInferMLAMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[FlashInferMLAImpl]:
        return FlashInferMLAImpl
