"""The machine a backend would run on, as plain data, so selection for any GPU can be tested on a CPU."""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DeviceInfo", "check_device_available", "is_triton_interpreted", "package_available"]


def package_available(name: str) -> bool:
    """Whether an installed package ``name`` can be imported (without importing it).

    A bare directory of that name on sys.path (a namespace package, e.g. a ``tests/flashinfer`` folder) does not
    count as an installation.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    return not (spec.origin in (None, "namespace") and spec.submodule_search_locations is not None)


def check_device_available(device: "torch.device | str", name: str = "device") -> torch.device:
    """``device`` as a torch.device; ValueError naming ``name`` when it cannot hold tensors on this machine (CUDA
    asked for where torch has no CUDA or sees no GPU, a GPU index past the last one, the meta device)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}={device!r} is not a device; allowed: 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{name}={str(dev)!r} was requested but {why}; use {name}='cpu' on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "meta":
        raise ValueError(f"{name}='meta' holds no data; allowed: 'cpu', 'cuda' or 'cuda:N'")
    elif dev.type != "cpu":
        raise ValueError(f"{name}={str(dev)!r} is not supported; allowed: 'cpu', 'cuda' or 'cuda:N'")
    return dev


class DeviceInfo(BaseModel):
    """A device as the registry sees it.

    Build one by hand (``DeviceInfo.cuda(9, 0)``, ``DeviceInfo.cpu()``) to ask what would be selected on another
    machine, or read the current one with :meth:`current`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["cpu", "cuda"]
    compute_capability: Optional[tuple[int, int]] = None
    sm_count: int = Field(default=0, ge=0)
    triton_interpreted: bool = False
    name: str = ""
    index: int = 0

    @model_validator(mode="after")
    def _check(self) -> "DeviceInfo":
        if self.kind == "cuda" and self.compute_capability is None:
            raise ValueError("compute_capability is required for a cuda device, e.g. (9, 0)")
        if self.kind == "cpu" and self.compute_capability is not None:
            raise ValueError("compute_capability must be None for a cpu device")
        return self

    @classmethod
    def cpu(cls, triton_interpreted: Optional[bool] = None) -> "DeviceInfo":
        interpreted = is_triton_interpreted() if triton_interpreted is None else triton_interpreted
        return cls(kind="cpu", triton_interpreted=interpreted, name="cpu")

    @classmethod
    def cuda(cls, major: int, minor: int = 0, sm_count: int = 132, name: str = "") -> "DeviceInfo":
        return cls(kind="cuda", compute_capability=(major, minor), sm_count=sm_count, name=name or f"sm_{major}{minor}")

    @classmethod
    def current(cls, device: "torch.device | str | None" = None) -> "DeviceInfo":
        """The device ``device`` (default: CUDA device 0 where CUDA is available, else the CPU); ValueError naming
        ``device`` when this machine has no such device (see :func:`check_device_available`)."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = check_device_available(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return _cuda_info(index)
        return cls.cpu()

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.is_cuda else torch.device("cpu")

    @property
    def runs_triton(self) -> bool:
        """Triton kernels can run here: natively on CUDA, or under TRITON_INTERPRET=1 on the CPU."""
        return self.is_cuda or self.triton_interpreted

    def describe(self) -> str:
        if self.is_cuda:
            major, minor = self.compute_capability
            sms = f", {self.sm_count} SMs" if self.sm_count else ""
            return f"cuda {self.name} (compute capability {major}.{minor}{sms})"
        return "cpu" + (" (Triton interpreted)" if self.triton_interpreted else "")


@lru_cache(maxsize=None)
def is_triton_interpreted() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET`` set to a true value).

    Triton reads the variable when ``triton.jit`` decorates a kernel, that is when a kernel module is imported;
    set it before that. Read once and cached, so that hot paths can ask for free.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


@lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        kind="cuda",
        compute_capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        name=props.name,
        index=index,
    )
