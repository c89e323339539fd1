"""KV-cache formats with scales beside their pages (per-token-head fp8 / int8 / int4, NVFP4): layout, quantise on
write (torch and the Triton write kernel, bit for bit), the reference read against the float64 oracle (bounded by
the format's quantisation error), the Triton reads against the reference over the same quantised cache, prefills
over their pages dequantised into a 16-bit scratch (on the CPU the unified kernel over the scratch stands in for the
paged Gluon kernel the GPU runs), and what declines them. CPU: the reference, Triton interpreted at tiny shapes."""

from __future__ import annotations

import math

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo, build_common_metadata, explain
from attnbackends.layer_groups import LayerGroupsConfig, group_layers
from attnbackends.ops.kv_cache_write import reshape_and_cache, reshape_and_cache_torch
from attnbackends.ops.kv_layout import kv_cache_bytes_per_token, kv_page_layout, kv_scale_views
from attnbackends.ops.kv_quant import dequantize_token_heads, quantize_token_heads
from attnbackends.reference.backend import ReferenceBackend
from attnbackends.selection.registry import get_backend_class, has_native_fp4
from attnbackends.spec import KVCacheFormat
from attnbackends.triton.backend import TritonAttentionBackend
from attnbackends.triton.choices import QuantisedPrefill
from attnbackends.triton.kv_dequant import dequantise_pages_torch
from attnbackends.triton.step_plan import LaunchKind

FORMATS = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4")
#: Relative Frobenius error of the reference over a quantised cache against the float64 oracle over the exact keys
#: (random normal data): the format's quantisation error, loosely.
ORACLE_BOUND = {"fp8_per_token_head": 0.06, "int8_per_token_head": 0.012, "int4_per_token_head": 0.2, "nvfp4": 0.2}
#: Triton against the reference reading the same quantised cache (float16 dots): tight.
TRITON_REL, TRITON_ATOL = 3e-3, 4e-3
#: NVFP4's per-tensor global scale in these tests (random normal data: block scales stay in e4m3's normal range).
NVFP4_GLOBAL = 0.01


def _spec(kv_cache_dtype: str, *, dtype: str = "float16", head_size: int = 32, **kw) -> AttentionSpec:
    return AttentionSpec(num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         block_size=16, **kw)


def _scales(spec: AttentionSpec) -> dict:
    if spec.kv_cache_dtype != "nvfp4":
        return {"k_scale": 1.0, "v_scale": 1.0}
    return {"k_scale": NVFP4_GLOBAL, "v_scale": 2 * NVFP4_GLOBAL}


def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's pages (values, scales, padding) as one uint8 view."""
    return kv_cache.view(torch.uint8).as_strided((kv_cache.shape[0] * kv_cache.stride(0),), (1,))


