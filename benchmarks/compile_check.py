"""Compile the library's Hopper prefill kernels for sm_90 on a machine without a GPU and check what ptxas makes of
them: registers, spill stack, shared memory, wgmma shapes, the warp-specialised partitions' register limits.

    python -m benchmarks.compile_check                  # every check below; exit status 1 if one finds a problem
    python -m benchmarks.compile_check --gluon-prefill [--cache-write]   # the Gluon prefill alone, JSON lines

- The Gluon prefill (:mod:`attnbackends.triton.prefill_hopper`), the backend's config, plain and with the kernel
  writing the paged cache itself: :func:`gluon_prefill_report` and :func:`gluon_prefill_problems`.
- The Triton prefill kernel's default tiles at head 64 and 128, plain, with window + sinks and with a soft-cap
  (:mod:`benchmarks.prefill_compile_report`): no spill (except head 128's 64x64 tiles, measured fastest anyway),
  shared memory within a block's limit, wgmma used.

Gluon does not run under the Triton interpreter; run this in a process without ``TRITON_INTERPRET`` (the
interpreter patches ``triton.language`` in the process that sets it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch

__all__ = ["gluon_prefill_problems", "gluon_prefill_report", "main", "triton_prefill_problems"]

H100_SMS = 132  # what an offline compile assumes for the persistent grid


def _launch_attrs(kernel, args: tuple, kwargs: dict) -> dict:
    """The 16-byte divisibility attributes the JIT derives at launch (pointers, integers divisible by 16, except
    where the kernel asks not to specialise), which ``offline_compile.compile_call`` leaves out: without them every
    O store is a 2-byte store."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    positional, attrs = list(args), {}
    for p in kernel.params:
        if p.is_constexpr:
            continue
        value = positional.pop(0) if positional else kwargs[p.name]
        attr = native_specialize_impl(CUDABackend, value, False, not p.do_not_specialize,
                                      not p.do_not_specialize_on_alignment)[1]
        if isinstance(attr, str) and attr:
            attrs[(p.num,)] = CUDABackend.parse_attr(attr)
    return attrs


def _sass_facts(sass: str) -> dict:
    """From the SASS: ``regs_by_limit`` {setmaxnreg limit: highest register number + 1 used under it}, each
    instruction counted under the last ``USETMAXREG`` above it in address order ("240": the consumers, "24": the
    loader; the out-of-line mbarrier retry loops at the end count under the last limit, "256"); ``local_ld_st``:
    spill loads / stores; ``global_stores`` {STG form: count}."""
    limit, use = "kernel", {}
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            limit = str(int(m.group(1), 16))
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line)]
        if regs:
            use[limit] = max(use.get(limit, 0), max(regs) + 1)
    return {"regs_by_limit": dict(sorted(use.items())),
            "local_ld_st": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "global_stores": dict(Counter(re.findall(r"\b(STG\.E(?:\.\w+)?)\b", sass)))}


