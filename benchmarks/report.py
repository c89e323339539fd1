"""Result files of a benchmark run: JSON rows, a markdown table with the PERF.md targets, and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tabulate import tabulate

__all__ = ["target_for", "write_json", "write_markdown", "write_plot"]


def target_for(row: dict[str, Any]) -> Optional[tuple[str, bool]]:
    """The PERF.md target a row is judged by, and whether it is met; None for rows without one."""
    case, backend, ratio = row.get("case"), row.get("backend"), row.get("ratio")
    B, L = row.get("B"), row.get("L")
    if case == "decode" and backend == "triton" and row.get("kv_dtype") == "auto" and ratio is not None:
        if B >= 64 and L >= 4096:
            return "time <= 1.05x flashinfer", ratio <= 1.05
        if B == 1 and L in (1024, 16384):
            return "time <= 1.3x flashinfer", ratio <= 1.3
    if case == "decode_fp8_speedup" and row.get("speedup") is not None:
        return ">= 1.7x own bf16 decode", row["speedup"] >= 1.7
    if case == "mixed" and backend == "triton" and ratio is not None:
        return "time <= 1.2x flashinfer prefill+decode", ratio <= 1.2
    if case == "prefill" and backend == "triton" and ratio is not None:
        return ">= 0.8x flashinfer TFLOP/s", 1.0 / ratio >= 0.8
    if case == "mla_decode" and backend == "triton_mla" and ratio is not None:
        return ">= 0.6x flashinfer MLA TFLOP/s", 1.0 / ratio >= 0.6
    if case == "adapter_overhead" and ratio is not None:
        if B == 1:
            # Host-bound: judged by back-to-back wall time per step (see benchmarks.flashinfer_adapter);
            # rows without wall times fall back to the do_bench times.
            extra = row.get("wall_overhead_us", row["us"] - row["peer_us"])
            return "<= 20 us over raw wrappers (wall, back to back)", extra <= 20.0
        return "<= 3% over raw wrappers", ratio <= 1.03
    if case == "build_host_time" and B == 256 and L == 4096 and row.get("us") is not None:
        return "build() <= 100 us CPU time", row["us"] <= 100.0
    return None


def write_json(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({**header, "rows": rows}, indent=1))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _step(row: dict[str, Any]) -> str:
    """The adapter rows' step ("run", "plan+run"), marked when the builder called plan() every step."""
    step = row.get("step")
    if step is None:
        return "-"
    return f"{step} (plan() each step)" if row.get("fast_plan") is False else step


def write_markdown(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A table of every row with its target verdict; returns the markdown text."""
    table = []
    for row in rows:
        target = target_for(row)
        table.append(
            [
                row.get("case"), _step(row), row.get("backend"), row.get("peer"), row.get("B"), row.get("L"),
                row.get("kv_dtype"), _fmt(row.get("us")), _fmt(row.get("peer_us")), _fmt(row.get("ratio")),
                _fmt(row.get("GBps")), _fmt(row.get("TFLOPs")),
                "-" if target is None else f"{target[0]}: {'met' if target[1] else 'MISSED'}",
            ]
        )
    heads = ["case", "step", "backend", "peer", "B", "L", "kv", "us", "peer us", "ratio", "GB/s", "TFLOP/s", "PERF.md target"]
    text = (
        f"# Benchmarks: {header['gpu']}, {header['date']}\n\n"
        f"Command: `{header['command']}`; torch {header['torch']}, triton {header['triton']}, "
        f"flashinfer {header.get('flashinfer') or 'not installed'}. Times: triton.testing.do_bench medians (us); "
        "ratio = us / peer_us.\n\n" + tabulate(table, heads, tablefmt="github") + "\n"
    )
    path.write_text(text)
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
