"""Every shell command in README.md runs as written from the checkout's root after the set-up command.

The README's commands are its indented code blocks (outside the ``` fences); a line holding several commands
joined by ``&&`` counts each. The set-up command makes and activates ``.venv`` with the package installed from the
checkout; here that environment is the interpreter running the tests: a ``bin/`` folder of shims (``python``,
``python3``, ``pip``, ``attnbackends``) first on PATH, with the checkout first on PYTHONPATH (what the editable
install gives a fresh clone), stands for the activated ``.venv``. Each fast command then runs through ``bash -c``
exactly as the README writes it (a ``|`` in it is a pipe, as a reader's shell would take it) and must exit 0.
Commands that are slow on a CPU, or change the machine, are listed in :data:`SLOW` with the reason; their README
line must say how long they take (or :data:`SLOW` says where they run). A README command in neither list fails
:func:`test_every_readme_command_is_classified`.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: Commands not run here, with the reason (each README line holding one says how long it takes).
SLOW = {
    "python3 -m venv .venv": "the set-up itself: this test's interpreter stands for the environment it makes",
    ". .venv/bin/activate": "the set-up itself: the shims first on PATH stand for the activation",
    "pip install torch==2.13.0 triton==3.6.0 -e .": "downloads and installs packages (minutes)",
    "pip install -e '.[dev]'": "downloads and installs packages (minutes)",
    "python -m pytest -q": "the whole suite: 8-13 minutes on two cores",
    "attnbackends demo": "about 15 s on a CPU; tests/test_cli.py runs the demo in-process",
    "attnbackends -v tune": "about 20 s on a CPU; tests/test_tuning.py runs the tiny grid in-process",
    "python -m examples.hf_encoder_models": "about 25 s on a CPU; tests/test_hf_encoders.py checks the same models",
    "python -m examples.deepseek_sparse_generate": "about 5 s on a CPU; tests/mla/test_sparse_mla_example.py runs its "
                                                   "function and main() in-process",
    "python examples/custom_backend.py": "runs as written in tests/test_engine_examples.py",
    "python examples/config_selection.py": "runs as written in tests/test_engine_examples.py",
}
#: Commands SLOW lists whose README line need not state a time (their reason says where they run instead).
_RUN_ELSEWHERE = ("python3 -m venv .venv", ". .venv/bin/activate", "python examples/custom_backend.py",
                  "python examples/config_selection.py")
_TIME = re.compile(r"(\d+(\.\d+)?(-\d+)?\s*(s|min|minutes)\b)|\bminutes\b")


def readme_command_lines() -> list[str]:
    """The README's command lines: indented code outside the ``` fences, comments stripped."""
    lines, fenced = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and line.strip():
            lines.append(line)
    return lines


def split_commands(line: str) -> list[str]:
    """The ``&&``-joined commands of one README line, its trailing ``# comment`` removed."""
    code = re.split(r"\s+#\s", line.strip(), maxsplit=1)[0]
    return [part.strip() for part in code.split("&&") if part.strip()]


def readme_commands() -> list[tuple[str, str]]:
    """(command, the README line it is on) for every command."""
    return [(cmd, line) for line in readme_command_lines() for cmd in split_commands(line)]


FAST = [cmd for cmd, _ in readme_commands() if cmd not in SLOW]


def test_readme_has_commands():
    commands = [cmd for cmd, _ in readme_commands()]
    assert "attnbackends list" in commands and any(c.startswith("python3 -m venv") for c in commands), commands


def test_every_readme_command_is_classified():
    """A command that changed in the README is either runnable here (FAST) or listed with its reason; SLOW names
    no command the README lost."""
    commands = {cmd for cmd, _ in readme_commands()}
    assert not set(SLOW) - commands, f"SLOW lists commands the README does not have: {set(SLOW) - commands}"
    for cmd, line in readme_commands():
        if cmd in SLOW and cmd not in _RUN_ELSEWHERE:
            assert _TIME.search(_context(line)), f"the README does not say how long {cmd!r} takes: {line.strip()}"


def _context(line: str) -> str:
    """The command's line and the paragraph just above its code block (where the README states durations)."""
    text = README.read_text()
    at = text.index(line)
    return text[max(0, text.rfind("\n\n", 0, max(0, text.rfind("\n\n", 0, at))) ): at + len(line)]


@pytest.fixture(scope="module")
def venv_env(tmp_path_factory) -> dict:
    """The environment of a shell in which the set-up command ran: its ``.venv/bin`` (shims over this
    interpreter) first on PATH."""
    bin_dir = tmp_path_factory.mktemp("venv") / "bin"
    bin_dir.mkdir()
    shims = {"python": f'exec "{sys.executable}" "$@"', "python3": f'exec "{sys.executable}" "$@"',
             "pip": f'exec "{sys.executable}" -m pip "$@"',
             "attnbackends": f'exec "{sys.executable}" -m attnbackends.cli "$@"'}
    for name, body in shims.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = {k: v for k, v in os.environ.items() if k != "ATTNBACKENDS_BACKEND"}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env


@pytest.mark.parametrize("command", FAST)
def test_readme_command_runs(command, venv_env):
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=venv_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (f"README command {command!r} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
