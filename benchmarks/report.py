"""Result files of the benchmark suites: one JSON and one markdown table per suite run, a PNG plot of decode times,
and ``benchmarks/RESULTS.md`` (every kept run, one section per suite and GPU).

A run's files are named ``<gpu>-<suite>-<date>.{json,md,log}`` (``h100-triton_api-2026-11-25.json``); the JSON is
``{"gpu", "date", "suite", "command", "torch", "triton", "flashinfer", "rows": [...]}`` with rows in the format of
PERF.md (``case``, ``backend``, ``peer``, ``B``, ``L``, ``us``, ``peer_us``, ``ratio`` = us / peer_us, ...).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional


__all__ = [
    "RESULT_NAME",
    "gpu_slug",
    "library_versions",
    "result_stem",
    "target_for",
    "write_json",
    "write_markdown",
    "write_plot",
    "write_results_index",
]

#: ``<gpu>-<suite>-<date>.<ext>``: gpu ``h100``, ``h200x2`` ...; suite in snake_case; ISO date.
RESULT_NAME = re.compile(r"^(?P<gpu>[a-z0-9]+)-(?P<suite>[a-z0-9_]+)-(?P<date>\d{4}-\d{2}-\d{2})\.(?P<ext>\w+)$")


def gpu_slug(name: str, count: int = 1) -> str:
    """The short GPU name of result files: ``NVIDIA H100 80GB HBM3`` -> ``h100``; ``count`` > 1 adds ``x<count>``."""
    match = re.search(r"(GH200|GB200|H100|H200|H20|A100|B200|L40S|L4|A10G|RTX ?\w+)", name, re.I)
    slug = re.sub(r"[^a-z0-9]", "", (match.group(1) if match else name).lower()) or "gpu"
    return slug + (f"x{count}" if count > 1 else "")


def result_stem(gpu: str, suite: str, date: str) -> str:
    return f"{gpu}-{suite}-{date}"


def _time_target(row: dict[str, Any], limit: float, what: str) -> tuple[str, bool]:
    return f"time <= {limit:g}x {what}", row["ratio"] <= limit


#: The quantised KV caches whose greedy tokens must match the bf16 cache's (the others are recorded).
_GREEDY_TARGET_FORMATS = ("int8_per_token_head", "fp8_per_token_head")


def target_for(row: dict[str, Any]) -> Optional[tuple[str, bool]]:
    """The PERF.md target a row is judged by and whether it is met; None for rows without one."""
    case, backend, peer, ratio = row.get("case"), row.get("backend"), row.get("peer"), row.get("ratio")
    B, L, kv = row.get("B"), row.get("L"), row.get("kv_dtype", "auto")
    if case == "adapter_overhead" and ratio is not None:
        if B == 1:
            # Host-bound: judged by back-to-back wall time per step (see benchmarks.flashinfer_adapter); rows
            # without wall times fall back to the do_bench times.
            extra = row.get("wall_overhead_us", row["us"] - row["peer_us"])
            return "<= 20 us over raw wrappers (wall, back to back)", extra <= 20.0
        return _time_target(row, 1.03, "raw wrappers")
    if case == "build_host_time" and B == 256 and L == 4096 and row.get("us") is not None:
        return "build() <= 100 us CPU time", row["us"] <= 100.0
    if case == "step_host" and B == 256 and row.get("pages") == 65536 and row.get("us") is not None:
        updates = max(row.get("add_us", 0.0), row.get("finish_us", 0.0))
        return "<= 150 us per step, <= 20 us per add/finish (host)", row["us"] <= 150.0 and updates <= 20.0
    if case == "engine_graphs" and row.get("speedup") is not None:
        return "tokens/s with graphs >= 2x eager", row["speedup"] >= 2.0
    if case == "first_run" and row.get("seconds") is not None and row.get("command") == "demo":
        return "`attnbackends demo` <= 30 s, fresh caches", row["seconds"] <= 30.0 and row.get("rc") == 0
    if case == "step_wall" and backend == "triton" and row.get("us") is not None:
        if row.get("mode") == "graph" and row.get("graph_overhead") is not None:
            return "step <= 1.05x its kernels' GPU time", row["graph_overhead"] <= 1.05
        if row.get("mode") == "eager" and ratio is not None:
            return _time_target(row, 0.95, "FlashInfer's own wrappers")
        return None
    if case == "kv_quant_greedy" and row.get("dtype") == "bfloat16" and row.get("format") in _GREEDY_TARGET_FORMATS:
        return "greedy tokens = bf16 cache's on >= 95% of positions", row["token_agreement"] >= 0.95
    if ratio is None or backend not in ("triton", "triton_mla", "auto"):
        return None
    if case == "decode" and peer == "flashinfer":
        if str(kv).startswith("fp8"):
            return _time_target(row, 1.0, "flashinfer fp8")
        if B >= 64 and L >= 4096:
            return _time_target(row, 1.05, "flashinfer")
        return None
    if case == "decode_eager" and peer == "flashinfer":
        if B == 1 and L == 1024:
            return _time_target(row, 1.1, "flashinfer")
        if B == 16 and L == 4096:
            return _time_target(row, 1.05, "flashinfer")
        return None
    rules = {
        ("host_overhead", "flashinfer"): (1.0, "flashinfer run()"),
        ("prefill", "flashinfer"): (0.9, "flashinfer"),
        ("prefill", "sdpa"): (1.11, "sdpa"),  # >= 0.9x SDPA's throughput
        ("prefill_chunk", "flashinfer"): (1.0, "flashinfer"),
        ("prefill_cached", "flashinfer"): (1.0, "flashinfer"),
        ("prefill_shape", "flashinfer"): (1.0, "flashinfer"),
        ("prefill_shape", "sdpa"): (1.11, "sdpa"),
        ("mixed", "flashinfer"): (1.0, "flashinfer"),
        ("serving_trace", "flashinfer"): (1.0, "flashinfer"),
        ("mla_forward", "flashinfer_mla"): (1.0, "flashinfer_mla"),
        ("mla_host", "flashinfer_mla"): (1.0, "flashinfer_mla"),
        ("mla_fp8", "triton_mla_bf16"): (1.0, "own bf16 pages"),
        ("verify", "flashinfer"): (1.2, "flashinfer"),
        ("decode_multi", "triton_single"): (1.3, "a single-token decode"),
        ("hybrid_decode", "groups_alone"): (1.1, "its groups alone"),
    }
    rule = rules.get((case, peer))
    if rule is None or (case == "host_overhead" and backend != "triton"):
        return None
    return _time_target(row, *rule)


def library_versions() -> dict[str, Any]:
    """The versions a result depends on (torch, triton, flashinfer; None where one is not installed), for a
    result file's header."""
    import torch

    versions: dict[str, Any] = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    try:
        import flashinfer

        versions["flashinfer"] = getattr(flashinfer, "__version__", "installed")
    except Exception:  # not installed, or its import fails on this host: the suites say which
        versions["flashinfer"] = None
    return versions


