"""examples/hybrid_model.py runs as a script on the CPU: two backends in one engine, checked against float32."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_hybrid_model_example_serves_two_backends():
    env = dict(os.environ)
    env.pop("ATTNBACKENDS_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hybrid_model.py"), "--new-tokens", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backends per group: sliding_24=triton,full=reference" in proc.stdout
    assert "group sliding_24: layers 0-1,3-4, backend triton" in proc.stdout
