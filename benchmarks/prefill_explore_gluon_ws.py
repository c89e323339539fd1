"""The Triton backend's warp-specialised Gluon causal prefill kernel (:mod:`attnbackends.triton.prefill_hopper`,
FlashAttention-3 style) on its own: a sweep of its options, an sm_90 compile report, and timings next to
FlashInfer's ragged prefill, torch SDPA and the non-specialised Gluon candidate.

The case and the API are those of :mod:`benchmarks.prefill_explore_gluon`: Q / K / V / O contiguous
``[tokens, heads, 128]`` 16-bit, sequences given by ``query_start_loc`` (varlen), GQA, causal, no cached context.
The kernel, its schedule and its barrier protocol are described in the library module; :data:`CONFIGS` are
:class:`~attnbackends.triton.prefill_hopper.HopperPrefillConfig` options (the first: the backend's).

Gluon does not run under the interpreter: on a CPU this module is only compiled for sm_90 (:func:`compile_report`,
``--compile-only``); ``tests/test_prefill_explore_gluon_ws.py`` checks each config against a float64 reference on
the GPU and ``python -m benchmarks.prefill_explore_gluon_ws --out DIR/ws.json`` checks each config in a child
process and times the passing ones next to FlashInfer's ragged prefill, torch SDPA and the non-specialised Gluon
candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

if __name__ == "__main__":  # run as a script (so are its child processes): the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnbackends.triton.prefill_hopper import (
    HopperPrefillConfig,
    _prefill_hopper_kernel,
    hopper_prefill_args,
    plan_hopper_prefill,
)
from benchmarks.prefill_explore_gluon import _check

DEFAULT_REGS = HopperPrefillConfig().regs


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM: what an offline compile assumes


def launch_args(q, k, v, out, query_start_loc, max_len: int, scale: float, cache_write=None, **cfg):
    """(grid, args, kwargs) of one launch of the library kernel over every sequence of ``query_start_loc`` (also
    what the offline compile uses); ``cfg``: :class:`HopperPrefillConfig` fields (default: the backend's);
    ``cache_write``: (kv_cache, slot_mapping, todo) for the kernel's own cache write."""
    config = HopperPrefillConfig(**cfg)
    _check(q, k, v, out, query_start_loc, config.block_n, config.nbuf)
    T, HQ, D = q.shape
    plan = plan_hopper_prefill(num_heads=HQ, num_kv_heads=k.shape[1], head_size=D,
                               num_seqs=query_start_loc.numel() - 1, first_seq=0, max_query_len=max_len,
                               num_tokens=T, num_sms=_num_sms(q.device), config=config,
                               writes_cache=cache_write is not None,
                               block_size=cache_write[0].shape[2] if cache_write is not None else 16)
    return hopper_prefill_args(plan, q, k, v, out, query_start_loc, scale, *(cache_write or ()))


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
        max_len: int, scale: float, **cfg) -> torch.Tensor:
    """Causal varlen prefill, every token new: ``out = softmax(scale * q k^T + causal) v`` per sequence.

    Parameters
    ----------
    q, out : [tokens, num_heads, 128] bfloat16 / float16, contiguous
    k, v : [tokens, num_kv_heads, 128], same dtype, contiguous; num_heads a multiple of num_kv_heads
    query_start_loc : [num_seqs + 1] int32 on the device, sequence i is tokens [qsl[i], qsl[i + 1])
    max_len : the longest sequence (host int; a larger value only adds work items that are skipped)
    scale : softmax scale
    cfg : :class:`HopperPrefillConfig` fields (see :data:`CONFIGS`)
    """
    if q.device.type != "cuda":
        raise NotImplementedError("the Gluon kernel runs on CUDA (sm_90) only, not under the Triton interpreter")
    grid, args, kwargs = launch_args(q, k, v, out, query_start_loc, max_len, scale, **cfg)
    _prefill_hopper_kernel[grid](*args, **kwargs)
    return out


# The sweep, the backend's config first. Every entry names every field (the tests compare them with the reports).
_BASE = dataclasses.asdict(HopperPrefillConfig())
CONFIGS = [
    _BASE,
    dict(_BASE, epi_tma=False),
    dict(_BASE, persistent=False),
    dict(_BASE, pingpong=False),
    dict(_BASE, pingpong=False, persistent=False),
    dict(_BASE, nbuf=3, epi_tma=False),  # a third 128-key stage leaves no room for the O staging tile
    dict(_BASE, block_n=64, nbuf=3),
    dict(_BASE, block_n=64, nbuf=4, pingpong=False),
    dict(_BASE, regs=(232, 40)),
]


