"""The MLA launch path: the builder plans, ``forward`` only launches (CPU, the Triton interpreter).

- A forward re-derives nothing: after the first forward of a batch, later forwards plan nothing, choose no kernel
  and build no cache state or descriptor; they launch the write and the decode with the same compiled-kernel keys.
- A decode-only batch with the Triton absorption writes its new tokens in the absorption's launch (no separate
  cache-write launch), exactly as ``concat_and_cache_mla`` does: 16-bit and fp8 caches, padding slots skipped, the
  other slots untouched, an out-of-range slot skipped and raised as the same ``PageTableError``; a batch with
  prefills, and the bmm absorption, still write through ``concat_and_cache_mla``.
- :class:`attnbackends.ops.launch.DescriptorLauncher` hands Triton's C launcher the same arguments as Triton's own
  descriptor-encoding wrapper does (checked against Triton's wrapper itself, with a recording launcher).
- The decode writes the absorbed queries and the latent output through the planned buffers and ``output``'s own
  strides (no copies), and matches the oracle.
- The Triton absorption equals the matmul and copies the rotary queries; the fused split reduction + up-projection
  equals the two-step path (reduction kernel, then ``torch.bmm``), LSE
  included, for single and multi-token decodes, and leaves the output's other rows alone.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from attnbackends import compat
from attnbackends.ops import launch as ops_launch
from attnbackends.mla import backends as mla_backends
from attnbackends.ops import mla_cache
from attnbackends.mla import decode_launch
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.spec import AttentionSpec
from attnbackends.testing.cases import SequenceShape
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle, poison_unread_slots

pytestmark = pytest.mark.usefixtures("interpret")


@pytest.fixture
def interpret(monkeypatch):
    from attnbackends.platform import is_triton_interpreted

    if not is_triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (set before the kernels are imported)")


SPEC = AttentionSpec.mla(16, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                         dtype="bfloat16", block_size=16)


def _batch(seed=0):
    shapes = [SequenceShape(query_len=1, context_len=c) for c in (21, 40, 7)]
    return make_random_mla_batch(SPEC, shapes, seed=seed)


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


class _Recorder:
    """A launcher that records (its name, the key) per launch into ``log`` and launches through ``real``
    (prepare: the real one's; None under the interpreter)."""

    def __init__(self, real, name, log):
        self.real, self.name, self.log = real, name, log

    def __call__(self, key, *rest):
        self.log.append((self.name, key))
        return self.real(key, *rest)

    def prepare(self, *a):
        return self.real.prepare(*a)


def test_forward_decides_nothing(monkeypatch):
    """Two forwards of one batch: the second plans nothing, builds no cache state and launches the same keys (the
    cache write folded into the absorption's launch)."""
    batch = _batch()
    builder = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=2)
    meta = builder.build(batch.common)
    impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    counters = {name: _Counter(getattr(decode_launch, name)) for name in ("plan_mla_decode", "choose_decode_kernel")}
    for name, c in counters.items():
        monkeypatch.setattr(decode_launch, name, c)
    states = _Counter(decode_launch.MLACacheState)
    monkeypatch.setattr(decode_launch, "MLACacheState", states)
    keys: list = []
    for name in ("_ABSORB", "_ABSORB_WRITE", "_POINTER", "_REDUCE", "_REDUCE_UP"):
        monkeypatch.setattr(decode_launch, name, _Recorder(getattr(decode_launch, name), name, keys))
    writes = _Counter(mla_cache._WRITE)
    monkeypatch.setattr(mla_cache, "_WRITE", writes)
    kv_cache = batch.kv_cache.clone()
    outs = []
    for _ in range(2):
        out = batch.new_output()
        impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)
        outs.append(out)
    assert all(c.calls == 0 for c in counters.values()), {n: c.calls for n, c in counters.items()}
    assert states.calls == 1  # one cache, its state built once
    # absorption with the cache write, decode, split reduction: twice, same keys
    assert [name for name, _ in keys[:3]] == ["_ABSORB_WRITE", "_POINTER", "_REDUCE"] and keys[:3] == keys[3:]
    assert hash(tuple(keys)) is not None
    assert writes.calls == 0
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    want = mla_oracle(batch)
    torch.testing.assert_close(outs[1].double(), want, rtol=3e-2, atol=3e-2)


