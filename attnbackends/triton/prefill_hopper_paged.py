"""Hopper causal prefill over the paged KV cache in Gluon: the warp-specialised kernel of :mod:`.prefill_hopper`
(a TMA loader warp, two ping-pong consumer warpgroups, a persistent schedule) with every key and value read from
the cache's pages, so one kernel serves fresh prompts, chunks on cached context, prefix-cache hits and
``forward(q, None, None)`` over keys already in the cache. The step's new keys and values are written into the
cache first (the write kernel, :func:`attnbackends.ops.kv_cache_write.reshape_and_cache`); the kernel then reads
only the query, the pages and the block table.

Query row i of a sequence with ``ctx = seq_len - query_len`` cached tokens sits at position ``ctx + i``: the
causal diagonal of the sequence's query block m0 .. m0 + 127 ends at key ``ctx + m0 + 127``, so a work item
(head, sequence, query block) reads key tiles ``j0 .. cdiv(ctx + min(query_len, m0 + 128), BLOCK_N) - 1``
(``j0`` past the tiles left of every row's sliding window, else 0). The work order, the barriers, the ping-pong
turns and the epilogue are those of :mod:`.prefill_hopper` (its module docstring), and so is the code of all but
the loader (:mod:`.prefill_hopper_common`, with its ``PAGED`` and option switches); what differs:

- **K/V tiles from pages.** A key tile of BLOCK_N keys is BLOCK_N / BOX TMA boxes of ``BOX = min(PAGE, BLOCK_N)``
  rows of one KV head (``[BOX, HEAD]``, rows ``(2 * page + kv) * PAGE + offset`` of the cache viewed as
  ``[num_blocks * 2 * PAGE, HKV * HEAD]``), counted in one expect-tx of the whole tile. Every lane of the loader
  warp holds every box's row (:func:`_tile_rows`), so issuing a box is a register move and a TMA; the rows are read
  from the block table a tile ahead (tile j + 2's while the loader waits for tile j + 1's stage), and a value tile
  uses its key tile's pages.
- **The sequence's end.** Every box of a tile is loaded: boxes past ``seq_len`` read the sequence's last page
  again (the block table is read only within the sequence). Those keys lie above every valid row's diagonal: their
  scores are replaced by -inf, NaN included. Their values enter P.V with weight 0, so they must be finite: before
  the P.V of an item's last tile (the only one that reaches past ``seq_len``) each consumer warpgroup zeroes the
  stage's value rows past the end (:func:`.prefill_hopper_common._zero_value_tail`), so the slots past a
  sequence's end may hold anything.
- **Options** (constexpr, off for the plain causal layer): a sliding window (``WINDOW`` keys: key n visible from
  position p iff p - WINDOW < n <= p; tiles left of the item's first row's window skipped, the left edge masked,
  the running max guarded while a row has seen no key), a logit soft-cap (``cap * tanh(s * scale / cap)`` before
  masking: the loop's scores are the tanh, its exponent scale ``cap * log2(e)``; the tanh computed as the
  config's ``softcap_tanh`` says, :data:`SOFTCAP_TANH`), attention sinks (one extra logit per query head, in the
  final normalisation only, with the max taken over it so nothing overflows).
- **Shapes**: head 64, 128 or 256 (:func:`default_paged_config`: head 256 uses 64-key tiles and no O staging so
  that Q and two K/V stages fit shared memory); any number of query heads per KV head (the item's KV head is
  ``h // (HQ // HKV)``); float16 or bfloat16; pages of 16 tokens or any larger power of two.

Gluon does not run under the Triton interpreter: ``tests/triton_backend/test_prefill_hopper_paged.py`` compiles
every variant for sm_90 on the CPU (no spills) and checks it against the float64 oracle on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..compat import gluon_available
from ..ops.launch_math import cdiv
from ..spec import AttentionSpec, AttentionType
from .prefill_hopper import BLOCK_M, CONSUMER_WARPS, ROWS_PER_WG, _LOG2E, HopperPrefillConfig, hopper_prefill_items
from .prefill_hopper_common import hopper_device_reason, launch_plan

__all__ = ["PAGED_KERNEL_NOTE", "PAGED_PREFILL_DEFAULT", "paged_default_reason", "PAGED_HEAD_SIZES", "plan_paged_split", "PagedPrefillConfig", "PagedPrefillPlan", "default_paged_config",
           "launch_paged_prefill", "paged_prefill_args", "paged_prefill_reason", "plan_paged_decodes",
           "plan_paged_prefill",
           "paged_cache_reason"]

PAGED_HEAD_SIZES = (64, 128, 256)
#: Whether a builder plans the paged kernel unless told (its ``hopper_paged_prefill`` option).
PAGED_PREFILL_DEFAULT = True
#: What the kernel serves, as ``attnbackends explain`` names it.
PAGED_KERNEL_NOTE = ("the paged Gluon Hopper kernel (every key from the cache's pages by TMA, a loader warp, two "
                     "ping-pong consumer warpgroups, persistent) for chunks on cached context, prefix-cache hits, "
                     "recomputation and key=None steps")

if gluon_available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from .prefill_hopper import _rows_descriptor, _smem_layout
    from .prefill_hopper_common import (
        _alloc_barriers,
        _consumer_partition,
        _init_barriers,
        _key_tiles,
        _load_q,
        _stage_buffers,
        _work_item,
    )


#: How the soft-cap's tanh is computed (the kernel's SOFTCAP constexpr; 0 is no cap): "approx", the hardware's
#: ``tanh.approx.f32`` (one multi-function-unit operation per score beside the softmax's exp2, relative error
#: about 5e-4, as FlashInfer computes it), or "exact", ``1 - 2 / (2^(2x log2 e) + 1)`` (float32 rounding; an exp2
#: and a reciprocal on that unit, which then limits the consumer warpgroups).
SOFTCAP_TANH = {"approx": 1, "exact": 2}


@dataclass(frozen=True)
class PagedPrefillConfig(HopperPrefillConfig):
    """Tile and schedule options: those of :class:`.prefill_hopper.HopperPrefillConfig`, and how a soft-capped
    layer computes tanh."""

    softcap_tanh: str = "approx"  # :data:`SOFTCAP_TANH`

    def __post_init__(self) -> None:
        if self.softcap_tanh not in SOFTCAP_TANH:
            raise ValueError(f"softcap_tanh must be one of {tuple(SOFTCAP_TANH)}, got {self.softcap_tanh!r}")
        super().__post_init__()


def default_paged_config(head_size: int) -> PagedPrefillConfig:
    """The backend's config for ``head_size``: 128-key tiles and two stages for heads 64 and 128 (three stages
    for 64, where they fit); 64-key tiles, no O staging for 256 (Q 64 KiB + 2 x 2 stages of 32 KiB)."""
    if head_size == 64:
        return PagedPrefillConfig(block_n=128, nbuf=3)
    if head_size == 256:
        return PagedPrefillConfig(block_n=64, nbuf=2, epi_tma=False)
    return PagedPrefillConfig()


@dataclass(frozen=True)
class PagedPrefillPlan:
    """The kernel's launch for sequences ``first_seq`` .. ``first_seq + num_seqs - 1`` of a batch (any cached
    context), within its first ``num_tokens`` query rows; the layer's options as the kernel's constexprs."""

    grid: tuple[int]
    first_seq: int
    num_seqs: int
    num_q_blocks: int
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    config: PagedPrefillConfig
    sliding_window: int = 0
    use_softcap: bool = False
    use_sinks: bool = False


def paged_prefill_reason(spec: AttentionSpec, compute_capability: "tuple[int, int] | None", *,
                         interpreted: bool = False, deterministic: bool = False) -> str:
    """Why the paged kernel cannot serve the prefills of a layer ``spec`` on a device of ``compute_capability``
    ("" if it can): causal decoder self-attention; query and value heads of 64, 128 or 256; a 16-bit model dtype
    and cache (an fp8 cache is not read by this kernel); pages of a power-of-two number of tokens; no ALiBi (rare in
    current models: the unified kernel serves it); not the builder's deterministic mode (the unified kernel serves
    every request there); compute capability 9.0, not under the Triton interpreter; Gluon installed."""
    if spec.attn_type is not AttentionType.DECODER:
        return f"{spec.attn_type.value} attention (needs causal decoder self-attention)"
    if spec.head_size not in PAGED_HEAD_SIZES:
        return f"head_size {spec.head_size} (needs one of {PAGED_HEAD_SIZES})"
    if spec.value_head_size != spec.head_size:
        return f"value head size {spec.value_head_size} (needs the key head size {spec.head_size})"
    if spec.torch_dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {spec.dtype} (needs float16 or bfloat16)"
    if spec.is_fp8_kv_cache:
        return "an fp8 KV cache (the paged kernel reads 16-bit pages)"
    if spec.block_size < 16 or spec.block_size & (spec.block_size - 1):
        return f"block_size {spec.block_size} (needs a power of two of at least 16)"
    if spec.alibi_slopes is not None:
        return "ALiBi"
    if deterministic:
        return "deterministic mode"
    return hopper_device_reason(compute_capability, interpreted, gluon_available())


def paged_default_reason(spec: AttentionSpec, compute_capability: "tuple[int, int] | None", *,
                         interpreted: bool = False) -> str:
    """Why a builder with default options does not plan the paged kernel for a layer ``spec`` ("" if it does):
    :func:`paged_prefill_reason`, or the default being off (:data:`PAGED_PREFILL_DEFAULT`)."""
    why = paged_prefill_reason(spec, compute_capability, interpreted=interpreted)
    if not why and not PAGED_PREFILL_DEFAULT:
        why = "off unless asked for (hopper_paged_prefill=True)"
    return why


def paged_cache_reason(kv_cache: torch.Tensor) -> str:
    """Why the kernel's TMA view cannot take this cache ("" if it can): [num_blocks, 2, block_size, num_kv_heads,
    head_size] contiguous, fewer than 2**31 rows of one KV head's keys or values, a 16-byte aligned pointer."""
    if not kv_cache.is_contiguous():
        return "a cache that is not contiguous"
    if kv_cache.shape[0] * 2 * kv_cache.shape[2] >= 2 ** 31:
        return "a cache of 2**31 or more token rows"
    if kv_cache.data_ptr() % 16:
        return "a cache pointer that is not 16-byte aligned"
    return ""


