"""Backend registry: names mapped lazily to classes, per-platform priority lists, selection and its explanation.

A backend is registered as ``name -> "module:Class"`` (imported only when needed), by the
:func:`register_backend` decorator, or by a third-party package through the ``attnbackends.backends`` entry-point
group. :func:`select` returns the first backend of the platform's priority list whose ``not_supported_reasons`` is
empty; an explicit choice (``AttentionConfig.backend`` or ``ATTNBACKENDS_BACKEND``) is validated and never replaced.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Optional, Sequence, Union

from ..interface import AttentionBackend, CudaGraphSupport
from ..platform import DeviceInfo
from ..spec import BACKEND_ENV_VAR, AttentionConfig, AttentionSpec
from .phased import (
    PhasedBackend,
    compose_phased,
    is_phased_name,
    parse_phased_name,
    phased_name,
)
from .tuning import measured_candidates

__all__ = [
    "BackendNotSupportedError",
    "CUDAGRAPH_SUPPORT_TEXT",
    "Explanation",
    "ENTRY_POINT_GROUP",
    "backend_names",
    "cudagraph_support_text",
    "environment_facts",
    "explain",
    "get_backend_class",
    "phased_backend",
    "priority_list",
    "NATIVE_FP4_MIN_COMPUTE_CAPABILITY",
    "has_native_fp4",
    "kv_format_notes",
    "register_backend",
    "resolve_backend",
    "select",
    "unregister_backend",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "attnbackends.backends"

_Target = Union[str, type[AttentionBackend]]

# Built-in backends, imported on first use.
_REGISTRY: dict[str, _Target] = {
    "reference": "attnbackends.reference.backend:ReferenceBackend",
    "reference_mla": "attnbackends.reference.mla:ReferenceMLABackend",
    "triton": "attnbackends.triton.backend:TritonAttentionBackend",
    "flashinfer": "attnbackends.flashinfer.backend:FlashInferBackend",
    "flash_attn": "attnbackends.flash_attn.backend:FlashAttnBackend",
    "triton_mla": "attnbackends.mla.backends:TritonMLABackend",
    "flashinfer_mla": "attnbackends.mla.backends:FlashInferMLABackend",
    "reference_mla_sparse": "attnbackends.reference.sparse_mla:ReferenceSparseMLABackend",
    "triton_mla_sparse": "attnbackends.mla.sparse.backend:TritonSparseMLABackend",
}

# Auto-selection order per (platform, MLA?) without a measured profile: first the backend measured fastest on the
# platform that also compiles in seconds on a fresh host (Triton JITs a kernel in seconds; FlashInfer builds a
# module per shape in tens of seconds), so a first run starts at once. FlashInfer and flash-attn come next: a
# profile (`attnbackends tune`), the config, or a spec only they serve chooses them. The reference backend ends
# the CUDA lists: it is slow but correct, and is chosen there (with a warning) only when no fast backend fits.
_PRIORITIES: dict[tuple[str, bool], list[str]] = {
    ("cuda", False): ["triton", "flashinfer", "flash_attn", "reference"],
    ("cuda", True): ["triton_mla", "flashinfer_mla", "reference_mla"],
    ("cpu", False): ["reference"],
    ("cpu", True): ["reference_mla"],
}

#: Why each built-in list starts where it does: the note :func:`explain` adds when the static list chose.
_PRIORITY_REASONS: dict[tuple[str, bool], str] = {
    ("cuda", False): (
        "no measured profile: the static CUDA list puts triton first, measured at or above FlashInfer on this "
        "platform's decode, prefill and mixed rows (benchmarks/RESULTS.md) and compiled in seconds on first "
        "use (FlashInfer builds a module per shape in tens of seconds); flashinfer and flash_attn are chosen by a profile (`attnbackends "
        "tune`, selection=measured), by config (backend=...), or where only they serve the spec"),
    ("cuda", True): (
        "no measured profile: the static CUDA MLA list puts triton_mla first, measured faster than flashinfer_mla "
        "on the MLA rows (benchmarks/RESULTS.md) and compiled in seconds on first use; flashinfer_mla is chosen by "
        "a profile, by config, or where only it serves the spec"),
}

# Sparse MLA specs (spec.sparse_indexer, DeepSeek V3.2) have their own lists: the dense MLA backends decline them.
_SPARSE_MLA_PRIORITIES: dict[str, list[str]] = {
    "cuda": ["triton_mla_sparse", "reference_mla_sparse"],
    "cpu": ["reference_mla_sparse"],
}

_entry_points_loaded = False

#: Compute capabilities whose tensor cores take FP4 (e2m1) operands natively: Blackwell (sm_100) and later. A
#: kernel that reads NVFP4 pages without dequantising registers for these (``min_compute_capability``); before it
#: the ``triton`` backend dequantises them (correct on every GPU it runs on, not fast).
NATIVE_FP4_MIN_COMPUTE_CAPABILITY = (10, 0)


def has_native_fp4(device: DeviceInfo) -> bool:
    """Whether ``device`` is a GPU with native FP4 tensor-core operands (:data:`NATIVE_FP4_MIN_COMPUTE_CAPABILITY`)."""
    return bool(device.is_cuda and device.compute_capability is not None
                and tuple(device.compute_capability) >= NATIVE_FP4_MIN_COMPUTE_CAPABILITY)


def kv_format_notes(spec: AttentionSpec, device: DeviceInfo) -> list[str]:
    """What :func:`explain` says about a cache format beyond the backends' reasons (NVFP4: native FP4 or not)."""
    if spec.kv_cache_dtype != "nvfp4" or not device.is_cuda:
        return []
    cc = ".".join(map(str, device.compute_capability or ()))
    if has_native_fp4(device):
        return [f"nvfp4 pages: this GPU (sm {cc}) has native FP4 tensor cores; no native-FP4 kernel is registered "
                "yet, so the pages are dequantised in the kernel"]
    return [f"nvfp4 pages: no native FP4 on this GPU (sm {cc} < "
            f"{'.'.join(map(str, NATIVE_FP4_MIN_COMPUTE_CAPABILITY))}): the pages are dequantised in the kernel"]


