"""A Gemma-3-shaped decode step through the public layer-group API against the sum of its groups measured alone.

    python -m benchmarks.run --suite hybrid_decode         # on the GPU, results kept in benchmarks/results/
    python -m benchmarks.hybrid_decode --smoke             # tiny, on the CPU

The model: ``--layers`` layers, every ``--global-every``-th global, the others sliding (``--window`` keys), 16 query /
8 KV heads of ``--head-size``, bf16, pages of 16; B requests decoding one token each after ``L - 1`` cached tokens,
pages in random order. One step = ``GroupedMetadataBuilder.build`` (one build per group, the sliding groups' block
tables trimmed to their window) + every layer's ``impl.forward``. The peer ("groups_alone") is the sum over groups of
the same step of a model made of that group's layers only (its own builder, build and forwards). Rows (PERF.md):
``hybrid_decode`` / ``triton`` / ``groups_alone`` with ``GBps`` = the K/V bytes the step must read (sliding layers:
``min(L, window)`` keys per request, global layers: L) over its time, and one ``hybrid_decode_group`` row per group
alone with its ``GBps`` counted the same way (the sliding group's is "GB/s over the window").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnbackends import (  # noqa: E402
    AttentionConfig,
    AttentionSpec,
    GroupedMetadataBuilder,
    build_common_metadata,
    group_layers,
)


def layer_specs(args) -> list[AttentionSpec]:
    return [AttentionSpec(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                          dtype=args.dtype, block_size=args.block_size,
                          sliding_window=None if (i + 1) % args.global_every == 0 else args.window)
            for i in range(args.layers)]


class Step:
    """One decode step of a model (or of one group's layers) through the public API."""

    def __init__(self, specs, common, caches, query, key, value, backend, device):
        self.groups = group_layers(specs, config=AttentionConfig(backend=backend))
        self.builder = GroupedMetadataBuilder(self.groups, device, max_num_reqs=common.num_reqs,
                                              max_num_tokens=common.num_actual_tokens, num_blocks=caches[0].shape[0])
        self.impls = self.groups.make_impls()
        self.common, self.caches = common, caches
        self.query, self.key, self.value = query, key, value
        self.outputs = [torch.empty_like(q) for q in query]

    def __call__(self):
        meta = self.builder.build(self.common)
        for i, impl in enumerate(self.impls):
            impl.forward(self.query[i], self.key[i], self.value[i], self.caches[i], meta.per_layer[i],
                         self.outputs[i])
        return self.outputs


def timer_us(fn, device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON rows to write (PERF.md format)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreted) to check it")
    ap.add_argument("-B", "--batch", type=int, default=64)
    ap.add_argument("-L", "--seq-len", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--global-every", type=int, default=6)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default="triton")
    args = ap.parse_args(argv)
    args.dtype = "bfloat16"
    if args.smoke:
        args.batch, args.seq_len, args.window, args.head_size = 3, 80, 24, 32
        args.num_heads, args.num_kv_heads, args.dtype = 2, 1, "float16"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("the full-size benchmark needs a GPU; use --smoke on the CPU")
    specs = layer_specs(args)
    dtype = specs[0].torch_dtype
    bs, B, L = args.block_size, args.batch, args.seq_len
    pages = -(-L // bs)
    pool = list(range(B * pages + 1))
    random.Random(0).shuffle(pool)
    tables = [pool[i * pages : (i + 1) * pages] for i in range(B)]
    common = build_common_metadata([1] * B, [L - 1] * B, tables, bs, device)
    gen = torch.Generator(device=device).manual_seed(0)
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_size

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    caches = [randn(len(pool), 2, bs, hkv, d) for _ in specs]
    query = [randn(B, hq, d) for _ in specs]
    key = [randn(B, hkv, d) for _ in specs]
    value = [randn(B, hkv, d) for _ in specs]

    whole = Step(specs, common, caches, query, key, value, args.backend, device)
    alone = []
    for group in whole.groups.groups:
        ids = list(group.layers)
        pick = lambda xs: [xs[i] for i in ids]  # noqa: E731
        alone.append((group, Step([specs[i] for i in ids], common, pick(caches), pick(query), pick(key),
                                  pick(value), args.backend, device)))

    # The grouped step and its groups alone compute the same outputs (same inputs, same backends).
    got = [o.clone() for o in whole()]
    worst = 0.0
    for group, step in alone:
        for o, i in zip(step(), group.layers):
            worst = max(worst, float((o.float() - got[i].float()).abs().max()))
    if args.smoke:
        ref = Step(specs, common, caches, query, key, value, "reference", device)()
        worst = max(worst, max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)))
    elem = torch.finfo(dtype).bits // 8

    def kv_bytes(spec) -> int:
        keys = L if spec.sliding_window is None else min(L, spec.sliding_window)
        return 2 * B * keys * hkv * d * elem

    rows = []
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"),
                                                  "command": " ".join(sys.argv), "rows": rows}, indent=1))

    base = {"B": B, "L": L, "dtype": args.dtype, "kv_dtype": "auto", "window": args.window, "head_size": d,
            "num_heads": hq, "num_kv_heads": hkv, "layers": args.layers, "global_every": args.global_every}
    group_us = []
    for group, step in alone:
        us = timer_us(step, device)
        group_us.append(us)
        emit({"case": "hybrid_decode_group", "backend": group.backend.name, "peer": None, "group": group.name,
              "num_layers": len(group.layers), **base, "us": round(us, 2),
              "GBps": round(sum(kv_bytes(specs[i]) for i in group.layers) / us / 1e3, 1)})
    us, peer_us = timer_us(whole, device), sum(group_us)
    emit({"case": "hybrid_decode", "backend": args.backend, "peer": "groups_alone", **base, "us": round(us, 2),
          "peer_us": round(peer_us, 2), "ratio": round(us / peer_us, 4),
          "GBps": round(sum(kv_bytes(s) for s in specs) / us / 1e3, 1), "max_abs_diff": worst})
    tol = 2e-2 if args.smoke else 0.0
    if worst > tol:
        print(f"outputs differ by {worst:.3g} (allowed {tol})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
