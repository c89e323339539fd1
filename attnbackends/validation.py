"""Input validation at the edges of an impl's ``forward`` and a builder's ``build``, kept cheap on the hot path.

The "checked" rule every impl follows (through :func:`check_forward_inputs`, the first line of its ``forward``):

- the FIRST call validates every tensor in full (shapes, dtypes, devices and strides of query / key / value / output
  / kv_cache against the spec and the backend's KV-cache layout) and records each tensor's layout: its shape past
  the token dimension, its strides, dtype and device;
- every LATER call compares the tensors with that record (a few attribute reads and tuple comparisons) and checks
  the token dimension against the batch's ``num_actual_tokens``; anything different runs the full validation
  again, which raises a ValueError naming the argument, or records the new layout when it is valid too;
- in debug mode every call validates in full and also checks the batch's metadata against the cache:
  block-table entries inside ``[0, kv_cache.shape[0])``, ``seq_len >= query_len`` (causal batches), a monotonic
  ``query_start_loc``, slots inside the cache and no slot written twice. These read the block table and the slot
  mapping on the host (a device sync), which is why they are off by default.

Every builder's ``build`` checks the batch's tensors first (:func:`check_metadata_tensors`: attribute reads only):
every device tensor on the builder's device in the one index dtype every backend takes (:data:`INDEX_DTYPES`), every
host copy on the CPU; then the builder's limits (:func:`check_batch_limits`: host integers only): an empty batch, more requests than ``max_num_reqs``, more tokens than ``max_num_tokens``; then
against the layer's spec (:func:`check_batch_for_spec`: causality, page size, integer page ids, cached context of
cache-less layers, and the slots against the block table where both are on the host), and marks the metadata with
its origin, which every ``forward`` compares with its layer before anything else
(:meth:`attnbackends.interface.AttentionImplBase.check_metadata`: one identity comparison per call).

How an engine turns debug mode on: set ``AttentionConfig(debug=True)`` (or ``debug: true`` in its YAML/JSON file)
and pass ``debug=config.debug`` to the metadata builder, as :class:`attnbackends.engine.Engine` does::

    builder = backend.get_builder_cls()(spec, device, debug=config.debug)

The builder validates each batch's metadata in ``build`` and marks the metadata it returns with ``debug=True``, so
every impl running that metadata checks its inputs and the block table on every call. An impl can also be put in
debug mode on its own: ``backend.get_impl_cls()(spec, debug=True)``.

Every error is a ValueError naming the argument, what it got (shape, dtype, device, strides or the bad index) and
what was expected.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .metadata import CommonAttentionMetadata, MetadataOrigin, check_slots_match_block_table, validate_common_metadata
from .ops.kv_layout import check_kv_cache_pages
from .ops.page_guard import guard_block_table
from .masks import check_masks_for_spec
from .platform import check_device_available
from .spec import AttentionSpec

__all__ = [
    "HOST_COPIES",
    "INDEX_DTYPES",
    "check_batch_for_spec",
    "check_batch_limits",
    "check_device_available",
    "check_forward_inputs",
    "check_host_table_matches",
    "check_lengths",
    "check_metadata_tensors",
    "check_tensor",
    "debug_enabled",
    "validate_forward_inputs",
    "validate_mla_forward_inputs",
    "same_device",
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
    device : the device it must be on (a tensor on the meta device is always rejected: it holds no data).
    names : the dimensions' names, for the message.
    last_dim_contiguous : require ``stride(-1) == 1`` (kernels load rows as contiguous vectors).
    min_rows : require ``shape[0] >= min_rows`` (e.g. the batch's num_actual_tokens).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {_fmt_shape(shape, names)}, got {type(t).__name__}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device: it holds no data (a model not yet materialised?); "
                         f"pass a tensor on cpu or cuda; got {_describe(t)}")
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
        raise ValueError(f"{name} must be on {device} (where the query is); got {_describe(t)}")
    if last_dim_contiguous and t.numel() and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1); got {_describe(t)}, "
                         f"strides {tuple(t.stride())}")


def _check_cache_contiguous(kv_cache: torch.Tensor, layout: str) -> None:
    if not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be one contiguous tensor in the backend's layout {layout} (as allocate_kv_cache returns "
            f"it); got shape {tuple(kv_cache.shape)} with strides {tuple(kv_cache.stride())}, a view of another "
            "layout or a slice of a larger tensor"
        )


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
    kv_cache_layout: Optional[str] = None,
) -> None:
    """Check a standard (non-MLA) forward's tensors against ``spec``.

    query : [T, num_heads, head_size] spec.dtype; key, value : [>= num_actual_tokens, num_kv_heads, head_size /
    value_head_size] spec.dtype (or None when the cache already holds them); output : [T, num_heads,
    value_head_size] spec.dtype; kv_cache : ``kv_cache_shape`` (the backend's layout for ``kv_cache.shape[0]``
    blocks; default: the standard ``[num_blocks, 2, block_size, num_kv_heads, head_size]``) in the spec's cache dtype,
    contiguous when ``kv_cache_layout`` (the layout's description) is given. Everything on query's device, last
    dimension contiguous.
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
    if spec.kv_cache_format.scales_in_pages:
        check_kv_cache_pages(kv_cache, spec)
    elif kv_cache_layout is not None:
        _check_cache_contiguous(kv_cache, kv_cache_layout)


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
    in the model dtype; kv_cache [num_blocks, block_size, Lkv + R] in the cache dtype, contiguous; all on q's
    device."""
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
    _check_cache_contiguous(kv_cache, "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]")


def validate_metadata_against_cache(
    common: CommonAttentionMetadata, kv_cache: Optional[torch.Tensor], block_size: int
) -> None:
    """Debug-mode checks of one batch against the cache it runs on (reads device tensors on the host).

    query_start_loc monotonic, seq_lens >= query lens (causal batches), every block-table entry a request uses inside
    ``[0, kv_cache.shape[0])``, every slot of a real token inside the cache (or -1) and no slot given to two
    tokens. Raises ValueError naming the tensor and the first bad index.
    """
    if kv_cache is None:
        validate_common_metadata(common)
        return
    num_blocks = kv_cache.shape[0]
    slots = common.slot_mapping[: common.num_actual_tokens].cpu()
    bad = torch.nonzero((slots < -1) | (slots >= num_blocks * block_size))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slots[i])} is outside [-1, {num_blocks * block_size}) "
            f"(num_blocks {num_blocks} x block_size {block_size})"
        )
    validate_common_metadata(common, num_blocks=num_blocks, block_size=block_size)
    sorted_slots, order = torch.sort(slots, stable=True)
    twice = torch.nonzero((sorted_slots[1:] == sorted_slots[:-1]) & (sorted_slots[1:] >= 0))
    if twice.numel():
        k = int(twice[0])
        i, j = sorted(int(x) for x in (order[k], order[k + 1]))
        raise ValueError(f"slot_mapping[{i}] and slot_mapping[{j}] are both {int(slots[i])}: two tokens of the "
                         "batch would be written to one cache slot")


def check_batch_limits(builder: Any, common: CommonAttentionMetadata) -> None:
    """What every builder's ``build`` checks first, from host integers only: the batch is not empty and fits the
    builder's ``max_num_reqs`` and ``max_num_tokens``, and ``slot_mapping`` covers every token.

    Raises ValueError naming the limit and the batch's value.
    """
    num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
    if num_reqs <= 0 or num_tokens <= 0:
        raise ValueError(f"empty batch (num_reqs = {num_reqs}, num_actual_tokens = {num_tokens}): build metadata "
                         "only for steps with at least one request and one token")
    if num_reqs > builder.max_num_reqs:
        raise ValueError(f"the batch has {num_reqs} requests, more than max_num_reqs = {builder.max_num_reqs} "
                         "this builder was made for; make the builder with a larger max_num_reqs or schedule fewer "
                         "requests per step")
    if num_tokens > builder.max_num_tokens:
        raise ValueError(f"the batch has {num_tokens} tokens (num_actual_tokens), more than max_num_tokens = "
                         f"{builder.max_num_tokens} this builder was made for; make the builder with a larger "
                         "max_num_tokens or schedule fewer tokens per step")
    if common.slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {common.slot_mapping.shape[0]} entries, fewer than num_actual_tokens "
                         f"({num_tokens}): every token needs a slot (-1 for padding)")


#: The index dtypes every backend takes (one rule, checked in every ``build``): the batch's offsets, lengths and
#: page ids are int32, on the device and in their host copies; the slots (block * block_size + offset, which
#: outgrow int32 in large caches) are int64.
INDEX_DTYPES = {
    "query_start_loc": torch.int32, "seq_lens": torch.int32, "block_table": torch.int32,
    "slot_mapping": torch.int64, "spec_tree_mask_indptr": torch.int32,
}
#: The host copies (always on the CPU) and the device tensors they copy.
HOST_COPIES = {"query_start_loc_cpu": "query_start_loc", "seq_lens_cpu": "seq_lens", "block_table_cpu": "block_table",
               "spec_tree_mask_indptr_cpu": "spec_tree_mask_indptr"}


def same_device(have: torch.device, want: torch.device) -> bool:
    """Whether a tensor on ``have`` is on ``want`` (``want`` without an index, e.g. a builder's ``"cuda"``, takes
    any index of its type)."""
    return have.type == want.type and (want.index is None or have.index == want.index)


def check_metadata_tensors(common: CommonAttentionMetadata, device: torch.device) -> None:
    """What every ``build`` checks first, from tensor attributes only (no device sync): the batch's device tensors
    (``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``, the tree mask and its offsets) are
    tensors on the builder's ``device``, the host copies (``query_start_loc_cpu``, ``seq_lens_cpu``,
    ``block_table_cpu``, ``spec_tree_mask_indptr_cpu``) on the CPU, each in the dtype of :data:`INDEX_DTYPES` (the
    tree mask bool), with a row per request.

    Raises ValueError naming the tensor, where it is or what it holds, and what is expected.
    """
    try:
        if _tensors_ok(common, device.type == "cuda", device.index):
            return
    except (AttributeError, TypeError):  # not a tensor: the checks below name it
        pass
    for name, dtype in INDEX_DTYPES.items():
        t = getattr(common, name)
        if t is None and name == "spec_tree_mask_indptr":
            continue
        _check_index_tensor(name, t, dtype)
        if not same_device(t.device, device):
            raise ValueError(f"{name} is on {t.device}, but the builder (and the KV cache it serves) is on {device}: "
                             f"every device tensor of the batch must be on the builder's device")
    mask = common.spec_tree_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype is not torch.bool
                             or not same_device(mask.device, device)):
        raise ValueError(f"spec_tree_mask must be a bool tensor on {device}, got {_what(mask)}")
    for name, of in HOST_COPIES.items():
        t = getattr(common, name)
        if t is None and name in ("block_table_cpu", "spec_tree_mask_indptr_cpu"):
            continue
        _check_index_tensor(name, t, INDEX_DTYPES[of])
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: it is the host copy of {of} and must be on the CPU "
                             f"(pass {of}.cpu(), or leave it None where optional)")
    n = common.num_reqs
    for name, rows in (("query_start_loc_cpu", n + 1), ("seq_lens_cpu", n), ("block_table", n)):
        t = getattr(common, name)
        if t.dim() != (2 if name == "block_table" else 1) or t.shape[0] < rows:
            raise ValueError(f"{name} must have at least {rows} rows for num_reqs = {n}, got shape "
                             f"{tuple(t.shape)}")


_DEVICE_CHECKS = tuple(INDEX_DTYPES.items())
_HOST_CHECKS = tuple((name, INDEX_DTYPES[of]) for name, of in HOST_COPIES.items())
_OPTIONAL = ("spec_tree_mask_indptr", "block_table_cpu", "spec_tree_mask_indptr_cpu")


def _tensors_ok(common: CommonAttentionMetadata, cuda: bool, index: Optional[int]) -> bool:
    """:func:`check_metadata_tensors`'s rule as one boolean, from the cheapest attribute reads (it runs in every
    build): ``dtype`` by identity, ``is_cuda`` / ``is_cpu`` and ``get_device()`` rather than ``device`` objects."""
    for name, dtype in _DEVICE_CHECKS:
        t = getattr(common, name)
        if t is None:
            if name in _OPTIONAL:
                continue
            return False
        if t.dtype is not dtype:
            return False
        if cuda:
            if not t.is_cuda or (index is not None and t.get_device() != index):
                return False
        elif not t.is_cpu:
            return False
    mask = common.spec_tree_mask
    if mask is not None and (mask.dtype is not torch.bool or mask.is_cuda is not cuda):
        return False
    for name, dtype in _HOST_CHECKS:
        t = getattr(common, name)
        if t is None:
            if name in _OPTIONAL:
                continue
            return False
        if t.dtype is not dtype or not t.is_cpu:
            return False
    n = common.num_reqs
    qsl, seq, table = common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table
    return (qsl.dim() == 1 and qsl.shape[0] > n and seq.dim() == 1 and seq.shape[0] >= n and table.dim() == 2
            and table.shape[0] >= n)


def _what(t: Any) -> str:
    return _describe(t) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_index_tensor(name: str, t: Any, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a {dtype} tensor, got {type(t).__name__}")
    if t.dtype is not dtype:
        what = "page ids" if "block_table" in name else "slots" if name == "slot_mapping" else "values"
        raise ValueError(f"{name} must hold {dtype} {what} (every backend takes the same index dtypes: int32 "
                         f"offsets, lengths and page ids, int64 slots); got {_describe(t)}: convert it once where "
                         f"the batch is made (e.g. .to(torch.{str(dtype).split('.')[-1]}))")


def check_lengths(common: CommonAttentionMetadata) -> None:
    """seq_len >= query_len for every request of a causal batch, from the host copies (a few NumPy operations, no
    device sync): a request cannot attend over fewer keys than its own new tokens. Raises ValueError naming
    ``seq_lens`` and the request."""
    n = common.num_reqs
    seq = common.seq_lens_cpu.numpy()[:n]
    qsl = common.query_start_loc_cpu.numpy()
    qlens = qsl[1 : n + 1] - qsl[:n]
    short = seq < qlens
    if np.count_nonzero(short):
        if qlens.min() < 0:
            i = int(np.argmax(qlens < 0))
            raise ValueError(f"query_start_loc is not monotonic at index {i + 1}: {int(qsl[i])} -> "
                             f"{int(qsl[i + 1])}")
        i = int(np.argmax(short))
        raise ValueError(f"seq_lens[{i}] ({int(seq[i])}) < query_len ({int(qsl[i + 1] - qsl[i])}) of request {i} "
                         "(query_start_loc): a causal request's seq_len counts its cached context and its new "
                         "tokens (was the batch edited after it was built?)")


def check_host_table_matches(common: CommonAttentionMetadata, block_size: int) -> None:
    """Where the block table and its host copy are two tensors on the host, the entries the batch uses hold the same
    page ids (NumPy on host memory, no device sync): the page guard and host-planning backends read the copy, the
    kernels the table. Raises ValueError naming ``block_table_cpu`` and the first entry that differs."""
    host, table = common.block_table_cpu, common.block_table
    n = common.num_reqs
    if not n or table.shape[1] == 0:
        return
    seq = common.seq_lens_cpu.numpy()[:n].astype(np.int64)
    pages = (seq + block_size - 1) // block_size
    width = min(int(pages.max()), table.shape[1])
    a, b = host.numpy(), table.numpy()
    if a.shape[0] < n or a.shape[1] < width:
        raise ValueError(f"block_table_cpu has shape {tuple(host.shape)}, smaller than block_table's used "
                         f"[{n}, {width}]: it must be the host copy of block_table")
    differ = a[:n, :width] != b[:n, :width]
    if np.count_nonzero(differ):
        differ &= np.arange(width)[None, :] < pages[:, None]
        if np.count_nonzero(differ):
            i, j = (int(v) for v in np.argwhere(differ)[0])
            raise ValueError(f"block_table_cpu[{i}, {j}] = {int(a[i, j])} but block_table[{i}, {j}] = {int(b[i, j])}: "
                             "the host copy disagrees with the table the kernels read (a stale copy, or one of "
                             "them rewritten in place?)")


def check_batch_for_spec(spec: AttentionSpec, common: CommonAttentionMetadata) -> None:
    """What every builder's ``build`` checks after its limits: the batch fits the layer's spec. From host data only
    (attribute reads; a few NumPy operations where the engine gives the block table and the slot mapping on the
    host), no device sync.

    - ``common.causal`` matches the layer: causal for decoder self-attention, non-causal for the layer kinds that
      see every key of their sequence (encoder, encoder-only, cross-attention);
    - causal layers with a KV cache: seq_len >= query_len from the host lengths, on every batch
      (:func:`check_lengths`), also one its producer checked (an engine may edit a batch in place);
    - layers with a KV cache: the page size ``common.block_size`` (where recorded) is the spec's; where the block
      table and its host copy are two host tensors and no producer made them together, they agree
      (:func:`check_host_table_matches`); and, for causal self-attention where the block table (``block_table_cpu`` or a CPU
      ``block_table``) and ``slot_mapping`` are on the host and :func:`build_common_metadata` has not already
      checked them (``common.host_checked``): seq_len >= query_len, every slot in its request's own page at the
      position its lengths imply (or -1), no slot given twice
      (:func:`~attnbackends.metadata.check_slots_match_block_table`). With device tensors only, the page guard
      contains page ids on the device and debug mode runs these checks (they then read the device);
    - layers without a KV cache: no request has cached context (seq_len == query_len).

    Raises ValueError naming the field and what the layer expects.
    """
    kind = spec.attn_type
    check_masks_for_spec(spec, common)
    if bool(common.causal) != spec.causal:
        want = "causal" if spec.causal else "non-causal (every query sees every key of its sequence)"
        hint = (" (a decoder layer that sees its whole cache declares AttentionSpec(mask=AttentionMask("
                "kind='non_causal')))" if spec.causal else "")
        raise ValueError(f"common.causal is {common.causal}, but the layer (attn_type {kind.value!r}, mask "
                         f"{spec.mask.describe()!r}) is {want}: build the metadata with causal={spec.causal}{hint}")
    common._cached_context = None  # a persistent batch may have been rewritten in place since the last build
    if kind.uses_kv_cache and kind.is_causal:
        check_lengths(common)
    if not kind.uses_kv_cache:
        if common.has_cached_context():
            i = int(torch.nonzero(common.seq_lens_cpu != common.query_lens_cpu)[0])
            raise ValueError(f"seq_lens[{i}] ({int(common.seq_lens_cpu[i])}) != query_len "
                             f"({int(common.query_lens_cpu[i])}) of request {i}: attn_type {kind.value!r} has no KV "
                             "cache, so a request cannot have cached context")
        return
    if common.block_size is not None and common.block_size != spec.block_size:
        raise ValueError(f"the batch's slots were computed for block_size {common.block_size}, the layer's spec has "
                         f"block_size {spec.block_size}: build the common metadata with the spec's block_size")
    if common.host_checked:
        return
    table, host = common.block_table, common.block_table_cpu
    if host is not None and host is not table and table.is_cpu:
        check_host_table_matches(common, spec.block_size)
    if not kind.is_causal:
        return
    host_table = host if host is not None else table
    slots = common.slot_mapping
    if host_table.is_cpu and slots.is_cpu:
        check_slots_match_block_table(common, spec.block_size, host_table.numpy(), slots.numpy())


def _layout(t: Optional[torch.Tensor], *, whole_shape: bool = False) -> Optional[tuple]:
    """What later calls must repeat: (size of dimension 1, size of the last dimension, strides, dtype, device), or
    the whole shape in place of the two sizes (``whole_shape``: the cache, whose first dimension is fixed too).

    The strides fix the number of dimensions, and the validated tensors have at most three, so dimension 1 and the
    last one are every dimension past the token dimension."""
    if t is None:
        return None
    if whole_shape:
        return (t.shape, t.stride(), t.dtype, t.device)
    return (t.shape[1], t.shape[-1], t.stride(), t.dtype, t.device)


def _same_layout(layout: tuple, n: int, query: Any, key: Any, value: Any, kv_cache: Any, output: Any) -> bool:
    """Whether this call's tensors repeat the recorded ``layout`` and hold at least ``n`` token rows.

    Written out in full on purpose: it runs on every forward of every layer, and each extra Python object or call
    costs host time."""
    q, k, v, c, o = layout
    qs, os_ = query.shape, output.shape
    if not (query.stride() == q[2] and output.stride() == o[2] and qs[0] >= n and os_[0] == qs[0]
            and qs[1] == q[0] and qs[-1] == q[1] and os_[1] == o[0] and os_[-1] == o[1]
            and query.dtype is q[3] and output.dtype is o[3] and query.device == q[4] and output.device == o[4]):
        return False
    if key is None:
        if k is not None or value is not None:
            return False
    else:
        if k is None or value is None:
            return False
        ks, vs = key.shape, value.shape
        if not (key.stride() == k[2] and value.stride() == v[2] and ks[0] >= n and vs[0] == ks[0]
                and ks[1] == k[0] and ks[-1] == k[1] and vs[1] == v[0] and vs[-1] == v[1]
                and key.dtype is k[3] and value.dtype is v[3] and key.device == k[4] and value.device == v[4]):
            return False
    if kv_cache is None:
        return c is None
    return (c is not None and kv_cache.shape == c[0] and kv_cache.stride() == c[1] and kv_cache.dtype is c[2]
            and kv_cache.device == c[3])


def _check_metadata_device(common: CommonAttentionMetadata, query: Any) -> None:
    """The batch's device tensors on the query's device (and so the cache's): the full validation's part of the
    device rule, which ``build`` checked against the builder's device."""
    device = getattr(query, "device", None)
    if not isinstance(device, torch.device):
        return  # not a tensor: the full validation names it
    for name in ("block_table", "seq_lens", "query_start_loc", "slot_mapping"):
        t = getattr(common, name)
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name} is on {t.device}, but this layer's query and kv_cache are on {device}: "
                             "build the metadata with a builder on the device of the layer's tensors")


