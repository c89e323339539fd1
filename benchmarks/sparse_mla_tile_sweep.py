"""Tile configs of the sparse MLA attention kernel (``attnbackends.mla.sparse.attention``) on DeepSeek-V3.2 decode
shapes: each config's time and its output against the default config's and a float64 oracle.

The kernel alone, as ``benchmarks.sparse_mla``'s ``attn_us``: B decode tokens, each over its own top-k slots (random
distinct slots of a latent cache filled with random tokens), 128 heads, latent 512 + rope 64, page 64, bf16 queries.

    python -m benchmarks.sparse_mla_tile_sweep --out rows.json          # GPU: the grid below, both latent formats
    TRITON_INTERPRET=1 python -m benchmarks.sparse_mla_tile_sweep --smoke --out rows.json   # CPU: tiny, 2 configs

Rows: ``case`` sparse_attention_sweep, ``latent`` (auto or fp8_ds_mla), ``B``, ``topk``, ``block_h``,
``block_n``, ``warps``, ``stages``, ``us`` (median), ``TFLOPs`` = 2 B H topk (576 + 512) / us, ``ratio`` = us /
the default config's us, ``err_vs_default`` and ``err_vs_oracle`` (relative Frobenius errors; the oracle on the first
``--oracle-tokens`` tokens), ``default`` (whether the row is the kernel's default config), or ``error``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from attnbackends import AttentionSpec, SparseIndexerSpec
from attnbackends.mla.sparse.attention import SparseAttentionConfig, default_attention_config, sparse_mla_attention
from attnbackends.ops.sparse_mla_cache import allocate_sparse_mla_cache, ds_latent_views, write_sparse_latent
from attnbackends.platform import is_triton_interpreted

from .report import write_rows

__all__ = ["GRID", "main", "sweep"]

#: (block_h, block_n, warps, stages) tried on the GPU; the first fp8 rows are the same grid.
GRID = (
    (16, 32, 4, 2), (16, 32, 4, 3), (16, 64, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
    (64, 16, 4, 2), (64, 16, 8, 2), (64, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1), (128, 16, 8, 2),
)
SMOKE_GRID = ((4, 8, 1, 1), (8, 8, 1, 1))


def spec_for(heads: int, topk: int, latent_format: str) -> AttentionSpec:
    return AttentionSpec.mla(heads, block_size=64, dtype="bfloat16", sparse_indexer=SparseIndexerSpec(
        num_index_heads=64, index_head_dim=128, topk=topk, latent_format=latent_format))


class SweepCase:
    """Random queries and a latent cache of ``num_blocks`` pages filled with random tokens; each of ``tokens`` tokens
    chooses ``topk`` distinct slots at random."""

    def __init__(self, spec: AttentionSpec, tokens: int, num_blocks: int, device: torch.device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        lkv, r = spec.kv_lora_rank, spec.qk_rope_head_dim
        self.spec, self.tokens = spec, tokens
        self.latent = allocate_sparse_mla_cache(num_blocks, spec, device).latent
        slots = torch.arange(num_blocks * spec.block_size, device=device)
        for s in range(0, slots.numel(), 1 << 20):
            part = slots[s: s + (1 << 20)]
            lat = torch.randn(part.numel(), lkv + r, device=device, generator=gen, dtype=torch.bfloat16)
            write_sparse_latent(lat[:, :lkv], lat[:, lkv:], self.latent, part, spec)
        topk = spec.sparse_indexer.topk
        self.slots = torch.stack([torch.randperm(slots.numel(), device=device, generator=gen)[:topk]
                                  for _ in range(tokens)]).to(torch.int32)
        self.ql = torch.randn(tokens, spec.num_heads, lkv, device=device, generator=gen, dtype=torch.bfloat16)
        self.q_pe = torch.randn(tokens, spec.num_heads, r, device=device, generator=gen, dtype=torch.bfloat16)

    def run(self, config: Optional[SparseAttentionConfig]) -> torch.Tensor:
        out = torch.full_like(self.ql, float("nan"))
        sparse_mla_attention(self.ql, self.q_pe, self.latent, self.slots, out, self.spec, self.tokens, config)
        return out

    def oracle(self, tokens: int) -> torch.Tensor:
        """float64 o_latent of the first ``tokens`` tokens [tokens, H, Lkv]."""
        spec, lkv = self.spec, self.spec.kv_lora_rank
        ds = spec.sparse_indexer.latent_format == "fp8_ds_mla"
        views = ds_latent_views(self.latent, spec) if ds else (self.latent,)
        flat = [v.flatten(0, 1) for v in views]

        def rows(idx: torch.Tensor) -> torch.Tensor:  # [topk, Lkv + R] float64 of the chosen slots
            if not ds:
                return flat[0][idx].double()
            nope, scales, rope = (v[idx].double() for v in flat)
            return torch.cat([(nope.unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]).flatten(-2), rope], -1)

        outs = []
        for t in range(tokens):
            c = rows(self.slots[t].long())
            q = torch.cat([self.ql[t], self.q_pe[t]], -1).double()  # [H, Lkv + R]
            p = torch.softmax(q @ c.T * spec.softmax_scale, -1)
            outs.append(p @ c[:, :lkv])
        return torch.stack(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def time_us(fn, cuda: bool) -> float:
    if cuda:
        import triton

        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def sweep(case: SweepCase, grid: Sequence[tuple], latent: str, oracle_tokens: int, cuda: bool) -> list[dict]:
    """One row per config of ``grid`` (the default config first, whether or not the grid holds it)."""
    spec = case.spec
    default = tuple(default_attention_config(spec.num_heads, is_triton_interpreted()))
    reference = case.run(None)
    oracle = case.oracle(oracle_tokens)
    flops = 2 * case.tokens * spec.num_heads * spec.sparse_indexer.topk * (2 * spec.kv_lora_rank
                                                                           + spec.qk_rope_head_dim)
    default_us = time_us(lambda: case.run(None), cuda)
    rows = []
    for cfg in [default] + [c for c in grid if tuple(c) != default]:
        row = dict(case="sparse_attention_sweep", backend="triton_mla_sparse", peer=None, latent=latent,
                   B=case.tokens, topk=spec.sparse_indexer.topk, block_h=cfg[0], block_n=cfg[1], warps=cfg[2],
                   stages=cfg[3], default=tuple(cfg) == default)
        try:
            config = SparseAttentionConfig(*cfg)
            out = case.run(config)
            us = default_us if row["default"] else time_us(lambda: case.run(config), cuda)
            row.update(us=round(us, 1), TFLOPs=round(flops / us / 1e6, 1), ratio=round(us / default_us, 3),
                       err_vs_default=rel_err(out, reference),
                       err_vs_oracle=rel_err(out[:oracle_tokens], oracle))
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a row, not the end of the sweep
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sparse_mla_tile_sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON rows to write")
    ap.add_argument("--batch", type=int, default=64, help="decode tokens")
    ap.add_argument("--formats", nargs="+", default=["auto", "fp8_ds_mla"], choices=["auto", "fp8_ds_mla"])
    ap.add_argument("--oracle-tokens", type=int, default=2, help="tokens checked against the float64 oracle")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and two configs (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not (args.smoke and is_triton_interpreted()):
        print("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    # on the GPU a cache of 512 pages per token (32k-token contexts): the gathers read HBM, not L2
    heads, topk, tokens = (128, 2048, args.batch) if cuda else (8, 16, 2)
    blocks = 512 * tokens if cuda else 2
    grid = GRID if cuda else SMOKE_GRID
    rows = []
    for latent in args.formats:
        case = SweepCase(spec_for(heads, topk, latent), tokens, max(blocks, math.ceil(topk / 64) + 1), device)
        rows += sweep(case, grid, latent, min(args.oracle_tokens, tokens), cuda)
        write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
