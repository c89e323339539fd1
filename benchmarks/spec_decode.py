"""Speculative decoding through the public API, side by side in one process (PERF.md rows):

- ``verify`` / ``triton`` / ``flashinfer``: 64 requests x (1 + 7) tokens on 4096 context, an EAGLE-like tree mask
  (three branches) on every request;
- ``decode_multi`` / ``triton`` / ``triton_single``: a uniform 1 + 3-token decode at B=64 L=4096 against a
  single-token decode of the same batch (the same KV is read once in both).

    python -m benchmarks.run --suite spec_decode                         # GPU, results kept
    python -m benchmarks.spec_decode --smoke --out /tmp/spec.json      # CPU: tiny shapes, reference + Triton interpreted

Each backend: ``builder.build(common)`` once, then ``impl.forward(q, k, v, kv_cache, metadata, out)`` timed (one
layer; the new tokens' K/V are written as an engine's forward does), ``triton.testing.do_bench`` medians on the GPU,
a wall-clock median on the CPU. Outputs are compared with the peer's (``max_abs_diff``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

EAGLE_TREE_8 = (-1, 0, 0, 0, 1, 1, 2, 4)


def time_us(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1] * 1e6


class Setup:
    """One batch on a random paged cache (pages shuffled): ``batch`` requests of ``q_len`` tokens after ``context``
    cached ones, optionally with the same tree on every request."""

    def __init__(self, *, batch: int, q_len: int, context: int, heads: tuple[int, int], head_size: int, block: int,
                 dtype: str, device: str, num_speculative_tokens: int, tree: Optional[tuple[int, ...]], seed: int = 0):
        from attnbackends import AttentionSpec, build_common_metadata
        from attnbackends.speculative.tree_mask import with_tree_mask

        self.device = device
        self.spec = AttentionSpec(num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size, dtype=dtype,
                                  block_size=block, num_speculative_tokens=num_speculative_tokens,
                                  speculative_tree=tree is not None)
        g = torch.Generator(device=device).manual_seed(seed)
        seq = context + q_len
        pages = -(-seq // block)
        total = batch * pages
        tdtype = self.spec.torch_dtype
        self.kv_cache = torch.randn((total, 2, block, heads[1], head_size), generator=g, device=device).to(tdtype)
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        tables = [perm[i * pages:(i + 1) * pages] for i in range(batch)]
        common = build_common_metadata([q_len] * batch, [context] * batch, tables, block, device)
        if tree is not None:
            common = with_tree_mask(common, [list(tree)] * batch)
        self.common = common
        n = batch * q_len
        self.query = torch.randn((n, heads[0], head_size), generator=g, device=device).to(tdtype)
        self.key = torch.randn((n, heads[1], head_size), generator=g, device=device).to(tdtype)
        self.value = torch.randn((n, heads[1], head_size), generator=g, device=device).to(tdtype)
        self.kv_bytes = batch * seq * heads[1] * head_size * 2 * self.kv_cache.element_size()

    def runner(self, backend_name: str) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        """(forward, output) for ``backend_name``, its metadata built once."""
        from attnbackends import get_backend_class

        cls = get_backend_class(backend_name)
        n = self.query.shape[0]
        builder = cls.get_builder_cls()(self.spec, self.device, max_num_reqs=max(256, self.common.num_reqs),
                                        max_num_tokens=max(8192, n), num_blocks=self.kv_cache.shape[0])
        metadata = builder.build(self.common)
        impl = cls.get_impl_cls()(self.spec)
        cache = self.kv_cache.clone()
        out = torch.full((n, self.spec.num_heads, self.spec.head_size), float("nan"), dtype=self.query.dtype,
                         device=self.device)

        def forward() -> torch.Tensor:
            return impl.forward(self.query, self.key, self.value, cache, metadata, out)

        return forward, out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (PERF.md rows)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: reference vs Triton interpreted")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if cuda:
        shape = dict(batch=64, context=4096, heads=(32, 8), head_size=128, block=16, dtype="bfloat16")
        peer_verify = "flashinfer"
    else:
        shape = dict(batch=2, context=40, heads=(4, 2), head_size=32, block=16, dtype="float16")
        peer_verify = "reference"
    L = shape["context"]
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"),
                                              "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                                              "rows": rows}, indent=1))

    def compare(case: str, mine: Setup, peer_setup: Setup, backend: str, peer: str, **extra) -> None:
        row = {"case": case, "backend": backend, "peer": peer, "B": shape["batch"], "L": L, "dtype": shape["dtype"],
               "kv_dtype": "auto"}
        try:
            fn, out = mine.runner("triton")
            fn()
            us = time_us(fn, cuda)
        except Exception as exc:  # a row that says why beats a run that stops
            emit({**row, "us": None, "peer_us": None, "ratio": None, "error": f"{type(exc).__name__}: {exc}"})
            return
        try:
            pfn, pout = peer_setup.runner(peer if peer != "triton_single" else "triton")
            pfn()
            peer_us = time_us(pfn, cuda)
        except Exception as exc:
            emit({**row, "us": round(us, 2), "peer_us": None, "ratio": None,
                  "peer_error": f"{type(exc).__name__}: {exc}"})
            return
        if case == "verify":
            extra["max_abs_diff"] = float((out.float() - pout.float()).abs().max())
        emit({**row, "us": round(us, 2), "peer_us": round(peer_us, 2), "ratio": round(us / peer_us, 4),
              "GBps": round(mine.kv_bytes / us / 1e3, 1), **extra})

    verify = Setup(q_len=8, num_speculative_tokens=7, tree=EAGLE_TREE_8, device=device, **shape)
    compare("verify", verify, verify, "triton", peer_verify, tokens_per_request=8, tree="eagle-8")
    multi = Setup(q_len=4, num_speculative_tokens=3, tree=None, device=device, **shape)
    single = Setup(q_len=1, num_speculative_tokens=0, tree=None, device=device, **shape)
    compare("decode_multi", multi, single, "triton", "triton_single", tokens_per_request=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
