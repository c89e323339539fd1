"""MLA on the CPU: the reference backend and triton_mla (interpreted, tiny dims) against the naive float64 oracle;
chunked context (>= 3 workspace chunks), decode path == prefill path, the cache write, the kernels on their own."""

import math
import os

import pytest
import torch

from attnbackends import AttentionConfig, DeviceInfo, explain, select
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend, TritonMLAMetadataBuilder
from attnbackends.ops.mla_cache import concat_and_cache_mla, concat_and_cache_mla_torch
from attnbackends.mla.decode_kernel import MLADecodeConfig, mla_decode_torch
from attnbackends.mla.decode_launch import mla_decode
from attnbackends.mla.decode_plan import Absorption, UpProjection
from attnbackends.mla.prefill import SdpaPrefill, TritonPrefill
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.ops.quant import dequantize_from_cache
from attnbackends.spec import AttentionSpec
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import assert_close_to_oracle, tolerance_for

TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


def tiny_spec(dtype="float16", kv_cache_dtype="auto", block_size=8, num_heads=4):
    # Lkv 64, R 16, P 16, V 16: every power-of-two path of the kernels, small enough for the interpreter.
    return AttentionSpec.mla(
        num_heads, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
    )


# decodes (incl. a context-less one and page edges), a plain prefill, chunked prefills with long contexts
MIXED = [S(1, 0), S(1, 7), S(1, 8), S(1, 41), S(6, 0), S(5, 30), S(9, 17)]


def check(backend, batch, **kw):
    out, cache = run_mla_backend(backend, batch, **kw)
    n = batch.num_actual_tokens
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    assert_close_to_oracle(out[:n], mla_oracle(batch), tol, what=backend.name)
    assert torch.isnan(out[n:].float()).all(), "padding rows must stay untouched"
    return out, cache


