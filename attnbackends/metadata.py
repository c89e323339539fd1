"""Per-batch attention metadata shared by every backend, and the helpers that build and split it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

__all__ = [
    "CommonAttentionMetadata",
    "DecodePrefillSplit",
    "build_common_metadata",
    "build_cross_attention_metadata",
    "decode_first_order",
    "encoder_slot_mapping",
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
    pages_checked_for : int or None
        Set by the page-id guard: the cache size (pages) this batch's block table was range-checked against.
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
    pages_checked_for: Optional[int] = field(default=None, init=False, repr=False, compare=False)

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
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seq_lens = []
    slots: list[int] = []
    for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        if q < 1 or c < 0:
            raise ValueError(f"request {i}: query_len must be >= 1 and context_len >= 0, got {q} and {c}")
        need = -(-(q + c) // block_size) if has_cache else 0
        if len(table) < need:
            raise ValueError(f"request {i}: block_tables[{i}] has {len(table)} pages, {q + c} tokens need {need}")
        seq_lens.append(q + c)
        for pos in range(c, c + q):
            slots.append(table[pos // block_size] * block_size + pos % block_size if has_cache else -1)
    return _assemble(query_lens, seq_lens, block_tables, slots, causal, num_padded_tokens, max_blocks_per_req, device)


def _assemble(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slots: list[int],
    causal: bool,
    num_padded_tokens: Optional[int],
    max_blocks_per_req: Optional[int],
    device: "torch.device | str",
) -> CommonAttentionMetadata:
    """The metadata tensors of checked per-request lists (slots: one per new token, padding appended here)."""
    num_reqs = len(query_lens)
    num_actual_tokens = len(slots)
    if num_padded_tokens is not None:
        if num_padded_tokens < num_actual_tokens:
            raise ValueError(f"num_padded_tokens ({num_padded_tokens}) < the batch's {num_actual_tokens} tokens")
        slots = slots + [-1] * (num_padded_tokens - num_actual_tokens)
    width = max((len(t) for t in block_tables), default=0)
    if max_blocks_per_req is not None:
        if max_blocks_per_req < width:
            raise ValueError(f"max_blocks_per_req ({max_blocks_per_req}) < the longest block table ({width})")
        width = max_blocks_per_req
    table = torch.zeros((num_reqs, width), dtype=torch.int32)
    for i, t in enumerate(block_tables):
        table[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.int32)
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
        slot_mapping=torch.as_tensor(slots, dtype=torch.int64).to(device),
        num_reqs=num_reqs,
        num_actual_tokens=num_actual_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        causal=causal,
        block_table_cpu=table,
    )


def _check_encoder_tables(encoder_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int) -> None:
    if len(block_tables) != len(encoder_lens):
        raise ValueError(f"encoder_lens and block_tables must have one entry per request; got {len(encoder_lens)} "
                         f"and {len(block_tables)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for i, (s, table) in enumerate(zip(encoder_lens, block_tables)):
        if s < 1:
            raise ValueError(f"request {i}: encoder_lens[{i}] must be >= 1, got {s}")
        need = -(-s // block_size)
        if len(table) < need:
            raise ValueError(f"request {i}: block_tables[{i}] has {len(table)} pages, {s} encoder tokens need {need}")


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
    if len(query_lens) != len(encoder_lens):
        raise ValueError(f"query_lens and encoder_lens must have one entry per request; got {len(query_lens)} and "
                         f"{len(encoder_lens)}")
    _check_encoder_tables(encoder_lens, block_tables, block_size)
    for i, q in enumerate(query_lens):
        if q < 1:
            raise ValueError(f"request {i}: query_len must be >= 1, got {q}")
    slots = [-1] * sum(query_lens)
    return _assemble(query_lens, list(encoder_lens), block_tables, slots, False, num_padded_tokens,
                     max_blocks_per_req, device)


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
    _check_encoder_tables(encoder_lens, block_tables, block_size)
    slots = [table[j // block_size] * block_size + j % block_size
             for s, table in zip(encoder_lens, block_tables) for j in range(s)]
    return torch.as_tensor(slots, dtype=torch.int64).to(device)


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
