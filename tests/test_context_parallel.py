"""Decode context parallelism (issue 8): block assignment helpers, the N-way merge, and 2-rank runs.

The distributed checks run in ONE spawned gloo group of 2 processes (spawning costs seconds), each rank holding
only its interleaved share of the KV blocks; the merged output must equal the float64 oracle over the whole cache.
The same checks with NCCL and the GPU kernels are marked ``gpu`` and need two GPUs.
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnbackends import AttentionSpec
from attnbackends.ops.quant import quantize_for_cache
from attnbackends.parallel import (
    ContextParallelLayout,
    block_owner,
    build_local_metadata,
    check_context_parallel_spec,
    cp_decode_attention,
    local_block_indices,
    local_num_blocks,
    local_seq_len,
    merge_attn_states_n,
    shard_block_table,
)
from attnbackends.reference.functional import sequence_attention
from attnbackends.testing import make_random_batch, oracle_attention
from attnbackends.testing.cases import SequenceShape


# ---------------------------------------------------------------------------------------------------------------
# Block assignment (pure python)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size,interleave", [(1, 1), (2, 1), (2, 3), (3, 2), (4, 1)])
def test_block_assignment_matches_brute_force(world_size, interleave):
    for num_blocks in range(0, 30):
        owners = [block_owner(i, world_size, interleave) for i in range(num_blocks)]
        assert owners == [(i // interleave) % world_size for i in range(num_blocks)]
        for rank in range(world_size):
            expected = [i for i, r in enumerate(owners) if r == rank]
            assert local_block_indices(num_blocks, rank, world_size, interleave) == expected
            assert local_num_blocks(num_blocks, rank, world_size, interleave) == len(expected)


@pytest.mark.parametrize("world_size,interleave,block_size", [(2, 1, 16), (2, 2, 16), (3, 1, 4), (4, 3, 8)])
def test_local_seq_lens_partition_the_sequence(world_size, interleave, block_size):
    for seq_len in range(0, 200, 3):
        parts = [local_seq_len(seq_len, block_size, r, world_size, interleave) for r in range(world_size)]
        assert sum(parts) == seq_len
        for rank, n in enumerate(parts):
            # tokens held = tokens of the blocks owned, counted position by position
            layout = ContextParallelLayout(world_size, rank, block_size, interleave)
            assert n == sum(layout.owns_position(p) for p in range(seq_len))


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="rank"):
        ContextParallelLayout(world_size=2, rank=2, block_size=16)
    with pytest.raises(ValueError, match="interleave"):
        ContextParallelLayout(world_size=2, rank=0, block_size=16, interleave=0)
    with pytest.raises(ValueError, match="world_size"):
        block_owner(0, 0)


def test_build_local_metadata_single_process():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=16)
    # seq lens 5 (1 block), 16, 17 (2 blocks), 40 (3 blocks), 70 (5 blocks)
    shapes = [SequenceShape(1, c) for c in (4, 15, 16, 39, 69)]
    batch = make_random_batch(spec, shapes, seed=1, pad_tokens=2)
    common = batch.common
    table = common.block_table
    writers = torch.zeros(len(shapes), dtype=torch.int64)
    for rank in range(2):
        layout = ContextParallelLayout(2, rank, 16, interleave=1)
        local = build_local_metadata(common, layout)
        assert local.seq_lens_cpu.tolist() == [layout.local_seq_len(s.seq_len) for s in shapes]
        assert local.max_seq_len == max(local.seq_lens_cpu.tolist())
        assert local.causal is False
        assert torch.equal(local.block_table, shard_block_table(table, layout))
        assert local.slot_mapping.shape == common.slot_mapping.shape
        assert (local.slot_mapping[-2:] == -1).all()  # padding stays padding
        for i, s in enumerate(shapes):
            slot = int(local.slot_mapping[i])
            if layout.owns_position(s.seq_len - 1):
                # shared page-id space: the owner writes exactly the global slot
                assert slot == int(common.slot_mapping[i])
                writers[i] += 1
            else:
                assert slot == -1
    assert writers.tolist() == [1] * len(shapes)  # every new token is written by exactly one rank
    with pytest.raises(ValueError, match="decode"):
        prefill = make_random_batch(spec, [SequenceShape(3, 4)], seed=2)
        build_local_metadata(prefill.common, ContextParallelLayout(2, 0, 16))


def test_unsupported_features_raise_at_setup():
    base = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=16)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        check_context_parallel_spec(AttentionSpec(**base, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        check_context_parallel_spec(AttentionSpec(**base, sliding_window=8))
    check_context_parallel_spec(AttentionSpec(**base, logits_soft_cap=20.0, has_sinks=True))


def test_merge_n_equals_full_attention():
    torch.manual_seed(0)
    q = torch.randn(3, 4, 32, dtype=torch.float64)
    k = torch.randn(50, 2, 32, dtype=torch.float64)
    v = torch.randn(50, 2, 32, dtype=torch.float64)
    pos = torch.full((3,), 50)
    full, full_lse = sequence_attention(q, k, v, pos, scale=0.2, causal=False, compute_dtype=torch.float64)
    cuts = [0, 7, 7, 30, 50]  # includes an empty part (lse -inf)
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = sequence_attention(q, k[a:b], v[a:b], pos, scale=0.2, causal=False, compute_dtype=torch.float64)
        outs.append(o.float())
        lses.append(l.float())
    assert torch.isinf(lses[1]).all()
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        out, lse = merge_attn_states_n([outs[i] for i in order], [lses[i] for i in order])
        torch.testing.assert_close(out, full.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse.float(), atol=1e-5, rtol=1e-5)
    out, lse = merge_attn_states_n([outs[1]], [lses[1]])
    assert (out == 0).all() and torch.isinf(lse).all()


# ---------------------------------------------------------------------------------------------------------------
# Two ranks (gloo)
# ---------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard_cache(batch, layout: ContextParallelLayout, seed: int):
    """This rank's own cache (its own page ids, shuffled) and local block table, copied from the global cache."""
    bs = layout.block_size
    table = batch.common.block_table.cpu()
    per_req = [layout.local_block_indices(math.ceil(s.seq_len / bs)) for s in batch.shapes]
    total = sum(len(p) for p in per_req)
    num_local = total + 3
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_local, generator=gen).tolist()
    cache = torch.empty((num_local,) + tuple(batch.kv_cache.shape[1:]), dtype=batch.kv_cache.dtype)
    # never-zero, never-read pages: random, like make_random_batch's
    cache.copy_(quantize_for_cache(torch.randn(cache.shape, generator=gen) * 50, cache.dtype, 1.0))
    width = max((len(p) for p in per_req), default=0)
    local_table = torch.zeros(len(per_req), max(width, 1), dtype=torch.int32)
    at = 0
    for i, logical in enumerate(per_req):
        for j, b in enumerate(logical):
            local_table[i, j] = pages[at]
            cache[pages[at]] = batch.kv_cache[int(table[i, b])]
            at += 1
    return cache, local_table


