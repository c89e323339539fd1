"""Bad input is rejected clearly (attnbackends.validation): tensors on an impl's first forward and in debug mode, the
batch's metadata against the cache in debug mode; every message names the tensor and what was expected."""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.metadata import check_slots_match_block_table
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.testing.mla import make_random_mla_batch
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import make_random_batch
from attnbackends.triton.backend import TritonAttentionBackend
from attnbackends.validation import validate_metadata_against_cache

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=16)
BACKENDS = [pytest.param(ReferenceBackend, id="reference"), pytest.param(TritonAttentionBackend, id="triton")]
SHAPES = [S(1, 20), S(5, 3)]


def setup(backend, debug=False, impl_debug=False):
    batch = make_random_batch(SPEC, SHAPES, seed=1)
    builder = backend.get_builder_cls()(SPEC, "cpu", debug=debug)
    impl = backend.get_impl_cls()(SPEC, debug=impl_debug)
    return batch, builder, impl


def run(impl, batch, meta, **override):
    args = dict(query=batch.query, key=batch.key, value=batch.value, kv_cache=batch.kv_cache.clone(),
                output=batch.new_output())
    args.update(override)
    return impl.forward(args["query"], args["key"], args["value"], args["kv_cache"], meta, args["output"])


BAD_INPUTS = {
    "query_heads": (lambda b: dict(query=b.query[:, :2]), r"query must be \[num_tokens, num_heads=4, head_size=32\]; got shape \(6, 2, 32\)"),
    "query_dtype": (lambda b: dict(query=b.query.float()), r"query must be torch.float16; got shape \(6, 4, 32\), dtype torch.float32"),
    "key_head_size": (lambda b: dict(key=b.key[..., :16]), r"key must be .*head_size=32.*got shape \(6, 2, 16\)"),
    "value_rows": (lambda b: dict(value=b.value[:3]), r"value must be \[num_tokens=6, .*got shape \(3, 2, 32\)"),
    "output_shape": (lambda b: dict(output=b.new_output()[:, :, :16]), r"output must be .*value_head_size=32.*got shape"),
    "output_dtype": (lambda b: dict(output=b.new_output().float()), r"output must be torch.float16; got .*float32"),
    "kv_cache_layout": (lambda b: dict(kv_cache=b.kv_cache.transpose(2, 3).contiguous()), r"kv_cache must be \[\d+, 2, 16, 2, 32\]; got shape"),
    "kv_cache_dtype": (lambda b: dict(kv_cache=b.kv_cache.to(torch.bfloat16)), r"kv_cache must be torch.float16; got .*bfloat16"),
    "query_stride": (lambda b: dict(query=torch.empty(6, 4, 64, dtype=torch.float16)[..., ::2]), r"query must be contiguous in its last dimension"),
    "key_without_value": (lambda b: dict(value=None), r"key and value must be given together"),
}


