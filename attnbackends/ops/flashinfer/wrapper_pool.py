"""Every FlashInfer wrapper one metadata builder plans, created on first use on the builder's float workspace, and
each decode wrapper's re-planner (:mod:`.fast_plan`).

Eager wrappers: one decode, two prefill (one for plain prefills and multi-token decodes, one for tree verify: a
wrapper built with ``backend="auto"`` fixes its kernel family at its first ``plan()``, and the family chosen without a
custom mask may not take one), one two-level cascade; one
decode wrapper per draft step (every step's plan must survive the later steps' planning). CUDA-graph wrappers: a
decode wrapper per captured batch size, all on one set of persistent page-table buffers (one batch runs at a time;
each sees its own prefix of them), and a prefill wrapper per captured verify shape (requests, tokens, tree), each
on its own buffers (a tree wrapper also owns a packed-mask buffer). :func:`standalone_decode_wrapper` makes the one
wrapper planned outside a builder (partial attention with its log-sum-exp, :mod:`.lse_forward`).

The MLA backends' wrappers are made here too, on the same shared workspace: :func:`mla_paged_wrapper` (the latent
decode of ``flashinfer_mla``) and :func:`ragged_prefill_wrapper` (the MLA prefill's new-token and context-chunk
attention), so that this module is where every FlashInfer wrapper the library uses is constructed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...compat import fallback_reason
from ...spec import AttentionSpec
from .fast_plan import DecodeReplanner, replan_unsupported_reason
from .plan_inputs import DevicePlanBuffer
from .workspace import shared_workspace

__all__ = ["KV_LAYOUT", "WrapperPool", "mla_paged_wrapper", "ragged_prefill_wrapper", "standalone_decode_wrapper"]

KV_LAYOUT = "NHD"  # kv_cache[:, 0] / [:, 1] are [num_blocks, block_size, num_kv_heads, head_size]


def standalone_decode_wrapper(flashinfer: Any, device: torch.device, use_tensor_cores: bool) -> Any:
    """A new eager decode wrapper on the device's shared workspace, for a call that plans and runs it at once
    (a new one per call: no later plan rewrites buffers a pending run still reads)."""
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(shared_workspace(device), KV_LAYOUT,
                                                         use_tensor_cores=use_tensor_cores)


def mla_paged_wrapper(flashinfer: Any, device: torch.device, backend: str) -> Any:
    """A latent-cache MLA decode wrapper (``flashinfer.mla.BatchMLAPagedAttentionWrapper``) on the device's shared
    workspace; ``backend``: FlashInfer's kernel family ("auto", "fa2", "fa3")."""
    return flashinfer.mla.BatchMLAPagedAttentionWrapper(shared_workspace(device), backend=backend)


def ragged_prefill_wrapper(flashinfer: Any, device: torch.device) -> Any:
    """A ragged (non-paged) prefill wrapper on the device's shared workspace: queries and keys as [tokens, heads,
    head_size] tensors with cumulative-length offsets."""
    return flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(shared_workspace(device), KV_LAYOUT)


