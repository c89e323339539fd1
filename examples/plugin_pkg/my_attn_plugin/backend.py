"""``my_triton``: attnbackends' Triton backend, narrowed to the head sizes this plugin's owner tuned and validated,
with a counter of impl calls and tokens.

attnbackends imports this module only when ``my_triton`` is listed, explained or selected (the entry point names
``my_attn_plugin.backend:MyTritonBackend``), so a plugin costs nothing until it is used.
"""

from __future__ import annotations

from typing import ClassVar

from attnbackends.triton.backend import TritonAttentionBackend, TritonImpl

__all__ = ["MyTritonBackend", "MyTritonImpl"]


class MyTritonImpl(TritonImpl):
    """The Triton impl, counting forward calls and attended tokens on the backend class."""

    def forward(self, query, key, value, kv_cache, metadata, output):
        MyTritonBackend.calls += 1
        MyTritonBackend.tokens += metadata.common.num_actual_tokens
        return super().forward(query, key, value, kv_cache, metadata, output)


class MyTritonBackend(TritonAttentionBackend):
    """Triton unified attention for head sizes 64 and 128 only: selection explains the rest as unsupported."""

    name = "my_triton"
    description = "attnbackends' Triton kernels for head sizes 64 and 128, with call telemetry (example plugin)"
    supported_head_sizes = frozenset({64, 128})
    calls: ClassVar[int] = 0
    tokens: ClassVar[int] = 0

    @classmethod
    def get_impl_cls(cls) -> type[MyTritonImpl]:
        return MyTritonImpl
