"""The balanced decode schedule (attnbackends/triton/decode_schedule.py): the host-side rule, the unified kernel's
scheduled decode mode against the float64 oracle (interpreted on the CPU at tiny shapes), the builder's choice and
its CUDA-graph buffers; GPU tests (marked ``gpu``) at realistic shapes, with CUDA-graph replays bit for bit."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
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
from attnbackends.testing.cases import random_tree_parents  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend, TritonImpl, TritonMetadataBuilder  # noqa: E402
from attnbackends.triton import decode_schedule as ds  # noqa: E402
from attnbackends.triton.decode_schedule import (  # noqa: E402
    COUNT_SHIFT,
    OPEN_END,
    BalancedParams,
    DecodeScheduler,
    balanced_reason,
    decode_key_ranges,
    make_decode_schedule,
    plan_decode_units,
    target_units,
    unit_capacity,
    units_cap,
)
from attnbackends.triton.heuristics import KernelConfig  # noqa: E402
from attnbackends.triton.launch import (  # noqa: E402
    UNIFIED_CONSTEXPRS,
    SplitKVWorkspace,
    launch_attention,
    plan_attention,
)
from attnbackends.platform import DeviceInfo  # noqa: E402
from tests.triton_backend.test_kernels import reference_lse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
S = SequenceShape
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Small units for tiny CPU shapes: no minimum beyond one tile.
TINY = BalancedParams(min_unit_keys=1)


# ---------------------------------------------------------------------------------------------------------------
# The host-side rule
# ---------------------------------------------------------------------------------------------------------------
def clipped(units, lo, hi):
    """[num_units, 4] int64 units with their key ranges clipped to the requests' visible keys [lo, hi), as the
    kernel clips them (a request's first unit starts at 0, its last ends at OPEN_END)."""
    units = units.astype(np.int64)
    r = units[:, 0]
    units[:, 1] = np.maximum(units[:, 1], lo[r])
    units[:, 2] = np.minimum(units[:, 2], hi[r])
    return units


def check_table(table, seq_lens, query_lens, *, align, cap, window=None, num_sms, num_kv_heads, params):
    """Every invariant of a unit table: each decode's visible keys covered exactly once by adjacent, tile-aligned,
    non-empty units in key order (the first from key 0, the last to OPEN_END), indices 0..count-1 with the right
    count, at most ``cap``, at most about 1.5 x S keys each (uncapped requests), and the total within the CUDA-graph
    capacity. Returns the units clipped to the visible keys."""
    lo, hi = decode_key_ranges(np.asarray(seq_lens), np.asarray(query_lens), sliding_window=window, align=align)
    raw = table.units.astype(np.int64)
    units = clipped(raw, lo, hi)
    n = len(seq_lens)
    assert table.num_units <= unit_capacity(n, num_sms, num_kv_heads, params.waves)
    assert sorted(set(units[:, 0].tolist())) == list(range(n)), "every request has units"
    row = 0
    seen = set()
    while row < table.num_units:
        r = int(units[row, 0])
        assert r not in seen, "a request's units are adjacent"
        seen.add(r)
        count = int(units[row, 3] >> COUNT_SHIFT)
        assert 1 <= count <= cap and count == table.units_per_request[r]
        mine = units[row:row + count]
        assert raw[row, 1] == 0 and raw[row + count - 1, 2] == OPEN_END, "open ends"
        assert (raw[row:row + count - 1, 2] <= hi[r]).all() and (raw[row + 1:row + count, 1] >= lo[r]).all()
        assert (mine[:, 0] == r).all() and ((mine[:, 3] & 0xFFFF) == np.arange(count)).all()
        assert ((mine[:, 3] >> COUNT_SHIFT) == count).all()
        assert mine[0, 1] == lo[r] and mine[-1, 2] == hi[r], "the units cover the visible keys"
        assert (mine[1:, 1] == mine[:-1, 2]).all(), "and exactly once, in key order"
        assert (mine[:, 1] % align == 0).all(), "units start on a tile"
        sizes = mine[:, 2] - mine[:, 1]
        assert (sizes > 0).all() or (count == 1 and hi[r] == lo[r]), "no empty unit (but an empty request's one)"
        if count < cap:
            assert sizes.max() <= 1.5 * table.unit_keys + align
        row += count
    return units


def heavy_tailed(rng, n, median, sigma=0.9, cap=None):
    lens = np.exp(rng.normal(math.log(median), sigma, n)).astype(np.int64) + 1
    return np.minimum(lens, cap) if cap else lens


@pytest.mark.parametrize("seed", range(6))
def test_units_cover_every_key_once(seed):
    rng = np.random.default_rng(seed)
    for case in range(40):
        n = int(rng.integers(1, 300))
        seq = heavy_tailed(rng, n, float(rng.choice([20, 700, 5000]))).astype(np.int32)
        seq[rng.random(n) < 0.05] = 0  # some requests without keys
        qlen = rng.integers(1, 5, n).astype(np.int32)
        seq = np.maximum(seq, qlen * (rng.random(n) < 0.5))
        align = int(rng.choice([16, 64, 128]))
        cap = int(rng.choice([1, 3, 32]))
        window = int(rng.choice([0, 100, 4000])) or None
        num_sms, num_kv_heads = int(rng.choice([1, 8, 132])), int(rng.choice([1, 2, 8]))
        params = BalancedParams(waves=int(rng.choice([1, 4, 8])), min_unit_keys=int(rng.choice([1, 128, 512])))
        table = plan_decode_units(seq, qlen, num_sms=num_sms, num_kv_heads=num_kv_heads, align=align,
                                  max_units_per_request=cap, sliding_window=window, params=params)
        check_table(table, seq, qlen, align=align, cap=cap, window=window, num_sms=num_sms,
                    num_kv_heads=num_kv_heads, params=params)


def test_long_requests_get_many_units_short_ones_one_largest_first():
    """96 decodes at 600 keys + 8 at 24k on an H100 (132 SMs), 8 KV heads: the long ones split into equal units
    that come first in the table, the short ones one unit each."""
    seq = np.array([600] * 96 + [24000] * 8)
    table = plan_decode_units(seq, None, num_sms=132, num_kv_heads=8, align=128, max_units_per_request=32)
    counts = table.units_per_request
    assert (counts[:96] == 1).all() and (counts[96:] > 1).all()
    assert table.unit_keys == 3840  # 249600 keys over T = 4 x 132 / 8 = 66 units, rounded up to a tile
    units = check_table(table, seq, np.ones(104), align=128, cap=32, num_sms=132, num_kv_heads=8,
                        params=BalancedParams())
    long_units = int(counts[96:].sum())
    assert set(units[:long_units, 0].tolist()) == set(range(96, 104)), "the long requests' units first"
    sizes = units[:, 2] - units[:, 1]
    assert sizes.max() <= table.unit_keys * 1.5 and sizes[:long_units].min() >= sizes[long_units:].max()


def test_uniform_batch_that_fills_the_gpu_is_not_split():
    table = plan_decode_units(np.full(128, 8192), None, num_sms=132, num_kv_heads=8, align=128,
                              max_units_per_request=32)
    assert table.num_units == 128 and (table.units_per_request == 1).all()


def test_empty_and_one_request_batches():
    empty = plan_decode_units(np.zeros(0, np.int32), None, num_sms=132, num_kv_heads=8, align=128,
                              max_units_per_request=32)
    assert empty.num_units == 0 and empty.units.shape == (0, 4)
    one = plan_decode_units(np.array([16384]), None, num_sms=132, num_kv_heads=8, align=128,
                            max_units_per_request=32)
    spans = clipped(one.units, np.array([0]), np.array([16384]))
    assert one.num_units == 32 and (spans[:, 2] - spans[:, 1] == 512).all(), "the cap: 32 units of 512"
    no_keys = plan_decode_units(np.array([0]), None, num_sms=132, num_kv_heads=8, align=128,
                                max_units_per_request=32)
    assert no_keys.units.tolist() == [[0, 0, OPEN_END, 1 << COUNT_SHIFT]]
    short = plan_decode_units(np.array([1000]), None, num_sms=132, num_kv_heads=8, align=128,
                              max_units_per_request=32)
    assert short.num_units == 8, "min_unit_keys (128) bounds the units of a short request"


def test_units_cap_follows_the_merge_tile_and_the_workspace():
    assert [units_cap(h, 32) for h in (64, 80, 128, 256, 512)] == [32, 16, 16, 8, 4]
    assert units_cap(128, 4) == 4 and units_cap(4096, 32) == 1


def test_window_ranges_start_at_the_first_visible_tile():
    lo, hi = decode_key_ranges(np.array([1000, 50, 300]), np.array([1, 4, 2]), sliding_window=128, align=64)
    # first query token at 999 sees from 872 -> tile 832; at 46: from 0; at 298: from 171 -> 128
    assert lo.tolist() == [832, 0, 128] and hi.tolist() == [1000, 50, 300]
    assert decode_key_ranges(np.array([7]), None, sliding_window=None, align=16)[0].tolist() == [0]


def test_the_rule():
    ragged, even = np.array([100, 100, 100, 2000]), np.array([1000, 1100, 900])
    assert balanced_reason("auto", ragged).startswith("auto: ragged")
    assert balanced_reason("auto", even) is None
    assert balanced_reason("balanced", even) == "decode_schedule='balanced'"
    assert balanced_reason("uniform", ragged) is None
    assert balanced_reason("uniform", ragged, graph_balanced=True) is not None
    assert balanced_reason("auto", even, BalancedParams(ragged_ratio=1.05)) is not None
    assert target_units(132, 8) == 66 and unit_capacity(10, 132, 8) == 76


@pytest.mark.parametrize("seed", range(3))
def test_python_and_numpy_plans_agree(seed):
    """A few decodes are planned in Python, more with numpy: the same table either way (windows, requests without
    keys, caps of one and two, lengths past the 16-bit sort)."""
    rng = np.random.default_rng(100 + seed)
    for case in range(150):
        n = int(rng.integers(1, 60))
        keys = heavy_tailed(rng, n, float(rng.choice([20, 700, 5000])))
        keys[rng.random(n) < 0.1] = 0
        if case % 10 == 0:
            keys[rng.integers(n)] = int(rng.integers(2 ** 22, 2 ** 30))
        align = int(rng.choice([16, 64, 128]))
        lo = (rng.integers(0, 4, n) * align).astype(np.int64) if case % 3 == 0 else None
        kw = dict(num_sms=int(rng.choice([1, 8, 132])), num_kv_heads=int(rng.choice([1, 8])), align=align,
                  cap=int(rng.choice([1, 2, 3, 16, 32])), params=BalancedParams(
                      waves=int(rng.choice([1, 4])), min_unit_keys=int(rng.choice([1, 128]))), out=None)
        total, longest = int(keys.sum()), int(keys.max())
        vectorized = ds._plan_units(keys.astype(np.int64), lo, total, longest, **kw)
        in_python = ds._plan_units_py(keys.tolist(), None if lo is None else lo.tolist(), total, longest, **kw)
        assert np.array_equal(vectorized.units, in_python.units), case
        assert np.array_equal(vectorized.units_per_request, in_python.units_per_request), case
        assert vectorized.unit_keys == in_python.unit_keys


@pytest.mark.parametrize("n", [3, 40])
def test_plan_into_given_rows(n):
    """``out``: the table is written into the given rows (a view of them), which must hold unit_capacity."""
    seq = np.array([30000] + [100] * (n - 1))
    kw = dict(num_sms=16, num_kv_heads=2, align=16, max_units_per_request=8)
    fresh = plan_decode_units(seq, None, **kw)
    out = np.full((unit_capacity(n, 16, 2), 4), -1, np.int32)
    table = plan_decode_units(seq, None, out=out, **kw)
    assert np.shares_memory(table.units, out) and np.array_equal(table.units, fresh.units)
    assert (out[table.num_units:] == -1).all()
    with pytest.raises(ValueError, match="unit_capacity"):
        plan_decode_units(seq, None, out=out[:table.num_units - 1], **kw)


# ---------------------------------------------------------------------------------------------------------------
# The scheduled kernel against the oracle (plan_attention / launch_attention)
# ---------------------------------------------------------------------------------------------------------------
def spec_for(**kw):
    base = dict(num_heads=8, num_kv_heads=2, head_size=32, dtype="bfloat16", block_size=16)
    base.update(kw)
    return AttentionSpec(**base)


def scheduled_run(spec, shapes, *, seed, num_decodes=None, align=16, tile=16, cap=8, num_sms=16, return_lse=False,
                  logit_magnitude=1.0, tree_parents=None, pad_rows=0, query_start_loc=None, runs=2, host_lens=None):
    """``shapes`` through a scheduled plan (planned with ``host_lens``' sequence lengths where given), ``runs``
    times on NaN-poisoned partials and outputs: checks the runs are equal, the counters back at zero, and returns
    (batch, schedule, plan, output, lse)."""
    batch = make_random_batch(spec, shapes, seed=seed, device=DEVICE, pad_tokens=2, logit_magnitude=logit_magnitude,
                              tree_parents=tree_parents)
    c = batch.common
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, c.slot_mapping, batch.k_scale, batch.v_scale)
    nd = c.num_reqs if num_decodes is None else num_decodes
    decode_q = max(s.query_len for s in shapes[:nd])
    qsl_cpu = c.query_start_loc_cpu.numpy()
    lens = c.seq_lens_cpu.numpy()[:nd] if host_lens is None else np.array(host_lens)
    table = plan_decode_units(lens, np.diff(qsl_cpu[:nd + 1]), num_sms=num_sms,
                              num_kv_heads=spec.num_kv_heads, align=align, max_units_per_request=cap,
                              sliding_window=spec.sliding_window, params=TINY)
    schedule = make_decode_schedule(table, device=DEVICE, align=align, max_units_per_request=cap)
    if pad_rows:  # a CUDA-graph buffer: more rows than units, the rest empty
        units = torch.zeros(table.num_units + pad_rows, 4, dtype=torch.int32, device=DEVICE)
        units[:table.num_units] = schedule.units[:table.num_units]
        schedule = dataclasses.replace(schedule, units=units, num_programs=table.num_units + pad_rows)
    ws = SplitKVWorkspace.allocate(batch.query.shape[0], spec.num_heads, spec.head_size, cap, device=DEVICE)
    plan = plan_attention(
        num_tokens=c.num_actual_tokens, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size, block_size=spec.block_size, num_seqs=c.num_reqs, max_query_len=c.max_query_len,
        max_seq_len=c.max_seq_len, kv_fp8=spec.is_fp8_kv_cache, causal=spec.causal,
        sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap,
        use_alibi=spec.alibi_slopes is not None, use_sinks=spec.has_sinks, return_lse=return_lse, num_decodes=nd,
        workspace=ws, config=KernelConfig(decode_tile_n=tile, tile_n=16), decode_query_len=decode_q,
        use_tree=c.spec_tree_mask is not None, decode_schedule=schedule)
    assert plan.grid == (spec.num_kv_heads, plan.grid[1], 1) and plan.decode_schedule is schedule
    assert plan.constexprs[UNIFIED_CONSTEXPRS.index("DECODE_SCHEDULED")]
    alibi = (torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=DEVICE)
             if spec.alibi_slopes is not None else None)
    tree = c.spec_tree_mask
    results = []
    for _ in range(runs):
        ws.partial_out.fill_(float("nan"))
        ws.partial_lse.fill_(float("nan"))
        out = batch.new_output()
        lse = torch.full((spec.num_heads, batch.query.shape[0]), float("nan"), device=DEVICE) if return_lse else None
        kv = batch.kv_cache
        launch_attention(plan, batch.query, kv[:, 0], kv[:, 1], out,
                         c.query_start_loc if query_start_loc is None else query_start_loc, c.seq_lens,
                         c.block_table, spec.softmax_scale, float(spec.logits_soft_cap or 0.0), alibi, batch.sinks,
                         batch.k_scale, batch.v_scale, lse, tree_mask=tree.view(torch.uint8) if tree is not None
                         else None, tree_indptr=c.spec_tree_mask_indptr)
        assert int(ws.counters.count_nonzero()) == 0, "the counters must be zero after the launch"
        results.append((out, lse))
    n = c.num_actual_tokens
    for out, lse in results[1:]:
        assert torch.equal(out[:n], results[0][0][:n]), "a second launch (a replay) gives the same output"
        if return_lse:
            assert torch.equal(lse[:, :n], results[0][1][:, :n])
    return batch, schedule, plan, results[0][0], results[0][1]


