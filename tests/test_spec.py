import json
import math

import pytest
import torch
from pydantic import ValidationError

from attnbackends import AttentionConfig, AttentionSpec, AttentionType

BASE = dict(num_heads=8, num_kv_heads=2, head_size=64)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_heads": 0}, "num_heads"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_size": 0}, "head_size"),
        ({"head_size_v": 0}, "head_size_v"),
        ({"dtype": "int8"}, "dtype"),
        ({"dtype": torch.int32}, "dtype"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"block_size": 0}, "block_size"),
        ({"attn_type": "cross"}, "attn_type"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 4, "attn_type": "encoder_only"}, "sliding_window"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap"),
        ({"alibi_slopes": (0.5, 0.25)}, "alibi_slopes"),
        ({"alibi_slopes": (math.nan,) * 8}, "alibi_slopes"),
        ({"scale": 0.0}, "scale"),
        ({"kv_lora_rank": 512}, "qk_nope_head_dim"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_invalid_spec_names_the_field(overrides, field):
    with pytest.raises(ValidationError) as err:
        AttentionSpec(**{**BASE, **overrides})
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"head_size": 512}, "head_size"),
        ({"num_kv_heads": 2, "num_heads": 16}, "num_kv_heads"),
        ({"head_size_v": 128}, "head_size_v"),
        ({"attn_type": "encoder_only"}, "attn_type"),
    ],
)
def test_invalid_mla_spec_names_the_field(overrides, field):
    kwargs = dict(
        num_heads=16, num_kv_heads=1, head_size=576, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
    )
    with pytest.raises(ValidationError) as err:
        AttentionSpec(**{**kwargs, **overrides})
    assert field in str(err.value)


def test_allowed_values_are_listed():
    with pytest.raises(ValidationError) as err:
        AttentionSpec(**BASE, kv_cache_dtype="fp4")
    for allowed in ("auto", "fp8_e4m3", "fp8_e5m2"):
        assert allowed in str(err.value)


def test_spec_defaults_and_derived_values():
    spec = AttentionSpec(**BASE, dtype=torch.float16, kv_cache_dtype="fp8")
    assert spec.dtype == "float16" and spec.torch_dtype == torch.float16
    assert spec.kv_cache_torch_dtype == torch.float8_e4m3fn and spec.is_fp8_kv_cache
    assert spec.softmax_scale == pytest.approx(1 / 8)
    assert spec.num_queries_per_kv == 4 and spec.value_head_size == 64
    assert spec.attn_type is AttentionType.DECODER and spec.causal
    with pytest.raises(ValidationError):
        spec.num_heads = 4  # frozen
    assert hash(spec) == hash(AttentionSpec(**BASE, dtype="float16", kv_cache_dtype="fp8"))


def test_mla_spec():
    spec = AttentionSpec.mla(num_heads=128)
    assert spec.is_mla and spec.head_size == 576 and spec.num_kv_heads == 1
    assert spec.value_head_size == spec.v_head_dim == 128  # the output's head size (the latent is 512)
    assert spec.softmax_scale == pytest.approx(1 / math.sqrt(192))


def test_config_sources(tmp_path, monkeypatch):
    assert AttentionConfig().backend == "auto"
    cfg = AttentionConfig.model_validate({"backend": "Triton", "priority": ["triton", "reference"]})
    assert cfg.backend == "triton" and cfg.priority == ("triton", "reference")
    (tmp_path / "c.yaml").write_text("attention:\n  backend: reference\n  priority: [reference]\n")
    assert AttentionConfig.from_file(tmp_path / "c.yaml").backend == "reference"
    (tmp_path / "c.json").write_text(json.dumps({"backend": "flashinfer"}))
    assert AttentionConfig.from_file(tmp_path / "c.json").backend == "flashinfer"
    (tmp_path / "c.txt").write_text("backend: x")
    with pytest.raises(ValueError, match="yaml"):
        AttentionConfig.from_file(tmp_path / "c.txt")
    with pytest.raises(ValidationError, match="priorty"):
        AttentionConfig.model_validate({"priorty": ["x"]})
    monkeypatch.setenv("ATTNBACKENDS_BACKEND", " Reference ")
    assert AttentionConfig.from_env(cfg).backend == "reference"
    assert AttentionConfig.from_env(cfg).priority == ("triton", "reference")
    monkeypatch.delenv("ATTNBACKENDS_BACKEND")
    assert AttentionConfig.from_env(cfg) == cfg
