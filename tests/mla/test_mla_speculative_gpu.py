"""Speculative decoding on the GPU MLA backends at DeepSeek-V3 dims (Lkv 512, R 64, P 128, V 128, page 64) against
the float64 oracle: uniform 1 + 3 and mixed-length multi-token decodes (triton_mla, flashinfer_mla), tree
verification (triton_mla; flashinfer_mla declines trees), the default kernels (at 128 heads on Hopper the Gluon
kernel serves every decode but a tree), split-KV and the fp8 latent cache. Run with `pytest -m gpu tests/mla/test_mla_speculative_gpu.py` on the GPU host."""

import random

import pytest
import torch

from attnbackends import DeviceInfo
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.spec import AttentionSpec
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import assert_close_to_oracle, tolerance_for
from attnbackends.testing.cases import EAGLE_TREE_8, random_tree_parents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONTEXTS = (0, 63, 64, 1000, 3001, 130)


def v3_spec(depth, tree, kv_cache_dtype="auto", num_heads=16):
    return AttentionSpec.mla(num_heads, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, block_size=64,
                             num_speculative_tokens=depth, speculative_tree=tree)


def _check(backend, batch, **builder_kwargs):
    reasons = backend.not_supported_reasons(batch.spec, DeviceInfo.current())
    if reasons:
        pytest.skip(f"{backend.name}: {'; '.join(reasons)}")
    out, _ = run_mla_backend(backend, batch, builder_kwargs=builder_kwargs)
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], mla_oracle(batch), tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype),
                           what=backend.name)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("backend", [TritonMLABackend, FlashInferMLABackend], ids=lambda b: b.name)
def test_uniform_1_plus_3_decode(backend, num_heads, num_splits):
    if backend is FlashInferMLABackend and num_splits is not None:
        pytest.skip("split count is a triton_mla option")
    batch = make_random_mla_batch(v3_spec(3, False, num_heads=num_heads), [S(4, c) for c in CONTEXTS], seed=1,
                                  device="cuda", pad_tokens=3)
    _check(backend, batch, **({"num_splits": num_splits} if num_splits else {}))


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", [TritonMLABackend, FlashInferMLABackend], ids=lambda b: b.name)
def test_mixed_length_decodes_with_prefills_behind(backend, kv_cache_dtype, num_heads):
    shapes = [S(q, c) for q, c in zip((2, 8, 1, 5, 3, 8), CONTEXTS)] + [S(37, 0), S(200, 1500)]
    batch = make_random_mla_batch(v3_spec(7, False, kv_cache_dtype, num_heads=num_heads), shapes, seed=2,
                                  device="cuda", pad_tokens=5)
    _check(backend, batch)


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_mla_tree_verify(kv_cache_dtype, num_splits):
    rng = random.Random(3)
    trees = [list(EAGLE_TREE_8), random_tree_parents(rng, 8), list(range(-1, 7)), random_tree_parents(rng, 8),
             list(EAGLE_TREE_8), [-1, 0, 0, 1]]
    shapes = [S(8, c) for c in CONTEXTS] + [S(65, 2100)]
    batch = make_random_mla_batch(v3_spec(7, True, kv_cache_dtype), shapes, seed=3, device="cuda", pad_tokens=2,
                                  tree_parents=trees + [None])
    _check(TritonMLABackend, batch, **({"num_splits": num_splits} if num_splits else {}))


def test_triton_mla_64_token_trees_at_128_heads():
    rng = random.Random(4)
    shapes = [S(64, 4000), S(64, 10), S(30, 700)]
    trees = [random_tree_parents(rng, 64), random_tree_parents(rng, 64), random_tree_parents(rng, 30)]
    batch = make_random_mla_batch(v3_spec(63, True, num_heads=128), shapes, seed=4, device="cuda", tree_parents=trees)
    _check(TritonMLABackend, batch)