def write_rows(out: "str | Path", rows: list[dict[str, Any]]) -> None:
    """A suite module's ``--out`` file, ``{"rows": [...]}`` (``benchmarks.run`` adds the header), folders made."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def write_json(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    return str(value)


def _step(row: dict[str, Any]) -> Optional[str]:
    """The adapter rows' step ("run", "plan+run"), marked when the builder called plan() every step."""
    step = row.get("step")
    if step is None:
        return None
    return f"{step} (plan() each step)" if row.get("fast_plan") is False else step


# Row fields that tell rows of one suite apart, shown as columns where some row has them (in this order).
_EXTRA_COLUMNS = (
    "config", "prefill_kernel", "kernel_writes_cache", "cache_write_sms", "tokens_per_program", "group", "window",
    "tree", "tokens_per_request", "drafter", "tokens_identical", "acceptance_length", "tokens_per_s",
    "speedup_vs_plain", "ranks", "exchange", "trace", "model", "mode", "shape", "ctx", "measured_choice",
    "wall_us", "peer_wall_us", "speedup", "q_len", "products", "repeat_us", "peer_repeat_us", "batch", "GBps",
    "roof_GBps", "pages", "array_us", "add_us", "finish_us",
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a GitHub table: the PERF.md columns, the identifying fields present, the target verdict."""
    from tabulate import tabulate  # a dev package: only where a table is written

    extras = [c for c in _EXTRA_COLUMNS if any(r.get(c) is not None for r in rows)]
    show_step = any(r.get("step") is not None for r in rows)
    show_kv = any(r.get("kv_dtype", "auto") != "auto" for r in rows)
    heads = ["case", *(["step"] if show_step else []), "backend", "peer", "B", "L", *(["kv"] if show_kv else []),
             "us", "peer us", "ratio", "GB/s", "TFLOP/s", *extras, "PERF.md target"]
    table = []
    for row in rows:
        target = target_for(row)
        table.append([
            row.get("case"), *([_fmt(_step(row))] if show_step else []), row.get("backend"), _fmt(row.get("peer")),
            _fmt(row.get("B")), _fmt(row.get("L")), *([row.get("kv_dtype")] if show_kv else []),
            _fmt(row.get("us")), _fmt(row.get("peer_us")), _fmt(row.get("ratio")), _fmt(row.get("GBps")),
            _fmt(row.get("TFLOPs")), *(_fmt(row.get(c)) for c in extras),
            "-" if target is None else f"{target[0]}: {'met' if target[1] else 'MISSED'}",
        ])
    return tabulate(table, heads, tablefmt="github", disable_numparse=True)


def _versions(header: dict[str, Any]) -> str:
    parts = [f"{name} {header[name]}" for name in ("torch", "triton") if header.get(name)]
    parts.append(f"flashinfer {header.get('flashinfer') or 'not installed'}")
    return ", ".join(parts)


def write_markdown(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A suite run's table with its target verdicts; returns the markdown text."""
    title = f"{header['suite']}: " if header.get("suite") else ""
    text = (
        f"# {title}{header['gpu']}, {header['date']}\n\n"
        f"Command: `{header['command']}`; {_versions(header)}. Times in us (medians); ratio = us / peer us.\n\n"
        + markdown_table(rows) + "\n"
    )
    path.write_text(text)
    return text


def _kept_runs(results_dir: Path) -> Iterable[tuple[str, str, str, dict[str, Any]]]:
    """(suite, gpu, date, data) of every ``<gpu>-<suite>-<date>.json`` in ``results_dir``."""
    for path in sorted(results_dir.glob("*.json")):
        match = RESULT_NAME.match(path.name)
        if match:
            yield match["suite"], match["gpu"], match["date"], json.loads(path.read_text())


def write_results_index(results_dir: Path, index: Path, suite_order: Iterable[str] = (),
                        about: Optional[dict[str, str]] = None) -> str:
    """Write ``index`` (RESULTS.md): one section per suite and GPU from the JSON files kept in ``results_dir``,
    suites in ``suite_order`` first; returns the text."""
    runs = list(_kept_runs(results_dir))
    order = {name: i for i, name in enumerate(suite_order)}
    runs.sort(key=lambda r: (order.get(r[0], len(order)), r[0], r[1], r[2]))
    link = Path(os.path.relpath(results_dir.resolve(), index.parent.resolve())).as_posix()
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.run` from the JSON files in "
        f"[`{link}/`]({link}/) (the latest run of each suite on each GPU); do not edit by hand. Each suite runs "
        "every available backend beside its peers on the same shapes in one process. Times in microseconds "
        "(medians); ratio = our time / the peer's time (below 1: faster than the peer). The PERF.md column judges "
        "a row by the targets in PERF.md.",
        "",
    ]
    for suite, gpu, date, data in runs:
        stem = result_stem(gpu, suite, date)
        lines += [f"## {suite} ({gpu.upper()}, {date})", ""]
        if about and about.get(suite):
            lines += [about[suite][0].upper() + about[suite][1:] + ".", ""]
        lines += [
            f"GPU: {data.get('gpu', gpu)}; {_versions(data)}; command: `{data.get('command', '-')}`; "
            f"files: `{link}/{stem}.*`.",
            "",
            markdown_table(data.get("rows", [])),
            "",
        ]
    text = "\n".join(lines)
    index.write_text(text)
    return text


def write_plot(path: Path, rows: list[dict[str, Any]]) -> bool:
    """Decode time against context length, one line per (backend, batch size), ours and the peer's. Writes nothing
    and returns False when ``rows`` hold no decode rows (e.g. an adapter-overhead run alone)."""
    panels = [("decode", "auto", "paged decode, bf16 KV"), ("mla_decode", "auto", "MLA decode")]
    if not any(r.get("case") == case and r.get("kv_dtype", "auto") == kv for r in rows for case, kv, _ in panels):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.5))
    for ax, (case, kv, title) in zip(axes, panels):
        picked = [r for r in rows if r.get("case") == case and r.get("kv_dtype", "auto") == kv]
        for B in sorted({r["B"] for r in picked}):
            series = sorted((r for r in picked if r["B"] == B), key=lambda r: r["L"])
            for key, name_key, style in (("us", "backend", "-o"), ("peer_us", "peer", "--x")):
                points = [(r["L"], r[key]) for r in series if r.get(key) is not None]
                if points:
                    label = f"{series[0][name_key]} B={B}"
                    ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="time (us)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        if picked:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
