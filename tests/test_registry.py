"""Selection: explicit choices, the environment override, plugins by decorator and entry point, explanations."""

from importlib import metadata as importlib_metadata

import pytest

import attnbackends.selection.registry as registry
from attnbackends import (
    AttentionConfig,
    AttentionSpec,
    BackendNotSupportedError,
    DeviceInfo,
    backend_names,
    explain,
    get_backend_class,
    register_backend,
    select,
    unregister_backend,
)
from attnbackends.reference.backend import ReferenceBackend

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64)
CPU = DeviceInfo.cpu(triton_interpreted=False)


def test_cpu_default_is_reference(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    assert select(SPEC, CPU) is ReferenceBackend
    assert explain(SPEC, CPU).chosen == "reference"


def test_every_builtin_name_is_registered():
    for name in ("reference", "reference_mla", "triton", "flashinfer", "triton_mla", "flashinfer_mla"):
        assert name in backend_names()


def test_explicit_choice_that_does_not_fit_raises_with_its_reasons(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    with pytest.raises(BackendNotSupportedError) as err:
        select(SPEC, CPU, AttentionConfig(backend="flashinfer"))
    assert "requested backend 'flashinfer'" in str(err.value)
    row = dict((n, (s, r)) for n, s, r in err.value.explanation.as_table())["flashinfer"]
    assert row[0] == "rejected" and row[1]


def test_environment_variable_overrides_config(monkeypatch):
    monkeypatch.setenv("ATTNBACKENDS_BACKEND", "flashinfer")
    with pytest.raises(BackendNotSupportedError, match="flashinfer"):
        select(SPEC, CPU, AttentionConfig(backend="reference"))
    monkeypatch.setenv("ATTNBACKENDS_BACKEND", "reference")
    assert select(SPEC, CPU) is ReferenceBackend


def test_unknown_backend_name(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    with pytest.raises(ValueError, match="unknown backend 'nope'.*registered: .*reference"):
        select(SPEC, CPU, AttentionConfig(backend="nope"))
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend_class("nope")
    with pytest.raises(ValueError, match="priority names unknown backends"):
        select(SPEC, CPU, AttentionConfig(priority=("nope",)))


def test_nothing_fits_lists_every_backend(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype="float32")
    with pytest.raises(BackendNotSupportedError) as err:
        select(spec, DeviceInfo.cuda(9, 0), AttentionConfig(priority=("triton",)))
    names = [row[0] for row in err.value.explanation.as_table()]
    assert set(names) == set(backend_names())
    assert "dtype float32 not supported" in str(err.value)


def test_decorator_registration_and_priority(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)

    @register_backend("telemetry_ref", select_before="reference")
    class TelemetryReference(ReferenceBackend):
        name = "telemetry_ref"

    try:
        assert select(SPEC, CPU) is TelemetryReference
        assert select(SPEC, CPU, AttentionConfig(priority=("reference",))) is ReferenceBackend
        with pytest.raises(ValueError, match="already registered"):
            register_backend("telemetry_ref")(ReferenceBackend)
    finally:
        unregister_backend("telemetry_ref")
    assert select(SPEC, CPU) is ReferenceBackend
    with pytest.raises(TypeError):
        register_backend("bad")(object)


def test_select_before_joins_every_list_that_holds_a_named_backend(monkeypatch):
    """select_before names backends, not device classes: "triton" is on the CUDA list only, so a CPU host never
    auto-selects a backend registered before it; naming reference too puts it first on the CPU list as well."""
    from attnbackends.selection.registry import priority_list

    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)

    @register_backend("mine_cuda_only", select_before="triton")
    class CudaOnly(ReferenceBackend):
        name = "mine_cuda_only"

    @register_backend("mine_everywhere", select_before=("triton", "reference"))
    class Everywhere(ReferenceBackend):
        name = "mine_everywhere"

    try:
        cuda = priority_list(DeviceInfo.cuda(9, 0), SPEC)
        assert cuda.index("mine_cuda_only") + 1 == cuda.index("mine_everywhere") == cuda.index("triton") - 1
        assert priority_list(CPU, SPEC) == ["mine_everywhere", "reference"]
        assert select(SPEC, CPU) is Everywhere
        mla = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        assert "mine_everywhere" not in priority_list(CPU, mla)  # reference_mla is another name
        with pytest.raises(ValueError, match="names the backend being registered"):
            register_backend("plugin_ref", select_before=("reference", "plugin_ref"))(PluginBackend)
    finally:
        unregister_backend("mine_cuda_only")
        unregister_backend("mine_everywhere")
    assert priority_list(CPU, SPEC) == ["reference"]


class PluginBackend(ReferenceBackend):
    name = "plugin_ref"


class _FakeEntryPoint:
    def __init__(self, name, value):
        self.name, self.value = name, value


def test_entry_point_plugins(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)
    eps = [_FakeEntryPoint("plugin_ref", f"{__name__}:PluginBackend"), _FakeEntryPoint("broken", "no_such_module_xyz:B")]
    monkeypatch.setattr(importlib_metadata, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        assert "plugin_ref" in backend_names()
        assert select(SPEC, CPU, AttentionConfig(backend="plugin_ref")) is PluginBackend
        rows = {n: (s, r) for n, s, r in explain(SPEC, CPU).as_table()}
        assert rows["plugin_ref"][0] == "fits (not in priority list)"
        assert rows["broken"][0] == "rejected" and "cannot be imported" in rows["broken"][1]
    finally:
        unregister_backend("plugin_ref")
        unregister_backend("broken")


def test_device_info():
    dev = DeviceInfo.cuda(8, 9, sm_count=100)
    assert dev.is_cuda and dev.compute_capability == (8, 9) and dev.runs_triton
    assert not DeviceInfo.cpu(triton_interpreted=False).runs_triton
    assert DeviceInfo.cpu(triton_interpreted=True).runs_triton
    with pytest.raises(ValueError, match="compute_capability"):
        DeviceInfo(kind="cuda")
    assert DeviceInfo.current("cpu").kind == "cpu"


def test_decorator_name_becomes_the_class_name(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)

    @register_backend("Mine")
    class Mine(ReferenceBackend):  # no `name` of its own: it would otherwise keep "reference"
        pass

    try:
        assert Mine.name == "mine" and get_backend_class("mine") is Mine
        assert select(SPEC, CPU, AttentionConfig(backend="mine")).name == "mine"
        assert ReferenceBackend.name == "reference"
    finally:
        unregister_backend("mine")


def test_class_that_would_keep_its_parents_name_is_refused():
    class Nameless(ReferenceBackend):
        pass

    before = (dict(registry._REGISTRY), {k: list(v) for k, v in registry._PRIORITIES.items()})
    with pytest.raises(ValueError, match="Nameless defines no name of its own .*parent's name 'reference'"):
        register_backend()(Nameless)

    class Named(ReferenceBackend):
        name = "named_one"

    with pytest.raises(ValueError, match=r"Named.name is 'named_one' but register_backend was given 'other'"):
        register_backend("other")(Named)
    assert (dict(registry._REGISTRY), {k: list(v) for k, v in registry._PRIORITIES.items()}) == before


def test_failed_registration_leaves_nothing_registered(monkeypatch):
    monkeypatch.delenv("ATTNBACKENDS_BACKEND", raising=False)

    class Typo(ReferenceBackend):
        name = "typo_ref"

    before = {k: list(v) for k, v in registry._PRIORITIES.items()}
    with pytest.raises(ValueError, match="select_before='refrence' is in no priority list"):
        register_backend(select_before="refrence")(Typo)
    assert "typo_ref" not in backend_names()
    assert {k: list(v) for k, v in registry._PRIORITIES.items()} == before
    try:
        register_backend(select_before="reference")(Typo)  # the corrected retry succeeds
        assert select(SPEC, CPU) is Typo
    finally:
        unregister_backend("typo_ref")