def _poison_unowned(batch, layout: ContextParallelLayout):
    """The global cache with every page this rank does not own set to NaN (shared page-id space)."""
    cache = batch.kv_cache.clone()
    owned = torch.zeros(cache.shape[0], dtype=torch.bool)
    table = batch.common.block_table.cpu()
    for i, s in enumerate(batch.shapes):
        for b in layout.local_block_indices(math.ceil(s.seq_len / layout.block_size)):
            owned[int(table[i, b])] = True
    cache[~owned] = float("nan")
    return cache


CASES = [
    # (name, impl, method, interleave, dtype, kv_cache_dtype, shared_ids, soft_cap, sinks)
    ("ref-gather-i1", "reference", "all_gather", 1, "float32", "auto", False, None, False),
    ("ref-reduce-i2-shared-softcap-sinks", "reference", "all_reduce", 2, "float32", "auto", True, 8.0, True),
    ("ref-gather-fp8", "reference", "all_gather", 1, "bfloat16", "fp8", False, None, False),
    ("triton-gather-i1", "triton", "all_gather", 1, "float32", "auto", False, None, False),
    ("triton-reduce-i2-shared-sinks", "triton", "all_reduce", 2, "float32", "auto", True, None, True),
    ("triton-gather-bf16-softcap", "triton", "all_gather", 1, "bfloat16", "auto", False, 8.0, False),
]
# seq lens 5 (rank 1 holds nothing), 16 (one full block), 17, 33 (rank 1 holds nothing at interleave 2 ... 3 blocks),
# 64, 97: local seq_len 0 and partial last pages on both ranks.
CONTEXTS = (4, 15, 16, 32, 63, 96)


