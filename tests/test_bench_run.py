"""The benchmark tool on CPU: the suite registry, --list, the results folder and RESULTS.md, the GPU test groups.
The timings themselves need the GPU."""

import importlib
import json

import pytest

from benchmarks import gpu_tests
from benchmarks.report import gpu_slug, write_json
from benchmarks.run import _remove_older, main, write_index
from benchmarks.suites import SUITES, module_present, resolve


def _row(case, us, peer_us, **extra):
    return {"case": case, "backend": "triton", "peer": "flashinfer", "B": 64, "L": 4096, "dtype": "bfloat16",
            "kv_dtype": "auto", "us": us, "peer_us": peer_us, "ratio": round(us / peer_us, 4), **extra}


def test_list_names_every_suite_and_group(capsys):
    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    for name, suite in SUITES.items():
        assert name in text and suite.module in text
        assert ("[module not in this checkout]" in text.split(name, 1)[1].splitlines()[0]) is not module_present(name)
    for group in gpu_tests.group_names():
        assert group in text


def test_unknown_names_are_refused_naming_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--suites", "triton,nope"])
    assert "unknown suite 'nope'" in capsys.readouterr().err and "triton_api" in SUITES
    with pytest.raises(SystemExit):
        main(["--gpu-tests", "nope"])
    assert "unknown GPU test group 'nope'" in capsys.readouterr().err


def test_aliases_and_slugs():
    assert resolve("triton_vs_flashinfer") == "triton" and resolve("mla") == "mla"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100" and gpu_slug("NVIDIA H200", 2) == "h200x2"
    assert gpu_slug("NVIDIA GH200 480GB") == "gh200"


@pytest.mark.parametrize("name", [n for n in SUITES if module_present(n)])
def test_every_suite_module_imports_on_cpu_and_has_main(name):
    assert callable(importlib.import_module(SUITES[name].module).main)


def test_results_index_and_tables_from_the_kept_json(tmp_path):
    header = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-25", "suite": "triton_api",
              "command": "python -m benchmarks.run --suite triton_api", "torch": "2.11", "triton": "3.6"}
    write_json(tmp_path / "h100-triton_api-2026-11-25.json", header, [_row("decode", 380.0, 370.0)])
    write_json(tmp_path / "h200-mla-2026-11-24.json", {**header, "gpu": "NVIDIA H200", "suite": "mla"},
               [{**_row("mla_forward", 90.0, 100.0), "backend": "triton_mla", "peer": "flashinfer_mla"}])
    (tmp_path / "notes.json").write_text("{}")  # not a result file: ignored
    index = write_index(tmp_path)
    assert index == tmp_path / "RESULTS.md"
    text = index.read_text()
    api, mla = text.index("## triton_api (H100, 2026-11-25)"), text.index("## mla (H200, 2026-11-24)")
    assert api < mla  # the registry's order
    assert "time <= 1.05x flashinfer: met" in text and "time <= 1x flashinfer_mla: met" in text
    assert "`python -m benchmarks.run --suite triton_api`" in text and "./h100-triton_api-2026-11-25.*" in text
    table = (tmp_path / "h100-triton_api-2026-11-25.md").read_text()
    assert table.startswith("# triton_api: NVIDIA H100 80GB HBM3, 2026-11-25") and "| 380.0" in table
    assert "notes" not in text


def test_a_run_replaces_the_older_files_of_its_suite_and_gpu(tmp_path):
    names = ["h100-mla-2026-11-20.json", "h100-mla-2026-11-20.md", "h100-mla-2026-11-20.log",
             "h100-mla-2026-11-25.json", "h200-mla-2026-11-20.json", "h100-mla_extra-2026-11-20.json", "README"]
    for name in names:
        (tmp_path / name).write_text("x")
    _remove_older(tmp_path, "h100", "mla", "2026-11-25")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["h100-mla-2026-11-25.json", "h200-mla-2026-11-20.json", "h100-mla_extra-2026-11-20.json", "README"])


