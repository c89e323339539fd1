"""One contract per kind of impl: the MLA impl base and its forward, the output head size of MLA specs, v_scale on
MLA impls, and context-parallel decode calling impls through their ``can_return_lse`` capability."""

from __future__ import annotations

import pytest
import torch

from attnbackends import AttentionSpec
from attnbackends.compile import AttentionLayer, forward_context
from attnbackends.interface import AttentionImpl
from attnbackends.mla.common import MLAAttentionImpl, MLAImpl
from attnbackends.reference.mla import ReferenceMLABackend, ReferenceMLAImpl
from attnbackends.testing.mla import make_random_mla_batch
from attnbackends.parallel.decode_cp import local_decode_attention
from attnbackends.reference.backend import ReferenceImpl
from attnbackends.testing.cases import SequenceShape, make_random_batch

MLA_SPEC = AttentionSpec.mla(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                             dtype="float32", block_size=16)


def test_mla_value_head_size_is_the_output_size():
    assert MLA_SPEC.value_head_size == 24 != MLA_SPEC.kv_lora_rank
    assert AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, head_size_v=32).value_head_size == 32


def test_mla_impls_have_their_own_contract():
    assert issubclass(MLAImpl, MLAAttentionImpl) and issubclass(ReferenceMLAImpl, MLAAttentionImpl)
    assert not issubclass(MLAAttentionImpl, AttentionImpl)


def test_compiled_layer_allocates_the_mla_output_shape():
    batch = make_random_mla_batch(MLA_SPEC, [SequenceShape(1, 20), SequenceShape(5, 9)], seed=3)
    metadata = ReferenceMLABackend.get_builder_cls()(MLA_SPEC, "cpu").build(batch.common)
    direct = batch.new_output()
    impl = ReferenceMLAImpl(MLA_SPEC, kv_b_proj=batch.kv_b_proj)
    impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), metadata, direct)
    layer = AttentionLayer("house-mla-layer", ReferenceMLAImpl(MLA_SPEC, kv_b_proj=batch.kv_b_proj),
                           batch.kv_cache.clone())
    with forward_context(metadata):
        out = layer(batch.q, batch.kv_c, batch.k_pe)
    assert out.shape == (batch.q.shape[0], 4, 24)
    n = batch.num_actual_tokens
    assert torch.isfinite(direct[:n]).all()
    torch.testing.assert_close(out[:n], direct[:n], rtol=0, atol=0)


@pytest.mark.parametrize("v_scale", [None, 1.0, 0.5])
def test_mla_v_scale_equal_to_k_scale_or_one_is_accepted(v_scale):
    kv_b_proj = torch.randn(4 * (16 + 24), 32)
    fp8_spec = MLA_SPEC.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})  # scales apply to fp8 caches only
    impl = ReferenceMLAImpl(fp8_spec, kv_b_proj=kv_b_proj, k_scale=0.5, v_scale=v_scale)
    assert impl.v_scale == impl.k_scale == 0.5


def test_mla_v_scale_that_differs_is_rejected():
    with pytest.raises(ValueError, match=r"v_scale=0\.25 is not supported by MLA.*k_scale=0\.5"):
        ReferenceMLAImpl(MLA_SPEC.model_copy(update={"kv_cache_dtype": "fp8_e4m3"}),
                         kv_b_proj=torch.randn(4 * (16 + 24), 32), k_scale=0.5, v_scale=0.25)


def _cp_case():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=16)
    batch = make_random_batch(spec, [SequenceShape(1, c) for c in (4, 17, 40)], seed=5)
    return spec, batch


def test_context_parallel_decode_takes_an_impl_instance():
    spec, batch = _cp_case()
    n = batch.num_actual_tokens
    by_name = local_decode_attention(batch.query[:n], batch.kv_cache, batch.common, spec, impl="reference")
    by_impl = local_decode_attention(batch.query[:n], batch.kv_cache, batch.common, spec, impl=ReferenceImpl(spec))
    assert torch.isfinite(by_name[0]).all() and torch.isfinite(by_name[1]).all()
    torch.testing.assert_close(by_impl[0], by_name[0], rtol=0, atol=0)
    torch.testing.assert_close(by_impl[1], by_name[1], rtol=0, atol=0)


def test_context_parallel_decode_rejects_an_impl_without_lse():
    spec, batch = _cp_case()

    class NoLSE(ReferenceImpl):
        can_return_lse = False

    with pytest.raises(ValueError, match="can_return_lse is False"):
        local_decode_attention(batch.query, batch.kv_cache, batch.common, spec, impl=NoLSE(spec))
