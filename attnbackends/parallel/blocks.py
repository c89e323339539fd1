"""Decode context parallelism: which rank holds which KV block, and each rank's local batch metadata.

Every sequence's logical KV blocks are dealt out to the ranks of the context-parallel group in runs of
``interleave`` blocks: logical block ``i`` lives on rank ``(i // interleave) % world_size``. A rank stores its
blocks one after another, so its share of a sequence is itself an ordinary paged sequence (full pages, then at
most one partial page: the sequence's last block, which holds the newest token) and any paged kernel can attend
over it. Only the rank that owns the block of a new token writes that token to its cache.

All helpers here are host-side: they read the CPU copies of the metadata, never the device tensors' values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..metadata import CommonAttentionMetadata

__all__ = [
    "ContextParallelLayout",
    "block_owner",
    "build_local_metadata",
    "local_block_indices",
    "local_num_blocks",
    "local_seq_len",
    "shard_block_table",
]


def _check_layout(world_size: int, interleave: int, rank: Optional[int] = None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(interleave, int) or interleave < 1:
        raise ValueError(f"interleave must be a positive int (blocks per run), got {interleave!r}")
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def block_owner(block_index: int, world_size: int, interleave: int = 1) -> int:
    """The rank that holds logical block ``block_index`` of a sequence: ``(block_index // interleave) % world_size``."""
    _check_layout(world_size, interleave)
    if block_index < 0:
        raise ValueError(f"block_index must be >= 0, got {block_index}")
    return (block_index // interleave) % world_size


def local_num_blocks(num_blocks: int, rank: int, world_size: int, interleave: int = 1) -> int:
    """How many of a sequence's first ``num_blocks`` logical blocks live on ``rank``."""
    _check_layout(world_size, interleave, rank)
    cycle = interleave * world_size
    rem = num_blocks % cycle
    return (num_blocks // cycle) * interleave + min(max(rem - rank * interleave, 0), interleave)


def local_block_indices(num_blocks: int, rank: int, world_size: int, interleave: int = 1) -> list[int]:
    """The logical indices (in order) of the blocks among the first ``num_blocks`` that live on ``rank``.

    The j-th local block is logical block ``(j // interleave) * interleave * world_size + rank * interleave
    + j % interleave``.
    """
    n = local_num_blocks(num_blocks, rank, world_size, interleave)
    cycle = interleave * world_size
    return [(j // interleave) * cycle + rank * interleave + j % interleave for j in range(n)]


def local_seq_len(seq_len: int, block_size: int, rank: int, world_size: int, interleave: int = 1) -> int:
    """Tokens of a ``seq_len``-token sequence that ``rank`` holds (0 when it holds none of its blocks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if seq_len <= 0:
        return 0
    num_blocks = -(-seq_len // block_size)
    tokens = local_num_blocks(num_blocks, rank, world_size, interleave) * block_size
    if block_owner(num_blocks - 1, world_size, interleave) == rank:
        tokens -= num_blocks * block_size - seq_len  # the last block is partial
    return tokens


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where the KV blocks of every sequence live in a context-parallel group (the same on every rank but ``rank``).

    Attributes
    ----------
    world_size : ranks in the context-parallel group.
    rank : this rank's index in the group.
    block_size : tokens per KV page.
    interleave : consecutive logical blocks per rank before moving to the next rank (1: round-robin by block).
    """

    world_size: int
    rank: int
    block_size: int
    interleave: int = 1

    def __post_init__(self) -> None:
        _check_layout(self.world_size, self.interleave, self.rank)
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def owner(self, block_index: int) -> int:
        return block_owner(block_index, self.world_size, self.interleave)

    def local_seq_len(self, seq_len: int) -> int:
        return local_seq_len(seq_len, self.block_size, self.rank, self.world_size, self.interleave)

    def local_block_indices(self, num_blocks: int) -> list[int]:
        return local_block_indices(num_blocks, self.rank, self.world_size, self.interleave)

    def owns_position(self, position: int) -> bool:
        """Whether the token at ``position`` of a sequence is stored on this rank."""
        return self.owner(position // self.block_size) == self.rank


def shard_block_table(block_table: torch.Tensor, layout: ContextParallelLayout) -> torch.Tensor:
    """This rank's columns of a global block table: ``[num_reqs, W]`` -> ``[num_reqs, local_num_blocks(W)]``.

    Column j of the result is column ``local_block_indices(W)[j]`` of the input (same device and dtype). Use it
    when all ranks share one page-id space (each rank fills only the pages of the blocks it owns).
    """
    width = block_table.shape[1]
    cols = layout.local_block_indices(width)
    index = torch.as_tensor(cols, dtype=torch.long, device=block_table.device)
    return block_table.index_select(1, index)


def build_local_metadata(
    common: CommonAttentionMetadata,
    layout: ContextParallelLayout,
    local_block_table: Optional[torch.Tensor] = None,
) -> CommonAttentionMetadata:
    """This rank's view of a decode batch under context parallelism.

    Parameters
    ----------
    common : the global batch; every request must be a decode (query_len 1). Its ``seq_lens`` count the whole
        sequence (every rank's share plus the new token).
    layout : the group's block layout and this rank.
    local_block_table : ``[num_reqs, >= local blocks]`` int32 or None. Row i lists, in order, the pages of this
        rank's cache that hold request i's local blocks (``local_block_indices``). None: the ranks share one
        page-id space and the columns are taken from ``common.block_table`` (:func:`shard_block_table`).

    Returns
    -------
    CommonAttentionMetadata
        Same queries (replicated on every rank); ``seq_lens`` = tokens this rank holds per request (may be 0);
        ``block_table`` = this rank's pages; ``slot_mapping`` = the new token's slot on the rank that owns its
        block and -1 (skip) elsewhere. ``causal`` is False: every local key precedes the query's global
        position, so the query sees all of them; a request with local seq_len 0 sees nothing (output 0, lse -inf).
        Note that ``seq_len >= query_len`` does not hold for such requests: do not pass the result to
        ``validate_common_metadata``.
    """
    if common.num_reqs and int(common.query_lens_cpu.max()) > 1:
        raise ValueError("context-parallel metadata supports decode batches only (every query_len must be 1); "
                         f"got max_query_len {int(common.query_lens_cpu.max())}")
    bs = layout.block_size
    device = common.device
    seq_lens = common.seq_lens_cpu.tolist()
    local_lens = [layout.local_seq_len(n) for n in seq_lens]
    if local_block_table is None:
        local_block_table = shard_block_table(common.block_table, layout)
    else:
        need = max((-(-n // bs) for n in local_lens), default=0)
        if local_block_table.dim() != 2 or local_block_table.shape[0] < common.num_reqs or \
                local_block_table.shape[1] < need:
            raise ValueError(f"local_block_table must be [>= num_reqs={common.num_reqs}, >= {need}], got "
                             f"{tuple(local_block_table.shape)}")
        local_block_table = local_block_table.to(device=device, dtype=torch.int32)
    # The new token's slot, gathered on the device from host-computed indices (no host-device sync).
    owned, cols, offsets = [], [], []
    for i, seq_len in enumerate(seq_lens):
        local_pos = local_lens[i] - 1  # the newest token is the last one this rank holds
        owned.append(seq_len >= 1 and layout.owns_position(seq_len - 1))
        cols.append(max(local_pos, 0) // bs)
        offsets.append(max(local_pos, 0) % bs)
    num_padded = common.slot_mapping.shape[0]
    slot_mapping = torch.full((num_padded,), -1, dtype=torch.int64, device=device)
    if common.num_reqs:
        rows = torch.arange(common.num_reqs, device=device)
        col_t = torch.as_tensor(cols, dtype=torch.long).to(device)
        pages = local_block_table[rows, col_t.clamp_max(max(local_block_table.shape[1] - 1, 0))].long() \
            if local_block_table.shape[1] else torch.zeros(common.num_reqs, dtype=torch.long, device=device)
        new_slots = pages * bs + torch.as_tensor(offsets, dtype=torch.int64).to(device)
        keep = torch.as_tensor(owned, dtype=torch.bool).to(device)
        slot_mapping[: common.num_reqs] = torch.where(keep, new_slots, torch.full_like(new_slots, -1))
    seq_lens_cpu = torch.as_tensor(local_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc,
        query_start_loc_cpu=common.query_start_loc_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        block_table=local_block_table,
        slot_mapping=slot_mapping,
        num_reqs=common.num_reqs,
        num_actual_tokens=common.num_actual_tokens,
        max_query_len=common.max_query_len,
        max_seq_len=max(local_lens, default=0),
        causal=False,
        common_prefix_len=0,
    )
