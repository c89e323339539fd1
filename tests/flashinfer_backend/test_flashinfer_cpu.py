"""The FlashInfer backend on the CPU: its declared limits without flashinfer, and the whole adapter (builder, plan
arguments, impl, cascade, CUDA-graph buffers) against the oracle through a stand-in `flashinfer` module.

The stand-in implements FlashInfer's documented page-table semantics in float64 (request i's KV = its pages in
order, the last holding kv_last_page_len tokens; query row r of a request sits at position kv_len - qo_len + r;
causal: keys <= position; window_left w: keys >= position - w; soft-cap on the scaled logits; run() folds k_scale
into sm_scale and multiplies the output by v_scale), and rejects what the real wrappers reject (wrong out shape or
dtype, dtypes other than planned, a CUDA-graph batch of another size). The GPU tests check the real thing.
"""

import importlib.machinery
import math
import sys
import types

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo, get_backend_class
from attnbackends.flashinfer import CascadePolicy, FlashInferBackend, FlashInferMetadataBuilder, PlanKey
from attnbackends.compat import flashinfer_installed
from attnbackends.metadata import build_common_metadata
from attnbackends.testing import (
    SequenceShape,
    assert_close_to_oracle,
    conformance_cases,
    make_random_batch,
    oracle_attention,
    run_backend_on_batch,
    tolerance_for,
)
from attnbackends.testing.cases import RandomBatch

H100 = DeviceInfo.cuda(9, 0)
without_flashinfer = pytest.mark.skipif(flashinfer_installed(), reason="checks the reasons given without flashinfer")
BASE = dict(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16)


# -- without flashinfer -------------------------------------------------------------------------------------------
@without_flashinfer
def test_module_imports_without_flashinfer_and_says_so():
    assert "flashinfer" not in sys.modules
    assert get_backend_class("flashinfer") is FlashInferBackend
    spec = AttentionSpec(**BASE)
    assert FlashInferBackend.not_supported_reasons(spec, H100) == ["flashinfer is not installed"]
    reasons = FlashInferBackend.not_supported_reasons(spec, DeviceInfo.cpu())
    assert reasons == ["flashinfer is not installed", "needs a CUDA GPU"]
    assert "flashinfer" not in sys.modules


@without_flashinfer
def test_builder_without_flashinfer_raises_import_error_on_first_plan():
    spec = AttentionSpec(**BASE)
    builder = FlashInferMetadataBuilder(spec, "cpu")  # constructing imports nothing
    common = build_common_metadata([1], [5], [[0]], 16)
    with pytest.raises(ImportError, match="flashinfer"):
        builder.build(common)


@pytest.mark.parametrize(
    "overrides, device, reason",
    [
        ({}, DeviceInfo.cuda(7, 5), "compute capability 7.5 < 8.0"),
        ({"head_size": 96}, H100, "head_size 96 not supported (supported: 64,128,256)"),
        ({"head_size": 80}, H100, "head_size 80 not supported"),
        ({"dtype": "float32"}, H100, "dtype float32 not supported"),
        ({"alibi_slopes": (0.5, 0.25, 0.125, 0.0625)}, H100, "ALiBi not supported"),
        ({"has_sinks": True}, H100, "attention sinks not supported"),
        ({"attn_type": "encoder_only"}, H100, "attn_type encoder_only not supported"),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float16"}, H100, "a 16-bit cache must match the model dtype"),
        ({"head_size_v": 128, "head_size": 64}, H100, "head_size_v (128) != head_size (64) not supported"),
    ],
)
def test_declared_limits(overrides, device, reason):
    reasons = FlashInferBackend.not_supported_reasons(AttentionSpec(**{**BASE, **overrides}), device)
    assert any(reason in r for r in reasons), reasons


@without_flashinfer
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"head_size": 128, "dtype": "bfloat16"},
        {"head_size": 256},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"kv_cache_dtype": "float16"},
        {"sliding_window": 128, "logits_soft_cap": 30.0},
    ],
)
def test_supported_specs_only_miss_the_package(overrides):
    reasons = FlashInferBackend.not_supported_reasons(AttentionSpec(**{**BASE, **overrides}), H100)
    assert reasons == ["flashinfer is not installed"]