class WrapperPool:
    """The wrappers of one builder (see the module docstring).

    Parameters
    ----------
    spec : the builder's spec (heads, head size, page size, dtypes, scale, window, soft-cap of every plan).
    device : where the workspace and the persistent buffers live.
    import_flashinfer : returns the flashinfer module (called on first use: the builder itself imports lazily).
    workspace_bytes : None: the device's shared float workspace; a size: a workspace of the pool's own (the wrappers
        share it: they run one after another on a stream).
    use_tensor_cores : decode on tensor cores.
    max_num_reqs, max_model_len : size the CUDA-graph buffers.
    window_left : FlashInfer's window (-1: none), for the re-planners.
    fast_plan : re-plan decode wrappers without ``plan()`` where the installed version allows.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device, import_flashinfer, *, workspace_bytes: Optional[int],
                 use_tensor_cores: bool, max_num_reqs: int, max_model_len: int, window_left: int,
                 fast_plan: bool) -> None:
        self.spec = spec
        self.device = device
        self._import = import_flashinfer
        self.workspace_bytes = workspace_bytes
        self.use_tensor_cores = use_tensor_cores
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.window_left = window_left
        self.fast_plan = fast_plan
        self._flashinfer: Any = None
        self._workspace: Optional[torch.Tensor] = None
        self.eager_decode: Any = None
        self._prefill: dict[bool, Any] = {}
        self._cascade: Any = None
        self._draft_decode: list[tuple[Any, DevicePlanBuffer]] = []
        self._graph_decode: dict[int, Any] = {}
        self._graph_verify: dict[tuple[int, int, bool], Any] = {}
        self._graph_buffers: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        # Per decode wrapper (by id; the pool keeps its wrappers alive): its replanner, or why it has none.
        self._replanners: dict[int, "DecodeReplanner | str"] = {}

    def fi(self) -> Any:
        """The flashinfer module."""
        if self._flashinfer is None:
            self._flashinfer = self._import()
        return self._flashinfer

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = (shared_workspace(self.device) if self.workspace_bytes is None else
                               torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device))
        return self._workspace

    # -- eager wrappers -----------------------------------------------------------------------------------------
    def decode(self) -> Any:
        if self.eager_decode is None:
            self.eager_decode = self.fi().BatchDecodeWithPagedKVCacheWrapper(
                self.workspace(), KV_LAYOUT, use_tensor_cores=self.use_tensor_cores)
        return self.eager_decode

    def prefill(self, custom_mask: bool = False) -> Any:
        """The eager prefill wrapper for plans with (tree verify) or without a custom mask."""
        if custom_mask not in self._prefill:
            self._prefill[custom_mask] = self.fi().BatchPrefillWithPagedKVCacheWrapper(self.workspace(), KV_LAYOUT)
        return self._prefill[custom_mask]

    def cascade(self) -> Any:
        if self._cascade is None:
            self._cascade = self.fi().MultiLevelCascadeAttentionWrapper(2, self.workspace(), KV_LAYOUT)
        return self._cascade

    def draft_step(self, step: int) -> tuple[Any, DevicePlanBuffer]:
        """Draft step ``step``'s own decode wrapper and page-table buffer."""
        while len(self._draft_decode) <= step:
            wrapper = self.fi().BatchDecodeWithPagedKVCacheWrapper(
                self.workspace(), KV_LAYOUT, use_tensor_cores=self.use_tensor_cores)
            self._draft_decode.append((wrapper, DevicePlanBuffer(self.device)))
        return self._draft_decode[step]

    # -- CUDA-graph wrappers ------------------------------------------------------------------------------------
    def captured_decode(self, batch_size: int) -> Optional[Any]:
        """The CUDA-graph decode wrapper of ``batch_size`` requests, if one was made for capture."""
        return self._graph_decode.get(batch_size)

    def captured_verify(self, num_reqs: int, num_tokens: int, tree: bool) -> Optional[Any]:
        """The CUDA-graph prefill wrapper of verify batches of this shape, if one was made for capture."""
        return self._graph_verify.get((num_reqs, num_tokens, tree))

    def graph_page_ids(self, num_pages: int) -> torch.Tensor:
        """[num_pages] int32: the page ids in the persistent buffer the captured decode wrappers read."""
        return self._graph_buffers[1][:num_pages]

    def graph_decode(self, batch_size: int) -> Any:
        """The CUDA-graph decode wrapper for ``batch_size`` requests, made on first call."""
        wrapper = self._graph_decode.get(batch_size)
        if wrapper is not None:
            return wrapper
        if batch_size > self.max_num_reqs:
            raise ValueError(f"a CUDA-graph batch of {batch_size} requests exceeds max_num_reqs={self.max_num_reqs}")
        if self._graph_buffers is None:
            pages_per_req = -(-self.max_model_len // self.spec.block_size)
            self._graph_buffers = (
                torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=self.device),
                torch.zeros(self.max_num_reqs * pages_per_req, dtype=torch.int32, device=self.device),
                torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device),
            )
        indptr, indices, last_page_len = self._graph_buffers
        wrapper = self.fi().BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(),
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr[: batch_size + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:batch_size],
        )
        self._graph_decode[batch_size] = wrapper
        return wrapper

    def graph_verify(self, num_reqs: int, num_tokens: int, tree: bool) -> Any:
        """The CUDA-graph prefill wrapper of verify batches of this shape, made on first call."""
        key = (num_reqs, num_tokens, tree)
        wrapper = self._graph_verify.get(key)
        if wrapper is not None:
            return wrapper
        if num_reqs > self.max_num_reqs:
            raise ValueError(f"a CUDA-graph batch of {num_reqs} requests exceeds max_num_reqs={self.max_num_reqs}")
        dev = self.device
        pages_per_req = -(-self.max_model_len // self.spec.block_size)
        buffers = dict(
            qo_indptr_buf=torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=torch.zeros(num_reqs * pages_per_req, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buf=torch.zeros(num_reqs, dtype=torch.int32, device=dev),
        )
        if tree:  # bits of every request's [query, key] mask, each request padded to whole bytes
            mask_bytes = -(-num_tokens * self.max_model_len // 8) + num_reqs
            buffers.update(custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8, device=dev),
                           mask_indptr_buf=torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev))
        wrapper = self.fi().BatchPrefillWithPagedKVCacheWrapper(
            self.workspace(), KV_LAYOUT, use_cuda_graph=True, **buffers)
        self._graph_verify[key] = wrapper
        return wrapper

    @property
    def cudagraph_batch_sizes(self) -> list[int]:
        """The pure-decode batch sizes that have persistent CUDA-graph plans."""
        return sorted(self._graph_decode)

    # -- re-planning --------------------------------------------------------------------------------------------
    def replanner_for(self, wrapper: Any) -> Optional[DecodeReplanner]:
        """The wrapper's replanner, set up after its first ``plan()``; None before that or where it cannot work."""
        entry = self._replanners.get(id(wrapper))
        return entry if isinstance(entry, DecodeReplanner) else None

    def after_public_plan(self, wrapper: Any) -> None:
        """Set up re-planning for a decode wrapper that ``plan()`` has just planned (once per wrapper)."""
        if id(wrapper) in self._replanners:
            return
        reason = "disabled (fast_plan=False)" if not self.fast_plan else replan_unsupported_reason(
            getattr(self.fi(), "__version__", "unknown"), wrapper)
        if reason is not None:
            self._replanners[id(wrapper)] = fallback_reason("flashinfer_decode_replan", reason)
            return
        spec = self.spec
        self._replanners[id(wrapper)] = DecodeReplanner(
            wrapper, num_qo_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            page_size=spec.block_size, window_left=self.window_left, logits_soft_cap=spec.logits_soft_cap,
            q_dtype=spec.torch_dtype, kv_dtype=spec.kv_cache_torch_dtype,
        )

    @property
    def decode_replan_status(self) -> dict[str, str]:
        """For each decode wrapper planned so far ("eager", or "graph B" for a CUDA-graph size): "replanned" when
        later batches skip ``plan()``, else why they go through it."""
        names = {id(self.eager_decode): "eager"} if self.eager_decode is not None else {}
        names.update({id(w): f"graph {size}" for size, w in self._graph_decode.items()})
        return {
            names[key]: "replanned" if isinstance(entry, DecodeReplanner) else entry
            for key, entry in self._replanners.items() if key in names
        }
