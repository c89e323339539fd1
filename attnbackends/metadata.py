"""Per-batch attention metadata shared by every backend, and the helpers that build and split it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .masks import BatchMasks
from .platform import check_device_available

__all__ = [
    "CommonAttentionMetadata",
    "DecodePrefillSplit",
    "MetadataOrigin",
    "PLAN_FEATURES",
    "build_common_metadata",
    "build_cross_attention_metadata",
    "check_slots_match_block_table",
    "decode_first_order",
    "encoder_slot_mapping",
    "plan_features",
    "split_decodes_and_prefills",
    "validate_common_metadata",
]


@dataclass
class CommonAttentionMetadata:
    """One batch, as every backend's metadata builder receives it.

    Requests are laid out one after another in the token dimension. A request with seq_len L and query_len Q has
    context C = L - Q cached tokens; its i-th new token sits at position C + i.

    Attributes
    ----------
    query_start_loc : torch.Tensor
        [num_reqs + 1] int32 on the device; cumulative query lengths, starting at 0.
    query_start_loc_cpu : torch.Tensor
        [num_reqs + 1] int32 on the CPU; the same values.
    seq_lens : torch.Tensor
        [num_reqs] int32 on the device; context + new tokens per request.
    seq_lens_cpu : torch.Tensor
        [num_reqs] int32 on the CPU.
    block_table : torch.Tensor
        [num_reqs, max_blocks_per_req] int32 on the device; page ids of each request, in order.
    slot_mapping : torch.Tensor
        [num_tokens] int64 on the device; cache slot (block * block_size + offset) of each new token, -1 for
        padding. ``num_tokens >= num_actual_tokens``: a CUDA-graph-padded batch has padding at the end.
    num_reqs, num_actual_tokens, max_query_len, max_seq_len : int
    causal : bool
    common_prefix_len : int
        Tokens at the start of every request that share the same pages (from the engine's prefix cache); 0 when
        unknown. Backends may use it for cascade attention.
    block_table_cpu : torch.Tensor or None
        Optional host copy of ``block_table`` (engines usually keep one). When given it must hold the same values;
        backends that plan on the host (FlashInfer) then read page ids from it instead of gathering on the device,
        and the page-id range check runs on it before any kernel (see :mod:`attnbackends.ops.page_guard`).
    block_size : int or None
        The page size (tokens) ``slot_mapping`` was computed for; :func:`build_common_metadata` records it, and a
        builder refuses a batch whose block_size differs from its spec's. None: not recorded (the builder then checks
        the slots against the block table where both are on the host).
    pages_checked_for : int or None
        Set by producers that range-checked every page id they placed against a cache of this many pages
        (:class:`~attnbackends.persistent_batch.PersistentBatch` with ``num_blocks``): a builder with the same
        ``num_blocks`` then skips its per-build range check. Nothing else writes it; ``dataclasses.replace`` clears it.
    host_checked : bool
        Set by :func:`build_common_metadata` and :func:`build_cross_attention_metadata`, which derive the slots
        from the block table and check page ids, lengths and duplicate slots on the host lists: the builders'
        per-step consistency checks then have nothing left to do. ``dataclasses.replace`` clears it (a replaced
        tensor is checked again).
    spec_tree_mask : torch.Tensor or None
        Tree verification (speculative decoding): [sum_i n_i * n_i] bool on the device, request i's [n_i, n_i]
        ancestor mask flattened row-major, requests one after another. A request's last n_i query tokens are its
        draft segment (usually n_i = query_len: the root plus the draft tokens); its draft token a may see draft
        token b iff ``mask[a, b]`` (b is a or an ancestor of a). Every key before the draft segment (the cached
        context) stays visible as usual; n_i = 0 leaves a request causal. Sliding windows and ALiBi keep counting
        positions in cache order (token a of the segment sits at L - n_i + a). Build it with
        :func:`attnbackends.speculative.tree_mask.tree_mask_from_parents`; a backend honours it only where its builder
        declares ``supports_tree_mask``.
    spec_tree_mask_indptr, spec_tree_mask_indptr_cpu : torch.Tensor or None
        [num_reqs + 1] int32 on the device and on the host: request i's mask is
        ``spec_tree_mask[indptr[i] : indptr[i + 1]]`` (n_i * n_i entries).
    masks : BatchMasks or None
        The per-request data of the layer's mask kind (:mod:`attnbackends.masks`): bidirectional spans (kind
        ``causal_spans``) or custom masks (kind ``custom``); made by :func:`attnbackends.masks.with_spans` and
        :func:`attnbackends.masks.with_custom_masks`. None: no per-request mask data.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    common_prefix_len: int = 0
    block_table_cpu: Optional[torch.Tensor] = None
    spec_tree_mask: Optional[torch.Tensor] = None
    spec_tree_mask_indptr: Optional[torch.Tensor] = None
    spec_tree_mask_indptr_cpu: Optional[torch.Tensor] = None
    block_size: Optional[int] = None
    masks: Optional[BatchMasks] = None
    pages_checked_for: Optional[int] = field(default=None, init=False, repr=False, compare=False)
    host_checked: bool = field(default=False, init=False, repr=False, compare=False)
    _cached_context: Optional[bool] = field(default=None, init=False, repr=False, compare=False)

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """[num_reqs] int32 on the CPU."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """[num_reqs] int32 on the CPU: tokens already in the cache before this step."""
        return self.seq_lens_cpu - self.query_lens_cpu

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def has_cached_context(self) -> bool:
        """Whether some request has context (seq_len > query_len), i.e. needs keys from a KV cache; read from the
        host copies once per batch."""
        if self._cached_context is None:
            self._cached_context = not torch.equal(self.seq_lens_cpu, self.query_lens_cpu)
        return self._cached_context

    @property
    def common(self) -> Any:
        """Not an attribute of the common metadata: ``forward`` takes the metadata a backend's builder returns."""
        raise ValueError(
            "metadata is a CommonAttentionMetadata, but forward takes the backend metadata its builder returns: "
            "pass builder.build(common) (builder = backend.get_builder_cls()(spec, device)) instead")