# ----------------------------------------------------------------------------------------------------------------
# layout and bytes per token
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_bytes_per_token_and_page_layout(kv_cache_dtype):
    spec = _spec(kv_cache_dtype, head_size=128, dtype="bfloat16")
    value = {"fp8_per_token_head": 128, "int8_per_token_head": 128, "int4_per_token_head": 64, "nvfp4": 64}
    scale = {"fp8_per_token_head": 4, "int8_per_token_head": 4, "int4_per_token_head": 4, "nvfp4": 8}
    want = 2 * spec.num_kv_heads * (value[kv_cache_dtype] + scale[kv_cache_dtype])
    assert kv_cache_bytes_per_token(spec) == want
    assert kv_cache_bytes_per_token(_spec("auto", head_size=128, dtype="bfloat16")) == 2 * 2 * 128 * 2
    layout = kv_page_layout(spec)
    cache = ReferenceBackend.allocate_kv_cache(3, spec)
    assert cache.stride(0) == layout.page_bytes and layout.page_bytes % 16 == 0
    assert tuple(cache.shape) == ReferenceBackend.kv_cache_shape(3, spec)
    k_sc, v_sc = kv_scale_views(cache, layout)
    base = cache.untyped_storage().data_ptr()
    # each page's scales lie inside that page, after its values
    for page in range(3):
        lo, hi = base + page * layout.page_bytes, base + (page + 1) * layout.page_bytes
        for view in (k_sc, v_sc):
            first, last = view[page].flatten()[0].data_ptr(), view[page].flatten()[-1].data_ptr()
            assert lo + 2 * layout.values_bytes <= first and last < hi


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_a_page_carries_its_scales(kv_cache_dtype):
    """Copy a page's bytes to another page id: the copy reads back the same keys and values."""
    spec = _spec(kv_cache_dtype)
    cache = ReferenceBackend.allocate_kv_cache(4, spec)
    _pages(cache).fill_(0)
    k, v = torch.randn(16, 2, 32).half(), torch.randn(16, 2, 32).half()
    reshape_and_cache_torch(k, v, cache, torch.arange(16, 32), **_scales(spec), kv_format=spec.kv_cache_format)
    raw = _pages(cache).view(4, -1)
    raw[3] = raw[1]
    impl = ReferenceBackend.get_impl_cls()(spec, **_scales(spec))
    from attnbackends.ops.kv_cache_write import gather_kv_torch
    a = gather_kv_torch(cache, torch.tensor([1]), 16, impl.k_scale, impl.v_scale, kv_format=spec.kv_cache_format)
    b = gather_kv_torch(cache, torch.tensor([3]), 16, impl.k_scale, impl.v_scale, kv_format=spec.kv_cache_format)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[0] - k.float()).abs().max() < k.abs().max()  # it read the written keys, not zeros


