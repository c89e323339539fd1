"""Capturing one forward into a CUDA graph, as the graph tests do it."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["capture_forward"]


def capture_forward(forward: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """Run ``forward`` once on a side stream (it compiles and validates there, outside any capture), then capture
    a second call into a CUDA graph and return it; ``forward`` must read and write only tensors that stay alive
    and in place across replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph
