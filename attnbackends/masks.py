"""Per-batch mask data (bidirectional spans, custom masks) and the exact definition of every mask kind.

A layer's mask is part of its spec (:class:`attnbackends.spec.AttentionMask`); what varies per request comes with
the batch as :class:`BatchMasks` in ``CommonAttentionMetadata.masks``:

- **Bidirectional spans** (kind ``causal_spans``): per request, token ranges ``[start, end)`` in absolute positions
  (an image's tokens), sorted and disjoint. A query at position p inside a span sees every key of its span that the
  sequence holds (j < seq_len), besides the causal keys j <= p. A span may start in the cached context and may end
  past this step's last token (a chunk that splits an image): its queries then see the span's keys up to
  seq_len, so a chunk that ends inside a span does not give the unchunked answer for that span's queries (engines
  end chunks at span boundaries, as vLLM does for multimodal items). The kernels read one int per query token,
  ``span_key_end``: the exclusive end of the keys the token sees (max(p + 1, its span's end), at most seq_len).
- **Custom masks** (kind ``custom``): per request a [query_len, seq_len] bool mask, row-major, packed to bits
  little-endian per request (FlashInfer's ``packed_custom_mask`` with its byte ``mask_indptr``).

:func:`dense_visibility` is the definition every backend follows (the reference backend applies it).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .spec import AttentionSpec, MaskKind

__all__ = [
    "BatchMasks",
    "check_masks_for_spec",
    "custom_mask_of",
    "dense_visibility",
    "pack_custom_masks",
    "span_key_end",
    "unpack_custom_masks",
    "with_custom_masks",
    "with_spans",
]

Span = tuple[int, int]


@dataclass(frozen=True)
class BatchMasks:
    """The per-request mask data of one batch (see the module docstring).

    Attributes
    ----------
    spans : per request, its bidirectional spans ((start, end), ...) in absolute positions, sorted and disjoint;
        () for none. Empty tuple: the batch has no spans.
    span_key_end, span_key_end_cpu : [num_tokens] int32 on the device and on the host, or None without spans:
        per query token, the exclusive end of the keys it sees under the causal-plus-spans mask.
    custom_mask : [sum_i ceil(Q_i * L_i / 8)] uint8 on the device, or None: request i's [Q_i, L_i] mask, row-major,
        bits little-endian, from byte ``custom_mask_indptr[i]``.
    custom_mask_indptr, custom_mask_indptr_cpu : [num_reqs + 1] int32 byte offsets on the device and on the host.
    """

    spans: tuple[tuple[Span, ...], ...] = ()
    span_key_end: Optional[torch.Tensor] = None
    span_key_end_cpu: Optional[torch.Tensor] = None
    custom_mask: Optional[torch.Tensor] = None
    custom_mask_indptr: Optional[torch.Tensor] = None
    custom_mask_indptr_cpu: Optional[torch.Tensor] = None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return int(value)


def check_spans(spans_per_req: Sequence[Optional[Sequence[Sequence[int]]]], num_reqs: int) -> tuple:
    """The spans as a tuple of tuples, checked: one entry per request (None or [] for none); each span two ints
    0 <= start < end; a request's spans sorted and disjoint. ValueError naming the request and the span otherwise."""
    if len(spans_per_req) != num_reqs:
        raise ValueError(f"spans has {len(spans_per_req)} entries, the batch has {num_reqs} requests: give one per "
                         "request (None or [] for a request without spans)")
    result = []
    for i, spans in enumerate(spans_per_req):
        checked: list[Span] = []
        for k, span in enumerate(spans or ()):
            if len(span) != 2:
                raise ValueError(f"spans[{i}][{k}] = {span!r}: a span is (start, end)")
            start, end = _int(span[0], f"spans[{i}][{k}] start"), _int(span[1], f"spans[{i}][{k}] end")
            if start < 0 or end <= start:
                raise ValueError(f"spans[{i}][{k}] = ({start}, {end}) is out of range: a span needs "
                                 "0 <= start < end (absolute positions, end exclusive)")
            if checked and start < checked[-1][1]:
                raise ValueError(f"spans[{i}][{k}] = ({start}, {end}) overlaps or precedes spans[{i}][{k - 1}] = "
                                 f"{checked[-1]}: a request's spans must be sorted and disjoint")
            checked.append((start, end))
        result.append(tuple(checked))
    return tuple(result)