def check_cache_written(batch, cache):
    slots = batch.common.slot_mapping[: batch.num_actual_tokens]
    bs = cache.shape[1]
    got = dequantize_from_cache(cache[slots // bs, slots % bs], torch.float64, batch.k_scale)
    want = torch.cat([x[s.context_len :] for x, s in zip(batch.dense_latent, batch.shapes)])
    if batch.spec.is_fp8_kv_cache:
        torch.testing.assert_close(got, want, rtol=0.13, atol=1e-3 * batch.k_scale)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_reference_mla_matches_oracle(dtype, kv_cache_dtype):
    batch = make_random_mla_batch(tiny_spec(dtype, kv_cache_dtype), MIXED, seed=1, pad_tokens=3)
    _, cache = check(ReferenceMLABackend, batch)
    check_cache_written(batch, cache)


@needs_triton
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,prefill",
    [("float16", "auto", "sdpa"), ("float16", "auto", "triton"), ("bfloat16", "auto", "triton"),
     ("bfloat16", "fp8_e4m3", "sdpa"), ("float16", "fp8_e5m2", "triton")],
)
def test_triton_mla_matches_oracle_with_context_chunks(dtype, kv_cache_dtype, prefill):
    spec = tiny_spec(dtype, kv_cache_dtype)
    batch = make_random_mla_batch(spec, MIXED, seed=2, pad_tokens=2)
    # 3 prefill requests share 16 workspace tokens: 5 per request, so the 30-token context needs 6 chunks.
    kw = dict(workspace_tokens=16, prefill_backend=prefill)
    meta = TritonMLAMetadataBuilder(spec, "cpu", **kw).build(batch.common)
    assert len(meta.prefill.chunks) >= 3
    assert all(c.total <= 16 for c in meta.prefill.chunks)
    _, cache = check(TritonMLABackend, batch, builder_kwargs=kw)
    check_cache_written(batch, cache)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("up_projection,absorb", [("fused", "triton"), ("bmm", "bmm")])
def test_triton_mla_decode_only_batches(num_splits, up_projection, absorb):
    spec = tiny_spec("bfloat16", block_size=16)
    batch = make_random_mla_batch(spec, [S(1, c) for c in (0, 15, 16, 47, 70)], seed=3, pad_tokens=2)
    kw = dict(num_splits=num_splits, up_projection=up_projection, absorb=absorb)
    plan = TritonMLAMetadataBuilder(spec, "cpu", **kw).build(batch.common).decode.plan
    assert plan.up_projection is UpProjection(up_projection) and plan.absorption is Absorption(absorb)
    assert plan.up_projection_reason == f"up_projection={up_projection!r}"
    assert plan.absorption_reason == f"absorb={absorb!r}"
    assert (plan.launch.up_grid is not None) == (up_projection == "fused")
    assert (plan.absorb_launch is not None) == (absorb == "triton")
    check(TritonMLABackend, batch, builder_kwargs=kw)


@needs_triton
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_decode_path_equals_prefill_path(kv_cache_dtype):
    """The absorbed decode and the up-projected prefill give the same numbers up to rounding (DESIGN.md)."""
    spec = tiny_spec("float16", kv_cache_dtype)
    batch = make_random_mla_batch(spec, [S(1, c) for c in (3, 9, 26, 40)], seed=4)
    via_decode, _ = run_mla_backend(TritonMLABackend, batch)
    via_prefill, _ = run_mla_backend(
        TritonMLABackend, batch, decode_threshold=0, builder_kwargs=dict(workspace_tokens=24, prefill_backend="triton")
    )
    torch.testing.assert_close(via_decode.float(), via_prefill.float(), atol=4e-3, rtol=4e-3)


def test_chunk_plan_covers_every_context_token_once():
    spec = tiny_spec()
    shapes = [S(1, 5), S(3, 0), S(4, 23), S(2, 9)]
    batch = make_random_mla_batch(spec, shapes, seed=5)
    builder = TritonMLAMetadataBuilder(spec, "cpu", workspace_tokens=9, prefill_backend="sdpa")
    meta = builder.build(batch.common)
    assert meta.decode.num_decodes == 1 and meta.prefill.num_prefills == 3
    got = torch.cat([c.slots for c in meta.prefill.chunks])
    want = []
    table = batch.common.block_table
    bs = spec.block_size
    contexts = [s.context_len for s in shapes[1:]]
    per_req = 9 // 3
    for start in range(0, max(contexts), per_req):
        for r, ctx in enumerate(contexts):
            for pos in range(start, min(ctx, start + per_req)):
                want.append(int(table[r + 1, pos // bs]) * bs + pos % bs)
    assert got.tolist() == want
    assert len(meta.prefill.chunks) == math.ceil(23 / per_req)


@needs_triton
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_cache_write_triton_equals_torch(cache_dtype):
    g = torch.Generator().manual_seed(6)
    kv_c, k_pe = torch.randn(7, 64, generator=g).half(), torch.randn(7, 16, generator=g).half()
    slots = torch.tensor([3, 17, -1, 0, 40, -1, 9])
    base = torch.randn(6, 8, 80, generator=g).to(cache_dtype)
    a, b = base.clone(), base.clone()
    concat_and_cache_mla(kv_c, k_pe, a, slots, k_scale=0.02, impl="triton")
    concat_and_cache_mla_torch(kv_c, k_pe, b, slots, k_scale=0.02)
    assert torch.equal(a.view(torch.uint8) if cache_dtype != torch.float16 else a,
                       b.view(torch.uint8) if cache_dtype != torch.float16 else b)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(a.view(48, 80)[untouched].float(), base.view(48, 80)[untouched].float())


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_kernel_matches_torch(num_splits, cache_dtype):
    g = torch.Generator().manual_seed(7)
    B, H, L, R, bs = 3, 5, 64, 16, 16
    seq_lens = torch.tensor([1, 33, 70], dtype=torch.int32)
    table = torch.randperm(16, generator=g)[: 3 * 5].view(3, 5).int()
    cache = (torch.randn(16, bs, L + R, generator=g) * 20).to(cache_dtype)
    ql = torch.randn(B, H, L, generator=g).bfloat16()
    qpe = torch.randn(B, H, R, generator=g).bfloat16()
    k_scale = 0.05 if cache_dtype == torch.float8_e4m3fn else 1.0
    lse = torch.empty(B, H)
    out = torch.empty(B, H, L, dtype=torch.bfloat16)
    mla_decode(ql, qpe, cache, table, seq_lens, out, scale=0.1, k_scale=k_scale, num_splits=num_splits, lse=lse,
               config=MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))
    want = torch.empty(B, H, L, dtype=torch.float32)
    mla_decode_torch(ql, qpe, cache, table, seq_lens, want, scale=0.1, k_scale=k_scale)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(lse).all()


@needs_triton
def test_many_split_reduction_covers_every_latent_column():
    """40 splits of a 512-wide latent: the reduction runs in column blocks (no register spills on the GPU); every
    column of the NaN-poisoned output is written and equals the torch reference, and the LSE is finite."""
    g = torch.Generator().manual_seed(11)
    B, H, L, R, bs = 2, 4, 512, 16, 16
    seq_lens = torch.tensor([120, 97], dtype=torch.int32)
    table = torch.randperm(16, generator=g)[:16].view(2, 8).int()
    cache = torch.randn(16, bs, L + R, generator=g).bfloat16()
    ql = torch.randn(B, H, L, generator=g).bfloat16()
    qpe = torch.randn(B, H, R, generator=g).bfloat16()
    lse = torch.full((B, H), float("nan"))
    out = torch.full((B, H, L), float("nan"), dtype=torch.bfloat16)
    mla_decode(ql, qpe, cache, table, seq_lens, out, scale=0.05, num_splits=40, lse=lse,
               config=MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))
    want = torch.empty(B, H, L, dtype=torch.float32)
    mla_decode_torch(ql, qpe, cache, table, seq_lens, want, scale=0.05)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.isfinite(lse).all()


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_tma_decode_kernel_matches_torch_with_poisoned_tails(num_splits):
    """The TMA kernel (whole tiles by tensor descriptor, the partial last tile by masked loads): every cache row
    that no request owns, including the rows past each request's end in its last page, is NaN."""
    from attnbackends.mla.decode_kernel import tma_decode_applies

    g = torch.Generator().manual_seed(11)
    B, H, L, R, bs = 3, 5, 64, 16, 32
    seq_lens = torch.tensor([1, 64, 75], dtype=torch.int32)  # a lone key, whole pages, a partial tile
    table = torch.randperm(12, generator=g)[: 3 * 3].view(3, 3).int()
    cache = torch.full((12, bs, L + R), float("nan")).bfloat16()
    for i, n in enumerate(seq_lens.tolist()):
        rows = cache[table[i].long()].view(-1, L + R)
        rows[:n] = (torch.randn(n, L + R, generator=g) * 3).bfloat16()
        cache[table[i].long()] = rows.view(-1, bs, L + R)
    ql = torch.randn(B, H, L, generator=g).bfloat16()
    qpe = torch.randn(B, H, R, generator=g).bfloat16()
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, use_tma=True)
    assert tma_decode_applies(ql, qpe, cache, config)
    lse = torch.full((B, H), float("nan"))
    out = torch.full((B, H, L), float("nan"), dtype=torch.bfloat16)
    mla_decode(ql, qpe, cache, table, seq_lens, out, scale=0.1, num_splits=num_splits, lse=lse, config=config)
    want = torch.empty(B, H, L, dtype=torch.float32)
    mla_decode_torch(ql, qpe, cache, table, seq_lens, want, scale=0.1)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    for i, n in enumerate(seq_lens.tolist()):  # the natural-log LSE of the scaled scores
        latent = cache[table[i].long()].view(-1, L + R)[:n].float()
        scores = torch.cat([ql[i], qpe[i]], -1).float() @ latent.T * 0.1
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), atol=1e-3, rtol=1e-3)


