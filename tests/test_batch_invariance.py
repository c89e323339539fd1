"""Batch invariance: a request's output does not depend on the rest of its batch.

A request is run alone and inside bigger batches (other decodes and prefills around it, padding after it) with the
same query, keys, values and pages; its output rows must agree within tolerance for every backend, and bitwise for
the Triton backend in deterministic mode (``TritonMetadataBuilder(..., deterministic=True)``: no split-KV, one tile
config fixed by the spec; README "Integrating an engine").
"""

import dataclasses

import pytest
import torch

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.testing.mla import make_random_mla_batch, run_mla_backend
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import make_random_batch, run_backend_on_batch, tolerance_for
from attnbackends.triton.backend import TritonAttentionBackend, TritonMetadataBuilder

BS = 16
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16", block_size=BS)
MLA_SPEC = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                             dtype="float16", block_size=BS)

# (batch shapes, index of the request under test): the request is a decode or a (chunked) prefill, first, in the
# middle or last, next to short and long neighbours.
BATCHES = [
    ([S(1, 5), S(1, 40), S(1, 17), S(6, 0), S(20, 33)], 1),
    ([S(1, 70), S(1, 3), S(9, 16), S(3, 2)], 0),
    ([S(1, 8), S(5, 30), S(17, 0)], 1),
    ([S(1, 2), S(1, 9), S(2, 45), S(12, 12), S(1 + BS, 0)], 3),
]


def sub_batch(batch, index):
    """The request ``index`` of ``batch`` alone: same query/keys/values, same pages, same cache contents."""
    qsl = batch.common.query_start_loc_cpu.tolist()
    rows = slice(qsl[index], qsl[index + 1])
    shape = batch.shapes[index]
    pages = -(-shape.seq_len // batch.spec.block_size)
    table = batch.common.block_table[index, :pages].tolist()
    common = build_common_metadata([shape.query_len], [shape.context_len], [table], batch.spec.block_size,
                                   batch.common.device)
    fields = dict(shapes=[shape], common=common)
    if hasattr(batch, "dense_keys"):
        fields.update(query=batch.query[rows], key=batch.key[rows], value=batch.value[rows],
                      dense_keys=[batch.dense_keys[index]], dense_values=[batch.dense_values[index]])
    else:
        fields.update(q=batch.q[rows], kv_c=batch.kv_c[rows], k_pe=batch.k_pe[rows],
                      dense_latent=[batch.dense_latent[index]])
    return dataclasses.replace(batch, **fields), rows


def run_triton(batch, deterministic):
    builder = TritonMetadataBuilder(batch.spec, batch.query.device, deterministic=deterministic)
    impl = TritonAttentionBackend.get_impl_cls()(batch.spec, k_scale=batch.k_scale, v_scale=batch.v_scale)
    out = batch.new_output()
    impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), builder.build(batch.common), out)
    return out


@pytest.mark.parametrize("case", range(len(BATCHES)))
@pytest.mark.parametrize("backend", [ReferenceBackend, TritonAttentionBackend], ids=lambda b: b.name)
def test_output_within_tolerance_of_the_request_alone(backend, case):
    shapes, index = BATCHES[case]
    batch = make_random_batch(SPEC, shapes, seed=case, pad_tokens=3)
    alone, rows = sub_batch(batch, index)
    together, _ = run_backend_on_batch(backend, batch)
    single, _ = run_backend_on_batch(backend, alone)
    tol = tolerance_for(SPEC.torch_dtype)
    torch.testing.assert_close(together[rows], single, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("case", range(len(BATCHES)))
def test_triton_deterministic_mode_is_bitwise_batch_invariant(case, kv_cache_dtype):
    spec = SPEC.model_copy(update={"kv_cache_dtype": kv_cache_dtype})
    shapes, index = BATCHES[case]
    batch = make_random_batch(spec, shapes, seed=case, pad_tokens=3)
    alone, rows = sub_batch(batch, index)
    together = run_triton(batch, deterministic=True)
    single = run_triton(alone, deterministic=True)
    assert torch.equal(together[rows], single), (together[rows].float() - single.float()).abs().max()


def test_deterministic_builder_fixes_splits_and_config():
    builder = TritonMetadataBuilder(SPEC, "cpu", deterministic=True)
    short = builder.build(make_random_batch(SPEC, [S(1, 3)]).common)
    long = builder.build(make_random_batch(SPEC, [S(1, 3), S(40, 90)]).common)
    assert short.num_kv_splits == long.num_kv_splits == 1 and short.workspace is None
    assert short.config is not None and short.config == long.config
    free = TritonMetadataBuilder(SPEC, "cpu")
    free_short = free.build(make_random_batch(SPEC, [S(1, 3)]).common)
    free_long = free.build(make_random_batch(SPEC, [S(1, 3), S(40, 90)]).common)
    assert free_short.config != free_long.config  # picked per batch outside deterministic mode


@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("backend", [ReferenceMLABackend, TritonMLABackend], ids=lambda b: b.name)
def test_mla_output_within_tolerance_of_the_request_alone(backend, case):
    shapes, index = BATCHES[case]
    batch = make_random_mla_batch(MLA_SPEC, shapes, seed=case, pad_tokens=2)
    alone, rows = sub_batch(batch, index)
    together, _ = run_mla_backend(backend, batch)
    single, _ = run_mla_backend(backend, alone)
    tol = tolerance_for(MLA_SPEC.torch_dtype)
    torch.testing.assert_close(together[rows], single, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_deterministic_mode_is_bitwise_on_gpu(kv_cache_dtype):
    """On the GPU the default mode splits a lone long decode's keys (split-KV) but not a big batch's; deterministic
    mode must give the request the same bits either way."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16,
                         kv_cache_dtype=kv_cache_dtype)
    shapes = [S(1, 3000 + 37 * i) for i in range(48)] + [S(300, 700), S(64, 0)]
    for index in (0, 17, 48):
        batch = make_random_batch(spec, shapes, seed=index, device="cuda", pad_tokens=8)
        alone, rows = sub_batch(batch, index)
        together = run_triton(batch, deterministic=True)
        single = run_triton(alone, deterministic=True)
        assert torch.equal(together[rows], single)
