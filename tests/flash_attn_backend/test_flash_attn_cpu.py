"""The flash_attn backend on the CPU: what it declines and why (with flash-attn absent or faked as each generation),
flash-attn detection, and the adapter's wiring against the oracle through a stand-in kernel that follows
flash-attn's documented paged varlen contract."""

import math

import pytest
import torch

from attnbackends import AttentionConfig, AttentionSpec, BackendNotSupportedError, DeviceInfo, explain, select
from attnbackends.flash_attn import FlashAttnBackend, library
from attnbackends.flash_attn.backend import NOT_INSTALLED
from attnbackends.testing import SequenceShape, check_backend_on_batch, conformance_cases, make_random_batch

LLAMA = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
H100 = DeviceInfo.cuda(9, 0, name="NVIDIA H100 80GB HBM3")
B200 = DeviceInfo.cuda(10, 0)


def fake_install(monkeypatch, generation):
    install = library.FlashAttnInstall(generation, "test", "fake") if generation else None
    monkeypatch.setattr(library, "installed_flash_attn", lambda: install)


def test_declined_with_reason_when_flash_attn_is_absent(monkeypatch):
    fake_install(monkeypatch, None)
    assert NOT_INSTALLED in FlashAttnBackend.not_supported_reasons(LLAMA, H100)
    with pytest.raises(BackendNotSupportedError, match="flash-attn is not installed"):
        select(LLAMA, H100, AttentionConfig(backend="flash_attn"))
    row = next(r for r in explain(LLAMA, H100).rows if r.name == "flash_attn")
    assert NOT_INSTALLED in row.reasons and not row.chosen


def test_fits_a_llama_layer_on_hopper_and_blackwell_with_flash_attn_4(monkeypatch):
    fake_install(monkeypatch, 4)
    assert FlashAttnBackend.not_supported_reasons(LLAMA, H100) == []
    assert FlashAttnBackend.not_supported_reasons(LLAMA, B200) == []
    assert select(LLAMA, H100, AttentionConfig(backend="flash_attn")) is FlashAttnBackend


