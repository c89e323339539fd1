"""GPU: configs of the paged Gluon prefill (attnbackends/triton/prefill_hopper_paged.py) timed on the kernel alone,
``forward(q, None, None)`` over keys already in the cache, for chunks on cached context and fresh prompts on pages
of 16 and 64 tokens; beside it the fresh-prompt Gluon kernel on the same fresh prompts (its forward with keys, the
cache write inside the kernel). Rows: config, shape, page, microseconds, TFLOP/s.

    python3 -m benchmarks.prefill_hopper_paged_sweep --out sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks import triton_api as api

#: name -> PagedPrefillConfig fields changed from the backend's config.
CONFIGS = {
    "default": {},
    "regs232_40": dict(regs=(232, 40)),
    "nbuf3_no_epi_tma": dict(nbuf=3, epi_tma=False),
}
#: (B, new tokens, cached tokens, page sizes)
SHAPES = [(4, 2048, 6144, (16, 64)), (16, 256, 1792, (16,)), (1, 8192, 0, (16,))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ns = ap.parse_args(argv)
    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        if ns.out:
            Path(ns.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                                "command": " ".join(sys.argv), "rows": rows}, indent=1))

    for B, new, cached, pages in SHAPES:
        for page in pages:
            api.PAGE = page
            b = api.Batch([(new, cached)] * B, hopper_paged_prefill=True)
            b.triton(write=True)()  # the step's keys into the cache
            decode_plan, plan = b.metadata.paged_prefill
            base = dict(B=B, new=new, cached=cached, page=page)
            for name in ns.configs:
                cfg = dataclasses.replace(plan.config, **CONFIGS[name])
                b.metadata.paged_prefill = (decode_plan, dataclasses.replace(plan, config=cfg))
                fn = b.triton()
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = api.do_bench_us(fn)
                except Exception as exc:  # a config that fails is a row
                    emit(kernel="gluon_paged", config=name, error=repr(exc)[:300], **base)
                    continue
                emit(kernel="gluon_paged", config=name, us=round(us, 2), TFLOPs=round(b.flops / us / 1e6, 1), **base)
            b.metadata.paged_prefill = (decode_plan, plan)
            if cached == 0:  # the fresh-prompt kernel on the same prompts, keys from the forward
                fresh = api.Batch([(new, cached)] * B, hopper_paged_prefill=False)
                fn = fresh.triton(write=True)
                fn()
                torch.cuda.synchronize()
                us = api.do_bench_us(fn)
                emit(kernel=api.prefill_kernel_name(fresh.metadata), config="fresh_kernel", us=round(us, 2),
                     TFLOPs=round(fresh.flops / us / 1e6, 1), **base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
