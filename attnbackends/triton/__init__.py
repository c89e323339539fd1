"""Triton unified paged attention."""

from .backend import TritonImpl
from .lse_forward import forward_with_lse

# TritonImpl's capability data and method for context-parallel decode (see AttentionImpl.can_return_lse).
TritonImpl.can_return_lse = True
TritonImpl.forward_with_lse = forward_with_lse
