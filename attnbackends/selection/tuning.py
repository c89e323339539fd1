"""Measured selection: stored `attnbackends tune` profiles, and the choice made from them.

A profile holds the time of every candidate (single backends and phase compositions) on a small grid of decode,
prefill and mixed shapes, measured on one GPU. It is stored as JSON under a key of everything that can change the
numbers: the GPU's name and compute capability, the driver, the torch / triton / attnbackends versions, what each
registered backend reports about the library it runs on (flashinfer's version, flash-attn's generation:
:meth:`attnbackends.AttentionBackend.environment_facts`), and the spec. ``AttentionConfig(selection="measured")``
makes :func:`attnbackends.select` look the profile up; with one, candidates are ranked by :func:`choose` (and the
explanation carries the table and why the winner won), without one the static priority list is used and the
explanation says so.

A candidate's time on a shape is its per-layer cost in a whole engine step (``build()`` shared out over the step's
layers, see :mod:`attnbackends.selection.tune_timing`). Its score is the geometric mean, over the grid's shapes, of
that time divided by the best fitting candidate's time on the shape: 1.0 means fastest everywhere. A phase
composition is ranked at its score times ``1 + COMPOSITION_MARGIN``: it runs two builds and, on mixed steps, two
launches per layer, so it is chosen only where it wins by more than timing noise. Candidates not measured on every
shape, or that do not fit the spec on this device now, are not ranked.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from ..platform import DeviceInfo
from ..spec import AttentionConfig, AttentionSpec
from .phased import is_phased_name

__all__ = [
    "COMPOSITION_MARGIN",
    "PROFILE_FORMAT",
    "MeasuredChoice",
    "Profile",
    "choose",
    "default_profile_dir",
    "environment_key",
    "load_profile",
    "measured_candidates",
    "profile_path",
]

logger = logging.getLogger(__name__)

PROFILE_FORMAT = 2
#: How much better than its score a phase composition must be to rank as it measured (see the module docstring).
COMPOSITION_MARGIN = 0.03
PHASES = ("decode", "prefill", "mixed")


def default_profile_dir(config: Optional[AttentionConfig] = None) -> Path:
    """``config.profile_dir``, else ``$XDG_CACHE_HOME/attnbackends/profiles`` (``~/.cache`` when unset)."""
    if config is not None and config.profile_dir:
        return Path(config.profile_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnbackends" / "profiles"


def _driver_version() -> str:
    """The CUDA driver's version (cuDriverGetVersion), "none" without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return "unknown"
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        return "none"


def _dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return None


def environment_key(spec: AttentionSpec, device: DeviceInfo, facts: Mapping[str, Optional[str]]) -> dict[str, Any]:
    """Everything a profile's numbers depend on (compared whole: any change means "not measured here").

    ``facts``: what the backends report about the libraries they run on
    (:func:`attnbackends.selection.registry.environment_facts`: flashinfer's version, flash-attn's generation, ...);
    a fact named like one of the key's own entries (``gpu``, ``torch``, ...) does not replace it.
    """
    cc = device.compute_capability
    key = {
        "format": PROFILE_FORMAT,
        "gpu": device.name,
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "driver": _driver_version(),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "attnbackends": _dist_version("attnbackends"),
        "spec": spec.model_dump(mode="json"),
    }
    for name, value in facts.items():
        key.setdefault(name, value)
    return key


