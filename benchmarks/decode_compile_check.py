"""Compile the unified kernel's decode launches for sm_90 on a machine without a GPU, exactly as the backend would
launch them (the plan's constexprs, and Triton's own specialisation of the launch arguments: 16-divisible ints and
16-byte aligned pointers), and report what ptxas makes of each: registers a thread, spill stack, shared memory.

    python -m benchmarks.decode_compile_check    # JSON lines; exit status 1 if a scheduled launch spills more
                                                 # or takes more registers than its unscheduled twin (or 224)

The balanced schedule (:mod:`attnbackends.triton.decode_schedule`) is a mode of the unified kernel's decode path;
its launches should cost no more registers than the uniform decode's (a wider merge tile did: see
``decode_schedule.SCHEDULED_MERGE_VALUES``). Run in a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch

from attnbackends.spec import AttentionSpec
from attnbackends.triton import launch as launch_module
from attnbackends.triton.decode_schedule import make_decode_schedule, plan_decode_units, units_cap
from attnbackends.triton.heuristics import MAX_KV_SPLITS, choose_num_kv_splits
from attnbackends.triton.launch import SplitKVWorkspace, launch_attention, plan_attention

LLAMA = dict(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)


class _Recorder:
    """Stands in for the attention launcher: keeps the launch's arguments instead of launching."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, key, grid, args, constexprs, num_warps, num_stages) -> None:
        self.calls.append((grid, args, constexprs, num_warps, num_stages))


def _compile(args: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> dict:
    """Compile ``_unified_attention_kernel`` for sm_90 with Triton's specialisation of ``args``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch_module._unified_attention_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(zip(launch_module.UNIFIED_CONSTEXPRS, constexprs), num_warps=num_warps, num_stages=num_stages)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, consts, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=target, options=options.__dict__)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.unlink(f.name)
    report = {"shared": compiled.metadata.shared}
    for key, field in (("regs", "REG"), ("stack", "STACK")):
        m = re.search(rf"\b{field}:(\d+)", usage)
        report[key] = int(m.group(1)) if m else None
    return report


def launch_report(spec: AttentionSpec, seq_lens: list[int], *, scheduled: bool, decode_q: int = 1,
                  prefills: int = 0, tree: bool = False) -> dict:
    """The resources of the decode launch of ``seq_lens`` (single-token decodes, or verify of ``decode_q``
    tokens; ``prefills`` prompts of 64 tokens after them), on the balanced schedule or the uniform split."""
    num_decodes = len(seq_lens)
    num_tokens = num_decodes * decode_q + 64 * prefills
    num_seqs = num_decodes + prefills
    dtype, cache_dtype = spec.torch_dtype, spec.kv_cache_torch_dtype
    cache = torch.zeros(64, 2, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=cache_dtype)
    query = torch.zeros(num_tokens, spec.num_heads, spec.head_size, dtype=dtype)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    workspace = SplitKVWorkspace.allocate(max(num_tokens, 256), spec.num_heads, spec.head_size, MAX_KV_SPLITS)
    schedule, splits = None, 1
    if scheduled:
        table = plan_decode_units(np.array(seq_lens), None, num_sms=132, num_kv_heads=spec.num_kv_heads, align=128,
                                  max_units_per_request=units_cap(spec.head_size, MAX_KV_SPLITS))
        schedule = make_decode_schedule(table, device="cpu", align=128,
                                        max_units_per_request=units_cap(spec.head_size, MAX_KV_SPLITS))
    elif not prefills:
        splits = choose_num_kv_splits(num_decodes, spec.num_kv_heads, spec.num_heads, 132, max(seq_lens),
                                      max_query_len=decode_q)
    plan = plan_attention(
        num_tokens=num_tokens, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        block_size=spec.block_size, num_seqs=num_seqs, max_query_len=64 if prefills else decode_q,
        max_seq_len=max(seq_lens), kv_fp8=spec.is_fp8_kv_cache, causal=True, sliding_window=spec.sliding_window,
        logits_soft_cap=spec.logits_soft_cap, use_sinks=spec.has_sinks, scales_are_ptrs=spec.is_fp8_kv_cache,
        num_decodes=num_decodes, num_kv_splits=splits, workspace=workspace, decode_query_len=decode_q,
        use_tree=tree, decode_schedule=schedule)
    recorder, launcher = _Recorder(), launch_module._attention_launcher
    launch_module._attention_launcher = recorder
    try:
        scale = torch.ones(1, dtype=torch.float32)
        launch_attention(plan, query, cache[:, 0], cache[:, 1], torch.empty_like(query), qsl,
                         torch.zeros(num_seqs, dtype=torch.int32), torch.zeros(num_seqs, 64, dtype=torch.int32),
                         0.1, float(spec.logits_soft_cap or 0.0), None,
                         torch.zeros(spec.num_heads) if spec.has_sinks else None,
                         scale if spec.is_fp8_kv_cache else 1.0, scale if spec.is_fp8_kv_cache else 1.0,
                         tree_mask=torch.zeros(16, dtype=torch.uint8) if tree else None,
                         tree_indptr=torch.zeros(num_seqs + 1, dtype=torch.int32) if tree else None)
    finally:
        launch_module._attention_launcher = launcher
    grid, args, constexprs, num_warps, num_stages = recorder.calls[0]
    report = _compile(args, constexprs, num_warps, num_stages)
    report.update(schedule="balanced" if scheduled else f"uniform x{plan.num_kv_splits}", grid=list(grid))
    return report


CASES = {
    # name: (spec fields, sequence lengths, launch_report keywords)
    "bf16": ({}, [600] * 96 + [24000] * 8, {}),
    "bf16_b1": ({}, [16384], {}),
    "fp8_e4m3": (dict(kv_cache_dtype="fp8"), [600] * 96 + [24000] * 8, {}),
    "window_sinks_softcap": (dict(sliding_window=4096, has_sinks=True, logits_soft_cap=30.0),
                             [600] * 96 + [24000] * 8, {}),
    "verify_tree": (dict(num_speculative_tokens=3, speculative_tree=True), [600] * 60 + [20000] * 4,
                    dict(decode_q=4, tree=True)),
    "mixed": ({}, [600] * 60 + [20000] * 4, dict(prefills=2)),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=None, help=f"of {', '.join(CASES)}; default: all")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET (the interpreter replaces triton.language in this process)")
    problems = 0
    for name in args.cases or list(CASES):
        fields, lens, kw = CASES[name]
        spec = AttentionSpec(**{**LLAMA, **fields})
        uniform = launch_report(spec, lens, scheduled=False, **kw)
        balanced = launch_report(spec, lens, scheduled=True, **kw)
        for report in (uniform, balanced):
            print(json.dumps({"case": name, **report}), flush=True)
        if balanced["stack"] > uniform["stack"] or balanced["regs"] > max(uniform["regs"], 224):
            print(f"# {name}: the scheduled launch takes {balanced['regs']} registers and {balanced['stack']} bytes "
                  f"of stack (uniform: {uniform['regs']}, {uniform['stack']})", file=sys.stderr)
            problems += 1
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