# ----------------------------------------------------------------------------------------------------------------
# the arithmetic
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_quantisation_error_is_bounded(kv_cache_dtype):
    fmt = KVCacheFormat(kv_cache_dtype)
    x = torch.randn(64, 4, 64) * torch.logspace(-2, 2, 4)[None, :, None]  # heads of very different sizes
    g = x.abs().max().item() / (448 * 6)  # NVFP4's global scale as calibrated: the largest block scale is 448
    values, scales = quantize_token_heads(x, fmt, g)
    back = dequantize_token_heads(values, scales, fmt, g)
    err = (back - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)
    if fmt is KVCacheFormat.INT8_PER_TOKEN_HEAD:
        assert (err <= absmax / 127 / 2 * 1.0001).all()
    elif fmt is KVCacheFormat.INT4_PER_TOKEN_HEAD:
        assert (err <= absmax / 7 / 2 * 1.0001).all()
    elif fmt is KVCacheFormat.FP8_PER_TOKEN_HEAD:
        assert (err <= x.abs() / 16 + absmax / 448 * 2.0 ** -9).all()  # half an e4m3 ulp (or a subnormal one)
        assert torch.allclose(back.abs().amax(-1), absmax.squeeze(-1), rtol=1e-6)  # absmax maps to 448 exactly
    else:
        d = scales.float()[..., None] * g  # [T, H, blocks, 1]: the block's unit
        block_max = x.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
        # the block scale is absmax / 6 rounded to e4m3 (half an ulp, or half a subnormal step)
        assert ((d - block_max / 6).abs() <= block_max / 6 / 16 + 2.0 ** -10 * g * 1.0001).all()
        # e2m1 steps are at most 2 units: the error is at most one unit, or what saturation at 6 units cuts off
        xb, eb = x.unflatten(-1, (-1, 16)), err.unflatten(-1, (-1, 16))
        assert (eb <= torch.maximum(d, xb.abs() - 6 * d) * 1.0001).all()
        assert (d > 0).any(-1).all()


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_triton_write_matches_torch_bit_for_bit(kv_cache_dtype):
    spec = _spec(kv_cache_dtype, dtype="bfloat16")
    fmt = spec.kv_cache_format
    caches = [ReferenceBackend.allocate_kv_cache(4, spec) for _ in range(2)]
    for c in caches:
        _pages(c).fill_(0xA5)  # poison: untouched slots keep it
    k = (torch.randn(24, 2, 32) * 3).bfloat16()
    v = torch.randn(24, 2, 32).bfloat16()
    slots = torch.randperm(64)[:24]
    slots[[2, 9]] = -1  # padding
    reshape_and_cache(k, v, caches[0], slots, **_scales(spec), kv_format=fmt)  # Triton (interpreted)
    reshape_and_cache_torch(k, v, caches[1], slots, **_scales(spec), kv_format=fmt)
    assert torch.equal(_pages(caches[0]), _pages(caches[1]))
    layout = kv_page_layout(spec)
    k_sc, _ = kv_scale_views(caches[0], layout)
    written = set(slots[slots >= 0].tolist())
    skipped = [s for s in range(64) if s not in written]
    for s in skipped[:4]:  # padding and unused slots keep the poison, values and scales
        assert (caches[0].view(torch.uint8)[s // 16, :, s % 16] == 0xA5).all()
        assert (k_sc.view(torch.uint8)[s // 16, s % 16] == 0xA5).all()


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "nvfp4"])
def test_bad_slot_is_a_clear_error_and_writes_nothing_there(kv_cache_dtype):
    spec = _spec(kv_cache_dtype)
    cache = ReferenceBackend.allocate_kv_cache(2, spec)
    _pages(cache).fill_(0)
    k = torch.randn(3, 2, 32).half()
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 99 is outside"):
        reshape_and_cache(k, k, cache, torch.tensor([0, 99, 5]), **_scales(spec), kv_format=spec.kv_cache_format)
    with pytest.raises(ValueError, match="outside"):
        reshape_and_cache_torch(k, k, cache, torch.tensor([0, 99, 5]), **_scales(spec),
                                kv_format=spec.kv_cache_format)


# ----------------------------------------------------------------------------------------------------------------
# reads: the reference against the oracle, Triton against the reference
# ----------------------------------------------------------------------------------------------------------------
def _oracle(q, keys, values, query_lens, context_lens, scale):
    """float64 causal attention per request over the exact (unquantised) keys and values."""
    outs, start = [], 0
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        k, v = keys[i].double().cpu(), values[i].double().cpu()  # [L, Hkv, D]
        qq = q[start:start + ql].double().cpu()
        start += ql
        group = qq.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        pos = torch.arange(cl, cl + ql)[:, None]
        s = s.masked_fill(torch.arange(cl + ql)[None, :] > pos, -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


def _batch(spec, query_lens, context_lens, *, seed=0, outlier_heads=(), device="cpu"):
    """A random batch over random pages: (common, q, per-request keys and values, step keys and values)."""
    gen = torch.Generator().manual_seed(seed)
    bs, hkv, d = spec.block_size, spec.num_kv_heads, spec.head_size
    pages_needed = [-(-(q + c) // bs) for q, c in zip(query_lens, context_lens)]
    perm = torch.randperm(sum(pages_needed) + 2, generator=gen).tolist()
    tables, at = [], 0
    for n in pages_needed:
        tables.append(perm[at:at + n])
        at += n
    keys = [torch.randn(q + c, hkv, d, generator=gen) for q, c in zip(query_lens, context_lens)]
    values = [torch.randn(q + c, hkv, d, generator=gen) for q, c in zip(query_lens, context_lens)]
    for h in outlier_heads:
        for t in keys + values:
            t[:, h] *= 100.0
    dt = spec.torch_dtype
    keys = [k.to(dt) for k in keys]
    values = [v.to(dt) for v in values]
    q = torch.randn(sum(query_lens), spec.num_heads, d, generator=gen).to(dt)
    common = build_common_metadata(query_lens, context_lens, tables, block_size=bs, device=device)
    prefill = build_common_metadata([q + c for q, c in zip(query_lens, context_lens)], [0] * len(tables), tables,
                                    block_size=bs, device=device)
    to = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    return common, prefill, q.to(device), to(keys), to(values), len(perm)


def _run(backend, spec, common, prefill, q, keys, values, num_blocks, cache=None, **builder_kw):
    """Write every token through ``backend``'s update_kv_cache (unless ``cache`` is given), then attend."""
    impl = backend.get_impl_cls()(spec, **_scales(spec))
    device = q.device
    if cache is None:
        cache = backend.allocate_kv_cache(num_blocks, spec, device)
        _pages(cache).fill_(0)
        impl.update_kv_cache(torch.cat(keys), torch.cat(values), cache, prefill.slot_mapping)
    md = backend.get_builder_cls()(spec, device, **builder_kw).build(common)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, None, None, cache, md, out)
    return out.float(), cache


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_reference_over_quantised_cache_against_oracle(kv_cache_dtype):
    spec = _spec(kv_cache_dtype, dtype="float32")
    ql, cl = [1, 1, 7], [40, 17, 9]
    common, prefill, q, keys, values, nb = _batch(spec, ql, cl)
    out, _ = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb)
    want = _oracle(q, keys, values, ql, cl, spec.softmax_scale)
    err = _rel(out, want)
    assert err < ORACLE_BOUND[kv_cache_dtype]
    exact, _ = _run(ReferenceBackend, _spec("auto", dtype="float32"), common, prefill, q, keys, values, nb)
    assert _rel(exact, want) < 1e-5  # the bound is the format's, not the reference's
    assert err > 1e-5  # the cache really is quantised


TRITON_CASES = {
    # name: (query lens, context lens, builder options, spec options)
    "mixed": ([1, 1, 5], [40, 17, 10], {}, {}),
    "balanced": ([1, 1, 1, 1], [70, 3, 33, 16], {"decode_schedule": "balanced"}, {}),
    "verify": ([3, 3, 2], [30, 12, 20], {}, {"num_speculative_tokens": 2}),
}


@pytest.mark.parametrize("case", sorted(TRITON_CASES))
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_triton_reads_like_the_reference(kv_cache_dtype, case):
    ql, cl, builder_kw, spec_kw = TRITON_CASES[case]
    spec = _spec(kv_cache_dtype, **spec_kw)
    common, prefill, q, keys, values, nb = _batch(spec, ql, cl, seed=hash(case) % 1000)
    out_t, cache = _run(TritonAttentionBackend, spec, common, prefill, q, keys, values, nb, **builder_kw)
    out_r, _ = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb, cache=cache)
    assert torch.isfinite(out_t).all()
    assert _rel(out_t, out_r) < TRITON_REL
    assert torch.allclose(out_t, out_r, atol=TRITON_ATOL, rtol=0)
    if case == "mixed":  # the Triton write and the torch write agree bit for bit, also inside forward
        out_w, cache_w = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb)
        assert torch.equal(_pages(cache_w), _pages(cache))


def _context_slots(prefill, query_lens, context_lens):
    """The slots of the requests' cached context (each request's first context_len tokens)."""
    keep, at = [], 0
    for q, c in zip(query_lens, context_lens):
        keep += list(range(at, at + c))
        at += q + c
    return prefill.slot_mapping[torch.tensor(keep, dtype=torch.long, device=prefill.slot_mapping.device)]


def _run_with_new_keys(spec, common, prefill, q, keys, values, num_blocks, query_lens, context_lens, **builder_kw):
    """The context written through ``update_kv_cache``, then one forward bringing the step's keys and values (the
    forward writes them): (output, cache, metadata)."""
    impl = TritonAttentionBackend.get_impl_cls()(spec, **_scales(spec))
    cache = TritonAttentionBackend.allocate_kv_cache(num_blocks, spec, q.device)
    _pages(cache).fill_(0)
    ctx_k = torch.cat([k[:c] for k, c in zip(keys, context_lens)])
    ctx_v = torch.cat([v[:c] for v, c in zip(values, context_lens)])
    impl.update_kv_cache(ctx_k, ctx_v, cache, _context_slots(prefill, query_lens, context_lens))
    new_k = torch.cat([k[c:] for k, c in zip(keys, context_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(values, context_lens)])
    md = TritonAttentionBackend.get_builder_cls()(spec, q.device, **builder_kw).build(common)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, new_k, new_v, cache, md, out)
    return out.float(), cache, md


#: Batches with prefills over dequantised pages: (query lens, context lens).
DEQUANT_CASES = {
    "mixed": ([1, 1, 5, 20], [40, 17, 10, 0]),  # decodes, a chunk ending mid-page, a fresh prompt
    "chunks": ([7, 16], [25, 32]),
}


@pytest.mark.parametrize("new_keys", [True, False], ids=["new_keys", "key_none"])
@pytest.mark.parametrize("case", sorted(DEQUANT_CASES))
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_dequantised_prefills_read_like_the_reference(kv_cache_dtype, case, new_keys):
    """The prefills over the scratch (the unified kernel standing in for the Gluon kernel on the CPU) read the values
    the quantised cache holds, the step's keys included: equal to the reference over the same cache and within the
    format's bound of the oracle; the scratch holds the torch read of the planned pages."""
    ql, cl = DEQUANT_CASES[case]
    spec = _spec(kv_cache_dtype)
    common, prefill, q, keys, values, nb = _batch(spec, ql, cl, seed=len(case) + 7)
    if new_keys:
        out_t, cache, md = _run_with_new_keys(spec, common, prefill, q, keys, values, nb, ql, cl,
                                              dequant_prefill=True)
    else:
        out_t, cache = _run(TritonAttentionBackend, spec, common, prefill, q, keys, values, nb, dequant_prefill=True)
        md = TritonAttentionBackend.get_builder_cls()(spec, "cpu", dequant_prefill=True).build(common)
    assert md.step.paged_no_new_kv.kinds()[-2:] == (LaunchKind.DEQUANT_PAGES, LaunchKind.ATTENTION_SCRATCH)
    out_r, _ = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb, cache=cache)
    assert torch.isfinite(out_t).all()
    assert _rel(out_t, out_r) < TRITON_REL
    assert torch.allclose(out_t, out_r, atol=TRITON_ATOL, rtol=0)
    assert _rel(out_t, _oracle(q, keys, values, ql, cl, spec.softmax_scale)) < ORACLE_BOUND[kv_cache_dtype]
    pages = md.dequant_prefill
    if new_keys:
        g = (_scales(spec)["k_scale"], _scales(spec)["v_scale"]) if kv_cache_dtype == "nvfp4" else (1.0, 1.0)
        want = dequantise_pages_torch(cache, kv_page_layout(spec), pages.pages, spec.torch_dtype, *g)
        assert torch.equal(pages.scratch, want)  # float16: the interpreter's conversion rounds to nearest