def test_unsupported_spec_rejected_by_builder_and_impl():
    spec = AttentionSpec(**BASE, has_sinks=True)
    with pytest.raises(NotImplementedError, match="sinks"):
        FlashInferMetadataBuilder(spec)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        FlashInferBackend.get_impl_cls()(AttentionSpec(**BASE, alibi_slopes=(1.0, 1.0, 1.0, 1.0)))


# -- a stand-in flashinfer ----------------------------------------------------------------------------------------
def _paged_attention(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, *, causal, window_left,
                     soft_cap, sm_scale, k_scale, v_scale, num_kv_heads, custom_mask=None):
    """FlashInfer's semantics in float64: returns (out [T, Hq, D] float64, lse [T, Hq] natural log). A
    ``custom_mask`` (flattened [qo_len, kv_len] per request) replaces the causal rule."""
    page = kv_cache.shape[2]
    qo_indptr, kv_indptr, last_page_len = (t.tolist() for t in (qo_indptr, kv_indptr, last_page_len))
    kv_indices = kv_indices.tolist()
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    outs, lses = [], []
    mask_at = 0
    for i in range(len(last_page_len)):
        pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
        kv_len = (len(pages) - 1) * page + last_page_len[i]
        k = kv_cache[pages, 0].double().reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
        v = kv_cache[pages, 1].double().reshape(-1, num_kv_heads, q.shape[2])[:kv_len]
        qi = q[qo_indptr[i] : qo_indptr[i + 1]].double()
        qo_len = qi.shape[0]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * (sm_scale * k_scale)
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(kv_len - qo_len, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        allowed = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if custom_mask is not None:
            allowed &= custom_mask[mask_at : mask_at + qo_len * kv_len].view(qo_len, kv_len).cpu()
            mask_at += qo_len * kv_len
        elif causal:
            allowed &= key <= pos
        if window_left >= 0:
            allowed &= key >= pos - window_left
        s = s.masked_fill(~allowed, -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # [H, Q]
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, v) * v_scale)
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


class _FakeWrapper:
    instances = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 causal_default=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_batch_size + 1
        self.plans = []
        _FakeWrapper.instances.append(self)

    def _plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              *, causal, window_left=-1, logits_soft_cap=None, sm_scale=None, q_data_type="float16",
              kv_data_type=None, o_data_type=None, pos_encoding_mode="NONE", non_blocking=True, seq_lens=None,
              custom_mask=None):
        for name, t in (("qo_indptr", qo_indptr), ("indptr", indptr), ("last_page_len", last_page_len)):
            assert t.device.type == "cpu" and t.dtype == torch.int32, name  # host arrays: no sync in plan
        assert indices.dtype == torch.int32
        assert pos_encoding_mode == "NONE"
        batch = len(last_page_len)
        assert len(indptr) == batch + 1 and len(qo_indptr) == batch + 1 and int(indptr[-1]) == len(indices)
        if seq_lens is not None:  # FlashInfer takes the KV lengths instead of deriving them: they must agree
            derived = (indptr[1:] - indptr[:-1] - 1) * page_size + last_page_len
            assert seq_lens.tolist() == derived.tolist(), (seq_lens, derived)
        if self.use_cuda_graph:
            if batch != self.fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            ib, xb, lb = self.buffers
            ib.copy_(indptr)
            lb.copy_(last_page_len)
            xb[: len(indices)].copy_(indices)
            indptr, indices, last_page_len = ib, xb, lb  # run() reads the persistent buffers, as on the GPU
        self.plan_args = dict(
            qo_indptr=qo_indptr.clone(), indptr=indptr, indices=indices, last_page_len=last_page_len,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
            causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
            custom_mask=custom_mask, q_data_type=q_data_type, kv_data_type=kv_data_type if kv_data_type is not None else q_data_type,
            o_data_type=o_data_type if o_data_type is not None else q_data_type,
        )
        self.plans.append(self.plan_args)

    def run(self, q, paged_kv_cache, *, out=None, k_scale=None, v_scale=None, return_lse=False):
        a = self.plan_args
        assert q.dtype == a["q_data_type"] and paged_kv_cache.dtype == a["kv_data_type"], "dtype differs from plan"
        assert paged_kv_cache.shape[2] == a["page_size"] and q.shape[1] == a["num_qo_heads"]
        if q.shape[0] != int(a["qo_indptr"][-1]):
            raise ValueError("q.shape[0] does not match qo_indptr[-1]")
        o, lse = _paged_attention(
            q, paged_kv_cache, a["qo_indptr"], a["indptr"], a["indices"], a["last_page_len"],
            causal=a["causal"], window_left=a["window_left"], soft_cap=a["logits_soft_cap"] or 0.0,
            sm_scale=a["sm_scale"] if a["sm_scale"] is not None else 1 / math.sqrt(q.shape[-1]),
            k_scale=1.0 if k_scale is None else k_scale, v_scale=1.0 if v_scale is None else v_scale,
            num_kv_heads=a["num_kv_heads"], custom_mask=a["custom_mask"],
        )
        if out is None:
            out = torch.empty(q.shape, dtype=a["o_data_type"])
        elif out.shape != q.shape or out.dtype != a["o_data_type"]:
            raise ValueError(f"out has shape {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)}")
        out.copy_(o.to(out.dtype))
        return (out, lse.float()) if return_lse else out


