"""Hopper causal prefill in Gluon, warp-specialised as FlashAttention-3 is, for prefills whose keys are all the
step's new tokens (no cached context): Q / K / V / O ``[tokens, heads, 128]`` 16-bit rows, sequences given by
``query_start_loc`` (varlen), GQA, causal; no window, soft-cap, ALiBi or sinks (:func:`hopper_prefill_reason`).

The builder picks it per batch (:func:`fresh_prefills`) for the prefill sequences of a batch whose prefills all
start at position 0; the decodes before them run on the unified kernel, and batches with cached context on the
Triton prefill kernel (:mod:`.prefill_launch`) or the unified one.

Work items are (head, sequence, 128-row query block), head fastest (the query heads of one KV head run side by
side, so their K/V tiles come from L2), the last (heaviest) query blocks first. Program p of P runs item
r * P + p in round r, in reverse order (r * P + P - 1 - p) on odd rounds (P = one per SM when ``persistent``, else
one program per item). Each program runs three partitions over NBUF stages of shared memory:

- **loader** (worker, 1 warp, REGS_LOAD registers): per item Q once ([128, 128] box, once both consumers are done
  with the previous item's Q), K_0, then per tile j K_{j+1} (one tile ahead: S_{j+1} is issued before P_j.V_j)
  and V_j, each into its own stage by TMA as soon as both consumers have released that stage;
- **consumer 0 / consumer 1** (the default partition and a 4-warp worker, one warpgroup each, REGS_CONSUMER
  registers): rows r0 = m0 + 64 * WG .. r0 + 63 of the query tile. Iteration j issues S_j = Q.K_j^T
  (``m64nBLOCK_Nk16``) and O += P_{j-1}.V_{j-1} (``m64n128k16``, P from registers), waits for S_j only, releases
  K_j, masks S_j (tiles on the diagonal only), runs the online softmax (log2 domain, the scale in the exp2's FMA)
  while P.V runs, then waits for P.V, releases V_{j-1} and rescales O. No instruction touches the accumulator of
  a wgmma in flight (ptxas would serialise every wgmma of the kernel otherwise). After the last S the consumer
  releases Q, issues the last P.V, normalises and stores its 64 rows while the loader already brings the next
  item's Q and first tiles;
- **ping-pong** (``PINGPONG``): the two consumers take turns issuing their wgmma (a turn = the one or two wgmma
  of an iteration), so the tensor cores run one warpgroup's products while the other one exponentiates.

- **writer** (worker, 1 warp, ``CACHE_WRITE`` only): the items of each KV head's first query head store their
  last (diagonal) key and value tiles into the paged cache from the stages the loader filled, one TMA store per
  page whose slots are that whole page in order; the other tokens are flagged for the write kernel after the
  launch (:func:`attnbackends.ops.kv_cache_write.finish_cache_write`). Every tile of a sequence is some query
  block's diagonal tile, so each is written once.

Barriers. Counters carried across a program's items: i (items done), it (tiles done; tile j of the item is
g = it + j, in stage s = g % NBUF with use parity (g // NBUF) & 1), and turns (n_tiles + 1 per item, so an item
starts at turn it + i):

    q_ready       count 1  loader expect-tx (+ Q bytes) per item; consumers wait parity i & 1
    q_empty       count 2  each consumer arrives once its last S of the item is complete; the loader waits parity
                           (i & 1) ^ 1 before Q of item i (a fresh barrier passes parity 1: item 0 goes at once)
    k_ready[s]    count 1  loader expect-tx (+ K bytes); consumers wait parity (g // NBUF) & 1 before S_g
    v_ready[s]    count 1  loader expect-tx (+ V bytes); consumers wait the same parity before P_g.V_g
    k_empty[s]    count 2  each consumer arrives once S_g is complete; the loader waits parity ((g // NBUF) & 1)
                           ^ 1 before loading tile g into stage s (the first NBUF loads pass at once)
    v_empty[s]    count 2  each consumer arrives once P_g.V_g is complete; the loader as for K
    store_go[s]   count 1  (CACHE_WRITE) the loader arrives once a stored tile's K and V loads into stage s are issued;
                           the writer waits it (its count of stored tiles in s gives the parity) before waiting
                           that tile's ready barriers, whose phase is then exactly the tile's
    k_stored[s]   count 1  (CACHE_WRITE) the writer's K (V) stores from stage s have read it; the loader waits it
    v_stored[s]            before refilling the stage's K (V) (per stage: a pending flag and the stored count)
    turn[w]       count 1  (PINGPONG) consumer w's k-th turn waits turn[w] parity (k & 1) ^ (1 - w) (consumer
                           0's first turn passes at once); after issuing, a consumer arrives on turn[1 - w]

Both consumers run the same n_tiles per item (the other warpgroup's extra diagonal tile is fully masked for
its rows, P = 0 there), so they make the same number of turns and arrivals, and every barrier anyone waits on
gets all its arrivals. No barrier can run a phase ahead of a waiter: a stage (or Q) is refilled only after both
consumers released its previous content, which each does only after waiting for that content.

Tails. The descriptors end at the batch's last token (``num_tokens``): rows past it, padding included, read as
zeros. Keys past a sequence's end (the next sequence's keys, or those zeros) lie above the causal diagonal of
every valid row, so they are masked (diagonal tiles are the only ones that reach past a valid row); their values
enter P.V with weight 0, so they must be finite: a NaN or inf in one sequence's values reaches the rows of the
sequence before it in the same key tile. Query rows past the end (the next sequence's queries or zeros) compute
values that are not stored. O is written by a TMA store of the warpgroup's 64 rows staged in shared memory when
all 64 rows are valid (``EPI_TMA``), by masked pointer stores otherwise: a TMA box would run into the next
sequence's rows.

Registers: ``gl.warp_specialize`` pads the 5 worker warps to 2 warpgroups (12 warps, 384 threads, kernel
.maxnreg 168, one program per SM); setmaxnreg gives the consumer worker REGS_CONSUMER, the loader's warpgroup
REGS_LOAD and the default partition what is left: (240, 24) gives both consumers 240.

The consumers, the work order and the shared memory are the code of :mod:`.prefill_hopper_common`, which the paged
kernel (:mod:`.prefill_hopper_paged`) runs too; the loader and the writer are this module's.

Gluon does not run under the Triton interpreter: the GPU tests (``tests/triton_backend/test_prefill_hopper.py``)
check the kernel against the oracle; on a CPU it is only compiled for sm_90
(``python -m benchmarks.compile_check``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from ..compat import gluon_available
from ..ops.launch_math import cdiv
from ..spec import AttentionSpec, AttentionType
from .prefill_hopper_common import hopper_device_reason, launch_plan

__all__ = ["HOPPER_PREFILL_HEAD_SIZE", "HopperPrefillConfig", "HopperPrefillPlan", "cache_write_reason",
           "fresh_prefills", "hopper_prefill_args", "hopper_prefill_items", "hopper_prefill_reason",
           "launch_hopper_prefill", "plan_hopper_prefill"]

HOPPER_PREFILL_HEAD_SIZE = 128  # P.V is one m64n128 wgmma per warpgroup; Q and O tiles [128, 128]
BLOCK_M = 128  # query rows per work item: two consumer warpgroups of one wgmma M tile (64 rows) each
ROWS_PER_WG = 64
CONSUMER_WARPS = 4  # the default partition: consumer 0
_LOG2E = 1.4426950408889634

if gluon_available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from .prefill_hopper_common import (
        _alloc_barriers,
        _consumer_partition,
        _init_barriers,
        _load_q,
        _stage_buffers,
        _work_item,
    )


@dataclass(frozen=True)
class HopperPrefillConfig:
    """The kernel's tile and schedule options; the defaults are the backend's config.

    block_n : keys per tile (64 or 128). nbuf : shared-memory stages for K and for V (>= 2). pingpong : the two
    consumer warpgroups take turns issuing wgmma. persistent : one program per SM looping over the work items (else
    one program per item). epi_tma : O of a warpgroup's 64 rows goes out by one TMA store when all are valid.
    regs : setmaxnreg of the consumer worker and of the loader warp (the default consumer gets the rest)."""

    block_n: int = 128
    nbuf: int = 2
    pingpong: bool = True
    persistent: bool = True
    epi_tma: bool = True
    regs: tuple[int, int] = (240, 24)

    def __post_init__(self) -> None:
        if self.block_n not in (64, 128) or self.nbuf < 2:
            raise ValueError(f"block_n must be 64 or 128 and nbuf >= 2, got block_n {self.block_n}, nbuf {self.nbuf}")
        regs = tuple(self.regs)
        if len(regs) != 2 or regs[0] % 8 or regs[1] % 8 or not 24 <= regs[1] <= regs[0] <= 256:
            raise ValueError(f"regs must be (consumer, loader) multiples of 8 with 24 <= loader <= consumer <= 256, "
                             f"got {self.regs}")
        object.__setattr__(self, "regs", regs)


@dataclass(frozen=True)
class HopperPrefillPlan:
    """The kernel's launch for one batch: sequences ``first_seq`` .. ``first_seq + num_seqs - 1``, every one with
    no cached context, within the batch's first ``num_tokens`` token rows."""

    grid: tuple[int]
    first_seq: int
    num_seqs: int
    num_q_blocks: int  # query blocks of BLOCK_M rows of the longest sequence
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    config: HopperPrefillConfig
    #: The kernel also writes the planned tokens' keys and values into the paged cache (pages of ``block_size``
    #: tokens), leaving flagged tokens to :func:`attnbackends.ops.kv_cache_write.finish_cache_write`.
    writes_cache: bool = False
    block_size: int = 16


