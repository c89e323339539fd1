"""Checks of the Gluon causal prefill candidate (benchmarks/prefill_explore_gluon.py).

CPU: every config compiles for sm_90 in a fresh process (the interpreter that the other tests use patches
triton.language in this one) with no spill stack, shared memory within what one block may use, wgmma and no
ptxas note that it serialised them; bad arguments are refused with a clear error. GPU: the kernel against a
float64 reference on small varlen batches (lengths around the tile edges, GQA 4 and 1), outputs poisoned with
NaN and a NaN guard band after the last token that must stay untouched.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pg = pytest.importorskip("benchmarks.prefill_explore_gluon")

REPO = Path(__file__).resolve().parents[1]


def test_every_config_compiles_for_sm90_without_spills_or_serialised_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "benchmarks.prefill_explore_gluon", "--compile-only"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reports = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in reports] == pg.CONFIGS
    for rep in reports:
        assert rep["stack"] == 0 and rep["local"] == 0, rep
        assert not rep["shared_over_limit"], rep
        assert not [n for n in rep["ptxas_notes"] if "serialized" in n.lower()], rep
        assert rep["wgmma"] and rep["mma_sync"] == 0, rep
        assert rep["regs"] <= 255, rep


def _cpu_args(tokens=64, heads=8, kv_heads=2, head=128, dtype=torch.bfloat16):
    q = torch.randn(tokens, heads, head).to(dtype)
    k = torch.randn(tokens, kv_heads, head).to(dtype)
    v = torch.randn(tokens, kv_heads, head).to(dtype)
    qsl = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    return q, k, v, torch.empty_like(q), qsl


@pytest.mark.parametrize("module", ["benchmarks.prefill_explore_gluon", "benchmarks.prefill_explore_gluon_ws"])
@pytest.mark.parametrize("change,exc,match", [
    (dict(head=64), NotImplementedError, "head_size"),
    (dict(dtype=torch.float32), ValueError, "bfloat16 or float16"),
    (dict(kv_heads=3, heads=8), ValueError, "multiple of kv heads"),
])
def test_bad_shapes_and_dtypes_are_refused(module, change, exc, match):
    """Both Gluon prefill candidates (the plain one and the warp-specialised one) refuse these arguments."""
    launch_args = pytest.importorskip(module).launch_args
    q, k, v, out, qsl = _cpu_args(**change)
    with pytest.raises(exc, match=match):
        launch_args(q, k, v, out, qsl, 32, 0.1)


@pytest.mark.parametrize("module", ["benchmarks.prefill_explore_gluon", "benchmarks.prefill_explore_gluon_ws"])
def test_bad_offsets_layout_and_tiles_are_refused_by_both(module):
    launch_args = pytest.importorskip(module).launch_args
    q, k, v, out, qsl = _cpu_args()
    with pytest.raises(ValueError, match="query_start_loc"):
        launch_args(q, k, v, out, qsl.long(), 32, 0.1)
    with pytest.raises(ValueError, match="k must be contiguous"):
        launch_args(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, out, qsl, 32, 0.1)
    with pytest.raises(ValueError, match="block_n"):
        launch_args(q, k, v, out, qsl, 32, 0.1, block_n=32)


def test_bad_offsets_layout_and_config_are_refused():
    q, k, v, out, qsl = _cpu_args()
    with pytest.raises(ValueError, match="same tokens"):
        pg.launch_args(q, k[:-1], v[:-1], out, qsl, 32, 0.1)


def test_run_refuses_the_cpu():
    q, k, v, out, qsl = _cpu_args()
    with pytest.raises(NotImplementedError, match="interpreter"):
        pg.run(q, k, v, out, qsl, 32, 0.1)


def _reference(q, k, v, qsl_host, scale):
    """Causal attention per sequence in float64: [tokens, heads, head]."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for a, b in zip(qsl_host, qsl_host[1:]):
        qq, kk, vv = (t[a:b].double() for t in (q, k, v))
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(causal, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return out


TOL = {torch.bfloat16: (1e-2, 4e-2), torch.float16: (2e-3, 6e-3)}  # (relative Frobenius, max abs)
LENGTHS = [[1, 127, 128, 129, 300, 64], [513], [7, 256, 200]]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", pg.CONFIGS, ids=[f"n{c['block_n']}_buf{c['nbuf']}" for c in pg.CONFIGS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "one", "three"])
def test_gluon_prefill_matches_float64_reference(cfg, dtype, heads, kv_heads, lengths):
    g = torch.Generator(device="cuda").manual_seed(sum(lengths) + heads)
    T = sum(lengths)
    q = torch.randn(T, heads, 128, generator=g, device="cuda").to(dtype)
    k = torch.randn(T, kv_heads, 128, generator=g, device="cuda").to(dtype)
    v = torch.randn(T, kv_heads, 128, generator=g, device="cuda").to(dtype)
    qsl_host = [0] + torch.tensor(lengths).cumsum(0).tolist()
    qsl = torch.tensor(qsl_host, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(128)
    guard = 3
    buf = torch.full((T + guard, heads, 128), float("nan"), dtype=dtype, device="cuda")
    out = buf[:T]
    pg.run(q, k, v, out, qsl, max(lengths) + 5, scale, **cfg)
    torch.cuda.synchronize()
    assert torch.isnan(buf[T:]).all(), "the kernel wrote past the last token"
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison) or non-finite output"
    ref = _reference(q, k, v, qsl_host, scale)
    rel_tol, abs_tol = TOL[dtype]
    diff = out.double() - ref
    rel = float(diff.norm() / ref.norm())
    assert rel < rel_tol and float(diff.abs().max()) < abs_tol, (cfg, lengths, rel, float(diff.abs().max()))


def test_family_h_of_the_prefill_driver_is_this_kernel():
    from benchmarks import prefill_explore as pe

    full = pe.family_configs("H", quick=False)
    assert len({c.label for c in full}) == len(full) and pe.family_configs("H", quick=True) == full[:1]
    assert [dict(block_n=c.block_n, nbuf=c.num_stages) for c in full] == pg.CONFIGS
    with_context = pe.PagedBatch([(8, 5)], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, device="cpu")
    out = torch.empty_like(with_context.query)
    with pytest.raises(ValueError, match="without cached context"):
        pe.make_launch(full[0], with_context, out)
    new_only = pe.PagedBatch([(8, 0)], num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(NotImplementedError, match="interpreter"):
        pe.make_launch(full[0], new_only, torch.empty_like(new_only.query))