def plan_paged_prefill(*, spec: AttentionSpec, num_seqs: int, first_seq: int, max_query_len: int, num_tokens: int,
                       num_sms: int, config: Optional[PagedPrefillConfig] = None) -> PagedPrefillPlan:
    """The launch of sequences ``first_seq`` .. ``num_seqs - 1`` (the longest query has ``max_query_len`` tokens)
    of a batch of ``num_tokens`` tokens for a layer ``spec`` (:func:`paged_prefill_reason` empty) on a GPU of
    ``num_sms`` SMs."""
    config = config or default_paged_config(spec.head_size)
    if spec.head_size not in PAGED_HEAD_SIZES or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"head_size must be one of {PAGED_HEAD_SIZES} and num_heads a multiple of num_kv_heads, "
                         f"got head_size {spec.head_size}, {spec.num_heads} / {spec.num_kv_heads} heads")
    seqs = num_seqs - first_seq
    items = hopper_prefill_items(spec.num_heads, seqs, max_query_len)
    grid = (min(items, num_sms) if config.persistent else items,)
    return PagedPrefillPlan(grid, first_seq, seqs, cdiv(max(int(max_query_len), 1), BLOCK_M), int(num_tokens),
                            spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, config,
                            int(spec.sliding_window or 0), bool(spec.logits_soft_cap), bool(spec.has_sinks))


