"""The MLA launch path: the builder plans, ``forward`` only launches (CPU, the Triton interpreter).

- A forward re-derives nothing: after the first forward of a batch, later forwards plan nothing, choose no kernel
  and build no cache state or descriptor; they launch the write and the decode with the same compiled-kernel keys.
- :class:`attnbackends.compat.DescriptorLauncher` hands Triton's C launcher the same arguments as Triton's own
  descriptor-encoding wrapper does (checked against Triton's wrapper itself, with a recording launcher).
- The decode writes the absorbed queries and the latent output through the planned buffers and ``output``'s own
  strides (no copies), and matches the oracle.
"""

from __future__ import annotations

import types

import pytest
import torch

from attnbackends import compat
from attnbackends.mla import backends as mla_backends
from attnbackends.mla import decode_launch
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.spec import AttentionSpec
from attnbackends.testing.cases import SequenceShape
from attnbackends.testing.mla import make_random_mla_batch, mla_oracle

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


def test_forward_decides_nothing(monkeypatch):
    """Two forwards of one batch: the second plans nothing, builds no cache state and launches the same keys."""
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
    for name in ("_POINTER", "_REDUCE"):
        real = getattr(decode_launch, name)

        def record(key, *rest, _real=real):
            keys.append(key)
            return _real(key, *rest)

        monkeypatch.setattr(decode_launch, name, record)
    kv_cache = batch.kv_cache.clone()
    outs = []
    for _ in range(2):
        out = batch.new_output()
        impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)
        outs.append(out)
    assert all(c.calls == 0 for c in counters.values()), {n: c.calls for n, c in counters.items()}
    assert states.calls == 1  # one cache, its state built once
    assert len(keys) == 4 and keys[:2] == keys[2:]  # decode + reduce, twice, same keys
    assert hash(tuple(keys)) is not None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    want = mla_oracle(batch)
    torch.testing.assert_close(outs[1].double(), want, rtol=3e-2, atol=3e-2)


def test_decode_plan_buffers_are_views_without_copies():
    """The planned query buffer and latent output are [N, T, Lkv] (the matmuls' own layouts), the kernel sees them
    as [T, N, Lkv] views, and the up-projection writes ``output`` through its strides."""
    batch = _batch(1)
    meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu").build(batch.common)
    extra = meta.decode.extra
    t, n, lkv = 3, SPEC.num_heads, SPEC.kv_lora_rank
    assert extra["ql"].shape == (n, t, lkv) and extra["ql"].is_contiguous()
    assert extra["latent"].shape == (n, t, lkv) and extra["latent"].is_contiguous()
    assert extra["ql_t"].data_ptr() == extra["ql"].data_ptr() and extra["ql_t"].shape == (t, n, lkv)
    assert extra["plan"].output.data_ptr() == extra["latent"].data_ptr()


def test_descriptor_launcher_passes_what_tritons_wrapper_passes():
    """The encoded-once launch gives Triton's C launcher exactly the arguments Triton's own wrapper gives it."""
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
    raw, reason = compat._raw_descriptor_launch(compiled, (1, 3))
    assert raw is not None, reason
    launcher = compat.DescriptorLauncher(lambda: None, ("C",), (1, 3))
    for _ in range(2):  # the second launch uses the encodings of the first
        raw[0](2, 3, 4, 99, *raw[1], *launcher.encoded_args("k", args, raw[2]), 16)
    assert received[1] == received[0] and received[2] == received[0]
    assert compat._raw_descriptor_launch(compiled, (1,))[0] is None  # positions must match the signature's


def test_mla_modules_use_the_platform_interpreted_check():
    """No MLA module asks ``tensor.is_cuda`` whether kernels are interpreted."""
    import inspect
    import re

    from attnbackends.mla import cache, decode_hopper, decode_kernel, prefill

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


def test_decode_forward_runs_one_torch_op_per_view(monkeypatch):
    """A decode-only forward whose q and output have exactly the decode rows: no slices, no transposes; each view
    the matmuls and the decode kernel need is one as_strided (launches replaced by recorders)."""
    from attnbackends.mla import common as mla_common

    batch = _batch(2)
    meta = TritonMLABackend.get_builder_cls()(SPEC, "cpu", num_splits=1).build(batch.common)
    impl = TritonMLABackend.get_impl_cls()(SPEC, kv_b_proj=batch.kv_b_proj)
    impl.process_weights_after_loading()
    launches: list = []
    monkeypatch.setattr(decode_launch, "_POINTER", lambda key, *rest: launches.append(key))
    monkeypatch.setattr(mla_common, "concat_and_cache_mla", lambda *a, **k: launches.append("write"))
    kv_cache, out = batch.kv_cache.clone(), batch.new_output()
    impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)  # first call: full validation
    launches.clear()
    with _AtenOps() as rec:
        impl.forward(batch.q, batch.kv_c, batch.k_pe, kv_cache, meta, out)
    assert len(launches) == 2, launches  # the cache write and the decode kernel
    views = [op for op in rec.ops if op != "bmm"]
    assert rec.ops.count("bmm") == 2 and views == ["as_strided"] * 3, rec.ops


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
