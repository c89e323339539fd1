import re

import pytest
import torch

from attnbackends.cli import build_parser, main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "triton", "flashinfer"):
        assert name in out


def test_explain_names_chosen_and_rejections(capsys):
    assert main(["explain", "--head-size", "128", "--kv-cache-dtype", "fp8", "--compute-capability", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "rejected" in out


def test_explain_explicit_choice_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["explain", "--cpu", "--backend", "flashinfer"]) == 1
    assert "the requested backend flashinfer does not fit" in " ".join(capsys.readouterr().out.split())


def test_explain_invalid_spec_is_a_clear_error(capsys):
    assert main(["explain", "--num-heads", "6", "--num-kv-heads", "4"]) == 2
    assert "num_heads" in capsys.readouterr().out


def test_demo_on_cpu(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["demo", "--device", "cpu", "--prompts", "3", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "backend chosen: reference" in out and "100.0% of tokens identical" in out


def one_line_error(capsys, argv, rc=2):
    assert main(argv) == rc
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert "\n" not in text and "errors.pydantic.dev" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("value", ["90", "abc", "9", "9.0.1"])
def test_compute_capability_must_be_major_minor(capsys, value):
    assert "--compute-capability must be major.minor" in one_line_error(capsys, ["explain", "--compute-capability", value])


def test_cpu_and_compute_capability_together_rejected(capsys):
    assert "--cpu cannot be combined" in one_line_error(capsys, ["explain", "--cpu", "--compute-capability", "9.0"])


def test_mla_with_head_size_rejected(capsys):
    assert "--head-size does not apply with --mla" in one_line_error(capsys, ["explain", "--mla", "--head-size", "128"])


def test_explain_header_shows_the_spec_and_sm_count_from_the_gpu_table(capsys):
    assert main(["explain", "--gpu", "a100", "--head-size", "64", "--kv-cache-dtype", "fp8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "head size 64" in out and "kv cache fp8" in out and "compute capability 8.0, 108 SMs" in out
    assert main(["explain", "--compute-capability", "8.9"]) == 0
    out = capsys.readouterr().out
    assert "compute capability 8.9)" in out and "SMs" not in out  # unknown GPU: no made-up SM count


def test_explain_mla_uses_its_own_sizes(capsys):
    assert main(["explain", "--mla", "--kv-lora-rank", "256", "--gpu", "h100"]) == 0
    assert "latent 256 + rope 64" in " ".join(capsys.readouterr().out.split())


def test_explain_explicit_backend_is_consistent(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("attnbackends.platform.is_triton_interpreted", lambda: False)  # it is read once and cached
    assert main(["explain", "--cpu", "--backend", "triton"]) == 1
    out = capsys.readouterr().out
    assert "lower priority" not in out and "fits (not requested)" in out
    assert "the requested backend triton does not fit" in out and "no backend fits" not in out


def test_spec_errors_without_pydantic_boilerplate(capsys):
    assert "block_size must be in [1, 1024]" in one_line_error(capsys, ["explain", "--block-size", "100000"])


def test_unknown_backend_from_environment_says_so(capsys, monkeypatch):
    monkeypatch.setenv("ATTNBACKENDS_BACKEND", "nope")
    assert "from the environment variable ATTNBACKENDS_BACKEND" in one_line_error(capsys, ["explain", "--cpu"])


@pytest.mark.parametrize("argv, message", [
    (["demo", "--prompts", "0"], "--prompts: must be >= 1"),
    (["demo", "--new-tokens", "0"], "--new-tokens: must be >= 1"),
])
def test_demo_zero_counts(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_demo_cuda_absent_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "--device='cuda' was requested but" in one_line_error(capsys, ["demo", "--device", "cuda"])


def test_every_option_has_help():
    for action in build_parser()._actions:
        for sub in getattr(action, "choices", None) or {}:
            if not isinstance(action.choices, dict):
                break
            for option in action.choices[sub]._actions:
                assert option.help, f"{sub} {option.option_strings} has no help text"


def test_demo_dtype_on_cpu(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["demo", "--device", "cpu", "--dtype", "float16", "--prompts", "2", "--new-tokens", "2"]) in (0, 1)
    assert "(float16)" in capsys.readouterr().out


ENCDEC_LAYERS = "examples/layer_groups_encdec.yaml"


def test_explain_layer_groups_file(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # table cells on one line each
    assert main(["explain", "--layers", ENCDEC_LAYERS, "--cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "18 layers in 3 groups" in out
    for line in ("group encoder: layers 0-5", "group full: layers 6-11", "group cross: layers 12-17",
                 "group encoder chosen: triton", "group full chosen: reference", "group cross chosen: triton"):
        assert line in out
    assert "attn_type encoder_decoder not supported" in out  # the decoder-only backends' reason in the cross group


def test_explain_layer_groups_backend_option_sets_the_default(capsys, monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert main(["explain", "--layers", ENCDEC_LAYERS, "--cpu", "--backend", "flashinfer"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "group full chosen: none" in out and "group encoder chosen: triton" in out  # pins stay
    assert "no backend (or not the requested one) fits groups full" in out


@pytest.mark.parametrize("text, message", [
    ("layers: []\n", "needs a non-empty `layers:` list"),
    ("layers: [{num_heads: 4, num_kv_heads: 4, head_size: 32}, {num_heads: 6, num_kv_heads: 4, head_size: 32}]\n",
     r"layers\[1\] in .*num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    ("layers: [{num_heads: 4, num_kv_heads: 4, head_size: 32, count: 0}]\n", r"layers\[0\].count .* positive integer"),
    ("layers: [{num_heads: 4, num_kv_heads: 4, head_size: 32, colour: red}]\n", r"layers\[0\] in .*colour"),
    ("layers: [{num_heads: 4, num_kv_heads: 4, head_size: 32}]\nlayer_groups: {groups: {cross: triton}}\n",
     "unknown groups \\['cross'\\]"),
])
def test_explain_layer_groups_file_errors(capsys, tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    assert re.search(message, one_line_error(capsys, ["explain", "--layers", str(path), "--cpu"]))


def test_explain_layers_refuses_single_layer_options(capsys):
    text = one_line_error(capsys, ["explain", "--layers", ENCDEC_LAYERS, "--head-size", "64", "--sinks"])
    assert "--layers takes every layer's spec from the file; drop --head-size, --sinks" in text


def test_list_status_is_the_install_check_explain_uses(capsys, monkeypatch):
    from attnbackends.flash_attn.library import installed_flash_attn
    from attnbackends.selection.registry import get_backend_class

    monkeypatch.setenv("COLUMNS", "250")
    assert main(["list"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("│") >= 3
            and line.split("│")[1].strip()}
    flash_attn = get_backend_class("flash_attn")
    if installed_flash_attn() is None:
        assert flash_attn.missing_packages() and "installed" not in rows["flash_attn"].replace("not installed", "")
        assert "pip install 'attnbackends[flash-attn]'" in rows["flash_attn"]  # not eaten as rich markup
    else:
        assert "installed" in rows["flash_attn"] and not flash_attn.missing_packages()
    for name in ("flashinfer", "flashinfer_mla"):
        cls = get_backend_class(name)
        want = "pip install 'attnbackends[flashinfer]'" if cls.missing_packages() else "installed"
        assert want in rows[name]
    assert "installed" in rows["reference"]


def test_explain_keeps_install_hints_in_brackets(capsys, monkeypatch):
    from attnbackends.flash_attn.library import installed_flash_attn

    if installed_flash_attn() is not None:
        pytest.skip("flash-attn is installed here")
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["explain", "--gpu", "h100"]) == 0
    assert "pip install 'attnbackends[flash-attn]'" in capsys.readouterr().out


def test_explain_layers_missing_file_is_one_line(capsys, tmp_path):
    text = one_line_error(capsys, ["explain", "--layers", str(tmp_path / "missing.yaml"), "--cpu"])
    assert "missing.yaml: no such file" in text


def test_explain_layers_unparsable_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("layers: [\n")
    assert "error:" in one_line_error(capsys, ["explain", "--layers", str(path), "--cpu"]).replace("\n", " ")


@pytest.mark.parametrize("argv, flag", [(["--bogus"], "--bogus"), (["-x", "list"], "-x"),
                                        (["explain", "--bogus"], "--bogus")])
def test_unknown_flags_are_named(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert f"unrecognized arguments: {flag}" in err and "\n" not in err


def test_demo_triton_on_cpu_names_the_fix(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA host runs triton natively")
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    monkeypatch.setattr("attnbackends.platform.is_triton_interpreted", lambda: False)  # read once and cached
    monkeypatch.setattr("attnbackends.cli.demo.is_triton_interpreted", lambda: False)
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["demo", "--backend", "triton", "--prompts", "1", "--new-tokens", "1"]) == 1
    out = capsys.readouterr().out
    assert "to run it here: TRITON_INTERPRET=1 attnbackends demo --backend triton --device cpu --dtype bfloat16" in out


def test_demo_help_shows_one_default_per_option(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:"):]
    device_help = text[text.index("--device DEVICE") : text.index("--dtype {")]
    assert device_help.count("default") == 1, device_help
    assert "(default: None)" not in text


def test_python_m_runs_the_cli():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "attnbackends.cli", "explain", "--cpu", "--backend", "reference"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "chosen: reference" in proc.stdout


def test_no_import_circle_through_the_cli():
    """The CLI imports the library, never the other way round; each command imports only the shared helpers."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "attnbackends"
    for path in root.rglob("*.py"):
        inside = path.parent.name == "cli"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                if inside:
                    assert not target.startswith("..cli"), f"{path.name} imports {target}"
                    if target.startswith(".") and not target.startswith(".."):
                        assert path.name in ("__init__.py", "__main__.py") or target == ".args", (
                            f"{path.name} imports {target}")
                else:
                    assert "cli" not in target.split("."), f"{path.relative_to(root)} imports the CLI ({target})"


@pytest.mark.parametrize("entry", ["examples/engine/generate.py", "examples.hf_encoder_models",
                                   "examples.hybrid_hf_models"])
def test_examples_without_transformers_name_the_extra(entry):
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    run = (f"sys.path.insert(0, {str(pathlib.Path(entry).parent)!r}); runpy.run_path({entry!r}, run_name='__main__')"
           if entry.endswith(".py")
           else f"runpy.run_module({entry!r}, run_name='__main__')")
    script = f"import runpy, sys; sys.modules['transformers'] = None; {run}"  # None: not importable
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "pip install 'attnbackends[dev]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
