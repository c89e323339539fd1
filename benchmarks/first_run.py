"""A first GPU run as a new user: ``attnbackends demo`` end to end in a fresh process with empty kernel caches.

    python -m benchmarks.run --suite first_run                  # on the GPU host: results/ and RESULTS.md
    python -m benchmarks.first_run --out rows.json               # the rows alone
    python -m benchmarks.first_run --device cpu                  # the same on the CPU (a check of the script)

``TRITON_CACHE_DIR`` and ``FLASHINFER_WORKSPACE_BASE`` point at fresh temporary directories, so every kernel the
demo needs is compiled during the run (the Triton JIT; FlashInfer's modules where it is chosen). ``--with-warmup``
adds a row for ``attnbackends warmup`` (no options: what the demo needs) followed by the demo in the same caches.

Rows (PERF.md ``first_run``, target ``seconds`` <= 30): ``backend`` the demo's chosen backend, ``command``,
``seconds`` (wall clock of the subprocess, interpreter start included), ``rc`` (0: the demo ran and its tokens
agree with the dense reference), ``agreement`` (the demo's line), ``warmup_seconds`` (the demo's own first steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from .report import write_rows

__all__ = ["main", "timed_command"]


def timed_command(args: list[str], env: dict, timeout: float) -> tuple[float, int, str]:
    """(seconds, return code, output) of ``python -m attnbackends.cli <args>`` in a fresh process."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "attnbackends.cli", *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout:.0f} s: {exc}"
    return time.perf_counter() - start, rc, out


def _row(command: str, seconds: float, rc: int, out: str) -> dict:
    chosen = re.search(r"backend chosen: (\S+)", out)
    agreement = re.search(r"agreement with the dense reference: ([^\n]+)", out)
    warm = re.search(r"warm-up \(kernel compilation on first use\): ([\d.]+) s", out)
    return {"case": "first_run", "backend": chosen.group(1) if chosen else None, "peer": None,
            "command": command, "seconds": round(seconds, 2), "us": round(seconds * 1e6), "rc": rc,
            "agreement": agreement.group(1).strip() if agreement else None,
            "warmup_seconds": float(warm.group(1)) if warm else None,
            **({"output_tail": out[-600:]} if rc else {})}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON rows to write (PERF.md format)")
    ap.add_argument("--device", default=None, help="the demo's --device (default: its own choice)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a command counts as failed")
    ap.add_argument("--with-warmup", action="store_true", help="also time `attnbackends warmup` + demo")
    args = ap.parse_args(argv)
    demo = ["demo"] + (["--device", args.device] if args.device else [])
    rows = []
    runs = [("demo", [demo])] + ([("warmup then demo", [["warmup"], demo])] if args.with_warmup else [])
    for label, commands in runs:
        with tempfile.TemporaryDirectory(prefix="attnbackends-first-run-") as tmp:
            env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                       FLASHINFER_WORKSPACE_BASE=os.path.join(tmp, "flashinfer"))
            env.pop("ATTNBACKENDS_BACKEND", None)
            total, rc, out = 0.0, 0, ""
            for command in commands:
                seconds, rc, out = timed_command(command, env, args.timeout)
                total += seconds
                if rc:
                    break
            row = _row(label, total, rc, out)
            if len(commands) > 1:
                row["demo_seconds"] = round(seconds, 2)
            rows.append(row)
    if args.out:
        write_rows(args.out, rows)
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
