"""Steps built ahead of the GPU (attnbackends.testing.run_ahead): one builder and one impl run several different
batches without synchronising; every step's output must match the oracle. On the CPU for the reference backend
and the interpreted Triton backend; on a GPU (`pytest -m gpu`) for every GPU backend and phase composition, behind
a GPU stall so the host is certainly ahead."""

import pytest
import torch

from attnbackends import AttentionSpec, DeviceInfo, get_backend_class
from attnbackends.testing import check_backend_run_ahead, run_ahead_batches

CPU_SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype="float32", block_size=16)
CPU_MLA_SPEC = AttentionSpec.mla(4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                 dtype="float32", block_size=16)
GPU_MLA_SPEC = AttentionSpec.mla(16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                 dtype="bfloat16", block_size=64)
GPU_SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=128, dtype="bfloat16", block_size=16)
GPU_BACKENDS = ["triton", "flashinfer", "flash_attn", "phased(decode=flashinfer,prefill=flash_attn)",
                "phased(decode=triton,prefill=flashinfer)"]
GPU_MLA_BACKENDS = ["triton_mla", "flashinfer_mla"]


def _run(name: str, spec: AttentionSpec, device: str) -> None:
    cls = get_backend_class(name)
    reasons = cls.not_supported_reasons(spec, DeviceInfo.current(device))
    if reasons:
        pytest.skip(f"{name} declines the spec here: {'; '.join(reasons)}")
    check_backend_run_ahead(cls, run_ahead_batches(spec, device))


def test_reference_cpu():
    _run("reference", CPU_SPEC, "cpu")


def test_reference_mla_cpu():
    _run("reference_mla", CPU_MLA_SPEC, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend(name):
    _run(name, GPU_SPEC, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", GPU_MLA_BACKENDS)
def test_gpu_mla_backend(name):
    _run(name, GPU_MLA_SPEC, "cuda")

