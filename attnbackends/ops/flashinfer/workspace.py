"""FlashInfer's float workspace: one size and one shared buffer per device.

The float workspace holds split-KV partial results while a wrapper runs; wrappers that run one after another on
a stream can share it (their plans live in their own integer workspaces).
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_WORKSPACE_BYTES", "shared_workspace"]

#: FlashInfer's recommended float workspace size.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024

_SHARED: dict[torch.device, torch.Tensor] = {}


def shared_workspace(device: "torch.device | str") -> torch.Tensor:
    """The device's shared float workspace ([DEFAULT_WORKSPACE_BYTES] uint8), allocated on first use."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _SHARED.get(device)
    if buffer is None:
        buffer = _SHARED[device] = torch.zeros(DEFAULT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return buffer
