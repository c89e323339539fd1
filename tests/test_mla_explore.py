"""CPU checks of the MLA decode candidates in benchmarks/mla_explore*.py.

Every Triton candidate config runs under the interpreter on tiny dimensions (8 heads, latent 64 + rope 16,
page 64) against the float64 oracle: one query per request and two (speculative decoding, causal within the
request), lengths around the tile and page edges, the config's own schedule and a forced 3-way split (the LSE
merge), NaN in every cache slot no request owns, outputs poisoned with NaN. The Gluon candidate cannot run on a
CPU: it is imported and compiled for sm_90 (registers and shared memory within the hardware's limits).
"""

import math
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CPU interpreter checks; the GPU runs python -m benchmarks.mla_explore", allow_module_level=True)

os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks import mla_explore as me  # noqa: E402
from benchmarks import mla_explore_triton as mt  # noqa: E402

DIMS = me.DRY_DIMS
SEQS_ONE = [1, 63, 64, 65, 200]
SEQS_TWO = [65, 130]


def _triton_configs():
    cfgs = []
    for fam in "ABCDEG":
        cfgs += me.family_configs(fam, quick=False)
    return cfgs


TRITON_CONFIGS = _triton_configs()


@pytest.fixture(scope="module", autouse=True)
def _allocator():
    me.set_tma_allocator()


