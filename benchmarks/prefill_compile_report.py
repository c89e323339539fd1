"""Compile the Triton prefill kernel for sm_90 on a machine without a GPU and report its resources per tile config
(registers, spill stack, shared memory, wgmma shapes), as JSON lines.

    python -m benchmarks.prefill_compile_report [--head-sizes 64,128] [--configs 128x64x8x3,...]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from attnbackends.triton.prefill_kernel import prefill_new_kv_kernel
from attnbackends.triton.heuristics import PrefillConfig, default_prefill_config
from attnbackends.triton.prefill_launch import PREFILL_CONSTEXPRS, plan_prefill_new_kv, prefill_kernel_args
from benchmarks.offline_compile import SHARED_LIMIT, compile_call


def report(head_size: int, config: PrefillConfig, num_heads: int = 32, num_kv_heads: int = 8,
           block_size: int = 16, sliding_window: int = 0, softcap: bool = False, sinks: bool = False) -> dict:
    """The sm_90 compile of the kernel for bf16 tensors of this shape (no kernel runs), with the arguments the
    launcher passes (:func:`~attnbackends.triton.prefill_launch.prefill_kernel_args`)."""
    bf = torch.bfloat16
    tokens, blocks = 256, 64
    q = torch.empty(tokens, num_heads, head_size, dtype=bf)
    k = torch.empty(tokens, num_kv_heads, head_size, dtype=bf)
    cache = torch.empty(blocks, 2, block_size, num_kv_heads, head_size, dtype=bf)
    plan = plan_prefill_new_kv(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                               block_size=block_size, num_seqs=4, first_seq=0, max_query_len=tokens,
                               sliding_window=sliding_window, use_softcap=softcap, use_sinks=sinks, config=config)
    args = prefill_kernel_args(plan, q, k, k.clone(), q.clone(), cache[:, 0], cache[:, 1],
                               torch.zeros(4, 16, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                               torch.zeros(5, dtype=torch.int32), 0.1, 30.0,
                               torch.empty(num_heads, dtype=torch.float32))
    kwargs = dict(zip(PREFILL_CONSTEXPRS, plan.constexprs), num_warps=plan.num_warps, num_stages=plan.num_stages)
    out = compile_call(prefill_new_kv_kernel, args, kwargs)
    return {"head_size": head_size, "config": [config.block_m, config.block_n, config.num_warps, config.num_stages, config.gqa_pack],
            "sliding_window": sliding_window, "softcap": softcap, "sinks": sinks,
            "regs": out["regs"], "stack": out["stack"], "shared": out["shared"],
            "shared_limit": SHARED_LIMIT[90], "wgmma": out["wgmma"]}


def _config(text: str) -> PrefillConfig:
    return PrefillConfig(*(int(x) for x in text.split("x")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-sizes", default="64,128")
    ap.add_argument("--features", action="store_true", help="also the window + sinks and soft-cap variants")
    ap.add_argument("--configs", default=None, help="block_m x block_n x warps x stages, comma separated "
                                                      "(default: the kernel's default config for each variant)")
    args = ap.parse_args(argv)
    for head_size in (int(h) for h in args.head_sizes.split(",")):
        variants = [dict()]
        if args.features:
            variants += [dict(sliding_window=128, sinks=True), dict(softcap=True)]
        for features in variants:
            configs = [_config(c) for c in args.configs.split(",")] if args.configs else [
                default_prefill_config(head_size=head_size, sliding_window=features.get("sliding_window"))]
            for config in configs:
                print(json.dumps(report(head_size, config, **features)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
