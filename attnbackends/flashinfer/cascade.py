"""When to use cascade (shared-prefix) attention: a pure-python heuristic, testable without a GPU.

Cascade attention splits a batch whose requests all start with the same pages into two levels: every query of the
batch attends to the shared prefix once (one pass over its pages, as a single "request" of many query rows), then
each request attends to its own remaining pages, and the two partial results are merged by their log-sum-exp.
In principle it pays when the shared prefix is long and many requests read it: the prefix is read once instead of
once per request. In practice FlashInfer's ``MultiLevelCascadeAttentionWrapper`` serves every level with its prefill
kernels (decodes included) and merges the levels, and on Hopper that measured slower than the plain decode and
prefill wrappers on every shared-prefix step tried, long prefixes included (``benchmarks/flashinfer_cascade.py``;
the numbers are in ``benchmarks/NOTES.md``). So the default policy is off; an engine
that measures a gain on its own traffic turns it on with ``CascadePolicy(enabled=True)``, and the thresholds below
then decide per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CascadePolicy", "cascade_prefix_blocks"]


@dataclass(frozen=True)
class CascadePolicy:
    """Thresholds of the cascade heuristic.

    Attributes
    ----------
    enabled : True lets the thresholds below turn cascade attention on; off by default (see the module docstring).
    min_requests : fewest requests sharing the prefix.
    min_shared_tokens : shortest shared prefix, in tokens (whole pages only).
    min_saved_fraction : the KV reads saved, ``(num_reqs - 1) * shared_tokens``, as a fraction of the batch's
        plain KV reads (``sum(seq_lens)``), must reach this.
    """

    enabled: bool = False
    min_requests: int = 8
    min_shared_tokens: int = 256
    min_saved_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.min_requests < 2:
            raise ValueError(f"min_requests must be >= 2 (cascade needs a prefix shared by requests), got {self.min_requests}")
        if self.min_shared_tokens < 1:
            raise ValueError(f"min_shared_tokens must be >= 1, got {self.min_shared_tokens}")
        if not 0.0 <= self.min_saved_fraction <= 1.0:
            raise ValueError(f"min_saved_fraction must be in [0, 1], got {self.min_saved_fraction}")


def cascade_prefix_blocks(
    policy: CascadePolicy,
    *,
    num_reqs: int,
    common_prefix_len: int,
    block_size: int,
    min_context_len: int,
    total_kv_tokens: int,
    sliding_window: Optional[int] = None,
    fp8_kv_cache: bool = False,
    cuda_graph: bool = False,
) -> int:
    """Pages of shared prefix to serve from the cascade's top level; 0 means "no cascade".

    Parameters
    ----------
    policy : the thresholds.
    num_reqs : requests in the batch (all of them share the prefix).
    common_prefix_len : tokens at the start of every request known to sit in the same pages (from the engine).
    block_size : tokens per page.
    min_context_len : the shortest cached context in the batch; the shared level must hold cached tokens only, so
        that no query needs a causal mask there and no new token is written into a shared page.
    total_kv_tokens : ``sum(seq_lens)``, the KV tokens a plain pass reads.
    sliding_window : cascade is off with a sliding window (the shared level has no per-query positions).
    fp8_kv_cache : cascade is off for fp8 caches (FlashInfer's cascade run takes no k/v scales).
    cuda_graph : cascade is off for batches replayed in a CUDA graph (those use the persistent decode plan).
    """
    if not policy.enabled or sliding_window is not None or fp8_kv_cache or cuda_graph:
        return 0
    if num_reqs < policy.min_requests or block_size <= 0:
        return 0
    shared_tokens = min(common_prefix_len, min_context_len)
    blocks = max(shared_tokens, 0) // block_size
    shared_tokens = blocks * block_size
    if blocks == 0 or shared_tokens < policy.min_shared_tokens:
        return 0
    saved = (num_reqs - 1) * shared_tokens
    if total_kv_tokens <= 0 or saved < policy.min_saved_fraction * total_kv_tokens:
        return 0
    return blocks
