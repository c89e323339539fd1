"""Input validation at the edges of an impl's ``forward``, kept off the hot path.

Every standard impl checks its tensors (shapes, dtypes, devices, strides of query / key / value / output / kv_cache
against the spec and the backend's KV-cache layout) on its FIRST ``forward`` call, and again on every call in debug
mode. Debug mode also checks the batch's metadata against the cache: block-table entries inside
``[0, kv_cache.shape[0])``, ``seq_len >= query_len``, a monotonic ``query_start_loc`` and slots inside the cache; these
read the block table and the slot mapping on the host (a device sync), which is why they are off by default.

How an engine turns debug mode on: set ``AttentionConfig(debug=True)`` (or ``debug: true`` in its YAML/JSON file)
and pass ``debug=config.debug`` to the metadata builder, as :class:`attnbackends.engine.Engine` does::

    builder = backend.get_builder_cls()(spec, device, debug=config.debug)

The builder validates each batch's metadata in ``build`` and marks the metadata it returns with ``debug=True``, so
every impl running that metadata checks its inputs and the block table on every call. An impl can also be put in
debug mode on its own: ``backend.get_impl_cls()(spec, debug=True)``.

Every error is a ValueError naming the tensor, what it got (shape, dtype, device or the bad index) and what was
expected.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from .metadata import CommonAttentionMetadata, validate_common_metadata
from .ops.page_guard import guard_block_table
from .spec import AttentionSpec

__all__ = [
    "check_forward_inputs",
    "check_tensor",
    "debug_enabled",
    "validate_forward_inputs",
    "validate_mla_forward_inputs",
    "validate_metadata_against_cache",
]

DimSpec = Optional[int]  # None: any size


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _fmt_shape(shape: Sequence[DimSpec], names: Optional[Sequence[str]] = None) -> str:
    parts = []
    for i, d in enumerate(shape):
        label = names[i] if names is not None else None
        if d is None:
            parts.append(label or "*")
        else:
            parts.append(f"{label}={d}" if label else str(d))
    return "[" + ", ".join(parts) + "]"


def check_tensor(
    name: str,
    t: Any,
    *,
    shape: Sequence[DimSpec],
    dtype: Union[torch.dtype, Sequence[torch.dtype], None] = None,
    device: Optional[torch.device] = None,
    names: Optional[Sequence[str]] = None,
    last_dim_contiguous: bool = True,
    min_rows: Optional[int] = None,
) -> None:
    """Check one tensor; raises ValueError naming ``name``, what it is and what was expected.

    Parameters
    ----------
    shape : the expected shape, ``None`` for a dimension of any size.
    dtype : the allowed dtype (or dtypes).
    device : the device it must be on.
    names : the dimensions' names, for the message.
    last_dim_contiguous : require ``stride(-1) == 1`` (kernels load rows as contiguous vectors).
    min_rows : require ``shape[0] >= min_rows`` (e.g. the batch's num_actual_tokens).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {_fmt_shape(shape, names)}, got {type(t).__name__}")
    if t.dim() != len(shape) or any(d is not None and d != s for d, s in zip(shape, t.shape)):
        raise ValueError(f"{name} must be {_fmt_shape(shape, names)}; got {_describe(t)}")
    if min_rows is not None and t.shape[0] < min_rows:
        raise ValueError(f"{name} must have at least {min_rows} rows (num_actual_tokens); got {_describe(t)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else "one of " + ", ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must be {want}; got {_describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}; got {_describe(t)}")
    if last_dim_contiguous and t.numel() and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1); got {_describe(t)}, "
                         f"strides {tuple(t.stride())}")


def debug_enabled(impl: Any, metadata: Any) -> bool:
    """Debug mode for one call: the impl was built with ``debug=True`` or the metadata's builder was."""
    return bool(getattr(impl, "debug", False)) or bool(getattr(metadata, "debug", False))


def validate_forward_inputs(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    value: Optional[torch.Tensor],
    kv_cache: Optional[torch.Tensor],
    output: torch.Tensor,
    num_actual_tokens: int,
    *,
    kv_cache_shape: Optional[Sequence[int]] = None,
) -> None:
    """Check a standard (non-MLA) forward's tensors against ``spec``.

    query : [T, num_heads, head_size] spec.dtype; key, value : [>= num_actual_tokens, num_kv_heads, head_size /
    value_head_size] spec.dtype (or None when the cache already holds them); output : [T, num_heads,
    value_head_size] spec.dtype; kv_cache : ``kv_cache_shape`` (the backend's layout for ``kv_cache.shape[0]``
    blocks; default: the standard ``[num_blocks, 2, block_size, num_kv_heads, head_size]``) in the spec's cache dtype.
    Everything on query's device, last dimension contiguous.
    """
    dtype = spec.torch_dtype
    hq, hkv, d, dv = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.value_head_size
    check_tensor("query", query, shape=(None, hq, d), dtype=dtype, names=("num_tokens", "num_heads", "head_size"),
                 min_rows=num_actual_tokens)
    device = query.device
    tokens = query.shape[0]
    check_tensor("output", output, shape=(tokens, hq, dv), dtype=dtype, device=device,
                 names=("num_tokens", "num_heads", "value_head_size"))
    if (key is None) != (value is None):
        raise ValueError("key and value must be given together (or both None when the cache already holds them)")
    if key is not None:
        check_tensor("key", key, shape=(None, hkv, d), dtype=dtype, device=device,
                     names=("num_tokens", "num_kv_heads", "head_size"), min_rows=num_actual_tokens)
        check_tensor("value", value, shape=(key.shape[0], hkv, dv), dtype=dtype, device=device,
                     names=("num_tokens", "num_kv_heads", "value_head_size"))
    if kv_cache is None:
        if key is None:
            raise ValueError("key and value are required when there is no kv_cache (encoder attention)")
        return
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise ValueError(f"kv_cache must be a tensor, got {type(kv_cache).__name__}")
    want = tuple(kv_cache_shape) if kv_cache_shape is not None else (
        kv_cache.shape[0], 2, spec.block_size, hkv, d
    )
    check_tensor("kv_cache", kv_cache, shape=want, dtype=spec.kv_cache_torch_dtype, device=device)