def check_oracle(batch, out, what):
    spec, n = batch.spec, batch.num_actual_tokens
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype, spec.kv_cache_dtype),
                           what)
    assert torch.isnan(out[n:].float()).all(), "padding rows must be left untouched"


# One long request beside short ones: the long one gets many units (19 of 16 keys with a cap of 32), the short ones
# one each; S(1, 0): one key; S(1, 2): fewer keys than a tile.
RAGGED = [S(1, 5), S(1, 300), S(1, 20), S(1, 0), S(1, 2), S(1, 47)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (2, 2), (10, 2)])
def test_scheduled_decode_ragged(num_heads, num_kv_heads):
    spec = spec_for(num_heads=num_heads, num_kv_heads=num_kv_heads)
    batch, schedule, _, out, _ = scheduled_run(spec, RAGGED, seed=1, cap=32)
    assert schedule.most_units > 8 and schedule.num_split >= 1 and (schedule.units_per_request == 1).sum() >= 3
    check_oracle(batch, out, f"scheduled decode, {num_heads}/{num_kv_heads} heads")


@pytest.mark.parametrize("name,spec_kw,return_lse", [
    ("window_sinks_lse", dict(sliding_window=40, has_sinks=True), True),
    ("softcap_alibi_lse", dict(logits_soft_cap=5.0, alibi_slopes=tuple(0.5 ** i for i in range(1, 9))), True),
    ("fp8_e4m3", dict(kv_cache_dtype="fp8"), False),
    ("fp8_e5m2_float16", dict(kv_cache_dtype="fp8_e5m2", dtype="float16"), False),
])
def test_scheduled_decode_features(name, spec_kw, return_lse):
    batch, schedule, _, out, lse = scheduled_run(spec_for(**spec_kw), RAGGED, seed=2, return_lse=return_lse,
                                                 logit_magnitude=3.0)
    assert schedule.num_split >= 1
    check_oracle(batch, out, name)
    if return_lse:
        n = batch.num_actual_tokens
        assert_close_to_oracle(lse[:, :n], reference_lse(batch), tolerance_for(torch.float32), f"{name} lse")
        assert torch.isnan(lse[:, n:]).all()