def paged_prefill_args(plan: PagedPrefillPlan, query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       softmax_scale: float, soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None):
    """(grid, args, kwargs) of ``plan``'s launch (also what an offline compile uses); tensors as in
    :func:`launch_paged_prefill`."""
    cfg, n, f = plan.config, plan.num_tokens, plan.first_seq
    num_blocks, _, page, hkv, head = kv_cache.shape
    box = min(page, cfg.block_n)
    c_desc = GluonTensorDescriptor(kv_cache, [num_blocks * 2 * page, hkv * head], [hkv * head, 1], [box, head],
                                   _smem_layout(kv_cache.dtype, cfg.block_n, head))
    qsl = query_start_loc[f:] if f else query_start_loc
    lens = seq_lens[f:] if f else seq_lens
    table = block_table[f:] if f else block_table
    softcap = SOFTCAP_TANH[cfg.softcap_tanh] if plan.use_softcap else 0
    if softcap:  # the loop's scores are tanh(s * scale / cap), its exponent scale cap * log2(e)
        qk_scale, cap_in = soft_cap * _LOG2E, softmax_scale / soft_cap * _tanh_input_scale(softcap)
    else:
        qk_scale, cap_in = softmax_scale * _LOG2E, 0.0
    epi = cfg.epi_tma
    o_desc = _rows_descriptor(output, n, ROWS_PER_WG) if epi else c_desc
    args = (_rows_descriptor(query, n, BLOCK_M), c_desc, o_desc, output, kv_cache, qsl, lens, table,
            sinks if plan.use_sinks else output, table.stride(0), output.stride(0), plan.num_seqs, plan.num_q_blocks,
            qk_scale, cap_in)
    kwargs = dict(HQ=plan.num_heads, HKV=plan.num_kv_heads, HEAD=head, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                  NBUF=cfg.nbuf, PAGE=page, PINGPONG=cfg.pingpong, EPI_TMA=epi, WINDOW=plan.sliding_window,
                  SOFTCAP=softcap, SINKS=plan.use_sinks,
                  REGS_CONSUMER=cfg.regs[0], REGS_LOAD=cfg.regs[1], num_warps=CONSUMER_WARPS)
    return plan.grid, args, kwargs


