"""Triton unified paged attention against the float64 oracle.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes; tests marked ``gpu`` use
realistic shapes (and a CUDA-graph replay) and skip without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from attnbackends.ops.kv_cache_write import reshape_and_cache  # noqa: E402
from attnbackends.spec import AttentionSpec  # noqa: E402
from attnbackends.testing import (  # noqa: E402
    SequenceShape,
    assert_close_to_oracle,
    check_backend_on_batch,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)
from attnbackends.reference.functional import sequence_attention  # noqa: E402
from attnbackends.speculative.tree_mask import request_tree_mask  # noqa: E402
from attnbackends.testing.cases import random_tree_parents  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadataBuilder  # noqa: E402
from attnbackends.triton.heuristics import KernelConfig, choose_num_kv_splits, fused_merge_rows  # noqa: E402
from attnbackends.triton.launch import (  # noqa: E402
    UNIFIED_CONSTEXPRS,
    SplitKVWorkspace,
    launch_attention,
    plan_attention,
    unified_attention,
    varlen_attention,
)
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


# ---------------------------------------------------------------------------------------------------------------
# Split-KV decodes merged in the attention launch (the last segment program of each decode and KV head merges)
# ---------------------------------------------------------------------------------------------------------------
def plan_fused(spec, batch, num_kv_splits, *, num_tokens=None, return_lse=False, config=None):
    """The plan of ``batch`` (decodes only) with ``num_kv_splits`` segments, which must merge in its own launch, on a
    new workspace whose partials are poisoned with NaN (a merge reading a partial no program wrote fails)."""
    common = batch.common
    n = common.num_actual_tokens if num_tokens is None else num_tokens
    workspace = SplitKVWorkspace.allocate(batch.query.shape[0], spec.num_heads, spec.head_size, num_kv_splits,
                                          device=batch.query.device)
    workspace.partial_out.fill_(float("nan"))
    workspace.partial_lse.fill_(float("nan"))
    decode_q = max(s.query_len for s in batch.shapes)
    plan = plan_attention(
        num_tokens=n, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        block_size=spec.block_size, num_seqs=common.num_reqs, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len, kv_fp8=spec.is_fp8_kv_cache, causal=spec.causal,
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
        use_alibi=spec.alibi_slopes is not None, use_sinks=spec.has_sinks, return_lse=return_lse,
        num_decodes=common.num_reqs, num_kv_splits=num_kv_splits, workspace=workspace, config=config,
        decode_query_len=decode_q, use_tree=common.spec_tree_mask is not None)
    assert plan.fused_reduce and plan.reduce_grid is None and plan.workspace is workspace
    assert plan.grid == (common.num_reqs, spec.num_kv_heads, num_kv_splits)
    return plan


def launch_fused(plan, batch, query_start_loc=None, *, return_lse=False):
    """One launch of ``plan`` into a NaN-poisoned output (and LSE); returns (output, lse or None). The counters are
    zero again afterwards."""
    spec, common = batch.spec, batch.common
    kv = batch.kv_cache
    out = batch.new_output()
    lse = torch.full((spec.num_heads, batch.query.shape[0]), float("nan"), device=out.device) if return_lse else None
    alibi = (torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=out.device)
             if spec.alibi_slopes is not None else None)
    tree = common.spec_tree_mask
    launch_attention(
        plan, batch.query, kv[:, 0], kv[:, 1], out,
        common.query_start_loc if query_start_loc is None else query_start_loc, common.seq_lens, common.block_table,
        spec.softmax_scale, float(spec.logits_soft_cap or 0.0), alibi, batch.sinks, batch.k_scale, batch.v_scale,
        lse, tree_mask=tree.view(torch.uint8) if tree is not None else None,
        tree_indptr=common.spec_tree_mask_indptr)
    assert int(plan.workspace.counters.count_nonzero()) == 0, "the counters must be zero after the launch"
    return out, lse


def reference_lse(batch):
    """[num_heads, num_actual_tokens] float64 natural-log LSE of every query row (sinks and tree masks included)."""
    spec = batch.spec
    lses, start = [], 0
    for i, (shape, keys, values) in enumerate(zip(batch.shapes, batch.dense_keys, batch.dense_values)):
        tree = request_tree_mask(batch.common, i)
        q = batch.query[start:start + shape.query_len].double().cpu()
        start += shape.query_len
        _, lse = sequence_attention(
            q, keys, values, torch.arange(shape.context_len, shape.seq_len), scale=spec.softmax_scale,
            causal=spec.causal, sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
            alibi_slopes=torch.tensor(spec.alibi_slopes) if spec.alibi_slopes is not None else None,
            sinks=batch.sinks.cpu() if batch.sinks is not None else None, compute_dtype=torch.float64,
            tree_mask=tree.cpu() if tree is not None else None)
        lses.append(lse)
    return torch.cat(lses, dim=1)


def check_fused(spec, shapes, num_kv_splits, *, seed, return_lse=False, config=None, logit_magnitude=1.0,
                tree_parents=None):
    """A decode-only batch of ``shapes`` through a fused plan, twice, against the oracle (and the reference LSE);
    returns (plan, batch, output, lse or None) of the first launch."""
    batch = make_random_batch(spec, shapes, seed=seed, device=DEVICE, pad_tokens=2, logit_magnitude=logit_magnitude,
                              tree_parents=tree_parents)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping, batch.k_scale,
                      batch.v_scale)
    plan = plan_fused(spec, batch, num_kv_splits, return_lse=return_lse, config=config)
    out, lse = launch_fused(plan, batch, return_lse=return_lse)
    check(batch, out, f"fused split-KV x{num_kv_splits}")
    n = batch.num_actual_tokens
    if return_lse:
        assert_close_to_oracle(lse[:, :n], reference_lse(batch), tolerance_for(torch.float32), "lse")
        assert torch.isnan(lse[:, n:]).all(), "padding rows' LSE must be left untouched"
    again, lse_again = launch_fused(plan, batch, return_lse=return_lse)  # a replay: the counters start at zero
    assert torch.equal(again[:n], out[:n]) and torch.isnan(again[n:].float()).all()
    if return_lse:
        assert torch.equal(lse_again[:, :n], lse[:, :n])
    return plan, batch, out, lse


# Uneven lengths; S(1, 2): three keys, fewer than one 16-key tile, so every segment but the first is empty.
UNEVEN_DECODES = [S(1, 70), S(1, 2), S(1, 33), S(1, 0)]


@pytest.mark.parametrize("num_kv_splits", [2, 3, 4, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (10, 2)])
def test_fused_split_decode(num_kv_splits, num_heads, num_kv_heads):
    spec = spec_for(num_heads=num_heads, num_kv_heads=num_kv_heads)
    check_fused(spec, UNEVEN_DECODES, num_kv_splits, seed=30 + num_kv_splits, config=KernelConfig(decode_tile_n=16))


@pytest.mark.parametrize("name,spec_kw,return_lse", [
    ("window_sinks_lse", dict(sliding_window=20, has_sinks=True), True),
    ("softcap_alibi_lse", dict(logits_soft_cap=5.0, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)), True),
    ("fp8", dict(kv_cache_dtype="fp8"), False),
    ("float16_gqa5_lse", dict(num_heads=10, num_kv_heads=2, dtype="float16", has_sinks=True), True),
])
def test_fused_split_decode_features(name, spec_kw, return_lse):
    check_fused(spec_for(**spec_kw), UNEVEN_DECODES, 4, seed=40, return_lse=return_lse, logit_magnitude=3.0,
                config=KernelConfig(decode_tile_n=16))


def test_fused_split_decode_merges_rows_in_several_steps():
    """Head 128 x 32 segments: the merge takes one row at a time, so each decode's 4 query heads take 4 steps."""
    spec = spec_for(num_heads=8, num_kv_heads=2, head_size=128, has_sinks=True)
    assert fused_merge_rows(4, 32, 128) == 1
    plan = check_fused(spec, [S(1, 40), S(1, 530)], 32, seed=41, return_lse=True)[0]
    assert plan.constexprs[UNIFIED_CONSTEXPRS.index("MERGE_ROWS")] == 1