def hopper_prefill_reason(spec: AttentionSpec, compute_capability: "tuple[int, int] | None", *,
                          interpreted: bool = False, deterministic: bool = False) -> str:
    """Why the kernel cannot serve the prefills of a layer ``spec`` on a device of ``compute_capability`` (None: not
    a CUDA device) ("" if it can): causal decoder self-attention; query, key and value heads of 128; a 16-bit model
    dtype; a 16-bit cache (it reads the step's keys and values as given, where an fp8 cache would round them); no
    sliding window, soft-cap, ALiBi or sinks; not the builder's deterministic mode (the kernel serves only batches
    whose prefills are all fresh, so a request's kernel, and its rounding, would depend on the rest of its batch);
    compute capability 9.0 (wgmma, setmaxnreg), not under the Triton interpreter; Gluon installed."""
    if spec.attn_type is not AttentionType.DECODER:
        return f"{spec.attn_type.value} attention (needs causal decoder self-attention)"
    if spec.head_size != HOPPER_PREFILL_HEAD_SIZE:
        return f"head_size {spec.head_size} (needs {HOPPER_PREFILL_HEAD_SIZE})"
    if spec.value_head_size != HOPPER_PREFILL_HEAD_SIZE:
        return f"value head size {spec.value_head_size} (needs {HOPPER_PREFILL_HEAD_SIZE})"
    if spec.torch_dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {spec.dtype} (needs float16 or bfloat16)"
    if spec.is_fp8_kv_cache:
        return "an fp8 KV cache"
    for present, what in ((spec.sliding_window, "a sliding window"), (spec.logits_soft_cap, "a logits soft-cap"),
                          (spec.alibi_slopes is not None, "ALiBi"), (spec.has_sinks, "attention sinks"),
                          (deterministic, "deterministic mode")):
        if present:
            return what
    return hopper_device_reason(compute_capability, interpreted, gluon_available())