def test_decode_plan_buffers_are_views_without_copies():
    """The planned query buffer and latent output are [N, T, Lkv] (the matmuls' own layouts), the kernel sees them
    as [T, N, Lkv] views, and the up-projection writes ``output`` through its strides."""
    batch = _batch(1)
    meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu").build(batch.common)
    plan = meta.decode.plan
    t, n, lkv = 3, SPEC.num_heads, SPEC.kv_lora_rank
    assert plan.ql.shape == (n, t, lkv) and plan.ql.is_contiguous()
    assert plan.latent.shape == (n, t, lkv) and plan.latent.is_contiguous()
    assert plan.ql_t.data_ptr() == plan.ql.data_ptr() and plan.ql_t.shape == (t, n, lkv)
    assert plan.launch.output.data_ptr() == plan.latent.data_ptr()
    p, r, v = SPEC.qk_nope_head_dim, SPEC.qk_rope_head_dim, SPEC.v_head_dim
    assert plan.q_nope_view == (n, t, p) and plan.q_pe_view == (t, n, r) and plan.out_view == (n, t, v)
    assert plan.q_pe_view.heads == n and plan.out_view.width == v


def test_descriptor_launcher_passes_what_tritons_wrapper_passes(monkeypatch):
    """The encoded-once launch, and the same launch prepared, give Triton's C launcher exactly the arguments
    Triton's own wrapper gives it."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from triton.tools.tensor_descriptor import TensorDescriptor

    if compat.surface_unsupported_reason("triton_descriptor_launch"):
        pytest.skip(compat.surface_unsupported_reason("triton_descriptor_launch"))
    received: list = []
    signature = {0: "*bf16", 1: "tensordesc<bf16[16, 32]>", 2: "i32", 3: "tensordesc<bf16[16, 16]>", 4: "fp32",
                 5: "constexpr"}
    wrapped = driver.wrap_handle_tensordesc(lambda *a: received.append(a), signature, None)
    run = types.SimpleNamespace(launch=wrapped, global_scratch_size=0, profile_scratch_size=0,
                                launch_cooperative_grid=False, launch_pdl=False)
    compiled = types.SimpleNamespace(run=run, function=1234, packed_metadata=("meta",),
                                     metadata=types.SimpleNamespace(tensordesc_meta=None))
    x = torch.randn(64, 48, dtype=torch.bfloat16)
    d1, d3 = TensorDescriptor.from_tensor(x, [16, 32]), TensorDescriptor.from_tensor(x, [16, 16])
    args = (x, d1, 7, d3, 0.5)
    # Triton's path: CudaLauncher.__call__ hands the wrapper the base arguments, then the kernel's
    wrapped(2, 3, 4, 99, 1234, False, False, None, None, ("meta",), None, None, None, *args, 16)
    raw, reason = compat.raw_descriptor_launch(compiled, (1, 3))
    assert raw is not None, reason
    launcher = ops_launch.DescriptorLauncher(lambda: None, ("C",), (1, 3))
    for _ in range(2):  # the second launch uses the encodings of the first
        raw[0](2, 3, 4, 99, *raw[1], *launcher.encoded_args("k", args, raw[2]), 16)
    assert received[1] == received[0] and received[2] == received[0]
    # the same launch prepared once (launch_prepared on the current stream)
    launcher._raw["k"] = raw
    prepared = launcher.prepare("k", args, (16,))
    monkeypatch.setattr(ops_launch, "_current_stream", lambda: 99)
    assert ops_launch.launch_prepared(prepared, (2, 3, 4))
    assert received[3] == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in received[0])
    assert prepared.keep and all(kept is x for kept in prepared.keep)
    assert launcher.prepare("not compiled", args, (16,)) is None
    assert compat.raw_descriptor_launch(compiled, (1,))[0] is None  # positions must match the signature's


def test_mla_modules_use_the_platform_interpreted_check():
    """No MLA module asks ``tensor.is_cuda`` whether kernels are interpreted."""
    import inspect
    import re

    from attnbackends.mla import decode_hopper, decode_kernel, prefill
    from attnbackends.ops import mla_cache as cache

    for mod in (cache, decode_kernel, decode_hopper, decode_launch, prefill, mla_backends):
        src = inspect.getsource(mod)
        assert not re.search(r"INTERPRET\s*=\s*not\s+\w+\.is_cuda|interpreted\s*=\s*not\s+[\w.]+\.is_cuda", src), mod


class _AtenOps:
    """Records the torch ops (views included) run while it is active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@pytest.mark.parametrize("absorb,up_projection,num_splits", [
    ("bmm", "bmm", 1), ("bmm", "fused", 1), ("bmm", "fused", 2), ("triton", "bmm", 2), ("triton", "fused", 2)])
