"""MLA on the GPU at DeepSeek-V3 dims (Lkv 512, R 64, P 128, V 128, page 64): every installed decode path
(triton_mla, flashinfer_mla) and prefill kernel (flash_attn, flashinfer, triton, sdpa) against the float64 oracle,
fp8 latent cache included. Run with `pytest -m gpu` on the GPU host."""

import dataclasses

import pytest
import torch

from attnbackends import DeviceInfo
from attnbackends.mla.backends import FlashInferMLABackend, TritonMLABackend
from attnbackends.ops.mla_cache import concat_and_cache_mla, concat_and_cache_mla_torch
from attnbackends.mla.decode_kernel import decode_kernel_name, default_decode_config, mla_decode_torch
from attnbackends.mla.decode_launch import mla_decode
from attnbackends.mla.prefill import available_prefill_kernels
from attnbackends.reference.mla import ReferenceMLABackend
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, run_mla_backend
from attnbackends.spec import AttentionSpec
from attnbackends.testing import SequenceShape as S
from attnbackends.testing import assert_close_to_oracle, tolerance_for

pytestmark = pytest.mark.gpu

HAS_CUDA = torch.cuda.is_available()
PREFILL = available_prefill_kernels(DeviceInfo.current(), torch.bfloat16) if HAS_CUDA else []
# decodes at page edges and long contexts, then chunked prefills whose contexts need >= 3 workspace chunks
SHAPES = [S(1, 0), S(1, 63), S(1, 64), S(1, 1000), S(1, 3001), S(37, 0), S(200, 1500), S(65, 2100)]
WORKSPACE = 1536  # 3 prefills -> 512 context tokens per request per chunk -> 5 chunks for 2100


def v3_spec(num_heads=16, kv_cache_dtype="auto"):
    return AttentionSpec.mla(num_heads, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, block_size=64)


def backends_for(kv_cache_dtype):
    out = [TritonMLABackend]
    if kv_cache_dtype == "auto":
        out.append(FlashInferMLABackend)
    return out


@pytest.fixture(scope="module")
def batches():
    return {
        kv: make_random_mla_batch(v3_spec(kv_cache_dtype=kv), SHAPES, seed=11, device="cuda", pad_tokens=5)
        for kv in ("auto", "fp8_e4m3")
    }


@pytest.fixture(scope="module")
def oracles(batches):
    return {kv: mla_oracle(b) for kv, b in batches.items()}


@pytest.mark.parametrize("prefill", ["flash_attn", "flashinfer", "triton", "sdpa"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", [TritonMLABackend, FlashInferMLABackend], ids=lambda b: b.name)
def test_mla_backend_on_gpu(backend, kv_cache_dtype, prefill, batches, oracles):
    if prefill not in PREFILL:
        pytest.skip(f"prefill kernel {prefill} is not available here (available: {PREFILL})")
    spec = batches[kv_cache_dtype].spec
    reasons = backend.not_supported_reasons(spec, DeviceInfo.current())
    if reasons:
        pytest.skip("; ".join(reasons))
    batch = batches[kv_cache_dtype]
    out, _ = run_mla_backend(backend, batch, builder_kwargs=dict(workspace_tokens=WORKSPACE, prefill_backend=prefill))
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    tol = tolerance_for(torch.bfloat16, kv_cache_dtype)
    assert_close_to_oracle(out[:n], oracles[kv_cache_dtype], tol, what=f"{backend.name}+{prefill}")
    assert torch.isnan(out[n:].float()).all()


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_triton_mla_at_128_heads_on_gpu(num_splits):
    """DeepSeek-V3's 128 heads: the decodes run on the default kernel for the GPU (the Gluon Hopper kernel on
    compute capability 9.0), the prefills behind them on the default prefill kernel, against the oracle."""
    batch = make_random_mla_batch(v3_spec(num_heads=128), SHAPES, seed=12, device="cuda", pad_tokens=5)
    out, _ = run_mla_backend(TritonMLABackend, batch, builder_kwargs=dict(
        workspace_tokens=WORKSPACE, **({"num_splits": num_splits} if num_splits else {})))
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], mla_oracle(batch), tolerance_for(torch.bfloat16), what="triton_mla 128 heads")
    assert torch.isnan(out[n:].float()).all()


