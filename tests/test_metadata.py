import dataclasses

import pytest
import torch

from attnbackends import (
    build_common_metadata,
    decode_first_order,
    split_decodes_and_prefills,
    validate_common_metadata,
)


def test_build_common_metadata_hand_made():
    common = build_common_metadata([1, 3], [5, 0], [[7, 2], [4]], block_size=4, num_padded_tokens=6)
    assert common.query_start_loc_cpu.tolist() == [0, 1, 4]
    assert common.seq_lens_cpu.tolist() == [6, 3]
    assert common.context_lens_cpu.tolist() == [5, 0]
    assert common.block_table.tolist() == [[7, 2], [4, 0]]
    # request 0, position 5 -> page 2 (second), offset 1; request 1 positions 0..2 -> page 4
    assert common.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18, -1, -1]
    assert (common.num_reqs, common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (2, 4, 3, 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(query_lens=[0], context_lens=[0], block_tables=[[0]]), "query_len"),
        (dict(query_lens=[5], context_lens=[0], block_tables=[[0]]), "block_tables\\[0\\]"),
        (dict(query_lens=[1, 1], context_lens=[0], block_tables=[[0]]), "one entry per request"),
        (dict(query_lens=[1], context_lens=[0], block_tables=[[0]], num_padded_tokens=0), "num_padded_tokens"),
        (dict(query_lens=[1], context_lens=[3], block_tables=None), "context_lens"),
    ],
)
def test_build_common_metadata_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_common_metadata(block_size=4, **kwargs)


def test_decode_first_order_and_split():
    query_lens = [5, 1, 1, 9, 1]
    order = decode_first_order(query_lens)
    assert order == [1, 2, 4, 0, 3]
    ordered = [query_lens[i] for i in order]
    common = build_common_metadata(ordered, [3] * 5, [[i, 10 + i, 20 + i] for i in range(5)], block_size=8)
    split = split_decodes_and_prefills(common)
    assert (split.num_decodes, split.num_prefills, split.num_decode_tokens, split.num_prefill_tokens) == (3, 2, 3, 14)
    unordered = build_common_metadata(query_lens, [3] * 5, [[i, 10 + i, 20 + i] for i in range(5)], block_size=8)
    with pytest.raises(ValueError, match="decodes first"):
        split_decodes_and_prefills(unordered)


def test_validate_common_metadata_rejects_a_stale_host_block_table():
    common = build_common_metadata([1, 2], [3, 0], [[0], [1]], block_size=4, device="cpu")
    common = dataclasses.replace(common, block_table=common.block_table.clone())
    validate_common_metadata(common, num_blocks=2, block_size=4)
    common.block_table[1, 0] = 0  # the device table moved on, the host copy did not
    with pytest.raises(ValueError, match="block_table_cpu does not hold the page ids of block_table"):
        validate_common_metadata(common, num_blocks=2, block_size=4)


def test_validate_common_metadata_names_tensor_and_index():
    common = build_common_metadata([1, 2], [3, 0], [[0], [1]], block_size=4)
    validate_common_metadata(common, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 5"):
        common.block_table[1, 0] = 5
        validate_common_metadata(common, num_blocks=2, block_size=4)
    common = build_common_metadata([1, 2], [3, 0], [[0], [1]], block_size=4)
    common.seq_lens_cpu[1] = 1
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        validate_common_metadata(common)
    common = build_common_metadata([1, 2], [3, 0], [[0], [1]], block_size=4)
    common.query_start_loc_cpu = torch.tensor([0, 2, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="not monotonic at index 2"):
        validate_common_metadata(common)