@needs_triton
def test_triton_ragged_prefill_matches_torch_with_empty_requests():
    g = torch.Generator().manual_seed(8)
    H, Dqk, Dv = 3, 24, 16  # 24 = 16 + 8: the split qk head path
    cu_q = torch.tensor([0, 5, 6, 6, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 9, 12, 30], dtype=torch.int32)  # request 0 has no keys
    q = torch.randn(20, H, Dqk, generator=g).half()
    k = torch.randn(30, H, Dqk, generator=g).half()
    v = torch.randn(30, H, Dv, generator=g).half()
    for causal, ck in ((False, cu_k), (True, cu_q)):
        args = dict(causal=causal, scale=0.2, num_heads=H, head_dim_qk=Dqk, head_dim_v=Dv, dtype=torch.float16)
        tri, ref = TritonPrefill(torch.device("cpu")), SdpaPrefill(torch.device("cpu"))
        kk, vv = (k, v) if not causal else (k[:20], v[:20])
        o1, l1 = tri.run(tri.plan(cu_q, ck, **args), q, kk, vv)
        o2, l2 = ref.run(ref.plan(cu_q, ck, **args), q, kk, vv)
        torch.testing.assert_close(o1.float(), o2.float(), atol=3e-3, rtol=3e-3)
        assert torch.equal(torch.isinf(l1), torch.isinf(l2))
        fin = torch.isfinite(l2)
        torch.testing.assert_close(l1[fin], l2[fin], atol=1e-3, rtol=1e-3)
        if not causal:
            assert torch.isinf(l1[:, :5]).all() and (o1[:5] == 0).all()


