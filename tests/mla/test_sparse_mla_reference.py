"""Sparse MLA (DeepSeek V3.2): the spec, the caches' layouts, the reference backend against the float64 oracle, the
top-k tie rule, sparse == dense MLA when top-k covers the context, and selection."""

import pytest
import torch

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, SparseIndexerSpec, explain, select
from attnbackends.ops.sparse_mla_cache import (
    allocate_sparse_mla_cache, ds_latent_bytes, index_cache_views, quantize_blockwise_fp8, read_index_keys,
)
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.reference.sparse_mla import (
    ReferenceSparseMLABackend, positions_to_slots, topk_positions,
)
from attnbackends.testing import SequenceShape as S
from tests.mla.sparse_mla_support import (
    make_random_sparse_mla_batch, run_sparse_mla_backend, sparse_mla_oracle,
)


def tiny_sparse_spec(topk=6, latent_format="auto", dtype="bfloat16", block_size=4, num_heads=4, kv_lora_rank=64):
    return AttentionSpec.mla(
        num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, dtype=dtype,
        block_size=block_size,
        sparse_indexer=SparseIndexerSpec(num_index_heads=4, index_head_dim=32, quant_block=16, topk=topk,
                                         latent_format=latent_format),
    )


MIXED = [S(1, 0), S(1, 5), S(1, 13), S(4, 0), S(5, 9)]


def test_spec_validation():
    with pytest.raises(ValueError, match="sparse_indexer needs an MLA spec"):
        AttentionSpec(num_heads=4, num_kv_heads=4, head_size=64, sparse_indexer=SparseIndexerSpec())
    with pytest.raises(ValueError, match="multiple of quant_block"):
        SparseIndexerSpec(index_head_dim=96)
    with pytest.raises(ValueError, match="kv_cache_dtype of a sparse MLA spec"):
        AttentionSpec.mla(8, kv_cache_dtype="fp8", sparse_indexer=SparseIndexerSpec())
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        AttentionSpec.mla(8, kv_lora_rank=96, sparse_indexer=SparseIndexerSpec(latent_format="fp8_ds_mla"))
    spec = AttentionSpec.mla(128, sparse_indexer=SparseIndexerSpec(latent_format="fp8_ds_mla"))
    assert spec.is_sparse_mla and spec.sparse_indexer.topk == 2048
    assert spec.sparse_indexer.softmax_scale == pytest.approx(128 ** -0.5)


def test_cache_layouts_at_deepseek_dims():
    spec = AttentionSpec.mla(128, block_size=64, sparse_indexer=SparseIndexerSpec(latent_format="fp8_ds_mla"))
    assert ds_latent_bytes(512, 64) == 656
    cache = allocate_sparse_mla_cache(3, spec, "cpu")
    assert cache.latent.shape == (3, 64, 656) and cache.latent.dtype == torch.uint8
    assert cache.index.shape == (3, 64 * (128 + 4))
    values, scales = index_cache_views(cache.index, spec)
    assert values.shape == (3, 64, 128) and scales.shape == (3, 64, 1) and scales.dtype == torch.float32
    # the scales of page 1 follow its values: the views address the documented bytes
    assert scales.data_ptr() - cache.index.data_ptr() == 64 * 128
    assert values[1].data_ptr() - cache.index.data_ptr() == 64 * 132


def test_blockwise_quantisation_round_trip():
    x = torch.randn(7, 64) * torch.tensor([0.01, 1.0, 30.0, 0.0]).repeat_interleave(16)
    q, s = quantize_blockwise_fp8(x, 16)
    assert s.shape == (7, 4) and torch.all(s[:, 3] == 1e-4 / 448)
    back = (q.float().view(7, 4, 16) * s[..., None]).view(7, 64)
    torch.testing.assert_close(back, x, rtol=2 ** -4, atol=1e-6)
    assert q.float().abs().max() <= 448


def test_topk_tie_rule_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 9.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    positions = topk_positions(scores, torch.tensor([4, 1]), topk=3)
    # row 0: position 5 is in the future; the three 3.0 tie and come in position order
    assert positions.tolist() == [[1, 2, 4], [0, 1, -1]]
    slots = positions_to_slots(positions, torch.tensor([7, 2]), block_size=4)
    assert slots.tolist() == [[29, 30, 8], [28, 29, -1]]


@pytest.mark.parametrize("latent_format,kv_lora_rank", [("auto", 64), ("fp8_ds_mla", 128)])
@pytest.mark.parametrize("topk", [3, 6])
def test_reference_backend_matches_oracle(latent_format, kv_lora_rank, topk):
    spec = tiny_sparse_spec(topk=topk, latent_format=latent_format, kv_lora_rank=kv_lora_rank)
    batch = make_random_sparse_mla_batch(spec, MIXED, seed=topk, pad_tokens=2)
    out, cache, _ = run_sparse_mla_backend(ReferenceSparseMLABackend, batch)
    n = batch.num_actual_tokens
    want, _, _ = sparse_mla_oracle(batch)
    torch.testing.assert_close(out[:n].double(), want, atol=2e-2, rtol=2e-2)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    # the step's index keys were written: the cache reads them back as their quantised values
    slots = batch.common.slot_mapping[:n]
    q8, s = quantize_blockwise_fp8(batch.index_k[:n], 16)
    assert torch.equal(read_index_keys(cache.index, slots, spec), (q8.float().view(n, 2, 16) * s[..., None]).view(n, 32))


def test_oracle_sparse_differs_from_dense():
    """A top-k smaller than the context changes the answer (the selection is not a no-op)."""
    spec = tiny_sparse_spec(topk=3)
    batch = make_random_sparse_mla_batch(spec, [S(1, 20), S(3, 9)], seed=7)
    sparse, _, _ = sparse_mla_oracle(batch)
    dense, _, _ = sparse_mla_oracle(batch, topk=64)
    assert (sparse - dense).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_equals_dense_mla_when_topk_covers_the_context(dtype):
    spec = tiny_sparse_spec(topk=32, dtype=dtype)
    batch = make_random_sparse_mla_batch(spec, MIXED, seed=11, pad_tokens=1)
    out, _, _ = run_sparse_mla_backend(ReferenceSparseMLABackend, batch)
    dense_spec = spec.model_copy(update={"sparse_indexer": None})
    meta = ReferenceMLABackend.get_builder_cls()(dense_spec, "cpu").build(batch.common)
    impl = ReferenceMLABackend.get_impl_cls()(dense_spec, kv_b_proj=batch.kv_b_proj)
    dense = batch.new_output()
    impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.cache.latent.clone(), meta, dense)
    n = batch.num_actual_tokens
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(out[:n].float(), dense[:n].float(), atol=tol, rtol=tol)


def test_selection_picks_sparse_backends_and_dense_ones_decline():
    spec = tiny_sparse_spec()
    assert select(spec, DeviceInfo.cpu(triton_interpreted=False)).name == "reference_mla_sparse"
    hopper = DeviceInfo.cuda(9, 0)
    result = explain(spec, hopper)
    assert result.chosen == "triton_mla_sparse", str(result)
    table = str(result)
    for name in ("triton_mla", "flashinfer_mla", "reference_mla"):
        why = str(explain(spec, hopper, AttentionConfig(backend=name)))
        assert "attends densely" in why, why
    dense = spec.model_copy(update={"sparse_indexer": None})
    assert select(dense, DeviceInfo.cpu(triton_interpreted=False)).name == "reference_mla"
    why = str(explain(dense, hopper, AttentionConfig(backend="triton_mla_sparse")))
    assert "serves sparse MLA specs only" in why, why
    assert "triton_mla_sparse" in table