class FakeDecodeWrapper(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   causal=False, **kw)


class FakePrefillWrapper(_FakeWrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
             causal=False, **kw):
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                   causal=causal, **kw)


class FakeCascadeWrapper:
    """Level 0 .. n-1 prefill wrappers, causal only at the last level, merged by log-sum-exp; no k/v scales."""

    def __init__(self, num_levels, workspace, kv_layout="NHD"):
        self.levels = [FakePrefillWrapper(workspace, kv_layout) for _ in range(num_levels)]
        self.plans = []

    def plan(self, qo_indptr_arr, kv_indptr_arr, kv_indices_arr, last_page_len_arr, num_qo_heads, num_kv_heads,
             head_dim, page_size, causal=False, **kw):
        assert "o_data_type" not in kw
        self.plans.append(dict(kw, causal=causal, kv_indptr_arr=kv_indptr_arr))
        for i, w in enumerate(self.levels):
            w.plan(qo_indptr_arr[i], kv_indptr_arr[i], kv_indices_arr[i], last_page_len_arr[i], num_qo_heads,
                   num_kv_heads, head_dim, page_size, causal=causal if i == len(self.levels) - 1 else False, **kw)

    def run(self, q, paged_kv_cache):
        out, lse = self.levels[-1].run(q, paged_kv_cache, return_lse=True)
        out = out.double()
        for w in self.levels[:-1]:
            o2, l2 = w.run(q, paged_kv_cache, return_lse=True)
            m = torch.maximum(lse, l2)
            a, b = torch.exp(lse - m), torch.exp(l2 - m)
            out = (out * a[..., None] + o2.double() * b[..., None]) / (a + b)[..., None]
            lse = m + torch.log(a + b)
        return out.to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    mod.__version__ = "0.0-fake"
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    mod.MultiLevelCascadeAttentionWrapper = FakeCascadeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _FakeWrapper.instances = []
    return mod


def check_against_oracle(batch, builder_kwargs=None, build_kwargs=None):
    """Run one batch through builder + impl; compare with the oracle; padding rows untouched. Returns metadata."""
    spec = batch.spec
    builder = FlashInferMetadataBuilder(spec, "cpu", workspace_bytes=1024, **(builder_kwargs or {}))
    meta = builder.build(batch.common, **(build_kwargs or {}))
    impl = FlashInferBackend.get_impl_cls()(spec, k_scale=batch.k_scale, v_scale=batch.v_scale)
    cache = batch.kv_cache.clone()
    out = batch.new_output()
    assert impl.forward(batch.query, batch.key, batch.value, cache, meta, out) is out
    n = batch.num_actual_tokens
    assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype, spec.kv_cache_dtype))
    assert bool(torch.isnan(out[n:].float()).all()), "rows past num_actual_tokens were written"
    return meta, builder


SUPPORTED_CASES = [
    c for c in conformance_cases("float16", 64, 16) + conformance_cases("bfloat16", 128, 16)
    if c.name.split("-")[0] not in ("alibi", "sinks", "encoder_only", "tree_verify_sinks")
]