def test_scheduled_window_skips_the_keys_before_it():
    """With a window the units cover only the visible tiles: the long request's units start past 0."""
    spec = spec_for(sliding_window=64)
    batch, schedule, _, out, _ = scheduled_run(spec, [S(1, 300), S(1, 10)], seed=3, align=32)
    units = schedule.units[:schedule.num_units].cpu()
    inner_starts = units[(units[:, 0] == 0) & (units[:, 1] > 0), 1]
    assert int(inner_starts.min()) >= 224 + 32  # position 300 sees keys 237..300: the units split tiles 224 onwards
    check_oracle(batch, out, "window")


@pytest.mark.parametrize("scale", [0.3, 2.5])
def test_scheduled_units_cover_the_device_lengths_whatever_the_host_planned(scale):
    """Units planned from other lengths than the device's: the first and last units of each request reach to the
    ends of its keys, so the output is still right (only the balance suffers)."""
    spec = spec_for(sliding_window=100, has_sinks=True)
    host = [max(1, int(s.seq_len * scale)) for s in RAGGED]
    batch, schedule, _, out, _ = scheduled_run(spec, RAGGED, seed=12, host_lens=host)
    assert schedule.num_split >= 1
    check_oracle(batch, out, f"planned on lengths x{scale}")


def test_scheduled_units_aligned_to_a_multiple_of_the_tile():
    batch, schedule, _, out, _ = scheduled_run(spec_for(has_sinks=True), RAGGED, seed=4, align=32, tile=16)
    check_oracle(batch, out, "units of two tiles")