def test_selection_and_layout():
    spec = AttentionSpec.mla(16)
    assert select(spec, DeviceInfo.cpu(triton_interpreted=False)).name == "reference_mla"
    assert select(spec, DeviceInfo.cpu(), AttentionConfig(backend="triton_mla")).name == "triton_mla" or not TRITON_OK
    table = {row.name: row.reasons for row in explain(spec, DeviceInfo.cuda(8, 0)).rows}
    assert any("compute capability" in r for r in table["flashinfer_mla"])
    assert not table["triton_mla"]
    odd = AttentionSpec.mla(16, kv_lora_rank=256)
    assert any("kv_lora_rank" in r for r in FlashInferMLABackend.not_supported_reasons(odd, DeviceInfo.cuda(9, 0)))
    fp8 = AttentionSpec.mla(16, kv_cache_dtype="fp8")
    assert any("kv_cache_dtype" in r for r in FlashInferMLABackend.not_supported_reasons(fp8, DeviceInfo.cuda(9, 0)))
    for backend in (ReferenceMLABackend, TritonMLABackend, FlashInferMLABackend):
        assert backend.kv_cache_shape(10, spec) == (10, spec.block_size, 576)
        assert backend.not_supported_reasons(AttentionSpec(num_heads=4, num_kv_heads=4, head_size=64), DeviceInfo.cuda(9, 0))


def test_impl_rejects_bad_weights():
    spec = tiny_spec()
    with pytest.raises(ValueError, match="kv_b_proj"):
        TritonMLABackend.get_impl_cls()(spec, kv_b_proj=torch.zeros(3, 64))


def test_weight_absorption_shapes():
    spec = tiny_spec("float32")
    batch = make_random_mla_batch(spec, [S(1, 3)], seed=9)
    impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    assert impl.W_UK_T.shape == (4, 16, 64) and impl.W_UV.shape == (4, 64, 16)
    x = torch.randn(2, 64)
    full = (x @ batch.kv_b_proj.T).view(2, 4, 32)
    torch.testing.assert_close(torch.einsum("tl,npl->tnp", x, impl.W_UK_T), full[..., :16])
    torch.testing.assert_close(torch.einsum("tl,nlv->tnv", x, impl.W_UV), full[..., 16:])


def test_prefill_kernel_choice_respects_head_dims(monkeypatch):
    """Library prefill kernels are only picked for the head sizes they are built for (others fail to compile)."""
    import attnbackends.mla.prefill as prefill
    from attnbackends import DeviceInfo

    monkeypatch.setattr(prefill, "package_available", lambda name: name == "flashinfer")
    h100 = DeviceInfo.cuda(9, 0)
    assert "flashinfer" in prefill.available_prefill_kernels(h100, torch.bfloat16, (192, 128))
    assert "flashinfer" not in prefill.available_prefill_kernels(h100, torch.bfloat16, (48, 32))
    assert prefill.select_prefill_kernel(h100, torch.bfloat16, "auto", (48, 32)) == "triton"