@pytest.mark.parametrize("case", SUPPORTED_CASES, ids=str)
def test_conformance_through_stand_in(fake_flashinfer, case):
    batch = case.batch("cpu")
    output, cache = run_backend_on_batch(FlashInferBackend, batch, check_support=False)
    n = batch.num_actual_tokens
    tol = tolerance_for(batch.spec.torch_dtype, batch.spec.kv_cache_dtype)
    assert_close_to_oracle(output[:n], oracle_attention(batch), tol)
    assert bool(torch.isnan(output[n:].float()).all())


def test_plan_arguments(fake_flashinfer):
    spec = AttentionSpec(**BASE, sliding_window=11, logits_soft_cap=5.0, scale=0.1)
    shapes = [SequenceShape(1, 20), SequenceShape(1, 3), SequenceShape(9, 16)]
    batch = make_random_batch(spec, shapes, seed=1)
    meta, builder = check_against_oracle(batch)
    dec, pre = meta.decode_wrapper.plan_args, meta.prefill_wrapper.plan_args
    assert meta.decode_wrapper.use_tensor_cores  # 4 query heads per... 2 per KV head: grouped
    for args in (dec, pre):
        assert args["window_left"] == 10  # W keys visible, self included -> 10 to the left
        assert args["logits_soft_cap"] == 5.0 and args["sm_scale"] == 0.1
        assert args["q_data_type"] == torch.float16 and args["kv_data_type"] == torch.float16
        assert args["o_data_type"] == torch.float16
    assert pre["causal"] is True
    assert dec["indptr"].tolist() == [0, 2, 3] and dec["last_page_len"].tolist() == [5, 4]
    assert pre["qo_indptr"].tolist() == [0, 9] and pre["indptr"].tolist() == [0, 2]
    assert meta.num_decode_tokens == 2 and meta.num_prefills == 1


def test_mha_decodes_without_tensor_cores_and_fp8_plans_fp8_kv(fake_flashinfer):
    spec = AttentionSpec(**{**BASE, "num_kv_heads": 4}, kv_cache_dtype="fp8_e5m2")
    meta, _ = check_against_oracle(make_random_batch(spec, [SequenceShape(1, 40)], seed=2))
    assert not meta.decode_wrapper.use_tensor_cores and meta.prefill_wrapper is None
    assert meta.decode_wrapper.plan_args["kv_data_type"] == torch.float8_e5m2


def test_pure_prefill_plans_no_decode(fake_flashinfer):
    spec = AttentionSpec(**BASE)
    meta, _ = check_against_oracle(make_random_batch(spec, [SequenceShape(7, 0), SequenceShape(20, 5)], seed=3))
    assert meta.decode_wrapper is None and meta.prefill_wrapper is not None


def test_one_plan_serves_every_layer(fake_flashinfer):
    spec = AttentionSpec(**BASE)
    batch = make_random_batch(spec, [SequenceShape(1, 30), SequenceShape(5, 9)], seed=4)
    builder = FlashInferMetadataBuilder(spec, "cpu", workspace_bytes=1024)
    meta = builder.build(batch.common)
    impl_cls = FlashInferBackend.get_impl_cls()
    for _ in range(3):  # three layers, same metadata, no re-planning
        out = batch.new_output()
        impl_cls(spec).forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, out)
        assert_close_to_oracle(out[: batch.num_actual_tokens], oracle_attention(batch), tolerance_for(torch.float16))
    assert sum(len(w.plans) for w in _FakeWrapper.instances) == 2


