"""Sliding-window groups read fewer pages: :func:`trim_to_window` drops the leading pages no query of the step can
see (attention depends on positions only through ``j - p``, and RoPE is applied before keys are cached, so the
output is exactly the same with a narrower block table)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from ..metadata import CommonAttentionMetadata

logger = logging.getLogger(__name__)


def window_pages_per_request(window: int, block_size: int, max_query_len: int) -> int:
    """The most pages a request of a ``window``-token sliding layer needs in one step of up to ``max_query_len``
    new tokens, after :func:`trim_to_window`: the window of the step's first query starts inside the first kept
    page, so at most ``window - 1 + block_size - 1`` context tokens plus the new ones remain."""
    return -(-(window + block_size + max_query_len - 2) // block_size)


def _dropped_pages(seq_lens: torch.Tensor, query_lens: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """[num_reqs] pages wholly before the window of each request's first new query (position = its context)."""
    first_visible = seq_lens - query_lens - (window - 1)
    return torch.div(first_visible.clamp(min=0), block_size, rounding_mode="floor")


def trim_to_window(
    common: CommonAttentionMetadata,
    window: int,
    block_size: int,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> CommonAttentionMetadata:
    """The batch as a sliding-window layer of ``window`` keys needs it, with the pages nobody sees dropped.

    For request r with context C (its first new query sits at position C) the keys visible to any of its queries
    are j >= C - window + 1, so its first ``k_r = max(0, C - window + 1) // block_size`` pages are wholly outside
    every query's window. The result keeps everything else and changes:

    - ``block_table[r]`` starts at the request's page ``k_r`` (row r = old row r shifted left by ``k_r``);
    - ``seq_lens[r]`` becomes ``seq_len - k_r * block_size`` (so positions shift down by the same amount; the
      window, the causal mask and ALiBi see only distances, RoPE is already in the cached keys, so outputs are
      unchanged);
    - ``max_seq_len`` and the host copies follow; ``query_start_loc``, ``slot_mapping`` (physical slots) and
      ``causal`` are untouched;
    - ``common_prefix_len`` becomes 0 once any page is dropped: requests drop different numbers of pages, so their
      trimmed tables no longer start with the same pages.

    The new table is ``min(old width, needed)`` pages wide (needed: the longest trimmed request), and columns past
    a request's pages repeat its last entries (in range; no backend reads them). The device part is a few torch
    ops on the device tensors (no host-device sync); the host copies are computed on the host.

    Parameters
    ----------
    out : persistent (seq_lens [>= num_reqs] int32, block_table [>= num_reqs, width] int32) device buffers to
        write into (CUDA graphs replay on fixed addresses); the table then has the buffer's width, which must be
        at least :func:`window_pages_per_request` of the batch's ``max_query_len``.
    """
    if window <= 0 or block_size <= 0:
        raise ValueError(f"window ({window}) and block_size ({block_size}) must be positive")
    n = common.num_reqs
    qsl_cpu = common.query_start_loc_cpu
    drop_cpu = _dropped_pages(common.seq_lens_cpu[:n], qsl_cpu[1:] - qsl_cpu[:-1], window, block_size)
    seq_lens_cpu = (common.seq_lens_cpu[:n] - drop_cpu * block_size).to(torch.int32)
    old_width = common.block_table.shape[1]
    needed = int((seq_lens_cpu + block_size - 1).div(block_size, rounding_mode="floor").max()) if n else 0
    if out is not None:
        seq_buf, table_buf = out
        width = table_buf.shape[1]
        if width < needed:
            raise ValueError(f"the trim buffer holds {width} pages per request; this batch needs {needed}")
    else:
        width = max(1, min(old_width, needed))
    qsl = common.query_start_loc
    drop = _dropped_pages(common.seq_lens[:n], qsl[1 : n + 1] - qsl[:n], window, block_size)
    columns = torch.arange(width, device=drop.device, dtype=torch.int64)
    index = (drop.long()[:, None] + columns[None, :]).clamp_(max=old_width - 1)  # [n, width]
    if out is not None:
        seq_lens = torch.sub(common.seq_lens[:n], drop * block_size, out=seq_buf[:n])
        block_table = torch.gather(common.block_table[:n], 1, index, out=table_buf[:n])
    else:
        seq_lens = (common.seq_lens[:n] - drop * block_size).to(torch.int32)
        block_table = torch.gather(common.block_table[:n], 1, index)
    table_cpu = None
    if common.block_table_cpu is not None:
        index_cpu = (drop_cpu.long()[:, None] + torch.arange(width)[None, :]).clamp_(max=old_width - 1)
        table_cpu = torch.gather(common.block_table_cpu[:n], 1, index_cpu)
    return dataclasses.replace(
        common,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        block_table=block_table,
        block_table_cpu=table_cpu,
        max_seq_len=int(seq_lens_cpu.max()) if n else 0,
        common_prefix_len=common.common_prefix_len if not bool(drop_cpu.any()) else 0,
    )