class BackendNotSupportedError(ValueError):
    """No backend (or not the one asked for) can serve the spec on the device; ``explanation`` says why."""

    def __init__(self, message: str, explanation: "Explanation") -> None:
        super().__init__(f"{message}\n{explanation}")
        self.explanation = explanation


@dataclass
class ExplanationRow:
    name: str
    reasons: list[str]
    rank: Optional[int]  # position in the priority list that was walked, None if not in it
    chosen: bool = False
    cudagraph: Optional[CudaGraphSupport] = None  # the backend's declared CUDA-graph support


@dataclass
class Explanation:
    """Why each registered backend was or was not chosen for a spec on a device."""

    spec: AttentionSpec
    device: DeviceInfo
    rows: list[ExplanationRow] = field(default_factory=list)
    chosen: Optional[str] = None
    requested: str = "auto"
    notes: list[str] = field(default_factory=list)  # how the choice was made, when not by the static list alone
    measured: Optional[Any] = None  # the measured table (attnbackends.selection.tuning.MeasuredChoice) behind the choice

    def as_table(self) -> list[tuple[str, str, str]]:
        """Rows of (backend, status, reasons) in priority order, then the backends outside the list."""
        out = []
        for row in sorted(self.rows, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.name)):
            if row.chosen:
                status = "chosen"
            elif row.reasons:
                status = "rejected"
            elif self.requested != "auto":
                status = "fits (not requested)"
            elif row.rank is None:
                status = "fits (not in priority list)"
            else:
                status = "fits (lower priority)"
            out.append((row.name, status, "; ".join(row.reasons) or "-"))
        return out

    def __str__(self) -> str:
        head = f"device: {self.device.describe()}; backend requested: {self.requested}; chosen: {self.chosen or 'none'}"
        width = max((len(r[0]) for r in self.as_table()), default=8)
        lines = [head] + [f"  {n:<{width}}  {s:<9}  {why}" for n, s, why in self.as_table()]
        lines += [f"note: {note}" for note in self.notes]
        graphs = [f"{r.name}: {cudagraph_support_text(r.cudagraph)}" for r in self.rows if r.cudagraph is not None]
        if graphs:
            lines.append("CUDA graphs: " + "; ".join(graphs))
        if self.measured is not None:
            lines.append(self.measured.render())
        return "\n".join(lines)