def _has_cached_context(common: CommonAttentionMetadata) -> bool:
    """:meth:`CommonAttentionMetadata.has_cached_context` without recording the answer (``forward`` writes nothing
    to the batch); ``build`` recorded it for the layers without a cache."""
    known = common._cached_context
    return not torch.equal(common.seq_lens_cpu, common.query_lens_cpu) if known is None else known


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
    """The hook every impl's ``forward`` calls first (the "checked" rule of the module docstring).

    The page ids: where the metadata's builder knew the cache size (``metadata.origin.num_blocks``), its ``build``
    range-checked them, and this compares the cache's page count with it (a ValueError naming both); otherwise it
    range-checks them against this cache on every call
    (:func:`attnbackends.ops.page_guard.guard_block_table`). Then full validation on the impl's first call, on every
    call in debug mode, and on any call whose tensors differ from the recorded layout; otherwise one comparison per
    tensor. Writes nothing to the metadata. ``backend``: the backend class whose ``kv_cache_shape`` and layout the
    cache must have. ``mla``: the arguments are MLA's (q, kv_c_normed, k_pe, kv_cache, output).
    """
    spec = impl.spec
    if kv_cache is not None:
        if not spec.attn_type.uses_kv_cache:
            raise ValueError(f"kv_cache must be None for attn_type {spec.attn_type.value!r}: the layer has no KV "
                             "cache (its keys and values are the step's own key and value)")
        if common is not None and isinstance(kv_cache, torch.Tensor) and kv_cache.dim() >= 1:
            origin = getattr(metadata, "origin", None)
            checked = origin.num_blocks if isinstance(origin, MetadataOrigin) else None
            if checked is None:
                guard_block_table(common, kv_cache.shape[0], spec.block_size)
            elif kv_cache.shape[0] != checked:
                raise ValueError(
                    f"kv_cache has {kv_cache.shape[0]} pages (kv_cache.shape[0]), but the metadata's builder was made "
                    f"with num_blocks={checked} and checked the batch's page ids against that: make the builder "
                    "with the page count of the caches of the layers it serves")
    elif spec.attn_type.uses_kv_cache:
        context = (" and the batch has cached context (seq_len > query_len) it reads from there"
                   if common is not None and _has_cached_context(common) else "")
        raise ValueError(f"kv_cache is None, but attn_type {spec.attn_type.value!r} keeps its keys and values in a "
                         f"KV cache{context}: pass the layer's kv_cache (layers without one are attn_type "
                         "'encoder' or 'encoder_only')")
    num_actual_tokens = common.num_actual_tokens if common is not None else metadata.num_actual_tokens
    layout = impl._input_layout
    debug = impl.debug or getattr(metadata, "debug", False)
    if layout is not None and not debug:
        try:
            if _same_layout(layout, num_actual_tokens, query, key, value, kv_cache, output):
                return
        except (AttributeError, IndexError, TypeError):  # not tensors, or a 0-d one: the full check names it
            pass
    if mla:
        validate_mla_forward_inputs(spec, query, key, value, kv_cache, output, num_actual_tokens)
    else:
        kv_cache_shape = kv_cache_layout = None
        if backend is not None and isinstance(kv_cache, torch.Tensor) and kv_cache.dim() >= 1:
            kv_cache_shape = backend.kv_cache_shape(kv_cache.shape[0], spec)
            kv_cache_layout = backend.kv_cache_layout
        validate_forward_inputs(spec, query, key, value, kv_cache, output, num_actual_tokens,
                                kv_cache_shape=kv_cache_shape, kv_cache_layout=kv_cache_layout)
    if common is not None:
        _check_metadata_device(common, query)
    if debug and common is not None:
        validate_metadata_against_cache(common, kv_cache, spec.block_size)
    impl._input_layout = (_layout(query), _layout(key), _layout(value), _layout(kv_cache, whole_shape=True),
                          _layout(output))


