"""Scale-out helpers: decode context parallelism over ``torch.distributed`` (KV blocks sharded across ranks)."""

from .blocks import (
    ContextParallelLayout,
    block_owner,
    build_local_metadata,
    local_block_indices,
    local_num_blocks,
    local_seq_len,
    shard_block_table,
)
from .decode_cp import (
    check_context_parallel_spec,
    cp_decode_attention,
    exchange_and_merge,
    local_decode_attention,
    merge_attn_states_n,
)

__all__ = [
    "ContextParallelLayout",
    "block_owner",
    "build_local_metadata",
    "check_context_parallel_spec",
    "cp_decode_attention",
    "exchange_and_merge",
    "local_block_indices",
    "local_decode_attention",
    "local_num_blocks",
    "local_seq_len",
    "merge_attn_states_n",
    "shard_block_table",
]
