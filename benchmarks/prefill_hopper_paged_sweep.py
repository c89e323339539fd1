"""GPU: configs of the paged Gluon prefill (attnbackends/triton/prefill_hopper_paged.py) timed on the kernel alone,
``forward(q, None, None)`` over keys already in the cache, for chunks on cached context and fresh prompts on pages
of 16 and 64 tokens; beside it the fresh-prompt Gluon kernel on the same fresh prompts (its forward with keys, the
cache write inside the kernel). Rows: config, shape, page, microseconds, TFLOP/s, and the largest difference from
the first config's output. ``--layer`` takes a layer shape of ``benchmarks.triton_api.SHAPE_ROWS`` (head size,
window, soft-cap, sinks) in place of the plain 32/8/128 layer.

    python3 -m benchmarks.prefill_hopper_paged_sweep --out sweep.json
    python3 -m benchmarks.prefill_hopper_paged_sweep --layer softcap30 --configs tanh_exact tanh_approx
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from attnbackends.triton import prefill_hopper_paged as paged
from attnbackends.triton.prefill_hopper_paged import SOFTCAP_TANH
from benchmarks import triton_api as api

#: name -> PagedPrefillConfig fields changed from the backend's config.
CONFIGS = {
    "default": {},
    "regs232_40": dict(regs=(232, 40)),
    "nbuf3_no_epi_tma": dict(nbuf=3, epi_tma=False),
    **{f"tanh_{mode}": dict(softcap_tanh=mode) for mode in SOFTCAP_TANH},
}
#: (B, new tokens, cached tokens, page sizes)
SHAPES = [(4, 2048, 6144, (16, 64)), (16, 256, 1792, (16,)), (1, 8192, 0, (16,))]


def _config_with(fields: dict):
    """The backend's default_paged_config with ``fields`` changed."""
    default = paged.default_paged_config
    return lambda head_size: dataclasses.replace(default(head_size), **fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--configs", nargs="*", default=[c for c in CONFIGS if not c.startswith("tanh_")])
    ap.add_argument("--layer", choices=sorted(api.SHAPE_ROWS), help="a layer shape of triton_api.SHAPE_ROWS")
    ns = ap.parse_args(argv)
    rows = []

    def emit(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        if ns.out:
            Path(ns.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                                                "command": " ".join(sys.argv), "rows": rows}, indent=1))

    layer = dict(api.SHAPE_ROWS[ns.layer]) if ns.layer else {}
    heads = {k: layer.pop(k) for k in ("num_heads", "num_kv_heads", "head_size") if k in layer}
    for B, new, cached, pages in SHAPES:
        for page in pages:
            api.PAGE = page
            b = api.Batch([(new, cached)] * B, hopper_paged_prefill=True, layer=layer, **heads)
            b.triton(write=True)()  # the step's keys into the cache
            base = dict(B=B, new=new, cached=cached, page=page, layer=ns.layer)
            first = None
            for name in ns.configs:
                with mock.patch.object(paged, "default_paged_config", _config_with(CONFIGS[name])):
                    b.metadata = b.builder.build(b.common)
                fn = b.triton()
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = api.do_bench_us(fn)
                except Exception as exc:  # a config that fails is a row
                    emit(kernel="gluon_paged", config=name, error=repr(exc)[:300], **base)
                    continue
                if first is None:
                    first = b.out.clone()
                emit(kernel="gluon_paged", config=name, us=round(us, 2), TFLOPs=round(b.flops / us / 1e6, 1),
                     max_abs_diff_vs_first=float((b.out.float() - first.float()).abs().max()), **base)
            if cached == 0 and not layer:  # the fresh-prompt kernel on the same prompts, keys from the forward
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