@pytest.mark.parametrize(
    "field, value",
    [("scale", 0.3), ("sliding_window", 64), ("logits_soft_cap", 10.0), ("kv_cache_dtype", "fp8"), ("head_size", 128)],
)
def test_layers_that_disagree_with_the_plan(fake_flashinfer, field, value):
    spec = AttentionSpec(**BASE)
    other = AttentionSpec(**{**BASE, field: value})
    with pytest.raises(ValueError, match=rf"layer_specs\[1\] cannot share this FlashInfer plan \({field}: planned"):
        FlashInferMetadataBuilder(spec, layer_specs=[spec, other])
    batch = make_random_batch(spec, [SequenceShape(1, 30)], seed=5)
    meta = FlashInferMetadataBuilder(spec, workspace_bytes=1024).build(batch.common)
    impl = FlashInferBackend.get_impl_cls()(other)
    # every field here is among those each metadata's origin records, checked before the plan's own comparison
    message = ("metadata was built for another layer's spec .head_size 64 .metadata. != 128" if field == "head_size"
               else rf"metadata was built for another layer's spec \({field} ")
    with pytest.raises(ValueError, match=message):
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta, batch.new_output())


def test_agreeing_layer_specs_accepted():
    spec = AttentionSpec(**BASE, kv_cache_dtype="fp8")
    same = AttentionSpec(**BASE, kv_cache_dtype="fp8_e4m3", scale=1 / 8)  # the same plan, spelled differently
    FlashInferMetadataBuilder(spec, layer_specs=[spec, same])
    assert PlanKey.of(spec) == PlanKey.of(same)


def test_batch_must_be_decode_first(fake_flashinfer):
    spec = AttentionSpec(**BASE)
    common = build_common_metadata([5, 1], [0, 7], [[0], [1]], 16)
    with pytest.raises(ValueError, match="decodes first"):
        FlashInferMetadataBuilder(spec, workspace_bytes=1024).build(common)


