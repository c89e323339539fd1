"""What the kernel-exploration drivers (``prefill_explore.py``, ``mla_explore.py``) share: a timestamped log, child
processes whose output streams into it (a candidate that crashes or hangs takes only its child with it), and the
budgeted loop over candidate families."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["Log", "kill_child", "run_families", "spawn_child"]


class Log:
    """Prints each line with the seconds since start, and appends it to ``path`` when given."""

    def __init__(self, path: Optional[str]):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a") if path else None
        self.t0 = time.time()

    def __call__(self, msg: str = "") -> None:
        line = f"[{time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def spawn_child(cmd: Sequence[str], log: Log, prefix: str, cwd: Optional[str] = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session; its output goes to ``log``, each line prefixed with ``[prefix]``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=cwd, start_new_session=True)

    def pump():
        for line in proc.stdout:
            log(f"[{prefix}] {line.rstrip()}")
    threading.Thread(target=pump, daemon=True).start()
    return proc


def kill_child(proc: subprocess.Popen) -> None:
    """Kill a child and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_families(families: Sequence[str], run_family: Callable[[str, float], None], deadline: float, log: Log, *,
                 reserve_s: float, min_left_s: float, between: Callable[[], None] = lambda: None) -> None:
    """Run each family with an equal share of the time left before ``deadline`` (less ``reserve_s``); stop when
    less than ``min_left_s`` is left. A family that raises is logged and the next one runs. ``between`` runs
    before each family (e.g. collecting a background peer's result)."""
    for i, fam in enumerate(families):
        between()
        left = deadline - time.time() - reserve_s
        if left < min_left_s:
            log(f"== budget spent: skipping candidates {list(families[i:])}")
            break
        try:
            run_family(fam, left / (len(families) - i))
        except Exception as e:  # noqa: BLE001 - one broken candidate must not end the sweep
            log(f"== candidate {fam} failed: {type(e).__name__}: {str(e)[:400]}")