def fresh_prefills(query_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, first_seq: int) -> bool:
    """Whether requests ``first_seq`` onwards have no cached context (every key is a new token): int32 CPU tensors
    [num_reqs]."""
    return bool(np.array_equal(query_lens_cpu.numpy()[first_seq:], seq_lens_cpu.numpy()[first_seq:]))


def hopper_prefill_items(num_heads: int, num_seqs: int, max_query_len: int) -> int:
    """Work items of the kernel: query heads x sequences x query blocks of the longest sequence."""
    return num_heads * num_seqs * cdiv(max(int(max_query_len), 1), BLOCK_M)


def cache_write_reason(config: HopperPrefillConfig, block_size: int) -> str:
    """Why the kernel cannot write the cache itself with ``config`` and pages of ``block_size`` tokens ("" if it
    can): it stores whole pages of its diagonal key tiles, so a page must divide a tile of BLOCK_M keys."""
    if config.block_n != BLOCK_M:
        return f"key tiles of {config.block_n} rows (needs {BLOCK_M}: one diagonal tile per query block)"
    if block_size < 8 or BLOCK_M % block_size:
        return f"block_size {block_size} (needs a divisor of {BLOCK_M} of at least 8)"
    return ""


def plan_hopper_prefill(*, num_heads: int, num_kv_heads: int, head_size: int, num_seqs: int, first_seq: int,
                        max_query_len: int, num_tokens: int, num_sms: int,
                        config: Optional[HopperPrefillConfig] = None, writes_cache: bool = False,
                        block_size: int = 16) -> HopperPrefillPlan:
    """The launch of sequences ``first_seq`` .. ``num_seqs - 1`` (the longest has ``max_query_len`` tokens) of a
    batch of ``num_tokens`` tokens, on a GPU of ``num_sms`` SMs; ``writes_cache``: the kernel writes the planned
    tokens into a cache of ``block_size``-token pages (:func:`cache_write_reason` must be empty)."""
    config = config or HopperPrefillConfig()
    if head_size != HOPPER_PREFILL_HEAD_SIZE or num_heads % num_kv_heads:
        raise ValueError(f"head_size must be {HOPPER_PREFILL_HEAD_SIZE} and num_heads a multiple of num_kv_heads, "
                         f"got head_size {head_size}, {num_heads} / {num_kv_heads} heads")
    seqs = num_seqs - first_seq
    num_q_blocks = cdiv(max(int(max_query_len), 1), BLOCK_M)
    items = hopper_prefill_items(num_heads, seqs, max_query_len)
    grid = (min(items, num_sms) if config.persistent else items,)
    if writes_cache and cache_write_reason(config, block_size):
        raise ValueError(f"the kernel cannot write this cache: {cache_write_reason(config, block_size)}")
    return HopperPrefillPlan(grid, first_seq, seqs, num_q_blocks, int(num_tokens), num_heads, num_kv_heads,
                             head_size, config, bool(writes_cache), int(block_size))