def test_scheduled_multi_token_tree_verify():
    rng = random.Random(5)
    spec = spec_for(num_speculative_tokens=3, speculative_tree=True, has_sinks=True)
    shapes = [S(4, 200), S(4, 1), S(4, 25)]
    trees = [random_tree_parents(rng, 4), [-1, 0, 0, 1], None]
    batch, schedule, _, out, lse = scheduled_run(spec, shapes, seed=5, tree_parents=trees, return_lse=True)
    assert schedule.units_per_request[0] > 1
    check_oracle(batch, out, "verify")
    n = batch.num_actual_tokens
    assert_close_to_oracle(lse[:, :n], reference_lse(batch), tolerance_for(torch.float32), "verify lse")


def test_scheduled_decodes_in_a_mixed_launch():
    """The decodes' units and the prefill programs in one launch (the generic path after the units)."""
    shapes = RAGGED + [S(24, 19), S(9)]
    batch, schedule, plan, out, _ = scheduled_run(spec_for(has_sinks=True), shapes, seed=6, num_decodes=len(RAGGED))
    assert plan.constexprs[UNIFIED_CONSTEXPRS.index("GENERIC_PATH")] and schedule.num_split >= 1
    check_oracle(batch, out, "mixed")


def test_scheduled_empty_rows_and_an_empty_request():
    """Rows past the units (a CUDA graph's fixed grid) run nothing; a split request without query tokens (a padded
    batch) writes nothing and still takes its tickets: the counters end at zero."""
    spec = spec_for(has_sinks=True)
    shapes = [S(1, 50), S(1, 17), S(1, 200)]
    batch = make_random_batch(spec, shapes, seed=7, device=DEVICE, pad_tokens=1)
    qsl = batch.common.query_start_loc.clone()
    qsl[-1] = qsl[-2]  # the last request (several units): zero tokens, its row becomes padding
    batch, schedule, _, out, _ = scheduled_run(spec, shapes, seed=7, pad_rows=5, query_start_loc=qsl, runs=1)
    assert schedule.units_per_request[2] > 1 and schedule.num_programs == schedule.num_units + 5
    full = oracle_attention(batch)
    assert_close_to_oracle(out[:2], full[:2], tolerance_for(spec.torch_dtype), "with an empty request")
    assert torch.isnan(out[2:].float()).all()


