"""The GPU test groups: ``pytest -m gpu`` over named sets of test paths, one verbose log per group.

    python -m benchmarks.run --gpu-tests                 # every group
    python -m benchmarks.run --gpu-tests triton mla      # named groups
    python -m benchmarks.run --gpu-tests mla --sanitize  # under compute-sanitizer memcheck

Groups run one after another, or side by side with ``--parallel`` (each its own process on the same GPU);
``--workers N`` spreads each group's tests over N pytest-xdist processes. A group that runs past ``--timeout`` still
leaves the PASSED / FAILED lines of the tests it reached in its log. A log holds pytest's output without its
opening banner line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["GROUPS", "GroupResult", "pytest_command", "run_groups", "summarise"]

REPO = Path(__file__).resolve().parents[1]

# group -> test paths (relative to the repository root); "integration" is every test outside the other groups.
GROUPS: dict[str, tuple[str, ...]] = {
    "triton": ("tests/triton_backend", "tests/test_page_guard.py", "tests/test_direct_launch.py"),
    "flashinfer": ("tests/flashinfer_backend",),
    "flash_attn": ("tests/flash_attn_backend",),
    "mla": ("tests/mla", "tests/test_engine_speculative_mla.py"),
    "catalogue": ("tests/test_bad_input_catalogue.py",),
}
INTEGRATION = "integration"
#: The plugin that writes each failure's traceback when it happens (a group stopped at its limit still says why).
FAILURES_NOW = "benchmarks.pytest_failures_now"


def group_names() -> list[str]:
    return [*GROUPS, INTEGRATION]


def group_paths(name: str) -> list[str]:
    """The pytest arguments of a group (paths missing from the checkout are left out)."""
    if name == INTEGRATION:
        ignored = [p for paths in GROUPS.values() for p in paths]
        return ["tests", *(f"--ignore={p}" for p in ignored)]
    if name not in GROUPS:
        raise ValueError(f"unknown GPU test group {name!r}; allowed: {', '.join(group_names())}")
    return [p for p in GROUPS[name] if (REPO / p).exists()]


def pytest_command(name: str, keyword: Optional[str] = None, sanitize: bool = False,
                   workers: Optional[int] = None, test_timeout_s: Optional[float] = None) -> list[str]:
    """The command line of one group; under ``sanitize``, compute-sanitizer's memcheck around pytest; ``workers``:
    pytest-xdist processes; ``test_timeout_s``: pytest-timeout's limit per test where the plugin is installed (a
    hung test then fails with its traceback instead of the whole group running past its limit unsummarised); every
    command loads :data:`FAILURES_NOW`."""
    timeout = (["--timeout", f"{test_timeout_s:g}"] if test_timeout_s and importlib.util.find_spec("pytest_timeout")
               else [])
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-p", FAILURES_NOW, "-rfE",
           *timeout,
           *(["-n", str(workers)] if workers else []), *group_paths(name), *(["-k", keyword] if keyword else [])]
    if sanitize:
        cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "50", *cmd]
    return cmd


@dataclass
class GroupResult:
    name: str
    log: Path
    returncode: Optional[int]  # None: ran past its time limit
    passed: int
    failed: int
    skipped: int
    failures: list[str]
    memcheck_errors: Optional[int] = None


def summarise(name: str, log: Path, returncode: Optional[int]) -> GroupResult:
    """Counts of a verbose pytest log (and memcheck's error summary when present)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    # the summary line itself ("N errors" at its end), not "N errors were not printed" that may follow it
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, flags=re.MULTILINE)
    outcomes = re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)\b", text, flags=re.MULTILINE)
    outcomes += re.findall(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) \S+::", text, flags=re.MULTILINE)
    return GroupResult(
        name=name, log=log, returncode=returncode,
        passed=outcomes.count("PASSED"), failed=outcomes.count("FAILED") + outcomes.count("ERROR"),
        skipped=outcomes.count("SKIPPED"),
        failures=[line[:240] for line in text.splitlines() if re.match(r"^(FAILED|ERROR) ", line)][:20],
        memcheck_errors=int(errors[-1]) if errors else None,
    )


def run_groups(names: Sequence[str], outdir: Path, log_name: str, keyword: Optional[str] = None,
               sanitize: bool = False, parallel: bool = False, timeout_s: Optional[float] = None,
               workers: Optional[int] = None, test_timeout_s: Optional[float] = None) -> list[GroupResult]:
    """Run the groups, each writing its log to ``outdir / log_name.format(group=name)``; returns their summaries
    (``returncode`` None for a group stopped at ``timeout_s``). Processes running side by side share the host's
    cores (``OMP_NUM_THREADS`` unless set): each with torch's default of every core, compilation and CPU-side
    tensor work starve one another."""
    if sanitize and shutil.which("compute-sanitizer") is None:
        raise FileNotFoundError("compute-sanitizer not found (the CUDA toolkit's bin/ is not on PATH)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    processes = (len(names) if parallel else 1) * (workers or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    if sanitize:
        # Every tensor its own cudaMalloc: an access past a tensor's end lands outside any allocation, where
        # memcheck sees it (with the caching allocator it would hit a neighbour's memory).
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    outdir.mkdir(parents=True, exist_ok=True)
    logs = {name: outdir / log_name.format(group=name) for name in names}
    running, codes = [], {}
    for name in names:
        log = logs[name].open("w")
        proc = subprocess.Popen(pytest_command(name, keyword, sanitize, workers, test_timeout_s), cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        running.append((name, proc, log))
        if not parallel:
            codes[name] = _wait(proc, timeout_s)
            log.close()
    for name, proc, log in running:
        if name not in codes:
            codes[name] = _wait(proc, timeout_s)
            log.close()
    for log in logs.values():
        _drop_banner(log)
    return [summarise(name, logs[name], codes[name]) for name in names]


_BANNER = re.compile(r"^=+ test \w+ starts =+\n", flags=re.MULTILINE)  # pytest's opening line


def _drop_banner(log: Path) -> None:
    """Remove pytest's opening banner line from a group's log (it carries no result)."""
    if log.exists():
        log.write_text(_BANNER.sub("", log.read_text(errors="replace"), count=1))


def _wait(proc: subprocess.Popen, timeout_s: Optional[float]) -> Optional[int]:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