@pytest.mark.parametrize(
    "generation, device, changes, expected",
    [
        (4, DeviceInfo.cuda(8, 0), {}, "needs compute capability 9.0..11.9 (this device: 8.0)"),
        (4, DeviceInfo.cuda(12, 0), {}, "needs compute capability 9.0..11.9 (this device: 12.0)"),
        (4, DeviceInfo.cpu(), {}, "needs a CUDA GPU"),
        (4, H100, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8 not supported"),
        (4, H100, {"alibi_slopes": tuple(1.0 for _ in range(32))}, "ALiBi not supported"),
        (4, H100, {"block_size": 8}, "block_size 8 is not a multiple of 16"),
        (4, H100, {"head_size": 264}, "head_size 264 not supported"),
        (4, H100, {"head_size": 100}, "head_size 100 not supported"),
        (4, B200, {"head_size": 192}, "head_size 192 on compute capability 10.x"),
        (4, H100, {"attn_type": "encoder_only"}, "attn_type encoder_only not supported"),
        (4, H100, {"kv_cache_dtype": "float16"}, "a 16-bit cache must match the model dtype"),
        (3, B200, {}, "flash-attn 3 paged attention needs compute capability 9.0..9.0"),
        (3, H100, {"has_sinks": True}, "attention sinks need flash-attn 4 (flash-attn 3 is installed)"),
        (2, H100, {}, "block_size 16 is not a multiple of 256 (flash-attn 2)"),
    ],
)
def test_every_reason_it_declines(monkeypatch, generation, device, changes, expected):
    fake_install(monkeypatch, generation)
    spec = LLAMA.model_copy(update=changes) if "attn_type" not in changes else AttentionSpec(
        **{**LLAMA.model_dump(), **changes})
    reasons = FlashAttnBackend.not_supported_reasons(spec, device)
    assert any(expected in r for r in reasons), reasons


@pytest.mark.parametrize("generation, changes", [
    (4, {"head_size": 256}), (4, {"head_size": 64, "sliding_window": 128, "logits_soft_cap": 30.0}),
    (4, {"has_sinks": True}), (4, {"block_size": 128}), (2, {"block_size": 256}), (3, {"head_size": 256}),
])
def test_accepts(monkeypatch, generation, changes):
    fake_install(monkeypatch, generation)
    spec = LLAMA.model_copy(update=changes)
    assert FlashAttnBackend.not_supported_reasons(spec, H100 if generation != 4 else B200
                                                  if changes.get("head_size") == 256 else H100) == []


def test_capabilities_are_data():
    caps = FlashAttnBackend.capabilities()
    assert caps["kv_cache_dtypes"] == ["auto", "bfloat16", "float16"]
    assert set(caps["features"]) == {"sliding_window", "soft_cap", "sinks"}
    assert caps["head_sizes"] == "8..256 (multiple of 8)"


def test_environment_facts_name_the_installed_generation(monkeypatch):
    """What a tune profile's key records about flash-attn, reached through the backend class."""
    fake_install(monkeypatch, None)
    assert FlashAttnBackend.environment_facts() == {"flash_attn": None}
    fake_install(monkeypatch, 3)
    assert FlashAttnBackend.environment_facts() == {"flash_attn": "flash-attn 3 (fake test)"}


def test_detection_finds_flash_attn_4_in_a_namespace_package(tmp_path, monkeypatch):
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    library.installed_flash_attn.cache_clear()
    try:
        install = library.installed_flash_attn()
        assert install is not None and install.generation == 4 and install.module == "flash_attn.cute"
    finally:
        library.installed_flash_attn.cache_clear()


def test_detection_ignores_a_bare_flash_attn_directory(tmp_path, monkeypatch):
    (tmp_path / "flash_attn").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    library.installed_flash_attn.cache_clear()
    try:
        assert library.installed_flash_attn() is None
    finally:
        library.installed_flash_attn.cache_clear()


def test_impl_refuses_an_unsupported_spec(monkeypatch):
    fake_install(monkeypatch, 4)
    with pytest.raises(NotImplementedError, match="head_size 100"):
        FlashAttnBackend.get_impl_cls()(LLAMA.model_copy(update={"head_size": 100}))


def test_builder_refuses_non_causal_and_bad_block_tables(monkeypatch):
    fake_install(monkeypatch, 4)
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16")
    batch = make_random_batch(spec, [SequenceShape(3, 5)])
    builder = FlashAttnBackend.get_builder_cls()(spec)
    batch.common.causal = False
    with pytest.raises(ValueError, match="causal"):
        builder.build(batch.common)
    batch.common.causal = True
    batch.common.block_table = batch.common.block_table.long()
    with pytest.raises(ValueError, match="block_table must hold torch.int32"):
        builder.build(batch.common)


def stand_in_paged_forward(install, call):
    """flash-attn's paged varlen contract in torch: rows per cu_seqlens_q, keys from page_table pages up to
    seqused_k, causal masks aligned to the sequence end, window (left, 0), soft-cap after scaling, sinks."""

    def forward(q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, cu_seqlens_k, max_q, max_k):
        assert cu_seqlens_q.dtype == seqused_k.dtype == page_table.dtype == torch.int32
        assert k_cache.stride(-1) == 1 and k_cache.shape[1:] == v_cache.shape[1:]
        assert out.shape == (q.shape[0], q.shape[1], v_cache.shape[-1]) and cu_seqlens_q[-1] == q.shape[0]
        page = k_cache.shape[1]
        group = q.shape[1] // k_cache.shape[2]
        for b in range(page_table.shape[0]):
            start, end, klen = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
            assert end - start <= max_q and klen <= max_k
            pages = page_table[b, : math.ceil(klen / page)].long()
            k = k_cache[pages].flatten(0, 1)[:klen].float().repeat_interleave(group, 1)
            v = v_cache[pages].flatten(0, 1)[:klen].float().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * call.softmax_scale
            if call.softcap:
                s = call.softcap * torch.tanh(s / call.softcap)
            qpos = torch.arange(klen - (end - start), klen)[:, None]
            kpos = torch.arange(klen)[None, :]
            mask = kpos <= qpos if call.causal else torch.ones_like(kpos <= qpos)
            if call.window_left is not None:
                mask &= kpos >= qpos - call.window_left
            s = s.masked_fill(~mask, float("-inf"))
            if call.sinks is not None:
                s = torch.cat([s, call.sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[..., :klen]
            out[start:end] = torch.einsum("hqk,khd->qhd", p, v).to(out.dtype)

    return forward


@pytest.mark.parametrize(
    "case", [c for c in conformance_cases("float16", 64, 16)
             if c.name.split("-")[0] in ("decode", "prefill", "chunked_prefill", "mixed", "mixed_padded", "random_mix",
                                         "mqa", "mha", "sliding_window", "soft_cap", "sinks")],
    ids=str,
)
def test_adapter_wiring_against_the_oracle(monkeypatch, case):
    """Everything but the kernel: argument translation, output slicing, padding rows left alone, cache writes."""
    fake_install(monkeypatch, 4)
    monkeypatch.setattr(library, "paged_forward", stand_in_paged_forward)
    monkeypatch.setattr(FlashAttnBackend, "not_supported_reasons", classmethod(lambda cls, spec, device: []))
    check_backend_on_batch(FlashAttnBackend, case.batch("cpu"))


def test_zeroed_cache():
    cache = FlashAttnBackend.allocate_kv_cache(3, LLAMA)
    assert cache.shape == (3, 2, 16, 8, 128) and cache.dtype == torch.bfloat16 and not bool(cache.any())
