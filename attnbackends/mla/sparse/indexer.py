"""The lightning indexer on Triton: scores of every visible cached token per query token, the top-k, and the
translation of the chosen positions to cache slots (the computation: :mod:`attnbackends.reference.sparse_mla`).

Scores are written as int64 sort keys: the float32 score's bits mapped to an order-preserving int32 in the high
half (-0.0 taken as +0.0) and ``2^32 - 1 - position`` in the low half, so a larger key is a higher score, or an
equal score at a lower position: the top-k of the keys (``torch.topk`` over int64) is the reference's top-k with
its tie rule, and each key carries its position. An invisible token (in the query's future, or past the request)
gets the smallest key. The top-k runs as ``torch.topk`` (a Triton radix select may replace it).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...ops.launch_math import cdiv, next_power_of_2
from ...ops.page_guard import safe_page
from ...ops.sparse_mla_cache import index_cache_views, quantize_block_fp8
from ...platform import is_triton_interpreted
from ...spec import AttentionSpec

__all__ = ["INVALID_KEY", "indexer_sort_keys", "keys_to_slots", "select_slots"]

#: The key of an invisible token (the smallest int64).
INVALID_KEY = -(2 ** 63)
_LOW = 4294967295  # 2^32 - 1


@triton.jit
def _indexer_keys_kernel(
    Q, W, VALUES, SCALES, BT, TOKEN_REQ, TOKEN_POS, KEYS, t0,
    stride_q_t, stride_q_h, stride_w_t, stride_v_blk, stride_v_tok, stride_s_blk, stride_s_tok, stride_bt,
    stride_keys_t, num_keys, num_blocks, block_size, index_scale,
    H: tl.constexpr, QB: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr, FP8_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (tokens of the group, cdiv(num_keys, BLOCK_N)): the sort keys of query token t0 + program_id(0) over
    positions [BLOCK_N * program_id(1), + BLOCK_N) into KEYS[program_id(0)] (positions < num_keys)."""
    i = tl.program_id(0)
    t = t0 + i
    req = tl.load(TOKEN_REQ + t)
    qpos = tl.load(TOKEN_POS + t)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = offs_n <= qpos
    keys = tl.full((BLOCK_N,), -9223372036854775808, tl.int64)
    if tl.program_id(1) * BLOCK_N <= qpos:
        page = tl.load(BT + req * stride_bt + offs_n // block_size, mask=visible, other=0)
        page = safe_page(page, num_blocks).to(tl.int64)
        row = offs_n % block_size
        offs_h = tl.arange(0, H)
        offs_d = tl.arange(0, QB)
        logits = tl.zeros((H, BLOCK_N), tl.float32)
        for b in tl.static_range(NB):
            q = tl.load(Q + t * stride_q_t + offs_h[:, None] * stride_q_h + b * QB + offs_d[None, :]).to(tl.float32)
            qy, qs = quantize_block_fp8(q, INTERPRET)
            k = tl.load(VALUES + page[:, None] * stride_v_blk + row[:, None] * stride_v_tok + b * QB + offs_d[None, :],
                        mask=visible[:, None], other=0.0)
            ks = tl.load(SCALES + page * stride_s_blk + row * stride_s_tok + b, mask=visible, other=0.0)
            if FP8_DOT:
                # Hopper's fp8 MMA keeps about 14 bits of its running sum; values scaled to +-448 cancel in the
                # sum, so each K-step of 32 is added to the float32 logits (DeepSeek's promotion interval).
                dot = tl.dot(qy.to(k.dtype), tl.trans(k), max_num_imprecise_acc=32)
            else:  # fp8 values and their products are exact in float32
                dot = tl.dot(qy, tl.trans(k.to(tl.float32)))
            logits += dot * qs[:, None] * ks[None, :]
        w = tl.load(W + t * stride_w_t + offs_h).to(tl.float32)
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0) * index_scale
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 sorts as +0.0
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        keys = tl.where(visible, ordered * 4294967296 + (4294967295 - offs_n.to(tl.int64)), keys)
    tl.store(KEYS + i * stride_keys_t + offs_n, keys, mask=offs_n < num_keys)