def _quantised_query_batch(b: me.DecodeBatch) -> me.DecodeBatch:
    """``b`` with its queries rounded as the fp8 Q.K^T candidates round them (e4m3, one scale per row over all
    LKV + R columns), so the oracle sees the same queries."""
    q = torch.cat([b.q_nope, b.q_pe], dim=-1).float()
    s = q.abs().amax(dim=-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (q / s).to(torch.float8_e4m3fn).float() * s
    out = me.DecodeBatch.__new__(me.DecodeBatch)
    out.__dict__.update(b.__dict__)
    out.q_nope, out.q_pe = q[..., :DIMS.lkv].to(b.dtype), q[..., DIMS.lkv:].to(b.dtype)
    return out


def _batches(kv_fp8: bool):
    ks = 0.5 if kv_fp8 else 1.0
    return [me.DecodeBatch(SEQS_ONE, 1, dims=DIMS, dtype=torch.float32, kv_fp8=kv_fp8, k_scale=ks, device="cpu",
                           seed=3),
            me.DecodeBatch(SEQS_TWO, 2, dims=DIMS, dtype=torch.float32, kv_fp8=kv_fp8, k_scale=ks, device="cpu",
                           seed=4)]


# Output relative error / LSE error allowed per fp8 mode against the oracle on the candidate's own queries:
# exact up to float32 except the bf16 rounding of P ("qk") and the e4m3 rounding of P ("qkpv").
TOL = {"": (1e-5, 1e-5), "dequant": (1e-5, 1e-5), "qk": (5e-3, 1e-5), "qkpv": (4e-2, 1e-5)}


@pytest.mark.parametrize("cfg", TRITON_CONFIGS, ids=[c.label.replace(" ", "_") for c in TRITON_CONFIGS])
def test_triton_candidate_matches_oracle(cfg):
    batches = _batches(cfg.kv_fp8)
    refs = []
    for b in batches:
        ref_b = _quantised_query_batch(b) if cfg.fp8 in ("qk", "qkpv") else b
        refs.append(me.reference(ref_b, torch.float64))
    for b, (ro, rl) in zip(batches, refs):
        hb = math.ceil(DIMS.heads / cfg.block_h)
        for sched in (mt.build_schedule(b.seq_lens_host, b.q_len, num_sms=8, head_blocks=hb,
                                        balanced=cfg.schedule == "balanced"),
                      mt.build_schedule(b.seq_lens_host, b.q_len, splits=3, align=64)):
            out, lse = b.new_output()
            me.make_launch_with(cfg, b, out, lse, sched, num_sms=8)()
            err = me.compare(out, lse, ro, rl)
            rel_tol, lse_tol = TOL[cfg.fp8]
            assert err["rel"] < rel_tol and err["lse_max_abs"] < lse_tol, (
                f"{cfg.label} q_len {b.q_len} splits {sched.splits_per_row}: {err}")


def test_unused_cache_slots_are_nan_and_oracle_ignores_them():
    b = me.DecodeBatch([65, 3], 1, dims=DIMS, dtype=torch.float32, device="cpu", seed=5)
    nan_slots = torch.isnan(b.cache[..., 0]).sum().item()
    pages = b.cache.shape[0]
    assert nan_slots == pages * DIMS.page - 68  # two spare pages + the tails of both requests' last pages
    out, lse = me.reference(b, torch.float64)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_reference_matches_a_dense_computation():
    b = me.DecodeBatch([70], 2, dims=DIMS, dtype=torch.float32, device="cpu", seed=6)
    out, lse = me.reference(b, torch.float64)
    latent = b.cache[b.block_table[0, :2].long()].reshape(-1, DIMS.lkv + DIMS.rope)[:70].double()
    for i in range(2):
        q = torch.cat([b.q_nope[i], b.q_pe[i]], -1).double()
        s = (q @ latent[:69 + i].T) * DIMS.scale
        torch.testing.assert_close(lse[i], torch.logsumexp(s, -1))
        torch.testing.assert_close(out[i], torch.softmax(s, -1) @ latent[:69 + i, :DIMS.lkv])


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_schedule_covers_every_row_once(balanced, splits):
    seqs, q_len = [2, 500, 1300, 64], 2
    sched = mt.build_schedule(seqs, q_len, splits=None if balanced else splits, num_sms=16, head_blocks=2,
                              min_keys=128, align=64, balanced=balanced)
    work = sched.work.tolist()
    lengths = [hi - lo for _, _, lo, hi, _ in work]
    assert lengths == sorted(lengths, reverse=True)
    by_row: dict = {}
    for t, b, lo, hi, slot in work:
        assert t // q_len == b and lo < hi and lo % 64 == 0
        by_row.setdefault(t, []).append((lo, hi, slot))
    split_rows = {t: (first, count) for t, first, count in sched.rows.tolist()}
    for b, L in enumerate(seqs):
        for i in range(q_len):
            t = b * q_len + i
            pieces = sorted(by_row[t])
            assert pieces[0][0] == 0 and pieces[-1][1] == L - q_len + i + 1
            assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
            if len(pieces) == 1:
                assert pieces[0][2] == -1 and t not in split_rows
            else:
                first, count = split_rows[t]
                assert count == len(pieces) and sorted(p[2] for p in pieces) == list(range(first, first + count))
    assert sched.num_slots == sum(c for _, c in split_rows.values())


def test_schedule_rejects_requests_shorter_than_their_queries():
    with pytest.raises(ValueError, match="seq_len >= q_len"):
        mt.build_schedule([5, 1], 2)


def test_family_configs_are_distinct_and_quick_is_first():
    for fam in "ABCDEG":
        full = me.family_configs(fam, quick=False)
        assert len({c.label for c in full}) == len(full)
        assert me.family_configs(fam, quick=True) == full[:1]
    with pytest.raises(ValueError, match="family"):
        me.family_configs("Z", quick=False)


@pytest.mark.parametrize("cfg,match", [
    (mt.TritonConfig("A", nchunk=3), "nchunk"),
    (mt.TritonConfig("A", nchunk=1, load=1), "TMA box"),
    (mt.TritonConfig("A", block_n=128, load=1), "page"),
    (mt.TritonConfig("A", fp8="int8"), "fp8"),
    (mt.TritonConfig("A", schedule="greedy"), "schedule"),
    (mt.TritonConfig("A", fp8="qkpv", p_via_mem=True), "p_via_mem"),
])
def test_bad_configs_are_rejected(cfg, match):
    with pytest.raises(ValueError, match=match):
        mt.validate_config(cfg, lkv=512, rope=64, page=64)


def test_fp8_config_needs_an_fp8_cache():
    b = me.DecodeBatch([65], 1, dims=DIMS, dtype=torch.float32, device="cpu")
    out, lse = b.new_output()
    with pytest.raises(ValueError, match="cache dtype"):
        me.make_launch(mt.TritonConfig("E", fp8="dequant"), b, out, lse, num_sms=8)


def test_configs_round_trip_through_json():
    for cfg in TRITON_CONFIGS:
        assert me.config_from_json(me.config_to_json(cfg)) == cfg


def test_gluon_candidate_imports_and_refuses_the_interpreter():
    mg = pytest.importorskip("benchmarks.mla_explore_gluon")
    cfgs = mg.family_configs(quick=False)
    assert len({c.label for c in cfgs}) == len(cfgs) and mg.family_configs(quick=True) == cfgs[:1]
    for cfg in cfgs:
        assert me.config_from_json(me.config_to_json(cfg)) == cfg
    b = me.DecodeBatch([65], 1, dims=DIMS, dtype=torch.bfloat16, device="cpu")
    out, lse = b.new_output()
    with pytest.raises(NotImplementedError, match="interpreter"):
        me.make_launch(cfgs[0], b, out, lse, num_sms=8)


def test_gluon_candidates_compile_for_sm90(tmp_path):
    """Every Gluon config is compiled for Hopper (no GPU needed; in a fresh process, since the interpreter that
    the other tests use patches triton.language in this one): it must fit the shared memory one block may use,
    and ptxas must not serialise its wgmma (which a register written during an in-flight wgmma causes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    mg = pytest.importorskip("benchmarks.mla_explore_gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.mla_explore", "--compile-only", "--families", "F",
                          "--out", str(tmp_path)], cwd=Path(__file__).resolve().parents[1], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reports = json.loads((tmp_path / "mla_explore_compile.json").read_text())
    assert [r["label"] for r in reports] == [c.label for c in mg.family_configs(quick=False)]
    for rep in reports:
        assert "error" not in rep and not rep["shared_over_limit"], rep
        assert not [n for n in rep["ptxas_notes"] if "serialized" in n], rep
        assert rep["wgmma"], f"no wgmma in {rep['label']}"


def test_driver_dry_run_checks_times_and_writes_rows(tmp_path):
    """The whole driver through the interpreter: child-process probes, the checks on the timed shapes, JSON rows
    and the markdown table (timings meaningless)."""
    import json

    rc = me.main(["--dry-run-cpu", "--quick", "--families", "A,E", "--out", str(tmp_path), "--budget-s", "200"])
    assert rc == 0
    data = json.loads((tmp_path / "mla_explore.json").read_text())
    assert [p["status"] for p in data["probes"]] == ["ok", "ok"]
    backends = {(r["backend"], r["kv_dtype"], r["q_len"]) for r in data["rows"]}
    for q_len in (1, 2):
        assert ("triton_A", "auto", q_len) in backends and ("triton_E", "fp8_e4m3", q_len) in backends
    assert all(r["rel_err"] < me.TOL_BF16[0] for r in data["rows"] if r["backend"] == "triton_A")
    table = (tmp_path / "mla_explore.md").read_text()
    assert "A h64" in table and "E h64" in table
