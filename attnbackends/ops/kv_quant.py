"""The arithmetic of the KV-cache formats whose scales are written with the tokens (the reference defines it; the
Triton write kernel computes the same bits): in torch, and as ``@triton.jit`` helpers for the write kernel.

Per token and head (fp8 e4m3, int8, int4), over the head's ``head_size`` values ``x`` (float32 of the model's):
    scale = absmax(x) / qmax (1.0 where that is 0), qmax = 448 (e4m3), 127 (int8), 7 (int4);
    stored = e4m3(clamp(x / scale, +-448)) | round_half_even(x / scale) clamped to +-qmax;
    read = stored * scale. int4 is stored as the nibble stored + 8.
NVFP4, per block of 16 values, with the per-tensor global scale g:
    block_scale = e4m3(min(absmax(block) / (g * 6), 448)); d = float(block_scale) * g;
    stored = e2m1(x / d) (0 where d is 0; e2m1 rounds half to even and saturates at 6);
    read = (e2m1 value * float(block_scale)) * g.
Every division is IEEE round-to-nearest (``tl.math.div_rn`` in the kernel). Packed formats hold element ``2i`` in
the low nibble of byte ``i`` and ``2i + 1`` in the high one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..spec import KVCacheFormat
from .quant import round_to_fp8_grid

__all__ = [
    "E2M1_VALUES", "FORMAT_QMAX", "NVFP4_BLOCK", "dequantize_token_heads", "quantize_token_heads",
    "e2m1_decode", "e2m1_encode", "pack_nibbles", "quantize_per_token_head", "quantize_nvfp4", "rint",
]

#: Largest stored magnitude of each per-token-head format.
FORMAT_QMAX = {
    KVCacheFormat.FP8_PER_TOKEN_HEAD: 448.0,
    KVCacheFormat.INT8_PER_TOKEN_HEAD: 127.0,
    KVCacheFormat.INT4_PER_TOKEN_HEAD: 7.0,
}
NVFP4_BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E4M3_MAX = 448.0


# --------------------------------------------------------------------------------------------------------------
# torch: the definition
# --------------------------------------------------------------------------------------------------------------
def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] integer codes 0..15 -> [..., D // 2] uint8, element 2i low nibble, 2i + 1 high."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 2] uint8 -> [..., D] int32 codes 0..15."""
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    a = y.abs().clamp(max=6.0)
    q = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5, torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0))
    mag = torch.where(q < 2.0, q * 2.0, torch.where(q < 4.0, q + 2.0, q * 0.5 + 4.0))
    return mag.to(torch.int32) + torch.where(y < 0, 8, 0)


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    return lut[code & 7] * torch.where((code & 8) != 0, -1.0, 1.0)


