"""Run every benchmark suite available on this GPU and write the results files (see the package docstring).

    python -m benchmarks.run [--suites triton,flashinfer_adapter,mla] [--outdir benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from attnbackends.platform import package_available
from benchmarks.report import write_json, write_markdown, write_plot

__all__ = ["SUITES", "main", "fp8_speedup_rows"]

logger = logging.getLogger(__name__)

# suite name -> (module with main(argv) writing {"rows": [...]} to --out, extra argv)
SUITES = {
    "triton": ("benchmarks.triton_vs_flashinfer", []),
    "flashinfer_adapter": ("benchmarks.flashinfer_adapter", []),
    "mla": ("benchmarks.mla", []),
}


def fp8_speedup_rows(rows: list[dict]) -> list[dict]:
    """Rows comparing our fp8 decode with our bf16 decode at the same (B, L) (the PERF.md fp8 target)."""
    out = []
    bf16 = {(r["B"], r["L"]): r for r in rows if r.get("case") == "decode" and r.get("backend") == "triton" and r.get("kv_dtype") == "auto"}
    for r in rows:
        if r.get("case") == "decode" and r.get("backend") == "triton" and str(r.get("kv_dtype", "")).startswith("fp8"):
            base = bf16.get((r["B"], r["L"]))
            if base:
                out.append({
                    "case": "decode_fp8_speedup", "backend": "triton", "peer": "triton_bf16", "B": r["B"], "L": r["L"],
                    "dtype": r.get("dtype"), "kv_dtype": r["kv_dtype"], "us": r["us"], "peer_us": base["us"],
                    "ratio": round(r["us"] / base["us"], 3), "speedup": round(base["us"] / r["us"], 3),
                })
    return out


def _gpu_slug(name: str) -> str:
    match = re.search(r"(H100|H200|H20|A100|B200|GB200|L40S|L4|A10G|RTX \w+)", name, re.I)
    return (match.group(1) if match else name).lower().replace(" ", "-")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, from: {', '.join(SUITES)}")
    parser.add_argument("--outdir", default="benchmarks/results")
    parser.add_argument("--tag", default="", help="suffix for the result file names")
    args = parser.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suites {unknown}; allowed: {', '.join(SUITES)}")
    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU: the suites time GPU kernels against GPU peers", file=sys.stderr)
        return 2
    import triton

    gpu = torch.cuda.get_device_name()
    date = dt.date.today().isoformat()
    command = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    failed: list[str] = []
    for name in tqdm(suites, desc="benchmark suites", unit="suite"):
        module_name, extra = SUITES[name]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / f"{name}.json"
            try:
                status = importlib.import_module(module_name).main(["--out", str(out), *extra])
            except Exception:  # one broken suite must not cost the others' numbers
                logger.exception("suite %s failed", name)
                status = 1
            if out.exists():
                rows += [{**r, "suite": name} for r in json.loads(out.read_text()).get("rows", [])]
            if status:
                failed.append(name)
    rows += fp8_speedup_rows(rows)
    flashinfer_version = None
    if package_available("flashinfer"):
        import flashinfer

        flashinfer_version = getattr(flashinfer, "__version__", "installed")
    header = {
        "gpu": gpu, "date": date, "command": command, "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": flashinfer_version, "failed_suites": failed,
    }
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = f"{_gpu_slug(gpu)}-{date}" + (f"-{args.tag}" if args.tag else "")
    write_json(outdir / f"{stem}.json", header, rows)
    print(write_markdown(outdir / f"{stem}.md", header, rows))
    plotted = write_plot(outdir / f"{stem}.png", rows)
    print(f"wrote {outdir / stem}.json/.md" + ("/.png" if plotted else "")
          + (f"; failed suites: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
