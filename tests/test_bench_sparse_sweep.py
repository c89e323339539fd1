"""The sparse MLA tile sweep is registered and runs on the CPU (its smoke mode under the Triton interpreter)."""

import json
import os

import pytest

from benchmarks.suites import SUITES, module_present

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the sweep's smoke mode runs the kernel under TRITON_INTERPRET=1")


def test_sweep_smoke(tmp_path):
    from benchmarks.sparse_mla_tile_sweep import main

    assert "sparse_mla_tile_sweep" in SUITES and module_present("sparse_mla_tile_sweep")
    out = tmp_path / "rows.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["latent"] for r in rows} == {"auto", "fp8_ds_mla"} and sum(r["default"] for r in rows) == 2
    for r in rows:
        assert "error" not in r, r
        assert r["us"] > 0 and r["err_vs_default"] < 1e-2 and r["err_vs_oracle"] < 2e-2, r
