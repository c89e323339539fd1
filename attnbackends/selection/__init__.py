"""Choosing a backend: the registry (names, plugins, priority lists, :func:`select`, :func:`explain`), phased
compositions (decodes on one backend, prefills on another), measured tuning with its stored profiles, and warm-up
(compiling what a spec needs ahead of the first step)."""

from .phased import PhasedMetadata, is_phased_name, parse_phased_name, phased_name
from .registry import (
    BackendNotSupportedError,
    Explanation,
    ExplanationRow,
    backend_names,
    explain,
    get_backend_class,
    phased_backend,
    priority_list,
    register_backend,
    select,
    unregister_backend,
)

__all__ = [
    "BackendNotSupportedError",
    "Explanation",
    "ExplanationRow",
    "PhasedMetadata",
    "backend_names",
    "explain",
    "get_backend_class",
    "is_phased_name",
    "parse_phased_name",
    "phased_backend",
    "phased_name",
    "priority_list",
    "register_backend",
    "select",
    "unregister_backend",
]
