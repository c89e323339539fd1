"""Where FlashInfer's cascade attention pays: the adapter with its cascade thresholds on
(``CascadePolicy(enabled=True)``) against the adapter's default (cascade off), with cascade forced and the Triton
backend beside them.

Each case is a whole engine step as an engine runs it: ``build()`` on a fresh metadata object (passing the common
prefix length, as a prefix-caching engine does), then ``forward`` for each of ``--layers`` layers with the step's new
keys and values. Cases (32 query / 8 KV heads, head 128, page 16, bf16, the private pages in random order):

- ``decode``: 128 decodes at 4096 tokens sharing a 1024- / 2048- / 3584-token prefix;
- ``chunks``: 16 prompt chunks of 512 tokens on a 2048-token shared prefix;
- ``chat``: 120 decodes at 2048-6144 tokens and 8 chunks of 256, all on a 1024-token system prompt (the serving
  trace's chat steps).

Rows: ``{"case": "cascade_step", "backend": "flashinfer_cascade", "peer": "flashinfer", "shape", "B", "L",
"prefix", "us" (per layer: the step's do_bench median / layers), "peer_us", "ratio", "cascade" (whether the
thresholds chose it), "forced_cascade_us" (cascade whatever the thresholds say), "triton_us", "saved_fraction"}``.
A ratio above 1 means cascade made the step slower.

    python -m benchmarks.run --suite flashinfer_cascade
    python -m benchmarks.flashinfer_cascade --out rows.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Optional

import torch

from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.flashinfer import FlashInferBackend
from attnbackends.flashinfer.cascade import CascadePolicy
from attnbackends.triton.backend import TritonAttentionBackend

SPEC = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)

def _cases() -> dict[str, tuple[list[int], list[int], int]]:
    """name -> (query lens, context lens, shared prefix tokens)."""
    rng = random.Random(0)
    cases = {}
    for prefix in (1024, 2048, 3584):
        cases[f"decode128@4096/prefix{prefix}"] = ([1] * 128, [4095] * 128, prefix)
    cases["chunks16x512/prefix2048"] = ([512] * 16, [2048] * 16, 2048)
    chat_ctx = [rng.randrange(2048, 6144) for _ in range(120)] + [rng.randrange(1024, 3072) for _ in range(8)]
    cases["chat120+8x256/prefix1024"] = ([1] * 120 + [256] * 8, chat_ctx, 1024)
    return cases


def shared_prefix_step(query_lens: list[int], context_lens: list[int], prefix: int, device: str = "cuda",
                       seed: int = 0):
    """(common with ``common_prefix_len``, cache, query, key, value): every request starts with the same
    ``prefix // page`` pages; the rest of each request's pages are its own, in random order."""
    bs = SPEC.block_size
    shared = prefix // bs
    gen = torch.Generator().manual_seed(seed)
    own = [-(-(q + c) // bs) - shared for q, c in zip(query_lens, context_lens)]
    num_blocks = shared + sum(own) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    prefix_pages, at, tables = perm[:shared], shared, []
    for n in own:
        tables.append(prefix_pages + perm[at: at + n])
        at += n
    common = build_common_metadata(query_lens, context_lens, tables, bs, device)
    common = dataclasses.replace(common, common_prefix_len=shared * bs)
    dgen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(num_blocks, 2, bs, SPEC.num_kv_heads, SPEC.head_size, generator=dgen, device=device,
                        dtype=torch.bfloat16)
    t = sum(query_lens)
    q = torch.randn(t, SPEC.num_heads, SPEC.head_size, generator=dgen, device=device, dtype=torch.bfloat16)
    k = torch.randn(t, SPEC.num_kv_heads, SPEC.head_size, generator=dgen, device=device, dtype=torch.bfloat16)
    v = torch.randn(t, SPEC.num_kv_heads, SPEC.head_size, generator=dgen, device=device, dtype=torch.bfloat16)
    return common, cache, q, k, v


def _step_fn(backend, common, cache, q, k, v, layers: int, **builder_kwargs):
    builder = backend.get_builder_cls()(SPEC, "cuda", max_num_reqs=256, max_num_tokens=16384,
                                        num_blocks=cache.shape[0], **builder_kwargs)
    impl = backend.get_impl_cls()(SPEC)
    out = torch.empty_like(q)
    state = {}

    def step() -> None:
        meta = builder.build(dataclasses.replace(common))
        state["meta"] = meta
        for _ in range(layers):
            impl.forward(q, k, v, cache, meta, out)

    return step, out, state


def cascade_rows(layers: int = 32, cases: Optional[dict] = None) -> list[dict]:
    import triton.testing

    rows = []
    for name, (qlens, clens, prefix) in (cases or _cases()).items():
        common, cache, q, k, v = shared_prefix_step(qlens, clens, prefix)
        timed, outs, chose = {}, {}, None
        for label, backend, kwargs in (
            ("flashinfer_cascade", FlashInferBackend, {"cascade_policy": CascadePolicy(enabled=True)}),
            ("flashinfer", FlashInferBackend, {}),
            ("flashinfer_forced", FlashInferBackend,
             {"cascade_policy": CascadePolicy(enabled=True, min_requests=2, min_shared_tokens=1,
                                              min_saved_fraction=0.0)}),
            ("triton", TritonAttentionBackend, {}),
        ):
            step, out, state = _step_fn(backend, common, cache, q, k, v, layers, **kwargs)
            step()
            torch.cuda.synchronize()
            if label == "flashinfer_cascade":
                chose = state["meta"].cascade_wrapper is not None
            outs[label] = out.float().clone()
            timed[label] = 1000.0 * triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median") / layers
        total_kv = sum(q_ + c for q_, c in zip(qlens, clens))
        rows.append({
            "case": "cascade_step", "backend": "flashinfer_cascade", "peer": "flashinfer", "shape": name,
            "B": len(qlens), "L": max(q_ + c for q_, c in zip(qlens, clens)), "prefix": prefix,
            "dtype": "bfloat16", "kv_dtype": "auto", "layers": layers,
            "us": round(timed["flashinfer_cascade"], 2), "peer_us": round(timed["flashinfer"], 2),
            "ratio": round(timed["flashinfer_cascade"] / timed["flashinfer"], 4), "cascade": chose,
            "forced_cascade_us": round(timed["flashinfer_forced"], 2), "triton_us": round(timed["triton"], 2),
            "saved_fraction": round((len(qlens) - 1) * prefix / total_kv, 3),
            "max_abs_diff_vs_plain": float((outs["flashinfer_cascade"] - outs["flashinfer"]).abs().max()),
            "max_abs_diff_vs_triton": float((outs["flashinfer_cascade"] - outs["triton"]).abs().max()),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON rows here")
    parser.add_argument("--layers", type=int, default=32, help="layers sharing one build() in a timed step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashinfer_cascade needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = cascade_rows(args.layers)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
