"""The installed library needs no dev package: every module imports, and the CLI's list, explain and demo run, with
the dev-only packages made unimportable (``.ci/run`` checks the same on a real plain install)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEV_ONLY = ("tqdm", "tabulate", "matplotlib", "transformers", "hypothesis", "pytest")

_SCRIPT = f"""
import importlib, pkgutil, sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            raise ImportError(f"dev-only package {{name}} imported by the library")
        return None

sys.meta_path.insert(0, _Blocked())
import attnbackends
for info in pkgutil.walk_packages(attnbackends.__path__, "attnbackends."):
    importlib.import_module(info.name)
from attnbackends.cli import main
for argv in (["list"], ["explain", "--head-size", "128"], ["demo", "--device", "cpu", "--prompts", "2", "--new-tokens", "2"]):
    status = main(argv)
    assert status == 0, (argv, status)
print("plain install ok")
"""


def test_library_and_cli_without_dev_packages():
    env = {k: v for k, v in os.environ.items() if k != "ATTNBACKENDS_BACKEND"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT / "tests", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plain install ok" in proc.stdout


def test_tooling_is_not_in_the_package():
    package = ROOT / "attnbackends"
    assert not (package / "bench").exists()
    assert not list((package / "engine").glob("hf*.py"))