def profile_path(key: dict[str, Any], directory: "str | os.PathLike") -> Path:
    """Where the profile of ``key`` lives: ``<directory>/<gpu>-<hash of the key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", str(key.get("gpu") or "device")).strip("-").lower()
    return Path(directory) / f"{gpu}-{digest}.json"


@dataclass
class Profile:
    """One tune run: its key, the shapes (``{"label", "phase", ...}``), and µs per layer per candidate and shape
    label (None where the candidate failed on that shape; ``errors`` says why), measured in steps of
    ``layers_per_step`` layers sharing one build."""

    key: dict[str, Any]
    shapes: list[dict[str, Any]]
    times_us: dict[str, dict[str, Optional[float]]]
    errors: dict[str, str] = field(default_factory=dict)
    created: str = ""
    layers_per_step: int = 1

    def save(self, directory: "str | os.PathLike") -> Path:
        path = profile_path(self.key, directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "Profile":
        data = json.loads(Path(path).read_text())
        missing = {"key", "shapes", "times_us"} - set(data)
        if missing:
            raise ValueError(f"{path} is not a tune profile (missing {', '.join(sorted(missing))})")
        return cls(**{k: data[k] for k in ("key", "shapes", "times_us", "errors", "created", "layers_per_step")
                      if k in data})


def load_profile(
    spec: AttentionSpec, device: DeviceInfo, directory: "str | os.PathLike", facts: Mapping[str, Optional[str]]
) -> Optional[tuple[Path, Profile]]:
    """The stored profile for ``spec`` on ``device`` as this machine is now (``facts``: as
    :func:`environment_key` takes them), or None."""
    key = environment_key(spec, device, facts)
    path = profile_path(key, directory)
    if not path.is_file():
        return None
    profile = Profile.load(path)
    if profile.key != key:
        logger.warning("ignoring %s: its key does not match this machine and spec", path)
        return None
    return path, profile


@dataclass
class CandidateRow:
    name: str
    phase_us: dict[str, Optional[float]]  # geometric mean µs per phase
    score: Optional[float]
    status: str  # "chosen", "ranked", or why it is not ranked


@dataclass
class MeasuredChoice:
    """The ranking made from a profile: rows (best first, then unranked), the winner and why it won."""

    source: str
    rows: list[CandidateRow]
    ranking: list[str]
    why: str

    @property
    def winner(self) -> Optional[str]:
        return self.ranking[0] if self.ranking else None

    def render(self) -> str:
        """A plain-text table (the CLI draws its own with rich)."""
        head = ["candidate"] + [f"{p} µs" for p in PHASES] + ["score", "status"]
        body = [[r.name] + [_fmt(r.phase_us.get(p)) for p in PHASES] + [_fmt(r.score, 3), r.status] for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines = [f"measured ({self.source}):"]
        lines += ["  " + "  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [head] + body]
        lines.append(f"  {self.why}")
        return "\n".join(lines)


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def choose(
    profile: Profile, reasons: dict[str, list[str]], order: list[str], source: str = "profile"
) -> MeasuredChoice:
    """Rank the profile's candidates that fit (``reasons[name]`` empty) by score; ties go to ``order``'s earlier
    entry (compositions after single backends)."""
    labels = [s["label"] for s in profile.shapes]
    phase_of = {s["label"]: s["phase"] for s in profile.shapes}
    fitting, status = [], {}
    for name, times in profile.times_us.items():
        why_not = reasons.get(name)
        if why_not is None:
            status[name] = "not registered here"
        elif why_not:
            status[name] = "does not fit now: " + "; ".join(why_not)
        elif any(times.get(label) is None for label in labels):
            failed = [label for label in labels if times.get(label) is None]
            error = f" ({profile.errors[name]})" if name in profile.errors else ""
            status[name] = "not measured on " + ", ".join(failed) + error
        else:
            fitting.append(name)
    best = {label: min(profile.times_us[n][label] for n in fitting) for label in labels} if fitting else {}
    scores = {n: _geomean([profile.times_us[n][label] / best[label] for label in labels]) for n in fitting}
    rank_of = {n: i for i, n in enumerate(order)}
    ranked = {n: scores[n] * (1 + COMPOSITION_MARGIN) if is_phased_name(n) else scores[n] for n in fitting}
    ranking = sorted(fitting, key=lambda n: (round(ranked[n], 6), rank_of.get(n, len(order)), n))
    rows = []
    for name in ranking + sorted(set(profile.times_us) - set(ranking)):
        times = profile.times_us[name]
        phase_us = {}
        for phase in PHASES:
            vals = [times[label] for label in labels if phase_of[label] == phase and times.get(label) is not None]
            phase_us[phase] = _geomean(vals) if vals else None
        rows.append(CandidateRow(name, phase_us, scores.get(name), status.get(name, "ranked")))
    if rows and ranking:
        rows[0].status = "chosen"
    return MeasuredChoice(source=source, rows=rows, ranking=ranking, why=_why(ranking, scores, ranked, rows, labels))


def _why(ranking: list[str], scores: dict[str, float], ranked: dict[str, float], rows: list[CandidateRow],
         labels: list[str]) -> str:
    if not ranking:
        return "no measured candidate fits this spec here: the static priority list is used"
    winner = ranking[0]
    text = (f"{winner} won: score {scores[winner]:.3f} (geometric mean over {len(labels)} shapes of its time / the "
            f"fastest fitting candidate's; 1.000 = fastest on every shape)")
    passed_over = [n for n in ranking[1:] if scores[n] < scores[winner]]
    if passed_over:
        text += (f"; {', '.join(passed_over)} measured lower but, as a phase composition, ranks at its score "
                 f"x {1 + COMPOSITION_MARGIN:.2f} ({ranked[passed_over[0]]:.3f})")
    if len(ranking) > 1:
        runner = ranking[1]
        by_name = {r.name: r for r in rows}
        parts = []
        for phase in PHASES:
            a, b = by_name[winner].phase_us.get(phase), by_name[runner].phase_us.get(phase)
            if a is not None and b is not None:
                parts.append(f"{phase} {a:.1f} vs {b:.1f} µs")
        text += f"; next {runner} at {scores[runner]:.3f} ({', '.join(parts)})"
    return text


def measured_candidates(
    spec: AttentionSpec, device: DeviceInfo, config: AttentionConfig, order: list[str], by_name: dict[str, Any],
    explanation: Any, reasons_of: "Callable[[str, AttentionSpec, DeviceInfo], Optional[list[str]]]",
    facts: Mapping[str, Optional[str]],
) -> list[str]:
    """The candidates :func:`attnbackends.explain` walks under ``selection="measured"``: the profile's ranking, then
    the static order as fallback. Records the table and the reason in ``explanation`` (never silent).
    ``reasons_of(name, spec, device)`` gives a backend's reasons, None for a name the registry does not know;
    ``facts`` are the backends' environment facts (the registry passes them: this module names no backend)."""

    directory = default_profile_dir(config)
    found = load_profile(spec, device, directory, facts) if device.is_cuda else None
    if found is None:
        note = (f"selection=measured, but no stored profile for {device.describe()} and this spec in {directory} "
                "(run `attnbackends tune`): the static priority list was used")
        logger.warning(note)
        explanation.notes.append(note)
        return order
    path, profile = found
    reasons: dict[str, list[str]] = {}
    for name in profile.times_us:
        if name in by_name:
            reasons[name] = by_name[name].reasons
            continue
        found_reasons = reasons_of(name, spec, device)
        if found_reasons is not None:
            reasons[name] = found_reasons
    choice = choose(profile, reasons, order, source=str(path))
    explanation.measured = choice
    explanation.notes.append(f"selection=measured from {path}: {choice.why}")
    return choice.ranking + [n for n in order if n not in choice.ranking]
