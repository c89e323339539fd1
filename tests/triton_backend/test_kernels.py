"""Triton unified paged attention against the float64 oracle.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes; tests marked ``gpu`` use
realistic shapes (and a CUDA-graph replay) and skip without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402

from attnbackends.ops.kv_cache_write import reshape_and_cache  # noqa: E402
from attnbackends.spec import AttentionSpec  # noqa: E402
from attnbackends.testing import (  # noqa: E402
    SequenceShape,
    assert_close_to_oracle,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)
from attnbackends.triton.heuristics import KernelConfig, choose_num_kv_splits  # noqa: E402
from attnbackends.triton.launch import SplitKVWorkspace, unified_attention, varlen_attention  # noqa: E402
from attnbackends.validation import check_unified_attention_args  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

S = SequenceShape
DECODES = [S(1, 37), S(1, 15), S(1, 64), S(1, 1)]
PREFILLS = [S(33), S(17)]
CHUNKED = [S(20, 45), S(3, 16)]
MIXED = [S(1, 50), S(1, 7), S(24, 19), S(9)]


def run_batch(spec, shapes, *, seed=0, pad_tokens=2, num_decodes=None, num_kv_splits=None, workspace=None,
              scales_as_tensors=False, alibi=None, config=None, device=DEVICE, logit_magnitude=1.0):
    batch = make_random_batch(spec, shapes, seed=seed, device=device, pad_tokens=pad_tokens,
                              logit_magnitude=logit_magnitude)
    common = batch.common
    k_scale, v_scale = batch.k_scale, batch.v_scale
    if scales_as_tensors:
        k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)
    kv_cache = batch.kv_cache
    reshape_and_cache(batch.key, batch.value, kv_cache, common.slot_mapping, k_scale, v_scale)
    out = batch.new_output()
    alibi_slopes = (torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)
                    if spec.alibi_slopes is not None else None)
    unified_attention(
        batch.query, kv_cache[:, 0], kv_cache[:, 1], out, common.query_start_loc, common.seq_lens,
        common.block_table, common.max_query_len, common.max_seq_len, spec.softmax_scale, causal=spec.causal,
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap, alibi_slopes=alibi_slopes,
        sinks=batch.sinks, k_scale=k_scale, v_scale=v_scale, workspace=workspace, num_decodes=num_decodes,
        num_kv_splits=num_kv_splits, config=config)
    return batch, out


def check(batch, out, what="output"):
    spec = batch.spec
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype, spec.kv_cache_dtype),
                           what)
    assert torch.isnan(out[n:].float()).all(), "padding rows must be left untouched"


def spec_for(**kw):
    base = dict(num_heads=4, num_kv_heads=2, head_size=32, dtype="bfloat16", block_size=16)
    base.update(kw)
    return AttentionSpec(**base)


# ---------------------------------------------------------------------------------------------------------------
# CPU (interpreter) correctness
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shapes,name", [(DECODES, "decode"), (PREFILLS, "prefill"), (CHUNKED, "chunked"),
                                         (MIXED, "mixed")])
def test_batch_kinds(shapes, name):
    batch, out = run_batch(spec_for(), shapes, seed=1)
    check(batch, out, name)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_gqa_mqa(num_heads, num_kv_heads):
    batch, out = run_batch(spec_for(num_heads=num_heads, num_kv_heads=num_kv_heads), MIXED, seed=2)
    check(batch, out)


@pytest.mark.parametrize("head_size", [80, 64])
def test_head_sizes(head_size):
    batch, out = run_batch(spec_for(head_size=head_size, dtype="float16"), MIXED, seed=3)
    check(batch, out)


def test_block_size_32():
    batch, out = run_batch(spec_for(block_size=32), [S(1, 70), S(1, 31), S(10, 33), S(40)], seed=4)
    check(batch, out)


def test_mixed_single_launch_decode_path():
    batch, out = run_batch(spec_for(), MIXED, seed=5, num_decodes=2)
    check(batch, out)


def test_sliding_window():
    batch, out = run_batch(spec_for(sliding_window=10), MIXED + [S(1, 80)], seed=6)
    check(batch, out)


def test_alibi_softcap_sinks():
    slopes = tuple(2.0 ** (-8 * (i + 1) / 4) for i in range(4))
    spec = spec_for(alibi_slopes=slopes, logits_soft_cap=5.0, has_sinks=True)
    batch, out = run_batch(spec, MIXED, seed=7, logit_magnitude=4.0)
    check(batch, out)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scales_as_tensors", [False, True])
def test_fp8_kv_cache(kv_cache_dtype, scales_as_tensors):
    batch, out = run_batch(spec_for(kv_cache_dtype=kv_cache_dtype), MIXED, seed=8,
                           scales_as_tensors=scales_as_tensors)
    check(batch, out)


@pytest.mark.parametrize("num_kv_splits", [2, 4])
def test_split_kv(num_kv_splits):
    spec = spec_for(has_sinks=True)
    shapes = [S(1, 70), S(1, 3), S(1, 0), S(1, 40)]
    ws = SplitKVWorkspace.allocate(16, spec.num_heads, spec.head_size, 4, device=DEVICE)
    batch, out = run_batch(spec, shapes, seed=9, num_kv_splits=num_kv_splits, workspace=ws,
                           config=KernelConfig(decode_tile_n=16))
    check(batch, out)


def test_split_kv_mixed_generic_path():
    ws = SplitKVWorkspace.allocate(64, 4, 32, 2, device=DEVICE)
    batch, out = run_batch(spec_for(), MIXED, seed=10, num_kv_splits=2, workspace=ws, num_decodes=2,
                           config=KernelConfig(tile_n=16, decode_tile_n=16))
    check(batch, out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="float32 queries are a CPU-interpreter feature")
def test_float32_query_on_cpu():
    batch, out = run_batch(spec_for(dtype="float32"), MIXED, seed=11, device="cpu")
    check(batch, out)


def test_encoder_decoder_noncausal_paged():
    spec = spec_for(attn_type="encoder_decoder")
    batch, out = run_batch(spec, [S(1, 20), S(5, 12)], seed=12)
    check(batch, out)


@pytest.mark.parametrize("num_heads,num_kv_heads,causal", [(4, 2, False), (4, 4, True)])
def test_varlen_attention(num_heads, num_kv_heads, causal):
    torch.manual_seed(13)
    lens = [17, 1, 40]
    total = sum(lens)
    d = 32
    q = torch.randn(total + 2, num_heads, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(total + 2, num_kv_heads, d, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn(total + 2, num_kv_heads, d, dtype=torch.bfloat16, device=DEVICE)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(d)
    varlen_attention(q, k, v, out, qsl, max(lens), scale, causal=causal)
    refs, start = [], 0
    g = num_heads // num_kv_heads
    for n in lens:
        qq = q[start:start + n].double().cpu()
        kk = k[start:start + n].double().cpu().repeat_interleave(g, dim=1)
        vv = v[start:start + n].double().cpu().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        refs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += n
    assert_close_to_oracle(out[:total], torch.cat(refs), tolerance_for(torch.bfloat16))
    assert torch.isnan(out[total:].float()).all()


# ---------------------------------------------------------------------------------------------------------------
# Pure-python pieces
# ---------------------------------------------------------------------------------------------------------------
def test_choose_num_kv_splits():
    # Large batches fill the GPU on their own.
    assert choose_num_kv_splits(64, 8, 32, 132, 4096) == 1
    assert choose_num_kv_splits(256, 8, 32, 132, 2048) == 1
    # One sequence: split, capped by the keys available and by max_splits.
    assert choose_num_kv_splits(1, 8, 32, 132, 16384) == 32
    assert choose_num_kv_splits(1, 8, 32, 132, 1024) == 8
    assert choose_num_kv_splits(1, 8, 32, 132, 1024, min_keys_per_split=64) == 16
    assert choose_num_kv_splits(1, 8, 32, 132, 100) == 1
    assert choose_num_kv_splits(1, 8, 32, 132, 300) == 2
    assert choose_num_kv_splits(1, 8, 32, 132, 16384, max_splits=8) == 8
    assert choose_num_kv_splits(16, 8, 32, 132, 4096) == 4
    # Prefill-heavy batches never split; results are powers of two.
    assert choose_num_kv_splits(1, 8, 32, 132, 8192, max_query_len=512) == 1
    for b in range(1, 300, 7):
        n = choose_num_kv_splits(b, 8, 32, 132, 4096)
        assert n >= 1 and n & (n - 1) == 0
    with pytest.raises(ValueError, match="num_heads"):
        choose_num_kv_splits(1, 3, 32, 132)


def _args():
    spec = spec_for()
    batch = make_random_batch(spec, MIXED, seed=0)
    c = batch.common
    kv = batch.kv_cache
    return dict(query=batch.query, key_cache=kv[:, 0], value_cache=kv[:, 1], output=batch.new_output(),
                query_start_loc=c.query_start_loc, seq_lens=c.seq_lens, block_table=c.block_table,
                max_query_len=c.max_query_len, max_seq_len=c.max_seq_len, softmax_scale=spec.softmax_scale)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(query=a["query"].to(torch.int32)), "query dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    (lambda a: a.update(block_table=a["block_table"].long()), "block_table"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "query_start_loc"),
    (lambda a: a.update(key_cache=a["key_cache"].float()), "key_cache"),
    (lambda a: a.update(output=a["output"][:, :2]), "output shape"),
    (lambda a: a.update(softmax_scale=torch.tensor(0.1)), "softmax_scale"),
    (lambda a: a.update(k_scale=torch.tensor([1.0, 2.0])), "k_scale"),
    (lambda a: a.update(k_scale="1"), "k_scale"),
    (lambda a: a.update(sinks=torch.zeros(3)), "sinks"),
    (lambda a: a.update(num_decodes=99), "num_decodes"),
    (lambda a: a.update(max_seq_len=10**6), "max_seq_len"),
    (lambda a: a.update(key_cache=a["key_cache"][:, :8], value_cache=a["value_cache"][:, :8]), "block_size"),
])
def test_validation_errors(change, match):
    a = _args()
    change(a)
    with pytest.raises(ValueError, match=match):
        check_unified_attention_args(**a)


def test_validation_sliding_window_needs_causal():
    with pytest.raises(NotImplementedError, match="sliding_window"):
        check_unified_attention_args(**_args(), causal=False, sliding_window=4)


def test_validation_accepts_valid_args():
    check_unified_attention_args(**_args())


# ---------------------------------------------------------------------------------------------------------------
# GPU: realistic shapes and CUDA graphs
# ---------------------------------------------------------------------------------------------------------------
GPU_SPEC = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16")


@gpu
@requires_cuda
@pytest.mark.parametrize("name,shapes,kv_dtype", [
    ("decode64", [S(1, 500 + 97 * i) for i in range(64)], "auto"),
    ("decode_long", [S(1, 8191), S(1, 3000)], "auto"),
    ("decode_fp8", [S(1, 1000 + 61 * i) for i in range(64)], "fp8"),
    ("prefill", [S(2048), S(1024), S(777)], "auto"),
    ("chunked_mixed", [S(1, 4096)] * 8 + [S(512, 2048), S(300, 1000)], "auto"),
])
def test_gpu_realistic(name, shapes, kv_dtype):
    spec = AttentionSpec(**GPU_SPEC, kv_cache_dtype=kv_dtype)
    num_decodes = sum(1 for s in shapes if s.query_len == 1)
    batch, out = run_batch(spec, shapes, seed=21, pad_tokens=3,
                           num_decodes=num_decodes if num_decodes < len(shapes) else None)
    check(batch, out, name)


@gpu
@requires_cuda
def test_gpu_split_kv_and_head_sizes():
    for head_size in (80, 256):
        spec = AttentionSpec(**{**GPU_SPEC, "head_size": head_size})
        batch, out = run_batch(spec, [S(1, 5000), S(1, 17)], seed=22, num_kv_splits=8)
        check(batch, out, f"split-kv head {head_size}")


@gpu
@requires_cuda
def test_gpu_cuda_graph_decode_replay_with_new_seq_lens():
    spec = AttentionSpec(**GPU_SPEC)
    shapes = [S(1, 300 + 50 * i) for i in range(8)]
    batch = make_random_batch(spec, shapes, seed=23, device="cuda", num_blocks=8 * 80)
    c = batch.common
    kv = batch.kv_cache
    reshape_and_cache(batch.key, batch.value, kv, c.slot_mapping)
    # Static buffers, sized for the largest context we will replay with.
    max_blocks = 80
    block_table = torch.zeros(8, max_blocks, dtype=torch.int32, device="cuda")
    block_table[:, : c.block_table.shape[1]] = c.block_table
    seq_lens = c.seq_lens.clone()
    out = torch.full_like(batch.query, float("nan"))
    ws = SplitKVWorkspace.allocate(8, spec.num_heads, spec.head_size, 8, device="cuda")
    kw = dict(max_query_len=1, max_seq_len=max_blocks * 16, softmax_scale=spec.softmax_scale, workspace=ws,
              num_kv_splits=8, validate=False)
    args = (batch.query, kv[:, 0], kv[:, 1], out, c.query_start_loc, seq_lens, block_table)
    unified_attention(*args, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unified_attention(*args, **kw)
    # Shrink every context: same shapes, new values; the graph must follow them.
    new_ctx = [100 + 37 * i for i in range(8)]
    seq_lens.copy_(torch.tensor([n + 1 for n in new_ctx], dtype=torch.int32))
    out.fill_(float("nan"))
    # Oracle over the same pages: the first new_ctx keys of each context + the new token (written at slot
    # position ctx_old, so move it to position new_ctx by rewriting the cache).
    for i, n in enumerate(new_ctx):
        blk, off = block_table[i, n // 16], n % 16
        kv[blk, 0, off] = batch.key[i]
        kv[blk, 1, off] = batch.value[i]
    graph.replay()
    torch.cuda.synchronize()
    refs = []
    g = spec.num_heads // spec.num_kv_heads
    for i, n in enumerate(new_ctx):
        keys = batch.dense_keys[i][:n]
        vals = batch.dense_values[i][:n]
        keys = torch.cat([keys, batch.key[i : i + 1].double().cpu()])
        vals = torch.cat([vals, batch.value[i : i + 1].double().cpu()])
        q = batch.query[i].double().cpu()  # [Hq, D]
        kk = keys.repeat_interleave(g, dim=1)  # [L, Hq, D]
        vv = vals.repeat_interleave(g, dim=1)
        p = (torch.einsum("hd,lhd->hl", q, kk) * spec.softmax_scale).softmax(-1)
        refs.append(torch.einsum("hl,lhd->hd", p, vv)[None])
    assert_close_to_oracle(out[:8], torch.cat(refs), tolerance_for(torch.bfloat16), "cuda graph replay")