# ======================================================================================================================
# Arguments of the Triton unified-attention launchers (attnbackends.triton.launch: unified_attention,
# varlen_attention) and of the Triton impl's first call. Shapes, dtypes, strides and devices only (no host-device
# sync); each error names the argument. Torch-only, like the rest of this module: nothing here imports Triton.
# ======================================================================================================================

__all__ += [
    "UNIFIED_ATTENTION_DTYPES",
    "UNIFIED_MAX_HEAD_SIZE",
    "UNIFIED_MIN_HEAD_SIZE",
    "check_return_lse",
    "check_unified_attention_args",
    "check_varlen_attention_args",
]

#: Query dtypes the unified kernel takes on a GPU (float32 as well on the CPU, under the interpreter).
UNIFIED_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
#: Head sizes the unified kernel takes (inclusive).
UNIFIED_MIN_HEAD_SIZE = 32
UNIFIED_MAX_HEAD_SIZE = 512
#: fp8 cache dtypes the unified kernel dequantises (as ``attnbackends.ops.quant.FP8_DTYPES``, which imports Triton).
_UNIFIED_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_launch_scale(name: str, scale: Union[float, torch.Tensor], device: torch.device) -> None:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"{name} must be a python float or a 1-element float32 tensor, got "
                             f"{tuple(scale.shape)} {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device}, expected {device}")
    elif isinstance(scale, (float, int)) and not isinstance(scale, bool):
        if not 0 < scale < float("inf"):  # also rejects NaN
            raise ValueError(f"{name} must be a positive finite number, got {scale}")
    else:
        raise ValueError(f"{name} must be a python float or a 1-element float32 tensor, got {type(scale).__name__}")


