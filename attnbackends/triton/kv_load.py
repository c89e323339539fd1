"""Loading one key/value tile of the paged cache in any format, for the unified kernel (``@triton.jit`` helpers) and
the host constants that go with them.

Formats (the kernel's ``KV_FORMAT`` constexpr, :func:`kernel_kv_format`): ``KV_PLAIN`` (16-bit, or fp8 with one
scale per tensor folded into the logits and the output), ``KV_TOKEN_HEAD_8BIT`` (fp8 e4m3 or int8 values with a
float32 scale per token and head), ``KV_TOKEN_HEAD_INT4`` (two int4 values a byte, scale per token and head),
``KV_NVFP4`` (two e2m1 values a byte, an e4m3 scale per 16 values; the global scale is the per-tensor one).

Per-token-head scales are loaded once per tile (one per key) and never multiply the values elementwise: a key's
scale factors out of ``q . k`` (the logits are scaled after the dot, :func:`scale_scores`) and a value's scale
folds into the softmax weights before the PV dot (:func:`fold_v_scales`). The weights are scaled by
``PV_FOLD`` more, keeping them in float16's normal range, and the launch's per-tensor value scale is
``1 / PV_FOLD`` (:func:`launch_tensor_scales`). NVFP4 tiles are dequantised elementwise (correctness first).

:func:`read_kv_tile` applies every scale to a tile's values instead (the keys and values a reader sees, in float32):
the page dequantisation of :mod:`.kv_dequant` reads through it.

Scales sit beside their pages (:mod:`attnbackends.ops.kv_layout`): from the key view's page start, the K scales
at ``2 * BLOCK_SIZE * stride_ks`` bytes, the V scales right after them; token ``t`` of a page and head ``h`` at
``(t * num_kv_heads + h) * scale_bytes`` in each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..ops.kv_quant import e2m1_decode
from ..spec import KVCacheFormat

__all__ = [
    "KV_NVFP4", "KV_PLAIN", "KV_TOKEN_HEAD_8BIT", "KV_TOKEN_HEAD_INT4", "PV_FOLD", "dots_in_fp16", "fold_v_scales",
    "kernel_kv_format", "launch_tensor_scales", "load_kv_tile", "quantised_cache_reason", "read_kv_tile",
    "scale_scores",
]

KV_PLAIN = 0
KV_TOKEN_HEAD_8BIT = 1
KV_TOKEN_HEAD_INT4 = 2
KV_NVFP4 = 3

#: Softmax weights times a value's scale, times this, are float16 normal numbers for values of ordinary size.
PV_FOLD = tl.constexpr(64.0)

_KERNEL_FORMATS = {
    KVCacheFormat.SIXTEEN_BIT: KV_PLAIN,
    KVCacheFormat.FP8_PER_TENSOR: KV_PLAIN,
    KVCacheFormat.FP8_PER_TOKEN_HEAD: KV_TOKEN_HEAD_8BIT,
    KVCacheFormat.INT8_PER_TOKEN_HEAD: KV_TOKEN_HEAD_8BIT,
    KVCacheFormat.INT4_PER_TOKEN_HEAD: KV_TOKEN_HEAD_INT4,
    KVCacheFormat.NVFP4: KV_NVFP4,
}


def kernel_kv_format(fmt: KVCacheFormat) -> int:
    """The kernel's ``KV_FORMAT`` of a cache format."""
    return _KERNEL_FORMATS[fmt]


def dots_in_fp16(spec) -> bool:
    """Whether the unified kernel runs a layer's dots in float16 over converted cache values (the ``kv_fp8`` of its
    plans and tile choices): fp8 per tensor, and every format with page scales."""
    return spec.is_fp8_kv_cache or spec.kv_cache_format.scales_in_pages


def quantised_cache_reason(spec) -> "str | None":
    """Why the prefill kernels (Triton prefill, both Gluon Hopper prefills) do not read a layer's cache: a format
    with page scales is read directly by the unified kernel only; its prefills dequantise their pages into a 16-bit
    scratch for the paged Gluon kernel, or run on the unified kernel (the builder's ``choices.quantised_prefill``
    says which). None: they may read it."""
    fmt = spec.kv_cache_format
    if fmt.scales_in_pages:
        return (f"a {spec.kv_cache_dtype} KV cache (scales beside its pages) is read directly by the unified kernel "
                "only")
    return None