def register_backend(
    name: Optional[str] = None, *, select_before: "str | Sequence[str] | None" = None, replace: bool = False
) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator that registers a backend under ``name`` and sets the class's ``name`` to it.

    name : the registered name (lower-cased); default: the ``name`` the class itself defines. A class that defines
        no ``name`` of its own (it would keep its parent's) needs one here; a class whose own ``name`` differs from
        the one given is refused.
    select_before : a backend name, or several: join every auto-selection list that holds one of them, right
        before the first of them in that list. The lists are per device class and kind of layer (CUDA:
        triton, flashinfer, flash_attn, reference; CPU: reference; MLA: their own), so ``"triton"`` joins the CUDA
        list only, and ``("triton", "reference")`` the CUDA list before triton and the CPU list before reference.
        By default a registered backend is chosen only explicitly or through ``AttentionConfig.priority``.
    replace : allow replacing an existing registration of the same name.

    All or nothing: every argument is checked before anything changes, so a refused registration leaves the
    registry, the priority lists and the class as they were.
    """

    def decorate(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"register_backend expects an AttentionBackend subclass, got {cls!r}")
        own_name = cls.__dict__.get("name")
        if name is None and not own_name:
            inherited = getattr(cls, "name", None)
            why = f"it would keep its parent's name {inherited!r}" if inherited else "it has none"
            raise ValueError(f"{cls.__name__} defines no name of its own ({why}): set the class attribute `name` "
                             "or pass register_backend(name)")
        key = (name if name is not None else own_name).strip().lower()
        if not key:
            raise ValueError(f"register_backend(name) must be a non-empty name, got {name!r}")
        if key in _REGISTRY and not replace and _REGISTRY[key] is not cls:
            raise ValueError(f"a backend named {key!r} is already registered; pass replace=True to override it")
        if own_name and own_name.lower() != key:
            raise ValueError(f"{cls.__name__}.name is {own_name!r} but register_backend was given {name!r}: "
                             "use one name (or drop one of them)")
        before = (select_before,) if isinstance(select_before, str) else tuple(select_before or ())
        if key in before:
            raise ValueError(f"select_before={select_before!r} names the backend being registered")
        lists = [order for order in _PRIORITIES.values() if any(n in order for n in before)]
        if before and not lists:
            raise ValueError(f"select_before={select_before!r} is in no priority list; known: {backend_names()}")
        cls.name = key
        _REGISTRY[key] = cls
        for order in lists:
            if key in order:
                order.remove(key)
            order.insert(min(order.index(n) for n in before if n in order), key)
        return cls

    return decorate


def unregister_backend(name: str) -> None:
    """Remove a registration (and its place in the priority lists)."""
    _REGISTRY.pop(name, None)
    for order in _PRIORITIES.values():
        if name in order:
            order.remove(name)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = ep.name.lower()
        if key in _REGISTRY:
            logger.warning("entry point %s=%s ignored: the name is already registered", ep.name, ep.value)
            continue
        _REGISTRY[key] = ep.value


def backend_names() -> list[str]:
    """Every registered backend name (built-in, decorated and entry points)."""
    _load_entry_points()
    return sorted(_REGISTRY)


def _import(target: str) -> type[AttentionBackend]:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{target} is not an AttentionBackend subclass")
    return cls


def resolve_backend(name: str) -> tuple[Optional[type[AttentionBackend]], list[str]]:
    """The class registered as ``name``, or None with the reason it cannot be loaded."""
    target = _REGISTRY[name]
    if not isinstance(target, str):
        return target, []
    try:
        cls = _import(target)
    except ModuleNotFoundError as exc:
        module_name = target.partition(":")[0]
        ours = module_name.startswith("attnbackends.")
        if ours and exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return None, [f"not available in this version of attnbackends ({module_name} is missing)"]
        return None, [f"cannot be imported: {exc}"]
    except Exception as exc:  # a broken plugin must not break selection of the others
        return None, [f"cannot be imported: {type(exc).__name__}: {exc}"]
    _REGISTRY[name] = cls
    return cls, []


def environment_facts() -> dict[str, Optional[str]]:
    """What the registered backends report about the libraries they run on (each one's
    :meth:`AttentionBackend.environment_facts`, merged: ``{"flashinfer": "0.6.13", "flash_attn": None, ...}``); a
    backend that cannot be imported reports nothing. A tune profile's key holds them
    (:func:`attnbackends.selection.tuning.environment_key`)."""
    _load_entry_points()
    facts: dict[str, Optional[str]] = {}
    for name in sorted(_REGISTRY):
        cls, _ = resolve_backend(name)
        if cls is not None:
            facts.update(cls.environment_facts())
    return facts


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``; ValueError if unknown or not importable."""
    _load_entry_points()
    key = name.lower()
    if is_phased_name(key):
        return phased_backend(*parse_phased_name(key))
    if key not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(backend_names())}")
    cls, reasons = resolve_backend(key)
    if cls is None:
        raise ValueError(f"backend {name!r} {reasons[0]}")
    return cls


