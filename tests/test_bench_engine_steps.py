"""The step_wall, engine_graphs and first_run suites are registered, and step_wall's code runs on the CPU (its
smoke mode: miniature steps, the reference backend, a torch stand-in for FlashInfer's wrappers)."""

import json

from benchmarks.suites import SUITES, module_present


def test_suites_registered():
    for name in ("step_wall", "engine_graphs", "first_run"):
        assert name in SUITES and module_present(name), name


def test_step_wall_smoke(tmp_path):
    from benchmarks.step_wall import main

    out = tmp_path / "rows.json"
    assert main(["--cpu-smoke", "--batches", "mixed_prompts", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {("reference", "eager"), ("reference_as_adapter", "eager")}
    for r in rows:
        assert r["case"] == "step_wall" and r["peer"] == "flashinfer_wrappers" and r["us"] > 0 and r["peer_us"] > 0
        assert r["ratio"] == round(r["us"] / r["peer_us"], 3)


def test_report_judges_the_new_rows():
    from benchmarks.report import target_for

    row = {"case": "step_wall", "backend": "triton", "peer": "flashinfer_wrappers", "us": 90.0, "peer_us": 100.0}
    assert target_for({**row, "mode": "eager", "ratio": 0.9})[1] is True
    assert target_for({**row, "mode": "eager", "ratio": 0.96})[1] is False
    assert target_for({**row, "mode": "graph", "ratio": 0.9, "graph_overhead": 1.08})[1] is False
    assert target_for({"case": "engine_graphs", "backend": "graphs", "speedup": 2.1, "ratio": 0.48})[1] is True
    assert target_for({"case": "engine_graphs", "backend": "graphs", "speedup": 1.5, "ratio": 0.67})[1] is False
    first = {"case": "first_run", "command": "demo", "rc": 0}
    assert target_for({**first, "seconds": 29.0})[1] is True and target_for({**first, "seconds": 31.0})[1] is False
