"""`attnbackends warmup` on the CPU: every kind of step runs through the selected backend (both parts of a phase
composition), each logged with its time; the CLI prints the table."""

import logging

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo
from attnbackends.cli import main
from attnbackends.selection.phased import phased_name
from attnbackends.selection.warmup import warmup

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16")


def test_warmup_runs_each_step_and_logs_its_time(caplog):
    caplog.set_level(logging.INFO, logger="attnbackends.selection.warmup")
    config = AttentionConfig(decode_backend="reference", prefill_backend="triton")
    records = warmup([SPEC, SPEC], DeviceInfo.cpu(triton_interpreted=True), config)
    name = phased_name("reference", "triton")
    assert [r.what for r in records] == [f"{name} decode", f"{name} prefill", f"{name} mixed"]
    assert all(r.seconds > 0 and "head 32" in r.detail for r in records)
    assert f"warm-up: {name} prefill step took" in caplog.text


def test_warmup_cli(capsys):
    assert main(["warmup", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "reference decode" in out and "warm-up:" in out