def launch_tensor_scales(fmt: KVCacheFormat, k_scale, v_scale):
    """The per-tensor (k_scale, v_scale) the kernel takes for a cache of ``fmt`` with the impl's scales: the impl's
    for 16-bit, fp8 per tensor and NVFP4 (its global scales); (1, 1 / PV_FOLD) for per-token-head formats."""
    if fmt.per_token_head:
        return 1.0, 1.0 / PV_FOLD.value
    return k_scale, v_scale


@triton.jit
def _token_head_scales(base_ptr, blk, slot, kv_head, n_ok, stride_kb, region, num_kv_heads,
                       MASKED: tl.constexpr):
    """[TILE_N] float32 scales of keys (``blk``, ``slot``) and ``kv_head`` in the scale region at byte ``region`` of
    each page (from ``base_ptr``)."""
    offs = blk.to(tl.int64) * stride_kb + region + (slot * num_kv_heads + kv_head) * 4
    ptrs = (base_ptr + offs).to(tl.pointer_type(tl.float32), bitcast=True)
    if MASKED:
        return tl.load(ptrs, mask=n_ok, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _biased_to_f16(biased, BIAS: tl.constexpr):
    """int32 codes with ``biased = value + BIAS`` in [0, 1024) -> float16 values, exactly, without a conversion
    instruction: the bits 0x6400 + biased are the float16 1024 + biased, from which 1024 + BIAS is subtracted
    (int8 pages; int4's nibbles keep their int32-to-float conversion: benchmarks/NOTES.md)."""
    return (biased + 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + BIAS)


@triton.jit
def _unpack_rows(packed):
    """[N, P] uint8 -> [N, 2P] int32 nibbles (byte i's low nibble at 2i, high at 2i + 1)."""
    p = packed.to(tl.int32)
    return tl.reshape(tl.join(p & 0xF, p >> 4), [packed.shape[0], packed.shape[1] * 2])


@triton.jit
def _load_rows(ptrs, mask, MASKED_ANY: tl.constexpr):
    if MASKED_ANY:
        return tl.load(ptrs, mask=mask, other=0)
    return tl.load(ptrs)


@triton.jit
def _nvfp4_rows(codes, base_ptr, blk, slot, kv_head, n_ok, stride_kb, region, num_kv_heads,
                HEAD_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr):
    """[TILE_N, HEAD_PAD] float32: e2m1 codes times their blocks' e4m3 scales."""
    GROUPS: tl.constexpr = HEAD_PAD // 16
    offs_g = tl.arange(0, GROUPS)
    row = blk.to(tl.int64) * stride_kb + region + (slot * num_kv_heads + kv_head) * (HEAD_SIZE // 16)
    mask = (offs_g[None, :] < HEAD_SIZE // 16)
    if MASKED:
        mask = mask & n_ok[:, None]
    bytes_ = tl.load(base_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + row[:, None] + offs_g[None, :],
                     mask=mask, other=0)
    scales = bytes_.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [TILE_N, GROUPS]
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], [TILE_N, GROUPS, 16]), [TILE_N, HEAD_PAD])
    return e2m1_decode(codes) * scales


