"""Prefills over a cache with page scales on the 16-bit prefill kernels: the builder's plan of the pages a batch's
prefills read, and the scratch they are dequantised into.

For a batch whose prefills (requests ``first_seq`` onwards) run this way, :meth:`TritonMetadataBuilder.build
<attnbackends.triton.backend.TritonMetadataBuilder.build>` collects, from host data only, the pages those requests
read (each request's first ``ceil(seq_len / block_size)`` block-table entries), numbers them 0 .. P - 1 in page
order (a page two requests share is dequantised once) and rewrites the requests' block-table rows in those numbers
(:func:`collect_prefill_pages`, numpy, no loop over requests or pages). Each layer's forward then writes the step's
keys and values into its quantised cache, dequantises the P pages into the builder's scratch
(:mod:`.kv_dequant`: ``[P, 2, block_size, num_kv_heads, head_size]`` in the model's dtype, the layout of a 16-bit
cache) and runs the prefill kernel over the scratch and the rewritten table: the prefills see exactly the values a
decode reads. The decodes of the batch read the quantised cache on the unified kernel.

The scratch (:class:`DequantScratch`) is one per builder, shared by its layers (each layer's forward overwrites it
on the forward's stream), grown on demand up to ``max_pages``; a batch needing more pages runs its prefills on the
unified kernel over the quantised cache, as do batches captured in a CUDA graph (their plan is fixed by the
shape alone: :meth:`~attnbackends.triton.backend.TritonMetadataBuilder.build_for_cudagraph_capture`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..ops.launch_math import cdiv
from .kv_dequant import DequantConfig

__all__ = ["DEQUANT_DEFAULT_TOKENS", "DequantPagesPlan", "DequantScratch", "PrefillPages", "collect_prefill_pages",
           "default_max_pages", "plan_dequant_pages"]

#: Tokens the default scratch holds (a builder's ``dequant_prefill_max_pages`` is this many tokens' pages).
DEQUANT_DEFAULT_TOKENS = 256 * 1024


def default_max_pages(block_size: int) -> int:
    """The scratch's default bound in pages of ``block_size`` tokens: :data:`DEQUANT_DEFAULT_TOKENS` tokens."""
    return cdiv(DEQUANT_DEFAULT_TOKENS, block_size)


class PrefillPages(NamedTuple):
    """The pages the prefills of a batch read, on the host.

    pages : [P] int32, the pages' ids in the cache, ascending (each once).
    block_table : [num_prefills, W] int32, the prefills' block-table rows in compact ids (entry j of row i is the
        position in ``pages`` of the request's j-th page; 0 past its ``ceil(seq_len / block_size)`` pages), W the
        most pages one of them reads (at least 1).
    """

    pages: np.ndarray
    block_table: np.ndarray


def collect_prefill_pages(block_table: np.ndarray, seq_lens: np.ndarray, first_seq: int, num_seqs: int,
                          block_size: int) -> PrefillPages:
    """The pages requests ``first_seq`` .. ``num_seqs - 1`` read and their rewritten rows (:class:`PrefillPages`).

    block_table : [>= num_seqs, max_blocks] integer page ids (entries past a request's pages may hold anything);
    seq_lens : [>= num_seqs] integer, cached plus new tokens of each request.
    """
    lens = np.asarray(seq_lens[first_seq:num_seqs], dtype=np.int64)
    counts = (lens + block_size - 1) // block_size  # [R] pages each request reads
    width = max(int(counts.max(initial=0)), 1)
    if width > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns; a request of seq_len "
                         f"{int(lens.max())} reads {width} pages")
    rows = np.asarray(block_table[first_seq:num_seqs, :width])  # [R, W]
    read = np.arange(width)[None, :] < counts[:, None]  # [R, W] the entries the requests read
    used = rows[read].astype(np.int64)
    if used.size and used.min() < 0:
        raise ValueError(f"block_table holds page id {int(used.min())} within a request's pages")
    top = int(used.max(initial=-1)) + 1
    hit = np.zeros(top, dtype=bool)
    hit[used] = True
    pages = np.flatnonzero(hit).astype(np.int32)  # [P] ascending, each once
    compact = np.zeros(top, dtype=np.int32)
    compact[pages] = np.arange(pages.size, dtype=np.int32)
    table = np.zeros(rows.shape, dtype=np.int32)
    table[read] = compact[used]
    return PrefillPages(pages, table)


class DequantScratch:
    """A builder's 16-bit page scratch: ``[capacity, 2, block_size, num_kv_heads, head_size]`` in ``dtype`` on
    ``device``, grown on demand (doubling, up to ``max_pages``); its views stay valid after it grows (a plan made
    before holds the old memory)."""

    def __init__(self, max_pages: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_pages = max_pages
        self._page_shape = (2, block_size, num_kv_heads, head_size)
        self._dtype, self._device = dtype, device
        self._pages: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        """Pages allocated now."""
        return 0 if self._pages is None else self._pages.shape[0]

    def view(self, num_pages: int) -> Optional[torch.Tensor]:
        """[num_pages, 2, block_size, num_kv_heads, head_size], the scratch's first pages; None above
        ``max_pages``."""
        if num_pages > self.max_pages:
            return None
        if num_pages > self.capacity:
            size = min(self.max_pages, max(num_pages, 2 * self.capacity))
            self._pages = torch.empty((size, *self._page_shape), dtype=self._dtype, device=self._device)
        return self._pages[:num_pages]


@dataclass(frozen=True)
class DequantPagesPlan:
    """One batch's page dequantisation (the ``DEQUANT_PAGES`` launch) and what the prefill kernel then reads.

    Attributes
    ----------
    config : the dequantisation kernel's launch config (:func:`.kv_dequant.dequant_config`).
    pages : [P] int32 (device), the cache pages the prefills read.
    scratch : [P, 2, block_size, num_kv_heads, head_size] float16 / bfloat16, a view of the builder's scratch (the
        forward writes it: a workspace, not part of the decision).
    block_table : [num_reqs, W] int32 (device): rows ``first_seq`` onwards the prefills' rows in scratch page ids
        (the rows of the decodes before them are not set and not read).
    first_seq : the first request the prefill kernel serves (the batch's decodes come before).
    """

    config: DequantConfig
    pages: torch.Tensor
    scratch: torch.Tensor
    block_table: torch.Tensor
    first_seq: int

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]


def plan_dequant_pages(host: PrefillPages, scratch: torch.Tensor, config: DequantConfig, first_seq: int,
                       device: torch.device) -> DequantPagesPlan:
    """The plan of ``host``'s pages into ``scratch`` (:meth:`DequantScratch.view` of ``host.pages.size`` pages),
    the pages and the table moved to ``device`` in one copy."""
    rows, width = host.block_table.shape
    num_pages = host.pages.size
    table_start = first_seq * width
    flat = np.concatenate((host.block_table.ravel(), host.pages))  # the prefill rows, then the page ids
    buffer = torch.empty(table_start + flat.size, dtype=torch.int32, device=device)
    buffer[table_start:].copy_(torch.from_numpy(flat), non_blocking=True)
    table = buffer[: table_start + rows * width].view(first_seq + rows, width)
    pages = buffer[table_start + rows * width:]
    assert pages.shape[0] == num_pages
    return DequantPagesPlan(config, pages, scratch, table, first_seq)