@lru_cache(maxsize=None)
def _smem_layout(dtype: torch.dtype, rows: int, head: int):
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, head], gdt)


def _rows_descriptor(t: torch.Tensor, num_tokens: int, rows: int):
    """TMA over ``t[:num_tokens]`` [tokens, heads, head] as [tokens, heads * head] rows (heads contiguous, row
    stride ``t.stride(0)``), boxes of [rows, head]."""
    head = t.shape[2]
    return GluonTensorDescriptor(t, [num_tokens, t.shape[1] * head], [t.stride(0), 1], [rows, head],
                                 _smem_layout(t.dtype, rows, head))


def hopper_prefill_args(plan: HopperPrefillPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        output: torch.Tensor, query_start_loc: torch.Tensor, softmax_scale: float,
                        kv_cache: Optional[torch.Tensor] = None, slot_mapping: Optional[torch.Tensor] = None,
                        todo: Optional[torch.Tensor] = None):
    """(grid, args, kwargs) of ``plan``'s launch of the kernel (also what an offline compile uses); tensors as in
    :func:`launch_hopper_prefill`."""
    cfg, n = plan.config, plan.num_tokens
    qsl = query_start_loc[plan.first_seq:] if plan.first_seq else query_start_loc
    k_desc = _rows_descriptor(key, n, cfg.block_n)
    if plan.writes_cache:
        num_blocks, _, page, hkv, head = kv_cache.shape
        c_desc = GluonTensorDescriptor(kv_cache, [num_blocks * 2 * page, hkv * head], [hkv * head, 1], [page, head],
                                       _smem_layout(kv_cache.dtype, cfg.block_n, head))
        cache_args = (c_desc, slot_mapping, todo, num_blocks * page)
    else:
        cache_args = (k_desc, query_start_loc, query_start_loc, 0)  # not read: the kernel's cache write is off
    args = (_rows_descriptor(query, n, BLOCK_M), k_desc, _rows_descriptor(value, n, cfg.block_n),
            _rows_descriptor(output, n, ROWS_PER_WG), output, qsl, output.stride(0), plan.num_seqs,
            plan.num_q_blocks, softmax_scale * _LOG2E, *cache_args)
    kwargs = dict(HQ=plan.num_heads, HKV=plan.num_kv_heads, HEAD=plan.head_size, BLOCK_M=BLOCK_M,
                  BLOCK_N=cfg.block_n, NBUF=cfg.nbuf, PINGPONG=cfg.pingpong, EPI_TMA=cfg.epi_tma,
                  CACHE_WRITE=plan.writes_cache, PAGE=plan.block_size, REGS_CONSUMER=cfg.regs[0],
                  REGS_LOAD=cfg.regs[1], num_warps=CONSUMER_WARPS)
    return plan.grid, args, kwargs