def test_outlier_heads_per_token_head_beats_per_tensor_fp8():
    """A KV head 100x larger than the others: per-token-head int8 and fp8 are at least as accurate as fp8 with one
    scale per tensor (calibrated on the whole cache), int8 far more."""
    ql, cl = [1, 1, 4], [48, 20, 12]
    errors = {}
    for kv_dtype in ("fp8", "fp8_per_token_head", "int8_per_token_head"):
        spec = _spec(kv_dtype, dtype="float32")
        common, prefill, q, keys, values, nb = _batch(spec, ql, cl, seed=3, outlier_heads=(1,))
        kw = {}
        if kv_dtype == "fp8":
            kw = {"k_scale": max(k.abs().max().item() for k in keys) / 448,
                  "v_scale": max(v.abs().max().item() for v in values) / 448}
        impl = ReferenceBackend.get_impl_cls()(spec, **kw)
        cache = ReferenceBackend.allocate_kv_cache(nb, spec)
        impl.update_kv_cache(torch.cat(keys), torch.cat(values), cache, prefill.slot_mapping)
        out = torch.full_like(q, float("nan"))
        impl.forward(q, None, None, cache, ReferenceBackend.get_builder_cls()(spec, "cpu").build(common), out)
        want = _oracle(q, keys, values, ql, cl, spec.softmax_scale)
        normal = [h for h in range(spec.num_heads) if h // spec.num_queries_per_kv != 1]  # the ordinary heads
        errors[kv_dtype] = _rel(out[:, normal], want[:, normal])
    assert errors["int8_per_token_head"] < 0.5 * errors["fp8"]
    assert errors["fp8_per_token_head"] <= 1.05 * errors["fp8"]


# ----------------------------------------------------------------------------------------------------------------
# who serves what
# ----------------------------------------------------------------------------------------------------------------
def test_layer_groups_keep_chosen_layers_in_16_bits():
    specs = [_spec("int4_per_token_head")] * 4
    groups = group_layers(specs, DeviceInfo.cpu(), LayerGroupsConfig.model_validate({"kv_cache_16bit_layers": "0,3"}))
    assert [g.spec.kv_cache_dtype for g in groups.groups] == ["auto", "int4_per_token_head"]
    assert groups.groups[0].layers == (0, 3) and groups.groups[1].layers == (1, 2)
    caches = groups.allocate_kv_caches(2)
    assert [c.dtype for c in caches] == [torch.float16, torch.uint8, torch.uint8, torch.float16]
    with pytest.raises(ValueError, match="kv_cache_16bit_layers names layer 9"):
        group_layers(specs, DeviceInfo.cpu(), LayerGroupsConfig(kv_cache_16bit_layers=(9,)))


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_backends_without_readers_decline_with_reasons(kv_cache_dtype):
    spec = _spec(kv_cache_dtype, dtype="bfloat16", head_size=128)
    h100 = DeviceInfo.cuda(9, 0)
    for name in ("flashinfer", "flash_attn"):
        reasons = get_backend_class(name).spec_reasons(spec)
        assert any(kv_cache_dtype in r and "scales stored beside the pages" in r for r in reasons), reasons
    assert not TritonAttentionBackend.spec_reasons(spec)
    table = str(explain(spec, h100))
    assert "scales stored beside the pages" in table
    assert any("unified kernel, reading" in n for n in TritonAttentionBackend.kernel_notes(spec, DeviceInfo.cuda(8, 0)))
    mla = AttentionSpec.mla(16, kv_cache_dtype=kv_cache_dtype)
    assert any("not offered for MLA" in r for r in get_backend_class("reference_mla").spec_reasons(mla))


def test_nvfp4_needs_whole_scale_blocks_and_fp4_hardware_is_known():
    assert any("multiple of 16" in r for r in ReferenceBackend.spec_reasons(_spec("nvfp4", head_size=24)))
    assert not has_native_fp4(DeviceInfo.cuda(9, 0)) and has_native_fp4(DeviceInfo.cuda(10, 0))
    assert not has_native_fp4(DeviceInfo.cpu())
    spec = _spec("nvfp4", dtype="bfloat16", head_size=128)
    assert any("no native FP4" in n for n in explain(spec, DeviceInfo.cuda(9, 0)).notes)
    assert any("native FP4 tensor cores" in n for n in explain(spec, DeviceInfo.cuda(10, 0)).notes)


def test_scales_only_where_a_format_takes_them():
    with pytest.raises(ValueError, match="per-tensor scales apply"):
        ReferenceBackend.get_impl_cls()(_spec("int8_per_token_head"), k_scale=0.5)
    ReferenceBackend.get_impl_cls()(_spec("nvfp4"), k_scale=0.5)  # NVFP4's global scale


# ----------------------------------------------------------------------------------------------------------------
# GPU: realistic shapes (Llama-3-8B layer: 32 query / 8 KV heads of 128, page 16, bfloat16)
# ----------------------------------------------------------------------------------------------------------------
def _lognormal_lens(n, median, sigma, seed, cap):
    gen = torch.Generator().manual_seed(seed)
    lens = (torch.randn(n, generator=gen) * sigma + math.log(median)).exp().round().clamp(1, cap)
    return [int(x) for x in lens]


GPU_CASES = {
    # name: (query lens, context lens, builder options, spec options)
    "uniform_b64": ([1] * 64, [1024] * 64, {"decode_schedule": "uniform"}, {}),
    "ragged_b64_balanced": ([1] * 64, _lognormal_lens(64, 700, 0.9, 1, 6000), {"decode_schedule": "balanced"}, {}),
    "ragged_mixed": ([1] * 48 + [200, 64], _lognormal_lens(48, 500, 0.9, 2, 4000) + [300, 0], {}, {}),
    "verify_b64": ([3] * 64, [900] * 64, {}, {"num_speculative_tokens": 2}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_gpu_triton_reads_like_the_reference(kv_cache_dtype, case):
    ql, cl, builder_kw, spec_kw = GPU_CASES[case]
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                         block_size=16, **spec_kw)
    common, prefill, q, keys, values, nb = _batch(spec, ql, cl, seed=len(case), device="cuda")
    out_t, cache = _run(TritonAttentionBackend, spec, common, prefill, q, keys, values, nb, **builder_kw)
    out_r, _ = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb, cache=cache)
    assert torch.isfinite(out_t).all()
    assert _rel(out_t, out_r) < 6e-3  # bfloat16 output rounding and float16 dots
    assert torch.allclose(out_t, out_r, atol=1.5e-2, rtol=8e-3)  # two bfloat16 ulps where outputs pass 2
    want = _oracle(q, keys, values, ql, cl, spec.softmax_scale)
    assert _rel(out_t.cpu(), want) < ORACLE_BOUND[kv_cache_dtype] + 6e-3
    out_w, cache_w = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb)
    assert torch.equal(_pages(cache_w), _pages(cache))  # the fused write and the torch write agree bit for bit