def test_scheduled_plan_checks(monkeypatch):
    table = plan_decode_units(np.array([300, 20]), None, num_sms=16, num_kv_heads=2, align=16,
                              max_units_per_request=8, params=TINY)
    schedule = make_decode_schedule(table, device=DEVICE, align=16, max_units_per_request=8)
    kw = dict(num_tokens=2, num_heads=8, num_kv_heads=2, head_size=32, block_size=16, num_seqs=2, max_query_len=1,
              max_seq_len=300, kv_fp8=False, causal=True, num_decodes=2, decode_schedule=schedule)
    ws = SplitKVWorkspace.allocate(4, 8, 32, 8, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        plan_attention(workspace=None, **kw)
    with pytest.raises(ValueError, match="workspace"):
        plan_attention(workspace=SplitKVWorkspace.allocate(4, 8, 32, 4, device=DEVICE), **kw)  # 4 < 8 segments
    with pytest.raises(ValueError, match="decode tile"):
        plan_attention(workspace=ws, config=KernelConfig(decode_tile_n=32), **kw)
    with pytest.raises(ValueError, match="num_kv_splits"):
        plan_attention(workspace=ws, num_kv_splits=2, **kw)
    plan = plan_attention(workspace=ws, config=KernelConfig(decode_tile_n=16), **kw)
    assert plan.grid == (2, schedule.num_units, 1) and plan.num_decode_programs == schedule.num_units
    assert plan.reduce_grid is None and not plan.fused_reduce and plan.num_kv_splits == 1
    # beside prefill programs that would take the grid's second axis past CUDA's limit: one program per decode
    monkeypatch.setattr("attnbackends.triton.launch.MAX_GRID_Y", schedule.num_units + 3)
    mixed = dict(kw, num_tokens=2 + 300, num_seqs=3, max_query_len=300)
    plan = plan_attention(workspace=ws, config=KernelConfig(decode_tile_n=16, block_m=16), **mixed)
    assert plan.decode_schedule is None and plan.grid[1:] == (2, 1) and plan.num_decode_programs == 2


# ---------------------------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------------------------
def tiny_scheduler(builder, mode="balanced"):
    """Replace a CPU builder's scheduler by one for tiny shapes (16 SMs, one-tile units)."""
    old = builder.decode_scheduler
    builder.decode_scheduler = DecodeScheduler(mode, old.device, num_sms=16, num_kv_heads=old.num_kv_heads,
                                               align=old.align, max_units_per_request=old.max_units_per_request,
                                               sliding_window=old.sliding_window, params=TINY)
    return builder


def run_builder(builder, batch):
    impl = TritonImpl(batch.spec, sinks=batch.sinks, k_scale=batch.k_scale, v_scale=batch.v_scale)
    out = batch.new_output()
    metadata = builder.build(batch.common)
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), metadata, out)
    return metadata, out


@pytest.mark.parametrize("shapes,name", [
    ([S(1, 700), S(1, 30), S(1, 5), S(1, 90)], "decodes"),
    ([S(1, 700), S(1, 30), S(1, 5), S(40, 10), S(17)], "mixed"),
])
def test_builder_schedules_the_decodes_balanced(shapes, name):
    spec = spec_for(has_sinks=True, sliding_window=600)
    batch = make_random_batch(spec, shapes, seed=8, device=DEVICE, pad_tokens=2)
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=8))
    metadata, out = run_builder(builder, batch)
    schedule = metadata.decode_schedule
    assert schedule is not None and schedule.num_split == 1 and metadata.plan.decode_schedule is schedule
    assert metadata.decode_schedule_note.startswith("balanced (decode_schedule='balanced')")
    check_oracle(batch, out, f"builder, {name}")


def test_builder_auto_rule_and_uniform():
    spec = spec_for()
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=8), "auto")
    ragged = make_random_batch(spec, [S(1, 700), S(1, 30), S(1, 5)], seed=9, device=DEVICE)
    even = make_random_batch(spec, [S(1, 300), S(1, 310), S(1, 290)], seed=9, device=DEVICE)
    assert builder.build(ragged.common).decode_schedule.why.startswith("auto: ragged")
    metadata = builder.build(even.common)
    assert metadata.decode_schedule is None and metadata.decode_schedule_note.startswith("uniform split")
    assert TritonMetadataBuilder(spec, DEVICE, decode_schedule="uniform").decode_scheduler is None
    if DEVICE == "cpu":
        assert TritonMetadataBuilder(spec, "cpu").decode_scheduler is None, "no workspace on the CPU by default"


