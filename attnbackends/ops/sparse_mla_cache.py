"""The caches of a sparse MLA layer (DeepSeek-V3.2, :class:`~attnbackends.spec.SparseIndexerSpec`): their layouts,
allocation, blockwise fp8 quantisation and the writes of new tokens, shared by every sparse MLA backend.

A layer's cache is a :class:`SparseMLACache` of two tensors over the same pages (``num_blocks`` pages of
``block_size`` tokens; slot s = page * block_size + row, as every paged cache here):

latent (``latent_format`` "auto")
    [num_blocks, block_size, Lkv + R] in the model dtype: c = [kv_c ; k_pe] per token, as the dense MLA cache.
latent (``latent_format`` "fp8_ds_mla", DeepSeek's format)
    [num_blocks, block_size, Lkv + 4 * Lkv / 128 + 2 * R] uint8 per token: Lkv fp8 e4m3 nope values, then one
    float32 scale per 128 of them, then R bfloat16 rope values (656 bytes at Lkv 512, R 64). A nope value reads
    fp8 * its tile's scale; the tile's scale is max(|x|, 1e-4) / 448 over its 128 values.
index
    [num_blocks, block_size * (D + 4 * D / quant_block)] uint8 per page (D = index_head_dim): first the page's
    block_size x D fp8 e4m3 key values (token-major), then its block_size x (D / quant_block) float32 scales.
    :func:`index_cache_views` gives them as [num_blocks, block_size, D] fp8 and [num_blocks, block_size, D / qb]
    float32 views. A key reads fp8 * its block's scale.

Blockwise fp8 quantisation (:func:`quantize_blockwise_fp8`, the indexer's keys and queries, the ds latent's nope
part): per block of ``block`` values, scale = max(max |x|, 1e-4) / 448 in float32, stored = saturate(x / scale) cast
to e4m3 (round to nearest even).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch_math import next_power_of_2
from .mla_cache import concat_and_cache_mla
from .page_guard import FAULT_SLOT, check_slots_host, fault_record, raise_pending_faults, record_fault
from .quant import fp8_grid, round_to_fp8_grid
from ..platform import is_triton_interpreted
from ..spec import SPARSE_QUANT_BLOCK, AttentionSpec

__all__ = [
    "SPARSE_INDEX_CACHE_LAYOUT",
    "SPARSE_LATENT_LAYOUTS",
    "FP8_E4M3_MAX",
    "SCALE_FLOOR",
    "SparseMLACache",
    "SparseMLACacheHooks",
    "allocate_sparse_mla_cache",
    "dequantize_blockwise_fp8",
    "ds_latent_bytes",
    "ds_latent_views",
    "index_cache_views",
    "index_page_bytes",
    "quantize_blockwise_fp8",
    "read_index_keys",
    "read_latent",
    "sparse_mla_cache_shapes",
    "write_index_keys",
    "write_sparse_latent",
]

SPARSE_LATENT_LAYOUTS = {
    "auto": "[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] model dtype",
    "fp8_ds_mla": "[num_blocks, block_size, Lkv fp8 | Lkv/128 fp32 scales | R bf16] uint8 (656 bytes at 512/64)",
}
SPARSE_INDEX_CACHE_LAYOUT = "[num_blocks, block_size * D fp8 | block_size * D/quant_block fp32 scales] uint8 per page"

FP8_E4M3_MAX = 448.0
#: The smallest block maximum a scale is taken from (an all-zero block gets scale 1e-4 / 448).
SCALE_FLOOR = 1e-4


class SparseMLACache(NamedTuple):
    """One sparse MLA layer's caches (layouts: the module docstring). latent : the latent cache; index : the
    indexer's key cache (uint8 pages)."""

    latent: torch.Tensor
    index: torch.Tensor