#: Prefills over dequantised pages on the paged Gluon kernel: (query lens, context lens).
GPU_DEQUANT_CASES = {
    "chunks_on_context": ([512, 256, 100], [3584, 1792, 37]),
    "mixed": ([1] * 24 + [300, 64], _lognormal_lens(24, 500, 0.9, 5, 4000) + [1000, 0]),
    "fresh_prompts": ([700, 129, 16], [0, 0, 0]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("new_keys", [True, False], ids=["new_keys", "key_none"])
@pytest.mark.parametrize("case", sorted(GPU_DEQUANT_CASES))
@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_gpu_dequantised_prefills_on_the_paged_gluon_kernel(kv_cache_dtype, case, new_keys):
    """Prefills over a quantised cache on the paged Gluon kernel over the dequantised scratch (the plan says so, and
    the forward picks that program), the decodes on the unified kernel: against the reference over the same cache
    and the float64 oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the paged Gluon kernel runs on sm_90")
    ql, cl = GPU_DEQUANT_CASES[case]
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                         block_size=16)
    common, prefill, q, keys, values, nb = _batch(spec, ql, cl, seed=len(case), device="cuda")
    if new_keys:
        out_t, cache, md = _run_with_new_keys(spec, common, prefill, q, keys, values, nb, ql, cl)
    else:
        out_t, cache = _run(TritonAttentionBackend, spec, common, prefill, q, keys, values, nb)
        md = TritonAttentionBackend.get_builder_cls()(spec, "cuda").build(common)
    builder_choice = TritonAttentionBackend.get_builder_cls()(spec, "cuda").choices.quantised_prefill
    assert builder_choice.kernel is QuantisedPrefill.DEQUANTISED_GLUON_PAGED, builder_choice
    step = md.step
    assert step.paged_no_new_kv.kinds()[-2:] == (LaunchKind.DEQUANT_PAGES, LaunchKind.GLUON_PAGED_PREFILL_SCRATCH)
    k_new = torch.empty(common.num_actual_tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    picked = step.program_for(q, k_new if new_keys else None, k_new if new_keys else None, torch.empty_like(q), cache,
                              common.slot_mapping)
    assert picked is (step.paged_new_kv if new_keys else step.paged_no_new_kv)
    out_r, _ = _run(ReferenceBackend, spec, common, prefill, q, keys, values, nb, cache=cache)
    assert torch.isfinite(out_t).all()
    assert _rel(out_t, out_r) < 6e-3  # bfloat16 scratch and output rounding
    assert torch.allclose(out_t, out_r, atol=1.5e-2, rtol=8e-3)
    want = _oracle(q, keys, values, ql, cl, spec.softmax_scale)
    assert _rel(out_t.cpu(), want) < ORACLE_BOUND[kv_cache_dtype] + 6e-3
    g = (_scales(spec)["k_scale"], _scales(spec)["v_scale"]) if kv_cache_dtype == "nvfp4" else (1.0, 1.0)
    pages = md.dequant_prefill
    if new_keys:  # the scratch holds the exact read of the planned pages, rounded to nearest once
        assert torch.equal(pages.scratch, dequantise_pages_torch(cache, kv_page_layout(spec), pages.pages,
                                                                 torch.bfloat16, *g))