@pytest.mark.parametrize("what", list(BAD_INPUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_forward_rejects_bad_tensors(backend, what):
    batch, builder, impl = setup(backend)
    make, message = BAD_INPUTS[what]
    with pytest.raises(ValueError, match=message):
        run(impl, batch, builder.build(batch.common), **make(batch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_once_outside_debug_and_every_call_in_debug(backend):
    batch, builder, impl = setup(backend)
    meta = builder.build(batch.common)
    run(impl, batch, meta)
    assert impl._input_layout is not None
    _, builder_d, impl_d = setup(backend, debug=True)
    meta_d = builder_d.build(batch.common)
    assert meta_d.debug
    run(impl_d, batch, meta_d)
    with pytest.raises(ValueError, match="kv_cache must be torch.float16"):  # debug: checked again on call 2
        run(impl_d, batch, meta_d, kv_cache=batch.kv_cache.to(torch.bfloat16))
    _, _, impl_only = setup(backend, impl_debug=True)  # the impl's own flag works with non-debug metadata
    run(impl_only, batch, meta)
    with pytest.raises(ValueError, match="query must be torch.float16"):
        run(impl_only, batch, meta, query=batch.query.float())


def _with_table(common, i, j, value):
    table = common.block_table.clone()
    table[i, j] = value
    return dataclasses.replace(common, block_table=table, block_table_cpu=table.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_rejects_block_table_entry_out_of_range(backend):
    batch, builder, impl = setup(backend, debug=True)
    num_blocks = batch.kv_cache.shape[0]
    # A context page (no new token lands in it, so the slots still agree): the builder cannot know num_blocks.
    meta = builder.build(_with_table(batch.common, 0, 0, num_blocks))
    with pytest.raises(ValueError, match=rf"block_table\[0, 0\] = {num_blocks} is outside \[0, {num_blocks}\)"):
        run(impl, batch, meta)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -3"):  # a page the new tokens go to: at build
        run(impl, batch, builder.build(_with_table(batch.common, 1, 0, -3)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_rejects_seq_len_shorter_than_query(backend):
    batch, builder, _ = setup(backend, debug=True)
    seq = batch.common.seq_lens_cpu.clone()
    seq[1] = 2  # query_len 5
    bad = dataclasses.replace(batch.common, seq_lens_cpu=seq, seq_lens=seq.clone())
    with pytest.raises(ValueError, match=r"seq_lens\[1\] \(2\) < query_len \(5\) of request 1"):
        builder.build(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_rejects_non_monotonic_query_start_loc(backend):
    batch = make_random_batch(SPEC, [S(1, 20), S(5, 3), S(4, 0)], seed=2)
    builder = backend.get_builder_cls()(SPEC, "cpu", debug=True)
    qsl = batch.common.query_start_loc_cpu.clone()
    qsl[2] = 0
    bad = dataclasses.replace(batch.common, query_start_loc_cpu=qsl, query_start_loc=qsl.clone())
    with pytest.raises(ValueError, match=r"query_start_loc is not monotonic at index 2: 1 -> 0"):
        builder.build(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_debug_rejects_slot_outside_the_cache(backend):
    batch, builder, impl = setup(backend, debug=True)
    slots = batch.common.slot_mapping.clone()
    slots[3] = batch.kv_cache.shape[0] * 16
    bad = dataclasses.replace(batch.common, slot_mapping=slots)
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = \d+ disagrees with the block table"):
        builder.build(bad)  # the slots are on the host here: every build checks them against the block table
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = \d+ is outside \[-1, \d+\)"):
        validate_metadata_against_cache(bad, batch.kv_cache, 16)  # what a debug forward checks against the cache


def test_mla_first_forward_rejects_bad_tensors_and_debug_checks_block_table():
    spec = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                             dtype="float16", block_size=16)
    batch = make_random_mla_batch(spec, [S(1, 20), S(3, 0)], seed=3)
    impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
    builder = TritonMLABackend.get_builder_cls()(spec, "cpu")
    meta = builder.build(batch.common)
    with pytest.raises(ValueError, match=r"k_pe must be \[num_tokens=4, qk_rope_head_dim=16\]; got shape \(4, 8\)"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe[:, :8], batch.kv_cache.clone(), meta, batch.new_output())
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks=\d+, block_size=16, kv_lora_rank \+ qk_rope_head_dim=48\]"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache[..., :40].clone(), meta, batch.new_output())
    debug_builder = TritonMLABackend.get_builder_cls()(spec, "cpu", debug=True)
    table = batch.common.block_table.clone()
    table[0, 0] = batch.kv_cache.shape[0] + 7
    bad = debug_builder.build(dataclasses.replace(batch.common, block_table=table, block_table_cpu=table.cpu()))
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = \d+ is outside"):
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), bad, batch.new_output())


def test_seq_len_below_query_len_is_caught_even_where_the_slot_matches_the_rows_last_page():
    """A token at a negative position (seq_len < query_len) must not be checked against its row read from the end:
    the decode token of a request with seq_len 0 is given exactly the slot that reading would expect."""
    common = build_common_metadata([1, 1], [4, 7], [[3], [5, 9]], 16, "cpu")
    seq = common.seq_lens_cpu.clone()
    seq[1] = 0
    slots = common.slot_mapping.clone()
    slots[1] = 9 * 16 + 15  # the last slot of the row's last page: where position -1 lands when read from the end
    bad = dataclasses.replace(common, seq_lens_cpu=seq, seq_lens=seq.clone(), slot_mapping=slots)
    table = bad.block_table_cpu.numpy()
    with pytest.raises(ValueError, match=r"seq_lens\[1\] \(0\) < query_len \(1\) of request 1"):
        check_slots_match_block_table(bad, 16, table, bad.slot_mapping.numpy())