def test_fused_split_multi_token_tree_decode():
    """Speculative verify on the decode path: 4 query tokens x 4 query heads per program, a tree over the drafts."""
    rng = random.Random(5)
    spec = spec_for(num_heads=8, num_kv_heads=2, num_speculative_tokens=3, speculative_tree=True)
    shapes = [S(4, 60), S(4, 1), S(4, 25)]
    trees = [random_tree_parents(rng, 4), [-1, 0, 0, 1], None]
    check_fused(spec, shapes, 4, seed=42, return_lse=True, tree_parents=trees, config=KernelConfig(decode_tile_n=16))


def test_fused_split_decode_empty_request():
    """A decode program whose request has no query token (a padded CUDA-graph batch) writes nothing, and its segment
    programs still take their tickets: its counters end at zero and the other requests are merged."""
    spec = spec_for(num_heads=8, num_kv_heads=2, has_sinks=True)
    batch = make_random_batch(spec, [S(1, 50), S(1, 17), S(1, 40)], seed=43, device=DEVICE, pad_tokens=1)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.common.slot_mapping, batch.k_scale,
                      batch.v_scale)
    qsl = batch.common.query_start_loc.clone()
    qsl[-1] = qsl[-2]  # the last request: zero tokens; its row becomes padding
    plan = plan_fused(spec, batch, 4, num_tokens=2, config=KernelConfig(decode_tile_n=16))
    out, _ = launch_fused(plan, batch, qsl)
    full = oracle_attention(batch)
    assert_close_to_oracle(out[:2], full[:2], tolerance_for(spec.torch_dtype), "fused split-KV, empty request")
    assert torch.isnan(out[2:].float()).all(), "the empty request's row and the padding must be left untouched"


