"""The benchmark report (targets, markdown, plot) on CPU; the timings themselves need the GPU."""

import json

import pytest

from benchmarks.report import target_for, write_json, write_markdown, write_plot
from benchmarks.run import fp8_speedup_rows
from benchmarks.run import main as bench_main

from attnbackends.cli import BENCH_COMMAND, main


def _row(case, backend, B, L, us, peer_us, kv="auto", peer="flashinfer"):
    return {"case": case, "backend": backend, "peer": peer, "B": B, "L": L, "dtype": "bfloat16", "kv_dtype": kv,
            "us": us, "peer_us": peer_us, "ratio": round(us / peer_us, 3)}


@pytest.mark.parametrize(
    "row, met",
    [
        (_row("decode", "triton", 64, 4096, 105.0, 100.0), True),
        (_row("decode", "triton", 64, 4096, 106.0, 100.0), False),
        (_row("decode", "triton", 64, 4096, 100.0, 100.0, kv="fp8_e4m3"), True),
        (_row("decode", "triton", 64, 4096, 101.0, 100.0, kv="fp8_e4m3"), False),
        (_row("decode_eager", "triton", 1, 1024, 11.0, 10.0), True),
        (_row("decode_eager", "triton", 1, 1024, 11.1, 10.0), False),
        (_row("decode_eager", "triton", 16, 4096, 105.0, 100.0), True),
        (_row("decode_eager", "triton", 16, 4096, 106.0, 100.0), False),
        (_row("host_overhead", "triton", 1, 16, 20.0, 20.0), True),
        (_row("host_overhead", "triton", 1, 16, 20.5, 20.0), False),
        (_row("prefill", "triton", 4, 4096, 90.0, 100.0), True),
        (_row("prefill", "triton", 4, 4096, 91.0, 100.0), False),
        (_row("prefill", "triton", 16, 1024, 111.0, 100.0, peer="sdpa"), True),  # >= 0.9x SDPA's throughput
        (_row("prefill", "triton", 16, 1024, 112.0, 100.0, peer="sdpa"), False),
        (_row("mixed", "triton", 64, 4096, 100.0, 100.0), True),
        (_row("mixed", "triton", 64, 4096, 101.0, 100.0), False),
        (_row("verify", "triton", 64, 4096, 120.0, 100.0), True),
        (_row("verify", "triton", 64, 4096, 121.0, 100.0), False),
        (_row("hybrid_decode", "triton", 64, 8192, 111.0, 100.0, peer="groups_alone"), False),
        (_row("mla_forward", "triton_mla", 64, 4096, 99.0, 100.0, peer="flashinfer_mla"), True),
        (_row("adapter_overhead", "flashinfer", 1, 1024, 35.0, 14.0, peer="flashinfer_raw"), False),
        (_row("adapter_overhead", "flashinfer", 64, 4096, 102.0, 100.0, peer="flashinfer_raw"), True),
        # B=1 with wall times: judged by them, not by the do_bench times
        ({**_row("adapter_overhead", "flashinfer", 1, 4096, 180.0, 100.0, peer="flashinfer_raw"),
          "wall_overhead_us": 19.0}, True),
        ({**_row("adapter_overhead", "flashinfer", 1, 4096, 101.0, 100.0, peer="flashinfer_raw"),
          "wall_overhead_us": 21.0}, False),
        (_row("build_host_time", "flashinfer", 256, 4096, 99.0, 800.0, peer="flashinfer_raw_plan"), True),
        (_row("build_host_time", "flashinfer", 256, 4096, 101.0, 800.0, peer="flashinfer_raw_plan"), False),
        ({**_row("step_host", "persistent", 256, None, 140.0, 4000.0, peer="build_common_metadata"), "pages": 65536,
          "add_us": 12.0, "finish_us": 8.0}, True),
        ({**_row("step_host", "persistent", 256, None, 160.0, 4000.0, peer="build_common_metadata"), "pages": 65536,
          "add_us": 12.0, "finish_us": 8.0}, False),
        ({**_row("step_host", "persistent", 256, None, 140.0, 4000.0, peer="build_common_metadata"), "pages": 65536,
          "add_us": 21.0, "finish_us": 8.0}, False),
    ],
)
def test_targets(row, met):
    assert target_for(row)[1] is met


@pytest.mark.parametrize("row", [
    _row("decode", "triton", 1, 1024, 20.0, 10.0),  # PERF.md judges small decodes eager (decode_eager)
    {**_row("prefill", "sdpa", 1, 8192, 20.0, 1.0), "peer": None, "peer_us": None, "ratio": None},  # a peer alone
    _row("host_overhead", "triton_with_write", 1, 16, 40.0, 20.0),
])
def test_rows_without_a_target(row):
    assert target_for(row) is None


def test_fp8_speedup_and_report_files(tmp_path):
    rows = [_row("decode", "triton", 64, 4096, 370.0, 372.0), _row("decode", "triton", 64, 4096, 200.0, 270.0, kv="fp8")]
    rows += [_row("decode", "triton", 1, L, 10.0 + L / 1000, 12.0) for L in (1024, 16384)]
    speed = fp8_speedup_rows(rows)
    assert len(speed) == 1 and speed[0]["speedup"] == pytest.approx(370 / 200, rel=1e-3)
    header = {"gpu": "test", "date": "2026-11-21", "suite": "triton", "command": "x", "torch": "t", "triton": "t"}
    write_json(tmp_path / "r.json", header, rows + speed)
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 5
    text = write_markdown(tmp_path / "r.md", header, rows + speed)
    assert "time <= 1.05x flashinfer: met" in text and "time <= 1x flashinfer fp8: met" in text
    assert text.startswith("# triton: test, 2026-11-21") and "| speedup" in text
    assert write_plot(tmp_path / "r.png", rows)
    assert (tmp_path / "r.png").stat().st_size > 1000
    adapter_only = [dict(rows[0], case="adapter_overhead")]
    assert not write_plot(tmp_path / "empty.png", adapter_only) and not (tmp_path / "empty.png").exists()


def test_bench_without_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the message on machines without a GPU")
    assert bench_main([]) == 2
    assert "need a CUDA GPU" in capsys.readouterr().err


def test_cli_bench_points_at_the_benchmarks(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # outside a checkout: no benchmarks/ to hand the arguments to
    assert main(["bench", "--suites", "triton"]) == 2
    assert BENCH_COMMAND in capsys.readouterr().out.replace("\n", "")
    assert main(["bench"]) == 0
    assert BENCH_COMMAND in capsys.readouterr().out.replace("\n", "")
