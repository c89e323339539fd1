"""Triton kernels for unified paged attention (decodes, prefills and chunked prefills in one launch).

Only ``@triton.jit`` code lives here; :mod:`attnbackends.triton.launch` validates arguments, picks tile
configurations and launches.

Tiling: a program owns one KV head and a tile of ``BLOCK_M`` rows = ``BLOCK_Q`` query tokens x the
``QPK`` query heads that share that KV head (GQA packing), so even a single decode token feeds the tensor
cores through ``tl.dot``. It walks the keys ``TILE_N`` at a time (several pages per iteration) with an online
softmax in the log2 domain. Tiles that no mask can touch run without masks; only the edge tiles (causal
diagonal, sliding-window start, the sequence's last partial tile) pay for them.

Split-KV: with ``NUM_SEGMENTS > 1`` the key range of each program is cut into segments (grid axis 2); each
writes its normalised partial output and log2-sum-exp to a workspace, and the segments are merged either by a
second launch (``_reduce_segments_kernel``, one program per query row) or, where every program of the launch is a
decode program (``FUSED_REDUCE``), in the same launch: each (decode, KV head, segment) program takes a ticket from
a per-(decode, KV head) counter after writing its partials, and the program that draws the last ticket merges the
segments of its request's rows and resets the counter to 0 (:func:`_merge_when_last`). The grid depends only on
shapes and host ints, never on ``seq_lens`` values (CUDA-graph safe).

Balanced decode schedule (``DECODE_SCHEDULED``, :mod:`.decode_schedule`): the builder cuts the decodes' keys into
work units of near-equal size and the decode programs run one unit each (grid (KV heads, units), so a long request
gets many programs and a short one one). A unit is a request, a tile-aligned key range, its index among its request's
units and their count; a request with one unit writes its output directly, the units of a split request write
partials at their index and the last to finish merges them (the same fused merge, with the request's own count).

Layer mask kinds (``MASK_KIND`` != 0: non-causal over the cache, block-causal, causal plus spans, two-sided
windows): each row sees one interval of keys, computed by :mod:`.mask_math`, which also bounds the tiles visited and
the unmasked ones. Custom masks (``MASK_KIND`` 4) run every tile in the rows' (window-clipped) interval masked by
the request's packed bits (:func:`_attn_custom_range`), skipping the tiles where none of the rows' bits is set
before their keys are loaded: the kernel's tree-mask pointers carry the bits (``tree_mask_ptr``: the batch's packed
bits, ``tree_indptr_ptr``: each request's first byte), as a custom-mask batch has no tree.
"""

import triton
import triton.language as tl

from ..ops.lse_merge import merge_by_lse
from ..ops.page_guard import safe_page
from ..ops.quant import load_kv_scales
from ..ops.tree_mask import tree_visible
from .mask_math import custom_visible, interval_visible, row_key_bounds, tile_bounds
from .kv_load import fold_v_scales, load_kv_tile, scale_scores

