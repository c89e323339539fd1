"""The ``kv_quant_greedy`` rows of the kv_quant_accuracy suite on the CPU (the demo model on the reference backend
in float32): one row per format after the 16-bit control, agreements in [0, 1], the control's 1.0; and the PERF
target that judges the bf16 rows."""

import pytest
import torch

from benchmarks.kv_quant_greedy import greedy_rows
from benchmarks.report import target_for


def test_greedy_rows_smoke():
    formats = ("int8_per_token_head", "nvfp4", "fp8")
    rows = greedy_rows(formats, torch.device("cpu"), smoke=True, num_prompts=2, new_tokens=3)
    assert [r["format"] for r in rows] == ["auto", *formats]
    assert rows[0]["token_agreement"] == 1.0 and rows[0]["first_divergence"] is None
    for row in rows:
        assert row["case"] == "kv_quant_greedy" and row["backend"] == "reference" and row["dtype"] == "float32"
        assert row["positions"] == 6 and 0.0 <= row["token_agreement"] <= 1.0
        assert row["token_agreement"] == row["matches"] / row["positions"]
    assert rows[2]["kv_scales"] is not None and rows[1]["kv_scales"] is None
    assert target_for(rows[1]) is None  # float32 smoke rows are not judged


@pytest.mark.parametrize("fmt,agreement,met", [("int8_per_token_head", 0.97, True),
                                               ("fp8_per_token_head", 0.9, False), ("int4_per_token_head", 0.5, None)])
def test_greedy_target(fmt, agreement, met):
    row = {"case": "kv_quant_greedy", "backend": "triton", "peer": "triton_bf16", "format": fmt,
           "dtype": "bfloat16", "token_agreement": agreement}
    target = target_for(row)
    assert (target[1] if target else None) is met