def _tanh_input_scale(softcap: int) -> float:
    """What the kernel's tanh (SOFTCAP mode ``softcap``) takes its argument multiplied by: 1 for the hardware
    tanh, ``2 log2(e)`` for the exp2-based one (its exponent is then the argument itself)."""
    return 1.0 if softcap == SOFTCAP_TANH["approx"] else 2.0 * _LOG2E


def launch_paged_prefill(plan: PagedPrefillPlan, query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         softmax_scale: float, soft_cap: float = 0.0,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``plan`` (no checks): causal attention of each planned sequence's queries over all its keys in the
    cache (the step's new keys written there before).

    Parameters
    ----------
    query, output : [>= num_tokens, num_heads, head_size] float16 / bfloat16, each with unit stride in the head
        dimension, heads contiguous, a 16-byte aligned row stride and pointer (:func:`.prefill_launch.tma_compatible`).
    kv_cache : [num_blocks, 2, block_size, num_kv_heads, head_size] in the query dtype (:func:`paged_cache_reason`).
    block_table : [num_reqs, max_blocks] int32; seq_lens : [num_reqs] int32 (cached + new tokens);
    query_start_loc : [num_reqs + 1] int32: the whole batch's (the plan's first sequence is ``plan.first_seq``).
    softmax_scale : the scale of q.k; soft_cap : the cap (``plan.use_softcap``);
    sinks : [num_heads] float32 (``plan.use_sinks``).
    """
    return launch_plan(_paged_prefill_kernel, paged_prefill_args, plan, output, query, output, kv_cache,
                       block_table, seq_lens, query_start_loc, softmax_scale, soft_cap, sinks)


if gluon_available():

    @gluon.jit
    def _tile_rows(bt, j, seq_len, KV: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):
        """The cache rows of the boxes of key (KV = 0) or value (KV = 1) tile j of one sequence: [BLOCK_N // BOX]
        int32, rows ``(2 * page + KV) * PAGE + offset`` of the [num_blocks * 2 * PAGE, HKV * HEAD] view, one per
        box of ``BOX = min(PAGE, BLOCK_N)`` keys. Keys past the sequence's end read its last page (their scores are
        masked, their values zeroed by the consumers), so the block table is read only within the sequence. Every
        lane holds every box's row (size_per_thread covers the tile): picking a box's row is a register move."""
        BOX: gl.constexpr = BLOCK_N if PAGE > BLOCK_N else PAGE
        NB: gl.constexpr = BLOCK_N // BOX
        layout: gl.constexpr = gl.BlockedLayout([NB], [32], [1], [0])
        k0 = j * BLOCK_N + gl.arange(0, NB, layout=layout) * BOX
        pages = gl.load(bt + gl.minimum(k0, seq_len - 1) // PAGE)
        return (2 * pages + KV) * PAGE + k0 % PAGE

    @gluon.jit
    def _issue_tile(c_desc, bufs, ready, empty, rows, g, col, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                    PAGE: gl.constexpr):
        """The boxes of one key or value tile (``rows``: :func:`_tile_rows`) into stage g % NBUF once both consumers
        released it; one expect-tx of the whole tile's bytes."""
        BOX: gl.constexpr = BLOCK_N if PAGE > BLOCK_N else PAGE
        NB: gl.constexpr = BLOCK_N // BOX
        box_ids = gl.arange(0, NB, layout=gl.BlockedLayout([NB], [32], [1], [0]))
        s = g % NBUF
        mbarrier.wait(empty.index(s), ((g // NBUF) & 1) ^ 1)
        bar = ready.index(s)
        buf = bufs.index(s)
        mbarrier.expect(bar, NB * c_desc.block_type.nbytes)
        for c in gl.static_range(NB):
            row = gl.max(gl.where(box_ids == c, rows, 0), axis=0)  # within each lane: rows is replicated
            tma.async_copy_global_to_shared(c_desc, [row, col], bar, buf.slice(c * BOX, BOX))

    @gluon.jit
    def _paged_loader(q_desc, c_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                      QSL, SEQ_LENS, BT, stride_bt, num_seqs, num_q_blocks, num_items, HQ: gl.constexpr,
                      HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NBUF: gl.constexpr, PAGE: gl.constexpr, WINDOW: gl.constexpr):
        """1 warp. Per work item: Q once both consumers are done with the previous one, K_{j0}, then per tile j
        K_{j+1} (one ahead) and V_j. The block-table reads run a tile ahead of the TMA: tile j + 2's rows are
        loaded while the loader waits for tile j + 1's stage, and V_j reuses K_j's pages."""
        PAGE_ROWS: gl.constexpr = PAGE  # a value box's row is its key box's plus PAGE
        it = 0
        i = 0
        for r in range(gl.cdiv(num_items, gl.num_programs(0))):
            h, seq, start, q_len, ctx, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ,
                                                                 BLOCK_M, SEQ_LENS)
            j0, j_end = _key_tiles(ctx, q_len, m0, BLOCK_M, BLOCK_N, WINDOW)
            if has_work:
                col = (h // (HQ // HKV)) * HEAD
                seq_len = ctx + q_len
                bt = BT + seq.to(gl.int64) * stride_bt
                nt = j_end - j0
                rows = _tile_rows(bt, j0, seq_len, 0, BLOCK_N, PAGE)
                rows_next = _tile_rows(bt, j0 + 1, seq_len, 0, BLOCK_N, PAGE)
                _load_q(q_desc, q_smem, q_ready, q_empty, i, start, m0, h, HEAD)
                _issue_tile(c_desc, k_bufs, k_ready, k_empty, rows, it, col, BLOCK_N, NBUF, PAGE)
                for jj in range(nt):
                    rows_v = rows + PAGE_ROWS
                    if jj + 1 < nt:
                        rows = rows_next
                        rows_next = _tile_rows(bt, j0 + jj + 2, seq_len, 0, BLOCK_N, PAGE)
                        _issue_tile(c_desc, k_bufs, k_ready, k_empty, rows, it + jj + 1, col, BLOCK_N, NBUF, PAGE)
                    _issue_tile(c_desc, v_bufs, v_ready, v_empty, rows_v, it + jj, col, BLOCK_N, NBUF, PAGE)
                it += nt
                i += 1

    @gluon.jit(do_not_specialize=["stride_bt", "num_seqs", "num_q_blocks", "cap_in"],
               do_not_specialize_on_alignment=["QSL", "SEQ_LENS", "BT", "SINK"])
    def _paged_prefill_kernel(
        q_desc, c_desc, o_desc,  # TMA over Q [T, HQ * HEAD] (box BLOCK_M x HEAD), the cache [num_blocks * 2 * PAGE,
                                 # HKV * HEAD] (box min(PAGE, BLOCK_N) x HEAD), O [T, HQ * HEAD] (64 x HEAD)
        O, CACHE, QSL, SEQ_LENS, BT, SINK,  # output rows; the cache; the planned sequences' offsets [num_seqs + 1],
                                            # lengths [num_seqs] and block-table rows (int32); sinks [HQ] float32
        stride_bt, stride_o_t, num_seqs, num_q_blocks,
        qk_scale, cap_in,  # exponent scale: softmax scale * log2(e), or cap * log2(e) with SOFTCAP; with SOFTCAP
                           # scale / cap times the tanh's input scale (_tanh_input_scale)
        HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NBUF: gl.constexpr, PAGE: gl.constexpr, PINGPONG: gl.constexpr, EPI_TMA: gl.constexpr, WINDOW: gl.constexpr,
        SOFTCAP: gl.constexpr, SINKS: gl.constexpr, REGS_CONSUMER: gl.constexpr,
        REGS_LOAD: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Grid (programs,): the HQ * num_seqs * num_q_blocks work items in rounds, as :mod:`.prefill_hopper`'s
        kernel; warps 4 (consumer 0) + 4 (consumer 1) + 1 (loader)."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        gl.static_assert(PAGE >= 8, "a box of whole 8-row swizzle atoms")
        num_items = HQ * num_seqs * num_q_blocks

        q_smem, k_bufs, v_bufs, o_smem = _stage_buffers(q_desc, c_desc, c_desc, o_desc, BLOCK_M, BLOCK_N, HEAD,
                                                        NBUF, EPI_TMA)
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn = _alloc_barriers(NBUF)
        _init_barriers(q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, NBUF)
        fence_async_shared()  # the initialised barriers visible to the async proxy (TMA complete-tx)
        gl.thread_barrier()

        gl.warp_specialize([
            (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                                   v_empty, turn, o_desc, O, QSL, SEQ_LENS, SINK, stride_o_t, num_seqs, num_q_blocks,
                                   num_items, qk_scale, cap_in, 0, HQ, HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG,
                                   EPI_TMA, WINDOW, SOFTCAP, SINKS)),
            (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                                   v_empty, turn, o_desc, O, QSL, SEQ_LENS, SINK, stride_o_t, num_seqs, num_q_blocks,
                                   num_items, qk_scale, cap_in, 1, HQ, HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG,
                                   EPI_TMA, WINDOW, SOFTCAP, SINKS)),
            (_paged_loader, (q_desc, c_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                             v_empty, QSL, SEQ_LENS, BT, stride_bt, num_seqs, num_q_blocks, num_items, HQ,
                             HKV, HEAD, BLOCK_M, BLOCK_N, NBUF, PAGE, WINDOW)),
        ], [4, 1], [REGS_CONSUMER, REGS_LOAD])


def plan_paged_split(builder, common, num_decodes: int, num_decode_tokens: int, causal: bool):
    """The builder's plan of a batch with prefills for the paged kernel: (the decodes' unified-kernel plan or None,
    the paged kernel's plan for requests ``num_decodes`` onwards). ``builder``: a
    :class:`.backend.TritonMetadataBuilder` (its spec, SM count, split-KV workspace and unified-plan arguments).

    The decodes run before the paged kernel on the same stream, so they have the GPU to themselves: their keys are
    split as a decode-only batch's are (the builder's ``decode_kv_splits`` over the decodes' longest sequence); a
    few decodes over long contexts beside a prompt chunk would otherwise run on a handful of SMs."""
    plan = plan_paged_prefill(spec=builder.spec, num_seqs=common.num_reqs, first_seq=num_decodes,
                              max_query_len=common.max_query_len, num_tokens=common.num_actual_tokens,
                              num_sms=builder.num_sms)
    return plan_paged_decodes(builder, common, num_decodes, num_decode_tokens, causal), plan


def plan_paged_decodes(builder, common, num_decodes: int, num_decode_tokens: int, causal: bool):
    """The unified-kernel plan of the ``num_decodes`` decodes before a paged prefill (:func:`plan_paged_split`'s
    first part; None without decodes)."""
    from .launch import plan_attention

    decode_plan = None
    if num_decodes:
        spec = builder.spec
        decode_max_seq_len = int(common.seq_lens_cpu[:num_decodes].max())
        num_kv_splits = builder.decode_kv_splits(num_decodes, decode_max_seq_len, builder.reorder_batch_threshold)
        decode_plan = plan_attention(
            num_tokens=num_decode_tokens, block_size=spec.block_size, num_seqs=num_decodes,
            max_query_len=builder.reorder_batch_threshold, max_seq_len=decode_max_seq_len, causal=causal,
            num_decodes=num_decodes, num_kv_splits=num_kv_splits, workspace=builder.workspace,
            decode_query_len=builder.reorder_batch_threshold, **builder._plan_args)
    return decode_plan
