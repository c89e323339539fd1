"""Sparse MLA (DeepSeek-V3.2) benchmarks on one GPU: ``triton_mla_sparse`` as an engine calls it (../shared/PERF.md).

DeepSeek-V3.2 layer: 128 heads, latent 512 + rope 64, nope 128, v 128, 64 index heads of 128, top-k 2048, page 64,
bf16, pages in random order; latent cache in bf16 (``latent`` auto) and DeepSeek's fp8 format (fp8_ds_mla).
``build()`` runs once per step, outside the timings; ``forward`` includes the step's cache writes.

Rows (``case``, backend ``triton_mla_sparse``):

- ``sparse_mla_decode`` (B decodes at context L): ``us`` = ``forward``; ``attn_us`` = the sparse attention kernel
  alone on the forward's selection; ``indexer_us`` = the indexer + top-k + slot translation alone;
  ``indexer_fraction`` = indexer_us / attn_us; ``TFLOPs`` = 2 B H topk (576 + 512) / attn_us. At 128k context a
  row with peer ``triton_mla`` (dense MLA ``forward`` on the same batch: ``peer_us``, ``ratio`` = us / peer_us).
- ``sparse_mla_prefill`` (B requests of Q new tokens on context C): as above per query token.
- ``sparse_indexer``: the indexer alone; ``TFLOPs`` = 2 x (visible keys summed over queries) x 64 x 128 /
  indexer_us (fp8 products).

    python -m benchmarks.sparse_mla --out benchmarks/results/<gpu>-sparse_mla-<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

import torch
import triton

from attnbackends import AttentionSpec, DeviceInfo, SparseIndexerSpec
from attnbackends.metadata import build_common_metadata
from attnbackends.mla.backends import TritonMLABackend
from attnbackends.mla.sparse.attention import sparse_mla_attention
from attnbackends.mla.sparse.backend import TritonSparseMLABackend
from attnbackends.mla.sparse.indexer import select_slots
from attnbackends.ops.sparse_mla_cache import allocate_sparse_mla_cache, write_index_keys, write_sparse_latent

H, LKV, R, P, V, PAGE, TOPK, IH, ID = 128, 512, 64, 128, 128, 64, 2048, 64, 128
#: (B, query tokens per request, context): decode shapes, prefill shapes, and the 128k dense comparison.
DECODE = ((64, 1, 32767), (128, 1, 32767), (64, 1, 8191))
PREFILL = ((1, 4096, 28672), (4, 2048, 14336))
DENSE_128K = ((16, 1, 131071),)


def spec_for(latent_format: str) -> AttentionSpec:
    return AttentionSpec.mla(H, block_size=PAGE, dtype="bfloat16", sparse_indexer=SparseIndexerSpec(
        num_index_heads=IH, index_head_dim=ID, topk=TOPK, latent_format=latent_format))


def bench(fn) -> float:
    """Median microseconds."""
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


class Case:
    """One batch on random caches (pages shuffled), its inputs, built metadata and impl."""

    def __init__(self, spec: AttentionSpec, b: int, q: int, ctx: int, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.spec, self.b, self.q, self.ctx = spec, b, q, ctx
        seq = ctx + q
        pages = math.ceil(seq / PAGE)
        self.num_blocks = b * pages + 1
        perm = torch.randperm(self.num_blocks - 1, device="cuda", generator=gen)[: b * pages]
        tables = perm.view(b, pages).cpu().tolist()
        self.cache = allocate_sparse_mla_cache(self.num_blocks, spec, "cuda")
        slots = torch.arange(self.num_blocks * PAGE, device="cuda")
        step = 1 << 20
        for s in range(0, slots.numel(), step):  # every slot holds a real token
            n = min(step, slots.numel() - s)
            lat = torch.randn(n, LKV + R, device="cuda", generator=gen, dtype=torch.bfloat16)
            write_sparse_latent(lat[:, :LKV], lat[:, LKV:], self.cache.latent, slots[s: s + n], spec)
            write_index_keys(torch.randn(n, ID, device="cuda", generator=gen, dtype=torch.bfloat16),
                             self.cache.index, slots[s: s + n], spec)
        t = b * q
        self.common = build_common_metadata([q] * b, [ctx] * b, tables, PAGE, "cuda")
        self.q_in = torch.randn(t, H, P + R, device="cuda", generator=gen, dtype=torch.bfloat16)
        self.kv_c = torch.randn(t, LKV, device="cuda", generator=gen, dtype=torch.bfloat16)
        self.k_pe = torch.randn(t, R, device="cuda", generator=gen, dtype=torch.bfloat16)
        self.index = dict(index_q=torch.randn(t, IH, ID, device="cuda", generator=gen, dtype=torch.bfloat16),
                          index_k=torch.randn(t, ID, device="cuda", generator=gen, dtype=torch.bfloat16),
                          index_weights=torch.randn(t, IH, device="cuda", generator=gen) * IH ** -0.5)
        self.kv_b_proj = (torch.randn(H * (P + V), LKV, device="cuda", generator=gen) / math.sqrt(LKV)).bfloat16()
        builder = TritonSparseMLABackend.get_builder_cls()(spec, "cuda", num_blocks=self.num_blocks)
        self.meta = builder.build(self.common)
        self.impl = TritonSparseMLABackend.get_impl_cls()(spec, kv_b_proj=self.kv_b_proj)
        self.impl.process_weights_after_loading()
        self.out = torch.empty(t, H, V, device="cuda", dtype=torch.bfloat16)

    def forward(self) -> None:
        self.impl.forward(self.q_in, self.kv_c, self.k_pe, self.cache, self.meta, self.out, **self.index)

    def indexer(self) -> None:
        m = self.meta
        select_slots(self.index["index_q"], self.index["index_weights"], self.cache.index, self.common.block_table,
                     m.token_req, m.token_pos, self.spec, m.groups, m.num_keys, m.keys_buffer, m.slots)

    def attention_only(self):
        t = self.b * self.q
        ql = torch.randn(t, H, LKV, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(ql)
        q_pe = self.q_in[:, :, P:]
        return lambda: sparse_mla_attention(ql, q_pe, self.cache.latent, self.meta.slots, o, self.spec, t)


def timed_rows(case: Case, case_name: str, latent_format: str) -> list[dict]:
    case.forward()
    us = bench(case.forward)
    indexer_us = bench(case.indexer)
    case.indexer()
    attn_us = bench(case.attention_only())
    t = case.b * case.q
    flops = 2 * t * H * TOPK * (LKV + R + LKV)
    seq = case.ctx + case.q
    visible = case.b * sum(case.ctx + i + 1 for i in range(case.q))
    base = dict(backend="triton_mla_sparse", peer=None, B=case.b, L=seq, Q=case.q, ctx=case.ctx, dtype="bfloat16",
                latent=latent_format, topk=TOPK)
    return [
        dict(case=case_name, **base, us=us, attn_us=attn_us, indexer_us=indexer_us,
             indexer_fraction=indexer_us / attn_us, TFLOPs=flops / attn_us / 1e6),
        dict(case="sparse_indexer", **base, us=indexer_us, TFLOPs=2 * visible * IH * ID / indexer_us / 1e6),
    ]


def dense_peer(case: Case) -> float:
    """triton_mla's forward on the same batch over a dense bf16 latent cache (same pages)."""
    dense = case.spec.model_copy(update={"sparse_indexer": None})
    cache = case.cache.latent if case.spec.sparse_indexer.latent_format == "auto" else \
        torch.randn(case.num_blocks, PAGE, LKV + R, device="cuda", dtype=torch.bfloat16)
    meta = TritonMLABackend.get_builder_cls()(dense, "cuda", num_blocks=case.num_blocks).build(case.common)
    impl = TritonMLABackend.get_impl_cls()(dense, kv_b_proj=case.kv_b_proj)
    impl.process_weights_after_loading()
    out = torch.empty_like(case.out)

    def run():
        impl.forward(case.q_in, case.kv_c, case.k_pe, cache, meta, out)

    run()
    return bench(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the result rows")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: decode, prefill, dense, fp8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    print(f"device: {DeviceInfo.current().describe()}, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    rows: list[dict] = []

    def save():
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)

    formats = ["auto"] + ([] if "fp8" in skip else ["fp8_ds_mla"])
    plan = []
    if "decode" not in skip:
        plan += [("sparse_mla_decode", fmt, shape) for fmt in formats for shape in DECODE]
    if "prefill" not in skip:
        plan += [("sparse_mla_prefill", fmt, shape) for fmt in formats for shape in PREFILL]
    if "dense" not in skip:
        plan += [("sparse_mla_decode", "auto", shape) for shape in DENSE_128K]
    for name, fmt, (b, q, ctx) in plan:
        try:
            case = Case(spec_for(fmt), b, q, ctx)
            new = timed_rows(case, name, fmt)
            if (b, q, ctx) in DENSE_128K:
                peer_us = dense_peer(case)
                new[0].update(peer="triton_mla", peer_us=peer_us, ratio=new[0]["us"] / peer_us)
            rows.extend(new)
            for row in new:
                print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
        except Exception:  # one failing shape must not cost the others' numbers
            traceback.print_exc()
            print(f"{name} {fmt} B={b} Q={q} ctx={ctx}: failed", flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