def test_deterministic_mode_keeps_its_schedule():
    spec = spec_for()
    with pytest.raises(ValueError, match="deterministic"):
        TritonMetadataBuilder(spec, DEVICE, deterministic=True, decode_schedule="balanced")
    with pytest.raises(ValueError, match="decode_schedule"):
        TritonMetadataBuilder(spec, DEVICE, decode_schedule="even")
    builder = TritonMetadataBuilder(spec, DEVICE, deterministic=True)
    assert builder.decode_scheduler is None
    batch = make_random_batch(spec, [S(1, 700), S(1, 5)], seed=10, device=DEVICE)
    assert builder.build(batch.common).decode_schedule is None


def test_cuda_graph_shape_keeps_one_buffer():
    """A decode-only shape built for capture with the balanced schedule gets a fixed-capacity buffer; every later
    build of that shape rewrites it (same tensor, same grid), whatever the rule says; other shapes get fresh
    tables."""
    spec = spec_for()
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=8), "auto")
    capture = make_random_batch(spec, [S(1, 700), S(1, 30), S(1, 5)], seed=11, device=DEVICE)
    captured = builder.build_for_cudagraph_capture(capture.common)
    schedule = captured.decode_schedule
    capacity = unit_capacity(3, 16, spec.num_kv_heads, TINY.waves)
    assert schedule.num_programs == capacity and schedule.units.shape[0] == capacity
    assert captured.plan.grid[1] == capacity
    even = make_random_batch(spec, [S(1, 300), S(1, 310), S(1, 290)], seed=12, device=DEVICE)
    replay = builder.build(even.common)
    assert replay.decode_schedule.units.data_ptr() == schedule.units.data_ptr()
    assert replay.plan.grid == captured.plan.grid and replay.decode_schedule.why.startswith("a shape captured")
    units = schedule.units.cpu()
    n = replay.decode_schedule.num_units
    assert (units[n:] == 0).all() and sorted(set(units[:n, 0].tolist())) == [0, 1, 2]
    other = make_random_batch(spec, [S(1, 700), S(1, 30)], seed=13, device=DEVICE)
    fresh = builder.build(other.common).decode_schedule
    assert fresh.units.data_ptr() != schedule.units.data_ptr() and fresh.num_programs == fresh.num_units


@pytest.mark.parametrize("n", [5, 40])
@pytest.mark.parametrize("window", [None, 3000])
def test_scheduler_plans_the_rule(n, window):
    """The scheduler's table (from the batch's host lengths, in Python or numpy by size) is plan_decode_units'."""
    rng = np.random.default_rng(n)
    seq = heavy_tailed(rng, n, 700).astype(np.int32)
    seq[0] = 20000
    qlen = rng.integers(1, 4, n).astype(np.int32)
    seq = np.maximum(seq, qlen)
    qsl = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    common = types.SimpleNamespace(seq_lens_cpu=torch.from_numpy(seq), query_start_loc_cpu=torch.from_numpy(qsl),
                                   num_reqs=n, num_actual_tokens=int(qsl[-1]))
    scheduler = DecodeScheduler("balanced", "cpu", num_sms=16, num_kv_heads=2, align=16, max_units_per_request=8,
                                sliding_window=window, params=TINY)
    schedule = scheduler.schedule(common, n, decode_only=True)
    table = plan_decode_units(seq, qlen, num_sms=16, num_kv_heads=2, align=16, max_units_per_request=8,
                              sliding_window=window, params=TINY)
    assert np.array_equal(schedule.units.numpy(), table.units) and schedule.num_split > 0
    assert np.array_equal(schedule.units_per_request, table.units_per_request)


def test_eager_tables_outlive_later_builds():
    """Steps built ahead of the GPU: an eager batch's units are its own, whatever is built after it."""
    spec = spec_for()
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=8))
    first = builder.build(make_random_batch(spec, [S(1, 700), S(1, 30), S(1, 5)], seed=16, device=DEVICE).common)
    units = first.decode_schedule.units.clone()
    builder.build(make_random_batch(spec, [S(1, 9), S(1, 500)], seed=17, device=DEVICE).common)
    assert torch.equal(first.decode_schedule.units, units)


class _Copy:
    """A stand-in for the CUDA event after a staging slot's copy."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waits += 1
        self.done = True


def test_eager_staging_slots_are_rewritten_only_after_their_copy():
    """The staging ring (CUDA's eager schedules; events faked here): a slot whose copy is pending is never handed
    out again; the host ahead of the GPU gets new slots up to MAX_STAGING_SLOTS, then waits for the oldest copy."""
    ring = ds._StagingRing(torch.device("cpu"))

    def build(rows=10):
        slot = ring.take(rows)
        assert not slot.copied or slot.event.done, "a slot with a pending copy was handed out"
        slot.event, slot.copied = _Copy(), True  # this build's copy, queued behind the GPU's work
        return slot

    ahead = [build() for _ in range(ds.MAX_STAGING_SLOTS)]
    assert len({id(slot) for slot in ahead}) == ds.MAX_STAGING_SLOTS == len(ring.slots)
    oldest = ahead[0].event
    assert build() is ahead[0] and oldest.waits == 1, "past the last slot: wait for the oldest copy"
    for slot in ring.slots:
        slot.event.done = True  # the GPU caught up: the slots are used in turn, no new ones
    assert [build() for _ in range(ds.MAX_STAGING_SLOTS)] == ahead[1:] + ahead[:1]
    for slot in ring.slots:
        slot.event.done = True
    bigger = build(rows=ahead[1].rows.shape[0] + 1)  # a larger batch: the next slot in turn, replaced
    assert bigger.rows.shape[0] > ahead[1].rows.shape[0] and len(ring.slots) == ds.MAX_STAGING_SLOTS
    assert ahead[1] not in ring.slots and bigger in ring.slots


def test_a_captured_table_rewritten_by_a_later_build_still_covers_every_key():
    """Two batches of one captured shape built before either runs (ahead of the GPU, or draft steps): the first
    launch reads the second's table, and is still right (each request's units reach to its keys' ends)."""
    spec = spec_for(has_sinks=True)
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=8))
    first = make_random_batch(spec, [S(1, 700), S(1, 30), S(1, 5)], seed=14, device=DEVICE, pad_tokens=1)
    second = make_random_batch(spec, [S(1, 3), S(1, 400), S(1, 260)], seed=15, device=DEVICE, pad_tokens=1)
    meta_first = builder.build_for_cudagraph_capture(first.common)
    meta_second = builder.build(second.common)
    assert meta_first.decode_schedule.units.data_ptr() == meta_second.decode_schedule.units.data_ptr()
    for batch, meta in ((first, meta_first), (second, meta_second)):
        out = batch.new_output()
        TritonImpl(spec, sinks=batch.sinks).forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta,
                                                    out)
        check_oracle(batch, out, "a table rewritten by a later build")