def span_key_end(spans: Sequence[Sequence[Span]], query_lens: Sequence[int], seq_lens: Sequence[int]) -> np.ndarray:
    """[sum query_lens] int32: per query token (request i's token t at position p = seq_len - query_len + t), the
    exclusive end of its visible keys under causal plus spans: min(max(p + 1, end of the span holding p), seq_len)."""
    out = []
    for spans, q, seq_len in zip(spans, query_lens, seq_lens):
        pos = np.arange(seq_len - q, seq_len, dtype=np.int64)
        end = pos + 1
        for start, stop in spans:
            inside = (pos >= start) & (pos < stop)
            end = np.where(inside, np.maximum(end, stop), end)
        out.append(np.minimum(end, seq_len))
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


def with_spans(common: Any, spans_per_req: Sequence[Optional[Sequence[Sequence[int]]]]) -> Any:
    """``common`` (a CommonAttentionMetadata) with the bidirectional spans of its requests (see the module
    docstring; one entry per request, None or [] for none). Checks them; builds ``span_key_end`` on the host and
    copies it to ``common``'s device once."""
    spans = check_spans(spans_per_req, common.num_reqs)
    key_end = span_key_end(spans, common.query_lens_cpu.tolist(), common.seq_lens_cpu.tolist())
    host = torch.from_numpy(key_end)
    previous = common.masks or BatchMasks()
    masks = dataclasses.replace(previous, spans=spans, span_key_end=host.to(common.device),
                                span_key_end_cpu=host)
    return dataclasses.replace(common, masks=masks)


def pack_custom_masks(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [sum ceil(n_i / 8)] uint8, byte indptr [len + 1] int32) of bool masks, each flattened row-major and
    packed little-endian (bit b of byte k is entry 8k + b), as FlashInfer's ``segment_packbits``."""
    chunks, indptr = [], [0]
    for m in masks:
        bits = np.packbits(m.detach().to("cpu", torch.bool).numpy().reshape(-1), bitorder="little")
        chunks.append(bits)
        indptr.append(indptr[-1] + bits.size)
    packed = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return torch.from_numpy(packed.astype(np.uint8)), torch.tensor(indptr, dtype=torch.int32)


def with_custom_masks(common: Any, masks: Sequence[torch.Tensor]) -> Any:
    """``common`` with a custom mask per request: ``masks[i]`` [query_len_i, seq_len_i] bool (True: visible), for
    kind ``custom`` layers. Checks the shapes, packs the bits and copies them to ``common``'s device once."""
    if len(masks) != common.num_reqs:
        raise ValueError(f"custom masks: {len(masks)} given, the batch has {common.num_reqs} requests (one each)")
    q_lens, seq_lens = common.query_lens_cpu.tolist(), common.seq_lens_cpu.tolist()
    for i, m in enumerate(masks):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (q_lens[i], seq_lens[i]):
            got = f"{tuple(m.shape)} {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"custom mask {i} must be a [query_len, seq_len] = [{q_lens[i]}, {seq_lens[i]}] bool "
                             f"tensor, got {got}")
    packed, indptr = pack_custom_masks(masks)
    previous = common.masks or BatchMasks()
    batch = dataclasses.replace(previous, custom_mask=packed.to(common.device),
                                custom_mask_indptr=indptr.to(common.device), custom_mask_indptr_cpu=indptr)
    return dataclasses.replace(common, masks=batch)


def custom_mask_of(masks: BatchMasks, i: int, query_len: int, seq_len: int) -> torch.Tensor:
    """Request ``i``'s custom mask, unpacked: [query_len, seq_len] bool on the CPU."""
    lo, hi = (int(v) for v in masks.custom_mask_indptr_cpu[i : i + 2])
    packed = masks.custom_mask[lo:hi].cpu().numpy()
    bits = np.unpackbits(packed, bitorder="little")[: query_len * seq_len]
    return torch.from_numpy(bits.astype(bool)).reshape(query_len, seq_len)