def _run_case(rank: int, world: int, case, device: str) -> str:
    name, impl, method, interleave, dtype, kv_dtype, shared_ids, soft_cap, use_sinks = case
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, kv_cache_dtype=kv_dtype,
                         block_size=16, logits_soft_cap=soft_cap, has_sinks=use_sinks)
    batch = make_random_batch(spec, [SequenceShape(1, c) for c in CONTEXTS], seed=7, pad_tokens=1)
    layout = ContextParallelLayout(world, rank, spec.block_size, interleave)
    if shared_ids:
        cache = _poison_unowned(batch, layout)
        local = build_local_metadata(batch.common, layout)
    else:
        cache, local_table = _shard_cache(batch, layout, seed=100 + rank)
        local = build_local_metadata(batch.common, layout, local_table)
    cache = cache.to(device)
    local.query_start_loc, local.seq_lens = local.query_start_loc.to(device), local.seq_lens.to(device)
    local.block_table, local.slot_mapping = local.block_table.to(device), local.slot_mapping.to(device)
    # the new tokens: only the owner of each token's block writes it
    keep = local.slot_mapping >= 0
    slots = local.slot_mapping[keep]
    blocks, offsets = slots // spec.block_size, slots % spec.block_size
    key, value = batch.key.to(device)[keep], batch.value.to(device)[keep]
    cache[blocks, 0, offsets] = quantize_for_cache(key, cache.dtype, batch.k_scale)
    cache[blocks, 1, offsets] = quantize_for_cache(value, cache.dtype, batch.v_scale)

    n = batch.num_actual_tokens
    query = batch.query.to(device)[:n].contiguous()
    local.query_start_loc = local.query_start_loc[: n + 1]
    out = cp_decode_attention(query, cache, local, spec, impl=impl, method=method,
                              sinks=batch.sinks.to(device) if batch.sinks is not None else None,
                              k_scale=batch.k_scale, v_scale=batch.v_scale)
    expected = oracle_attention(batch).float()
    assert torch.isfinite(out).all(), f"{name}: non-finite output"
    tol = 2e-2 if dtype == "bfloat16" else 2e-4
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    # every rank ends with the same answer
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out.contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{name}: ranks disagree"
    return name


def _worker(rank: int, world: int, port: int, backend: str, cases, device_kind: str) -> None:
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case in cases:
            _run_case(rank, world, case, device)
    finally:
        dist.destroy_process_group()