def compile_gluon_call(kernel, args: tuple, kwargs: dict, target=None) -> tuple[dict[str, Any], str, str]:
    """Compile one Gluon kernel call for sm_90 without a GPU and read what it uses: (report, ptx, sass). The report
    holds "compile_s", "shared", "shared_over_limit", "regs" / "stack" / "local" (cuobjdump's resource usage),
    "ptxas_notes", "wgmma" {shape: count}, "setmaxnreg" (the PTX's register moves, "inc N" / "dec N"), "maxnreg"
    and the SASS facts of :func:`_sass_facts`."""
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.offline_compile import SHARED_LIMIT, _ptxas_notes, _signature, _tool, sm90_target

    target = target or sm90_target()
    signature, constexprs, options = _signature(kernel, args, kwargs)
    attrs = _launch_attrs(kernel, args, kwargs)
    t0 = time.time()
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    rep: dict[str, Any] = {"compile_s": round(time.time() - t0, 2), "shared": compiled.metadata.shared,
                           "shared_over_limit": compiled.metadata.shared > SHARED_LIMIT[target.arch]}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    for key, field in (("regs", "REG"), ("stack", "STACK"), ("local", "LOCAL")):
        m = re.search(rf"\b{field}:(\d+)", usage)
        rep[key] = int(m.group(1)) if m else None
    ptx = compiled.asm["ptx"]
    rep["ptxas_notes"] = _ptxas_notes(ptx, target.arch)
    rep["wgmma"] = dict(Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.[\w.]+)", ptx)))
    rep["setmaxnreg"] = [f"{kind} {n}" for kind, n in
                         re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
    m = re.search(r"\.maxnreg\s+(\d+)", ptx)
    rep["maxnreg"] = int(m.group(1)) if m else None
    rep.update(_sass_facts(sass))
    return rep, ptx, sass


def gluon_prefill_report(tokens: int = 256, heads: int = 32, kv_heads: int = 8, cache_write: bool = False,
                         **config: Any) -> dict:
    """Compile the Gluon prefill for sm_90 as the GPU's JIT would (arguments built on the CPU through the library's
    own planner and argument builder, with the launch's divisibility attributes).

    Parameters
    ----------
    tokens, heads, kv_heads : one sequence of ``tokens`` new tokens, head size 128, bfloat16
    cache_write : the variant that writes the paged cache itself (16-token pages), as the backend runs it for
        batches of fresh prefills
    config : :class:`~attnbackends.triton.prefill_hopper.HopperPrefillConfig` fields (default: the backend's)

    Returns
    -------
    dict with "regs" (the kernel-level .maxnreg warp specialisation sets), "stack" / "local" (spill stack),
    "shared", "shared_over_limit", "wgmma" {shape: count}, "mma_sync", "ptxas_notes", "setmaxnreg" (the PTX's
    register moves), "maxnreg", the SASS facts of :func:`_sass_facts` and "config" (every field, regs a list).
    """
    from attnbackends.triton.prefill_hopper import (
        HopperPrefillConfig,
        _prefill_hopper_kernel,
        hopper_prefill_args,
        plan_hopper_prefill,
    )
    from benchmarks.offline_compile import sm90_target

    cfg = HopperPrefillConfig(**config)
    q = torch.zeros(tokens, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(tokens, kv_heads, 128, dtype=torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    cache = ()
    if cache_write:  # a cache of 16-token pages, the slots, the to-do flags
        cache = (torch.zeros(tokens // 16 + 1, 2, 16, kv_heads, 128, dtype=torch.bfloat16),
                 torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int8))
    plan = plan_hopper_prefill(num_heads=heads, num_kv_heads=kv_heads, head_size=128, num_seqs=1, first_seq=0,
                               max_query_len=tokens, num_tokens=tokens, num_sms=H100_SMS, config=cfg,
                               writes_cache=cache_write, block_size=16)
    _, args, kwargs = hopper_prefill_args(plan, q, k, k.clone(), torch.empty_like(q), qsl, 0.1, *cache)
    kernel, target = _prefill_hopper_kernel, sm90_target()
    rep, ptx, sass = compile_gluon_call(kernel, args, kwargs, target)
    rep = {"kernel": kernel.fn.__name__, **rep}
    rep["mma_sync"] = len(re.findall(r"\bmma\.sync\.aligned", ptx))
    rep["config"] = {**dataclasses.asdict(cfg), "regs": list(cfg.regs)}
    return rep


def gluon_prefill_problems(rep: dict) -> list[str]:
    """What a :func:`gluon_prefill_report` shows wrong ([]: nothing): a spill, shared memory past what one block may
    use, wgmma serialised by ptxas or mma.sync in their place, a missing Q.K^T or P.V wgmma shape, setmaxnreg moves
    other than the config's, a partition using more registers than its setmaxnreg limit."""
    cfg, problems = rep["config"], []
    if rep["stack"] or rep["local"] or rep["local_ld_st"]:
        problems.append(f"spills: stack {rep['stack']}, local {rep['local']}, {rep['local_ld_st']} LDL/STL")
    if rep["shared_over_limit"]:
        problems.append(f"shared memory {rep['shared']} bytes is over the limit")
    if [n for n in rep["ptxas_notes"] if "serialized" in n.lower()] or rep["mma_sync"]:
        problems.append(f"wgmma serialised or replaced: {rep['ptxas_notes']}, {rep['mma_sync']} mma.sync")
    for shape in ("m64n128k16.f32.bf16.bf16", f"m64n{cfg['block_n']}k16.f32.bf16.bf16"):  # P.V, Q.K^T
        if not rep["wgmma"].get(shape):
            problems.append(f"no {shape} wgmma: {rep['wgmma']}")
    consumer, loader = cfg["regs"]
    if f"inc {consumer}" not in rep["setmaxnreg"] or f"dec {loader}" not in rep["setmaxnreg"]:
        problems.append(f"setmaxnreg {rep['setmaxnreg']} lacks inc {consumer} / dec {loader}")
    for limit in (consumer, loader):
        used = rep["regs_by_limit"].get(str(limit), 0)
        if not 0 < used <= limit:
            problems.append(f"{used} registers used under setmaxnreg {limit}")
    return problems


def _cache_write_problems(rep: dict) -> list[str]:
    """The cache-writing variant: as :func:`gluon_prefill_problems`, except that its two single-warp partitions, at
    their few registers, may keep a few scalars on the stack (up to 64 bytes)."""
    return [p for p in gluon_prefill_problems(rep) if not (p.startswith("spills") and (rep["stack"] or 0) <= 64)]


def triton_prefill_problems(rep: dict) -> list[str]:
    """What a :func:`benchmarks.prefill_compile_report.report` shows wrong: a spill (head 128's unwindowed 64x64
    tiles may spill up to 1 KiB: the H100 sweep measured them fastest), shared memory over the limit, no wgmma."""
    spill_allowed = 1024 if (rep["head_size"] == 128 and not rep["sliding_window"]
                             and rep["config"][:2] == [64, 64]) else 0
    problems = []
    if rep["stack"] > spill_allowed:
        problems.append(f"spill stack {rep['stack']} bytes (allowed {spill_allowed})")
    if rep["shared"] > rep["shared_limit"]:
        problems.append(f"shared memory {rep['shared']} bytes is over the limit")
    if not rep["wgmma"]:
        problems.append("no wgmma")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gluon-prefill", action="store_true", help="only the Gluon prefill; its reports as JSON lines")
    ap.add_argument("--cache-write", action="store_true", help="with --gluon-prefill: the cache-writing variant")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: Gluon kernels are compiled, not interpreted", file=sys.stderr)
        return 2
    if args.gluon_prefill:
        print(json.dumps(gluon_prefill_report(cache_write=args.cache_write)), flush=True)
        return 0
    from attnbackends.triton.prefill_launch import default_prefill_config
    from benchmarks.prefill_compile_report import report as triton_prefill_report

    found = False
    checks = [("gluon prefill", lambda: gluon_prefill_report(), gluon_prefill_problems),
              ("gluon prefill writing the cache", lambda: gluon_prefill_report(cache_write=True),
               _cache_write_problems)]
    for head_size in (64, 128):
        for features in ({}, {"sliding_window": 128, "sinks": True}, {"softcap": True}):
            config = default_prefill_config(head_size=head_size, sliding_window=features.get("sliding_window"))
            checks.append((f"triton prefill head {head_size} {features or 'plain'}",
                           lambda h=head_size, c=config, f=features: triton_prefill_report(h, c, **f),
                           triton_prefill_problems))
    for name, compile_one, problems_of in checks:
        rep = compile_one()
        problems = problems_of(rep)
        found |= bool(problems)
        print(f"{name}: regs {rep['regs']}, stack {rep['stack']}, shared {rep['shared']}: "
              + ("; ".join(problems) if problems else "ok"), flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
