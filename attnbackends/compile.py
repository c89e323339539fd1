"""torch.compile support: attention as a torch.library custom op, so a model compiles with ``fullgraph=True``.

The op takes the layer's name instead of the impl object (custom ops take tensors and plain values); the batch's
metadata reaches it through :func:`forward_context`, set once per step by the engine, as in vLLM::

    layers = [AttentionLayer(f"layer{i}", impl, kv_cache) for i, (impl, kv_cache) in ...]
    compiled = torch.compile(model, fullgraph=True)
    with forward_context(builder.build(common)):
        logits = compiled(tokens, positions)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch

from .interface import AttentionImplBase

__all__ = ["AttentionLayer", "forward_context", "current_metadata"]

_LAYERS: "weakref.WeakValueDictionary[str, AttentionLayer]" = weakref.WeakValueDictionary()
_metadata_stack: list[Any] = []


@contextlib.contextmanager
def forward_context(metadata: Any) -> Iterator[None]:
    """Make ``metadata`` (a backend's built metadata) the one every :class:`AttentionLayer` uses in this block."""
    _metadata_stack.append(metadata)
    try:
        yield
    finally:
        _metadata_stack.pop()


def current_metadata() -> Any:
    if not _metadata_stack:
        raise RuntimeError("no attention metadata: run the model inside `with forward_context(metadata):`")
    return _metadata_stack[-1]


@torch.library.custom_op("attnbackends::attention", mutates_args=("output",))
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    layer = _LAYERS.get(layer_name)
    if layer is None:
        raise ValueError(f"no AttentionLayer named {layer_name!r} is alive")
    layer.impl.forward(query, key, value, layer.kv_cache, current_metadata(), output)


@_attention_op.register_fake
def _attention_op_fake(query, key, value, output, layer_name) -> None:
    return None


class AttentionLayer(torch.nn.Module):
    """One attention layer: an impl and its KV cache behind the ``attnbackends::attention`` custom op.

    forward(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, Dv]) -> [T, Hq, Dv]
    """

    def __init__(self, name: str, impl: AttentionImplBase, kv_cache: Optional[torch.Tensor]) -> None:
        super().__init__()
        if name in _LAYERS:
            raise ValueError(f"an AttentionLayer named {name!r} already exists; layer names must be unique")
        self.layer_name = name
        self.impl = impl
        self.kv_cache = kv_cache
        _LAYERS[name] = self

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        spec = self.impl.spec
        output = torch.empty(
            (query.shape[0], spec.num_heads, spec.value_head_size), dtype=query.dtype, device=query.device
        )
        torch.ops.attnbackends.attention(query, key, value, output, self.layer_name)
        return output