RCP_LN2 = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    # exp-based so that it also runs under TRITON_INTERPRET; saturates correctly at +-inf.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * RCP_LN2)) + 1.0)


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, j,
    key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head, kv_row_start,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, MASKED: tl.constexpr, USE_TREE: tl.constexpr, INTERPRET: tl.constexpr,
    MASK_KIND: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    offs_n = j * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
    n_ok = offs_n < kv_end
    if PAGED:
        if MASKED:
            blk = tl.load(block_table_ptr + seq_idx * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        else:
            blk = tl.load(block_table_ptr + seq_idx * stride_bt + offs_n // BLOCK_SIZE)
        blk = safe_page(blk, num_blocks)
        k_off = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks
        v_off = blk.to(tl.int64) * stride_vb + (offs_n % BLOCK_SIZE) * stride_vs
    else:
        blk = offs_n
        k_off = (kv_row_start + offs_n).to(tl.int64) * stride_ks
        v_off = (kv_row_start + offs_n).to(tl.int64) * stride_vs
    k, v, k_sc, v_sc = load_kv_tile(
        key_ptr, value_ptr, k_off, v_off, blk, offs_n % BLOCK_SIZE, kv_head, n_ok, offs_d, stride_kb, stride_ks,
        stride_kh, stride_vh, HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, MASKED, KV_FORMAT)
    if INTERPRET:
        # The interpreter's tl.dot on bfloat16 is wrong (numpy has no bfloat16): compute in float32 there.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        # fp8 cache: the per-tensor scales are folded into qk_scale and the final output instead.
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    s = scale_scores(tl.dot(q, k), k_sc, KV_FORMAT)  # [BLOCK_M, TILE_N] fp32
    if USE_SOFTCAP:
        s = soft_cap * _tanh(s * qk_scale / soft_cap) * RCP_LN2
    else:
        s = s * qk_scale
    if USE_ALIBI:
        s += slope[:, None] * (offs_n[None, :] - pos[:, None]).to(tl.float32)
    if MASKED:
        if MASK_KIND != 0:  # the layer's mask kind: each row's keys [row_lo, row_hi) (.mask_math)
            vis = interval_visible(offs_n, row_lo, row_hi)
            if MASK_KIND == 4:  # custom: the request's bits (tree_ptr, row length draft_len; draft_start = context)
                vis = custom_visible(vis, offs_n, pos, draft_start, draft_len, tree_ptr)
        elif CAUSAL:
            vis = offs_n[None, :] <= pos[:, None]
        else:  # every key of the sequence, also for queries past its length (cross-attention: more queries than keys)
            vis = n_ok[None, :]
        if SLIDING_WINDOW > 0:
            vis = vis & (offs_n[None, :] > pos[:, None] - SLIDING_WINDOW)
        if USE_TREE:
            vis = tree_visible(vis, offs_n, pos, draft_start, draft_len, tree_ptr)
        s = tl.where(vis, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(fold_v_scales(p, v_sc, KV_FORMAT).to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attn_range(
    acc, l_i, m_i, q, lo, hi,
    key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head, kv_row_start,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, MASKED: tl.constexpr, USE_TREE: tl.constexpr, INTERPRET: tl.constexpr,
    MASK_KIND: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """Tiles lo..hi-1. Compiled: a pipelined for-loop. Interpreted: a while-loop, because the interpreter
    (with numpy >= 2.3) cannot turn its 1-element scalar arrays into range() bounds."""
    if INTERPRET:
        j = lo
        while j < hi:
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, j, key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI,
                MASKED, USE_TREE, INTERPRET, MASK_KIND, KV_FORMAT)
            j += 1
    else:
        for j in range(lo, hi):
            acc, l_i, m_i = _attn_tile(
                acc, l_i, m_i, q, j, key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI,
                MASKED, USE_TREE, INTERPRET, MASK_KIND, KV_FORMAT)
    return acc, l_i, m_i


@triton.jit
def _attn_custom_range(
    acc, l_i, m_i, q, lo, hi,
    key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head, kv_row_start,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    pos, kv_end, qk_scale, soft_cap, slope, offs_d, bits_ptr, ctx, seq_len, row_lo, row_hi,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, INTERPRET: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """Tiles lo..hi-1 of a custom-mask request (``bits_ptr``: its packed bits; ``ctx``: its context length;
    ``seq_len``: its row length in bits), each masked; a tile none of whose rows' bits is set is skipped before its
    keys and values are loaded."""
    if INTERPRET:
        j = lo
        while j < hi:
            offs_n = j * TILE_N + tl.arange(0, TILE_N)
            vis = custom_visible(interval_visible(offs_n, row_lo, row_hi), offs_n, pos, ctx, seq_len, bits_ptr)
            if tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0:
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, j, key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head,
                    kv_row_start, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    pos, kv_end, qk_scale, soft_cap, slope, offs_d, bits_ptr, ctx, seq_len, row_lo, row_hi,
                    HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, False, 0, USE_SOFTCAP, USE_ALIBI,
                    True, False, INTERPRET, 4, KV_FORMAT)
            j += 1
    else:
        for j in range(lo, hi):
            offs_n = j * TILE_N + tl.arange(0, TILE_N)
            vis = custom_visible(interval_visible(offs_n, row_lo, row_hi), offs_n, pos, ctx, seq_len, bits_ptr)
            if tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0:
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, j, key_ptr, value_ptr, block_table_ptr, num_blocks, seq_idx, kv_head,
                    kv_row_start, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    pos, kv_end, qk_scale, soft_cap, slope, offs_d, bits_ptr, ctx, seq_len, row_lo, row_hi,
                    HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, False, 0, USE_SOFTCAP, USE_ALIBI,
                    True, False, INTERPRET, 4, KV_FORMAT)
    return acc, l_i, m_i


@triton.jit
def _attend(
    query_ptr, key_ptr, value_ptr, output_ptr, block_table_ptr, num_blocks, seq_lens_ptr, query_start_loc_ptr,
    alibi_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tree_mask_ptr, tree_indptr_ptr,
    key_end_ptr, mask_block, window_left, window_right,
    seq_idx, q_block, kv_head, segm, unit_lo, unit_hi, num_units,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
    q_scale, qk_scale, soft_cap, v_scale,
    QPK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, Q_FP16: tl.constexpr,
    RETURN_LSE: tl.constexpr, USE_TREE: tl.constexpr, INTERPRET: tl.constexpr, SCHEDULED: tl.constexpr,
    MASK_KIND: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    """One program's rows (query block ``q_block`` of ``seq_idx`` x the ``QPK`` query heads of ``kv_head``) over
    its keys: segment ``segm`` of ``NUM_SEGMENTS``, or with ``SCHEDULED`` the work unit ``segm`` of ``num_units``
    over keys ``[unit_lo, unit_hi)`` (multiples of ``TILE_N``; clipped to the keys the rows see). One segment or unit:
    the output rows; else the partials at index ``segm``."""
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        if PAGED:
            seq_len = tl.load(seq_lens_ptr + seq_idx)
        else:
            seq_len = q_len
        ctx = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        tok = q_block * BLOCK_Q + offs_m // QPK  # [BLOCK_M] token index inside the sequence
        head = kv_head * QPK + offs_m % QPK  # [BLOCK_M] query head
        row_ok = (offs_m < BLOCK_Q * QPK) & (tok < q_len)
        pos = ctx + tok
        q_ptrs = query_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
        if HEAD_PAD != HEAD_SIZE:
            q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_SIZE), other=0.0)
        else:
            q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_PAD]
        if Q_FP16:
            # fp8 cache: e4m3/e5m2 -> fp16 is one cvt per pair (-> bf16 is several), so the dots run in fp16.
            # The softmax scale is folded into q first: fp16 has bf16's range only up to 65504.
            q = (q.to(tl.float32) * q_scale).to(tl.float16)
        if INTERPRET:
            q = q.to(tl.float32)

        first_pos = ctx + q_block * BLOCK_Q
        last_pos = ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
        if CAUSAL:
            kv_end = last_pos + 1
            full_hi = (first_pos + 1) // TILE_N
        else:
            kv_end = seq_len
            full_hi = seq_len // TILE_N
        if USE_TREE:
            # The request's draft segment (its last draft_len tokens): only tiles reaching into it are masked.
            tree_lo = tl.load(tree_indptr_ptr + seq_idx)
            tree_size = tl.load(tree_indptr_ptr + seq_idx + 1) - tree_lo
            draft_len = (tl.sqrt(tree_size.to(tl.float32)) + 0.5).to(tl.int32)
            draft_start = seq_len - draft_len
            full_hi = tl.minimum(full_hi, draft_start // TILE_N)
            tree_ptr = tree_mask_ptr + tree_lo
        else:
            draft_len = 0
            draft_start = seq_len
            tree_ptr = tree_mask_ptr
        if SLIDING_WINDOW > 0:
            kv_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
            full_lo = _cdiv(tl.maximum(last_pos - SLIDING_WINDOW + 1, 0), TILE_N)
        else:
            kv_lo = 0
            full_lo = 0
        if MASK_KIND != 0:
            row_lo, row_hi = row_key_bounds(pos, row_ok, q_start + tok, seq_len, key_end_ptr, mask_block,
                                            window_left, window_right, MASK_KIND)
            kv_lo, kv_end, full_lo, mask_full_hi = tile_bounds(row_lo, row_hi, row_ok, TILE_N)
            full_hi = tl.minimum(full_hi, mask_full_hi)
            if MASK_KIND == 4:
                # Custom: every tile runs masked (_attn_custom_range). The tile arguments of the tree carry the
                # request's packed bits, its context (first row's position) and its row length in bits.
                tree_ptr = tree_mask_ptr + tl.load(tree_indptr_ptr + seq_idx)
                draft_start = ctx
                draft_len = seq_len
        else:
            row_lo = pos
            row_hi = pos
        tile_lo = kv_lo // TILE_N
        tile_hi = _cdiv(kv_end, TILE_N)
        if SCHEDULED:
            # The unit's tiles, within the ones the rows see (a request's first unit starts at key 0 and its last
            # ends past any sequence: they reach to the ends of that range, whatever lengths the host planned with).
            seg_lo = tl.minimum(tl.maximum(unit_lo // TILE_N, tile_lo), tile_hi)
            seg_hi = tl.minimum(tl.maximum(_cdiv(unit_hi, TILE_N), seg_lo), tile_hi)
        else:
            # This program's share of the tiles (all of them when NUM_SEGMENTS == 1).
            per_seg = _cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
            seg_lo = tl.minimum(tile_lo + segm * per_seg, tile_hi)
            seg_hi = tl.minimum(seg_lo + per_seg, tile_hi)
        mid_lo = tl.minimum(tl.maximum(full_lo, seg_lo), seg_hi)
        mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), seg_hi)

        if USE_SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * RCP_LN2
            m_i = tl.where(segm == 0, sink, float("-inf"))
            l_i = tl.where(segm == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        if USE_ALIBI:
            slope = tl.load(alibi_ptr + head).to(tl.float32) * RCP_LN2
        else:
            slope = tl.zeros([BLOCK_M], dtype=tl.float32)
        kv_row_start = q_start

        if MASK_KIND == 4:
            acc, l_i, m_i = _attn_custom_range(
                acc, l_i, m_i, q, seg_lo, seg_hi, key_ptr, value_ptr, block_table_ptr, num_blocks,
                seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, USE_SOFTCAP, USE_ALIBI, INTERPRET, KV_FORMAT)
        else:
            acc, l_i, m_i = _attn_range(
                acc, l_i, m_i, q, seg_lo, mid_lo, key_ptr, value_ptr, block_table_ptr, num_blocks,
                seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI,
                True, USE_TREE, INTERPRET, MASK_KIND, KV_FORMAT)
            acc, l_i, m_i = _attn_range(
                acc, l_i, m_i, q, mid_lo, mid_hi, key_ptr, value_ptr, block_table_ptr, num_blocks,
                seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI,
                False, USE_TREE, INTERPRET, MASK_KIND, KV_FORMAT)
            acc, l_i, m_i = _attn_range(
                acc, l_i, m_i, q, mid_hi, seg_hi, key_ptr, value_ptr, block_table_ptr, num_blocks,
                seq_idx, kv_head, kv_row_start,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                pos, kv_end, qk_scale, soft_cap, slope, offs_d, tree_ptr, draft_start, draft_len, row_lo, row_hi,
                HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI,
                True, USE_TREE, INTERPRET, MASK_KIND, KV_FORMAT)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc * (v_scale / l_safe)[:, None]
        d_ok = offs_d < HEAD_SIZE
        tok_glob = (q_start + tok).to(tl.int64)
        if SCHEDULED:
            if num_units == 1:  # an unsplit request: no partials, no merge
                _store_rows(output_ptr, lse_out_ptr, out, m_i, l_i, l_safe, tok_glob, head, row_ok, d_ok, offs_d,
                            stride_ot, stride_oh, stride_lse_h, RETURN_LSE)
            else:
                _store_partials(partial_out_ptr, partial_lse_ptr, out, m_i, l_i, l_safe, tok_glob, head, segm, row_ok,
                                d_ok, offs_d, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh)
        elif NUM_SEGMENTS == 1:
            _store_rows(output_ptr, lse_out_ptr, out, m_i, l_i, l_safe, tok_glob, head, row_ok, d_ok, offs_d,
                        stride_ot, stride_oh, stride_lse_h, RETURN_LSE)
        else:
            _store_partials(partial_out_ptr, partial_lse_ptr, out, m_i, l_i, l_safe, tok_glob, head, segm, row_ok,
                            d_ok, offs_d, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh)


@triton.jit
def _store_rows(output_ptr, lse_out_ptr, out, m_i, l_i, l_safe, tok_glob, head, row_ok, d_ok, offs_d,
                stride_ot, stride_oh, stride_lse_h, RETURN_LSE: tl.constexpr):
    """A program's finished rows: out [BLOCK_M, HEAD_PAD] float32 (normalised) into the output, and with RETURN_LSE
    their natural-log log-sum-exp (m_i, l_i: the log2-domain running max and sum)."""
    o_ptrs = output_ptr + tok_glob[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        # Natural log for callers (merge_attn_states); -inf where no key was visible (l_i == 0).
        lse_ln = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
        tl.store(lse_out_ptr + head * stride_lse_h + tok_glob, lse_ln, mask=row_ok)


@triton.jit
def _store_partials(partial_out_ptr, partial_lse_ptr, out, m_i, l_i, l_safe, tok_glob, head, segm, row_ok, d_ok,
                    offs_d, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh):
    """A program's rows as segment ``segm``'s partials: the normalised output and the log2-sum-exp (-inf: no keys)."""
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    p_ptrs = (partial_out_ptr + tok_glob[:, None] * stride_pt + head[:, None] * stride_ph
              + segm * stride_ps + offs_d[None, :])
    tl.store(p_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(partial_lse_ptr + tok_glob * stride_lt + head * stride_lh + segm, lse, mask=row_ok)


@triton.jit
def _merge_rows(
    output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tok, head, row_ok,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, num_segments, SEG_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Merge the ``num_segments`` (output, log2-sum-exp) partials of a block of query rows and write the rows.

    tok [R] int64: the rows' tokens (batch index); head [R] int32: their query heads; row_ok [R]: rows to write.
    num_segments (<= SEG_PAD): the launch's split (a constexpr), or a scheduled request's unit count.
    The partials are read through L2 (``.cg``): in a fused launch other programs wrote them, and this SM's L1 may
    hold stale lines of them."""
    offs_s = tl.arange(0, SEG_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_segments
    d_ok = offs_d < HEAD_SIZE
    lse_ptrs = partial_lse_ptr + (tok * stride_lt + head * stride_lh)[:, None] + offs_s[None, :]
    lse = tl.load(lse_ptrs, mask=row_ok[:, None] & s_ok[None, :], other=float("-inf"),
                  cache_modifier=".cg")  # [R, SEG_PAD]
    p_ptrs = (partial_out_ptr + (tok * stride_pt + head * stride_ph)[:, None, None]
              + offs_s[None, :, None] * stride_ps + offs_d[None, None, :])
    parts = tl.load(p_ptrs, mask=row_ok[:, None, None] & s_ok[None, :, None] & d_ok[None, None, :], other=0.0,
                    cache_modifier=".cg")  # [R, SEG_PAD, HEAD_PAD]
    out, lse2 = merge_by_lse(parts, lse, True)  # [R, HEAD_PAD], [R]
    o_ptrs = output_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(output_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if RETURN_LSE:
        tl.store(lse_out_ptr + head * stride_lse_h + tok, lse2 * LN2, mask=row_ok)


@triton.jit
def _merge_when_last(
    counter_ptr, output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, query_start_loc_ptr, seq_idx, kv_head,
    num_kv_heads, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
    QPK: tl.constexpr, DECODE_Q: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    num_segments, SEG_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr, RETURN_LSE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The fused split-KV reduction of decode ``seq_idx`` and ``kv_head`` (``num_segments`` segments: the launch's
    constexpr split, or a scheduled request's unit count), run by each of its segment programs
    after its partials are written (whatever it computed or skipped): take a ticket from the counter
    ``counter_ptr[seq_idx * num_kv_heads + kv_head]`` (int32, 0 before the launch); the program that draws the last
    merges the request's query tokens x the KV head's ``QPK`` query heads, ``MERGE_ROWS`` rows at a time, and
    sets the counter back to 0."""
    # Every warp's partial stores precede the ticket; the ticket's release publishes them at GPU scope.
    tl.debug_barrier()
    counter = counter_ptr + seq_idx * num_kv_heads + kv_head
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == num_segments - 1:
        # Every segment has its ticket: nothing else touches the counter in this launch.
        tl.store(counter, 0)
        q_start = tl.load(query_start_loc_ptr + seq_idx)
        q_len = tl.minimum(tl.load(query_start_loc_ptr + seq_idx + 1) - q_start, DECODE_Q)
        num_rows = q_len * QPK  # rows r = token (r // QPK) x query head (r % QPK), as the decode tile's
        offs_r = tl.arange(0, MERGE_ROWS)
        if INTERPRET:  # the interpreter cannot use its 1-element scalar arrays as range() bounds
            r0 = 0
            while r0 < num_rows:
                r = r0 + offs_r
                _merge_rows(output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr,
                            (q_start + r // QPK).to(tl.int64), kv_head * QPK + r % QPK, r < num_rows,
                            stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                            stride_lse_h, HEAD_SIZE, HEAD_PAD, num_segments, SEG_PAD, RETURN_LSE)
                r0 += MERGE_ROWS
        else:
            for r0 in range(0, num_rows, MERGE_ROWS):
                r = r0 + offs_r
                _merge_rows(output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr,
                            (q_start + r // QPK).to(tl.int64), kv_head * QPK + r % QPK, r < num_rows,
                            stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                            stride_lse_h, HEAD_SIZE, HEAD_PAD, num_segments, SEG_PAD, RETURN_LSE)


# Values that change from batch to batch, and pointers whose alignment no load depends on, are not specialised:
# one compiled kernel per layout then serves every batch and can be launched directly (ops.launch.DirectLauncher).
@triton.jit(
    do_not_specialize=["num_blocks", "num_seqs", "num_decodes", "num_decode_programs", "stride_qt", "stride_qh",
                       "stride_ot", "stride_oh", "stride_bt", "stride_pt", "stride_ph", "stride_ps", "stride_lt",
                       "stride_lh", "stride_lse_h", "mask_block", "window_left", "window_right"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "alibi_ptr",
                                    "sinks_ptr", "partial_lse_ptr", "lse_out_ptr", "counter_ptr", "k_scale",
                                    "v_scale", "tree_mask_ptr", "tree_indptr_ptr", "schedule_ptr", "key_end_ptr"],
)
def _unified_attention_kernel(
    query_ptr, key_ptr, value_ptr, output_ptr, block_table_ptr, num_blocks, seq_lens_ptr, query_start_loc_ptr,
    alibi_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, counter_ptr, k_scale, v_scale,
    tree_mask_ptr, tree_indptr_ptr, schedule_ptr, key_end_ptr,
    num_seqs, num_decodes, num_decode_programs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
    softmax_scale, soft_cap, mask_block, window_left, window_right,
    QPK: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DECODE_PATH: tl.constexpr, DECODE_BLOCK_M: tl.constexpr, DECODE_TILE_N: tl.constexpr,
    GENERIC_PATH: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_SINKS: tl.constexpr, SCALES_ARE_PTRS: tl.constexpr, KV_FP8: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, RETURN_LSE: tl.constexpr, INTERPRET: tl.constexpr,
    DECODE_Q: tl.constexpr, USE_TREE: tl.constexpr, FUSED_REDUCE: tl.constexpr, SEG_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr, DECODE_SCHEDULED: tl.constexpr, MASK_KIND: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """Grid: (num_decode_programs + [num_tokens // BLOCK_Q + num_seqs - num_decodes if GENERIC_PATH], num_kv_heads,
    NUM_SEGMENTS). Programs below num_decode_programs (= num_decodes) take one decode sequence each (query_len <=
    DECODE_Q: all its tokens in one tile, so the sequence's keys are read once); the others map to (sequence, query
    block) by a binary search over query_start_loc. USE_TREE: requests' draft segments follow the packed tree mask
    (``CommonAttentionMetadata.spec_tree_mask``); with ``MASK_KIND`` 4 the same two pointers hold the batch's custom mask
(packed bits, uint8, and each request's first byte, int32). FUSED_REDUCE (decode programs only, NUM_SEGMENTS > 1): the
    segments are merged in this launch (:func:`_merge_when_last`, ``counter_ptr``: [>= num_decodes *
    num_kv_heads] int32 zeros); else with NUM_SEGMENTS > 1 ``_reduce_segments_kernel`` merges them.

    DECODE_SCHEDULED (NUM_SEGMENTS == 1; grid (num_kv_heads, programs, 1)): decode program ``pid <
    num_decode_programs`` runs work unit ``pid`` of ``schedule_ptr`` ([>= num_decode_programs, 4] int32: request,
    key start, key end, index | count << 16; count 0: no unit), and the units of a request with several merge in
    this launch through ``counter_ptr`` as above."""
    if DECODE_SCHEDULED:
        # Grid (num_kv_heads, programs): a unit's KV heads start together, and the units in the schedule's order
        # (largest first), so the long requests' units start first and the short ones fill the tail.
        pid = tl.program_id(1)
        kv_head = tl.program_id(0)
        num_kv_heads = tl.num_programs(0)
    else:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    segm = tl.program_id(2)

    if KV_FP8:
        ks, vs = load_kv_scales(k_scale, v_scale, SCALES_ARE_PTRS)
    else:
        ks = 1.0
        vs = 1.0
    if KV_FP8:
        q_scale = softmax_scale
        qk_scale = ks
    else:
        q_scale = 1.0
        qk_scale = softmax_scale
    if not USE_SOFTCAP:
        qk_scale = qk_scale * RCP_LN2

    if DECODE_PATH and DECODE_SCHEDULED:
        if pid < num_decode_programs:
            unit = schedule_ptr + pid * 4
            meta = tl.load(unit + 3)
            num_units = meta >> 16
            if num_units > 0:  # rows past the schedule's units (a CUDA graph's fixed grid) have none
                seq_idx = tl.load(unit)
                _attend(
                    query_ptr, key_ptr, value_ptr, output_ptr, block_table_ptr, num_blocks,
                    seq_lens_ptr, query_start_loc_ptr,
                    alibi_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tree_mask_ptr,
                    tree_indptr_ptr, key_end_ptr, mask_block, window_left, window_right,
                    seq_idx, 0, kv_head, meta & 0xFFFF, tl.load(unit + 1), tl.load(unit + 2), num_units,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
                    q_scale, qk_scale, soft_cap, vs,
                    QPK, DECODE_Q, DECODE_BLOCK_M, DECODE_TILE_N, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                    PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI, USE_SINKS, 1, KV_FP8, RETURN_LSE,
                    USE_TREE, INTERPRET, True, MASK_KIND, KV_FORMAT)
                if num_units > 1:
                    # Every unit of a split request takes its ticket, also where it had no tokens or keys.
                    _merge_when_last(
                        counter_ptr, output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, query_start_loc_ptr,
                        seq_idx, kv_head, num_kv_heads, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
                        stride_lt, stride_lh, stride_lse_h, QPK, DECODE_Q, HEAD_SIZE, HEAD_PAD, num_units, SEG_PAD,
                        MERGE_ROWS, RETURN_LSE, INTERPRET)
    elif DECODE_PATH:
        if pid < num_decodes:
            _attend(
                query_ptr, key_ptr, value_ptr, output_ptr, block_table_ptr, num_blocks,
                seq_lens_ptr, query_start_loc_ptr,
                alibi_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tree_mask_ptr, tree_indptr_ptr,
                key_end_ptr, mask_block, window_left, window_right,
                pid, 0, kv_head, segm, 0, 0, 1,
                stride_qt, stride_qh, stride_ot, stride_oh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
                q_scale, qk_scale, soft_cap, vs,
                QPK, DECODE_Q, DECODE_BLOCK_M, DECODE_TILE_N, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI, USE_SINKS, NUM_SEGMENTS, KV_FP8, RETURN_LSE,
                USE_TREE, INTERPRET, False, MASK_KIND, KV_FORMAT)
        if FUSED_REDUCE:
            # Outside every condition: each segment program takes its ticket, also where it had no tokens or keys.
            _merge_when_last(
                counter_ptr, output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, query_start_loc_ptr, pid,
                kv_head, num_kv_heads, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                stride_lse_h, QPK, DECODE_Q, HEAD_SIZE, HEAD_PAD, NUM_SEGMENTS, SEG_PAD, MERGE_ROWS, RETURN_LSE,
                INTERPRET)
    if GENERIC_PATH:
        if pid >= num_decode_programs:
            # Sequence i >= num_decodes owns query blocks starting at (qsl[i] - qsl[nd]) // BLOCK_Q + (i - nd):
            # an upper bound on its block count, so the grid needs only num_tokens and num_seqs.
            target = pid - num_decode_programs
            base = tl.load(query_start_loc_ptr + num_decodes)
            lo = num_decodes
            hi = num_seqs
            while lo < hi:
                mid = (lo + hi) // 2
                start = (tl.load(query_start_loc_ptr + mid) - base) // BLOCK_Q + mid - num_decodes
                if start <= target:
                    lo = mid + 1
                else:
                    hi = mid
            seq_idx = lo - 1
            q_start = tl.load(query_start_loc_ptr + seq_idx)
            q_block = target - ((q_start - base) // BLOCK_Q + seq_idx - num_decodes)
            # Heaviest (last) query blocks first: under a causal mask they see the most keys, and starting them
            # early shortens the tail of the launch. Blocks past the end map to n_blk and are skipped.
            n_blk = _cdiv(tl.load(query_start_loc_ptr + seq_idx + 1) - q_start, BLOCK_Q)
            q_block = tl.where(q_block < n_blk, n_blk - 1 - q_block, n_blk)
            _attend(
                query_ptr, key_ptr, value_ptr, output_ptr, block_table_ptr, num_blocks,
                seq_lens_ptr, query_start_loc_ptr,
                alibi_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tree_mask_ptr, tree_indptr_ptr,
                key_end_ptr, mask_block, window_left, window_right,
                seq_idx, q_block, kv_head, segm, 0, 0, 1,
                stride_qt, stride_qh, stride_ot, stride_oh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
                q_scale, qk_scale, soft_cap, vs,
                QPK, BLOCK_Q, BLOCK_M, TILE_N, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE,
                PAGED, CAUSAL, SLIDING_WINDOW, USE_SOFTCAP, USE_ALIBI, USE_SINKS, NUM_SEGMENTS, KV_FP8, RETURN_LSE,
                USE_TREE, INTERPRET, False, MASK_KIND, KV_FORMAT)


@triton.jit(
    do_not_specialize=["num_seqs", "stride_ot", "stride_oh", "stride_pt", "stride_ph", "stride_ps", "stride_lt",
                       "stride_lh", "stride_lse_h"],
    do_not_specialize_on_alignment=["partial_lse_ptr", "lse_out_ptr", "query_start_loc_ptr"],
)
def _reduce_segments_kernel(
    output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, query_start_loc_ptr, num_seqs,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_lse_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SEG_PAD: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """Grid: (num_tokens, num_heads). Merges the per-segment (output, log2-sum-exp) pairs of one row."""
    tok = tl.program_id(0).to(tl.int64) + tl.zeros([1], dtype=tl.int64)  # [1]
    head = tl.program_id(1) + tl.zeros([1], dtype=tl.int32)
    _merge_rows(output_ptr, partial_out_ptr, partial_lse_ptr, lse_out_ptr, tok, head,
                tok < tl.load(query_start_loc_ptr + num_seqs), stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
                stride_lt, stride_lh, stride_lse_h, HEAD_SIZE, HEAD_PAD, NUM_SEGMENTS, SEG_PAD, RETURN_LSE)