#: The spec's features a builder's plan may bake in beside the shapes (a kernel specialised for a window, a
#: soft-cap, ALiBi, sinks or an fp8 cache; the softmax scale): metadata built for one value serves no layer of
#: another (:meth:`MetadataOrigin.differences`). A new spec field that a plan bakes in belongs here.
PLAN_FEATURES = ("sliding_window", "logits_soft_cap", "alibi_slopes", "has_sinks", "kv_cache_dtype", "scale")


def plan_features(spec: Any) -> tuple:
    """``spec``'s values of :data:`PLAN_FEATURES`, as :class:`MetadataOrigin` records them (the cache dtype
    resolved: ``"auto"`` and the model dtype name the same cache)."""
    values = []
    for name in PLAN_FEATURES:
        value = getattr(spec, name, None)
        if name == "kv_cache_dtype":
            value = getattr(spec, "kv_cache_torch_dtype", value)
        values.append(value)
    return tuple(values)


@dataclass(frozen=True)
class MetadataOrigin:
    """Where a backend's built metadata came from and which layers it can serve: the builder class, the spec
    fields its plan depends on and the cache size its page ids were checked against. Every builder's ``build`` sets
    it as ``metadata.origin``; every impl's ``forward`` compares it with its own spec
    (:meth:`attnbackends.interface.AttentionImplBase.check_metadata`, once per origin) and its cache's page count
    with ``num_blocks`` (:func:`attnbackends.validation.check_forward_inputs`).

    ``features``: the builder spec's :data:`PLAN_FEATURES` values (:func:`plan_features`), compared with the layer's
    on every backend alike, so that metadata planned for another window, soft-cap, ALiBi, sinks, cache dtype or
    scale is an error everywhere rather than honoured by one backend and dropped by another.
    ``num_blocks``: the builder's (the KV cache's pages), against which ``build`` range-checked the batch's page ids
    and contained any it gathered; None: the builder was not told, so ``forward`` checks the page ids itself.
    ``device``: the builder's device, where ``build`` found every device tensor of the batch."""

    builder: type
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    value_head_size: int
    qk_nope_head_dim: Optional[int]
    dtype: str
    attn_type: Any  # AttentionType
    num_blocks: Optional[int] = None
    features: tuple = ()
    device: Optional[torch.device] = None

    @classmethod
    def of(cls, builder: type, spec: Any, num_blocks: Optional[int] = None,
           device: Optional[torch.device] = None) -> "MetadataOrigin":
        """The origin of metadata that a ``builder`` instance of ``spec`` (an AttentionSpec) on ``device`` for a
        cache of ``num_blocks`` pages (None: not told) builds."""
        return cls(builder, spec.block_size, spec.num_heads, spec.num_kv_heads, spec.head_size,
                   spec.value_head_size, spec.qk_nope_head_dim, spec.dtype, spec.attn_type, num_blocks,
                   plan_features(spec), device)

    def differences(self, spec: Any) -> list[str]:
        """The fields where ``spec`` (the layer's) differs from the spec the metadata was built for, in words."""
        diffs = []
        for name in ("block_size", "num_heads", "num_kv_heads", "head_size", "value_head_size", "qk_nope_head_dim",
                     "dtype", "attn_type"):
            built, layer = getattr(self, name), getattr(spec, name)
            if built != layer:
                show = (lambda v: v.value) if name == "attn_type" else (lambda v: v)
                diffs.append(f"{name} {show(built)!r} (metadata) != {show(layer)!r} (this layer)")
        if self.features:
            for name, built, layer in zip(PLAN_FEATURES, self.features, plan_features(spec)):
                if built != layer:
                    diffs.append(f"{name} {built!r} (metadata) != {layer!r} (this layer)")
        return diffs


