"""Run benchmark suites side by side with their peers, or the GPU test groups, and keep the results.

    python -m benchmarks.run --list                           # the suites and the GPU test groups
    python -m benchmarks.run                                  # the default suites
    python -m benchmarks.run --suite triton_api [--suite mla] # named suites (also: --suites triton_api,mla)
    python -m benchmarks.run --suite triton_api -- --quick    # arguments after -- go to every suite named
    python -m benchmarks.run --gpu-tests [GROUP ...]          # pytest -m gpu over test groups (default: all)
    python -m benchmarks.run --gpu-tests triton --sanitize    # the same under compute-sanitizer memcheck
    python -m benchmarks.run --index                          # rewrite RESULTS.md and the tables from the JSON

Each suite run writes ``<outdir>/<gpu>-<suite>-<date>.json`` (PERF.md rows), a ``.md`` table and a ``.log`` of its
output, and removes that suite's older files for the same GPU from ``<outdir>`` (git history keeps them); then
``RESULTS.md`` is regenerated from every JSON in ``<outdir>`` (``benchmarks/RESULTS.md`` for the default outdir,
``<outdir>/RESULTS.md`` otherwise). Test groups write ``<gpu>-gpu_tests_<group>-<date>.log``
(``sanitize_<group>`` under memcheck).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from benchmarks import gpu_tests
from benchmarks.report import (
    library_versions,
    RESULT_NAME,
    gpu_slug,
    result_stem,
    write_json,
    write_markdown,
    write_plot,
    write_results_index,
)
from benchmarks.suites import SUITES, load, module_present, resolve

__all__ = ["DEFAULT_OUTDIR", "fp8_speedup_rows", "main", "run_suite"]

logger = logging.getLogger(__name__)

DEFAULT_OUTDIR = Path(__file__).resolve().parent / "results"


def fp8_speedup_rows(rows: list[dict]) -> list[dict]:
    """Rows comparing our fp8 decode with our bf16 decode at the same (B, L)."""
    out = []
    bf16 = {(r["B"], r["L"]): r for r in rows
            if r.get("case") == "decode" and r.get("backend") == "triton" and r.get("kv_dtype") == "auto"}
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


class _Tee:
    """A text stream writing to two streams (the console and a suite's log)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _logged(path: Path) -> Iterator[None]:
    with path.open("w") as log, contextlib.redirect_stdout(_Tee(sys.stdout, log)), \
            contextlib.redirect_stderr(_Tee(sys.stderr, log)):
        yield


def _remove_older(outdir: Path, gpu: str, suite: str, date: str) -> None:
    """Delete the suite's files of other dates for this GPU: the directory keeps the latest run."""
    for path in outdir.iterdir():
        match = RESULT_NAME.match(path.name)
        if match and match["gpu"] == gpu and match["suite"] == suite and match["date"] != date:
            path.unlink()


def run_suite(name: str, outdir: Path, extra_args: Sequence[str] = (), plot: bool = False) -> tuple[bool, str]:
    """Run one suite (GPU) and write its files; returns (complete, a line saying what happened)."""
    import torch

    suite = SUITES[name]
    if not module_present(name):
        return False, f"{name}: module {suite.module} is not in this checkout"
    if torch.cuda.device_count() < suite.gpus:
        return False, f"{name}: needs {suite.gpus} CUDA GPUs, found {torch.cuda.device_count()}"
    gpu_name = torch.cuda.get_device_name()
    gpu, date = gpu_slug(gpu_name, suite.gpus), dt.date.today().isoformat()
    stem = result_stem(gpu, name, date)
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / (name if suite.out_dir_file else f"{name}.json")
        rows_file = out / suite.out_dir_file if suite.out_dir_file else out
        with _logged(outdir / f"{stem}.log"):
            try:
                status = load(name).main([*suite.args, *extra_args, "--out", str(out)])
            except Exception:  # one broken suite must not cost the others' numbers
                logger.exception("suite %s failed", name)
                status = 1
        rows = json.loads(rows_file.read_text()).get("rows", []) if rows_file.exists() else []
    if not rows:
        return False, f"{name}: no rows (exit status {status}); see {outdir / stem}.log"
    rows += fp8_speedup_rows(rows)
    command = " ".join(["python -m benchmarks.run --suite", name, *(["--", *extra_args] if extra_args else [])])
    header = {"gpu": gpu_name, "date": date, "suite": name, "command": command, **library_versions(),
              "complete": not status, **({"world_size": suite.gpus} if suite.gpus > 1 else {})}
    write_json(outdir / f"{stem}.json", header, rows)
    write_markdown(outdir / f"{stem}.md", header, rows)
    if plot:
        write_plot(outdir / f"{stem}.png", rows)
    if not status:
        _remove_older(outdir, gpu, name, date)
    return not status, f"{name}: {len(rows)} rows -> {outdir / stem}.json" + ("" if not status else
                                                                              f" (exit status {status})")


def index_path(outdir: Path) -> Path:
    """Where RESULTS.md goes: beside the results folder for the default one, inside any other."""
    return DEFAULT_OUTDIR.parent / "RESULTS.md" if outdir.resolve() == DEFAULT_OUTDIR else outdir / "RESULTS.md"


def write_index(outdir: Path) -> Path:
    """Rewrite every kept run's markdown table and RESULTS.md from the JSON files in ``outdir``."""
    for path in sorted(outdir.glob("*.json")):
        if RESULT_NAME.match(path.name):
            data = json.loads(path.read_text())
            rows = data.pop("rows", [])
            write_markdown(path.with_suffix(".md"), data, rows)
    index = index_path(outdir)
    write_results_index(outdir, index, suite_order=SUITES, about={k: s.about for k, s in SUITES.items()})
    return index


def list_text() -> str:
    lines = ["suites (* = run when none is named):"]
    for name, suite in SUITES.items():
        where = suite.module + (" " + " ".join(suite.args) if suite.args else "")
        missing = "" if module_present(name) else "  [module not in this checkout]"
        gpus = f", {suite.gpus} GPUs" if suite.gpus > 1 else ""
        lines.append(f"  {'*' if suite.default else ' '} {name:<19} {suite.about} ({where}{gpus}){missing}")
    lines.append("GPU test groups (--gpu-tests):")
    for name in gpu_tests.group_names():
        paths = gpu_tests.GROUPS.get(name, ("every test outside the other groups",))
        lines.append(f"    {name:<19} {' '.join(paths)}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="append", default=[], metavar="NAME", help="a suite to run (repeatable)")
    ap.add_argument("--suites", default="", metavar="A,B", help="suites to run, comma separated")
    ap.add_argument("--list", action="store_true", help="list the suites and the GPU test groups, then exit")
    ap.add_argument("--gpu-tests", nargs="*", metavar="GROUP", default=None,
                    help="run pytest -m gpu over these test groups (none named: every group)")
    ap.add_argument("--sanitize", action="store_true", help="with --gpu-tests: under compute-sanitizer memcheck")
    ap.add_argument("-k", dest="keyword", default=None, help="with --gpu-tests: pytest's -k expression")
    ap.add_argument("--parallel", action="store_true", help="with --gpu-tests: the groups side by side")
    ap.add_argument("--workers", type=int, default=None, help="with --gpu-tests: pytest-xdist processes per group")
    ap.add_argument("--timeout", type=float, default=None, help="with --gpu-tests: seconds per group")
    ap.add_argument("--test-timeout", type=float, default=None,
                    help="with --gpu-tests: seconds per test (pytest-timeout, where installed)")
    ap.add_argument("--index", action="store_true",
                    help="only rewrite RESULTS.md and the tables from the JSON files in --outdir (no GPU)")
    ap.add_argument("--outdir", type=Path, default=DEFAULT_OUTDIR)
    ap.add_argument("--plot", action="store_true", help="also a PNG of decode time against context per suite")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        print(list_text())
        return 0
    outdir: Path = args.outdir
    if args.index:
        print(f"wrote {write_index(outdir)}")
        return 0
    named = [*args.suite, *(s.strip() for s in args.suites.split(",") if s.strip())]
    try:
        suites = list(dict.fromkeys(resolve(s) for s in named))
        for group in args.gpu_tests or ():
            gpu_tests.group_paths(group)
    except ValueError as e:
        parser.error(str(e))
    if args.gpu_tests is None and not suites:
        suites = [name for name, suite in SUITES.items() if suite.default]
    status = 0
    if args.gpu_tests is not None:
        status |= _run_gpu_tests(args, outdir)
    if suites:
        status |= _run_suites(suites, outdir, extra, args.plot)
    return status


def _run_gpu_tests(args: argparse.Namespace, outdir: Path) -> int:
    import torch

    groups = args.gpu_tests or gpu_tests.group_names()
    gpu = gpu_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    kind = "sanitize" if args.sanitize else "gpu_tests"
    log_name = f"{gpu}-{kind}_{{group}}-{dt.date.today().isoformat()}.log"
    results = gpu_tests.run_groups(groups, outdir, log_name, keyword=args.keyword, sanitize=args.sanitize,
                                   parallel=args.parallel, timeout_s=args.timeout, workers=args.workers,
                                   test_timeout_s=args.test_timeout)
    failed = False
    for r in results:
        timed_out = " TIMED OUT (tests after the last PASSED line did not run)" if r.returncode is None else ""
        memcheck = "" if r.memcheck_errors is None else f" memcheck errors={r.memcheck_errors}"
        print(f"{r.name}: passed={r.passed} failed={r.failed} skipped={r.skipped}{memcheck}{timed_out} -> {r.log}")
        for line in r.failures:
            print(f"  {line}")
        # pytest's 5: nothing collected (e.g. a -k matching no test of the group)
        failed |= r.returncode not in (0, 5) or bool(r.memcheck_errors)
    return 1 if failed else 0


def _run_suites(suites: list[str], outdir: Path, extra: Sequence[str], plot: bool) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU: the suites time GPU kernels against GPU peers", file=sys.stderr)
        return 2
    from tqdm import tqdm

    incomplete = []
    for name in tqdm(suites, desc="benchmark suites", unit="suite"):
        complete, line = run_suite(name, outdir, extra, plot)
        print(line)
        if not complete:
            incomplete.append(name)
    print(f"wrote {write_index(outdir)}" + (f"; incomplete: {', '.join(incomplete)}" if incomplete else ""))
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