def test_captured_plan_replayed_over_a_later_batch_of_its_shape():
    """What a CUDA-graph replay runs: the launch captured from the first batch (its plan, its buffers) over a later
    batch of the same shape copied into those buffers, after the later build rewrote the captured unit table."""
    spec = spec_for(has_sinks=True)
    width, num_blocks = 64, 8 * 64

    def batch_of(ctxs, seed):
        batch = make_random_batch(spec, [S(1, c) for c in ctxs], seed=seed, device=DEVICE, num_blocks=num_blocks,
                                  pad_tokens=2)
        table = torch.zeros(len(ctxs), width, dtype=torch.int32, device=DEVICE)
        table[:, :batch.common.block_table.shape[1]] = batch.common.block_table
        return batch, dataclasses.replace(batch.common, block_table=table, block_table_cpu=table.cpu())

    first, common = batch_of([70] * 6 + [300, 500], 40)
    static = dataclasses.replace(common, query_start_loc=common.query_start_loc.clone(),
                                 seq_lens=common.seq_lens.clone(), block_table=common.block_table.clone())
    builder = tiny_scheduler(TritonMetadataBuilder(spec, DEVICE, decode_schedule="balanced", max_num_reqs=16))
    impl = TritonImpl(spec, sinks=first.sinks)
    captured = builder.build_for_cudagraph_capture(static)
    assert captured.decode_schedule.num_split == 2
    query, kv_cache = first.query.clone(), first.kv_cache.clone()
    out = first.new_output()
    impl.forward(query, first.key, first.value, kv_cache, captured, out)
    check_oracle(first, out, "the captured batch")

    later, new = batch_of([400] + [4] * 7, 41)
    later = dataclasses.replace(later, sinks=first.sinks)
    for dst, src in ((query, later.query), (static.query_start_loc, new.query_start_loc),
                     (static.seq_lens, new.seq_lens), (static.block_table, new.block_table), (kv_cache, later.kv_cache)):
        dst.copy_(src)
    reshape_and_cache(later.key, later.value, kv_cache, new.slot_mapping)
    rebuilt = builder.build(dataclasses.replace(new, query_start_loc=static.query_start_loc,
                                                seq_lens=static.seq_lens, block_table=static.block_table))
    assert rebuilt.decode_schedule.units.data_ptr() == captured.decode_schedule.units.data_ptr()
    assert rebuilt.decode_schedule.num_split == 1
    out = later.new_output()
    impl.forward(query, None, None, kv_cache, captured, out)
    check_oracle(later, out, "the captured plan over a later batch of its shape")


def test_kernel_notes_say_how_decodes_are_scheduled():
    spec = spec_for()
    notes = TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(9, 0))
    assert notes[0].startswith("prefill kernel") and notes[1].startswith("decode schedule: balanced where")
    assert "uniform split" in TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cpu())[1]


# ---------------------------------------------------------------------------------------------------------------
# GPU: realistic shapes, the backend end to end, CUDA graphs
# ---------------------------------------------------------------------------------------------------------------
GPU_SPEC = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16")


def lognormal_shapes(seed, n, median, sigma=0.9, cap=None, query_len=1):
    rng = np.random.default_rng(seed)
    return [S(query_len, int(c)) for c in heavy_tailed(rng, n, median, sigma, cap)]


def gpu_check(spec, shapes, *, mode="balanced", seed=0, expect_split=True, **batch_kw):
    batch = make_random_batch(spec, shapes, seed=seed, device="cuda", pad_tokens=3, **batch_kw)
    builder = TritonMetadataBuilder(spec, "cuda", decode_schedule=mode, max_num_reqs=max(256, len(shapes)))
    metadata, out = run_builder(builder, batch)
    if expect_split:
        assert metadata.decode_schedule is not None and metadata.decode_schedule.num_split > 0, \
            metadata.decode_schedule_note
    check_oracle(batch, out, f"{mode}: {metadata.decode_schedule_note}")
    return metadata