def check_masks_for_spec(spec: AttentionSpec, common: Any) -> None:
    """ValueError unless the batch's mask data fits the layer's mask kind: spans only for ``causal_spans`` (where
    they are optional: none means causal), a custom mask for ``custom`` (required) and nothing else; the data sized
    for the batch."""
    masks: Optional[BatchMasks] = common.masks
    kind = spec.mask.kind
    has_spans = masks is not None and masks.span_key_end is not None
    has_custom = masks is not None and masks.custom_mask is not None
    if has_spans and kind is not MaskKind.CAUSAL_SPANS:
        raise ValueError(f"the batch carries bidirectional spans, but the layer's mask kind is {kind.value!r}: "
                         "declare the layer AttentionMask(kind='causal_spans')")
    if has_custom != (kind is MaskKind.CUSTOM):
        raise ValueError(f"the layer's mask kind is {kind.value!r} and the batch "
                         f"{'carries' if has_custom else 'has no'} custom mask: a custom mask goes with kind 'custom' "
                         "(attnbackends.masks.with_custom_masks)")
    if has_spans:
        if len(masks.spans) != common.num_reqs or masks.span_key_end_cpu.shape[0] != common.num_actual_tokens:
            raise ValueError(f"the batch's spans were made for {len(masks.spans)} requests and "
                             f"{masks.span_key_end_cpu.shape[0]} tokens; the batch has {common.num_reqs} and "
                             f"{common.num_actual_tokens}: make them with attnbackends.masks.with_spans")
    if has_custom:
        indptr = masks.custom_mask_indptr_cpu
        q_lens, seq_lens = common.query_lens_cpu, common.seq_lens_cpu
        need = (q_lens.long() * seq_lens.long() + 7) // 8
        if indptr.shape[0] != common.num_reqs + 1 or not torch.equal(indptr[1:].long() - indptr[:-1].long(), need):
            raise ValueError("the batch's custom mask does not hold ceil(query_len * seq_len / 8) bytes per request: "
                             "make it with attnbackends.masks.with_custom_masks")


def dense_visibility(spec: AttentionSpec, query_positions: torch.Tensor, seq_len: int, *,
                     spans: Sequence[Span] = (), custom: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The definition of the layer's mask for one request: [Q, seq_len] bool, True where the query at
    ``query_positions[q]`` ([Q] int) sees key j. ``spans``: the request's spans (kind ``causal_spans``);
    ``custom``: its [Q, seq_len] mask (kind ``custom``). Encoder layers see every key."""
    pos = query_positions.to("cpu", torch.int64)[:, None]  # [Q, 1]
    j = torch.arange(seq_len, dtype=torch.int64)[None, :]  # [1, L]
    kind = spec.mask.kind
    if not spec.attn_type.is_causal or kind is MaskKind.NON_CAUSAL:
        visible = torch.ones(pos.shape[0], seq_len, dtype=torch.bool)
    elif kind is MaskKind.CAUSAL:
        visible = j <= pos
    elif kind is MaskKind.BLOCK_CAUSAL:
        visible = (j // spec.mask.block_len) <= (pos // spec.mask.block_len)
    elif kind is MaskKind.CAUSAL_SPANS:
        visible = j <= pos
        for start, end in spans:
            inside_q = (pos >= start) & (pos < end)
            inside_k = (j >= start) & (j < end)
            visible = visible | (inside_q & inside_k)
    else:
        if custom is None:
            raise ValueError("a custom-mask layer needs the request's custom mask")
        visible = custom.to("cpu", torch.bool).clone()
    window = spec.window
    if window is not None:
        visible = visible & (j >= pos - window[0]) & (j <= pos + window[1])
    return visible.expand(pos.shape[0], seq_len).clone()


def unpack_custom_masks(common: Any, first: int = 0, last: Optional[int] = None) -> torch.Tensor:
    """The custom masks of requests ``first..last-1`` unpacked on the device: [sum_i Q_i * L_i] bool, request i's
    [Q_i, L_i] row-major (FlashInfer's ``custom_mask`` layout). Sizes from the host copies; no host-device sync."""
    masks: BatchMasks = common.masks
    last = common.num_reqs if last is None else last
    q_lens = common.query_lens_cpu[first:last].long()
    sizes = q_lens * common.seq_lens_cpu[first:last].long()
    total = int(sizes.sum())
    device = masks.custom_mask.device
    byte_start = masks.custom_mask_indptr_cpu[first:last].long()
    offsets = torch.cumsum(sizes, 0) - sizes
    req = torch.repeat_interleave(torch.arange(last - first), sizes, output_size=total).to(device)
    within = torch.arange(total, device=device) - offsets.to(device)[req]
    bit = byte_start.to(device)[req] * 8 + within
    byte = masks.custom_mask[bit // 8].to(torch.int32)
    return ((byte >> (bit % 8).to(torch.int32)) & 1).bool()