@pytest.mark.parametrize("shapes,num_splits", [
    ([S(1, 4095)], 16),  # the host-bound B=1 step
    ([S(1, c) for c in (0, 63, 700, 3001)], None),  # the builder's split count, a request without context
    ([S(4, 500), S(2, 2000), S(1, 63)], 4),  # multi-token decodes
    ([S(1, c) for c in range(40, 40 * 41, 40)], 1),  # unsplit: the fused kernel on a 16-bit latent, 40 tokens
])
def test_fused_up_projection_equals_two_step_on_gpu(shapes, num_splits):
    """DeepSeek-V3 dims (128 heads, Lkv 512, R 64, page 64, bf16): the Triton absorption and the fused split
    reduction + up-projection against the matmuls and the two-step path (reduction kernel, torch.bmm) on the same
    decode, and both against the oracle."""
    depth = max(s.query_len for s in shapes) - 1  # multi-token decodes: a speculative spec reorders them first
    spec = v3_spec(num_heads=128)
    if depth:
        spec = spec.model_copy(update={"num_speculative_tokens": depth})
    batch = make_random_mla_batch(spec, shapes, seed=13, device="cuda", pad_tokens=3)
    kw = {"num_splits": num_splits} if num_splits else {}
    outs = {}
    for up, absorb in (("fused", "triton"), ("bmm", "bmm")):
        outs[up], _ = run_mla_backend(TritonMLABackend, batch,
                                      builder_kwargs=dict(up_projection=up, absorb=absorb, **kw))
    torch.cuda.synchronize()
    n = batch.num_actual_tokens
    want = mla_oracle(batch)
    for up, out in outs.items():
        assert_close_to_oracle(out[:n], want, tolerance_for(torch.bfloat16), what=f"triton_mla up_projection={up}")
        assert torch.isnan(out[n:].float()).all()
    # the same numerics up to the matmuls' summation order (and a latent or ql rounded the other way where the
    # float32 sums differ in their last bit)
    torch.testing.assert_close(outs["fused"][:n].float(), outs["bmm"][:n].float(), rtol=1.6e-2, atol=2e-3)