def validate_mla_forward_inputs(
    spec: AttentionSpec,
    q: torch.Tensor,
    kv_c_normed: Optional[torch.Tensor],
    k_pe: Optional[torch.Tensor],
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    num_actual_tokens: int,
) -> None:
    """Check an MLA forward's tensors: q [T, N, P + R], kv_c_normed [>= n, Lkv], k_pe [>= n, R], output [T, N, V]
    in the model dtype; kv_cache [num_blocks, block_size, Lkv + R] in the cache dtype; all on q's device."""
    dtype = spec.torch_dtype
    n, p, r, v, lkv = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
                       spec.kv_lora_rank)
    check_tensor("q", q, shape=(None, n, p + r), dtype=dtype, names=("num_tokens", "num_heads", "P + R"),
                 min_rows=num_actual_tokens)
    device = q.device
    check_tensor("output", output, shape=(q.shape[0], n, v), dtype=dtype, device=device,
                 names=("num_tokens", "num_heads", "v_head_dim"))
    if (kv_c_normed is None) != (k_pe is None):
        raise ValueError("kv_c_normed and k_pe must be given together (or both None when the cache holds them)")
    if kv_c_normed is not None:
        check_tensor("kv_c_normed", kv_c_normed, shape=(None, lkv), dtype=dtype, device=device,
                     names=("num_tokens", "kv_lora_rank"), min_rows=num_actual_tokens)
        check_tensor("k_pe", k_pe, shape=(kv_c_normed.shape[0], r), dtype=dtype, device=device,
                     names=("num_tokens", "qk_rope_head_dim"))
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise ValueError(f"kv_cache must be a tensor, got {type(kv_cache).__name__}")
    check_tensor("kv_cache", kv_cache, shape=(kv_cache.shape[0], spec.block_size, spec.head_size),
                 dtype=spec.kv_cache_torch_dtype, device=device,
                 names=("num_blocks", "block_size", "kv_lora_rank + qk_rope_head_dim"))


def validate_metadata_against_cache(
    common: CommonAttentionMetadata, kv_cache: Optional[torch.Tensor], block_size: int
) -> None:
    """Debug-mode checks of one batch against the cache it runs on (reads device tensors on the host).

    query_start_loc monotonic, seq_lens >= query lens, every block-table entry a request uses inside
    ``[0, kv_cache.shape[0])``, every slot of a real token inside the cache (or -1). Raises ValueError naming the
    tensor and the first bad index.
    """
    if kv_cache is None:
        validate_common_metadata(common)
        return
    num_blocks = kv_cache.shape[0]
    validate_common_metadata(common, num_blocks=num_blocks, block_size=block_size)
    slots = common.slot_mapping[: common.num_actual_tokens].cpu()
    bad = torch.nonzero((slots < -1) | (slots >= num_blocks * block_size))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slots[i])} is outside [-1, {num_blocks * block_size}) "
            f"(num_blocks {num_blocks} x block_size {block_size})"
        )


def check_forward_inputs(
    impl: Any,
    metadata: Any,
    common: Optional[CommonAttentionMetadata],
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    value: Optional[torch.Tensor],
    kv_cache: Optional[torch.Tensor],
    output: torch.Tensor,
    *,
    backend: Optional[type] = None,
    mla: bool = False,
) -> None:
    """The hook every impl's ``forward`` calls first: range-checks the batch's page ids against the cache once per
    batch (:func:`attnbackends.ops.page_guard.guard_block_table`), validates the tensors on the impl's first call and
    on every call in debug mode, plus the metadata against the cache in debug mode. Cheap after the first call outside
    debug mode (two attribute reads). ``backend``: the backend class whose ``kv_cache_shape`` the cache must have."""
    if kv_cache is not None and common is not None and kv_cache.dim() >= 1:
        guard_block_table(common, kv_cache.shape[0], impl.spec.block_size)
    debug = debug_enabled(impl, metadata)
    if impl._inputs_checked and not debug:
        return
    spec = impl.spec
    num_actual_tokens = common.num_actual_tokens if common is not None else metadata.num_actual_tokens
    if mla:
        validate_mla_forward_inputs(spec, query, key, value, kv_cache, output, num_actual_tokens)
    else:
        kv_cache_shape = None
        if backend is not None and kv_cache is not None and kv_cache.dim() >= 1:
            kv_cache_shape = backend.kv_cache_shape(kv_cache.shape[0], spec)
        validate_forward_inputs(spec, query, key, value, kv_cache, output, num_actual_tokens,
                                kv_cache_shape=kv_cache_shape)
    if debug and common is not None:
        validate_metadata_against_cache(common, kv_cache, spec.block_size)
    impl._inputs_checked = True