# -- cascade ------------------------------------------------------------------------------------------------------
def shared_prefix_batch(spec, shapes, shared_blocks, seed=0, device="cpu"):
    """A random batch whose requests all start with the same ``shared_blocks`` pages (request 0's)."""
    batch = make_random_batch(spec, shapes, seed=seed, device=device)
    bs = spec.block_size
    shared_tokens = shared_blocks * bs
    assert all(s.context_len >= shared_tokens for s in shapes)
    table = batch.common.block_table.cpu()
    tables = []
    for i, s in enumerate(shapes):
        pages = -(-s.seq_len // bs)
        row = table[i, :pages].tolist()
        row[:shared_blocks] = table[0, :shared_blocks].tolist()
        tables.append(row)
    common = build_common_metadata(
        [s.query_len for s in shapes], [s.context_len for s in shapes], tables, bs, device,
        num_padded_tokens=batch.common.slot_mapping.shape[0],
    )
    dense_k = [torch.cat([batch.dense_keys[0][:shared_tokens], k[shared_tokens:]]) for k in batch.dense_keys]
    dense_v = [torch.cat([batch.dense_values[0][:shared_tokens], v[shared_tokens:]]) for v in batch.dense_values]
    fields = {f: getattr(batch, f) for f in RandomBatch.__dataclass_fields__}
    fields.update(common=common, dense_keys=dense_k, dense_values=dense_v)
    return RandomBatch(**fields)


CASCADE_SHAPES = [SequenceShape(1, 300 + 7 * i) for i in range(8)] + [SequenceShape(12, 290), SequenceShape(3, 333)]


def test_cascade_attention(fake_flashinfer):
    spec = AttentionSpec(**BASE, logits_soft_cap=20.0)
    batch = shared_prefix_batch(spec, CASCADE_SHAPES, shared_blocks=17, seed=6)
    meta, _ = check_against_oracle(batch, builder_kwargs=dict(cascade_policy=CascadePolicy(enabled=True)),
                                   build_kwargs=dict(common_prefix_len=17 * 16))
    assert meta.cascade_wrapper is not None and meta.cascade_shared_blocks == 17
    assert meta.decode_wrapper is None and meta.prefill_wrapper is None
    top, bottom = meta.cascade_wrapper.levels
    assert top.plan_args["causal"] is False and bottom.plan_args["causal"] is True
    assert top.plan_args["indptr"].tolist() == [0, 17]
    assert bottom.plan_args["indptr"][1].item() == -(-301 // 16) - 17


def test_cascade_declined_without_prefix_or_policy_or_with_fp8(fake_flashinfer):
    spec = AttentionSpec(**BASE)
    batch = shared_prefix_batch(spec, CASCADE_SHAPES, shared_blocks=17, seed=7)
    on = dict(cascade_policy=CascadePolicy(enabled=True))
    meta, _ = check_against_oracle(batch, builder_kwargs=on)  # no common_prefix_len: plain path, still right
    assert meta.cascade_wrapper is None
    meta, _ = check_against_oracle(batch, build_kwargs=dict(common_prefix_len=272))  # the default policy: off
    assert meta.cascade_wrapper is None
    fp8 = shared_prefix_batch(AttentionSpec(**BASE, kv_cache_dtype="fp8"), CASCADE_SHAPES, shared_blocks=17, seed=7)
    meta, _ = check_against_oracle(fp8, builder_kwargs=on, build_kwargs=dict(common_prefix_len=272))
    assert meta.cascade_wrapper is None


# -- CUDA-graph buffers -------------------------------------------------------------------------------------------
def test_cuda_graph_decode_replans_persistent_buffers(fake_flashinfer):
    spec = AttentionSpec(**BASE)
    builder = FlashInferMetadataBuilder(spec, "cpu", workspace_bytes=1024, max_num_reqs=8, max_model_len=512)
    impl = FlashInferBackend.get_impl_cls()(spec)
    capture = make_random_batch(spec, [SequenceShape(1, c) for c in (5, 40, 17, 100)], seed=8, num_blocks=64)
    meta = builder.build_for_cudagraph_capture(capture.common)
    wrapper = meta.decode_wrapper
    assert meta.cuda_graph and wrapper.use_cuda_graph and builder.cudagraph_batch_sizes == [4]
    # "Replay": new seq lens and pages, same batch size -> the same wrapper, its buffers re-planned in place.
    for seed, contexts in ((9, (300, 1, 64, 31)), (10, (15, 16, 17, 200))):
        batch = make_random_batch(spec, [SequenceShape(1, c) for c in contexts], seed=seed, num_blocks=64)
        meta2 = builder.build(batch.common)
        assert meta2.decode_wrapper is wrapper and meta2.cuda_graph
        out = batch.new_output()
        impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), meta2, out)
        assert_close_to_oracle(out, oracle_attention(batch), tolerance_for(torch.float16))
        indptr_buf = wrapper.buffers[0]
        assert indptr_buf.tolist() == meta2.plan_inputs.kv_indptr.tolist()
    # Other sizes and mixed batches stay on the eager wrapper; capture refuses prefills.
    other = make_random_batch(spec, [SequenceShape(1, 9), SequenceShape(1, 10)], seed=11)
    assert not builder.build(other.common).cuda_graph
    mixed = make_random_batch(spec, [SequenceShape(1, 9), SequenceShape(4, 10)], seed=12)
    with pytest.raises(ValueError, match="pure-decode"):
        builder.build_for_cudagraph_capture(mixed.common)
    too_many = make_random_batch(spec, [SequenceShape(1, 3)] * 9, seed=13)
    with pytest.raises(ValueError, match="max_num_reqs"):
        builder.build_for_cudagraph_capture(too_many.common)