@lru_cache(maxsize=None)
def phased_backend(decode: str, prefill: str) -> type[PhasedBackend]:
    """The composition running decodes on backend ``decode`` and the rest on ``prefill`` (registered names).

    Raises ValueError for unknown names, a composition as a part, or ``decode == prefill`` (use that backend).
    """
    if decode == prefill:
        raise ValueError(f"decode and prefill are both {decode!r}: use that backend itself, not a composition")
    if is_phased_name(decode) or is_phased_name(prefill):
        raise ValueError("the parts of a phased backend must be plain backends, not compositions")
    return compose_phased(get_backend_class(decode), get_backend_class(prefill))


def priority_list(device: DeviceInfo, spec: AttentionSpec) -> list[str]:
    """The platform's auto-selection order for this kind of spec."""
    if spec.is_sparse_mla:
        return list(_SPARSE_MLA_PRIORITIES[device.kind])
    return list(_PRIORITIES[(device.kind, spec.is_mla)])


def _reasons(name: str, spec: AttentionSpec, device: DeviceInfo) -> tuple[Optional[type[AttentionBackend]], list[str]]:
    cls, reasons = resolve_backend(name)
    if cls is None:
        return None, reasons
    return cls, cls.not_supported_reasons(spec, device)


def explain(
    spec: AttentionSpec, device: Optional[DeviceInfo] = None, config: Optional[AttentionConfig] = None
) -> Explanation:
    """Every registered backend with its reasons, and which one :func:`select` would return (never raises)."""
    _load_entry_points()
    device = device or DeviceInfo.current()
    config = AttentionConfig.from_env(config)
    order = list(config.priority) if config.priority else priority_list(device, spec)
    unknown = [n for n in order if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"priority names unknown backends {unknown}; registered: {', '.join(backend_names())}")
    phased = config.backend == "auto" and (config.decode_backend or config.prefill_backend)
    requested = phased_name(config.decode_backend or "auto", config.prefill_backend or "auto") if phased else config.backend
    result = Explanation(spec=spec, device=device, requested=requested)
    for name in sorted(_REGISTRY):
        _, reasons = _reasons(name, spec, device)
        rank = order.index(name) if name in order else None
        result.rows.append(ExplanationRow(name=name, reasons=reasons, rank=rank))
    by_name = {row.name: row for row in result.rows}
    if config.backend != "auto":
        if config.backend not in _REGISTRY and not is_phased_name(config.backend):
            from_env = os.environ.get(BACKEND_ENV_VAR, "").strip().lower() == config.backend
            source = f" (from the environment variable {BACKEND_ENV_VAR})" if from_env else ""
            raise ValueError(f"unknown backend {config.backend!r}{source}; registered: {', '.join(backend_names())}")
        candidates = [config.backend]
    elif phased:
        candidates = [_phase_choice(config, order, by_name)]
    elif config.selection == "measured":
        candidates = measured_candidates(spec, device, config, order, by_name, result, _reasons_of_any,
                                         environment_facts())
    else:
        candidates = order
    static = config.backend == "auto" and not phased and not config.priority and not result.measured
    for name in candidates:
        if name not in by_name:  # a composition: one more row, with both parts' reasons
            by_name[name] = ExplanationRow(name=name, reasons=get_backend_class(name).not_supported_reasons(spec, device),
                                           rank=None)
            result.rows.append(by_name[name])
        if not by_name[name].reasons:
            by_name[name].chosen = True
            result.chosen = name
            reason_key = (device.kind, spec.is_mla)
            if static and name == order[0] and not spec.is_sparse_mla and reason_key in _PRIORITY_REASONS:
                result.notes.insert(0, _PRIORITY_REASONS[reason_key])
            if name in _REGISTRY:
                result.notes += [f"{name}: {note}" for note in _REGISTRY[name].kernel_notes(spec, device)]
            break
    for row in result.rows:
        row.cudagraph = _cudagraph_support(row.name)
    result.notes += kv_format_notes(spec, device)
    return result


