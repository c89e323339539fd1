"""The split-KV decode's tile and launch options swept on a few decode shapes, through
:func:`attnbackends.triton.launch.unified_attention` with a forced ``num_kv_splits`` and ``config``.

    python -m benchmarks.decode_tile_sweep [--out rows.json] [--shapes b1_16384 b64_4096_fp8] [--quick]

Llama-3-8B layer (32 query / 8 KV heads, head 128, pages of 16, pages shuffled), the cache already holding every key;
each row: the shape, the split count, the config, µs (``triton.testing.do_bench`` median), effective TB/s (K and V
bytes of every key / time) and the largest difference from the default launch's output. The defaults'
row (``config: "default"``) comes first; the sweep says which options would move the default.
"""

from __future__ import annotations

import argparse
import itertools
from datetime import date
import sys
from pathlib import Path

import torch

from attnbackends.triton.heuristics import KernelConfig, device_sm_count
from attnbackends.triton.launch import SplitKVWorkspace, unified_attention

from .report import library_versions, write_json
from .triton_api import do_bench_us

HQ, HKV, D, PAGE = 32, 8, 128, 16

#: name -> (batch size, sequence length, cache dtype)
SHAPES = {
    "b1_16384": (1, 16384, torch.bfloat16),
    "b1_16384_fp8": (1, 16384, torch.float8_e4m3fn),
    "b4_32768": (4, 32768, torch.bfloat16),
    "b64_4096_fp8": (64, 4096, torch.float8_e4m3fn),
    "b128_8192_fp8": (128, 8192, torch.float8_e4m3fn),
}


def make_case(batch: int, seq_len: int, cache_dtype: torch.dtype, seed: int = 0):
    """Query, paged K/V caches (pages shuffled) and the batch tensors of ``batch`` decodes at ``seq_len``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-seq_len // PAGE)
    num_blocks = batch * pages_per_seq
    kv = torch.randn(2, num_blocks, PAGE, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    kv = kv.to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    return dict(
        query=torch.randn(batch, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16),
        key_cache=kv[0], value_cache=kv[1],
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, device="cuda", dtype=torch.int32),
        block_table=perm.view(batch, pages_per_seq),
        max_query_len=1, max_seq_len=seq_len, softmax_scale=D ** -0.5, causal=True,
        num_decodes=batch,
    ), 2 * batch * seq_len * HKV * D * kv.element_size()


def configs(quick: bool):
    tiles = (64, 128) if quick else (32, 64, 128)
    warps = (4, 8)
    stages = (2, 3, 4) if quick else (2, 3, 4, 5)
    for tile, w, s in itertools.product(tiles, warps, stages):
        yield KernelConfig(decode_block_m=16, decode_tile_n=tile, num_warps=w, num_stages=s)


def sweep(name: str, quick: bool) -> list[dict]:
    batch, seq_len, dtype = SHAPES[name]
    case, kv_bytes = make_case(batch, seq_len, dtype)
    workspace = SplitKVWorkspace.allocate(batch, HQ, D, device="cuda")
    out = torch.empty_like(case["query"])

    def run(splits, config):
        return unified_attention(output=out, workspace=workspace, num_kv_splits=splits, config=config,
                                 validate=False, **case)

    run(None, None)
    want = out.clone()
    rows = [dict(shape=name, splits="default", config="default", us=do_bench_us(lambda: run(None, None)))]
    sms = device_sm_count(torch.device("cuda"))
    split_options = [s for s in (1, 2, 4, 8, 16, 32) if sms // 4 <= batch * HKV * s <= 8 * sms] or [1]
    for splits in split_options:
        for config in configs(quick):
            out.fill_(float("nan"))
            try:
                run(splits, config)
                torch.cuda.synchronize()
                us = do_bench_us(lambda: run(splits, config))
            except Exception as exc:  # a config the compiler refuses (registers, shared memory)
                rows.append(dict(shape=name, splits=splits, config=str(config), error=repr(exc)[:200]))
                continue
            diff = (out.float() - want.float()).abs().max().item()
            rows.append(dict(shape=name, splits=splits, config=config.__dict__, us=us, max_abs_diff=diff))
    for row in rows:
        if "us" in row:
            row["TBps"] = kv_bytes / row["us"] / 1e6
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["b1_16384", "b64_4096_fp8"], choices=sorted(SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_tile_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name in args.shapes:
        shape_rows = sweep(name, args.quick)
        rows += shape_rows
        best = sorted((r for r in shape_rows if "us" in r), key=lambda r: r["us"])[:5]
        print(f"[{name}] default {shape_rows[0]['us']:.1f} us; best:")
        for r in best:
            print(f"  {r['us']:.1f} us {r['TBps']:.2f} TB/s splits={r['splits']} {r['config']}")
    if args.out:
        for row in rows:
            row.update(case="decode_tile_sweep", backend="triton", peer=None)
            if isinstance(row["config"], dict):
                row["config"] = ",".join(f"{k}={v}" for k, v in row["config"].items() if not k.startswith(("block", "tile")))
        header = dict(gpu=torch.cuda.get_device_name(), date=date.today().isoformat(), suite="decode_tile_sweep",
                      command="python -m benchmarks.decode_tile_sweep " + " ".join(argv or sys.argv[1:]),
                      **library_versions(), complete=True)
        write_json(args.out, header, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