def test_split_plans_merge_in_the_launch_only_for_decode_only_programs():
    kw = dict(num_heads=8, num_kv_heads=2, head_size=32, block_size=16, kv_fp8=False, causal=True, num_kv_splits=4)
    ws = SplitKVWorkspace.allocate(16, 8, 32, 4, device=DEVICE)
    decode_only = plan_attention(num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=90, workspace=ws, **kw)
    assert decode_only.fused_reduce and decode_only.reduce_grid is None
    assert decode_only.constexprs[UNIFIED_CONSTEXPRS.index("FUSED_REDUCE")]
    mixed = plan_attention(num_tokens=12, num_seqs=3, max_query_len=10, max_seq_len=90, num_decodes=2, workspace=ws,
                           **kw)
    assert mixed.num_kv_splits == 4 and not mixed.fused_reduce and mixed.reduce_grid == (12, 8, 1)
    assert not mixed.constexprs[UNIFIED_CONSTEXPRS.index("FUSED_REDUCE")]
    no_counters = SplitKVWorkspace(ws.partial_out, ws.partial_lse)
    plan = plan_attention(num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=90, workspace=no_counters, **kw)
    assert not plan.fused_reduce and plan.reduce_grid == (3, 8, 1)
    few = SplitKVWorkspace(ws.partial_out, ws.partial_lse, ws.counters[:5])  # 3 decodes x 2 KV heads need 6
    plan = plan_attention(num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=90, workspace=few, **kw)
    assert not plan.fused_reduce and plan.reduce_grid == (3, 8, 1)
    unsplit = plan_attention(num_tokens=3, num_seqs=3, max_query_len=1, max_seq_len=90, workspace=ws,
                             **{**kw, "num_kv_splits": 1})
    assert not unsplit.fused_reduce and unsplit.reduce_grid is None


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
    assert choose_num_kv_splits(1, 8, 32, 132, 1024) == 16
    assert choose_num_kv_splits(1, 8, 32, 132, 1024, min_keys_per_split=128) == 8
    assert choose_num_kv_splits(1, 8, 32, 132, 100) == 1
    assert choose_num_kv_splits(1, 8, 32, 132, 300) == 4
    assert choose_num_kv_splits(1, 8, 32, 132, 16384, max_splits=8) == 8
    # Programs at or under two per SM: 4 x 8 programs take 8 segments, 16 x 8 take 2, 33 x 8 none.
    assert choose_num_kv_splits(4, 8, 32, 132, 1024) == 8
    assert choose_num_kv_splits(16, 8, 32, 132, 4096) == 2
    assert choose_num_kv_splits(33, 8, 32, 132, 4096) == 1
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


def _workspace_with_int64_counters():
    ws = SplitKVWorkspace.allocate(16, 4, 32, 2, device=DEVICE)
    return SplitKVWorkspace(ws.partial_out, ws.partial_lse, ws.counters.long())


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
    (lambda a: a.update(workspace=_workspace_with_int64_counters()), "counters"),
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


@gpu
@requires_cuda
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_gpu_fused_split_decode_eager_and_graph_replays(kv_dtype):
    """Split decodes merged in their own launch, where a decode's segment programs finish in any order: against the
    oracle eagerly, then replayed from a CUDA graph many times, each replay equal to the eager run (a counter left
    non-zero by one launch would leave rows of the next unwritten: NaN)."""
    spec = AttentionSpec(**GPU_SPEC, kv_cache_dtype=kv_dtype, has_sinks=True)
    shapes = [S(1, 1023), S(1, 5000), S(1, 3), S(1, 700), S(1, 0)]
    for num_kv_splits in (8, 32):
        plan, batch, out, lse = check_fused(spec, shapes, num_kv_splits, seed=24, return_lse=True)
        common, kv = batch.common, batch.kv_cache
        g_out, g_lse = batch.new_output(), torch.full_like(lse, float("nan"))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_attention(plan, batch.query, kv[:, 0], kv[:, 1], g_out, common.query_start_loc, common.seq_lens,
                             common.block_table, spec.softmax_scale, 0.0, None, batch.sinks, batch.k_scale,
                             batch.v_scale, g_lse)
        n = batch.num_actual_tokens
        for replay in range(200):
            g_out.fill_(float("nan"))
            g_lse.fill_(float("nan"))
            graph.replay()
            assert torch.equal(g_out[:n], out[:n]) and torch.equal(g_lse[:, :n], lse[:, :n]), f"replay {replay}"
        assert int(plan.workspace.counters.count_nonzero()) == 0


@gpu
@requires_cuda
def test_gpu_builder_fuses_the_small_eager_decode():
    """B=1 decodes over 1024 keys: the builder splits them and merges in the attention launch; through the backend
    against the oracle."""
    spec = AttentionSpec(**GPU_SPEC)
    batch = make_random_batch(spec, [S(1, 1023)], seed=25, device="cuda")
    plan = TritonMetadataBuilder(spec, "cuda").build(batch.common).plan
    assert plan.num_kv_splits > 1 and plan.fused_reduce and plan.reduce_grid is None
    check_backend_on_batch(TritonAttentionBackend, batch)