#: Each CUDA-graph support level in words (explain's CUDA-graph line and the CLI's column).
CUDAGRAPH_SUPPORT_TEXT = {
    CudaGraphSupport.NEVER: "none (every step eager)",
    CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE: "single-token decode steps",
    CudaGraphSupport.UNIFORM_BATCH: "steps whose requests share one query length",
    CudaGraphSupport.ALWAYS: "any step, mixed prefills and decodes included",
}


def cudagraph_support_text(level: CudaGraphSupport) -> str:
    """``level`` in words, with its enum name."""
    return f"{CUDAGRAPH_SUPPORT_TEXT[level]} ({level.name})"


def _cudagraph_support(name: str) -> Optional[CudaGraphSupport]:
    """The CUDA-graph support ``name``'s class declares (None when it cannot be loaded)."""
    try:
        return get_backend_class(name).cudagraph_support
    except ValueError:
        return None


def _reasons_of_any(name: str, spec: AttentionSpec, device: DeviceInfo) -> Optional[list[str]]:
    """Why ``name`` (a backend or a composition) cannot serve ``spec``; None when no such backend exists."""
    try:
        return get_backend_class(name).not_supported_reasons(spec, device)
    except ValueError:
        return None


def _phase_choice(config: AttentionConfig, order: list[str], by_name: dict[str, ExplanationRow]) -> str:
    """The backend named by decode_backend / prefill_backend; a phase left unset takes the first fitting backend of
    ``order``. One backend for both phases is that backend itself."""
    fallback = next((n for n in order if not by_name[n].reasons), order[0] if order else "reference")
    decode, prefill = config.decode_backend or fallback, config.prefill_backend or fallback
    for name in (decode, prefill):
        if name not in _REGISTRY:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(backend_names())}")
    return decode if decode == prefill else phased_name(decode, prefill)


def select(
    spec: AttentionSpec, device: Optional[DeviceInfo] = None, config: Optional[AttentionConfig] = None
) -> type[AttentionBackend]:
    """The backend class for ``spec`` on ``device`` (default: the current device).

    Raises
    ------
    BackendNotSupportedError
        when the explicitly requested backend does not fit (with its reasons), or when none on the priority list
        does (with every backend's reasons).
    ValueError
        when the requested backend name is unknown.
    """
    result = explain(spec, device, config)
    if result.chosen is None:
        if result.requested != "auto":
            raise BackendNotSupportedError(
                f"the requested backend {result.requested!r} cannot serve this spec", result
            )
        raise BackendNotSupportedError("no registered backend can serve this spec", result)
    cls = get_backend_class(result.chosen)
    if result.requested == "auto" and cls.name in ("reference", "reference_mla", "reference_mla_sparse") and result.device.is_cuda:
        logger.warning("no fast backend fits this spec on %s; using the slow reference backend:\n%s", result.device.describe(), result)
    return cls