def test_precompile_builds_each_module_in_its_own_thread(fake_flashinfer, monkeypatch):
    """precompile() runs every needed module's own build (so first use finds it current), in parallel, leaving
    MAX_JOBS to the user."""
    import os
    import threading

    from attnbackends.flashinfer import precompile

    built, threads = [], set()

    class Spec:
        def __init__(self, name):
            self.name = name

        def build(self, verbose):
            built.append((self.name, os.environ.get("MAX_JOBS")))
            threads.add(threading.get_ident())

    jit = types.ModuleType("flashinfer.jit")
    jit.gen_batch_prefill_module = lambda backend, *args: Spec(f"prefill-{backend}-{args[0]}-{args[1]}-{args[7:]}")
    jit.gen_batch_decode_module = lambda *args: Spec(f"decode-{args[0]}-{args[1]}")
    cascade = types.ModuleType("flashinfer.jit.cascade")
    cascade.gen_cascade_module = lambda: Spec("cascade")
    utils = types.ModuleType("flashinfer.utils")
    utils.determine_attention_backend = lambda device, *args: "fa3"
    for name, mod in (("flashinfer.jit", jit), ("flashinfer.jit.cascade", cascade), ("flashinfer.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    specs = [AttentionSpec(**BASE), AttentionSpec(**{**BASE, "num_kv_heads": 4}), AttentionSpec(**BASE)]
    names = precompile(specs, "cpu", builder_cls=FlashInferMetadataBuilder, cascade=True)
    assert names == sorted(name for name, _ in built) and len(names) == 4  # fa2 (GQA decode), decode (MHA), fa3, cascade
    assert all(jobs is None for _, jobs in built)
    assert "MAX_JOBS" not in os.environ


def test_the_backend_class_hooks_reach_precompile_and_the_installed_version(monkeypatch):
    """Selection reaches FlashInfer's ahead-of-time build and version only through FlashInferBackend's hooks: warmup
    delegates to precompile with the backend's builder class (on CUDA only), environment_facts names the version."""
    from attnbackends.compat import package_version
    from attnbackends.flashinfer import warmup as warmup_module

    calls = []

    def precompile(specs, device, **kw):
        calls.append((specs, device, kw))
        return ["m"]

    monkeypatch.setattr(warmup_module, "precompile", precompile)
    specs = [AttentionSpec(**BASE)]
    assert FlashInferBackend.warmup(specs, DeviceInfo.cpu()) == [] and calls == []
    gpu = DeviceInfo.cuda(9, 0)
    assert FlashInferBackend.warmup(specs, gpu) == ["m"]
    assert calls == [(specs, gpu.torch_device, {"builder_cls": FlashInferMetadataBuilder})]
    version = package_version("flashinfer-python") or package_version("flashinfer")
    assert FlashInferBackend.environment_facts() == {"flashinfer": version}


def test_decode_replan_falls_back_to_plan_and_says_why(fake_flashinfer):
    """The stand-in is not a tested flashinfer version, so every decode batch goes through plan(); the status says
    why; with a tested version number but a wrapper without FlashInfer's private fields, the same."""
    spec = AttentionSpec(**BASE)
    builder = FlashInferMetadataBuilder(spec, "cpu", workspace_bytes=1024)
    assert builder.decode_replan_status == {}
    for seed in (30, 31):
        batch = make_random_batch(spec, [SequenceShape(1, 10 * seed), SequenceShape(1, 3)], seed=seed)
        builder.build(batch.common)
    (status,) = builder.decode_replan_status.values()
    assert "0.0-fake is not one of the tested versions" in status
    assert len(builder.wrappers.eager_decode.plans) == 2  # plan() both times

    fake_flashinfer.__version__ = "0.6.13"
    meta, builder = check_against_oracle(make_random_batch(spec, [SequenceShape(1, 12)], seed=32))
    assert "lacks" in builder.decode_replan_status["eager"]
    assert "disabled" in check_against_oracle(
        make_random_batch(spec, [SequenceShape(1, 12)], seed=33), builder_kwargs={"fast_plan": False}
    )[1].decode_replan_status["eager"]


def test_multi_token_decodes_and_trees_run_on_the_prefill_wrapper(fake_flashinfer):
    from attnbackends.testing.cases import EAGLE_TREE_8

    multi = AttentionSpec(**BASE, num_speculative_tokens=3)
    meta, builder = check_against_oracle(make_random_batch(multi, [SequenceShape(4, 20), SequenceShape(4, 3)]))
    assert builder.reorder_batch_threshold == 4
    assert meta.decode_wrapper is None and meta.prefill_wrapper.plan_args["causal"]
    assert meta.prefill_wrapper.plan_args["custom_mask"] is None
    single = check_against_oracle(make_random_batch(multi, [SequenceShape(1, 20), SequenceShape(1, 3)]))[0]
    assert single.decode_wrapper is not None and single.prefill_wrapper is None
    tree = AttentionSpec(**BASE, num_speculative_tokens=7, speculative_tree=True)
    batch = make_random_batch(tree, [SequenceShape(8, 20), SequenceShape(8, 3), SequenceShape(12, 0)],
                              tree_parents=[list(EAGLE_TREE_8), list(EAGLE_TREE_8), None])
    meta = check_against_oracle(batch)[0]
    assert meta.prefill_wrapper.plan_args["custom_mask"].numel() == 8 * 28 + 8 * 11 + 12 * 12