def test_two_ranks_gloo_match_single_rank_attention():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the spawned ranks inherit it (set before triton imports)
    mp.spawn(_worker, args=(2, _free_port(), "gloo", CASES, "cpu"), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_two_ranks_nccl_match_single_rank_attention():
    gpu_cases = [c for c in CASES if c[1] == "triton"] + [
        ("triton-gather-bf16-i1", "triton", "all_gather", 1, "bfloat16", "auto", False, None, False),
        ("triton-reduce-fp16-i4", "triton", "all_reduce", 4, "float16", "auto", False, None, False),
        ("triton-gather-fp8", "triton", "all_gather", 1, "bfloat16", "fp8", False, None, False),
    ]
    gpu_cases = [c for c in gpu_cases if c[4] != "float32"]  # the GPU kernels take fp16/bf16 queries
    mp.spawn(_worker, args=(2, _free_port(), "nccl", gpu_cases, "cuda"), nprocs=2, join=True)


def test_mla_decode_partials_merge_exactly():
    """The MLA decode kernel on each rank's local metadata (one rank holds nothing of request 0) merges exactly."""
    from attnbackends.mla.decode_launch import mla_decode
    from attnbackends import build_common_metadata

    gen = torch.Generator().manual_seed(3)
    batch, heads, lora, rope, bs = 3, 4, 64, 16, 16
    contexts = [4, 40, 70]
    cache = torch.randn(20, bs, lora + rope, generator=gen)
    perm = torch.randperm(20, generator=gen).tolist()
    tables, at = [], 0
    for c in contexts:
        n = math.ceil((c + 1) / bs)
        tables.append(perm[at : at + n])
        at += n
    common = build_common_metadata([1] * batch, contexts, tables, bs)
    q_nope, q_pe = torch.randn(batch, heads, lora, generator=gen), torch.randn(batch, heads, rope, generator=gen)
    full, full_lse = torch.empty(batch, heads, lora), torch.empty(batch, heads)
    mla_decode(q_nope, q_pe, cache, common.block_table, common.seq_lens, full, scale=0.1, lse=full_lse)
    outs, lses = [], []
    for rank in range(2):
        local = build_local_metadata(common, ContextParallelLayout(2, rank, bs))
        out, lse = torch.empty(batch, heads, lora), torch.empty(batch, heads)
        mla_decode(q_nope, q_pe, cache, local.block_table, local.seq_lens, out, scale=0.1, lse=lse)
        outs.append(out)
        lses.append(lse.transpose(0, 1).contiguous())  # mla_decode's lse is [B, H]; the merge takes [H, T]
    assert torch.isinf(lses[1][:, 0]).all()
    merged, merged_lse = merge_attn_states_n(outs, lses)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, full_lse.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_unified_attention_return_lse(num_kv_splits):
    """return_lse: natural-log LSE equal to the reference's; seq_len 0 gives output 0 and lse -inf (no NaN)."""
    from attnbackends.triton.launch import unified_attention

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs, lens = 4, 2, 32, 16, [37, 0, 16, 50]
    kc, vc = torch.randn(20, bs, kv_heads, d, generator=gen), torch.randn(20, bs, kv_heads, d, generator=gen)
    perm = torch.randperm(20, generator=gen)
    table = torch.zeros(len(lens), 4, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        pages = -(-n // bs)
        table[i, :pages] = perm[at : at + pages].int()
        at += pages
    q = torch.randn(len(lens), heads, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((heads, len(lens)), float("nan"))
    unified_attention(q, kc, vc, out, torch.arange(len(lens) + 1, dtype=torch.int32),
                      torch.tensor(lens, dtype=torch.int32), table, 1, max(lens), 0.3, causal=False,
                      logits_soft_cap=5.0, num_kv_splits=num_kv_splits, return_lse=lse)
    for i, n in enumerate(lens):
        pages = table[i, : -(-n // bs)].long()
        k, v = kc[pages].reshape(-1, kv_heads, d)[:n], vc[pages].reshape(-1, kv_heads, d)[:n]
        o, l = sequence_attention(q[i : i + 1], k, v, torch.tensor([n]), scale=0.3, causal=False,
                                  logits_soft_cap=5.0)
        torch.testing.assert_close(out[i], o[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse[:, i], l[:, 0], atol=1e-4, rtol=1e-4)
    assert (out[1] == 0).all() and torch.isinf(lse[:, 1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_flashinfer_local_partials_merge_exactly(kv_cache_dtype):
    """FlashInfer's decode wrapper as the local kernel, two ranks simulated in one process (one rank holds no key
    of the shortest request): each partial and its natural-log LSE equal the reference local path's, and the merge
    equals single-rank attention."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from attnbackends import DeviceInfo
    from attnbackends.flashinfer import FlashInferBackend
    from attnbackends.parallel.decode_cp import local_decode_attention

    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype="bfloat16", block_size=16,
                         kv_cache_dtype=kv_cache_dtype)
    reasons = FlashInferBackend.not_supported_reasons(spec, DeviceInfo.current())
    if reasons:
        pytest.skip("; ".join(reasons))
    scales = dict(k_scale=0.05, v_scale=0.08) if spec.is_fp8_kv_cache else {}
    batch = make_random_batch(spec, [SequenceShape(1, c) for c in (5, 40, 300, 1000)], seed=5, device="cuda",
                              fp8_scales=(scales["k_scale"], scales["v_scale"]) if scales else None)
    cache = batch.kv_cache
    common = batch.common
    full, full_lse = local_decode_attention(batch.query, cache, common, spec, impl="reference", **scales)
    outs, lses = [], []
    for rank in range(2):
        local = build_local_metadata(common, ContextParallelLayout(2, rank, spec.block_size))
        out, lse = local_decode_attention(batch.query, cache, local, spec, impl="flashinfer", **scales)
        ref_out, ref_lse = local_decode_attention(batch.query, cache, local, spec, impl="reference", **scales)
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
        outs.append(out)
        lses.append(lse)
    assert torch.isinf(lses[1][:, 0]).all()  # rank 1 holds no key of the 6-token request
    merged, merged_lse = merge_attn_states_n(outs, lses)
    torch.testing.assert_close(merged, full, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(merged_lse, full_lse, atol=2e-2, rtol=1e-3)
