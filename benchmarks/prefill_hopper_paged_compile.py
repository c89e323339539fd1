"""Offline sm_90 compile of the paged Gluon prefill (attnbackends/triton/prefill_hopper_paged.py) for the layer
shapes the backend plans it for, without a GPU: registers per partition, spills, shared memory, wgmma shapes.

    python -m benchmarks.prefill_hopper_paged_compile                 # every variant, one JSON line each
    python -m benchmarks.prefill_hopper_paged_compile --variants head128-page16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import torch

from attnbackends import AttentionSpec

#: name -> AttentionSpec fields (32 query heads unless given).
VARIANTS = {
    "head128-page16": dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16),
    "head128-page32": dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=32),
    "head128-page64": dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=64),
    "head128-page256": dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=256),
    "head128-gqa5-fp16": dict(num_heads=40, num_kv_heads=8, head_size=128, block_size=16, dtype="float16"),
    "head128-window-softcap-sinks": dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                         sliding_window=4096, logits_soft_cap=30.0, has_sinks=True),
    "head64-sinks-window128": dict(num_heads=64, num_kv_heads=8, head_size=64, block_size=16, sliding_window=128,
                                   has_sinks=True),
    "head256-window1024": dict(num_heads=16, num_kv_heads=8, head_size=256, block_size=16, sliding_window=1024),
    "head256-softcap": dict(num_heads=16, num_kv_heads=8, head_size=256, block_size=16, logits_soft_cap=50.0),
}


def compile_variant(name: str, **config) -> dict:
    """Compile one variant; the report of ``benchmarks.compile_check.gluon_prefill_report``'s keys."""

    from attnbackends.triton.prefill_hopper_paged import _paged_prefill_kernel, paged_prefill_args, plan_paged_prefill
    from benchmarks.compile_check import compile_gluon_call

    fields = dict(VARIANTS[name])
    fields.setdefault("dtype", "bfloat16")
    spec = AttentionSpec(**fields)
    dt = spec.torch_dtype
    tokens, seqs = 256, 2
    q = torch.zeros(tokens, spec.num_heads, spec.head_size, dtype=dt)
    cache = torch.zeros(64, 2, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=dt)
    table = torch.zeros(seqs, 64, dtype=torch.int32)
    lens = torch.tensor([200, 300], dtype=torch.int32)
    qsl = torch.tensor([0, 128, 256], dtype=torch.int32)
    sinks = torch.zeros(spec.num_heads, dtype=torch.float32)
    plan = plan_paged_prefill(spec=spec, num_seqs=seqs, first_seq=0, max_query_len=128, num_tokens=tokens,
                              num_sms=132)
    if config:
        plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, **config))
    _, args, kwargs = paged_prefill_args(plan, q, torch.empty_like(q), cache, table, lens, qsl, 0.1,
                                         float(spec.logits_soft_cap or 0.0), sinks)
    rep, _, sass = compile_gluon_call(_paged_prefill_kernel, args, kwargs)
    rep = {"variant": name, **rep}
    rep.update(_sass_by_limit(sass))
    if os.environ.get("PAGED_SASS_DIR"):
        with open(os.path.join(os.environ["PAGED_SASS_DIR"], f"{name}.sass"), "w") as f:
            f.write(sass)
    rep["config"] = dataclasses.asdict(plan.config)
    return rep


def _sass_by_limit(sass: str) -> dict:
    """Per setmaxnreg limit (each instruction under the last ``USETMAXREG`` above it): spill loads / stores
    (``spills_by_limit``) and TMA loads issued (``tma_loads_by_limit``)."""
    limit, spills, tma = "kernel", {}, {}
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            limit = str(int(m.group(1), 16))
            continue
        if re.search(r"\b(?:LDL|STL)\b", line):
            spills[limit] = spills.get(limit, 0) + 1
        if "UTMALDG" in line:
            tma[limit] = tma.get(limit, 0) + 1
    return {"spills_by_limit": spills, "tma_loads_by_limit": tma}


def problems(rep: dict) -> list[str]:
    """What a report shows wrong: spills, shared memory over the limit, serialised wgmma, a partition over its
    setmaxnreg limit."""
    out = []
    if rep["stack"] or rep["local"] or rep["local_ld_st"]:
        out.append(f"spills: stack {rep['stack']}, local {rep['local']}, {rep['local_ld_st']} LDL/STL")
    if rep["shared_over_limit"]:
        out.append(f"shared memory {rep['shared']} over the limit")
    if [n for n in rep["ptxas_notes"] if "serialized" in n.lower()]:
        out.append(f"wgmma serialised: {rep['ptxas_notes']}")
    for limit in rep["config"]["regs"]:  # noqa: B007
        used = rep["regs_by_limit"].get(str(limit), 0)
        if used > limit:
            out.append(f"{used} registers under a limit of {limit}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--regs", nargs=2, type=int, help="consumer and loader registers (else the backend's)")
    ap.add_argument("--nbuf", type=int)
    ap.add_argument("--no-epi-tma", action="store_true", help="O by masked stores, no staging in shared memory")
    ap.add_argument("--softcap-tanh", help="how soft-capped variants compute tanh (SOFTCAP_TANH; else the backend's)")
    ns = ap.parse_args()
    config = {}
    if ns.regs:
        config["regs"] = tuple(ns.regs)
    if ns.nbuf:
        config["nbuf"] = ns.nbuf
    if ns.no_epi_tma:
        config["epi_tma"] = False
    if ns.softcap_tanh:
        config["softcap_tanh"] = ns.softcap_tanh
    for name in ns.variants:
        rep = compile_variant(name, **config)
        rep["problems"] = problems(rep)
        print(json.dumps(rep), flush=True)


if __name__ == "__main__":
    main()
