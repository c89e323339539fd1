"""The ``bad_input_cost`` benchmark runs on the CPU with tiny repeats and reports the per-step row the GPU host
records (docs/PERF.md)."""

from __future__ import annotations

from benchmarks.bad_input_cost import TARGET_US, measure_step


def test_bad_input_cost_rows():
    rows = measure_step(num_reqs=8, context=40, layers=2, device="cpu", calls=3, repeats=1)
    by_mode = {row["mode"]: row for row in rows}
    assert set(by_mode) == {"persistent_batch", "hand_made", "host_tensors_spec_check"}
    step = by_mode["persistent_batch"]
    assert step["case"] == "bad_input_cost" and step["B"] == 8 and step["target_us"] == TARGET_US
    assert step["us"] > 0 and step["forward_us"] >= 0
    assert step["step_total_us"] >= step["us"]
