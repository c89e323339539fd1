"""The examples run as the README says (as scripts, from the checkout) and report success, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("ATTNBACKENDS_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_config_selection_example():
    proc = _run(str(EXAMPLES / "config_selection.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "backend chosen: triton" in out
    # The configured backend does not fit these layers: the error names it and gives its reasons.
    assert "BackendNotSupportedError" in out and "the requested backend 'triton' cannot serve this spec" in out
    assert "triton cannot: dtype float32 not supported" in out
    assert "MLA specs need an MLA backend" in out
    assert "unknown backend 'no_such_backend'" in out


def test_config_selection_example_env_override_wins():
    env_proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "config_selection.py")], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ATTNBACKENDS_BACKEND": "reference", "TRITON_INTERPRET": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))},
    )
    assert env_proc.returncode == 0, env_proc.stdout + env_proc.stderr
    assert "backend='reference'" in env_proc.stdout and "backend chosen: reference" in env_proc.stdout


def test_custom_backend_example():
    proc = _run(str(EXAMPLES / "custom_backend.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "backend chosen: triton_telemetry" in out
    assert "generated tokens identical to the reference backend's: True" in out
    assert "backend chosen: my_triton (my_attn_plugin.backend)" in out
    assert "my_triton for head_size 32: head_size 32 not supported" in out
    assert "all checks passed" in out


def test_plugin_package_declares_the_entry_point():
    text = (EXAMPLES / "plugin_pkg" / "pyproject.toml").read_text()
    assert '[project.entry-points."attnbackends.backends"]' in text
    assert 'my_triton = "my_attn_plugin.backend:MyTritonBackend"' in text


@pytest.mark.parametrize("model,backend", [("llama", "reference")])
def test_generate_example_matches_transformers(model, backend):
    pytest.importorskip("transformers")
    proc = _run(str(EXAMPLES / "engine" / "generate.py"), "--model", model, "--backend", backend,
                "--prompts", "3", "--new-tokens", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"backend chosen: {backend}" in proc.stdout
    assert "9/9 tokens identical" in proc.stdout