def build_common_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Optional[Sequence[Sequence[int]]],
    block_size: int,
    device: "torch.device | str" = "cpu",
    *,
    causal: bool = True,
    num_padded_tokens: Optional[int] = None,
    max_blocks_per_req: Optional[int] = None,
) -> CommonAttentionMetadata:
    """Build :class:`CommonAttentionMetadata` from per-request lists.

    Parameters
    ----------
    query_lens : new tokens per request (>= 1).
    context_lens : tokens already cached per request (>= 0).
    block_tables : per request, the page ids holding its tokens; needs ceil((context + query) / block_size) pages.
        None for layers without a KV cache (encoders): context_lens must be 0 and every slot is -1.
    block_size : tokens per page.
    num_padded_tokens : total token count including padding at the end (slot -1), default: no padding.
    max_blocks_per_req : width of the block table (default: the longest table); extra entries are 0.
    """
    block_size = _as_int("block_size", block_size)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    device = check_device_available(device)
    query_lens = _int_list("query_lens", query_lens)
    context_lens = _int_list("context_lens", context_lens)
    num_reqs = len(query_lens)
    has_cache = block_tables is not None
    if not has_cache:
        if any(context_lens):
            raise ValueError("context_lens must be 0 when there is no KV cache (block_tables=None)")
        block_tables = [[] for _ in query_lens]
    if len(context_lens) != num_reqs or len(block_tables) != num_reqs:
        raise ValueError(
            f"query_lens, context_lens and block_tables must have one entry per request; got "
            f"{num_reqs}, {len(context_lens)}, {len(block_tables)}"
        )
    tables = [_page_ids(i, table) for i, table in enumerate(block_tables)]
    seq_lens = []
    slots: list[np.ndarray] = []
    writer: dict[int, tuple[int, int]] = {}  # page -> (request, column) whose new tokens it receives
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, tables)):
        if q < 1 or c < 0:
            raise ValueError(f"request {i}: query_len must be >= 1 and context_len >= 0, got {q} and {c}")
        need = -(-(q + c) // block_size) if has_cache else 0
        if len(table) < need:
            raise ValueError(f"request {i}: block_tables[{i}] has {len(table)} pages, {q + c} tokens need {need}")
        _check_used_pages(i, table, need)
        seq_lens.append(q + c)
        if not has_cache:
            slots.append(np.full(q, -1, dtype=np.int64))
            continue
        for col in range(c // block_size, need):
            # A page that receives new tokens belongs to one request and one column (shared prefix pages are full
            # and read-only); otherwise two tokens of the step are written to one cache slot.
            page = int(table[col])
            other = writer.setdefault(page, (i, col))
            if other != (i, col):
                raise ValueError(f"block_tables[{i}][{col}] = {page} receives new tokens, and so does "
                                 f"block_tables[{other[0]}][{other[1]}]: two tokens of the step would share a cache "
                                 "slot (duplicate slots)")
        pos = np.arange(c, c + q, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    common = _assemble(query_lens, seq_lens, tables, np.concatenate(slots) if slots else np.zeros(0, np.int64),
                       causal, num_padded_tokens, max_blocks_per_req, device)
    common.block_size = block_size if has_cache else None  # no pages, no page size
    common.host_checked = True
    return common


def _as_int(name: str, value: Any) -> int:
    """``value`` as an int; ValueError naming ``name`` for a float, a bool or anything else that is not an integer
    (a float length or page id would otherwise be truncated silently)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype is not torch.bool
            and not (value.is_floating_point() or value.is_complex())):
        return int(value)
    raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _int_list(name: str, values: Sequence[Any]) -> list[int]:
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _page_ids(i: int, table: Sequence[Any]) -> np.ndarray:
    """Request ``i``'s block table as int64 page ids (each an int); ValueError naming the entry otherwise."""
    if isinstance(table, torch.Tensor):
        table = table.cpu()
    arr = np.asarray(table)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        for j, value in enumerate(table):  # the first entry that is not an int names the problem
            _as_int(f"block_tables[{i}][{j}]", value)
        raise ValueError(f"block_tables[{i}] must be a list of int page ids, got {table!r}")
    return arr.astype(np.int64, copy=False)


def _check_used_pages(i: int, table: np.ndarray, need: int) -> None:
    """The ``need`` pages request ``i`` uses are >= 0 (columns past them may hold anything: engines pad rows with -1
    or stale ids); ValueError naming the entry otherwise."""
    negative = np.flatnonzero(table[:need] < 0)
    if negative.size:
        j = int(negative[0])
        raise ValueError(f"block_tables[{i}][{j}] = {int(table[j])}: page ids must be >= 0")


def _assemble(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[np.ndarray],
    slots: np.ndarray,
    causal: bool,
    num_padded_tokens: Optional[int],
    max_blocks_per_req: Optional[int],
    device: "torch.device | str",
) -> CommonAttentionMetadata:
    """The metadata tensors of checked per-request lists (slots [num_tokens] int64: one per new token; padding
    appended here)."""
    num_reqs = len(query_lens)
    num_actual_tokens = len(slots)
    if num_padded_tokens is not None:
        num_padded_tokens = _as_int("num_padded_tokens", num_padded_tokens)
        if num_padded_tokens < num_actual_tokens:
            raise ValueError(f"num_padded_tokens ({num_padded_tokens}) < the batch's {num_actual_tokens} tokens")
        slots = np.concatenate([slots, np.full(num_padded_tokens - num_actual_tokens, -1, dtype=np.int64)])
    width = max((len(t) for t in block_tables), default=0)
    if max_blocks_per_req is not None:
        max_blocks_per_req = _as_int("max_blocks_per_req", max_blocks_per_req)
        if max_blocks_per_req < width:
            raise ValueError(f"max_blocks_per_req ({max_blocks_per_req}) < the longest block table ({width})")
        width = max_blocks_per_req
    table = torch.zeros((num_reqs, width), dtype=torch.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64)).to(torch.int32)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.as_tensor(list(query_lens), dtype=torch.int32), 0)
    seq_lens_cpu = torch.as_tensor(seq_lens, dtype=torch.int32)
    device = torch.device(device)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        block_table=table.to(device),
        slot_mapping=torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(device),
        num_reqs=num_reqs,
        num_actual_tokens=num_actual_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        causal=causal,
        block_table_cpu=table,
    )