def config_label(cfg: dict) -> str:
    """A short unique name: ``ws n128 buf2 pp persist tmaO`` (+ ``regs232/40``)."""
    cfg = dict(_BASE, **cfg)
    s = f"ws n{cfg['block_n']} buf{cfg['nbuf']}"
    s += " pp" if cfg["pingpong"] else ""
    s += " persist" if cfg["persistent"] else ""
    s += " tmaO" if cfg["epi_tma"] else ""
    if tuple(cfg["regs"]) != DEFAULT_REGS:
        s += " regs{}/{}".format(*cfg["regs"])
    return s


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
    import re
    from collections import Counter

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


def compile_report(tokens: int = 256, heads: int = 32, kv_heads: int = 8, keep_asm: bool = False,
                   cache_write: bool = False, **cfg) -> dict:
    """Compile the kernel for sm_90 without a GPU, as the GPU's JIT would (arguments built on the CPU, with the
    launch's divisibility attributes), for one config (``CONFIGS`` fields).

    Returns the keys of ``benchmarks.offline_compile.compile_call`` ("regs" is the kernel-level .maxnreg that
    warp specialisation sets; "stack" / "local" the spill stack; "shared", "shared_over_limit", "wgmma",
    "mma_sync", "ptxas_notes") plus "setmaxnreg" (the PTX's register moves), "maxnreg", :func:`_sass_facts`
    and "config"."""
    import re
    import subprocess
    from collections import Counter

    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.offline_compile import (
        SHARED_LIMIT,
        _ptxas_notes,
        _signature,
        _tool,
        sm90_target,
    )

    cfg = dict(_BASE, **cfg)
    q = torch.zeros(tokens, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(tokens, kv_heads, 128, dtype=torch.bfloat16)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    cache = None
    if cache_write:  # the backend's own cache write: a cache of 16-token pages, slots, to-do flags
        cache = (torch.zeros(tokens // 16 + 1, 2, 16, kv_heads, 128, dtype=torch.bfloat16),
                 torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int8))
    _, args, kwargs = launch_args(q, k, k.clone(), torch.empty_like(q), qsl, tokens, 0.1, cache_write=cache, **cfg)
    target = sm90_target()
    signature, constexprs, options = _signature(_prefill_hopper_kernel, args, kwargs)
    attrs = _launch_attrs(_prefill_hopper_kernel, args, kwargs)
    t0 = time.time()
    compiled = triton.compile(GluonASTSource(_prefill_hopper_kernel, signature, constexprs, attrs), target=target,
                              options=options)
    rep = {"kernel": _prefill_hopper_kernel.fn.__name__, "compile_s": round(time.time() - t0, 2),
           "shared": compiled.metadata.shared,
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
    rep["mma_sync"] = len(re.findall(r"\bmma\.sync\.aligned", ptx))
    rep["setmaxnreg"] = [f"{kind} {n}" for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                                 ptx)]
    m = re.search(r"\.maxnreg\s+(\d+)", ptx)
    rep["maxnreg"] = int(m.group(1)) if m else None
    rep.update(_sass_facts(sass))
    rep["config"] = {**cfg, "regs": list(cfg["regs"])}
    if keep_asm:
        rep["asm"] = {"ttgir": compiled.asm.get("ttgir", ""), "ptx": ptx, "sass": sass}
    return rep


def compile_problems(rep: dict) -> list[str]:
    """What a :func:`compile_report` shows wrong ([]: nothing): a spill, shared memory past what one block may use,
    wgmma serialised by ptxas or mma.sync in their place, a missing Q.K^T or P.V wgmma shape, setmaxnreg moves
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


# ==============================================================================================================
# Benchmark: python -m benchmarks.prefill_explore_gluon_ws --out DIR/prefill-ws.json
# ==============================================================================================================
SHAPES = "1x8192,4x4096,16x1024"
HQ, HKV, D = 32, 8, 128
CHECK_LENGTHS = [300, 127, 1, 77, 128, 200, 129]  # the probe's varlen batch (no cached context)
REL_TOL = 1e-2


def _launcher(fn_kernel, grid, args, kwargs):
    """A no-argument callable launching a prepared grid (descriptors built once, as a metadata builder would)."""
    kernel = fn_kernel[grid]
    return lambda: kernel(*args, **kwargs)


def _ws_fn(cfg: dict, q, k, v, out, qsl, max_len: int, scale: float):
    grid, args, kwargs = launch_args(q, k, v, out, qsl, max_len, scale, **cfg)
    return _launcher(_prefill_hopper_kernel, grid, args, kwargs)


def _probe_main(ns) -> int:
    """Child process: per config, compile and check against the float32 reference on a varlen batch, then one
    launch per timed shape (a hang or crash shows here, not in the parent). JSON lines to --probe-out, 'started'
    before each config so that a dead child names it."""
    from benchmarks.prefill_explore import PagedBatch, compare, parse_shapes, reference

    configs = json.loads(ns.probe_configs)
    small = PagedBatch([(n, 0) for n in CHECK_LENGTHS], seed=1)
    ref = reference(small, torch.float32)
    key, value = small.new_kv()
    bench = [PagedBatch([(L, 0)] * B) for B, L in parse_shapes(ns.shapes)]
    with open(ns.probe_out, "a") as f:
        for cfg in configs:
            label = config_label(cfg)
            f.write(json.dumps({"label": label, "status": "started"}) + "\n")
            f.flush()
            t0 = time.time()
            try:
                out = torch.full_like(small.query, float("nan"))
                _ws_fn(cfg, small.query, key, value, out, small.qsl, max(small.q_lens), small.scale)()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                mad, rel = compare(out, ref)
                for bb in bench:
                    kk, vv = bb.new_kv()
                    _ws_fn(cfg, bb.query, kk, vv, torch.empty_like(bb.query), bb.qsl, max(bb.q_lens), bb.scale)()
                torch.cuda.synchronize()
                rec = {"label": label, "status": "ok" if rel < REL_TOL else "wrong", "max_abs": mad, "rel": rel,
                       "compile_s": round(compile_s, 2)}
            except Exception as e:  # noqa: BLE001 - one failing config must not stop the probe
                rec = {"label": label, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(f"probe {label}: {rec}", flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()
    return 0


def _flashinfer_ragged(q, k, v, qsl, scale: float):
    """FlashInfer's ragged prefill (every token new), planned once: (fn, out holder)."""
    import flashinfer

    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(qsl, qsl, q.shape[1], k.shape[1], q.shape[2], causal=True, q_data_type=q.dtype, sm_scale=scale)
    holder = {}

    def fn():
        holder["o"] = w.run(q, k, v)
    return fn, holder


def _warm_flashinfer_main(ns) -> int:
    """Child process: JIT-build (or load) FlashInfer's ragged prefill module for the timed parameters."""
    from benchmarks.prefill_explore import PagedBatch

    b = PagedBatch([(256, 0), (100, 0)])
    k, v = b.new_kv()
    fn, _ = _flashinfer_ragged(b.query, k, v, b.qsl, b.scale)
    fn()
    torch.cuda.synchronize()
    print("flashinfer ragged prefill module ready", flush=True)
    return 0


class _Sweep:
    """The parent process: probes in children, then peers and passing configs timed here, in one process."""

    def __init__(self, ns, log):
        from benchmarks.prefill_explore import parse_shapes

        self.ns, self.log = ns, log
        self.shapes = parse_shapes(ns.shapes)
        self.result = {"meta": {}, "probes": {}, "tflops": {}, "checks": {}, "rows": []}

    def _spawn(self, extra: list[str], prefix: str):
        from benchmarks.explore_common import spawn_child

        cmd = [sys.executable, "-m", "benchmarks.prefill_explore_gluon_ws", "--shapes", self.ns.shapes] + extra
        return spawn_child(cmd, self.log, prefix, cwd=str(Path(__file__).resolve().parents[1]))

    def probe(self, configs: list[dict]) -> dict:
        """{label: verdict}; a child that hangs past --probe-timeout-s on one config or dies is replaced by a new
        child for the configs after it; past --probe-budget-s no new child starts (the rest: "skipped")."""
        from benchmarks.explore_common import kill_child

        verdicts, pending = {}, list(configs)
        end = time.time() + self.ns.probe_budget_s
        while pending and time.time() < end:
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
                path = tmp.name
            proc = self._spawn(["--probe-configs", json.dumps(pending), "--probe-out", path], "probe")
            started_at, current, seen, rc = time.time(), None, 0, None
            while True:
                rc = proc.poll()
                lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
                for r in lines[seen:]:
                    if r["status"] == "started":
                        current, started_at = r["label"], time.time()
                    else:
                        verdicts[r["label"]] = r
                        current = None
                seen = len(lines)
                if rc is not None:
                    break
                if time.time() - started_at > self.ns.probe_timeout_s:
                    kill_child(proc)
                    rc = "timeout"
                    break
                time.sleep(0.5)
            os.unlink(path)
            if current is not None:
                status = "timeout" if rc == "timeout" else "crashed"
                verdicts[current] = {"label": current, "status": status, "error": f"child ended ({rc}) on it"}
                self.log(f"  {current}: {status} (child ended: {rc})")
            remaining = [c for c in pending if config_label(c) not in verdicts]
            if len(remaining) == len(pending):  # died before its first config: it would every time
                for c in remaining:
                    verdicts[config_label(c)] = {"label": config_label(c), "status": "error",
                                                 "error": f"probe process ended ({rc}) before any config"}
                remaining = []
            pending = remaining
        for c in pending:
            verdicts[config_label(c)] = {"label": config_label(c), "status": "skipped", "error": "probe budget spent"}
        return verdicts

    def add_time(self, name: str, shape, us: float, flops: float, check: str = "") -> None:
        key = f"{shape[0]}x{shape[1]}"
        self.result["tflops"].setdefault(name, {})[key] = round(flops / us / 1e6, 1)
        if check:
            self.result["checks"].setdefault(name, {})[key] = check
        self.log(f"  {name:34s} {key:>8s} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s  {check}")

    def write(self) -> None:
        if not self.ns.out:
            return
        rows = []
        peers = ("flashinfer_ragged", "sdpa")
        for name, per_shape in self.result["tflops"].items():
            for key, t in per_shape.items():
                B, L = (int(x) for x in key.split("x"))
                for peer in peers:
                    pt = self.result["tflops"].get(peer, {}).get(key)
                    if peer != name and pt:
                        rows.append({"case": "prefill_new", "backend": name, "peer": peer, "B": B, "L": L,
                                     "dtype": "bfloat16", "kv_dtype": "auto", "TFLOPs": t, "peer_TFLOPs": pt,
                                     "ratio": round(pt / t, 4)})
        self.result["rows"] = rows
        Path(self.ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(self.ns.out).write_text(json.dumps(self.result, indent=1) + "\n")

    def table(self) -> str:
        keys = [f"{B}x{L}" for B, L in self.shapes]
        lines = ["| kernel | " + " | ".join(f"{k} TFLOP/s (x FI / x SDPA)" for k in keys) + " |",
                 "|---|" + "---:|" * len(keys)]
        fi, sd = self.result["tflops"].get("flashinfer_ragged", {}), self.result["tflops"].get("sdpa", {})
        for name, per_shape in self.result["tflops"].items():
            cells = []
            for k in keys:
                t = per_shape.get(k)
                if t is None:
                    cells.append("—")
                    continue
                ratios = " / ".join(f"{t / p[k]:.2f}" if p.get(k) else "—" for p in (fi, sd))
                cells.append(f"{t:.0f} ({ratios})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _bench_main(ns) -> int:
    from benchmarks.explore_common import Log, kill_child
    from benchmarks.prefill_explore import PagedBatch, bench_us, compare, sdpa_fns
    from benchmarks.prefill_explore_gluon import CONFIGS as PLAIN_CONFIGS
    from benchmarks.prefill_explore_gluon import _prefill_new_kernel
    from benchmarks.prefill_explore_gluon import launch_args as plain_launch_args

    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU (sm_90); --compile-only runs anywhere")
        return 2
    log = Log(str(Path(ns.out).with_suffix(".log")) if ns.out else None)
    faulthandler.dump_traceback_later(ns.budget_s, exit=True)  # a hang here (not in a probe) still ends the run
    configs = [CONFIGS[i] for i in ns.configs] if ns.configs else CONFIGS
    if ns.quick:
        configs = configs[:1]
    sweep = _Sweep(ns, log)
    sweep.result["meta"] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "triton": triton.__version__, "shapes": ns.shapes, "heads": [HQ, HKV], "head_size": D,
                            "configs": {config_label(c): c for c in configs}}
    log(f"{sweep.result['meta']}")
    fi_proc = None
    if not ns.no_flashinfer:
        fi_proc = sweep._spawn(["--warm-flashinfer"], "flashinfer warm-up")

    log(f"== probes (compile, float32 reference on lengths {CHECK_LENGTHS}, one launch per shape)")
    verdicts = sweep.probe(sorted(configs, key=lambda c: (c["pingpong"], c["persistent"])))  # simplest first
    sweep.result["probes"] = verdicts
    passing = [c for c in configs if verdicts.get(config_label(c), {}).get("status") == "ok"]
    for c in configs:
        v = verdicts.get(config_label(c), {})
        rel = f"rel {v['rel']:.2e}" if "rel" in v else ""
        log(f"  {config_label(c):34s} {v.get('status')} {v.get('error', '')} {rel}")

    log("== timings (do_bench median), checked against SDPA's output")
    batches = {shape: PagedBatch([(shape[1], 0)] * shape[0]) for shape in sweep.shapes}
    refs = {}
    for shape, b in batches.items():
        best = None
        for name, (fn, holder) in sdpa_fns(b).items():
            try:
                fn()
                torch.cuda.synchronize()
                us = bench_us(fn)
                if best is None or us < best[0]:
                    best = (us, holder["o"])
            except Exception as e:  # noqa: BLE001
                log(f"  {name} {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
        if best is not None:
            sweep.add_time("sdpa", shape, best[0], b.flops(), "(best of gqa / expanded)")
            refs[shape] = best[1].transpose(1, 2).reshape(b.num_tokens, b.num_heads, b.head_size)

    def check(shape, out) -> tuple[bool, str]:
        if shape not in refs:
            return True, "(no reference)"
        mad, rel = compare(out, refs[shape])
        return rel < REL_TOL, f"max|diff| {mad:.2e} rel {rel:.2e}" + ("" if rel < REL_TOL else "  ** WRONG **")

    plain_cfg = PLAIN_CONFIGS[0]
    kernels = [(f"gluon_plain n{plain_cfg['block_n']} buf{plain_cfg['nbuf']}", None)] + [
        (f"gluon_{config_label(c)}", c) for c in passing]
    for name, cfg in kernels:
        for shape, b in batches.items():
            try:
                k, v = b.new_kv()
                out = torch.full_like(b.query, float("nan"))
                if cfg is None:
                    fn = _launcher(_prefill_new_kernel, *plain_launch_args(b.query, k, v, out, b.qsl, shape[1],
                                                                           b.scale, **plain_cfg))
                else:
                    fn = _ws_fn(cfg, b.query, k, v, out, b.qsl, shape[1], b.scale)
                fn()
                torch.cuda.synchronize()
                ok, msg = check(shape, out)
                if ok:
                    sweep.add_time(name, shape, bench_us(fn), b.flops(), msg)
                else:
                    log(f"  {name} {shape}: {msg}; not timed")
            except Exception as e:  # noqa: BLE001 - one failing config must not stop the sweep
                log(f"  {name} {shape}: error {type(e).__name__}: {str(e)[:300]}")
        sweep.write()

    if fi_proc is not None:
        log("== flashinfer ragged prefill")
        try:
            rc = fi_proc.wait(timeout=max(5.0, ns.flashinfer_wait_s))
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            kill_child(fi_proc)
            rc = "timeout"
        if rc != 0:
            log(f"  flashinfer warm-up ended with {rc}: no FlashInfer column")
        else:
            for shape, b in batches.items():
                try:
                    k, v = b.new_kv()
                    fn, holder = _flashinfer_ragged(b.query, k, v, b.qsl, b.scale)
                    fn()
                    torch.cuda.synchronize()
                    sweep.add_time("flashinfer_ragged", shape, bench_us(fn), b.flops(), check(shape, holder["o"])[1])
                except Exception as e:  # noqa: BLE001
                    log(f"  flashinfer {shape}: failed: {type(e).__name__}: {str(e)[:300]}")
    sweep.write()
    faulthandler.cancel_dump_traceback_later()
    log("\n" + sweep.table())
    if ns.out:
        log(f"\nresults: {ns.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results (the log goes next to it, .log)")
    ap.add_argument("--shapes", default=SHAPES, help="BxL,... (32 q heads, 8 kv heads, head 128, bf16)")
    ap.add_argument("--configs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="indices into CONFIGS (default: all)")
    ap.add_argument("--quick", action="store_true", help="the first config only")
    ap.add_argument("--compile-only", action="store_true", help="sm_90 compile report, no GPU needed")
    ap.add_argument("--cache-write", action="store_true",
                    help="with --compile-only: the kernel writing the paged cache itself, as the backend runs it")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--probe-timeout-s", type=float, default=60.0,
                    help="per config (compile included; the first also pays the child's start-up)")
    ap.add_argument("--probe-budget-s", type=float, default=300.0, help="no new probe child after this")
    ap.add_argument("--flashinfer-wait-s", type=float, default=150.0, help="for its JIT warm-up, after the sweep")
    ap.add_argument("--budget-s", type=float, default=560.0, help="the parent's hang guard (faulthandler)")
    ap.add_argument("--probe-configs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-flashinfer", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.compile_only:
        configs = [CONFIGS[i] for i in ns.configs] if ns.configs else CONFIGS
        for cfg in configs:
            print(json.dumps(compile_report(cache_write=ns.cache_write, **cfg)), flush=True)
        return 0
    if ns.probe_configs:
        return _probe_main(ns)
    if ns.warm_flashinfer:
        return _warm_flashinfer_main(ns)
    return _bench_main(ns)


if __name__ == "__main__":
    raise SystemExit(main())
