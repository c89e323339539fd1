"""Config-driven backend selection: read the choice from a YAML file, select for a model's layers, and see the clear
error when the configured backend does not fit a layer.

    python examples/config_selection.py                       # uses examples/attention.yaml (backend: triton)
    python examples/config_selection.py --config my_attn.yaml

Runs on a GPU, or on the CPU with Triton interpreted (set below, before triton is imported). Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter, which must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import (  # noqa: E402
    BACKEND_ENV_VAR,
    AttentionConfig,
    AttentionSpec,
    BackendNotSupportedError,
    DeviceInfo,
    explain,
    select,
)
from attnbackends.engine import EngineConfig, PagedEngine, TinyLlama, TinyLlamaConfig  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "attention.yaml"


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML or JSON file with an attention: section")
    args = parser.parse_args(argv)
    ok = True

    # The user's choice: the file, then ATTNBACKENDS_BACKEND on top (the one override variable).
    config = AttentionConfig.from_env(AttentionConfig.from_file(args.config))
    device = DeviceInfo.current()
    print(f"config {args.config.name}: backend={config.backend!r} priority={config.priority}; device: {device.describe()}")

    # 1. A layer the configured backend serves: a Llama-style GQA layer in half precision.
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype="float16", block_size=16)
    try:
        backend = select(spec, device, config)
    except BackendNotSupportedError as exc:  # e.g. `backend: flashinfer` on a machine without it
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\n[1] {spec.num_heads}/{spec.num_kv_heads} heads of {spec.head_size}, {spec.dtype}: backend chosen: {backend.name}")
    print(explain(spec, device, config))

    # The engine takes the same config and serves a tiny model through that backend.
    model = TinyLlama(TinyLlamaConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                      head_size=64, intermediate_size=256))
    engine = PagedEngine(model, EngineConfig(max_num_batched_tokens=16), device=device.torch_device,
                         dtype=torch.float16, attention_config=config)
    result = engine.generate([[1, 2, 3, 4, 5], [9] * 18], max_new_tokens=2)
    print(f"engine: backend {result.backend}, generated {result.tokens}")
    ok &= result.backend == backend.name

    # 2. Layers the configured backend does not serve: selection raises, names the backend and lists its reasons
    #    (and every other backend's), and never falls back silently.
    misfits = {
        "float32 layer": spec.model_copy(update={"dtype": "float32"}),
        "head_size 512": spec.model_copy(update={"head_size": 512}),
        "DeepSeek-V3 MLA layer": AttentionSpec.mla(num_heads=16, dtype="float16"),
    }
    for label, bad in misfits.items():
        try:
            chosen = select(bad, device, config)
        except BackendNotSupportedError as exc:
            row = {r.name: r for r in exc.explanation.rows}.get(config.backend)
            print(f"\n[2] {label}: BackendNotSupportedError")
            print(str(exc))
            if row is not None:
                print(f"-> {config.backend} cannot: {'; '.join(row.reasons)}")
        else:
            if config.backend != "auto":
                print(f"\n[2] {label}: {chosen.name} serves it")
            else:
                print(f"\n[2] {label}: auto selection picked {chosen.name}")

    # 3. A name nobody registered is a ValueError that lists the registered names.
    if os.environ.get(BACKEND_ENV_VAR, "").strip():
        print(f"\n[3] skipped: {BACKEND_ENV_VAR} is set and overrides the backend of every config")
    else:
        try:
            select(spec, device, AttentionConfig(backend="no_such_backend"))
            ok = False
        except BackendNotSupportedError:
            ok = False
        except ValueError as exc:
            print(f"\n[3] unknown name: ValueError: {exc}")

    # 4. "auto" walks the platform's priority list (or the config's `priority`) and takes the first that fits.
    auto = select(spec.model_copy(update={"dtype": "float32"}), device, config.model_copy(update={"backend": "auto"}))
    print(f"\n[4] backend: auto, float32 layer: backend chosen: {auto.name}")

    print("\nall checks passed" if ok else "\na check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
