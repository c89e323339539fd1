"""The benchmark suites ``python -m benchmarks.run`` knows, by short name.

A suite is a module with ``main(argv) -> int`` that writes ``{"rows": [...]}`` (rows in the format of
``PERF.md``) to the file given as ``--out``; ``args`` are passed before ``--out``. Modules are imported only when a
suite runs, so a suite whose module is missing from the checkout is reported, not a crash.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

__all__ = ["Suite", "SUITES", "load", "module_present", "resolve"]


@dataclass(frozen=True)
class Suite:
    """One registered suite.

    Attributes
    ----------
    module : the module whose ``main(argv)`` runs it
    about : one line for ``--list``
    args : arguments passed to ``main`` before ``--out``
    default : run when no suite is named
    gpus : GPUs it needs (the result files' GPU name gets ``x<gpus>`` when above 1)
    out_dir_file : when set, ``--out`` names a directory and the rows are in this file under it
    """

    module: str
    about: str
    args: tuple[str, ...] = ()
    default: bool = False
    gpus: int = 1
    out_dir_file: Optional[str] = None
    aliases: tuple[str, ...] = field(default=())


SUITES: dict[str, Suite] = {
    "triton": Suite("benchmarks.triton_vs_flashinfer", "Triton kernels called directly vs FlashInfer wrappers "
                    "(decode bf16/fp8, prefill, mixed)", default=True, aliases=("triton_vs_flashinfer",)),
    "triton_api": Suite("benchmarks.triton_api", "the Triton backend through build() + forward() vs FlashInfer and "
                        "SDPA (host time, eager decode, decode, prefill, mixed)", default=True),
    "prefill_sweep": Suite("benchmarks.triton_api", "the Triton prefill kernel's tile configs on the prefill shapes "
                           "and the mixed step", args=("--prefill-sweep",)),
    "write_sweep": Suite("benchmarks.triton_api", "the KV-cache write kernel alone and beside the Gluon prefill on "
                         "k SMs", args=("--write-sweep",)),
    "decode": Suite("benchmarks.decode", "decode as an engine drives it on heavy-tailed ragged, uniform and mixed "
                    "batches vs FlashInfer's own wrappers and our adapter (eager and CUDA graphs, fp8 pages, the "
                    "copy roof, host time)", default=True),
    "flashinfer_adapter": Suite("benchmarks.flashinfer_adapter", "the FlashInfer adapter's cost over raw "
                                "FlashInfer wrapper calls; build() host time", default=True),
    "flashinfer_cascade": Suite("benchmarks.flashinfer_cascade", "FlashInfer's cascade attention as the adapter's "
                                "policy picks it vs cascade off, on shared-prefix steps"),
    "mla": Suite("benchmarks.mla", "MLA decode and prefill (DeepSeek-V3 dims) vs FlashInfer MLA", default=True),
    "sparse_mla": Suite("benchmarks.sparse_mla", "DeepSeek sparse attention (V3.2 dims, top-k 2048): sparse MLA "
                        "decode and prefill, the indexer, dense triton_mla at 128k context"),
    "sparse_mla_tile_sweep": Suite("benchmarks.sparse_mla_tile_sweep", "tile configs of the sparse MLA attention "
                                   "kernel on DeepSeek-V3.2 decodes: time, error against the default and an "
                                   "oracle"),
    "phase_selection": Suite("benchmarks.phase_selection", "prefill per backend and an engine-like mixed workload "
                             "on each backend and on the measured composition"),
    "hybrid_decode": Suite("benchmarks.hybrid_decode", "a Gemma-3-shaped decode step (sliding + global layer "
                           "groups) vs the sum of its groups alone", default=True),
    "spec_decode": Suite("benchmarks.spec_decode", "speculative verify with a tree mask and multi-token decode",
                         default=True),
    "spec_engine": Suite("benchmarks.spec_engine", "speculative decoding end to end on the compact engine: "
                         "acceptance and tokens/s per drafter", out_dir_file="spec_engine.json"),
    "serving_trace": Suite("benchmarks.serving_trace", "serving traces (chat, long documents, short prompts, "
                           "decode-heavy) on model layer shapes"),
    "prefill_hopper_paged_sweep": Suite("benchmarks.prefill_hopper_paged_sweep", "configurations of the paged "
                                        "Gluon prefill (registers, stages, O staging) on chunk and fresh shapes"),
    "bad_input_cost": Suite("benchmarks.bad_input_cost", "host cost of the per-step bad-input checks in build() "
                            "and forward(), by how the engine passes the batch"),
    "step_host": Suite("benchmarks.step_host", "host cost of a step's common metadata: PersistentBatch (appends + "
                       "prepare, one copy) vs build_common_metadata from lists; add/finish per request"),
    "step_wall": Suite("benchmarks.step_wall", "whole-step wall time of 32 Llama-3-8B layers on ragged steps: "
                       "triton eager and from a CUDA graph vs FlashInfer's own wrappers, our adapter beside"),
    "engine_graphs": Suite("benchmarks.engine_graphs", "the built-in engine's demo model, decode-heavy: tokens/s "
                           "with decode steps from CUDA graphs vs eager"),
    "first_run": Suite("benchmarks.first_run", "`attnbackends demo` end to end in a fresh process with empty "
                       "Triton and FlashInfer caches"),
    "hf_generate_batch": Suite("benchmarks.hf_generate_batch", "transformers' generate_batch tokens/s with "
                               "paged|attnbackends vs paged|sdpa (and flash_attention_2 where installed)"),
    "mask_prefill": Suite("benchmarks.mask_prefill", "masked prefill (image spans, block-causal, two-sided window, "
                          "non-causal, custom) vs our causal prefill on equal work and FlashInfer's custom mask"),
    "mask_decode": Suite("benchmarks.mask_decode", "masked decodes over a cached context (non-causal, image spans, "
                         "custom) vs our causal decode of the same batch and FlashInfer where it serves the mask"),
    "kv_quant_decode": Suite("benchmarks.kv_quant", "decode over quantised KV caches (per-token-head fp8/int8/int4, "
                             "NVFP4, fp8 per tensor) vs our bf16 cache, uniform and ragged, bytes moved",
                             args=("--mode", "decode")),
    "kv_quant_prefill": Suite("benchmarks.kv_quant", "a chunk on cached context over quantised KV caches vs our bf16 "
                              "cache", args=("--mode", "prefill")),
    "kv_quant_accuracy": Suite("benchmarks.kv_quant", "output error of each quantised KV cache vs the bf16 cache, "
                               "random and outlier-head data", args=("--mode", "accuracy")),
    "cp_decode": Suite("benchmarks.cp_decode", "decode context parallelism: 1 rank vs 2 ranks (NCCL exchange)",
                       gpus=2),
}


def resolve(name: str) -> str:
    """The registered name of ``name`` (a name or an alias); ValueError naming the allowed names otherwise."""
    if name in SUITES:
        return name
    for key, suite in SUITES.items():
        if name in suite.aliases:
            return key
    raise ValueError(f"unknown suite {name!r}; allowed: {', '.join(SUITES)}")


def module_present(name: str) -> bool:
    """Whether the suite's module exists in this checkout (without importing it)."""
    try:
        return importlib.util.find_spec(SUITES[name].module) is not None
    except ModuleNotFoundError:
        return False


def load(name: str) -> ModuleType:
    """Import the suite's module; ModuleNotFoundError naming the suite when its module is not in the checkout."""
    suite = SUITES[name]
    if not module_present(name):
        raise ModuleNotFoundError(f"suite {name}: module {suite.module} is not in this checkout")
    return importlib.import_module(suite.module)