def _check_attention_query_args(query: torch.Tensor, output: torch.Tensor, query_start_loc: torch.Tensor,
                                num_kv_heads: int, head_size: int, causal: bool, sliding_window, logits_soft_cap,
                                alibi_slopes, sinks, softmax_scale) -> None:
    """What both launchers take alike: query, output, query_start_loc, the scale and the optional features."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got shape {tuple(query.shape)}")
    allowed = UNIFIED_ATTENTION_DTYPES + ((torch.float32,) if (query.device.type == "cpu") else ())
    if query.dtype not in allowed:
        raise ValueError(f"query dtype must be one of {allowed}, got {query.dtype}")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dimension (stride(-1) == 1)")
    num_heads = query.shape[1]
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} does not match the key head_size {head_size}")
    if not UNIFIED_MIN_HEAD_SIZE <= head_size <= UNIFIED_MAX_HEAD_SIZE:
        raise ValueError(f"head_size must be in [{UNIFIED_MIN_HEAD_SIZE}, {UNIFIED_MAX_HEAD_SIZE}], got {head_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if output.shape != query.shape:
        raise ValueError(f"output shape {tuple(output.shape)} must equal query shape {tuple(query.shape)}")
    if output.dtype not in UNIFIED_ATTENTION_DTYPES + (torch.float32,):
        raise ValueError(f"output dtype must be float16, bfloat16 or float32, got {output.dtype}")
    if output.stride(-1) != 1:
        raise ValueError("output must be contiguous in its last dimension (stride(-1) == 1)")
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32 or query_start_loc.numel() < 2:
        raise ValueError("query_start_loc must be a 1-D int32 tensor [num_seqs + 1], got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    for name, t in (("output", output), ("query_start_loc", query_start_loc)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device} (query's device)")
    if not isinstance(softmax_scale, (float, int)) or isinstance(softmax_scale, bool) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive python float, got {softmax_scale!r}")
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
        if not causal:
            raise NotImplementedError("sliding_window is only supported with causal=True")
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (float, int)) or not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be None or a positive float, got {logits_soft_cap!r}")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (num_heads,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor of shape [num_heads] = [{num_heads}]")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")


_PAGE_SCALED_DTYPES = {"fp8_per_token_head": torch.float8_e4m3fn, "int8_per_token_head": torch.int8,
                       "int4_per_token_head": torch.uint8, "nvfp4": torch.uint8}


def _check_page_scaled_views(query: torch.Tensor, key_cache: Any, value_cache: Any, kv_format: Any) -> None:
    """The key and value views of a cache whose scales sit beside its pages: ``kv_cache[:, 0]`` and
    ``kv_cache[:, 1]`` of one cache of that format (values' last dimension head_size, or head_size // 2 packed)."""
    want = _PAGE_SCALED_DTYPES[kv_format.value]
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got "
                             f"{getattr(t, 'shape', None)}")
        if t.dtype != want:
            raise ValueError(f"{name} of a {kv_format.value} cache must be {want}, got {t.dtype}")
    head = key_cache.shape[-1] * (2 if kv_format.packed else 1)
    if query.dim() == 3 and query.shape[-1] != head:
        raise ValueError(f"key_cache's last dimension {key_cache.shape[-1]} holds head_size {head} in the "
                         f"{kv_format.value} format; query has head_size {query.shape[-1]}")
    b, s_, h, d = key_cache.shape
    if (key_cache.stride()[1:] != (h * d, d, 1) or value_cache.stride() != key_cache.stride()
            or value_cache.data_ptr() - key_cache.data_ptr() != s_ * h * d):
        raise ValueError(f"key_cache and value_cache of a {kv_format.value} cache must be kv_cache[:, 0] and "
                         "kv_cache[:, 1] of one cache from allocate_kv_cache (its scales sit beside its pages)")