def test_reference_mla_on_gpu(batches, oracles):
    batch = batches["fp8_e4m3"]
    out, _ = run_mla_backend(ReferenceMLABackend, batch)
    assert_close_to_oracle(out[: batch.num_actual_tokens], oracles["fp8_e4m3"], tolerance_for(torch.bfloat16, "fp8"))


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kernel", ["pointer", "tma", "hopper"])
def test_decode_kernel_v3_dims(num_heads, num_splits, cache_dtype, kernel):
    g = torch.Generator().manual_seed(12)
    seq_lens = torch.tensor([1, 64, 65, 777, 4100], dtype=torch.int32)
    pages = (seq_lens + 63) // 64
    table = torch.randperm(int(pages.sum()) + 8, generator=g)[: int(pages.sum())]
    block_table = torch.zeros(5, int(pages.max()), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages.tolist()):
        block_table[i, :p] = table[at : at + p]
        at += p
    cache = (torch.randn(int(pages.sum()) + 8, 64, 576, generator=g) * 10).to(cache_dtype).cuda()
    k_scale = 0.1 if cache_dtype == torch.float8_e4m3fn else 1.0
    ql = torch.randn(5, num_heads, 512, generator=g).bfloat16().cuda()
    qpe = torch.randn(5, num_heads, 64, generator=g).bfloat16().cuda()
    out = torch.full((5, num_heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    config = dataclasses.replace(default_decode_config(num_heads), use_tma=kernel != "pointer",
                                 use_hopper=kernel == "hopper")
    if kernel == "hopper" and num_heads >= 64 and cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        runs = "hopper"
    elif cache_dtype != torch.bfloat16:
        runs = "pointer"
    else:
        runs = "tma" if kernel == "hopper" else kernel
    assert decode_kernel_name(ql, qpe, cache, config, tree=False) == runs
    mla_decode(ql, qpe, cache, block_table.cuda(), seq_lens.cuda(), out, scale=0.0722, k_scale=k_scale,
               num_splits=num_splits, config=config)
    want = torch.empty(5, num_heads, 512, dtype=torch.float32, device="cuda")
    mla_decode_torch(ql, qpe, cache, block_table.cuda(), seq_lens, want, scale=0.0722, k_scale=k_scale)
    torch.testing.assert_close(out.float(), want, atol=3e-2 * k_scale * 10, rtol=3e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_cache_write_on_gpu(cache_dtype):
    g = torch.Generator().manual_seed(13)
    kv_c, k_pe = torch.randn(50, 512, generator=g).bfloat16().cuda(), torch.randn(50, 64, generator=g).bfloat16().cuda()
    slots = torch.randperm(640, generator=g)[:50].cuda()
    slots[::7] = -1
    base = torch.randn(10, 64, 576, generator=g).to(cache_dtype).cuda()
    a, b = base.clone(), base.clone()
    concat_and_cache_mla(kv_c, k_pe, a, slots, k_scale=0.03)
    concat_and_cache_mla_torch(kv_c, k_pe, b, slots, k_scale=0.03)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_decode_equals_prefill_on_gpu():
    spec = v3_spec(num_heads=16)
    batch = make_random_mla_batch(spec, [S(1, c) for c in (5, 300, 2000)], seed=14, device="cuda")
    via_decode, _ = run_mla_backend(TritonMLABackend, batch)
    via_prefill, _ = run_mla_backend(TritonMLABackend, batch, decode_threshold=0, builder_kwargs=dict(workspace_tokens=1024))
    torch.testing.assert_close(via_decode.float(), via_prefill.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("max_q", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_hopper_kernel_on_nan_slots_and_bad_pages(max_q, num_splits):
    """The Gluon Hopper kernel with NaN in every slot past a sequence's end and page ids outside the cache (in a
    whole tile and in a partial last tile): finite, bit for bit the run with page 0 in their place, close to torch
    in output and to the Triton TMA kernel in output and LSE; one and several query tokens, with and without splits."""
    g = torch.Generator().manual_seed(21)
    seq_lens = torch.tensor([5, 64, 130, 700], dtype=torch.int32)
    batch, heads, pages = len(seq_lens), 128, (seq_lens + 63) // 64
    num_blocks = int(pages.sum()) + 4
    cache = (torch.randn(num_blocks, 64, 576, generator=g) * 3).bfloat16()
    good = torch.zeros(batch, int(pages.max()), dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # page 0 belongs to no request
    for i, (n, p) in enumerate(zip(seq_lens.tolist(), pages.tolist())):
        good[i, :p] = torch.tensor(order[:p], dtype=torch.int32)
        order = order[p:]
        cache[good[i, p - 1], n - (p - 1) * 64:] = float("nan")  # the slots past the end of its last page
    bad = good.clone()
    bad[3, 1] = num_blocks + 5  # a whole tile (TMA)
    bad[2, 2] = -1  # the partial last tile (pointer loads)
    substituted = torch.where((bad >= 0) & (bad < num_blocks), bad, 0)
    tokens = batch * max_q
    query_start = torch.arange(0, tokens + 1, max_q, dtype=torch.int32)
    ql = torch.randn(tokens, heads, 512, generator=g).bfloat16().cuda()
    qpe = torch.randn(tokens, heads, 64, generator=g).bfloat16().cuda()
    cache = cache.cuda()

    def run(table, hopper):
        config = dataclasses.replace(default_decode_config(heads), use_hopper=hopper)
        assert decode_kernel_name(ql, qpe, cache, config, False) == ("hopper" if hopper else "tma")
        out = torch.full((tokens, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((tokens, heads), float("nan"), device="cuda")
        mla_decode(ql, qpe, cache, table.cuda(), seq_lens.cuda(), out, scale=0.0722, num_splits=num_splits,
                   config=config, lse=lse, query_start_loc=query_start.cuda(), max_query_len=max_q)
        return out, lse

    if decode_kernel_name(ql, qpe, cache, default_decode_config(heads), tree=False) != "hopper":
        pytest.skip("the Gluon kernel needs compute capability 9.0 and triton.experimental.gluon")
    out, lse = run(bad, True)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    want_out, want_lse = run(substituted, True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    triton_out, triton_lse = run(substituted, False)
    torch.testing.assert_close(out.float(), triton_out.float(), atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(lse, triton_lse, atol=1e-3, rtol=1e-4)
    want = torch.empty(tokens, heads, 512, dtype=torch.float32, device="cuda")
    mla_decode_torch(ql, qpe, cache, substituted.cuda(), seq_lens, want, scale=0.0722,
                     query_lens_cpu=torch.full((batch,), max_q, dtype=torch.int32))
    torch.testing.assert_close(out.float(), want, atol=6e-2, rtol=3e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("query_len", [1, 2])
def test_folded_cache_write_on_gpu(kv_cache_dtype, query_len):
    """A decode-only triton_mla forward, eager, its cache write folded into the absorption's launch (Lkv 512: four
    write programs per token block): the cache afterwards bit for bit what ``concat_and_cache_mla`` writes (a token
    with slot -1 skipped, every slot no request reads keeps its poison), the same cache as the reference backend's,
    and the output the reference's within the oracle tolerance."""
    from attnbackends.ops.page_guard import raise_pending_faults
    from attnbackends.testing.mla import poison_unread_slots

    spec = v3_spec(num_heads=16, kv_cache_dtype=kv_cache_dtype)
    shapes = [S(query_len, c) for c in (0, 63, 64, 1000, 3001)]
    batch = make_random_mla_batch(spec, shapes, seed=17 + query_len, device="cuda", pad_tokens=3)
    n = batch.num_actual_tokens
    batch.common.slot_mapping[3] = -1
    batch.kv_cache = poison_unread_slots(batch.kv_cache, batch.common)
    builder = TritonMLABackend.get_builder_cls()(spec, "cuda")
    builder.decode_threshold = query_len
    assert builder.build(batch.common).decode.plan.writes_cache
    out, cache = run_mla_backend(TritonMLABackend, batch, decode_threshold=query_len)
    want = batch.kv_cache.clone()
    concat_and_cache_mla(batch.kv_c[:n], batch.k_pe[:n], want, batch.common.slot_mapping, batch.k_scale)
    torch.cuda.synchronize()
    raise_pending_faults("cuda")
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    ref, ref_cache = run_mla_backend(ReferenceMLABackend, batch, decode_threshold=query_len)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert_close_to_oracle(out[:n], ref[:n].double(), tolerance_for(spec.torch_dtype, kv_cache_dtype),
                           what="folded triton_mla against reference_mla")
    assert torch.isnan(out[n:].float()).all()


def test_folded_cache_write_reports_a_bad_slot_on_gpu():
    """An out-of-range slot in a folded decode-only forward: skipped (the other tokens written, no memory error) and
    raised at the next check point with the message of the separate write."""
    from attnbackends.ops.page_guard import PageTableError, raise_pending_faults

    spec = v3_spec(num_heads=16)
    batch = make_random_mla_batch(spec, [S(1, c) for c in (5, 300, 2000)], seed=19, device="cuda")
    meta = TritonMLABackend.get_builder_cls()(spec, "cuda").build(batch.common)
    assert meta.decode.plan.writes_cache
    num_slots = batch.kv_cache.shape[0] * spec.block_size
    skipped = batch.common.slot_mapping.clone()
    skipped[1] = -1
    meta.slot_mapping[1] = num_slots + 3
    impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    cache = batch.kv_cache.clone()
    impl.forward(batch.q, batch.kv_c, batch.k_pe, cache, meta, batch.new_output())
    torch.cuda.synchronize()
    with pytest.raises(PageTableError) as folded:
        raise_pending_faults("cuda")
    assert f"slot_mapping[1] = {num_slots + 3} is outside the KV cache's {num_slots} slots" in str(folded.value)
    want = batch.kv_cache.clone()
    concat_and_cache_mla(batch.kv_c, batch.k_pe, want, skipped)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    concat_and_cache_mla(batch.kv_c, batch.k_pe, batch.kv_cache.clone(), meta.slot_mapping)
    torch.cuda.synchronize()
    with pytest.raises(PageTableError) as separate:
        raise_pending_faults("cuda")
    assert str(separate.value) == str(folded.value)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_steps_keep_plans_and_prepared_launches_on_gpu(kv_cache_dtype, monkeypatch):
    """As an engine runs it: five steps of one decode batch on the same metadata buffers (the builder keeps the
    plan, so each layer's launches stay prepared), three layers with their own weights and caches, and every
    forward given fresh queries, new tokens and output (new addresses; from the fourth step on, queries with other
    strides). Each output matches reference_mla's on the same inputs, and each cache equals the reference's bit
    for bit after every step. The third and fifth steps run every layer as a prepared launch sequence."""
    from attnbackends.mla import backends as mla_backends

    sequences = []
    real_sequence = mla_backends.launch_prepared_sequence
    monkeypatch.setattr(mla_backends, "launch_prepared_sequence",
                        lambda *a: sequences.append(step) or real_sequence(*a))
    spec = v3_spec(num_heads=128, kv_cache_dtype=kv_cache_dtype)
    shapes = [S(1, c) for c in (63, 1000, 3001)]
    base = make_random_mla_batch(spec, shapes, seed=23, device="cuda", pad_tokens=2)
    n = base.num_actual_tokens
    layers = []
    for i in range(3):
        weights = make_random_mla_batch(spec, shapes[:1], seed=40 + i, device="cuda").kv_b_proj
        impls = []
        for backend in (TritonMLABackend, ReferenceMLABackend):
            impl = backend.get_impl_cls()(spec, kv_b_proj=weights, k_scale=base.k_scale)
            impl.process_weights_after_loading()
            impls.append(impl)
        layers.append((*impls, base.kv_cache.clone(), base.kv_cache.clone()))
    builder = TritonMLABackend.get_builder_cls()(spec, "cuda", up_projection="fused")
    ref_builder = ReferenceMLABackend.get_builder_cls()(spec, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)

    def fresh(*shape, wider=0):
        t = torch.randn(*shape[:-1], shape[-1] + wider, generator=gen, device="cuda", dtype=torch.bfloat16)
        return t[..., :shape[-1]]

    plans = []
    for step in range(5):
        meta, ref_meta = builder.build(base.common), ref_builder.build(base.common)
        plans.append(meta.decode.plan)
        for layer, (ours, ref, cache, ref_cache) in enumerate(layers):
            q = fresh(*base.q.shape, wider=8 if step >= 3 else 0)
            kv_c, k_pe = fresh(*base.kv_c.shape), fresh(*base.k_pe.shape)
            out, ref_out = base.new_output(), base.new_output()
            ours.forward(q, kv_c, k_pe, cache, meta, out)
            ref.forward(q, kv_c, k_pe, ref_cache, ref_meta, ref_out)
            torch.cuda.synchronize()
            assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)), (step, layer)
            assert_close_to_oracle(out[:n], ref_out[:n].double(), tolerance_for(spec.torch_dtype, kv_cache_dtype),
                                   what=f"triton_mla step {step} layer {layer}")
            assert torch.isnan(out[n:].float()).all()
    assert all(plan is plans[0] for plan in plans)
    assert meta.decode.plan.writes_cache and plans[0].launch.up_grid is not None and plans[0].num_splits > 1
    assert sequences == [2] * len(layers) + [4] * len(layers), sequences