def launch_hopper_prefill(plan: HopperPrefillPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          output: torch.Tensor, query_start_loc: torch.Tensor, softmax_scale: float,
                          kv_cache: Optional[torch.Tensor] = None, slot_mapping: Optional[torch.Tensor] = None,
                          todo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``plan`` (no checks): causal attention of each planned sequence's queries over its own new keys, and
    for a plan that ``writes_cache``, their keys and values into the cache.

    Parameters
    ----------
    query, output : [>= num_tokens, num_heads, 128] float16 / bfloat16; key, value : [>= num_tokens, num_kv_heads,
        128], same dtype (rows as in query). Each with unit stride in the head dimension, heads contiguous, a row
        stride and a data pointer 16-byte aligned (:func:`.prefill_launch.tma_compatible`); views of a fused
        projection qualify.
    query_start_loc : [num_reqs + 1] int32 on the device: the whole batch's offsets.
    softmax_scale : the scale of q.k.
    kv_cache : (``writes_cache``) [num_blocks, 2, block_size, num_kv_heads, 128] in the query dtype, contiguous.
    slot_mapping : (``writes_cache``) [>= num_tokens] int64 contiguous: each token's slot (any values: a page is
        stored by TMA only where its tokens' slots are that whole page in order).
    todo : (``writes_cache``) [>= num_tokens] int8, zero on entry: the kernel sets the tokens it did not write;
        :func:`attnbackends.ops.kv_cache_write.finish_cache_write` writes them and clears the flags.
    """
    return launch_plan(_prefill_hopper_kernel, hopper_prefill_args, plan, output, query, key, value, output,
                       query_start_loc, softmax_scale, kv_cache, slot_mapping, todo)


if gluon_available():

    @gluon.jit
    def _load_tile(desc, bufs, ready, empty, row, col, g, NBUF: gl.constexpr):
        """TMA the [BLOCK_N, HEAD] tile starting at token ``row`` into stage g % NBUF (g: the program's running tile
        count) once both consumers released the stage's previous tile, g - NBUF."""
        s = g % NBUF
        mbarrier.wait(empty.index(s), ((g // NBUF) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [row, col], bar, bufs.index(s))

    @gluon.jit
    def _page_runs(SLOTS, TODO, t0, n_rows, num_slots, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):
        """The PAGE-token chunks of a key tile (rows t0 .. t0 + n_rows - 1 of the batch): [BLOCK_N // PAGE] (whether
        the chunk's slots are one whole page in order, that page). The tokens of the other chunks are flagged in
        ``TODO`` for the write kernel to finish (slots -1, outside the cache, out of order, or a partial page)."""
        NCH: gl.constexpr = BLOCK_N // PAGE
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (PAGE // 4), PAGE // 4], [1, 1], [1, 0])
        c = gl.arange(0, NCH, layout=gl.SliceLayout(1, layout))
        k = gl.arange(0, PAGE, layout=gl.SliceLayout(0, layout))
        row = gl.expand_dims(c, 1) * PAGE + gl.expand_dims(k, 0)
        valid = row < n_rows
        slot = gl.load(SLOTS + t0 + row, mask=valid, other=-1)
        inside = valid & (slot >= 0) & (slot < num_slots)  # num_slots < 2**31: an inside slot fits in int32
        base = gl.where(inside, slot, -1).to(gl.int32) - gl.expand_dims(k, 0)  # one value along a chunk in order
        lo = gl.min(base, axis=1)
        regular = (lo == gl.max(base, axis=1)) & (gl.min(inside.to(gl.int32), axis=1) == 1) & (lo % PAGE == 0)
        todo = valid & gl.expand_dims(~regular, 1)
        gl.store(TODO + t0 + row, gl.full([NCH, PAGE], 1, gl.int8, layout=layout), mask=todo)
        return regular, lo // PAGE, c

    @gluon.jit
    def _store_pages(c_desc, tile, regular, page, chunk, kv: gl.constexpr, col, BLOCK_N: gl.constexpr,
                     PAGE: gl.constexpr):
        """TMA-store each regular chunk of a key (kv = 0) or value (kv = 1) tile in shared memory to its page: cache
        rows (2 * page + kv) * PAGE .. + PAGE - 1 of the [num_blocks * 2 * PAGE, HKV * HEAD] view, columns col .."""
        for ch in gl.static_range(BLOCK_N // PAGE):
            if gl.max(gl.where((chunk == ch) & regular, 1, 0), axis=0) > 0:
                pg = gl.max(gl.where(chunk == ch, page, 0), axis=0)
                tma.async_copy_shared_to_global(c_desc, [(2 * pg + kv) * PAGE, col], tile.slice(ch * PAGE, PAGE))

    @gluon.jit
    def _wait_stored(stored, s, pend0, pend1, cnt0, cnt1):
        """Before the loader refills stage s of one ring (K or V): if the writer has a store pending from it, wait
        until that store has read the stage. Returns the ring's pending flags with stage s's cleared."""
        pend = gl.where(s == 0, pend0, pend1)
        cnt = gl.where(s == 0, cnt0, cnt1)
        if pend != 0:
            mbarrier.wait(stored.index(s), (cnt - 1) & 1)
        return gl.where(s == 0, 0, pend0), gl.where(s == 0, pend1, 0)

    @gluon.jit
    def _loader_partition(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, store_go, k_stored, v_stored, QSL, num_seqs, num_q_blocks, num_items,
                          HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, NBUF: gl.constexpr, CACHE_WRITE: gl.constexpr):
        """1 warp. Per work item: Q (once both consumers' last Q.K^T of the previous item is complete), K_0, then
        per tile j K_{j+1} (one tile ahead: S_{j+1} is issued before P_j.V_j) and V_j.

        ``CACHE_WRITE`` (NBUF = 2): the last (diagonal) tile of each KV head's first query head's items is stored
        into the cache by the writer warp (:func:`_writer_partition`). The loader tells it the tile's loads are
        issued (``store_go[s]``) and refills a K (V) stage only once the writer's K (V) stores have read it
        (``k_stored[s]``, ``v_stored[s]``; per stage: pending flags and the count of stored tiles, whose parity
        the waits use)."""
        it = 0
        i = 0
        pk0 = 0
        pk1 = 0
        pv0 = 0
        pv1 = 0
        cnt0 = 0
        cnt1 = 0
        for r in range(gl.cdiv(num_items, gl.num_programs(0))):
            h, _, start, q_len, _, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ, BLOCK_M)
            if has_work:
                col_kv = (h // (HQ // HKV)) * HEAD
                n_tiles = gl.cdiv(gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
                _load_q(q_desc, q_smem, q_ready, q_empty, i, start, m0, h, HEAD)
                if CACHE_WRITE:
                    pk0, pk1 = _wait_stored(k_stored, it % NBUF, pk0, pk1, cnt0, cnt1)
                _load_tile(k_desc, k_bufs, k_ready, k_empty, start, col_kv, it, NBUF)
                for j in range(n_tiles):
                    if j + 1 < n_tiles:
                        if CACHE_WRITE:
                            pk0, pk1 = _wait_stored(k_stored, (it + j + 1) % NBUF, pk0, pk1, cnt0, cnt1)
                        _load_tile(k_desc, k_bufs, k_ready, k_empty, start + (j + 1) * BLOCK_N, col_kv, it + j + 1,
                                   NBUF)
                    if CACHE_WRITE:
                        pv0, pv1 = _wait_stored(v_stored, (it + j) % NBUF, pv0, pv1, cnt0, cnt1)
                    _load_tile(v_desc, v_bufs, v_ready, v_empty, start + j * BLOCK_N, col_kv, it + j, NBUF)
                if CACHE_WRITE:
                    if h % (HQ // HKV) == 0:
                        s = (it + n_tiles - 1) % NBUF
                        mbarrier.arrive(store_go.index(s), count=1)
                        pk0 = gl.where(s == 0, 1, pk0)
                        pk1 = gl.where(s == 0, pk1, 1)
                        pv0 = gl.where(s == 0, 1, pv0)
                        pv1 = gl.where(s == 0, pv1, 1)
                        cnt0 = gl.where(s == 0, cnt0 + 1, cnt0)
                        cnt1 = gl.where(s == 0, cnt1, cnt1 + 1)
                it += n_tiles
                i += 1

    @gluon.jit
    def _writer_partition(c_desc, k_bufs, v_bufs, k_ready, v_ready, store_go, k_stored, v_stored, QSL, SLOTS, TODO,
                          num_slots, num_seqs, num_q_blocks, num_items, HQ: gl.constexpr, HKV: gl.constexpr,
                          HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                          PAGE: gl.constexpr):
        """1 warp (``CACHE_WRITE``). The items of each KV head's first query head write their last (diagonal) key
        and value tiles into the paged cache, so every tile of a sequence is written once: each chunk of PAGE tokens
        whose slots are one whole page in order goes by one TMA store from the stage the loader filled; the other
        tokens are flagged in ``TODO`` (:func:`_page_runs`). Per stored tile: check the slots (before the tile
        lands), wait ``store_go[s]`` (its loads are issued: the ready barriers' phases are then the tile's), K
        ready, store K, wait until those stores have read the stage, arrive ``k_stored[s]``; the same for V."""
        it = 0
        cnt0 = 0
        cnt1 = 0
        for r in range(gl.cdiv(num_items, gl.num_programs(0))):
            h, _, start, q_len, _, m0, has_work = _work_item(r, QSL, num_seqs, num_q_blocks, num_items, HQ, BLOCK_M)
            if has_work:
                n_tiles = gl.cdiv(gl.minimum(q_len, m0 + BLOCK_M), BLOCK_N)
                if h % (HQ // HKV) == 0:
                    last = it + n_tiles - 1
                    s = last % NBUF
                    col_kv = (h // (HQ // HKV)) * HEAD
                    regular, page, chunk = _page_runs(SLOTS, TODO, start + (n_tiles - 1) * BLOCK_N,
                                                      q_len - (n_tiles - 1) * BLOCK_N, num_slots, BLOCK_N, PAGE)
                    mbarrier.wait(store_go.index(s), gl.where(s == 0, cnt0, cnt1) & 1)
                    mbarrier.wait(k_ready.index(s), (last // NBUF) & 1)
                    _store_pages(c_desc, k_bufs.index(s), regular, page, chunk, 0, col_kv, BLOCK_N, PAGE)
                    tma.store_wait(0)
                    mbarrier.arrive(k_stored.index(s), count=1)
                    mbarrier.wait(v_ready.index(s), (last // NBUF) & 1)
                    _store_pages(c_desc, v_bufs.index(s), regular, page, chunk, 1, col_kv, BLOCK_N, PAGE)
                    tma.store_wait(0)
                    mbarrier.arrive(v_stored.index(s), count=1)
                    cnt0 = gl.where(s == 0, cnt0 + 1, cnt0)
                    cnt1 = gl.where(s == 0, cnt1, cnt1 + 1)
                it += n_tiles

    @gluon.jit(do_not_specialize=["num_seqs", "num_q_blocks", "num_slots"],
               do_not_specialize_on_alignment=["QSL", "SLOTS", "TODO"])
    def _prefill_hopper_kernel(
        q_desc, k_desc, v_desc, o_desc,  # TMA over Q [T, HQ * HEAD] (box BLOCK_M x HEAD), K / V [T, HKV * HEAD]
                                         # (BLOCK_N x HEAD), O [T, HQ * HEAD] (64 x HEAD)
        O, QSL,  # [T, HQ, HEAD] (heads contiguous); [num_seqs + 1] int32, the planned sequences' offsets
        stride_o_t, num_seqs, num_q_blocks, qk_scale,  # qk_scale: softmax scale * log2(e)
        c_desc, SLOTS, TODO, num_slots,  # CACHE_WRITE: TMA over the cache [num_blocks * 2 * PAGE, HKV * HEAD] (box
                                         # PAGE x HEAD), the planned tokens' slots (int64), their to-do flags (int8)
        HQ: gl.constexpr, HKV: gl.constexpr, HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NBUF: gl.constexpr, PINGPONG: gl.constexpr, EPI_TMA: gl.constexpr, CACHE_WRITE: gl.constexpr,
        PAGE: gl.constexpr, REGS_CONSUMER: gl.constexpr, REGS_LOAD: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Grid (programs,): each program runs its share of the HQ * num_seqs * num_q_blocks work items in rounds
        (:func:`.prefill_hopper_common._work_item`; one item each when programs = items, persistent when programs =
        SMs). Warps: 4 (consumer 0, the default partition) + 4 (consumer 1) + 1 (TMA loader), + 1 (writer) with
        ``CACHE_WRITE``. The batch's sizes are not specialised on (one compiled kernel serves every batch of a
        layer)."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        gl.static_assert(not CACHE_WRITE or (BLOCK_N == BLOCK_M and BLOCK_N % PAGE == 0 and PAGE >= 8
                                             and NBUF == 2),
                         "the cache write stores whole pages of each query block's diagonal key tile, two stages")
        num_items = HQ * num_seqs * num_q_blocks

        q_smem, k_bufs, v_bufs, o_smem = _stage_buffers(q_desc, k_desc, v_desc, o_desc, BLOCK_M, BLOCK_N, HEAD,
                                                        NBUF, EPI_TMA)
        q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn = _alloc_barriers(NBUF)
        store_go = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        k_stored = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_stored = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        _init_barriers(q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, NBUF)
        for s in gl.static_range(NBUF):
            mbarrier.init(store_go.index(s), count=1)  # CACHE_WRITE: the loader issued a stored tile's loads
            mbarrier.init(k_stored.index(s), count=1)  # the writer's K stores have read the stage
            mbarrier.init(v_stored.index(s), count=1)  # its V stores have
        fence_async_shared()  # the initialised barriers visible to the async proxy (TMA complete-tx)
        gl.thread_barrier()

        PARTITIONS: gl.constexpr = 4 if CACHE_WRITE else 3  # the writer warp only where the kernel writes the cache
        gl.warp_specialize([
            (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                                   v_empty, turn, o_desc, O, QSL, None, None, stride_o_t, num_seqs, num_q_blocks,
                                   num_items, qk_scale, 0.0, 0, HQ, HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG, EPI_TMA,
                                   0, 0, False)),
            (_consumer_partition, (q_smem, o_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty,
                                   v_empty, turn, o_desc, O, QSL, None, None, stride_o_t, num_seqs, num_q_blocks,
                                   num_items, qk_scale, 0.0, 1, HQ, HEAD, BLOCK_M, BLOCK_N, NBUF, PINGPONG, EPI_TMA,
                                   0, 0, False)),
            (_loader_partition, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready,
                                 k_empty, v_empty, store_go, k_stored, v_stored, QSL, num_seqs, num_q_blocks,
                                 num_items, HQ, HKV, HEAD, BLOCK_M, BLOCK_N, NBUF, CACHE_WRITE)),
            (_writer_partition, (c_desc, k_bufs, v_bufs, k_ready, v_ready, store_go, k_stored, v_stored, QSL, SLOTS,
                                 TODO, num_slots, num_seqs, num_q_blocks, num_items, HQ, HKV, HEAD, BLOCK_M,
                                 BLOCK_N, NBUF, PAGE)),
        ][:PARTITIONS], [4, 1, 1][:PARTITIONS - 1], [REGS_CONSUMER, REGS_LOAD, REGS_LOAD][:PARTITIONS - 1])