@pytest.mark.parametrize("batch, seq_len", [(1, 32768), (4, 32768), (8, 32768), (1, 300), (30, 8192), (64, 4096)])
def test_split_count_fills_one_wave(batch, seq_len):
    """128 heads in 64-row blocks on 132 SMs: grids under half the SMs split up to one full wave and never past it
    (a decode program holds a whole SM), at most one split per 256 tokens and 64 splits; fuller grids do not split."""
    from attnbackends.mla.decode_kernel import choose_num_splits

    config = MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    splits = choose_num_splits(batch, 128, seq_len, 132, config)
    programs = batch * 2
    if 2 * programs >= 132:
        assert splits == 1
    else:
        assert programs * splits <= 132 and splits <= min(64, -(-seq_len // 256))
        assert programs * (splits + 1) > 132 or splits == min(64, -(-seq_len // 256))



@pytest.mark.parametrize("kv_cache_dtype, heads, block_size, cc, kernel", [
    ("auto", 128, 64, (9, 0), "Gluon Hopper kernel (warp-specialised"),
    ("fp8_e4m3", 128, 64, (9, 0), "Gluon Hopper kernel (warp-specialised"),
    ("fp8_e5m2", 128, 64, (9, 0), "a float8_e5m2 latent cache (needs float16, bfloat16 or float8_e4m3fn) rules out"),
    ("auto", 16, 64, (9, 0), "16 heads (< 64) rules out"),
    ("auto", 128, 16, (9, 0), "page size 16 (not a multiple of 64) rules out"),
    ("auto", 128, 64, (8, 0), "compute capability is not 9.0 rules out"),
])
def test_explain_names_the_mla_decode_kernel(kv_cache_dtype, heads, block_size, cc, kernel):
    from attnbackends.compat import gluon_available

    if not gluon_available() and "Gluon Hopper kernel (warp" in kernel:
        kernel = "triton.experimental.gluon is not installed"
    spec = AttentionSpec.mla(heads, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    result = explain(spec, DeviceInfo.cuda(*cc), AttentionConfig(backend="triton_mla"))
    assert any(note.startswith("triton_mla: decode kernel") and kernel in note for note in result.notes), result.notes
    assert "triton_mla: decode kernel" in str(result)


class FakeMLAWrapper:
    """Stand-in for flashinfer.mla.BatchMLAPagedAttentionWrapper in float64: request r's queries
    ``qo_indptr[r]:qo_indptr[r + 1]`` over its ``kv_len[r]`` keys in pages ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``,
    logits ``(q_nope . ckv + q_pe . kpe) * sm_scale``, causal with the queries aligned to the last keys, output
    ``softmax . ckv``."""

    def __init__(self, workspace, backend="auto"):
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type):
        self.planned = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len,
                            page_size=page_size, causal=causal, sm_scale=sm_scale)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out):
        p = self.planned
        qo, kv, ids, lens = (p[k].tolist() for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len"))
        for r in range(len(lens)):
            pages = ids[kv[r] : kv[r + 1]]
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[: lens[r]].double()  # [L, Lkv]
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[: lens[r]].double()
            rows = slice(qo[r], qo[r + 1])
            s = (q_nope[rows].double() @ ckv.T + q_pe[rows].double() @ kpe.T) * p["sm_scale"]  # [Q, N, L]
            nq = qo[r + 1] - qo[r]
            pos_q = torch.arange(lens[r] - nq, lens[r])[:, None, None]
            s = s.masked_fill(torch.arange(lens[r])[None, None, :] > pos_q, float("-inf"))
            out[rows] = (torch.softmax(s, dim=-1) @ ckv).to(out.dtype)
        return out


@pytest.mark.parametrize("shapes, threshold, num_decodes", [
    (MIXED, 1, 4),  # one-token decodes (page edges, a context-less one), then prefills with and without context
    ([S(3, 9), S(2, 30), S(3, 0)], 3, 3),  # multi-token decodes alone: planned causal
])
def test_flashinfer_mla_through_a_stand_in(monkeypatch, shapes, threshold, num_decodes):
    """flashinfer_mla's builder and impl on the CPU through a stand-in flashinfer.mla: the planned page table is the
    brute-force one (int32, on the CPU), and the output matches the oracle."""
    import importlib.machinery
    import sys
    import types

    fi = types.ModuleType("flashinfer")
    fi.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    fi.mla = types.ModuleType("flashinfer.mla")
    fi.mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", fi.mla)
    spec = tiny_spec("bfloat16")
    batch = make_random_mla_batch(spec, shapes, seed=len(shapes))
    check(FlashInferMLABackend, batch, decode_threshold=threshold)

    builder = FlashInferMLABackend.get_builder_cls()(spec, "cpu")
    builder.decode_threshold = threshold
    planned = builder.build(batch.common).decode.plan.wrapper.planned
    lens = batch.common.seq_lens_cpu[:num_decodes].tolist()
    pages = [-(-n // spec.block_size) for n in lens]
    table = batch.common.block_table.tolist()
    assert planned["qo_indptr"].tolist() == batch.common.query_start_loc_cpu[: num_decodes + 1].tolist()
    assert planned["kv_indptr"].tolist() == torch.tensor([0] + pages).cumsum(0).tolist()
    assert planned["kv_indices"].tolist() == [p for r, n in enumerate(pages) for p in table[r][:n]]
    assert planned["kv_len"].tolist() == lens and planned["causal"] == (threshold > 1)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len"):
        assert planned[name].dtype == torch.int32 and planned[name].device.type == "cpu", name
