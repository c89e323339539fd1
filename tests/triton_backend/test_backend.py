"""The Triton backend through the public interface, against the oracle (CPU: interpreted, tiny shapes)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import AttentionSpec, DeviceInfo, select, AttentionConfig  # noqa: E402
from attnbackends.testing import check_backend_case, conformance_cases  # noqa: E402
from attnbackends.triton.backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tiny interpreted shapes on the CPU: a third of the conformance cases per dtype keeps the suite fast.
CASES = conformance_cases("float16", 32, 16) + [
    c for c in conformance_cases("bfloat16", 80, 32) if c.name.split("-")[0] in ("mixed_padded", "fp8_e4m3", "sinks")
]


# Head size 512 (global layers of some Gemma-family models): its own tile config.
CASES += [c for c in conformance_cases("bfloat16", 512, 16) if c.name.split("-")[0] in ("decode", "chunked_prefill")]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_backend_conformance(case):
    check_backend_case(TritonAttentionBackend, case, device=DEVICE)


def test_selected_explicitly_on_cpu_when_interpreted():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16")
    assert select(spec, DeviceInfo.cpu(triton_interpreted=True), AttentionConfig(backend="triton")) is TritonAttentionBackend
    reasons = TritonAttentionBackend.not_supported_reasons(spec, DeviceInfo.cpu(triton_interpreted=False))
    assert reasons == ["needs a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"]


@pytest.mark.parametrize(
    "overrides, cc, reason",
    [
        ({"head_size": 16}, (9, 0), "head_size 16"),
        ({"head_size": 576}, (9, 0), "head_size 576"),
        ({"block_size": 8}, (9, 0), "block_size 8"),
        ({"dtype": "float32"}, (9, 0), "dtype float32"),
        ({"kv_cache_dtype": "fp8_e4m3"}, (8, 6), "fp8 e4m3"),
        ({}, (7, 5), "compute capability 7.5"),
    ],
)
def test_not_supported_reasons(overrides, cc, reason):
    spec = AttentionSpec(**{**dict(num_heads=8, num_kv_heads=2, head_size=128), **overrides})
    reasons = TritonAttentionBackend.not_supported_reasons(spec, DeviceInfo.cuda(*cc))
    assert any(reason in r for r in reasons), reasons


def test_forward_rejects_a_wrong_cache_shape():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float16")
    case = conformance_cases("float16", 32, 16)[0]
    batch = case.batch(DEVICE)
    builder = TritonAttentionBackend.get_builder_cls()(spec, DEVICE)
    impl = TritonAttentionBackend.get_impl_cls()(spec)
    bad_cache = batch.kv_cache[:, :, :, :1]
    with pytest.raises(ValueError, match="kv_cache must be"):
        impl.forward(batch.query, batch.key, batch.value, bad_cache, builder.build(batch.common), batch.new_output())