def test_decode_forward_runs_one_torch_op_per_view(monkeypatch, absorb, up_projection, num_splits):
    """A decode-only forward whose q and output have exactly the decode rows: no slices, no transposes; each view
    the matmuls and the decode kernel need is one as_strided; the Triton absorption replaces the first matmul and
    both query views and its launch writes the new tokens (no separate cache write), the fused up-projection the
    second matmul and its output view: with both, a decode forward runs no torch op at all and three launches
    (launches replaced by recorders)."""
    from attnbackends.mla import common as mla_common

    batch = _batch(2)
    # num_blocks: build() checks the page ids, so forward's check is one comparison (no block-table read)
    meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=num_splits, up_projection=up_projection,
                                              absorb=absorb, num_blocks=batch.kv_cache.shape[0]).build(batch.common)
    impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    launches: list = []
    class Stub:
        """A launcher that launches nothing and has nothing prepared."""

        def __init__(self, name):
            self.name = name

        def __call__(self, key, *rest):
            launches.append(self.name)

        def prepare(self, *a):
            return None

    for name in ("_ABSORB", "_ABSORB_WRITE", "_POINTER", "_REDUCE", "_REDUCE_UP"):
        monkeypatch.setattr(decode_launch, name, Stub(name))
    monkeypatch.setattr(mla_common, "concat_and_cache_mla", lambda *a, **k: launches.append("write"))
    kv_cache, out = batch.kv_cache.clone(), batch.new_output()
    impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)  # first call: full validation
    launches.clear()
    with _AtenOps() as rec:
        impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)
    fused, triton_absorb = up_projection == "fused", absorb == "triton"
    # the Triton absorption's launch writes the decode-only batch's new tokens: no separate write
    assert launches == ((["_ABSORB_WRITE"] if triton_absorb else ["write"]) + ["_POINTER"]
                        + (["_REDUCE_UP"] if fused else ["_REDUCE"] if num_splits > 1 else [])), launches
    want = ([] if triton_absorb else ["as_strided", "bmm", "as_strided"]) + ([] if fused else ["as_strided", "bmm"])
    assert rec.ops == want, rec.ops


def test_decode_reads_strided_queries_and_leaves_padding_rows_alone():
    """q a view into a wider buffer (storage offset, row stride != N * (P + R)) with padding rows behind the
    decodes; the output's padding rows keep their poison."""
    shapes = [SequenceShape(query_len=1, context_len=c) for c in (5, 33, 18)]
    batch = make_random_mla_batch(SPEC, shapes, seed=7, pad_tokens=2)
    wide = torch.randn(batch.q.shape[0], SPEC.num_heads, batch.q.shape[2] + 24, dtype=batch.q.dtype)
    q = wide[:, :, 8: 8 + batch.q.shape[2]]
    q.copy_(batch.q)
    for splits in (1, 2):
        meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=splits).build(batch.common)
        impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=batch.kv_b_proj)
        impl.process_weights_after_loading()
        out = batch.new_output()
        impl.forward(q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), meta, out)
        n = batch.num_actual_tokens
        torch.testing.assert_close(out[:n].double(), mla_oracle(batch), rtol=3e-2, atol=3e-2)
        assert torch.isnan(out[n:].float()).all()


def _fused_case(num_tokens, num_heads, kv_lora, v_dim, seed):
    """Single-token decodes over random pages: (inputs of mla_decode, W_UV)."""
    g = torch.Generator().manual_seed(seed)
    rope, page = 16, 16
    seq_lens = torch.randint(1, 30, (num_tokens,), generator=g, dtype=torch.int32)
    seq_lens[0] = 1  # every split but the first holds no key: LSE -inf partials
    pages = 2 * num_tokens
    table = torch.randperm(pages, generator=g).view(num_tokens, 2).int()
    cache = torch.randn(pages, page, kv_lora + rope, generator=g).bfloat16()
    ql = torch.randn(num_tokens, num_heads, kv_lora, generator=g).bfloat16()
    qpe = torch.randn(num_tokens, num_heads, rope, generator=g).bfloat16()
    w_uv = (torch.randn(num_heads, kv_lora, v_dim, generator=g) / kv_lora ** 0.5).bfloat16()
    return ql, qpe, cache, table, seq_lens, w_uv