def _check_encoder_tables(encoder_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                          block_size: int) -> tuple[list[int], list[np.ndarray], int]:
    """The checked (encoder_lens, block tables, block_size)."""
    encoder_lens = _int_list("encoder_lens", encoder_lens)
    block_size = _as_int("block_size", block_size)
    if len(block_tables) != len(encoder_lens):
        raise ValueError(f"encoder_lens and block_tables must have one entry per request; got {len(encoder_lens)} "
                         f"and {len(block_tables)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    block_tables = [_page_ids(i, table) for i, table in enumerate(block_tables)]
    for i, (s, table) in enumerate(zip(encoder_lens, block_tables)):
        if s < 1:
            raise ValueError(f"request {i}: encoder_lens[{i}] must be >= 1, got {s}")
        need = -(-s // block_size)
        if len(table) < need:
            raise ValueError(f"request {i}: block_tables[{i}] has {len(table)} pages, {s} encoder tokens need {need}")
        _check_used_pages(i, table, need)
    return encoder_lens, block_tables, block_size


def build_cross_attention_metadata(
    query_lens: Sequence[int],
    encoder_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: "torch.device | str" = "cpu",
    *,
    num_padded_tokens: Optional[int] = None,
    max_blocks_per_req: Optional[int] = None,
) -> CommonAttentionMetadata:
    """The batch as a cross-attention layer (``AttentionType.ENCODER_DECODER``) sees it: each request's decoder
    queries of this step over ALL of its encoder's keys, which sit in the cross-attention cache (written once per
    request, at the slots :func:`encoder_slot_mapping` gives, through the impl's ``update_kv_cache``).

    Compared with the decoder self-attention's metadata of the same step, ``query_start_loc`` is the same (the
    step's decoder tokens) and:

    - ``seq_lens`` [num_reqs] int32 are the encoder lengths: the keys every query of the request sees
      (non-causal). A request may have more query tokens than encoder keys (a long decoder prompt over a short
      input); seq_len >= query_len holds for causal batches only;
    - ``block_table`` [num_reqs, max_blocks_per_req] int32 holds the pages of each request's encoder keys;
    - ``slot_mapping`` [num_tokens] int64 is -1 everywhere: decoder tokens write nothing into the cross cache, so
      ``forward`` is called with ``key = value = None``;
    - ``causal`` is False.

    Parameters
    ----------
    query_lens : the step's decoder tokens per request (>= 1).
    encoder_lens : encoder tokens per request (>= 1).
    block_tables : per request, the pages of its encoder keys; needs ceil(encoder_len / block_size) pages.
    block_size, num_padded_tokens, max_blocks_per_req : as for :func:`build_common_metadata`.
    """
    query_lens = _int_list("query_lens", query_lens)
    if len(query_lens) != len(encoder_lens):
        raise ValueError(f"query_lens and encoder_lens must have one entry per request; got {len(query_lens)} and "
                         f"{len(encoder_lens)}")
    encoder_lens, tables, block_size = _check_encoder_tables(encoder_lens, block_tables, block_size)
    device = check_device_available(device)
    for i, q in enumerate(query_lens):
        if q < 1:
            raise ValueError(f"request {i}: query_len must be >= 1, got {q}")
    slots = np.full(sum(query_lens), -1, dtype=np.int64)
    common = _assemble(query_lens, encoder_lens, tables, slots, False, num_padded_tokens, max_blocks_per_req, device)
    common.block_size = block_size
    common.host_checked = True
    return common


def encoder_slot_mapping(
    encoder_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: "torch.device | str" = "cpu",
) -> torch.Tensor:
    """[sum(encoder_lens)] int64 cache slots of the encoder keys and values, requests one after another: encoder
    token j of request i goes to slot ``block_tables[i][j // block_size] * block_size + j % block_size``. Pass it to
    a cross-attention impl's ``update_kv_cache(key, value, kv_cache, slots)`` with key and value
    [sum(encoder_lens), num_kv_heads, head_size] once per request, before the request's first decoder step."""
    encoder_lens, tables, block_size = _check_encoder_tables(encoder_lens, block_tables, block_size)
    device = check_device_available(device)
    slots = [table[np.arange(s) // block_size] * block_size + np.arange(s) % block_size
             for s, table in zip(encoder_lens, tables)]
    return torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, np.int64)).to(device)


def decode_first_order(query_lens: Sequence[int], decode_threshold: int = 1) -> list[int]:
    """A stable permutation of request indices that puts decodes (query_len <= threshold) first."""
    decodes = [i for i, q in enumerate(query_lens) if q <= decode_threshold]
    prefills = [i for i, q in enumerate(query_lens) if q > decode_threshold]
    return decodes + prefills


@dataclass(frozen=True)
class DecodePrefillSplit:
    """How many requests and tokens form the leading decode part and the trailing prefill part of a batch."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(common: CommonAttentionMetadata, decode_threshold: int = 1) -> DecodePrefillSplit:
    """Split a decode-first batch (see :func:`decode_first_order`) into its decode and prefill parts.

    Uses the CPU copies only (no host-device sync). Raises ValueError if a decode follows a prefill.
    """
    query_lens = common.query_lens_cpu
    is_decode = query_lens <= decode_threshold
    num_decodes = int(is_decode.sum())
    if num_decodes and not bool(is_decode[:num_decodes].all()):
        raise ValueError(
            f"the batch is not ordered decodes first (query_len <= {decode_threshold}); "
            "reorder it with decode_first_order() before building metadata"
        )
    num_decode_tokens = int(common.query_start_loc_cpu[num_decodes])
    return DecodePrefillSplit(
        num_decodes=num_decodes,
        num_prefills=common.num_reqs - num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=common.num_actual_tokens - num_decode_tokens,
    )


def check_slots_match_block_table(
    common: CommonAttentionMetadata, block_size: int, table: np.ndarray, slots: np.ndarray
) -> None:
    """The step's slots against its block table and lengths, on host arrays (no device sync, no torch op).

    table : [>= num_reqs, W] int page ids; slots : [>= num_actual_tokens] int64 (``slot_mapping``). Checks that
    every request's seq_len >= its query_len (causal batches), that the pages its lengths need exist in its row,
    that token t of request i (at position C_i + t) has slot ``table[i, pos // block_size] * block_size + pos %
    block_size`` or -1 (not written), and that no two tokens share a slot. Raises ValueError naming the tensor, the
    index and the values.
    """
    n, t = common.num_reqs, common.num_actual_tokens
    seq = common.seq_lens_cpu.numpy()[:n]
    given = slots[:t]
    # Every build runs this, so the common case takes as few NumPy calls as it can (each costs about a
    # microsecond, more than the arithmetic on a few thousand elements): every token's slot from the block table,
    # one comparison, one sort. Only when something differs does the slow path work out what exactly is wrong.
    if t == n and common.max_query_len == 1:  # a decode step: request i's one token sits at position seq_len - 1
        req = _arange(n)
        pos = seq.astype(np.int64)  # positions in int64, like the slots, so no later step needs a cast
        pos -= 1
    else:
        req, pos = _token_positions(common, seq)
    col = pos // block_size
    pages = None
    if pos.min(initial=0) >= 0:  # a negative position (seq_len < query_len) would read its row from the end
        try:
            pages = table[req, col]
        except IndexError:  # a column past the table's width
            pass
    if pages is not None:
        expected = pages - col
        expected *= block_size
        expected += pos
    if pages is None or np.count_nonzero(given != expected):
        _explain_slot_mismatch(common, block_size, table, given, req, pos)  # raises, unless only -1s differ
        return
    _check_no_repeated_slot(given, np.sort(given))


def _token_positions(common: CommonAttentionMetadata, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's request and position (int64 [num_actual_tokens] each), from ``query_start_loc``.

    Raises ValueError where ``query_start_loc`` is not monotonic (checked first) or does not rise from 0 to
    num_actual_tokens."""
    qsl = common.query_start_loc_cpu.numpy()
    n, t = common.num_reqs, common.num_actual_tokens
    qlens = qsl[1 : n + 1] - qsl[:n]
    if qsl[0] != 0 or qsl[n] != t:
        _check_monotonic(qsl, qlens)
        raise ValueError(f"query_start_loc must rise from 0 to num_actual_tokens ({t}); got "
                         f"{int(qsl[0])} ... {int(qsl[n])}")
    try:
        req = np.repeat(_arange(n), qlens)
    except ValueError:  # np.repeat refuses a negative count: a query_start_loc that goes down
        _check_monotonic(qsl, qlens)
        raise
    return req, _arange(t) + (seq - qsl[1 : n + 1])[req]


def _check_monotonic(qsl: np.ndarray, qlens: np.ndarray) -> None:
    """Raise naming the first index where ``query_start_loc`` goes down (``qlens``: its differences)."""
    if qlens.min(initial=0) < 0:
        i = int(np.argmax(qlens < 0))
        raise ValueError(f"query_start_loc is not monotonic at index {i + 1}: {int(qsl[i])} -> {int(qsl[i + 1])}")


def _check_no_repeated_slot(given: np.ndarray, ordered: np.ndarray) -> None:
    """Raise naming the first two tokens of ``given`` (the step's slots) that share a slot, where ``ordered`` (the
    slots that count, sorted) holds a value twice."""
    twice = ordered[1:] == ordered[:-1]
    if np.count_nonzero(twice):
        value = int(ordered[np.argmax(twice)])
        i, j = (int(x) for x in np.flatnonzero(given == value)[:2])
        raise ValueError(f"slot_mapping[{i}] and slot_mapping[{j}] are both {value}: two tokens of the step would "
                         "be written to one cache slot (duplicate slots)")


def _explain_slot_mismatch(common: CommonAttentionMetadata, block_size: int, table: np.ndarray, given: np.ndarray,
                           req: np.ndarray, pos: np.ndarray) -> None:
    """The slow path of :func:`check_slots_match_block_table`: raise the error that names what is wrong, or return
    where the only differences are slots of -1 (tokens not written) and no slot repeats."""
    seq, qsl, n = common.seq_lens_cpu.numpy(), common.query_start_loc_cpu.numpy(), common.num_reqs
    qlens = qsl[1 : n + 1] - qsl[:n]
    if common.max_query_len == 1 and qlens.max(initial=0) > 1:
        i = int(np.argmax(qlens > 1))
        raise ValueError(f"max_query_len is 1 but request {i} has query_len {int(qlens[i])} (query_start_loc)")
    short = np.flatnonzero(seq[:n] < qlens)
    if short.size:
        i = int(short[0])
        raise ValueError(f"seq_lens[{i}] ({int(seq[i])}) < query_len ({int(qlens[i])}) of request {i}")
    col = pos // block_size
    wide = np.flatnonzero(col >= table.shape[1])
    if wide.size:
        i = int(req[wide[0]])
        raise ValueError(f"block_table row {i} has {table.shape[1]} entries, seq_len {int(seq[i])} needs "
                         f"{-(-int(seq[i]) // block_size)} (block_size {block_size})")
    pages = table[req, col].astype(np.int64)
    expected = pages * block_size + pos % block_size
    wrong = np.flatnonzero((given != expected) & (given != -1))
    if wrong.size:
        k = int(wrong[0])
        i = int(req[k])
        if pages[k] < 0:
            raise ValueError(f"block_table[{i}, {int(col[k])}] = {int(pages[k])}: page ids must be >= 0")
        raise ValueError(
            f"slot_mapping[{k}] = {int(given[k])} disagrees with the block table: token {k} (request {i}, "
            f"position {int(pos[k])}) belongs in page block_table[{i}, {int(col[k])}] = {int(pages[k])} "
            f"at offset {int(pos[k] % block_size)}, slot {int(expected[k])} (block_size {block_size})")
    _check_no_repeated_slot(given, np.sort(given[given >= 0]))


_ARANGE = np.arange(0)


def _arange(n: int) -> np.ndarray:
    """np.arange(n) (int64) from a cached array: the per-step checks avoid allocating it each time."""
    global _ARANGE
    if n > _ARANGE.shape[0]:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
    return _ARANGE[:n]


def validate_common_metadata(common: CommonAttentionMetadata, num_blocks: Optional[int] = None, block_size: Optional[int] = None) -> None:
    """Check a batch's metadata for consistency (debug mode; reads the CPU copies and the block table).

    Raises ValueError naming the tensor and the first bad index.
    """
    qsl = common.query_start_loc_cpu
    if qsl.shape != (common.num_reqs + 1,):
        raise ValueError(f"query_start_loc has shape {tuple(qsl.shape)}, expected ({common.num_reqs + 1},)")
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    steps = qsl[1:] - qsl[:-1]
    bad = torch.nonzero(steps < 0)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"query_start_loc is not monotonic at index {i + 1}: {int(qsl[i])} -> {int(qsl[i + 1])}")
    if int(qsl[-1]) != common.num_actual_tokens:
        raise ValueError(f"query_start_loc[-1] ({int(qsl[-1])}) != num_actual_tokens ({common.num_actual_tokens})")
    if common.seq_lens_cpu.shape != (common.num_reqs,):
        raise ValueError(f"seq_lens has shape {tuple(common.seq_lens_cpu.shape)}, expected ({common.num_reqs},)")
    for name, rows in (("query_start_loc", common.num_reqs + 1), ("seq_lens", common.num_reqs)):
        dev, host = getattr(common, name), getattr(common, name + "_cpu")
        if dev is not host:
            differ = torch.nonzero(dev[:rows].cpu() != host[:rows])
            if differ.numel():
                i = int(differ[0])
                raise ValueError(f"{name}[{i}] (device) is {int(dev[i])} but its host copy {name}_cpu[{i}] is "
                                 f"{int(host[i])}: the two must hold the same values (one rewritten in place?)")
    short = torch.nonzero(common.seq_lens_cpu < steps)
    if common.causal and short.numel():  # a non-causal (cross-attention) query may see fewer keys than queries
        i = int(short[0])
        raise ValueError(f"seq_lens[{i}] ({int(common.seq_lens_cpu[i])}) < query_len ({int(steps[i])}) of request {i}")
    if common.slot_mapping.shape[0] < common.num_actual_tokens:
        raise ValueError(
            f"slot_mapping has {common.slot_mapping.shape[0]} entries, fewer than num_actual_tokens ({common.num_actual_tokens})"
        )
    if block_size is not None and common.num_reqs:
        pages = (common.seq_lens_cpu + block_size - 1) // block_size
        width = common.block_table.shape[1]
        over = torch.nonzero(pages > width)
        if over.numel():
            i = int(over[0])
            raise ValueError(f"block_table row {i} has {width} entries, seq_len {int(common.seq_lens_cpu[i])} needs {int(pages[i])}")
        if num_blocks is not None:
            table = common.block_table.cpu()
            used = torch.arange(width)[None, :] < pages[:, None]
            out = torch.nonzero(used & ((table < 0) | (table >= num_blocks)))
            if out.numel():
                i, j = (int(v) for v in out[0])
                raise ValueError(f"block_table[{i}, {j}] = {int(table[i, j])} is outside [0, {num_blocks})")
        if common.block_table_cpu is not None:
            needed = int(pages.max())
            host = common.block_table_cpu[: common.num_reqs, :needed]
            dev = common.block_table[: common.num_reqs, :needed].cpu()
            used = torch.arange(needed)[None, :] < pages[:, None]
            if host.shape != dev.shape or not torch.equal(host[used], dev[used]):
                raise ValueError("block_table_cpu does not hold the page ids of block_table (a stale host copy?)")
        if common.causal:
            check_slots_match_block_table(common, block_size, common.block_table.cpu().numpy(),
                                          common.slot_mapping.cpu().numpy())