@gpu
@requires_cuda
@pytest.mark.parametrize("name,shapes,spec_kw", [
    ("lognormal_128", lognormal_shapes(0, 128, 1500), {}),
    ("lognormal_32_long", lognormal_shapes(1, 32, 12000, cap=32768), {}),
    ("two_mode", [S(1, 600)] * 96 + [S(1, 24000)] * 8, {}),
    ("two_mode_window_sinks", [S(1, 600)] * 48 + [S(1, 20000)] * 4, dict(sliding_window=4096, has_sinks=True)),
    ("two_mode_softcap", [S(1, 300)] * 60 + [S(1, 9000)] * 4, dict(logits_soft_cap=30.0)),
    ("two_mode_fp8_e4m3", [S(1, 600)] * 64 + [S(1, 16000)] * 4, dict(kv_cache_dtype="fp8")),
    ("two_mode_fp8_e5m2", [S(1, 600)] * 64 + [S(1, 16000)] * 4, dict(kv_cache_dtype="fp8_e5m2")),
    ("b1_16k", [S(1, 16383)], {}),
])
@pytest.mark.parametrize("mode", ["balanced", "auto"])
def test_gpu_balanced_decode(name, shapes, spec_kw, mode):
    spec = AttentionSpec(**GPU_SPEC, **spec_kw)
    gpu_check(spec, shapes, mode=mode, seed=21, expect_split=mode == "balanced" or not name.startswith("b1"))


@gpu
@requires_cuda
def test_gpu_balanced_verify_with_trees():
    rng = random.Random(3)
    spec = AttentionSpec(**GPU_SPEC, num_speculative_tokens=3, speculative_tree=True)
    shapes = [S(4, 500)] * 40 + [S(4, 12000)] * 3
    trees = [random_tree_parents(rng, 4) for _ in shapes]
    gpu_check(spec, shapes, seed=22, tree_parents=trees)


@gpu
@requires_cuda
@pytest.mark.parametrize("prefills", [[S(512, 2048), S(512, 1000)], [S(300), S(77)]])
def test_gpu_balanced_decodes_in_a_mixed_step(prefills):
    spec = AttentionSpec(**GPU_SPEC)
    gpu_check(spec, [S(1, 600)] * 60 + [S(1, 20000)] * 4 + prefills, seed=23)


@gpu
@requires_cuda
def test_gpu_cuda_graph_replays_bit_for_bit():
    """Capture a ragged decode step with the balanced schedule, replay it 200 times bit for bit against the eager
    run, then replay new lengths (the builder rewrites the captured unit table) against the oracle."""
    spec = AttentionSpec(**GPU_SPEC, has_sinks=True)
    contexts = [700] * 30 + [9000, 15000]
    width = 1024  # block-table width: up to 16384 keys per request
    num_blocks = 32 * width // 2

    def batch_of(ctxs, seed):
        batch = make_random_batch(spec, [S(1, c) for c in ctxs], seed=seed, device="cuda", num_blocks=num_blocks,
                                  pad_tokens=2)
        table = torch.zeros(len(ctxs), width, dtype=torch.int32, device="cuda")
        table[:, :batch.common.block_table.shape[1]] = batch.common.block_table
        return batch, dataclasses.replace(batch.common, block_table=table, block_table_cpu=table.cpu())

    first, common = batch_of(contexts, 30)
    static = dataclasses.replace(common, query_start_loc=common.query_start_loc.clone(),
                                 seq_lens=common.seq_lens.clone(), block_table=common.block_table.clone(),
                                 slot_mapping=common.slot_mapping.clone())
    query, key, value, kv_cache = first.query.clone(), first.key.clone(), first.value.clone(), first.kv_cache.clone()
    output = first.new_output()
    builder = TritonMetadataBuilder(spec, "cuda", decode_schedule="balanced", max_num_reqs=64)
    impl = TritonImpl(spec, sinks=first.sinks)
    meta = builder.build_for_cudagraph_capture(static)
    assert meta.decode_schedule is not None and meta.decode_schedule.num_split == 2
    eager = first.new_output()
    impl.forward(first.query, first.key, first.value, first.kv_cache.clone(), builder.build(first.common), eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl.forward(query, key, value, kv_cache.clone(), meta, output)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(query, None, None, kv_cache, meta, output)
    impl.forward(query, key, value, kv_cache, meta, output)  # the step's keys into the captured cache
    builder.build(static)  # the captured shape again: rewrites the same table
    n = first.num_actual_tokens
    for replay in range(200):
        output.fill_(float("nan"))
        graph.replay()
        assert torch.equal(output[:n], eager[:n]), f"replay {replay}"
    check_oracle(first, output, "graph replay")

    for seed, ctxs in enumerate(([5000] + [40] * 31, [300 + 29 * i for i in range(32)], contexts[::-1]), start=31):
        batch, new = batch_of(ctxs, seed)
        batch = dataclasses.replace(batch, sinks=first.sinks)  # the captured impl's sinks: the oracle's too
        for dst, src in ((query, batch.query), (static.query_start_loc, new.query_start_loc),
                         (static.seq_lens, new.seq_lens), (static.block_table, new.block_table)):
            dst.copy_(src)
        kv_cache.copy_(batch.kv_cache)
        reshape_and_cache(batch.key, batch.value, kv_cache, new.slot_mapping)
        step = dataclasses.replace(new, query_start_loc=static.query_start_loc, seq_lens=static.seq_lens,
                                   block_table=static.block_table)
        assert builder.build(step).decode_schedule.units.data_ptr() == meta.decode_schedule.units.data_ptr()
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_oracle(batch, output, f"graph replay on new lengths {ctxs[:3]}...")
