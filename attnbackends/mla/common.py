"""What every MLA backend shares: batch metadata with the decode/prefill split and the context-chunk plan, and the
impl base class (weight absorption, absorbed decode, chunked-context prefill).

Notation (DeepSeek-V3): N query heads, latent Lkv = kv_lora_rank (512), rope R = qk_rope_head_dim (64),
nope P = qk_nope_head_dim (128), V = v_head_dim (128). ``kv_b_proj`` is the [N * (P + V), Lkv] weight of the
up-projection (nn.Linear layout: [k_nope ; v] of head n = rows n*(P+V) ... of ``kv_c @ kv_b_proj.T``).

Decode (query_len <= reorder_batch_threshold, first in the batch): ql = q_nope @ W_UK_T per head ([P] -> [Lkv]);
MQA of [ql ; q_pe] over the latent cache (one KV head of Lkv + R, value = its first Lkv); o = o_latent @ W_UV
per head ([Lkv] -> [V]). With speculative decoding a decode has 1 + k query tokens (the builder declares how many,
:attr:`~attnbackends.interface.AttentionMetadataBuilder.query_len_support`), causal among themselves, and a tree
mask (:attr:`CommonAttentionMetadata.spec_tree_mask`) applies to decodes only: the prefill path is causal. Prefill: [k_nope ; v] = kv_c @ kv_b_proj.T per head, k = [k_nope ; k_pe]; causal MHA over
the new tokens, plus the cached context processed in chunks through a bounded workspace (each chunk non-causal
with its lse) merged with :func:`~attnbackends.ops.merge_attn_states.merge_attn_states`.

The impl contract, :class:`~attnbackends.interface.MLAAttentionImpl`, lives beside ``AttentionImpl`` in
:mod:`attnbackends.interface` (imported here too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..interface import AttentionMetadataBuilder, MLAAttentionImpl
from ..metadata import CommonAttentionMetadata, split_decodes_and_prefills, validate_common_metadata
from ..ops.merge_attn_states import merge_attn_states
from ..ops.quant import FP8_DTYPES, dequantize_from_cache, quantize_for_cache
from ..platform import DeviceInfo
from ..spec import AttentionSpec
from ..ops.mla_cache import concat_and_cache_mla, context_slots, gather_mla_cache
from .decode_plan import MLADecodeStepPlan
from .prefill import PrefillKernel, RaggedPlan, get_prefill_kernel, select_prefill_kernel

__all__ = [
    "DEFAULT_WORKSPACE_TOKENS",
    "MLAContextChunk",
    "MLADecodeMetadata",
    "MLAPrefillMetadata",
    "MLAMetadata",
    "MLAMetadataBuilder",
    "MLAImpl",
    "split_kv_b_proj",
]

#: Default context workspace, in tokens (64k tokens x 576 x 2 bytes = 72 MiB in bf16).
DEFAULT_WORKSPACE_TOKENS = 64 * 1024


@dataclass
class MLAContextChunk:
    """One slice of every prefill request's cached context, small enough for the workspace.

    slots : [total] int64 cache slots to gather (device); plan : the non-causal ragged problem (queries = the
    prefill requests' new tokens, keys = this chunk).
    """

    total: int
    slots: torch.Tensor
    plan: RaggedPlan


@dataclass
class MLADecodeMetadata:
    """The leading decode requests. block_table : [B, W] int32; seq_lens : [B] int32 (device and host copies).

    Speculative decoding: query_start_loc [B + 1] int32 (device and host copies) places each request's query tokens
    (``max_query_len`` the longest, 1 without speculation); tree_mask [sum n_i^2] bool and tree_indptr [B + 1] int32
    are the batch's packed tree mask (:attr:`CommonAttentionMetadata.spec_tree_mask`) when it has one.

    plan : what the builder planned for these requests (:meth:`MLAMetadataBuilder.build_decode_plan`), a subclass
    of :class:`~attnbackends.mla.decode_plan.MLADecodeStepPlan` per backend (its ``writes_cache`` says whether the
    decode's first launch writes the new tokens into the cache); None: nothing planned.
    """

    num_decodes: int
    num_decode_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_seq_len: int
    query_start_loc: Optional[torch.Tensor] = None
    query_start_loc_cpu: Optional[torch.Tensor] = None
    max_query_len: int = 1
    tree_mask: Optional[torch.Tensor] = None
    tree_indptr: Optional[torch.Tensor] = None
    plan: Optional[MLADecodeStepPlan] = None


@dataclass
class MLAPrefillMetadata:
    """The trailing prefill requests (token indices relative to the first prefill token)."""

    num_prefills: int
    num_prefill_tokens: int
    new_tokens: RaggedPlan  # causal attention of the new tokens among themselves
    chunks: list[MLAContextChunk]
    kernel: PrefillKernel
    workspace: Optional[torch.Tensor]  # [workspace_tokens, Lkv + R] in the model dtype


@dataclass
class MLAMetadata:
    common: CommonAttentionMetadata
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    decode: Optional[MLADecodeMetadata]
    prefill: Optional[MLAPrefillMetadata]
    debug: bool = False  # the builder's debug flag: impls validate inputs and the block table on every call

    @property
    def num_decode_tokens(self) -> int:
        return self.decode.num_decode_tokens if self.decode is not None else 0


class MLAMetadataBuilder(AttentionMetadataBuilder[MLAMetadata]):
    """Builds :class:`MLAMetadata`: splits the batch (decodes first), plans the context chunks and the prefill kernel,
    and carries the subclass's plan for the decode requests (:meth:`build_decode_plan`) as ``decode.plan``.

    Parameters (beyond the base class)
    ----------
    workspace_tokens : tokens of cached context gathered per chunk (all prefill requests together); the context is
        processed in ceil(max_context / (workspace_tokens // num_prefills)) chunks.
    prefill_backend : "auto" or one of flash_attn, flashinfer, triton, sdpa (see :mod:`attnbackends.mla.prefill`).
    """

    reorder_batch_threshold = 1

    def __init__(
        self,
        spec: AttentionSpec,
        device: "torch.device | str" = "cpu",
        *,
        workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
        prefill_backend: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, device, **kwargs)
        if not spec.is_mla:
            raise ValueError("MLA metadata builders need an MLA spec (AttentionSpec.mla(...))")
        if workspace_tokens < 1:
            raise ValueError(f"workspace_tokens must be >= 1, got {workspace_tokens}")
        self.workspace_tokens = int(workspace_tokens)
        self.decode_threshold = self.reorder_batch_threshold
        self.device_info = DeviceInfo.current(self.device)
        self.prefill_backend = select_prefill_kernel(
            self.device_info, spec.torch_dtype, prefill_backend,
            head_dims=(spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim),
        )
        self.prefill_kernel = get_prefill_kernel(self.prefill_backend, self.device)
        self._workspace: Optional[torch.Tensor] = None

    @property
    def workspace(self) -> torch.Tensor:
        """[workspace_tokens, Lkv + R] in the model dtype, allocated on first use and shared by every layer."""
        if self._workspace is None:
            self._workspace = torch.empty(
                self.workspace_tokens, self.spec.head_size, dtype=self.spec.torch_dtype, device=self.device
            )
        return self._workspace

    def _plan(self, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> RaggedPlan:
        spec = self.spec
        return self.prefill_kernel.plan(
            cu_q, cu_k, causal=causal, scale=spec.softmax_scale, num_heads=spec.num_heads,
            head_dim_qk=spec.qk_nope_head_dim + spec.qk_rope_head_dim, head_dim_v=spec.v_head_dim,
            dtype=spec.torch_dtype,
        )

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        if self.debug:
            validate_common_metadata(common, block_size=self.spec.block_size)
        split = split_decodes_and_prefills(common, self.decode_threshold)
        nd, np_ = split.num_decodes, split.num_prefills
        tree = common.spec_tree_mask is not None
        if tree:
            self._check_tree(common, nd)
        decode = prefill = None
        if nd:
            seq_lens_cpu = common.seq_lens_cpu[:nd]
            multi = split.num_decode_tokens > nd
            decode = MLADecodeMetadata(
                num_decodes=nd,
                num_decode_tokens=split.num_decode_tokens,
                block_table=common.block_table[:nd],
                seq_lens=common.seq_lens[:nd],
                seq_lens_cpu=seq_lens_cpu,
                max_seq_len=int(seq_lens_cpu.max()),
                query_start_loc=common.query_start_loc[: nd + 1] if multi or tree else None,
                query_start_loc_cpu=common.query_start_loc_cpu[: nd + 1],
                max_query_len=int(common.query_lens_cpu[:nd].max()) if multi else 1,
                tree_mask=common.spec_tree_mask if tree else None,
                tree_indptr=common.spec_tree_mask_indptr[: nd + 1] if tree else None,
            )
            decode.plan = self.build_decode_plan(decode, common)
        if np_:
            prefill = self._build_prefill(common, nd, split.num_prefill_tokens)
        return MLAMetadata(
            common=common,
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            decode=decode,
            prefill=prefill,
            debug=self.debug,
        )

    def build_decode_plan(self, decode: MLADecodeMetadata,
                          common: CommonAttentionMetadata) -> Optional[MLADecodeStepPlan]:
        """The backend's plan for the batch's decode requests (``decode``, its ``plan`` not yet set), carried as
        ``decode.plan``; None: nothing to plan."""
        return None

    def _check_tree(self, common: CommonAttentionMetadata, num_decodes: int) -> None:
        """A tree mask is honoured on the decode path of builders that declare ``supports_tree_mask``: anything else
        would silently attend causally. Host reads only."""
        sizes = common.spec_tree_mask_indptr_cpu[1:] - common.spec_tree_mask_indptr_cpu[:-1]
        if not self.supports_tree_mask and bool((sizes > 0).any()):
            raise ValueError(f"{type(self).__name__} does not honour spec_tree_mask (supports_tree_mask is False); "
                             "build verify batches without a tree mask (chains) or pick a backend that declares it")
        late = torch.nonzero(sizes[num_decodes:] > 0)
        if late.numel():
            i = num_decodes + int(late[0])
            raise ValueError(
                f"request {i} has a tree mask but query_len {int(common.query_lens_cpu[i])} > the builder's "
                f"reorder_batch_threshold {self.decode_threshold}: MLA verifies trees on the decode path only "
                "(give the spec num_speculative_tokens >= the draft tokens per request)")

    def _build_prefill(self, common: CommonAttentionMetadata, nd: int, num_tokens: int) -> MLAPrefillMetadata:
        self.prefill_kernel.begin_batch()
        qsl_cpu = common.query_start_loc_cpu[nd:]
        cu_q = (qsl_cpu - qsl_cpu[0]).to(torch.int32)
        new_tokens = self._plan(cu_q, cu_q, causal=True)
        context_cpu = common.context_lens_cpu[nd:].to(torch.int64)
        num_prefills = context_cpu.shape[0]
        chunks: list[MLAContextChunk] = []
        max_context = int(context_cpu.max())
        if max_context > 0:
            per_req = max(1, self.workspace_tokens // num_prefills)
            block_table = common.block_table[nd:]
            for start in range(0, max_context, per_req):
                starts = context_cpu.clamp(max=start)
                ends = context_cpu.clamp(max=start + per_req)
                lens = ends - starts
                cu_k = torch.zeros(num_prefills + 1, dtype=torch.int32)
                cu_k[1:] = torch.cumsum(lens, 0)
                total = int(cu_k[-1])
                cu_k_dev = cu_k.to(self.device, non_blocking=True)
                slots = context_slots(
                    block_table, cu_k_dev, starts.to(torch.int32).to(self.device, non_blocking=True),
                    total, self.spec.block_size,
                )
                chunks.append(MLAContextChunk(total=total, slots=slots, plan=self._plan(cu_q, cu_k, causal=False)))
        return MLAPrefillMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=num_tokens,
            new_tokens=new_tokens,
            chunks=chunks,
            kernel=self.prefill_kernel,
            workspace=self.workspace if chunks else None,
        )


def split_kv_b_proj(kv_b_proj: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK_T [N, P, Lkv] and W_UV [N, Lkv, V] from kv_b_proj [N * (P + V), Lkv] (contiguous copies)."""
    n, p, v, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    if kv_b_proj.shape != (n * (p + v), lkv):
        raise ValueError(f"kv_b_proj must have shape ({n * (p + v)}, {lkv}) = (N * (P + V), Lkv), got {tuple(kv_b_proj.shape)}")
    w = kv_b_proj.view(n, p + v, lkv)
    return w[:, :p, :].contiguous(), w[:, p:, :].transpose(1, 2).contiguous()


class MLAImpl(MLAAttentionImpl[MLAMetadata]):
    """The absorbed MLA impl the fast backends share: weight absorption, the decode requests through a subclass's
    kernel (:meth:`_decode_latent`), chunked-context prefill. Constructor as :class:`MLAAttentionImpl`."""

    def __init__(self, spec: AttentionSpec, **kwargs: Any) -> None:
        super().__init__(spec, **kwargs)
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None

    def process_weights_after_loading(self) -> None:
        """Build W_UK_T [N, P, Lkv] and W_UV [N, Lkv, V] (once, after the weights are final)."""
        self.W_UK_T, self.W_UV = split_kv_b_proj(self.kv_b_proj, self.spec)

    def update_kv_cache(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
        """See :meth:`MLAAttentionImpl.update_kv_cache` (:func:`~attnbackends.ops.mla_cache.concat_and_cache_mla`)."""
        concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping, self.k_scale)

    def forward(self, q: torch.Tensor, kv_c_normed: Optional[torch.Tensor], k_pe: Optional[torch.Tensor],
                kv_cache: torch.Tensor, metadata: MLAMetadata, output: torch.Tensor) -> torch.Tensor:
        """See :meth:`MLAAttentionImpl.forward`."""
        self.check_inputs(q, kv_c_normed, k_pe, kv_cache, metadata, output)
        if self.W_UK_T is None:
            self.process_weights_after_loading()
        n_tokens = metadata.num_actual_tokens
        decode = metadata.decode
        plan = decode.plan if decode is not None else None
        new_tokens = None
        if kv_c_normed is not None:
            if plan is not None and plan.writes_cache:
                # the decode's first launch writes them, reading their first T rows through their strides
                new_tokens = (kv_c_normed, k_pe)
            else:
                # a slice is a torch op even when it keeps every row: compare lengths first
                if kv_c_normed.shape[0] != n_tokens:
                    kv_c_normed = kv_c_normed[:n_tokens]
                if k_pe.shape[0] != n_tokens:
                    k_pe = k_pe[:n_tokens]
                self.update_kv_cache(kv_c_normed, k_pe, kv_cache, metadata.slot_mapping)
        if decode is not None:
            self._forward_decode(q, kv_cache, decode, output, new_tokens)
        if metadata.prefill is not None:
            if kv_c_normed is None:
                raise ValueError("prefill tokens need kv_c_normed and k_pe")
            nd = metadata.num_decode_tokens
            pre = metadata.prefill
            end = nd + pre.num_prefill_tokens
            self._forward_prefill(q[nd:end], kv_c_normed[nd:end], k_pe[nd:end], kv_cache, pre, output[nd:end])
        return output

    def _forward_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, decode: MLADecodeMetadata,
                        output: torch.Tensor,
                        new_tokens: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """The decode requests: q [>= T, N, P + R] -> output [>= T, N, V], T = ``decode.num_decode_tokens``, the
        decodes being the first T rows of both (absorbed queries, :meth:`_decode_latent`, the up-projection of the
        latent output). Rows past T are neither read nor written. new_tokens: the batch's new tokens (kv_c
        [>= T, Lkv] and k_pe [>= T, R], their first T rows), given only where ``decode.plan.writes_cache`` (the
        decode's first launch writes them into the cache at the batch's slots); impls whose builders never fold the
        write take none."""
        if new_tokens is not None:
            raise NotImplementedError(f"{type(self).__name__} does not write the cache in its decode launches; its "
                                      "builder must not plan writes_cache")
        nd = decode.num_decode_tokens
        if q.shape[0] != nd:
            q = q[:nd]
        if output.shape[0] != nd:
            output = output[:nd]
        q_nope, q_pe = q.split([self.spec.qk_nope_head_dim, self.spec.qk_rope_head_dim], dim=-1)
        ql = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)  # [T, N, Lkv]
        o_latent = self._decode_latent(ql.contiguous(), q_pe.contiguous(), kv_cache, decode)
        # [N, T, Lkv] @ [N, Lkv, V] -> [N, T, V]
        o = torch.bmm(o_latent.transpose(0, 1).to(self.W_UV.dtype), self.W_UV)
        output.copy_(o.transpose(0, 1))

    def _decode_latent(
        self, ql: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, decode: MLADecodeMetadata
    ) -> torch.Tensor:
        """Latent MQA for the decode requests: ql [B, N, Lkv], q_pe [B, N, R] -> o_latent [B, N, Lkv]."""
        raise NotImplementedError

    def _up_project(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [T, Lkv + R] (model dtype) -> k [T, N, P + R], v [T, N, V]."""
        spec = self.spec
        n, p, lkv = spec.num_heads, spec.qk_nope_head_dim, spec.kv_lora_rank
        kv_c, k_pe = latent[:, :lkv], latent[:, lkv:]
        kv = (kv_c @ self.kv_b_proj.T).view(-1, n, p + spec.v_head_dim)  # [T, N, P + V]
        k_nope, v = kv.split([p, spec.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, n, -1)], dim=-1)
        return k, v.contiguous()

    def _forward_prefill(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        pre: MLAPrefillMetadata,
        output: torch.Tensor,
    ) -> None:
        latent = torch.cat([kv_c, k_pe], dim=-1)
        if kv_cache.dtype in FP8_DTYPES:
            # Keys are what the cache holds: the new tokens take the same fp8 round trip as the context.
            latent = dequantize_from_cache(quantize_for_cache(latent, kv_cache.dtype, self.k_scale), q.dtype, self.k_scale)
        k, v = self._up_project(latent.to(q.dtype))
        out, lse = pre.kernel.run(pre.new_tokens, q, k, v)
        for chunk in pre.chunks:
            ctx = gather_mla_cache(kv_cache, chunk.slots, pre.workspace, self.k_scale)
            k_c, v_c = self._up_project(ctx)
            out_c, lse_c = pre.kernel.run(chunk.plan, q, k_c, v_c)
            merge_attn_states(out, out_c, lse_c, out, lse, output_lse=lse)
        output.copy_(out)