@pytest.mark.parametrize("num_tokens,num_splits", [(3, 3), (70, 2), (5, 1)])
def test_fused_reduce_up_projection_kernel(num_tokens, num_splits):
    """The planned fused launch against the two-step path's numerics in torch (the partials merged by their LSE in
    float64, rounded to bf16, then the matmul) and against the float32 decode oracle: several token blocks (70
    tokens), ignored splits whose partials hold NaN, the merged LSE, a strided output whose other rows and columns
    keep their poison."""
    from attnbackends.mla.decode_kernel import MLADecodeConfig, mla_decode_torch
    from attnbackends.mla.decode_launch import (
        LOG2E, MLACacheState, launch_mla_decode, launch_mla_up_projection, plan_mla_decode, weight_launch_state,
    )

    heads, kv_lora, v_dim, scale = 2, 48, 24, 0.1  # Lkv and V not powers of two: masked columns
    ql, qpe, cache, table, seq_lens, w_uv = _fused_case(num_tokens, heads, kv_lora, v_dim, seed=num_tokens)
    latent = torch.full((num_tokens, heads, kv_lora), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((num_tokens, heads), float("nan"))
    plan = plan_mla_decode(
        num_tokens=num_tokens, num_heads=heads, kv_lora=kv_lora, rope=qpe.shape[-1], page=cache.shape[1],
        cache_dtype=cache.dtype, q_dtype=ql.dtype, block_table=table, seq_lens=seq_lens, output=latent,
        num_splits=num_splits, config=MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1),
        compute_capability=None, lse=lse, kernel="pointer", fuse_up_projection=True, v_dim=v_dim)
    assert plan.reduce_grid is None and plan.up_grid is not None
    launch_mla_decode(plan, ql, qpe, MLACacheState(cache), scale * LOG2E, 1.0)
    if num_splits > 1:
        parts, part_lse = plan.out.double(), plan.lse.double()  # [T, H, S, Lkv], [T, H, S]
        weights = torch.softmax(part_lse, dim=-1)
        two_step = torch.where(weights[..., None] > 0, parts * weights[..., None], 0.0).sum(2).bfloat16()
        want_lse = torch.logsumexp(part_lse, dim=-1).float()
        empty = plan.lse == float("-inf")
        assert empty.any()
        plan.out[empty] = float("nan")  # an ignored split's partial must not leak
    else:
        two_step, want_lse = latent.clone(), lse.clone()
    wide = torch.full((num_tokens + 2, heads, v_dim + 8), float("nan"), dtype=torch.bfloat16)
    out = wide[:, :, 4: 4 + v_dim]
    launch_mla_up_projection(plan, w_uv, weight_launch_state(w_uv), out)
    want = torch.einsum("thc,hcv->thv", two_step.double(), w_uv.double())
    torch.testing.assert_close(out[:num_tokens].double(), want, rtol=1e-2, atol=4e-3)
    oracle = torch.empty(num_tokens, heads, kv_lora)
    mla_decode_torch(ql, qpe, cache, table, seq_lens, oracle, scale=scale)
    torch.testing.assert_close(out[:num_tokens].double(), torch.einsum("thc,hcv->thv", oracle.double(),
                                                                       w_uv.double()), rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.isnan(wide[num_tokens:].float()).all() and torch.isnan(wide[:, :, :4].float()).all()
    assert torch.isnan(wide[:, :, 4 + v_dim:].float()).all()
    if num_splits > 1:
        assert torch.isnan(latent.float()).all()  # the merged latent is never stored


def test_up_projection_rejects_bad_arguments():
    from attnbackends.mla.decode_launch import weight_launch_state

    with pytest.raises(ValueError, match="up_projection"):
        TritonMLABackend.get_builder_cls()(SPEC, "cpu", up_projection="cublas")
    with pytest.raises(ValueError, match="absorb"):
        TritonMLABackend.get_builder_cls()(SPEC, "cpu", absorb="cublas")
    with pytest.raises(ValueError, match="W_UK_T"):
        weight_launch_state(torch.zeros(2, 8, 4).transpose(1, 2), "W_UK_T")


@pytest.mark.parametrize("num_tokens", [3, 70])
def test_absorb_kernel_matches_matmul(num_tokens):
    """The planned absorption against q_nope @ W_UK_T in float64 (rounded once to bf16): queries read through a
    storage offset and wider rows, rows past T ignored, several token blocks (70 tokens), Lkv not a power of two;
    the rotary queries copied exactly; the buffers poisoned first."""
    from attnbackends.mla.decode_launch import launch_mla_absorb, plan_mla_absorb, weight_launch_state

    g = torch.Generator().manual_seed(num_tokens)
    heads, nope, rope, kv_lora = 3, 16, 16, 48
    wide = torch.randn(num_tokens + 4, heads, nope + rope + 8, generator=g).bfloat16()
    q = wide[:, :, 8:]  # [T + 4, H, P + R], storage offset 8, row stride H * (P + R + 8)
    w_uk_t = (torch.randn(heads, nope, kv_lora, generator=g) / nope ** 0.5).bfloat16()
    ql = torch.full((num_tokens, heads, kv_lora), float("nan"), dtype=torch.bfloat16)
    q_pe = torch.full((num_tokens, heads, rope), float("nan"), dtype=torch.bfloat16)
    plan = plan_mla_absorb(num_tokens=num_tokens, num_heads=heads, nope=nope, rope=rope, kv_lora=kv_lora, ql=ql,
                           q_pe=q_pe)
    launch_mla_absorb(plan, q, w_uk_t, weight_launch_state(w_uk_t, "W_UK_T"))
    want = torch.einsum("thp,hpl->thl", q[:num_tokens, :, :nope].double(), w_uk_t.double()).bfloat16()
    torch.testing.assert_close(ql.float(), want.float(), rtol=8e-3, atol=1e-3)
    assert torch.equal(q_pe, q[:num_tokens, :, nope:])


def test_one_plan_serves_several_caches():
    """One batch's plan over two layers' caches, alternately: each forward reads its own cache (the launch worked
    out per cache), as a fresh plan does."""
    batch = _batch(4)
    builder = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=2)
    meta = builder.build(batch.common)
    impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    caches = [batch.kv_cache.clone(), (batch.kv_cache.float() * 0.5).to(batch.kv_cache.dtype)]
    outs = []
    for i in (0, 1, 0):
        out = batch.new_output()
        impl.forward(batch.q, None, None, caches[i], meta, out)
        outs.append(out)
    fresh = batch.new_output()
    impl.forward(batch.q, None, None, caches[1], builder.build(batch.common), fresh)
    torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=0)
    torch.testing.assert_close(outs[1], fresh, rtol=0, atol=0)
    assert not torch.equal(outs[0], outs[1])