def quantize_token_heads(x: torch.Tensor, fmt: KVCacheFormat, global_scale: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise tokens' keys or values.

    Parameters
    ----------
    x : [T, H, D] float16 / bfloat16 / float32.
    fmt : a format with page scales.
    global_scale : NVFP4's per-tensor scale g (positive); ignored by the other formats.

    Returns
    -------
    values : [T, H, D] float8_e4m3fn / int8, or [T, H, D // 2] uint8 (int4, NVFP4).
    scales : [T, H] float32, or [T, H, D // 16] float8_e4m3fn (NVFP4).
    """
    xf = x.float()
    if fmt is KVCacheFormat.NVFP4:
        g = torch.tensor(global_scale, dtype=torch.float32, device=x.device)
        t, h, d = xf.shape
        blocks = xf.view(t, h, d // NVFP4_BLOCK, NVFP4_BLOCK)
        bamax = blocks.abs().amax(-1)
        block_scale = (bamax / (g * 6.0)).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
        denom = block_scale.float() * g
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        y = torch.where(denom[..., None] > 0, blocks / safe[..., None], torch.zeros_like(blocks))
        return _pack(_e2m1_code(y).view(t, h, d)), block_scale
    qmax = FORMAT_QMAX[fmt]
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a Python-number divisor, not IEEE division.
    scale = xf.abs().amax(-1) / torch.tensor(qmax, dtype=torch.float32, device=x.device)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale[..., None]
    if fmt is KVCacheFormat.FP8_PER_TOKEN_HEAD:
        return y.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn), scale
    q = torch.round(y).clamp(-qmax, qmax)
    if fmt is KVCacheFormat.INT8_PER_TOKEN_HEAD:
        return q.to(torch.int8), scale
    return _pack(q.to(torch.int32) + 8), scale


def dequantize_token_heads(values: torch.Tensor, scales: torch.Tensor, fmt: KVCacheFormat,
                           global_scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read quantised keys or values back (the exact read of the module docstring), as ``dtype``.

    values, scales : as :func:`quantize_token_heads` returns them (any leading dimensions). Returns [..., D]."""
    if fmt is KVCacheFormat.NVFP4:
        v = _e2m1_value(_unpack(values))
        v = v.unflatten(-1, (-1, NVFP4_BLOCK)) * scales.float()[..., None]
        g = torch.tensor(global_scale, dtype=torch.float32, device=values.device)
        return (v.flatten(-2) * g).to(dtype)
    if fmt is KVCacheFormat.INT4_PER_TOKEN_HEAD:
        q = (_unpack(values) - 8).float()
    else:
        q = values.float()
    return (q * scales.float()[..., None]).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# Triton: the same bits, for the write kernel
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def rint(y):
    """Round half to even (float32), as ``torch.round``; also under the interpreter."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + tl.where(up, 1.0, 0.0)


@triton.jit
def pack_nibbles(codes):
    """[T, H, D] int32 codes 0..15 -> [T, H, D // 2] uint8 (element 2i low nibble, 2i + 1 high)."""
    T: tl.constexpr = codes.shape[0]
    H: tl.constexpr = codes.shape[1]
    D: tl.constexpr = codes.shape[2]
    lo, hi = tl.split(tl.reshape(codes, [T, H, D // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def quantize_per_token_head(x, QMAX: tl.constexpr, IS_FP8: tl.constexpr, PACK4: tl.constexpr,
                            INTERPRET: tl.constexpr):
    """x [T, H, D] float32 (padding columns 0) -> (stored values ready for the cache's dtype, scales [T, H]):
    e4m3-ready floats (IS_FP8), rounded integers (int8), or packed nibbles [T, H, D // 2] uint8 (PACK4)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 2), QMAX)
    scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, scale[:, :, None])
    if IS_FP8:
        y = tl.clamp(y, -QMAX, QMAX)
        if INTERPRET:
            y = round_to_fp8_grid(y, 3, -6)
    else:
        y = tl.clamp(rint(y), -QMAX, QMAX)
    if PACK4:
        y = pack_nibbles(y.to(tl.int32) + 8)
    return y, scale


@triton.jit
def e2m1_encode(y):
    """float32 -> e2m1 codes 0..15 (int32): round half to even, saturate at 6, sign in bit 3."""
    a = tl.minimum(tl.abs(y), 6.0)
    q = tl.where(a < 2.0, rint(a * 2.0) * 0.5, tl.where(a < 4.0, rint(a), rint(a * 0.5) * 2.0))
    mag = tl.where(q < 2.0, q * 2.0, tl.where(q < 4.0, q + 2.0, q * 0.5 + 4.0))
    return mag.to(tl.int32) + tl.where(y < 0, 8, 0)


@triton.jit
def e2m1_decode(code):
    """e2m1 codes (integers 0..15) -> float32 values."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def quantize_nvfp4(x, g, BLOCKS: tl.constexpr, INTERPRET: tl.constexpr):
    """x [T, H, D] float32 (D = BLOCKS * 16), g the global scale -> (packed codes [T, H, D // 2] uint8, block
    scales [T, H, BLOCKS] float8e4nv)."""
    T: tl.constexpr = x.shape[0]
    H: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x, [T, H, BLOCKS, 16])
    bs = tl.minimum(tl.math.div_rn(tl.max(tl.abs(blocks), 3), g * 6.0), 448.0)
    if INTERPRET:
        bs = round_to_fp8_grid(bs, 3, -6)
    bs8 = bs.to(tl.float8e4nv)
    denom = bs8.to(tl.float32) * g
    safe = tl.where(denom > 0, denom, 1.0)
    y = tl.where(denom[:, :, :, None] > 0, tl.math.div_rn(blocks, safe[:, :, :, None]), 0.0)
    codes = tl.reshape(e2m1_encode(y), [T, H, BLOCKS * 16])
    return pack_nibbles(codes), bs8