@triton.jit
def _keys_to_slots_kernel(
    KEYS, BT, TOKEN_REQ, TOKEN_POS, SLOTS, t0, stride_keys_t, stride_bt, stride_slots_t, num_chosen, topk,
    num_blocks, block_size, BLOCK: tl.constexpr,
):
    """Grid (tokens of the group, cdiv(topk, BLOCK)): the chosen keys of token t0 + program_id(0) (its first
    num_chosen) -> cache slots (int32) in SLOTS[t0 + program_id(0)], -1 for the rest of its topk entries."""
    i = tl.program_id(0)
    t = t0 + i
    req = tl.load(TOKEN_REQ + t)
    qpos = tl.load(TOKEN_POS + t)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(KEYS + i * stride_keys_t + offs, mask=offs < num_chosen, other=-9223372036854775808)
    pos = 4294967295 - (key & 4294967295)
    valid = (offs < num_chosen) & (pos <= qpos)
    pos32 = tl.where(valid, pos, 0).to(tl.int32)
    page = tl.load(BT + req * stride_bt + pos32 // block_size, mask=valid, other=0)
    page = safe_page(page, num_blocks)
    slot = tl.where(valid, page * block_size + pos32 % block_size, -1)
    tl.store(SLOTS + t * stride_slots_t + offs, slot, mask=offs < topk)


def indexer_sort_keys(index_q: torch.Tensor, index_weights: torch.Tensor, index_cache: torch.Tensor,
                      block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor, spec: AttentionSpec,
                      t0: int, num_tokens: int, num_keys: int, out: torch.Tensor, block_n: int = 64,
                      fp8_dot: Optional[bool] = None) -> torch.Tensor:
    """Sort keys (module docstring) of query tokens [t0, t0 + num_tokens) over positions [0, num_keys).

    index_q [T, H, D], index_weights [T, H]; block_table [R, W] int32; token_req / token_pos [T] int32 (each token's
    request and position); out [>= num_tokens, >= num_keys] int64. Returns out[:num_tokens, :num_keys]."""
    sparse = spec.sparse_indexer
    values, scales = index_cache_views(index_cache, spec)
    h = sparse.num_index_heads
    if h != next_power_of_2(h) or sparse.quant_block != next_power_of_2(sparse.quant_block):
        raise ValueError(f"the Triton indexer needs power-of-two num_index_heads and quant_block, got {h} and "
                         f"{sparse.quant_block}")
    interpret = is_triton_interpreted()
    if fp8_dot is None:
        fp8_dot = (not interpret and index_q.is_cuda and torch.cuda.get_device_capability(index_q.device) >= (8, 9))
    if index_q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("index_q and the key buffer need unit stride in their last dimension")
    _indexer_keys_kernel[(num_tokens, cdiv(num_keys, block_n))](
        index_q, index_weights, values, scales, block_table, token_req, token_pos, out, t0,
        index_q.stride(0), index_q.stride(1), index_weights.stride(0), values.stride(0), values.stride(1),
        scales.stride(0), scales.stride(1), block_table.stride(0), out.stride(0), num_keys, values.shape[0],
        spec.block_size, sparse.softmax_scale,
        H=h, QB=sparse.quant_block, NB=sparse.num_quant_blocks, BLOCK_N=block_n, FP8_DOT=fp8_dot,
        INTERPRET=interpret, num_warps=4)
    return out[:num_tokens, :num_keys]


def keys_to_slots(chosen: torch.Tensor, block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                  slots: torch.Tensor, t0: int, num_blocks: int, block_size: int) -> None:
    """chosen [n, k] int64 keys of tokens [t0, t0 + n) -> slots[t0: t0 + n] [n, topk] int32 (-1 past k and for
    invisible keys)."""
    n, k = chosen.shape
    topk = slots.shape[1]
    block = min(1024, next_power_of_2(topk))
    _keys_to_slots_kernel[(n, cdiv(topk, block))](
        chosen, block_table, token_req, token_pos, slots, t0, chosen.stride(0), block_table.stride(0),
        slots.stride(0), k, topk, num_blocks, block_size, BLOCK=block, num_warps=4)


def select_slots(index_q: torch.Tensor, index_weights: torch.Tensor, index_cache: torch.Tensor,
                 block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor, spec: AttentionSpec,
                 groups: tuple[tuple[int, int], ...], num_keys: int, keys_buffer: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """The indexer and top-k of every query token: ``slots`` [T, topk] int32 (cache slots of the chosen tokens in
    no particular order; -1 padding). ``groups``: (start, end) token ranges scored at once into ``keys_buffer``
    [>= max group size, >= num_keys] int64."""
    topk = spec.sparse_indexer.topk
    k = min(topk, num_keys)
    for start, end in groups:
        keys = indexer_sort_keys(index_q, index_weights, index_cache, block_table, token_req, token_pos, spec,
                                 start, end - start, num_keys, keys_buffer)
        chosen = torch.topk(keys, k, dim=-1, sorted=False).values if k < num_keys else keys
        keys_to_slots(chosen, block_table, token_req, token_pos, slots, start, index_cache.shape[0],
                      spec.block_size)
    return slots