def test_pointer_fallback_is_kept_per_cache_and_leaves_the_plan_alone(monkeypatch):
    """A TMA plan over a cache whose pages are not contiguous rows (a slice of wider rows): the portable kernel
    serves it, planned once for that cache (kept in the cache's state, with planned queries and without), the plan
    itself unchanged, the numbers those of the TMA kernel over a contiguous copy."""
    from attnbackends.mla.decode_kernel import MLADecodeConfig

    g = torch.Generator().manual_seed(9)
    heads, lkv, rope, page, num_blocks = 4, 64, 16, 16, 6
    q_nope = torch.randn(2, heads, lkv, generator=g).bfloat16()
    q_pe = torch.randn(2, heads, rope, generator=g).bfloat16()
    wide = torch.randn(num_blocks, page, lkv + rope + 16, generator=g).bfloat16()
    strided, contiguous = wide[..., : lkv + rope], wide[..., : lkv + rope].contiguous()
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 23], dtype=torch.int32)
    out = torch.full((2, heads, lkv), float("nan"), dtype=torch.bfloat16)
    config = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, use_tma=True)
    plan = decode_launch.plan_mla_decode(
        num_tokens=2, num_heads=heads, kv_lora=lkv, rope=rope, page=page, cache_dtype=torch.bfloat16,
        q_dtype=torch.bfloat16, block_table=table, seq_lens=seq_lens, output=out, num_splits=2, config=config,
        compute_capability=None, kernel="tma")
    fields = {name: id(value) for name, value in vars(plan).items()}
    planned = _Counter(decode_launch.plan_mla_decode)
    monkeypatch.setattr(decode_launch, "plan_mla_decode", planned)
    state = decode_launch.MLACacheState(strided)
    assert not state.rows_contiguous
    keys = (decode_launch.tensor_key(q_nope), decode_launch.tensor_key(q_pe))
    for q_keys in (keys, (None, None), keys):
        decode_launch.launch_mla_decode(plan, q_nope, q_pe, state, 0.1, 1.0, *q_keys)
    assert planned.calls == 1
    fallback = state.plan_launches(plan).pointer_plan
    assert fallback.kernel == "pointer" and plan.kernel == "tma"
    assert {name: id(value) for name, value in vars(plan).items()} == fields
    got = out.clone()
    decode_launch.launch_mla_decode(plan, q_nope, q_pe, decode_launch.MLACacheState(contiguous), 0.1, 1.0, *keys)
    assert planned.calls == 1
    torch.testing.assert_close(got.float(), out.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ the cache write folded into the absorption


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _fold_spec(kv_cache_dtype):
    return AttentionSpec.mla(4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                             dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, block_size=16)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("query_len", [1, 3])
def test_folded_cache_write_equals_concat_and_cache_mla(kv_cache_dtype, query_len):
    """A decode-only forward whose write is folded into the absorption's launch: the cache afterwards is bit for bit
    the one ``concat_and_cache_mla`` (its Triton kernel and its torch path) writes, a token with slot -1 is skipped,
    every slot no request reads keeps its poison, padding rows past T are ignored; the output matches the reference
    backend's on the same cache."""
    from attnbackends.ops.mla_cache import concat_and_cache_mla
    from attnbackends.reference.mla import ReferenceMLABackend
    from attnbackends.ops.page_guard import raise_pending_faults
    from attnbackends.testing import assert_close_to_oracle, tolerance_for
    from attnbackends.testing.mla import run_mla_backend

    spec = _fold_spec(kv_cache_dtype)
    shapes = [SequenceShape(query_len=query_len, context_len=c) for c in (0, 15, 16, 37)]
    batch = make_random_mla_batch(spec, shapes, seed=21 + query_len, pad_tokens=2)
    n = batch.num_actual_tokens
    batch.common.slot_mapping[2] = -1  # this token's slot is skipped: the decode reads what the cache held there
    batch.kv_cache = poison_unread_slots(batch.kv_cache, batch.common)
    kw = dict(builder_kwargs=dict(absorb="triton"), decode_threshold=query_len)
    meta = TritonMLABackend.get_builder_cls()(spec, "cpu", absorb="triton")
    meta.decode_threshold = query_len
    meta = meta.build(batch.common)
    assert meta.decode.plan.writes_cache and meta.decode.plan.absorb_launch.write_grid is not None
    out, cache = run_mla_backend(TritonMLABackend, batch, **kw)
    for impl in ("triton", "torch"):
        want = batch.kv_cache.clone()
        concat_and_cache_mla(batch.kv_c[:n], batch.k_pe[:n], want, batch.common.slot_mapping, batch.k_scale,
                             impl=impl)
        assert _same_bytes(cache, want), impl
    assert not _same_bytes(cache, batch.kv_cache)  # the new tokens were written
    raise_pending_faults("cpu")  # nothing recorded
    ref, ref_cache = run_mla_backend(ReferenceMLABackend, batch, decode_threshold=query_len)
    assert _same_bytes(cache, ref_cache)
    assert_close_to_oracle(out[:n], ref[:n].double(), tolerance_for(spec.torch_dtype, kv_cache_dtype),
                           what="folded triton_mla against reference_mla")
    assert torch.isnan(out[n:].float()).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [3, 70])
