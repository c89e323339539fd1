"""The flash_attn backend on a GPU against the float64 oracle (`pytest -m gpu`; skipped without CUDA or flash-attn).

flash-attn 4 compiles each (dtype, head size, GQA ratio, causal/local, paged TMA or cp.async, soft-cap, sinks)
variant on first use (seconds each), so the configs are few: the conformance suite at bf16/head 128 and fp16/head 64
with pages of 16 (cp.async page loads), a Llama-shaped mixed batch with pages of 16 and of 128 (TMA page loads at
head 128), and a large mixed batch.
"""

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo
from attnbackends.flash_attn import FlashAttnBackend, installed_flash_attn
from attnbackends.testing import (
    CaseNotSupported,
    SequenceShape,
    assert_close_to_oracle,
    check_backend_case,
    check_backend_on_batch,
    conformance_cases,
    make_random_batch,
    oracle_attention,
    tolerance_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(installed_flash_attn() is None, reason="flash-attn is not installed"),
]

MIXED = (
    SequenceShape(1, 0), SequenceShape(1, 16), SequenceShape(1, 53), SequenceShape(1, 300),
    SequenceShape(17, 0), SequenceShape(7, 31), SequenceShape(40, 100), SequenceShape(129, 255),
)
LLAMA = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16")


def _skip_unless_supported(spec: AttentionSpec) -> None:
    reasons = FlashAttnBackend.not_supported_reasons(spec, DeviceInfo.current())
    if reasons:
        pytest.skip("; ".join(reasons))


@pytest.mark.parametrize(
    "case", conformance_cases("bfloat16", 128, 16) + conformance_cases("float16", 64, 16), ids=str)
def test_conformance(case):
    try:
        check_backend_case(FlashAttnBackend, case, device="cuda")
    except CaseNotSupported as exc:
        pytest.skip(f"declined by the backend: {exc}")


@pytest.mark.parametrize("block_size", [16, 128])
def test_llama_mixed_batch(block_size):
    spec = AttentionSpec(**LLAMA, block_size=block_size)
    _skip_unless_supported(spec)
    check_backend_on_batch(FlashAttnBackend, make_random_batch(spec, MIXED, seed=3, device="cuda", pad_tokens=5))


def test_large_mixed_batch():
    spec = AttentionSpec(**LLAMA, block_size=16)
    _skip_unless_supported(spec)
    shapes = [SequenceShape(1, 1000 + 37 * i) for i in range(48)] + [SequenceShape(512, 1536), SequenceShape(700, 0)]
    check_backend_on_batch(FlashAttnBackend, make_random_batch(spec, shapes, seed=5, device="cuda"))


def test_reuses_one_builder_and_impl_across_batches():
    """The bound kernel and the first-call checks carry over to later batches of other shapes."""
    spec = AttentionSpec(**LLAMA, block_size=16)
    _skip_unless_supported(spec)
    builder = FlashAttnBackend.get_builder_cls()(spec, "cuda")
    impl = FlashAttnBackend.get_impl_cls()(spec)
    for seed, shapes in enumerate([MIXED, [SequenceShape(1, 4000)] * 8, [SequenceShape(300, 0)]]):
        batch = make_random_batch(spec, shapes, seed=seed, device="cuda")
        out = batch.new_output()
        kv_cache = batch.kv_cache.clone()
        impl.forward(batch.query, batch.key, batch.value, kv_cache, builder.build(batch.common), out)
        n = batch.num_actual_tokens
        assert_close_to_oracle(out[:n], oracle_attention(batch), tolerance_for(spec.torch_dtype), what=f"batch {seed}")