@triton.jit
def load_kv_tile(
    key_ptr, value_ptr, k_off, v_off, blk, slot, kv_head, n_ok, offs_d, stride_kb, stride_ks, stride_kh, stride_vh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """One tile's keys and values and their per-token-head scales.

    ``k_off``/``v_off`` [TILE_N]: the keys' row offsets (page and slot) from ``key_ptr``/``value_ptr``; ``blk``,
    ``slot`` [TILE_N]: their pages and slots (only read by page-scaled formats); ``n_ok`` [TILE_N]: keys that exist
    (loads masked with ``MASKED``). Returns k [HEAD_PAD, TILE_N] and v [TILE_N, HEAD_PAD] in the cache's dtype
    (``KV_PLAIN``, fp8 e4m3 values), float16 (int8 codes, converted exactly by integer operations) or float32
    (int4 and NVFP4, already unpacked), and k_sc, v_sc [TILE_N] float32 (per-token-head formats; ones otherwise)."""
    ones = tl.full([TILE_N], 1.0, tl.float32)
    if KV_FORMAT == 0 or KV_FORMAT == 1:
        k_ptrs = key_ptr + kv_head * stride_kh + k_off[None, :] + offs_d[:, None]  # [HEAD_PAD, TILE_N]
        v_ptrs = value_ptr + kv_head * stride_vh + v_off[:, None] + offs_d[None, :]  # [TILE_N, HEAD_PAD]
        if MASKED:
            if HEAD_PAD != HEAD_SIZE:
                d_ok = offs_d < HEAD_SIZE
                k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            if HEAD_PAD != HEAD_SIZE:
                d_ok = offs_d < HEAD_SIZE
                k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        if k.dtype == tl.int8:
            k = _biased_to_f16(k.to(tl.int32) + 128, 128)
            v = _biased_to_f16(v.to(tl.int32) + 128, 128)
        k_sc = ones
        v_sc = ones
    else:
        HALF: tl.constexpr = HEAD_PAD // 2
        offs_b = tl.arange(0, HALF)
        mask = offs_b[None, :] < HEAD_SIZE // 2
        if MASKED:
            mask = mask & n_ok[:, None]
        kb = _load_rows(key_ptr + kv_head * stride_kh + k_off[:, None] + offs_b[None, :], mask,
                        MASKED or HEAD_PAD != HEAD_SIZE)
        vb = _load_rows(value_ptr + kv_head * stride_vh + v_off[:, None] + offs_b[None, :], mask,
                        MASKED or HEAD_PAD != HEAD_SIZE)
        k_codes = _unpack_rows(kb)  # [TILE_N, HEAD_PAD]
        v_codes = _unpack_rows(vb)
        k_sc = ones
        v_sc = ones
        num_kv_heads = stride_ks // stride_kh
        if KV_FORMAT == 2:
            k = tl.trans((k_codes - 8).to(tl.float32))
            v = (v_codes - 8).to(tl.float32)
        else:
            SB: tl.constexpr = HEAD_SIZE // 16
            k_region = 2 * BLOCK_SIZE * stride_ks
            v_region = BLOCK_SIZE * stride_ks + BLOCK_SIZE * num_kv_heads * SB
            k = tl.trans(_nvfp4_rows(k_codes, key_ptr, blk, slot, kv_head, n_ok, stride_kb, k_region, num_kv_heads,
                                     HEAD_PAD, HEAD_SIZE, TILE_N, MASKED))
            v = _nvfp4_rows(v_codes, value_ptr, blk, slot, kv_head, n_ok, stride_kb, v_region, num_kv_heads,
                            HEAD_PAD, HEAD_SIZE, TILE_N, MASKED)
    if KV_FORMAT == 1 or KV_FORMAT == 2:
        num_kv_heads = stride_ks // stride_kh
        k_sc = _token_head_scales(key_ptr, blk, slot, kv_head, n_ok, stride_kb, 2 * BLOCK_SIZE * stride_ks,
                                  num_kv_heads, MASKED)
        v_sc = _token_head_scales(value_ptr, blk, slot, kv_head, n_ok, stride_kb,
                                  BLOCK_SIZE * stride_ks + BLOCK_SIZE * num_kv_heads * 4, num_kv_heads, MASKED)
    return k, v, k_sc, v_sc


@triton.jit
def scale_scores(s, k_sc, KV_FORMAT: tl.constexpr):
    """Logits [M, TILE_N] of ``q . k`` over stored keys -> over the keys read (times each key's scale)."""
    if KV_FORMAT == 1 or KV_FORMAT == 2:
        s = s * k_sc[None, :]
    return s


@triton.jit
def fold_v_scales(p, v_sc, KV_FORMAT: tl.constexpr):
    """Softmax weights [M, TILE_N] -> the weights of the stored values (times each value's scale and PV_FOLD)."""
    if KV_FORMAT == 1 or KV_FORMAT == 2:
        p = p * (v_sc * PV_FOLD)[None, :]
    return p


@triton.jit
def read_kv_tile(
    key_ptr, value_ptr, k_off, v_off, blk, slot, kv_head, n_ok, offs_d, stride_kb, stride_ks, stride_kh, stride_vh,
    k_global, v_global,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """One tile's keys and values as read (:mod:`attnbackends.ops.kv_quant`'s exact read): k [HEAD_PAD, TILE_N]
    and v [TILE_N, HEAD_PAD] float32, the stored values times their per-token-head scales, or (NVFP4) times their
    block scales and then the global scales ``k_global``/``v_global``. Arguments as :func:`load_kv_tile`'s; a
    format with page scales (``KV_FORMAT`` > 0)."""
    k, v, k_sc, v_sc = load_kv_tile(key_ptr, value_ptr, k_off, v_off, blk, slot, kv_head, n_ok, offs_d, stride_kb,
                                    stride_ks, stride_kh, stride_vh, HEAD_SIZE, HEAD_PAD, TILE_N, BLOCK_SIZE, MASKED,
                                    KV_FORMAT)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if KV_FORMAT == 3:
        k = k * k_global
        v = v * v_global
    else:
        k = k * k_sc[None, :]
        v = v * v_sc[:, None]
    return k, v
