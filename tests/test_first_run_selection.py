"""Selection without a measured profile on CUDA: the backend that is fast and compiles in seconds (Triton) first,
and `explain` says why; FlashInfer where only it serves the spec, or by name. `explain` states every backend's
CUDA-graph support. `attnbackends warmup` without layer options prepares the demo's layer."""

import pytest

import attnbackends.platform as platform
from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, explain
from attnbackends.cli import main
from attnbackends.engine.demo_setup import demo_spec
from attnbackends.engine import TinyLlama, TinyLlamaConfig
from attnbackends.interface import CudaGraphSupport
from attnbackends.selection.registry import cudagraph_support_text, get_backend_class

H100 = DeviceInfo.cuda(9, 0, sm_count=132, name="H100")
SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16)


@pytest.fixture
def flashinfer_installed(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    real = platform.package_available
    monkeypatch.setattr(platform, "package_available", lambda name: True if name == "flashinfer" else real(name))


@pytest.mark.parametrize("spec, first", [(SPEC, "triton"), (AttentionSpec.mla(num_heads=16, block_size=64), "triton_mla")])
def test_static_cuda_choice_is_triton_and_says_why(flashinfer_installed, spec, first):
    result = explain(spec, H100)
    assert result.chosen == first, str(result)
    assert "no measured profile" in result.notes[0] and f"puts {first} first" in result.notes[0]
    assert "compiled in seconds" in result.notes[0]


def test_flashinfer_serves_what_triton_cannot_and_is_chosen_by_name(flashinfer_installed):
    fp8_on_a100 = SPEC.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})
    result = explain(fp8_on_a100, DeviceInfo.cuda(8, 0))
    assert result.chosen == "flashinfer", str(result)
    assert not any("no measured profile" in n for n in result.notes)  # the static list's first did not fit
    assert explain(SPEC, H100, AttentionConfig(backend="flashinfer")).chosen == "flashinfer"
    measured_without_profile = explain(SPEC, H100, AttentionConfig(selection="measured", profile_dir="/nonexistent"))
    assert measured_without_profile.chosen == "triton"


def test_explain_states_each_backends_cuda_graph_support(flashinfer_installed, capsys):
    result = explain(SPEC, H100)
    text = str(result)
    for row in result.rows:
        level = get_backend_class(row.name).cudagraph_support
        assert row.cudagraph is level
        assert f"{row.name}: {cudagraph_support_text(level)}" in text
    assert main(["explain", "--gpu", "h100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "CUDA graphs" in out and CudaGraphSupport.NEVER.name in out


def test_demo_spec_is_the_demo_models_layer():
    cfg = TinyLlamaConfig()
    spec = demo_spec("cpu")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size, spec.dtype) == (
        cfg.num_heads, cfg.num_kv_heads, cfg.head_size, "float32")
    assert spec == TinyLlama(cfg).attention_spec(spec.torch_dtype, spec.block_size)
    assert demo_spec("cuda").dtype == "bfloat16"


def test_warmup_without_layer_options_prepares_the_demo(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["warmup"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "attnbackends demo" in out and "reference decode" in out and "demo engine steps" in out
