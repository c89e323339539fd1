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
from attnbackends.triton.prefill_launch import PrefillConfig, default_prefill_config
from benchmarks.offline_compile import SHARED_LIMIT, compile_call


def report(head_size: int, config: PrefillConfig, num_heads: int = 32, num_kv_heads: int = 8,
           block_size: int = 16, sliding_window: int = 0, softcap: bool = False, sinks: bool = False) -> dict:
    """The sm_90 compile of the kernel for bf16 tensors of this shape (no kernel runs)."""
    bf = torch.bfloat16
    tokens, blocks = 256, 64
    q = torch.empty(tokens, num_heads, head_size, dtype=bf)
    k = torch.empty(tokens, num_kv_heads, head_size, dtype=bf)
    cache = torch.empty(blocks, 2, block_size, num_kv_heads, head_size, dtype=bf)
    kc, vc = cache[:, 0], cache[:, 1]
    table = torch.zeros(4, 16, dtype=torch.int32)
    lens = torch.zeros(4, dtype=torch.int32)
    starts = torch.zeros(5, dtype=torch.int32)
    sink_logits = torch.empty(num_heads, dtype=torch.float32)
    args = (q, k, k.clone(), q.clone(), kc, vc, table, blocks, lens, starts, sink_logits, 0, q.stride(0),
            k.stride(0), k.stride(0), q.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0),
            vc.stride(1), vc.stride(2), table.stride(0), 0.1, 30.0)
    kwargs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, SLIDING_WINDOW=sliding_window,
                  USE_SOFTCAP=softcap, USE_SINKS=sinks, INTERPRET=False, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    out = compile_call(prefill_new_kv_kernel, args, kwargs)
    return {"head_size": head_size, "config": [config.block_m, config.block_n, config.num_warps, config.num_stages],
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
