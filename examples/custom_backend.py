"""Bring your own attention backend: subclass a built-in one, register it, select it from config, serve a model.

    python examples/custom_backend.py

1. ``triton_telemetry``: the Triton backend with a telemetry hook (impl calls and tokens), registered in-process
   with the ``@register_backend`` decorator and selected from a YAML config.
2. ``my_triton``: the Triton backend narrowed to head sizes 64 and 128, shipped in its own package
   (``examples/plugin_pkg``) and found through the ``attnbackends.backends`` entry-point group declared in that
   package's pyproject.toml. ``pip install -e examples/plugin_pkg`` installs it; if it is not installed, this script
   makes it discoverable for its own process the way pip would (a ``.dist-info`` holding ``entry_points.txt``).

Runs on a GPU, or on the CPU with Triton interpreted (set below, before triton is imported; slow, so the models are
tiny). Exit status 1 when a check fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # No GPU: run Triton kernels through its interpreter. It reads this variable when triton is first imported, so
    # it is set before anything imports attnbackends' Triton modules.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import yaml  # noqa: E402

from attnbackends import AttentionConfig, AttentionSpec, DeviceInfo, explain, register_backend, select  # noqa: E402
from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig  # noqa: E402

try:
    from attnbackends.triton.backend import TritonAttentionBackend as BaseBackend
    from attnbackends.triton.backend import TritonImpl as BaseImpl
except ImportError:
    # Triton cannot be imported on this machine (no wheel for the platform): the same telemetry hook on the
    # pure-torch reference backend, so the registration and selection steps still run.
    from attnbackends.reference.backend import ReferenceBackend as BaseBackend
    from attnbackends.reference.backend import ReferenceImpl as BaseImpl

HERE = Path(__file__).resolve().parent
PLUGIN_ENTRY_POINTS = "[attnbackends.backends]\nmy_triton = my_attn_plugin.backend:MyTritonBackend\n"


# --------------------------------------------------------------------------- 1. a subclass, registered by decorator


class Telemetry:
    """What the hook saw: impl forward calls, and tokens attended (summed over layers)."""

    calls = 0
    tokens = 0


class TelemetryImpl(BaseImpl):
    def forward(self, query, key, value, kv_cache, metadata, output):
        Telemetry.calls += 1
        Telemetry.tokens += metadata.common.num_actual_tokens
        return super().forward(query, key, value, kv_cache, metadata, output)


@register_backend("triton_telemetry")
class TelemetryTritonBackend(BaseBackend):
    """The built-in backend's kernels and capabilities, plus a telemetry hook in the impl."""

    name = "triton_telemetry"
    description = f"{BaseBackend.name} with a telemetry hook (example)"

    @classmethod
    def get_impl_cls(cls) -> type[TelemetryImpl]:
        return TelemetryImpl


CONFIG_YAML = """
attention:
  backend: triton_telemetry   # any registered name: built-in, decorated or entry point
"""


def tiny_model(head_size: int) -> TinyLlama:
    return TinyLlama(
        TinyLlamaConfig(vocab_size=256, hidden_size=4 * head_size, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_size=head_size, intermediate_size=256),
        seed=0,
    )


def serve(model: TinyLlama, config: AttentionConfig, device: str, dtype: torch.dtype):
    engine = PagedEngine(model, EngineConfig(block_size=16, num_blocks=32, max_num_batched_tokens=16, max_num_reqs=4),
                         device=device, dtype=dtype, attention_config=config)
    prompts = [[1, 2, 3], [7] * 20, [42]]
    return engine, engine.generate(prompts, max_new_tokens=3)


def decorator_example(device: str, dtype: torch.dtype) -> bool:
    print("== 1. subclass + @register_backend, selected from a YAML config")
    config = AttentionConfig.model_validate(yaml.safe_load(CONFIG_YAML)["attention"])
    engine, result = serve(tiny_model(32), config, device, dtype)
    print(f"backend chosen: {result.backend}")
    expected_calls = engine.model.num_layers * result.num_steps
    expected_tokens = engine.model.num_layers * sum(engine.scheduled_tokens)
    print(f"telemetry: {Telemetry.calls} impl calls (expected {expected_calls}), "
          f"{Telemetry.tokens} tokens (expected {expected_tokens})")
    _, baseline = serve(tiny_model(32), AttentionConfig(backend="reference"), device, dtype)
    same = baseline.tokens == result.tokens
    print(f"generated tokens identical to the reference backend's: {same}")
    return result.backend == "triton_telemetry" and Telemetry.calls == expected_calls and Telemetry.tokens == expected_tokens and same


# --------------------------------------------------------------------------- 2. a plugin package, found by entry point


def make_plugin_discoverable() -> str:
    """Make examples/plugin_pkg's entry point visible to importlib.metadata unless the package is installed."""
    from importlib import metadata

    if any(ep.name == "my_triton" for ep in metadata.entry_points(group="attnbackends.backends")):
        return "installed"
    site = Path(tempfile.mkdtemp(prefix="my_attn_plugin_"))
    dist_info = site / "my_attn_plugin-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-attn-plugin\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text(PLUGIN_ENTRY_POINTS)
    sys.path[:0] = [str(HERE / "plugin_pkg"), str(site)]
    return "not installed: made discoverable for this process (pip install -e examples/plugin_pkg installs it)"


def entry_point_example(device: str, dtype: torch.dtype, plugin_status: str) -> bool:
    print("== 2. a plugin package registered by entry point (examples/plugin_pkg)")
    print(f"my-attn-plugin: {plugin_status}")
    config = AttentionConfig(backend="my_triton")
    narrow = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype)
    row = {r.name: r for r in explain(narrow, DeviceInfo.current(device), config).rows}["my_triton"]
    print(f"my_triton for head_size 32: {'; '.join(row.reasons) or 'fits'}")
    from my_attn_plugin.backend import MyTritonBackend

    engine, result = serve(tiny_model(64), config, device, dtype)
    print(f"backend chosen: {result.backend} ({select(engine.spec, DeviceInfo.current(device), config).__module__})")
    print(f"my_triton telemetry: {MyTritonBackend.calls} impl calls, {MyTritonBackend.tokens} tokens")
    return result.backend == "my_triton" and bool(row.reasons) and MyTritonBackend.calls == engine.model.num_layers * result.num_steps


def main() -> int:
    # Entry points are read once, on the registry's first lookup: make the plugin visible before any selection.
    plugin_status = make_plugin_discoverable()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16  # the Triton kernels have no float32 path
    print(f"device: {DeviceInfo.current(device).describe()}; base class: {BaseBackend.__module__}.{BaseBackend.__name__}")
    ok = decorator_example(device, dtype)
    ok = entry_point_example(device, dtype, plugin_status) and ok
    print("all checks passed" if ok else "a check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
