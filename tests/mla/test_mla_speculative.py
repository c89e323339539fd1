"""Speculative decoding on the MLA backends (CPU: reference_mla, triton_mla interpreted at tiny dims) against the
float64 naive oracle: multi-token decodes (uniform 1 + k and mixed lengths) and tree verification on the decode
path, split-KV and the TMA kernel included; what each MLA builder declares and what it refuses."""

import os
import random

import pytest
import torch

from attnbackends import DeviceInfo, explain
from attnbackends.interface import QueryLenSupport
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend, TritonMLAMetadataBuilder
from attnbackends.mla.decode_kernel import MLADecodeConfig
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.speculative.tree_mask import chain_parents
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.spec import AttentionSpec
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import assert_close_to_oracle, tolerance_for
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


def spec_of(dtype="float16", kv_cache_dtype="auto", block_size=16, num_heads=4, depth=7, tree=True):
    return AttentionSpec.mla(
        num_heads, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_speculative_tokens=depth, speculative_tree=tree,
    )


def check(backend, batch, **kw):
    out, _ = run_mla_backend(backend, batch, **kw)
    n = batch.num_actual_tokens
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    want = mla_oracle(batch)
    assert_close_to_oracle(out[:n], want, tol, what=backend.name)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    return out, want


CONTEXTS = (0, 7, 16, 41)
# a verify request per context: EAGLE-like tree, a chain, a random tree, a draft segment shorter than the query
TREES = [list(EAGLE_TREE_8), chain_parents(8), random_tree_parents(random.Random(1), 8), [-1, 0, 0, 1]]


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "fp8_e4m3")])
def test_reference_mla_tree_verify(dtype, kv_cache_dtype):
    spec = spec_of(dtype, kv_cache_dtype)
    shapes = [S(8, c) for c in CONTEXTS] + [S(1, 5), S(12, 9)]
    batch = make_random_mla_batch(spec, shapes, seed=1, pad_tokens=2, tree_parents=TREES + [None, None])
    out, want = check(ReferenceMLABackend, batch)
    causal = mla_oracle(make_random_mla_batch(spec, shapes, seed=1, pad_tokens=2))
    assert not torch.allclose(want, causal), "the tree must change the answer (else the test cannot fail)"


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("use_tma", [False, True])
def test_triton_mla_uniform_multi_token_decode(num_splits, use_tma):
    spec = spec_of("bfloat16", depth=3, tree=False)
    batch = make_random_mla_batch(spec, [S(4, c) for c in CONTEXTS], seed=2, pad_tokens=3)
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, use_tma=use_tma)
    meta = TritonMLAMetadataBuilder(spec, "cpu", num_splits=num_splits, decode_config=config).build(batch.common)
    assert meta.decode.num_decodes == 4 and meta.prefill is None and meta.decode.max_query_len == 4
    check(TritonMLABackend, batch, builder_kwargs=dict(num_splits=num_splits, decode_config=config))


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fused_up_projection_equals_two_step_on_tree_verify(num_splits):
    """Varlen multi-token decodes with a tree: the Triton absorption with the fused split reduction +
    up-projection, and the matmuls with the two-step path (reduction kernel, torch.bmm), both match the oracle and
    each other."""
    spec = spec_of("bfloat16", depth=7)
    shapes = [S(8, 7), S(1, 20), S(4, 33)]
    batch = make_random_mla_batch(spec, shapes, seed=9, pad_tokens=2, tree_parents=[TREES[0], None, TREES[3]])
    outs = {}
    for up, absorb in (("fused", "triton"), ("bmm", "bmm")):
        outs[up], _ = check(TritonMLABackend, batch, builder_kwargs=dict(num_splits=num_splits, up_projection=up,
                                                                         absorb=absorb))
    n = batch.num_actual_tokens
    torch.testing.assert_close(outs["fused"][:n].float(), outs["bmm"][:n].float(), rtol=2e-2, atol=2e-2)


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_mla_varlen_decodes_with_a_prefill_behind(kv_cache_dtype):
    spec = spec_of("float16", kv_cache_dtype, depth=5, tree=False)
    shapes = [S(3, 9), S(1, 30), S(6, 0), S(2, 17), S(9, 12)]  # the 9-token request is a chunked prefill
    batch = make_random_mla_batch(spec, shapes, seed=3, pad_tokens=1)
    meta = TritonMLAMetadataBuilder(spec, "cpu").build(batch.common)
    assert meta.decode.num_decodes == 4 and meta.prefill.num_prefills == 1
    check(TritonMLABackend, batch, builder_kwargs=dict(prefill_backend="sdpa"))


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("use_tma", [False, True])
def test_triton_mla_tree_verify(num_splits, use_tma):
    spec = spec_of("bfloat16")
    shapes = [S(8, c) for c in CONTEXTS] + [S(1, 20), S(10, 3)]
    batch = make_random_mla_batch(spec, shapes, seed=4, pad_tokens=2, tree_parents=TREES + [None, None])
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, use_tma=use_tma)
    kw = dict(num_splits=num_splits, decode_config=config, prefill_backend="sdpa")
    check(TritonMLABackend, batch, builder_kwargs=kw)


