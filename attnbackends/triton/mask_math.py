"""The layer mask kinds on the unified kernel, as ``@triton.jit`` helpers: every kind it serves leaves each query
row one interval of visible keys [lo, hi), so a tile is skipped, run unmasked or masked from the rows' bounds alone.

Per row at position p of a sequence of ``seq_len`` keys (the kinds: :class:`attnbackends.spec.MaskKind`):

- non-causal: [0, seq_len);
- block-causal with blocks of ``mask_block``: [0, (p // b + 1) * b);
- causal plus spans: [0, span_key_end) with ``span_key_end`` read per token (max(p + 1, the end of p's span),
  :attr:`attnbackends.masks.BatchMasks.span_key_end`);
- custom: [0, seq_len), every tile masked by the request's packed bits (:func:`custom_visible`);
- a window (left, right) intersects that with [p - left, p + right + 1) (a side < 0: unbounded);
- hi is at most seq_len.
"""

import triton
import triton.language as tl

__all__ = ["MASK_NONE", "MASK_NON_CAUSAL", "MASK_BLOCK_CAUSAL", "MASK_SPANS", "MASK_CUSTOM", "custom_visible",
           "interval_visible", "row_key_bounds", "tile_bounds"]

#: ``MASK_KIND`` constexpr values: none (the kernel's causal / sliding-window path), the interval kinds, and custom
#: bit masks (an interval of the whole sequence, window-clipped, whose tiles all read the bits).
MASK_NONE = 0
MASK_NON_CAUSAL = 1
MASK_BLOCK_CAUSAL = 2
MASK_SPANS = 3
MASK_CUSTOM = 4

_BIG = tl.constexpr(2147483647)


@triton.jit
def row_key_bounds(pos, row_ok, token, seq_len, key_end_ptr, mask_block, window_left, window_right,
                   MASK_KIND: tl.constexpr):
    """(lo, hi) [M] int32: the visible keys [lo, hi) of each row (``pos`` [M] positions, ``token`` [M] the rows'
    token indices in the batch, for the spans' per-token ends; rows not ``row_ok`` get an empty range)."""
    if MASK_KIND == 2:
        hi = (pos // mask_block + 1) * mask_block
    elif MASK_KIND == 3:
        hi = tl.load(key_end_ptr + token, mask=row_ok, other=0)
    else:
        hi = tl.zeros_like(pos) + seq_len
    hi = tl.minimum(hi, seq_len)
    lo = tl.where(window_left >= 0, tl.maximum(pos - window_left, 0), 0)
    hi = tl.where(window_right >= 0, tl.minimum(hi, pos + window_right + 1), hi)
    hi = tl.where(row_ok, hi, 0)
    lo = tl.where(row_ok, lo, 0)
    return lo, hi


@triton.jit
def tile_bounds(lo, hi, row_ok, TILE_N: tl.constexpr):
    """(kv_lo, kv_end, full_lo, full_hi): the keys some row sees [kv_lo, kv_end) and the tiles [full_lo, full_hi)
    every row sees whole (run unmasked)."""
    kv_lo = tl.min(tl.where(row_ok, lo, _BIG), 0)
    kv_end = tl.max(tl.where(row_ok, hi, 0), 0)
    full_lo = (tl.max(tl.where(row_ok, lo, 0), 0) + TILE_N - 1) // TILE_N
    full_hi = tl.min(tl.where(row_ok, hi, _BIG), 0) // TILE_N
    return kv_lo, kv_end, full_lo, full_hi


@triton.jit
def interval_visible(offs_n, lo, hi):
    """[M, N] bool: key ``offs_n`` [N] in row r's [lo[r], hi[r])."""
    return (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])


@triton.jit
def custom_visible(vis, offs_n, pos, ctx, seq_len, bits_ptr):
    """``vis`` [M, N] bool (rows at positions ``pos`` [M] of a request with ``ctx`` cached keys and ``seq_len`` keys,
    keys ``offs_n`` [N]) and the request's custom mask: ``bits_ptr`` (uint8) points at its packed [query_len,
    seq_len] bits, row-major, little-endian in each byte (:func:`attnbackends.masks.pack_custom_masks`). Only the
    entries ``vis`` leaves are read."""
    bit = (pos - ctx).to(tl.int64)[:, None] * seq_len + offs_n[None, :]  # [M, N] bit index in the request's mask
    byte = tl.load(bits_ptr + (bit >> 3), mask=vis, other=0)
    return vis & (((byte.to(tl.int32) >> (bit & 7).to(tl.int32)) & 1) != 0)