def ds_latent_bytes(kv_lora_rank: int, rope: int) -> int:
    """Bytes per token of the fp8_ds_mla latent format."""
    return kv_lora_rank + 4 * (kv_lora_rank // SPARSE_QUANT_BLOCK) + 2 * rope


def index_page_bytes(spec: AttentionSpec) -> int:
    """Bytes of one page of the indexer's key cache."""
    sparse = spec.sparse_indexer
    return spec.block_size * (sparse.index_head_dim + 4 * sparse.num_quant_blocks)


def sparse_mla_cache_shapes(num_blocks: int, spec: AttentionSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(latent shape, index shape) of one layer's :class:`SparseMLACache`."""
    if not spec.is_sparse_mla:
        raise ValueError("sparse MLA caches need a spec with a sparse_indexer")
    if spec.sparse_indexer.latent_format == "fp8_ds_mla":
        latent = (num_blocks, spec.block_size, ds_latent_bytes(spec.kv_lora_rank, spec.qk_rope_head_dim))
    else:
        latent = (num_blocks, spec.block_size, spec.head_size)
    return latent, (num_blocks, index_page_bytes(spec))


def allocate_sparse_mla_cache(num_blocks: int, spec: AttentionSpec, device: "torch.device | str") -> SparseMLACache:
    """An UNINITIALISED :class:`SparseMLACache` for one layer (only written slots may be attended over)."""
    latent_shape, index_shape = sparse_mla_cache_shapes(num_blocks, spec)
    latent_dtype = torch.uint8 if spec.sparse_indexer.latent_format == "fp8_ds_mla" else spec.torch_dtype
    return SparseMLACache(torch.empty(latent_shape, dtype=latent_dtype, device=device),
                          torch.empty(index_shape, dtype=torch.uint8, device=device))


def index_cache_views(index: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer key cache's values [num_blocks, block_size, D] float8_e4m3fn and scales
    [num_blocks, block_size, D / quant_block] float32, views of ``index`` [num_blocks, page bytes] uint8."""
    sparse = spec.sparse_indexer
    bs, d, nb = spec.block_size, sparse.index_head_dim, sparse.num_quant_blocks
    if index.dtype != torch.uint8 or index.dim() != 2 or index.shape[1] != index_page_bytes(spec):
        raise ValueError(f"the index cache must be [num_blocks, {index_page_bytes(spec)}] uint8, got "
                         f"{tuple(index.shape)} {index.dtype}")
    values = index[:, : bs * d].view(torch.float8_e4m3fn).view(index.shape[0], bs, d)
    scales = index[:, bs * d:].view(torch.float32).view(index.shape[0], bs, nb)
    return values, scales


def ds_latent_views(latent: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp8_ds_mla latent cache's nope values [num_blocks, block_size, Lkv] float8_e4m3fn, tile scales
    [num_blocks, block_size, Lkv / 128] float32 and rope values [num_blocks, block_size, R] bfloat16."""
    lkv, r = spec.kv_lora_rank, spec.qk_rope_head_dim
    width = ds_latent_bytes(lkv, r)
    if latent.dtype != torch.uint8 or latent.dim() != 3 or latent.shape[2] != width:
        raise ValueError(f"an fp8_ds_mla latent cache must be [num_blocks, block_size, {width}] uint8, got "
                         f"{tuple(latent.shape)} {latent.dtype}")
    tiles = lkv // SPARSE_QUANT_BLOCK
    nope = latent[..., :lkv].view(torch.float8_e4m3fn)
    scales = latent[..., lkv: lkv + 4 * tiles].view(torch.float32)
    rope = latent[..., lkv + 4 * tiles:].view(torch.bfloat16)
    return nope, scales, rope


# ------------------------------------------------------------------------------------------------ torch arithmetic


def quantize_blockwise_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D a multiple of ``block``) -> (values [..., D] float8_e4m3fn, scales [..., D / block] float32)."""
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of the block ({block})")
    xb = x.float().unflatten(-1, (-1, block))
    # A tensor divisor: CUDA torch multiplies by the reciprocal of a Python-number divisor, not IEEE division.
    scale = xb.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / torch.tensor(FP8_E4M3_MAX, device=xb.device)
    q = (xb / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def dequantize_blockwise_fp8(values: torch.Tensor, scales: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """values [..., D] fp8 and scales [..., D / block] -> [..., D] in ``dtype`` (values * their block's scale)."""
    block = values.shape[-1] // scales.shape[-1]
    x = values.to(dtype).unflatten(-1, (-1, block)) * scales.to(dtype)[..., None]
    return x.flatten(-2)


def read_index_keys(index: torch.Tensor, slots: torch.Tensor, spec: AttentionSpec,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The indexer keys of cache ``slots`` [n] int64 (all valid), dequantized: [n, D] in ``dtype``."""
    values, scales = index_cache_views(index, spec)
    bs = spec.block_size
    page, row = slots // bs, slots % bs
    return dequantize_blockwise_fp8(values[page, row], scales[page, row], dtype)


def read_latent(latent: torch.Tensor, slots: torch.Tensor, spec: AttentionSpec,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The latent vectors [kv_c ; k_pe] of cache ``slots`` [n] int64 (all valid), dequantized: [n, Lkv + R]."""
    bs = spec.block_size
    page, row = slots // bs, slots % bs
    if spec.sparse_indexer.latent_format != "fp8_ds_mla":
        return latent[page, row].to(dtype)
    nope, scales, rope = ds_latent_views(latent, spec)
    kv_c = dequantize_blockwise_fp8(nope[page, row], scales[page, row], dtype)
    return torch.cat([kv_c, rope[page, row].to(dtype)], dim=-1)


def _write_torch(index_or_latent_rows: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, bs: int) -> None:
    index_or_latent_rows[slots // bs, slots % bs] = rows


def _write_index_keys_torch(k_idx: torch.Tensor, index: torch.Tensor, slots: torch.Tensor,
                            spec: AttentionSpec) -> None:
    values, scales = index_cache_views(index, spec)
    check_slots_host(slots, index.shape[0] * spec.block_size)
    keep = slots >= 0
    q, s = quantize_blockwise_fp8(k_idx[keep], spec.sparse_indexer.quant_block)
    _write_torch(values, slots[keep], q, spec.block_size)
    _write_torch(scales, slots[keep], s, spec.block_size)


def _write_ds_latent_torch(kv_c: torch.Tensor, k_pe: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor,
                           spec: AttentionSpec) -> None:
    nope, scales, rope = ds_latent_views(latent, spec)
    check_slots_host(slots, latent.shape[0] * spec.block_size)
    keep = slots >= 0
    q, s = quantize_blockwise_fp8(kv_c[keep], SPARSE_QUANT_BLOCK)
    _write_torch(nope, slots[keep], q, spec.block_size)
    _write_torch(scales, slots[keep], s, spec.block_size)
    _write_torch(rope, slots[keep], k_pe[keep].to(torch.bfloat16), spec.block_size)


# ------------------------------------------------------------------------------------------------ Triton writes


@triton.jit
def quantize_block_fp8(x, INTERPRET: tl.constexpr):
    """x [ROWS, BLOCK] float32 -> (x / scale saturated, on the e4m3 grid under the interpreter [ROWS, BLOCK];
    scale [ROWS]) with scale = max(max |x|, 1e-4) / 448 per row (:func:`quantize_blockwise_fp8`)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4), 448.0)
    y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    if INTERPRET:
        y = round_to_fp8_grid(y, 3, -6)
    return y, scale


@triton.jit
def _store_fp8_blocks(x, values_ptr, scales_ptr, N: tl.constexpr, QB: tl.constexpr, INTERPRET: tl.constexpr):
    """One token's row x [N] float32 quantised per QB values (:func:`quantize_block_fp8`): its N fp8 values at
    values_ptr, its N // QB float32 scales at scales_ptr."""
    y, scale = quantize_block_fp8(tl.reshape(x, (N // QB, QB)), INTERPRET)
    tl.store(values_ptr + tl.arange(0, N), tl.reshape(y, (N,)).to(values_ptr.dtype.element_ty))
    tl.store(scales_ptr + tl.arange(0, N // QB), scale)


@triton.jit(do_not_specialize=["num_slots"])
def _write_index_keys_kernel(K, VALUES, SCALES, SLOTS, stride_k_t, stride_v_blk, stride_v_tok, stride_s_blk,
                             stride_s_tok, block_size, num_slots, fault_ptr, fault_flag_ptr,
                             D: tl.constexpr, QB: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (T,): token t's index key K[t] [D] quantised per QB values into slot SLOTS[t] (-1: skipped; outside
    the cache: skipped and recorded in the fault record)."""
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if (slot < -1) | (slot >= num_slots):
        record_fault(fault_ptr, fault_flag_ptr, FAULT_SLOT, t, slot, num_slots)
    elif slot >= 0:
        page = slot // block_size
        row = slot % block_size
        x = tl.load(K + t * stride_k_t + tl.arange(0, D)).to(tl.float32)
        _store_fp8_blocks(x, VALUES + page * stride_v_blk + row * stride_v_tok,
                          SCALES + page * stride_s_blk + row * stride_s_tok, D, QB, INTERPRET)


@triton.jit(do_not_specialize=["num_slots"])
def _write_ds_latent_kernel(KV_C, K_PE, NOPE, SCALES, ROPE, SLOTS, stride_c_t, stride_pe_t, stride_blk, stride_tok,
                            stride_s_blk, stride_s_tok, stride_r_blk, stride_r_tok, block_size, num_slots, fault_ptr,
                            fault_flag_ptr, LKV: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                            INTERPRET: tl.constexpr):
    """Grid (T,): token t's latent [KV_C[t] ; K_PE[t]] into slot SLOTS[t] in the fp8_ds_mla format."""
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if (slot < -1) | (slot >= num_slots):
        record_fault(fault_ptr, fault_flag_ptr, FAULT_SLOT, t, slot, num_slots)
    elif slot >= 0:
        page = slot // block_size
        row = slot % block_size
        x = tl.load(KV_C + t * stride_c_t + tl.arange(0, LKV)).to(tl.float32)
        _store_fp8_blocks(x, NOPE + page * stride_blk + row * stride_tok,
                          SCALES + page * stride_s_blk + row * stride_s_tok, LKV, 128, INTERPRET)
        offs_r = tl.arange(0, BLOCK_R)
        r = tl.load(K_PE + t * stride_pe_t + offs_r, mask=offs_r < R)
        tl.store(ROPE + page * stride_r_blk + row * stride_r_tok + offs_r, r.to(tl.bfloat16), mask=offs_r < R)


def _use_triton(impl: str, device: torch.device) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


def write_index_keys(k_idx: torch.Tensor, index: torch.Tensor, slot_mapping: torch.Tensor, spec: AttentionSpec,
                     impl: str = "auto") -> None:
    """Quantise new tokens' indexer keys into the index cache.

    k_idx : [T, D] model dtype; index : the index cache (module docstring); slot_mapping : [>= T] int64, -1 skipped.
    impl : "triton" (CUDA or the interpreter), "torch" (host-checked, syncs) or "auto" (Triton on CUDA).
    """
    d = spec.sparse_indexer.index_head_dim
    num_tokens = k_idx.shape[0]
    if k_idx.dim() != 2 or k_idx.shape[1] != d:
        raise ValueError(f"index keys must be [T, {d}] (index_head_dim), got {tuple(k_idx.shape)}")
    if num_tokens == 0:
        return
    slots = slot_mapping[:num_tokens]
    if not _use_triton(impl, index.device):
        _write_index_keys_torch(k_idx, index, slots, spec)
        return
    if k_idx.stride(-1) != 1:
        raise ValueError("index keys need unit stride in their last dimension")
    if d != next_power_of_2(d):
        raise ValueError(f"the Triton index-key write needs a power-of-two index_head_dim, got {d}")
    values, scales = index_cache_views(index, spec)
    faults = fault_record(index.device)
    interpret = is_triton_interpreted()
    _write_index_keys_kernel[(num_tokens,)](
        k_idx, values, scales, slots, k_idx.stride(0), values.stride(0), values.stride(1), scales.stride(0),
        scales.stride(1), spec.block_size, index.shape[0] * spec.block_size, faults.record, faults.host_flag,
        D=d, QB=spec.sparse_indexer.quant_block, INTERPRET=interpret, num_warps=1)
    if interpret:
        raise_pending_faults(index.device)


def write_sparse_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor,
                        spec: AttentionSpec, impl: str = "auto") -> None:
    """Write new tokens' latent vectors (kv_c [T, Lkv], k_pe [T, R]) into the latent cache in the spec's format."""
    num_tokens = kv_c.shape[0]
    if spec.sparse_indexer.latent_format != "fp8_ds_mla":
        concat_and_cache_mla(kv_c, k_pe, latent, slot_mapping, 1.0, impl=impl)
        return
    if num_tokens == 0:
        return
    slots = slot_mapping[:num_tokens]
    if not _use_triton(impl, latent.device):
        _write_ds_latent_torch(kv_c, k_pe, latent, slots, spec)
        return
    nope, scales, rope = ds_latent_views(latent, spec)
    lkv, r = spec.kv_lora_rank, spec.qk_rope_head_dim
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("kv_c and k_pe need unit stride in their last dimension")
    if lkv != next_power_of_2(lkv):
        raise ValueError(f"the Triton fp8_ds_mla write needs a power-of-two kv_lora_rank, got {lkv}")
    faults = fault_record(latent.device)
    interpret = is_triton_interpreted()
    _write_ds_latent_kernel[(num_tokens,)](
        kv_c, k_pe, nope, scales, rope, slots, kv_c.stride(0), k_pe.stride(0), nope.stride(0), nope.stride(1),
        scales.stride(0), scales.stride(1), rope.stride(0), rope.stride(1), spec.block_size,
        latent.shape[0] * spec.block_size, faults.record, faults.host_flag, LKV=lkv, R=r,
        BLOCK_R=next_power_of_2(r), INTERPRET=interpret, num_warps=4)
    if interpret:
        raise_pending_faults(latent.device)


class SparseMLACacheHooks:
    """The cache hooks every sparse MLA backend shares, mixed into its backend class before ``AttentionBackend``:
    the layout in words, the latent cache's shape, and the allocation of both caches."""

    kv_cache_layout = ("SparseMLACache(latent: " + " or ".join(SPARSE_LATENT_LAYOUTS.values())
                       + ", index: [num_blocks, page bytes] uint8)")

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        """The latent cache's shape (the index cache's: :func:`sparse_mla_cache_shapes`)."""
        return sparse_mla_cache_shapes(num_blocks, spec)[0]

    @classmethod
    def allocate_kv_cache(cls, num_blocks: int, spec: AttentionSpec,
                          device: "torch.device | str" = "cpu") -> SparseMLACache:
        """An UNINITIALISED :class:`SparseMLACache` (latent and index caches)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        return allocate_sparse_mla_cache(num_blocks, spec, device)
