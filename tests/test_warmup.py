"""`attnbackends warmup` on the CPU: every kind of step runs through the selected backend (both parts of a phase
composition), each logged with its time; a backend's ahead-of-time build (its class's ``warmup`` hook) runs in the
background before that backend's steps; MLA layers warm up too; the CLI prints the table."""

import logging
import threading

import pytest

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, register_backend, unregister_backend
from attnbackends.cli import main
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.selection.phased import phased_name
from attnbackends.selection.warmup import warmup

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16")
MLA = AttentionSpec.mla(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        dtype="float16")
CPU = DeviceInfo.cpu(triton_interpreted=True)


def test_warmup_runs_each_step_and_logs_its_time(caplog):
    caplog.set_level(logging.INFO, logger="attnbackends.selection.warmup")
    config = AttentionConfig(decode_backend="reference", prefill_backend="triton")
    records = warmup([SPEC, SPEC], CPU, config)
    name = phased_name("reference", "triton")
    assert [r.what for r in records] == [f"{name} decode", f"{name} prefill", f"{name} mixed"]
    assert all(r.seconds > 0 and "head 32" in r.detail for r in records)
    assert f"warm-up: {name} prefill step took" in caplog.text


def test_a_backends_ahead_of_time_build_runs_through_its_class_before_its_steps():
    """The hook runs once per backend with every spec it serves (also as a part of a composition), in the
    background, and its steps wait for it; it is listed first, with what it built."""
    calls, steps = [], []

    @register_backend("prebuilt_ref")
    class PrebuiltReference(ReferenceBackend):
        @classmethod
        def warmup(cls, specs, device):
            calls.append((list(specs), device, threading.current_thread() is threading.main_thread()))
            return ["module-a", "module-b"]

        @classmethod
        def get_builder_cls(cls):
            builder = super().get_builder_cls()

            class Counting(builder):
                def build(self, common):
                    steps.append(len(calls))
                    return super().build(common)

            return Counting

    try:
        other = SPEC.model_copy(update={"head_size": 64})
        config = AttentionConfig(decode_backend="prebuilt_ref", prefill_backend="reference")
        records = warmup([SPEC, other], CPU, config)
    finally:
        unregister_backend("prebuilt_ref")
    assert calls == [([SPEC, other], CPU, False)]
    assert steps and all(n == 1 for n in steps)  # every build after the hook had run
    assert records[0].what == "prebuilt_ref modules" and records[0].detail == "module-a, module-b"
    assert [r.what for r in records[1:4]] == [f"{phased_name('prebuilt_ref', 'reference')} {s}"
                                              for s in ("decode", "prefill", "mixed")]


def test_the_default_hooks_build_nothing_and_report_nothing():
    assert ReferenceBackend.warmup([SPEC], CPU) == []
    assert ReferenceBackend.environment_facts() == {}


@pytest.mark.parametrize("backend", ["reference_mla", "triton_mla"])
def test_mla_layers_warm_up(backend):
    records = warmup([MLA], CPU, AttentionConfig(backend=backend))
    assert [r.what for r in records] == [f"{backend} decode", f"{backend} prefill", f"{backend} mixed"]


def test_warmup_cli(capsys):
    assert main(["warmup", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "reference decode" in out and "warm-up:" in out


def test_warmup_cli_mla(capsys):
    assert main(["warmup", "--mla", "--num-heads", "4", "--kv-lora-rank", "32", "--qk-rope-head-dim", "16"]) == 0
    assert "reference_mla decode" in capsys.readouterr().out