def test_absorb_write_kernel_matches_concat_and_cache_mla(cache_dtype, num_tokens):
    """The absorption launch with the write, on its own: several latent blocks (Lkv 160: the write slice has two
    programs per token block) and token blocks (70 tokens), kv_c and k_pe read through wider rows, slots -1 and
    unused slots poisoned; ql and q_pe bit for bit those of the absorption alone, the cache those of
    ``concat_and_cache_mla``."""
    from attnbackends.ops.mla_cache import concat_and_cache_mla
    from attnbackends.mla.decode_launch import (
        MLACacheState, launch_mla_absorb, launch_mla_absorb_and_write, plan_mla_absorb, weight_launch_state,
    )

    g = torch.Generator().manual_seed(num_tokens)
    heads, nope, rope, kv_lora, block_size, k_scale = 2, 16, 16, 160, 8, 0.03
    q = torch.randn(num_tokens + 2, heads, nope + rope, generator=g).bfloat16()
    w_uk_t = (torch.randn(heads, nope, kv_lora, generator=g) / nope ** 0.5).bfloat16()
    wide = torch.randn(num_tokens + 2, kv_lora + rope + 8, generator=g).bfloat16()
    kv_c, k_pe = wide[:, :kv_lora], wide[:, kv_lora + 8:]  # row stride Lkv + R + 8
    num_blocks = num_tokens // block_size + 4
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    cache = torch.randn(num_blocks, block_size, kv_lora + rope, generator=g).to(cache_dtype)
    cache.view(torch.uint8).view(num_blocks * block_size, -1)[num_blocks * block_size // 2:] = 0xFF
    outs = {}
    for write in (False, True):
        ql = torch.full((num_tokens, heads, kv_lora), float("nan"), dtype=torch.bfloat16)
        q_pe = torch.full((num_tokens, heads, rope), float("nan"), dtype=torch.bfloat16)
        plan = plan_mla_absorb(num_tokens=num_tokens, num_heads=heads, nope=nope, rope=rope, kv_lora=kv_lora, ql=ql,
                               q_pe=q_pe, slot_mapping=slots)
        assert plan.write_grid == (heads + 1,) + plan.grid[1:] and plan.grid[2] == 2
        got = cache.clone()
        if write:
            launch_mla_absorb_and_write(plan, q, w_uk_t, weight_launch_state(w_uk_t), kv_c, k_pe,
                                        MLACacheState(got), k_scale)
        else:
            launch_mla_absorb(plan, q, w_uk_t, weight_launch_state(w_uk_t))
        outs[write] = (ql, q_pe, got)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    assert _same_bytes(outs[False][2], cache)
    for impl in ("triton", "torch"):
        want = cache.clone()
        concat_and_cache_mla(kv_c[:num_tokens], k_pe[:num_tokens], want, slots, k_scale, impl=impl)
        assert _same_bytes(outs[True][2], want), impl


@pytest.mark.parametrize("bad", [-7, "past_the_end"])
def test_folded_write_raises_a_slot_outside_the_cache(bad):
    """An out-of-range slot in a folded forward: the same PageTableError as the separate write raises (its Triton
    kernel and its torch path), the other tokens written, nothing written for the bad one, the fault cleared."""
    from attnbackends.ops.mla_cache import concat_and_cache_mla
    from attnbackends.ops.page_guard import PageTableError, raise_pending_faults

    spec = _fold_spec("auto")
    batch = make_random_mla_batch(spec, [SequenceShape(query_len=1, context_len=c) for c in (5, 30, 17)], seed=31)
    num_slots = batch.kv_cache.shape[0] * spec.block_size
    bad_slot = num_slots + 3 if bad == "past_the_end" else bad
    meta = TritonMLABackend.get_builder_cls()(spec, "cpu").build(batch.common)
    assert meta.decode.plan.writes_cache
    good_slots = batch.common.slot_mapping.clone()
    meta.slot_mapping[1] = bad_slot  # the planned slot mapping, changed after the build (a device-side mistake)
    impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    cache = batch.kv_cache.clone()
    with pytest.raises(PageTableError) as folded:
        impl.forward(batch.q, batch.kv_c, batch.k_pe, cache, meta, batch.new_output())
    assert f"slot_mapping[1] = {bad_slot} is outside the KV cache's {num_slots} slots" in str(folded.value)
    raise_pending_faults("cpu")  # raised once
    for way in ("triton", "torch"):
        separate = batch.kv_cache.clone()
        with pytest.raises(PageTableError) as err:
            concat_and_cache_mla(batch.kv_c, batch.k_pe, separate, meta.slot_mapping, impl=way)
        assert str(err.value) == str(folded.value), way
    want = batch.kv_cache.clone()
    skipped = good_slots.clone()
    skipped[1] = -1
    concat_and_cache_mla(batch.kv_c, batch.k_pe, want, skipped, impl="torch")
    assert _same_bytes(cache, want)
    # the unfolded forward (bmm absorption) raises the same error
    unfolded = TritonMLABackend.get_builder_cls()(spec, "cpu", absorb="bmm").build(batch.common)
    assert not unfolded.decode.plan.writes_cache
    with pytest.raises(PageTableError) as err:
        impl.forward(batch.q, batch.kv_c, batch.k_pe, batch.kv_cache.clone(), unfolded, batch.new_output())
    assert str(err.value) == str(folded.value)
    batch.common.slot_mapping.copy_(good_slots)


def test_cache_write_launch_only_where_not_folded(monkeypatch):
    """The separate cache write (``concat_and_cache_mla``) runs for a mixed batch, for the bmm absorption and for
    ``update_kv_cache``, and never in a folded decode-only forward; a decode-only forward without new tokens
    launches the absorption alone."""
    from attnbackends.mla import common as mla_common

    recorded: list = []
    for name in ("_ABSORB", "_ABSORB_WRITE"):
        monkeypatch.setattr(decode_launch, name, _Recorder(getattr(decode_launch, name), name, recorded))
    real_write = mla_common.concat_and_cache_mla
    monkeypatch.setattr(mla_common, "concat_and_cache_mla",
                        lambda *a, **k: (recorded.append(("write", None)), real_write(*a, **k)))
    spec = _fold_spec("auto")
    decodes = [SequenceShape(query_len=1, context_len=c) for c in (4, 20)]
    cases = [
        ("decode-only", decodes, {}, True, ["_ABSORB_WRITE"]),
        ("decode-only, no new tokens", decodes, {}, False, ["_ABSORB"]),
        ("decode-only, bmm absorption", decodes, dict(absorb="bmm"), True, ["write"]),
        ("mixed", decodes + [SequenceShape(query_len=5, context_len=3)], dict(prefill_backend="sdpa"), True,
         ["write", "_ABSORB"]),
    ]
    for what, shapes, kw, new_tokens, want in cases:
        batch = make_random_mla_batch(spec, shapes, seed=41)
        meta = TritonMLABackend.get_builder_cls()(spec, "cpu", **kw).build(batch.common)
        assert meta.decode.plan.writes_cache == (want == ["_ABSORB_WRITE"] or want == ["_ABSORB"]), what
        impl = TritonMLABackend.get_impl_cls()(spec, kv_b_proj=batch.kv_b_proj)
        impl.process_weights_after_loading()
        recorded.clear()
        args = (batch.kv_c, batch.k_pe) if new_tokens else (None, None)
        impl.forward(batch.q, *args, batch.kv_cache.clone(), meta, batch.new_output())
        assert [name for name, _ in recorded] == want, (what, recorded)
    recorded.clear()
    impl.update_kv_cache(batch.kv_c, batch.k_pe, batch.kv_cache.clone(), batch.common.slot_mapping)
    assert [name for name, _ in recorded] == ["write"]


def test_builder_keeps_the_plan_of_a_batch_with_the_same_inputs():
    """A build whose planning inputs (token count, split count, query length, the metadata tensors' addresses,
    shapes and strides) are a kept batch's reuses that batch's plan; a different split count, a different tensor
    or a batch with prefills plans anew."""
    batch = _batch()
    builder = TritonMLABackend.get_builder_cls()(SPEC, "cpu")
    first = builder.build(batch.common).decode.plan
    again = builder.build(batch.common).decode.plan
    assert again is first and again.writes_cache
    builder.num_splits = 3
    assert builder.build(batch.common).decode.plan is not first
    builder.num_splits = None
    common = batch.common
    moved = dataclasses.replace(common, slot_mapping=common.slot_mapping.clone())
    assert builder.build(moved).decode.plan is not first
    assert builder.build(batch.common).decode.plan is first
    for _ in range(builder.KEPT_PLANS):  # the oldest kept plans make room for new ones
        builder.num_splits = (builder.num_splits or 1) + 1
        builder.build(batch.common)
    builder.num_splits = None
    assert len(builder._kept_plans) == builder.KEPT_PLANS
    assert builder.build(batch.common).decode.plan is not first


def test_a_layers_launches_are_prepared_on_its_second_forward_of_a_plan(monkeypatch):
    """A layer's decode launches (absorption with the cache write, decode, up-projection) are prepared on its
    second forward of a plan over a cache; later forwards launch them back to back, passing only the call's
    tensors' addresses (queries, new tokens; output). Another layer, or queries of another layout, launch in full.
    The launchers are stand-ins that prepare a recording launch (the interpreter prepares none)."""
    monkeypatch.setattr(ops_launch, "_current_stream", lambda: 0)
    log: list = []

    class Preparing(_Recorder):
        def prepare(self, key, args, constexprs, leading=0):
            def run(*launch_args, _name=self.name):
                log.append((_name + " prepared", launch_args[4:]))
            return ops_launch.PreparedLaunch(run, (), ())

    for name in ("_ABSORB_WRITE", "_POINTER", "_REDUCE_UP"):
        monkeypatch.setattr(decode_launch, name, Preparing(getattr(decode_launch, name), name, log))
    batch = _batch()
    meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=2, up_projection="fused").build(batch.common)
    layers = []
    for seed in (1, 2):
        weights = make_random_mla_batch(SPEC, [SequenceShape(query_len=1, context_len=4)], seed=seed).kv_b_proj
        impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=weights)
        impl.process_weights_after_loading()
        layers.append((impl, batch.kv_cache.clone()))

    def forward(layer, q, kv_c, k_pe, out):
        log.clear()
        impl, cache = layers[layer]
        impl.forward(q, kv_c, k_pe, cache, meta, out)
        return [name for name, _ in log]

    full = ["_ABSORB_WRITE", "_POINTER", "_REDUCE_UP"]
    assert forward(0, batch.q, batch.kv_c, batch.k_pe, batch.new_output()) == full
    # the second forward prepares (the decode launch is already prepared from the first)
    assert forward(0, batch.q, batch.kv_c, batch.k_pe, batch.new_output()) == [
        "_ABSORB_WRITE", "_POINTER prepared", "_REDUCE_UP"]
    q, kv_c, k_pe, out = batch.q.clone(), batch.kv_c.clone(), batch.k_pe.clone(), batch.new_output()
    assert forward(0, q, kv_c, k_pe, out) == [name + " prepared" for name in full]
    assert [leading for _, leading in log] == [
        (q.data_ptr(), kv_c.data_ptr(), k_pe.data_ptr()), (), (out.data_ptr(),)]
    assert forward(1, q, kv_c, k_pe, out) == full  # another layer: its own weights and cache
    # new weights: the launches prepared with the old ones are dropped
    layers[0][0].process_weights_after_loading()
    assert forward(0, q, kv_c, k_pe, out) == ["_ABSORB_WRITE", "_POINTER prepared", "_REDUCE_UP"]
    # queries with other strides: check_inputs records a new layout, the launches are made in full
    wide = torch.empty(q.shape[0], q.shape[1], q.shape[2] + 8, dtype=q.dtype)[..., :q.shape[2]]
    wide.copy_(q)
    assert forward(0, wide, kv_c, k_pe, out) == ["_ABSORB_WRITE", "_POINTER prepared", "_REDUCE_UP"]