@needs_triton
def test_triton_mla_deep_random_trees_many_heads():
    """24-token trees x 6 heads = 144 rows per request: several row blocks, some past a shorter request's tokens."""
    rng = random.Random(5)
    spec = spec_of("float16", num_heads=6, depth=23)
    shapes = [S(24, 33), S(5, 2), S(17, 50)]
    trees = [random_tree_parents(rng, 24), random_tree_parents(rng, 5), random_tree_parents(rng, 12)]
    check(TritonMLABackend, make_random_mla_batch(spec, shapes, seed=5, tree_parents=trees))


@needs_triton
def test_decode_path_equals_prefill_path_for_multi_token_decodes():
    """Verify tokens through the absorbed decode kernel and through the up-projected prefill path agree."""
    spec = spec_of("float16", depth=3, tree=False)
    batch = make_random_mla_batch(spec, [S(4, c) for c in (3, 9, 26)], seed=6)
    via_decode, _ = run_mla_backend(TritonMLABackend, batch)
    via_prefill, _ = run_mla_backend(TritonMLABackend, batch, decode_threshold=0,
                                     builder_kwargs=dict(prefill_backend="sdpa"))
    torch.testing.assert_close(via_decode.float(), via_prefill.float(), atol=4e-3, rtol=4e-3)


def test_a_tree_on_a_prefill_request_is_refused():
    spec = spec_of("float16", depth=3)
    batch = make_random_mla_batch(spec, [S(4, 5), S(8, 3)], seed=7, tree_parents=[None, list(EAGLE_TREE_8)])
    with pytest.raises(ValueError, match="request 1 has a tree mask but query_len 8 > the builder's"):
        TritonMLAMetadataBuilder(spec, "cpu").build(batch.common)


def test_builders_declare_their_speculative_support():
    assert TritonMLABackend.get_builder_cls().query_len_support is QueryLenSupport.VARLEN
    assert TritonMLABackend.get_builder_cls().supports_tree_mask
    fi = FlashInferMLABackend.get_builder_cls()
    assert fi.query_len_support is QueryLenSupport.VARLEN and not fi.supports_tree_mask
    h100 = DeviceInfo.cuda(9, 0)
    chain = AttentionSpec.mla(16, num_speculative_tokens=3)
    tree = AttentionSpec.mla(16, num_speculative_tokens=3, speculative_tree=True)
    rows = {r.name: r.reasons for r in explain(tree, h100).rows}
    assert not rows["triton_mla"] and not rows["reference_mla"]
    assert any("takes no custom mask" in r for r in rows["flashinfer_mla"])
    assert not [r for r in FlashInferMLABackend.not_supported_reasons(chain, h100) if "speculative" in r]
    too_deep = AttentionSpec.mla(16, num_speculative_tokens=64)
    assert any("needs decodes of 65 tokens" in r for r in TritonMLABackend.not_supported_reasons(too_deep, h100))


def test_capabilities_say_what_each_builder_serves():
    assert TritonMLABackend.capabilities()["speculative"] == "any mix of decodes of up to 64 tokens; tree masks"
    assert FlashInferMLABackend.capabilities()["speculative"].endswith("no tree masks")
