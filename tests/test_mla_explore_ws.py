"""CPU checks of the warp-specialised Gluon MLA decode candidate W (benchmarks/mla_explore_gluon_ws.py).

Gluon does not run on a CPU: the kernel is compiled for sm_90 (in a fresh process, without the interpreter) and
the compiled code is checked for what the design relies on; its numbers are checked on the GPU by
``python -m benchmarks.mla_explore --families W`` (every candidate against the oracle before it is timed).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CPU checks; the GPU runs python -m benchmarks.mla_explore --families W", allow_module_level=True)

pytest.importorskip("triton.experimental.gluon")

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_configs_labels_and_json_round_trip():
    from benchmarks import mla_explore as me
    from benchmarks import mla_explore_gluon_ws as mw

    cfgs = mw.family_configs(quick=False)
    assert len({c.label for c in cfgs}) == len(cfgs) and mw.family_configs(quick=True) == cfgs[:1]
    assert me.family_configs("W", quick=False) == cfgs
    assert "W" in me.FAMILIES.split(",")
    for cfg in cfgs:
        assert me.config_from_json(me.config_to_json(cfg)) == cfg


def test_host_refuses_the_interpreter_and_unaligned_items():
    from benchmarks import mla_explore_gluon_ws as mw
    from benchmarks.mla_explore_triton import Schedule

    H, lkv, rope, page = 128, 512, 64, 64
    cache = torch.zeros(4, page, lkv + rope, dtype=torch.bfloat16)
    qn, qp = torch.zeros(1, H, lkv, dtype=torch.bfloat16), torch.zeros(1, H, rope, dtype=torch.bfloat16)
    out, lse, bt = torch.zeros_like(qn), torch.zeros(1, H), torch.zeros(1, 4, dtype=torch.int32)

    def sched(lo, hi):
        return Schedule(torch.tensor([[0, 0, lo, hi, -1]], dtype=torch.int32), torch.zeros(0, 3, dtype=torch.int32),
                        0, 1)
    cfg = mw.GluonWSConfig()
    with pytest.raises(NotImplementedError, match="interpreter"):
        mw.make_gluon_launch(cfg, qn, qp, cache, bt, sched(0, 65), out, lse, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="page boundary"):
        mw.make_gluon_launch(cfg, qn, qp, cache, bt, sched(32, 200), out, lse, scale=0.1)
    launch = mw.make_gluon_launch(cfg, qn, qp, cache, bt, sched(0, 200), out, lse, scale=0.1)
    assert len(launch.calls) == 1 and launch.calls[0][1] == (2, 1)  # 128 heads / 64, one item, no merge


_PTX_FACTS = r"""
import json, re, sys, torch
from benchmarks import mla_explore_gluon_ws as mw
from benchmarks.mla_explore_triton import build_schedule
from benchmarks.offline_compile import compile_call
B, L, H, lkv, rope, page = 2, 1000, 128, 512, 64, 64
cache = torch.zeros(B * 16, page, lkv + rope, dtype=torch.bfloat16)
qn, qp = torch.zeros(B, H, lkv, dtype=torch.bfloat16), torch.zeros(B, H, rope, dtype=torch.bfloat16)
out, lse, bt = torch.zeros_like(qn), torch.zeros(B, H), torch.zeros(B, 16, dtype=torch.int32)
facts = []
for cfg in mw.family_configs(quick=False)[:2]:
    launch = mw.make_gluon_launch(cfg, qn, qp, cache, bt, build_schedule([L] * B, 1, splits=2), out, lse,
                                  scale=0.1)
    k, _, a, kw = launch.calls[0]
    rep = compile_call(k, a, kw, keep_asm=True)
    ptx = rep.pop("asm")["ptx"]
    rep["expect_tx"] = sorted(set(int(x) for x in re.findall(r"expect_tx\.shared\.b64 _, \[%r\d+\], (\d+)", ptx)))
    rep["setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    rep["tma_copies"] = len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx))
    rep["mbarrier_init_counts"] = sorted(
        int(x) for x in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+)", ptx))
    rep["label"] = cfg.label
    facts.append(rep)
print(json.dumps(facts))
"""


def test_kernel_compiles_for_sm90_with_the_designed_structure(tmp_path):
    """Every config compiles for Hopper within shared memory, no serialised wgmma; the first (default) config
    spills nothing; the compiled code has the designed structure: one expect-tx of a whole page (64 x 576 x 2
    bytes) split into 9 TMA boxes (8 latent [64, 64] + 1 rope), setmaxnreg per partition, kv_empty barriers
    counting two arrivals, the score tile as m64n64k16 and each output half as m64n256k16."""
    from benchmarks import mla_explore_gluon_ws as mw

    res = subprocess.run([sys.executable, "-m", "benchmarks.mla_explore", "--compile-only", "--families", "W",
                          "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reports = json.loads((tmp_path / "mla_explore_compile.json").read_text())
    assert [r["label"] for r in reports] == [c.label for c in mw.family_configs(quick=False)]
    for rep in reports:
        assert "error" not in rep and not rep["shared_over_limit"], rep
        assert not [n for n in rep["ptxas_notes"] if "serialized" in n], rep
        assert set(rep["wgmma"]) == {"m64n64k16.f32.bf16.bf16", "m64n256k16.f32.bf16.bf16"}, rep
    assert reports[0]["stack"] == 0, reports[0]

    res = subprocess.run([sys.executable, "-c", _PTX_FACTS], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rep in json.loads(res.stdout.strip().splitlines()[-1]):
        assert rep["expect_tx"] == [64 * 576 * 2], rep
        assert rep["tma_copies"] == 9, rep
        assert rep["setmaxnreg"], rep
        assert rep["mbarrier_init_counts"].count(2) == 2, rep  # kv_empty x NBUF 2
