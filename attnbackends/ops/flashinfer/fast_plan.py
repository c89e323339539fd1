"""Re-planning a FlashInfer decode wrapper for the next batch without its Python ``plan()``.

``BatchDecodeWithPagedKVCacheWrapper.plan()`` does two things each step: per-batch work (copy the page table to
the GPU, run the C++ scheduler on the host arrays) and set-up that is the same for every batch of a builder (resolve
dtypes, look the compiled module up, store scale / window / soft-cap). Its Python costs more host time than a decode
step at small batches, and at large ones its ``max()`` over a tensor walks the KV lengths one element at a time.

A :class:`DecodeReplanner` keeps the set-up of one public ``plan()`` call and redoes only the per-batch part:

- the page table is already on the GPU, in the builder's :class:`.plan_inputs.DevicePlanBuffer` (one asynchronous
  copy of a pinned host buffer, page ids gathered there for large batches): the wrapper is pointed at it, or, in
  CUDA-graph mode, it is copied into the wrapper's persistent buffers;
- the compiled module's own ``plan`` (the C++ scheduler) runs on the host arrays, as ``plan()`` would call it;
- the wrapper's per-batch fields are set as ``plan()`` sets them.

This reads FlashInfer's private wrapper fields, so it is used only with the FlashInfer versions it was checked
against on the GPU (:data:`TESTED_FLASHINFER_VERSIONS`: the plan info and the outputs equal those of ``plan()``,
bit for bit, see tests/flashinfer_backend/test_flashinfer_gpu.py) and for the wrapper kinds it knows (FlashAttention-2
and -3 tensor-core decode, the CUDA-core decode kernel; no JIT-customised modules). Anything else goes through
``plan()``: :func:`replan_unsupported_reason` says why. The same idea is behind vLLM's and SGLang's fast decode plans.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...compat import PRIVATE_SURFACES, surface_unsupported_reason
from .plan_guard import planning
from .plan_inputs import PagedKVPlanInputs

__all__ = ["TESTED_FLASHINFER_VERSIONS", "DecodeReplanner", "replan_unsupported_reason"]

#: FlashInfer versions whose decode wrapper internals DecodeReplanner was checked against (the compat table's).
TESTED_FLASHINFER_VERSIONS = PRIVATE_SURFACES["flashinfer_decode_replan"].tested_versions

_WRAPPER_FIELDS = (
    "_cached_module", "_plan_info", "_float_workspace_buffer", "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer", "_paged_kv_indptr_buf", "_paged_kv_indices_buf",
    "_paged_kv_last_page_len_buf", "_use_tensor_cores", "_use_cuda_graph", "_backend", "_jit_module",
)


def replan_unsupported_reason(flashinfer_version: str, wrapper: Any) -> Optional[str]:
    """Why :class:`DecodeReplanner` cannot re-plan ``wrapper`` (a planned decode wrapper), or None when it can."""
    version_reason = surface_unsupported_reason("flashinfer_decode_replan", flashinfer_version)
    if version_reason is not None:
        return version_reason
    missing = [name for name in _WRAPPER_FIELDS if not hasattr(wrapper, name)]
    if missing:
        return f"the wrapper lacks {', '.join(missing)} (not planned yet, or another wrapper class)"
    if wrapper._jit_module is not None:
        return "the wrapper runs a JIT-customised module"
    if wrapper._use_tensor_cores and wrapper._backend not in ("fa2", "fa3"):
        return f"tensor-core decode on the {wrapper._backend!r} backend"
    return None


class DecodeReplanner:
    """Re-plans one decode wrapper after a public ``plan()`` call set it up.

    Parameters
    ----------
    wrapper : a ``BatchDecodeWithPagedKVCacheWrapper`` (plain or CUDA-graph mode) already planned through ``plan()``
        with the same heads, head size, page size, dtypes, scale, window and soft-cap as every later batch;
        :func:`replan_unsupported_reason` must have returned None for it.
    num_qo_heads, num_kv_heads, head_dim, page_size : as given to that ``plan()``.
    window_left : FlashInfer's window (-1: none); logits_soft_cap : None or the cap.
    q_dtype, kv_dtype : the dtypes given to that ``plan()``.
    """

    def __init__(
        self, wrapper: Any, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
        window_left: int, logits_soft_cap: Optional[float], q_dtype: torch.dtype, kv_dtype: torch.dtype,
    ) -> None:
        self.wrapper = wrapper
        self.tensor_cores = bool(wrapper._use_tensor_cores)
        self.cuda_graph = bool(wrapper._use_cuda_graph)
        self.device = wrapper._float_workspace_buffer.device
        w = wrapper
        workspaces = (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
        if self.tensor_cores:
            # module.plan(workspaces, qo_indptr, kv_indptr, kv_lens, total_rows, batch, heads..., page_size,
            #             cuda_graph, head_dim_qk, head_dim_vo, causal, window_left[, split size, no split, ctas])
            self._fixed = (
                num_qo_heads, num_kv_heads, page_size, self.cuda_graph, head_dim, head_dim, False, window_left
            )
            self._tail = (-1, False, 0) if w._backend == "fa2" else ()
        else:
            # module.plan(workspaces, kv_indptr, batch, heads..., page_size, cuda_graph, window_left, soft_cap,
            #             head_dim_qk, head_dim_vo, empty q, empty kv)
            self._fixed = (num_qo_heads, num_kv_heads, page_size, self.cuda_graph, window_left,
                           0.0 if logits_soft_cap is None else float(logits_soft_cap), head_dim, head_dim,
                           torch.empty(0, dtype=q_dtype), torch.empty(0, dtype=kv_dtype))
            self._tail = ()
        self._workspaces = workspaces
        self._aranges: dict[int, torch.Tensor] = {}

    def _arange(self, b: int) -> torch.Tensor:
        """[b] int32 CPU 0, 1, ..., b - 1: the decodes' qo_indptr (one query token each), made once per size."""
        qo = self._aranges.get(b)
        if qo is None:
            qo = self._aranges[b] = torch.arange(b, dtype=torch.int32)
        return qo

    def replan(
        self, inputs: PagedKVPlanInputs, num_reqs: int, seq_lens_cpu: torch.Tensor, max_kv_len: Optional[int] = None
    ) -> None:
        """Plan requests ``0:num_reqs`` of ``inputs`` (the decodes, one query token each; ``inputs`` as
        :func:`paged_kv_plan_inputs` returned it for the whole batch, with its arrays on the device, ``on_device``, in
        plain mode) with KV lengths ``seq_lens_cpu[:num_reqs]`` (``max_kv_len``: their maximum, when the caller knows
        it). No host-device synchronisation.
        """
        w = self.wrapper
        b = num_reqs + 1
        whole = num_reqs == inputs.num_reqs  # a pure-decode batch: no views to make
        kv_indptr_host = inputs.host_kv_indptr(num_reqs)
        kv_lens_host = seq_lens_cpu if seq_lens_cpu.shape[0] == num_reqs else seq_lens_cpu[:num_reqs]
        on_device = inputs.on_device
        if self.cuda_graph:
            if num_reqs != w._fixed_batch_size:
                raise ValueError(
                    f"this CUDA-graph decode plan is for {w._fixed_batch_size} requests, the batch has {num_reqs}"
                )
            num_pages = int(kv_indptr_host[-1])
            if num_pages > w._paged_kv_indices_buf.shape[0]:
                raise ValueError(
                    f"the batch uses {num_pages} pages, the CUDA-graph page buffer holds "
                    f"{w._paged_kv_indices_buf.shape[0]} (raise max_model_len)"
                )
            src = on_device if on_device is not None else inputs  # device-to-device copies when staged there
            w._paged_kv_indptr_buf.copy_(src.kv_indptr[:b], non_blocking=True)
            w._paged_kv_last_page_len_buf.copy_(src.kv_last_page_len[:num_reqs], non_blocking=True)
            w._paged_kv_indices_buf[:num_pages].copy_(src.kv_indices[:num_pages], non_blocking=True)
        else:
            if on_device is None:
                raise ValueError("re-planning a decode wrapper needs the page table on the device: build it with "
                                 "paged_kv_plan_inputs(..., device_buffer=...)")
            if whole:
                w._qo_indptr_buf, w._paged_kv_indptr_buf, w._paged_kv_last_page_len_buf, w._paged_kv_indices_buf = (
                    on_device)
            else:
                w._paged_kv_indptr_buf = on_device.kv_indptr[:b]
                w._paged_kv_last_page_len_buf = on_device.kv_last_page_len[:num_reqs]
                w._qo_indptr_buf = on_device.qo_indptr[:b]
                w._paged_kv_indices_buf = on_device.kv_indices[: int(kv_indptr_host[-1])]
        w._batch_size = num_reqs
        w._block_tables = None
        with planning(w):
            if self.tensor_cores:
                w._max_kv_len = int(kv_lens_host.numpy().max()) if max_kv_len is None else max_kv_len
                w._plan_info = w._cached_module.plan(
                    *self._workspaces, self._arange(b), kv_indptr_host, kv_lens_host, num_reqs, num_reqs,
                    *self._fixed, *self._tail,
                )
            else:
                w._plan_info = w._cached_module.plan(*self._workspaces, kv_indptr_host, num_reqs, *self._fixed)
