"""Decode steps of the built-in engine from CUDA graphs: the model's whole forward (every layer, attention and all)
captured once per padded batch size, replayed with the step's values written into persistent input buffers.

A decode step of ``n`` requests (one new token each) runs on the graph of the smallest capture size ``B >= n``; the
``B - n`` padding requests decode one token at position 0 over a valid page with slot -1 (nothing written), and
their logits are dropped. Each step writes its tokens, positions, sequence lengths, slots and block table into the
buffers (three host-to-device copies from pinned memory), calls the builder's ``build`` on them (a backend that
plans on the host re-plans into the buffers the graph reads; the Triton backend rewrites a balanced schedule's unit
table) and replays. A size is captured the first time a step needs it (its kernels are compiled by one eager run
of that step first); steps with prefills, with more requests than the largest size, or that a capture refused run
eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..metadata import CommonAttentionMetadata

__all__ = ["DEFAULT_CAPTURE_SIZES", "DecodeGraphs", "capture_sizes"]

logger = logging.getLogger(__name__)

#: Padded batch sizes captured by default (those up to the engine's request and token limits).
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(sizes: Optional[Sequence[int]], max_num_reqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """The capture sizes an engine uses: ``sizes`` (default :data:`DEFAULT_CAPTURE_SIZES`) up to its request and
    token limits, sorted; ValueError for a size that is not a positive int."""
    sizes = DEFAULT_CAPTURE_SIZES if sizes is None else tuple(sizes)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"cudagraph_capture_sizes must hold positive ints, got {size!r}")
    limit = min(max_num_reqs, max_num_tokens)
    return tuple(sorted({s for s in sizes if s <= limit}))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab]: the graph's output, rewritten by each replay
    metadata: Any  # the captured metadata: its plans and buffers stay alive with the graph


class DecodeGraphs:
    """The engine's decode graphs and the buffers they read.

    Buffers (device; ``B`` = the largest capture size, ``W`` = the engine's block-table width): tokens and
    positions [B] int64, query_start_loc [B + 1] int32 (0, 1, ..., B: one token per request), seq_lens [B] int32,
    block_table [B, W] int32, slot_mapping [B] int64; pinned host mirrors of all but query_start_loc.
    """

    def __init__(self, engine: Any, sizes: Sequence[int]) -> None:
        """``engine``: the :class:`~attnbackends.engine.PagedEngine` whose model, builder, persistent batch and
        caches the graphs use; ``sizes``: the capture sizes (:func:`capture_sizes`)."""
        if not sizes:
            raise ValueError("no capture size fits the engine's max_num_reqs and max_num_batched_tokens")
        self.engine = engine
        self.sizes = tuple(sorted(sizes))
        self.max_size = self.sizes[-1]
        B, W, dev = self.max_size, engine.batch.max_pages_per_req, engine.device
        self.block_size = engine.config.block_size
        self.tokens = torch.zeros(2, B, dtype=torch.int64, device=dev)  # rows: token ids, positions
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(B, W, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda"
        self.host_tokens = torch.zeros(2, B, dtype=torch.int64, pin_memory=pin)
        self.host_seq_lens = torch.ones(B, dtype=torch.int32, pin_memory=pin)
        self.host_slots = torch.full((B,), -1, dtype=torch.int64, pin_memory=pin)
        self.host_table = torch.zeros(B, W, dtype=torch.int32, pin_memory=pin)
        self.host_qsl = torch.arange(B + 1, dtype=torch.int32)
        self._np_tokens, self._np_seq = self.host_tokens.numpy(), self.host_seq_lens.numpy()
        self._np_slots, self._np_table = self.host_slots.numpy(), self.host_table.numpy()
        self.graphs: dict[int, _Captured] = {}
        self.refused: dict[int, str] = {}  # sizes whose capture failed, with the error: run eagerly
        self._pool = None
        self.replays = 0

    def size_for(self, num_reqs: int) -> Optional[int]:
        """The capture size a decode step of ``num_reqs`` requests runs on (None: none, or its capture failed)."""
        for size in self.sizes:
            if size >= num_reqs:
                return None if size in self.refused else size
        return None

    def load(self, common: CommonAttentionMetadata, tokens: Sequence[int], positions: Sequence[int],
              size: int) -> CommonAttentionMetadata:
        """Write the step (``common``'s ``n`` decodes, as the engine's persistent batch prepared them; their tokens
        and positions) padded to ``size`` requests into the buffers; returns the step's metadata over them."""
        n = common.num_reqs
        toks, seq, slots, table = self._np_tokens, self._np_seq, self._np_slots, self._np_table
        toks[0, :n] = tokens
        toks[1, :n] = positions
        toks[:, n:size] = 0
        seq[:n] = common.seq_lens_cpu.numpy()
        seq[n:size] = 1
        host_table = common.block_table_cpu.numpy()
        width = host_table.shape[1]
        table[:n, :width] = host_table
        table[n:size] = 0  # padding requests read page 0's first slot
        pos = seq[:n].astype(np.int64) - 1
        slots[:n] = table[np.arange(n), pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        slots[n:size] = -1
        self.tokens[:, :size].copy_(self.host_tokens[:, :size], non_blocking=True)
        self.seq_lens[:size].copy_(self.host_seq_lens[:size], non_blocking=True)
        self.slot_mapping[:size].copy_(self.host_slots[:size], non_blocking=True)
        self.block_table[:size].copy_(self.host_table[:size], non_blocking=True)
        step = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], query_start_loc_cpu=self.host_qsl[: size + 1],
            seq_lens=self.seq_lens[:size], seq_lens_cpu=self.host_seq_lens[:size],
            block_table=self.block_table[:size], block_table_cpu=self.host_table[:size],
            slot_mapping=self.slot_mapping[:size], num_reqs=size, num_actual_tokens=size, max_query_len=1,
            max_seq_len=int(seq[:size].max()), block_size=self.block_size,
        )
        # The persistent batch checked the real requests' pages and slots; padding reads page 0 and writes nothing.
        step.host_checked = True
        if common.pages_checked_for is not None:
            step.pages_checked_for = common.pages_checked_for
        return step

    def run(self, common: CommonAttentionMetadata, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """The logits [n, vocab] of a decode step of ``n = common.num_reqs`` requests (one token each, in the
        metadata's request order), from the graph of its padded size (captured now if it is the first such step).

        Returns a view of the graph's output, valid until the next replay."""
        n = common.num_reqs
        size = self.size_for(n)
        assert size is not None, "size_for(num_reqs) must be checked first"
        step = self.load(common, tokens, positions, size)
        engine = self.engine
        captured = self.graphs.get(size)
        if captured is None:
            captured = self._capture(step, size)
            if captured is None:
                return self.forward_padded(step)[:n]
        else:
            engine.builder.build(step)  # re-plans what the graph reads (host-planned wrappers, balanced tables)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[:n]

    def forward_padded(self, step: CommonAttentionMetadata) -> torch.Tensor:
        """The model's forward over the buffers as :meth:`load` left them, eagerly: logits [step.num_reqs, vocab]
        (the padding requests' rows last). What a refused size runs, and what a graph replays."""
        size = step.num_reqs
        attn = self.engine.step_attention_of(self.engine.builder.build(step))
        return self.engine.model.forward(self.tokens[0, :size], self.tokens[1, :size], attn)

    def _capture(self, step: CommonAttentionMetadata, size: int) -> Optional[_Captured]:
        """Capture the model's forward over the buffers for ``size`` requests (one eager run first, on a side
        stream, compiles its kernels); None, with the size refused from then on, where the capture fails."""
        engine = self.engine
        metadata = engine.builder.build_for_cudagraph_capture(step)
        attn = engine.step_attention_of(metadata)
        tokens, positions = self.tokens[0, :size], self.tokens[1, :size]
        stream = torch.cuda.Stream(engine.device)
        stream.wait_stream(torch.cuda.current_stream(engine.device))
        with torch.cuda.stream(stream):
            engine.model.forward(tokens, positions, attn)
        torch.cuda.current_stream(engine.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = engine.model.forward(tokens, positions, attn)
        except RuntimeError as exc:
            self.refused[size] = f"{type(exc).__name__}: {exc}"
            logger.warning("CUDA-graph capture of decode steps of %d requests failed; they run eagerly: %s", size,
                           exc)
            return None
        if self._pool is None:
            self._pool = graph.pool()
        logger.info("captured the decode step of %d requests in a CUDA graph", size)
        captured = self.graphs[size] = _Captured(graph, logits, metadata)
        return captured