def _logical_cache_view(cache: torch.Tensor, query: torch.Tensor, kv_format: Any) -> torch.Tensor:
    """A stand-in of the cache's logical shape in query's dtype (no memory) for the shape checks below."""
    b, s_, h, d = cache.shape
    d = d * (2 if kv_format.packed else 1)
    return torch.empty(d, dtype=query.dtype, device=cache.device).expand(b, s_, h, d)


def check_unified_attention_args(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table,
                                 max_query_len, max_seq_len, softmax_scale, *, causal=True, sliding_window=None,
                                 logits_soft_cap=None, alibi_slopes=None, sinks=None, k_scale=1.0, v_scale=1.0,
                                 workspace=None, num_decodes=None, num_kv_splits=None, kv_format=None) -> None:
    """Validate the arguments of :func:`attnbackends.triton.launch.unified_attention` (shapes there); raises
    ValueError / NotImplementedError naming the offending argument. Reads only shapes, dtypes, strides and devices
    (no host-device sync). ``kv_format``: the cache's :class:`~attnbackends.spec.KVCacheFormat` (None: 16-bit or
    fp8 per tensor, from the dtype)."""
    if kv_format is not None and kv_format.scales_in_pages:
        _check_page_scaled_views(query, key_cache, value_cache, kv_format)
        key_cache = value_cache = _logical_cache_view(key_cache, query, kv_format)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, num_kv_heads, head_size], got "
                             f"{getattr(t, 'shape', None)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1)")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
    _, block_size, num_kv_heads, head_size = key_cache.shape
    _check_attention_query_args(query, output, query_start_loc, num_kv_heads, head_size, causal, sliding_window,
                                logits_soft_cap, alibi_slopes, sinks, softmax_scale)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in _UNIFIED_FP8_DTYPES and t.dtype != query.dtype:
            raise ValueError(f"{name} dtype must be query's dtype ({query.dtype}) or one of {_UNIFIED_FP8_DTYPES}, "
                             f"got {t.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
                         f"{tuple(value_cache.shape)} {value_cache.dtype} must match")
    if block_size < 16 or block_size % 16:
        raise ValueError(f"block_size (key_cache.shape[1]) must be a positive multiple of 16, got {block_size}")
    num_seqs = query_start_loc.numel() - 1
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.numel() != num_seqs:
        raise ValueError(f"seq_lens must be a 1-D int32 tensor [num_seqs] = [{num_seqs}], got "
                         f"{tuple(seq_lens.shape)} {seq_lens.dtype}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table must be a 2-D int32 tensor [>= num_seqs, max_blocks], got "
                         f"{tuple(block_table.shape)} {block_table.dtype}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    for name, t in (("seq_lens", seq_lens), ("block_table", block_table)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
    for name, v in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative python int (host value), got {v!r}")
    if max_seq_len > block_table.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds block_table capacity "
                         f"{block_table.shape[1]} x {block_size}")
    _check_launch_scale("k_scale", k_scale, query.device)
    _check_launch_scale("v_scale", v_scale, query.device)
    if isinstance(k_scale, torch.Tensor) != isinstance(v_scale, torch.Tensor):
        raise ValueError("k_scale and v_scale must both be floats or both be tensors")
    if num_decodes is not None:
        if not isinstance(num_decodes, int) or not 0 <= num_decodes <= num_seqs:
            raise ValueError(f"num_decodes must be None or an int in [0, num_seqs={num_seqs}], got {num_decodes!r}")
        if num_decodes > query.shape[0]:
            raise ValueError(f"num_decodes ({num_decodes}) exceeds num_tokens ({query.shape[0]})")
    if num_kv_splits is not None:
        if not isinstance(num_kv_splits, int) or not 1 <= num_kv_splits <= 64:
            raise ValueError(f"num_kv_splits must be None or an int in [1, 64], got {num_kv_splits!r}")
    if workspace is not None:
        # A SplitKVWorkspace (attnbackends.triton.launch) by what it holds: this module does not import Triton.
        partial_out = getattr(workspace, "partial_out", None)
        if not isinstance(partial_out, torch.Tensor) or not isinstance(getattr(workspace, "partial_lse", None),
                                                                          torch.Tensor):
            raise ValueError(f"workspace must be a SplitKVWorkspace, got {type(workspace).__name__}")
        if partial_out.device != query.device:
            raise ValueError(f"workspace is on {partial_out.device}, expected {query.device}")
        counters = getattr(workspace, "counters", None)
        if counters is not None and (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
                                     or counters.dim() != 1 or counters.device != query.device):
            raise ValueError("workspace.counters must be None or a 1-D int32 tensor of zeros on the query's device")


