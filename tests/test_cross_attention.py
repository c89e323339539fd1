"""Cross-attention (``encoder_decoder``) metadata and the backends that declare it: decoder queries over each
request's cached encoder keys, including decoder chunks longer than the encoder output, against a float64 dense
softmax; encoder passes and partial steps through GroupedMetadataBuilder."""

import math
import random

import pytest
import torch

from attnbackends import (
    AttentionSpec,
    DeviceInfo,
    GroupedMetadataBuilder,
    build_cross_attention_metadata,
    encoder_slot_mapping,
    explain,
    get_backend_class,
    group_layers,
    validate_common_metadata,
)
from attnbackends.engine.encoder import encoder_common_metadata
from attnbackends.testing.tolerances import assert_close_to_oracle, tolerance_for

BLOCK = 16


def test_cross_metadata_hand_made():
    common = build_cross_attention_metadata([1, 3, 20], [5, 17, 4], [[7], [2, 9], [4]], block_size=BLOCK,
                                            num_padded_tokens=26)
    assert common.query_start_loc_cpu.tolist() == [0, 1, 4, 24]
    assert common.seq_lens_cpu.tolist() == [5, 17, 4]  # encoder lengths; request 2 has more queries than keys
    assert common.block_table.tolist() == [[7, 0], [2, 9], [4, 0]]
    assert common.slot_mapping.tolist() == [-1] * 26  # queries write nothing into the cross cache
    assert not common.causal
    assert (common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (24, 20, 17)
    validate_common_metadata(common, num_blocks=10, block_size=BLOCK)  # non-causal: seq_len < query_len is valid
    slots = encoder_slot_mapping([5, 17], [[7], [2, 9]], BLOCK)
    assert slots.tolist() == [7 * 16 + j for j in range(5)] + [2 * 16 + j for j in range(16)] + [9 * 16]


def test_causal_metadata_still_needs_as_many_keys_as_queries():
    import dataclasses

    common = build_cross_attention_metadata([20], [4], [[4]], block_size=BLOCK)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] \(4\) < query_len \(20\)"):
        validate_common_metadata(dataclasses.replace(common, causal=True))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(query_lens=[1, 1], encoder_lens=[4], block_tables=[[0]]), "one entry per request"),
        (dict(query_lens=[1], encoder_lens=[0], block_tables=[[0]]), r"encoder_lens\[0\] must be >= 1"),
        (dict(query_lens=[0], encoder_lens=[4], block_tables=[[0]]), "query_len must be >= 1"),
        (dict(query_lens=[1], encoder_lens=[40], block_tables=[[0, 1]]), r"block_tables\[0\] has 2 pages, 40"),
        (dict(query_lens=[1], encoder_lens=[4], block_tables=[[0], [1]]), "one entry per request"),
    ],
)
def test_cross_metadata_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_cross_attention_metadata(block_size=BLOCK, **kwargs)


def test_encoder_slot_mapping_errors():
    with pytest.raises(ValueError, match=r"block_tables\[1\] has 1 pages, 20 encoder tokens need 2"):
        encoder_slot_mapping([3, 20], [[0], [1]], BLOCK)


def _cross_spec(dtype: str) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype, block_size=BLOCK,
                         attn_type="encoder_decoder", scale=0.3)


def _dense_cross(q, keys, values, query_lens, scale):
    """float64 softmax(q k^T * scale) v per request over all of its encoder keys (GQA: heads share kv heads)."""
    out, start = [], 0
    for n, k, v in zip(query_lens, keys, values):
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), kk) * scale
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += n
    return torch.cat(out)


# Decodes first (the builders' order), then decoder prefill chunks: one shorter and one longer than its encoder.
QUERY_LENS = [1, 1, 6, 23]
ENCODER_LENS = [19, 3, 40, 9]


@pytest.mark.parametrize("backend,dtype", [("reference", "float32"), ("reference", "bfloat16"),
                                           ("triton", "float16")])
def test_cross_attention_matches_dense_softmax(backend, dtype):
    spec = _cross_spec(dtype)
    row = {r.name: r for r in explain(spec, DeviceInfo.current()).rows}[backend]
    if row.reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(row.reasons)}")
    cls = get_backend_class(backend)
    torch_dtype = spec.torch_dtype
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    pages = [-(-s // BLOCK) for s in ENCODER_LENS]
    num_blocks = sum(pages) + 3
    order = rng.sample(range(num_blocks), sum(pages))
    tables, at = [], 0
    for n in pages:
        tables.append(order[at:at + n])
        at += n
    keys = [torch.randn(s, 2, 32, generator=gen).to(torch_dtype) for s in ENCODER_LENS]
    values = [torch.randn(s, 2, 32, generator=gen).to(torch_dtype) for s in ENCODER_LENS]
    cache = cls.allocate_kv_cache(num_blocks, spec)
    cache.fill_(float("nan"))  # only the written encoder slots may be read
    impl = cls.get_impl_cls()(spec)
    impl.update_kv_cache(torch.cat(keys), torch.cat(values), cache, encoder_slot_mapping(ENCODER_LENS, tables, BLOCK))
    common = build_cross_attention_metadata(QUERY_LENS, ENCODER_LENS, tables, BLOCK,
                                            num_padded_tokens=sum(QUERY_LENS) + 2)
    meta = cls.get_builder_cls()(spec, "cpu", debug=True).build(common)
    q = torch.randn(sum(QUERY_LENS) + 2, 4, 32, generator=gen).to(torch_dtype)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, None, None, cache, meta, out)
    want = _dense_cross(q, keys, values, QUERY_LENS, spec.softmax_scale)
    n = sum(QUERY_LENS)
    assert_close_to_oracle(out[:n], want, tolerance_for(torch_dtype), what=f"{backend} cross-attention")
    assert torch.isnan(out[n:].float()).all()  # padding rows untouched
    assert torch.isnan(cache.float()).any()  # the unwritten slots stayed poisoned and were not read


def test_grouped_builder_builds_only_the_groups_of_a_step():
    enc = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=32, dtype="float32", attn_type="encoder")
    dec = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=32, dtype="float32")
    cross = AttentionSpec(num_heads=2, num_kv_heads=2, head_size=32, dtype="float32", attn_type="encoder_decoder")
    groups = group_layers([enc, enc, dec, cross], DeviceInfo.cpu())
    assert [g.name for g in groups.groups] == ["encoder", "full", "cross"]
    builder = GroupedMetadataBuilder(groups, "cpu")
    step = builder.build([encoder_common_metadata([5, 3]), None, None])
    assert step.per_group[1] is None and step.per_group[2] is None
    assert step.per_layer[0] is step.per_layer[1] is step.per_group[0]
    assert step.per_layer[2] is None and step.commons[2] is None
    assert math.isclose(float(step.commons[0].seq_lens_cpu.sum()), 8)