def test_gpu_test_groups(tmp_path):
    assert gpu_tests.group_paths("triton")[0] == "tests/triton_backend"
    integration = gpu_tests.group_paths("integration")
    assert integration[0] == "tests" and "--ignore=tests/mla" in integration
    cmd = gpu_tests.pytest_command("mla", keyword="hopper", sanitize=True)
    assert cmd[:2] == ["compute-sanitizer", "--tool"] and cmd[-2:] == ["-k", "hopper"] and "gpu" in cmd
    log = tmp_path / "g.log"
    log.write_text("tests/a.py::t1 PASSED [ 50%]\ntests/a.py::t2 FAILED [100%]\ntests/b.py::t3 SKIPPED\n"
                   "[gw3] [ 75%] PASSED tests/b.py::t4 \n"
                   "FAILED tests/a.py::t2 - AssertionError\n========= ERROR SUMMARY: 2 errors\n"
                   "========= ERROR SUMMARY: 1 error was not printed. Use --print-limit option to adjust\n")
    r = gpu_tests.summarise("mla", log, 1)
    assert (r.passed, r.failed, r.skipped, r.memcheck_errors) == (2, 1, 1, 2)
    spread = gpu_tests.pytest_command("mla", workers=8)
    assert spread[spread.index("-n") + 1] == "8" and "-n" not in gpu_tests.pytest_command("mla")
    import importlib.util

    limited = gpu_tests.pytest_command("mla", test_timeout_s=90)
    if importlib.util.find_spec("pytest_timeout"):
        assert limited[limited.index("--timeout") + 1] == "90"
    else:
        assert "--timeout" not in limited  # the flag would be an unknown option without the plugin
    assert r.failures == ["FAILED tests/a.py::t2 - AssertionError"]
    assert cmd[cmd.index(gpu_tests.FAILURES_NOW) - 1] == "-p"


def test_failures_are_written_when_they_happen(tmp_path):
    """The GPU groups' plugin writes a failing test's traceback to stderr at once (pytest's own summary, on stdout,
    comes only when the run ends)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_one.py").write_text("def test_fails():\n    assert 1 + 1 == 3\n\n"
                                          "def test_after():\n    pass\n")
    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          gpu_tests.FAILURES_NOW, str(tmp_path / "test_one.py")], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 1
    assert "FAILURE NOW test_one.py::test_fails (call)" in run.stderr and "assert 1 + 1 == 3" in run.stderr
    assert "test_after" not in run.stderr


def test_kept_results_follow_the_naming_and_format():
    from pathlib import Path

    from benchmarks.report import RESULT_NAME

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for path in results.iterdir():
        match = RESULT_NAME.match(path.name)
        assert match, path.name
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            assert data["suite"] == match["suite"] and data["date"] == match["date"] and data["rows"], path.name
            assert gpu_slug(data["gpu"], data.get("world_size", 1)) == match["gpu"], path.name
            assert all({"case", "backend", "peer"} <= set(r) for r in data["rows"]), path.name


def test_the_cascade_suite_shares_the_prefix_pages_it_reports():
    """flashinfer_cascade's steps: every request starts on the same prefix pages, the rest are its own, and the
    common metadata says how long the prefix is (what cascade attention needs to be planned at all)."""
    from benchmarks.flashinfer_cascade import SPEC, _cases, shared_prefix_step

    bs = SPEC.block_size
    for qlens, clens, prefix in _cases().values():
        assert prefix % bs == 0 and all(c >= prefix for c in clens)
    common, cache, q, k, v = shared_prefix_step([1, 1, 300], [700, 500, 100 + 96], 96, device="cpu")
    table = common.block_table_cpu if common.block_table_cpu is not None else common.block_table.cpu()
    shared = 96 // bs
    assert common.common_prefix_len == 96
    assert (table[:, :shared] == table[0, :shared]).all()
    own = [table[i, shared: -(-(common.seq_lens_cpu[i].item()) // bs)].tolist() for i in range(3)]
    assert len(set(sum(own, []))) == sum(map(len, own))  # private pages are not shared
    assert q.shape[0] == k.shape[0] == v.shape[0] == 302 and cache.shape[0] > int(table.max())