def check_varlen_attention_args(query, key, value, output, query_start_loc, max_seq_len, softmax_scale, *,
                                causal=False, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                                sinks=None) -> None:
    """Validate the arguments of :func:`attnbackends.triton.launch.varlen_attention` (shapes there); raises
    ValueError / NotImplementedError naming the offending argument."""
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[0] != query.shape[0] or t.shape[2] != query.shape[2]:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_size] matching query "
                             f"{tuple(query.shape)}, got {tuple(t.shape)}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must equal query dtype {query.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, expected {query.device}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    _check_attention_query_args(query, output, query_start_loc, key.shape[1], key.shape[2], causal, sliding_window,
                                logits_soft_cap, alibi_slopes, sinks, softmax_scale)
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative python int, got {max_seq_len!r}")


def check_return_lse(return_lse: torch.Tensor, query: torch.Tensor) -> None:
    """``return_lse`` of :func:`attnbackends.triton.launch.unified_attention`: [num_heads, >= num_tokens] float32
    with unit stride in the token dimension, on query's device."""
    if (return_lse.dim() != 2 or return_lse.dtype != torch.float32 or return_lse.shape[0] != query.shape[1]
            or return_lse.shape[1] < query.shape[0] or return_lse.stride(1) != 1):
        raise ValueError(f"return_lse must be a [num_heads={query.shape[1]}, >= num_tokens={query.shape[0]}] "
                         f"float32 tensor with unit token stride, got {tuple(return_lse.shape)} "
                         f"{return_lse.dtype} strides {tuple(return_lse.stride())}")
    if return_lse.device != query.device:
        raise ValueError(f"return_lse is on {return_lse.device}, expected {query.device}")
