"""MLA decode in Triton and Gluon: candidate kernels, checked against the float32 oracle and timed side by side
with FlashInfer MLA and today's attnbackends kernel, in one process.

    python -m benchmarks.mla_explore --out DIR [--quick]      # on the H100: DIR/mla_explore.{json,log,md}
    python -m benchmarks.mla_explore --compile-only --out DIR  # any machine: sm_90 registers / spills / smem
    TRITON_INTERPRET=1 python -m benchmarks.mla_explore --dry-run-cpu --out DIR   # the driver on the CPU
    pytest -m gpu tests/test_mla_explore_gpu.py                # every candidate vs the oracle, no timing

DeepSeek-V3 decode: 128 heads, latent LKV 512 + rope R 64, page 64, bf16, pages in random order; absorbed
queries ``q_nope [T, H, LKV]``, ``q_pe [T, H, R]`` (T = B * q_len); the project's cache layout
``[num_blocks, PAGE, LKV + R]``. TFLOP/s = 2 * H * (LKV + R + LKV) * (keys seen, summed over query rows) / time.

Candidates (kernels in ``mla_explore_triton.py`` and ``mla_explore_gluon.py``):

- **A** the accumulator [64, LKV] as 2 or 4 column chunks, products accumulated in place, exp2 with the scale in
  its FMA, whole tiles by TMA (host descriptors);
- **B** the cache tile loaded once as [BLOCK_N, LKV] and used as K and V, pointer loads, one or two chunks;
- **C** TMA pipelining: deeper ``tl.range`` stages on 32-key tiles, device-side descriptors, the scale multiply
  kept (isolates the exp2 fold);
- **D** scheduling on A's best config: FlashMLA-style balanced split-KV pieces (the same work list as the default
  one when every request has the same length, as in the default shapes), and a persistent grid;
- **E** fp8 e4m3 latent pages: dequantised to bf16 in the kernel (TMA or pointers), and fp8 tensor cores for
  Q.K^T (queries quantised per row) or both products (P rounded to e4m3: a coarser accuracy class);
- **F** Gluon: two warpgroups split S along the keys and O along the columns (no Q.K^T computed twice, which
  plain Triton's layout for 64-row attention does), P exchanged through shared memory, TMA + mbarriers; one
  variant keeps P.V of the previous tile on the tensor cores while the warps exponentiate the current one;
- **G** Triton with P and alpha passed through a per-program global scratch, so Triton no longer sees a chained
  dot and splits Q.K^T across the warpgroups like F (at the price of a round trip through L2 per tile, and Triton
  3.6 then leaves the loop's loads unpipelined: see the compile report).

Candidate W (warp-specialised Gluon, FlashInfer's Hopper split) won and became the backend's Hopper kernel
(``attnbackends/mla/decode_hopper.py``); the backend's own rows (``triton (current)``) time it.

F runs first (the likeliest winner), then A (today's formulation, improved) and G; ``--families`` reorders.

Every candidate takes a work list built once per batch on the host (row, key range, partial slot), so split-KV,
q_len > 1 (each row's causal end) and the LSE output come from one code path; split rows are merged by LSE.

Safety: each family is compiled and checked first in a child process (small batch with odd lengths, q_len 1 and
2, a forced 3-way split, NaN in unused cache slots, output poisoned), then run once on every timed shape; a
compiler crash or an illegal address kills the child and only marks the config it was on. Passing configs are
checked again on each timed shape against the oracle and timed (``triton.testing.do_bench`` median) next to the
peers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks.explore_common import Log, kill_child, run_families, spawn_child

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Dims:
    """Model dimensions of a run."""

    heads: int = 128
    lkv: int = 512
    rope: int = 64
    page: int = 64

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(128 + self.rope)  # DeepSeek: 1 / sqrt(qk_nope 128 + rope 64)


DEEPSEEK = Dims()
DRY_DIMS = Dims(heads=8, lkv=64, rope=16, page=64)
SHAPES = [(64, 4096, 1), (128, 8192, 1), (1, 32768, 1), (4, 32768, 1), (8, 32768, 1)]
DRY_SHAPES = [(2, 130, 1), (1, 300, 2)]
# Accuracy classes: (relative Frobenius error of the output, max |LSE - oracle|).
TOL_BF16 = (1e-2, 2e-2)
TOL_FP8_MMA = (0.1, 0.2)  # fp8 queries (and P): quantisation, not a bug, sets this error
FAMILIES = "F,A,G,B,C,D,E"
K_SCALE_CHECK = 0.5  # the fp8 scale of the probe's check batch (timed batches use 1, as FlashInfer reads no scale)


# ==============================================================================================================
# Batches and the oracle
# ==============================================================================================================
class DecodeBatch:
    """A decode batch over a paged latent cache: ``seq_lens`` keys per request (new tokens included), ``q_len``
    query rows per request, pages in random order, unused cache slots NaN (a kernel must never read them into a
    product). fp8 caches hold saturate(c / k_scale) in e4m3."""

    def __init__(self, seq_lens: list[int], q_len: int = 1, *, dims: Dims = DEEPSEEK, dtype=torch.bfloat16,
                 kv_fp8: bool = False, k_scale: float = 1.0, device="cuda", seed: int = 0, extra_pages: int = 2):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.dims, self.q_len, self.dtype, self.device = dims, q_len, dtype, device
        self.seq_lens_host = list(seq_lens)
        self.k_scale = k_scale if kv_fp8 else 1.0
        page, width = dims.page, dims.lkv + dims.rope
        pages = [math.ceil(s / page) for s in seq_lens]
        num_blocks = sum(pages) + extra_pages
        perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
        bt = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
        at = 0
        for i, n in enumerate(pages):
            bt[i, :n] = perm[at:at + n]
            at += n
        self.block_table = bt.to(device)
        self.block_table_host = bt
        gd = torch.Generator(device=device).manual_seed(seed)
        latent = torch.randn(num_blocks, page, width, generator=gd, device=device)
        valid = torch.zeros(num_blocks, page, dtype=torch.bool, device=device)
        for i, (n, s) in enumerate(zip(pages, seq_lens)):
            used = torch.arange(n * page, device=device) < s
            valid[bt[i, :n].long().to(device)] = used.view(n, page)
        latent[~valid] = float("nan")
        if kv_fp8:
            self.cache = (latent / self.k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        else:
            self.cache = latent.to(dtype)
        T = len(seq_lens) * q_len
        self.q_nope = torch.randn(T, dims.heads, dims.lkv, generator=gd, device=device).to(dtype)
        self.q_pe = torch.randn(T, dims.heads, dims.rope, generator=gd, device=device).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)

    @property
    def kv_fp8(self) -> bool:
        return self.cache.dtype == torch.float8_e4m3fn

    @property
    def num_rows(self) -> int:
        return self.q_nope.shape[0]

    def keys_seen(self) -> int:
        return sum(L - self.q_len + i + 1 for L in self.seq_lens_host for i in range(self.q_len))

    def flops(self) -> float:
        d = self.dims
        return 2.0 * d.heads * (d.lkv + d.rope + d.lkv) * self.keys_seen()

    def new_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Output [T, H, LKV] and LSE [T, H], poisoned with NaN."""
        out = torch.full_like(self.q_nope, float("nan"))
        lse = torch.full(self.q_nope.shape[:2], float("nan"), dtype=torch.float32, device=self.device)
        return out, lse


def reference(b: DecodeBatch, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request in ``dtype`` from the (dequantised) cache: (output [T, H, LKV], natural-log LSE [T, H])."""
    d = b.dims
    out = torch.empty(b.num_rows, d.heads, d.lkv, dtype=dtype, device=b.device)
    lse = torch.empty(b.num_rows, d.heads, dtype=dtype, device=b.device)
    for i, L in enumerate(b.seq_lens_host):
        pages = b.block_table[i, :math.ceil(L / d.page)].long()
        latent = b.cache[pages].reshape(-1, d.lkv + d.rope)[:L].to(dtype) * b.k_scale  # [L, LKV + R]
        rows = slice(i * b.q_len, (i + 1) * b.q_len)
        q = torch.cat([b.q_nope[rows], b.q_pe[rows]], dim=-1).to(dtype)  # [q_len, H, LKV + R]
        s = torch.einsum("qhw,kw->qhk", q, latent) * d.scale
        ends = L - b.q_len + torch.arange(b.q_len, device=b.device) + 1
        s = s.masked_fill(torch.arange(L, device=b.device)[None, None, :] >= ends[:, None, None], float("-inf"))
        lse[rows] = torch.logsumexp(s, dim=-1)
        out[rows] = torch.einsum("qhk,kv->qhv", torch.softmax(s, dim=-1), latent[:, :d.lkv])
    return out, lse


def compare(out, lse, ref_out, ref_lse) -> dict[str, float]:
    """max |diff|, relative Frobenius error of the output, and max |LSE diff|; a NaN anywhere gives inf."""
    diff = out.float() - ref_out.float()
    ldiff = lse.float() - ref_lse.float()
    if not (torch.isfinite(diff).all() and torch.isfinite(ldiff).all()):
        return {"max_abs": float("inf"), "rel": float("inf"), "lse_max_abs": float("inf")}
    return {"max_abs": float(diff.abs().max()),
            "rel": float(diff.norm() / ref_out.float().norm().clamp_min(1e-30)),
            "lse_max_abs": float(ldiff.abs().max())}


def tolerance(cfg) -> tuple[float, float]:
    return TOL_FP8_MMA if getattr(cfg, "fp8", "") in ("qk", "qkpv") else TOL_BF16


def within(err: dict, cfg) -> bool:
    rel, lse_tol = tolerance(cfg)
    return err["rel"] < rel and err["lse_max_abs"] < lse_tol


# ==============================================================================================================
# Candidates
# ==============================================================================================================
def family_configs(family: str, quick: bool, best: Optional[dict] = None) -> list:
    """The sweep of one candidate family, best guess first (``quick``: that one only). ``best`` maps a family to
    its fastest config so far (D builds on A's)."""
    from benchmarks.mla_explore_triton import TritonConfig as TC

    if family == "A":
        cs = [TC("A"), TC("A", nchunk=4), TC("A", num_stages=3), TC("A", no_acc_multibuf=True),
              TC("A", acc_inplace=False, fold_scale=False)]
    elif family == "B":
        cs = [TC("B", nchunk=1, load=0), TC("B", nchunk=1, load=0, num_stages=3), TC("B", nchunk=2, load=0)]
    elif family == "C":
        cs = [TC("C", block_n=32, num_stages=3, loop_stages=3), TC("C", load=2), TC("C", block_n=32, num_stages=4),
              TC("C", fold_scale=False)]
    elif family == "D":
        base = (best or {}).get("A") or TC("A")
        cs = [replace(base, family="D", schedule="balanced"), replace(base, family="D", programs_per_sm=1),
              replace(base, family="D", schedule="balanced", programs_per_sm=1)]
    elif family == "E":
        cs = [TC("E", fp8="dequant"), TC("E", fp8="dequant", load=0), TC("E", fp8="qk"), TC("E", fp8="qkpv")]
    elif family == "G":
        cs = [TC("G", p_via_mem=True), TC("G", p_via_mem=True, load=0),
              TC("G", p_via_mem=True, block_n=32, loop_stages=3)]
    elif family == "F":
        from benchmarks.mla_explore_gluon import family_configs as gluon_configs

        cs = gluon_configs(quick=False)
    else:
        raise ValueError(f"unknown candidate family {family!r}; allowed: {FAMILIES}")
    return cs[:1] if quick else cs


def config_to_json(cfg) -> dict:
    return {"kind": type(cfg).__name__, **asdict(cfg)}


def config_from_json(d: dict):
    d = dict(d)
    kind = d.pop("kind")
    if kind == "GluonConfig":
        from benchmarks.mla_explore_gluon import GluonConfig

        return GluonConfig(**d)
    from benchmarks.mla_explore_triton import TritonConfig

    return TritonConfig(**d)


def make_launch(cfg, b: DecodeBatch, out, lse, num_sms: int):
    """A callable running ``cfg`` on ``b`` into ``out``/``lse`` (work list and buffers built here, once)."""
    from benchmarks.mla_explore_triton import build_schedule

    head_blocks = math.ceil(b.dims.heads / cfg.block_h)
    sched = build_schedule(b.seq_lens_host, b.q_len, num_sms=num_sms, head_blocks=head_blocks,
                           balanced=cfg.schedule == "balanced", device=b.device)
    return make_launch_with(cfg, b, out, lse, sched, num_sms)


def make_launch_with(cfg, b: DecodeBatch, out, lse, sched, num_sms: int):
    kw = dict(scale=b.dims.scale, k_scale=b.k_scale, num_sms=num_sms, interpret=INTERPRET)
    if type(cfg).__name__ == "GluonConfig":
        from benchmarks.mla_explore_gluon import make_gluon_launch

        return make_gluon_launch(cfg, b.q_nope, b.q_pe, b.cache, b.block_table, sched, out, lse, **kw)
    from benchmarks.mla_explore_triton import make_triton_launch

    return make_triton_launch(cfg, b.q_nope, b.q_pe, b.cache, b.block_table, sched, out, lse, **kw)


# ==============================================================================================================
# Peers
# ==============================================================================================================
def flashinfer_launch(b: DecodeBatch):
    """(callable, out, backend) running FlashInfer's BatchMLAPagedAttentionWrapper on ``b`` (backend "fa3", else
    "auto"), as attnbackends/mla/backends.py plans it. fp8 caches are passed as stored (k_scale must be 1)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    d = b.dims
    B = len(b.seq_lens_host)
    pages = [math.ceil(s / d.page) for s in b.seq_lens_host]
    kv_indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([b.block_table[i, :n] for i, n in enumerate(pages)]).to(torch.int32)
    qo_indptr = torch.arange(B + 1, dtype=torch.int32) * b.q_len
    out = torch.full_like(b.q_nope, float("nan"))
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=b.device)
    ckv, kpe = b.cache[..., :d.lkv], b.cache[..., d.lkv:]
    errors = []
    for backend in ("fa3", "auto"):
        try:
            w = BatchMLAPagedAttentionWrapper(ws, backend=backend)
            w.plan(qo_indptr, kv_indptr, kv_indices, torch.tensor(b.seq_lens_host, dtype=torch.int32), d.heads,
                   d.lkv, d.rope, d.page, b.q_len > 1, d.scale, b.q_nope.dtype, b.cache.dtype)

            def fn(w=w):
                w.run(b.q_nope, b.q_pe, ckv, kpe, out=out)
            fn()
            torch.cuda.synchronize()
            return fn, out, backend
        except Exception as e:  # noqa: BLE001 - fa3 may be missing from this build: fall back to auto
            errors.append(f"{backend}: {type(e).__name__}: {str(e)[:300]}")
    raise RuntimeError("; ".join(errors))


def current_kernel_launch(b: DecodeBatch, out, lse, num_sms: int):
    """attnbackends' MLA decode today (``mla_decode`` with its default config and split choice); q_len 1. Its TMA
    descriptors and partials are built once, as the backend's impl does, and as the candidates' runners do."""
    from attnbackends.mla.decode_kernel import (
        choose_num_splits,
        decode_descriptors,
        decode_kernel_name,
        default_decode_config,
        mla_decode,
    )

    if b.q_len != 1:
        raise ValueError("the current kernel takes one query per request")
    cfg = default_decode_config(b.dims.heads)
    splits = choose_num_splits(len(b.seq_lens_host), b.dims.heads, max(b.seq_lens_host), num_sms, cfg)
    B, H, lkv = b.q_nope.shape
    partials = None
    if splits > 1:
        partials = (torch.empty(B, H, splits, lkv, dtype=torch.float32, device=b.device),
                    torch.empty(B, H, splits, dtype=torch.float32, device=b.device))

    descriptors = decode_descriptors(decode_kernel_name(b.q_nope, b.q_pe, b.cache, cfg, tree=False), b.cache, lkv, cfg)

    def fn():
        mla_decode(b.q_nope, b.q_pe, b.cache, b.block_table, b.seq_lens, out, scale=b.dims.scale,
                   k_scale=b.k_scale, num_splits=splits, config=cfg, lse=lse, partials=partials,
                   descriptors=descriptors)
    return fn


# ==============================================================================================================
# Driver
# ==============================================================================================================
def bench_us(fn, timer: str) -> tuple[float, str]:
    """(median microseconds, timer used): ``do_bench`` (eager), or CUDA graph replay when asked and capturable."""
    import triton.testing

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "cpu"
    if timer == "graph":
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3, "graph"
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, "eager"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def num_sms() -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(0).multi_processor_count


def set_tma_allocator() -> None:
    """Device-side tensor descriptors (C's ``tmadev``) need a global scratch buffer, from this allocator."""
    import triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def alloc(size: int, alignment: int, stream: Optional[int]):
        return torch.empty(size, dtype=torch.int8, device=dev)
    triton.set_allocator(alloc)


def check_batches(dims: Dims, kv_fp8: bool, device) -> list[DecodeBatch]:
    """The probe's correctness batches: lengths around the tile and page edges, one query and two."""
    ks = K_SCALE_CHECK if kv_fp8 else 1.0
    if dims == DEEPSEEK:
        one = [1, 63, 64, 65, 200, 1000, 4097, 130]
        two = [65, 300, 4097]
    else:
        one = [1, 63, 64, 65, 200]
        two = [65, 130]
    return [DecodeBatch(one, 1, dims=dims, kv_fp8=kv_fp8, k_scale=ks, device=device, seed=1),
            DecodeBatch(two, 2, dims=dims, kv_fp8=kv_fp8, k_scale=ks, device=device, seed=2)]


def check_config(cfg, batches: list[DecodeBatch], refs: list, sms: int) -> dict:
    """Run ``cfg`` on every check batch with its own schedule and with a forced 3-way split; the worst error."""
    from benchmarks.mla_explore_triton import build_schedule

    worst = {"max_abs": 0.0, "rel": 0.0, "lse_max_abs": 0.0}
    for b, (ro, rl) in zip(batches, refs):
        hb = math.ceil(b.dims.heads / cfg.block_h)
        for sched in (build_schedule(b.seq_lens_host, b.q_len, num_sms=sms, head_blocks=hb,
                                     balanced=cfg.schedule == "balanced", device=b.device),
                      build_schedule(b.seq_lens_host, b.q_len, splits=3, align=64, device=b.device)):
            out, lse = b.new_output()
            make_launch_with(cfg, b, out, lse, sched, sms)()
            sync()
            err = compare(out, lse, ro, rl)
            worst = {k: max(worst[k], err[k]) for k in worst}
    return worst


def parse_shapes(s: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in s.split(","):
        f = [int(x) for x in part.lower().split("x")]
        shapes.append((f[0], f[1], f[2] if len(f) > 2 else 1))
    return shapes


def shape_name(shape) -> str:
    B, L, q = shape
    return f"{B}x{L}" + (f"x{q}" if q != 1 else "")


def probe_main(args, dims: Dims) -> int:
    """Child process: compile and check each config, then run it once on every timed shape (a crash names the
    config: a 'started' line goes out before each). One JSON line per config to --probe-out."""
    set_tma_allocator()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configs = [config_from_json(c) for c in json.loads(args.probe_configs)]
    sms = num_sms()
    checks: dict[bool, Any] = {}
    timed: dict[bool, list] = {}
    with open(args.probe_out, "a") as f:
        for cfg in configs:
            f.write(json.dumps({"label": cfg.label, "status": "started"}) + "\n")
            f.flush()
            t0 = time.time()
            try:
                fp8 = cfg.kv_fp8
                if fp8 not in checks:
                    bs = check_batches(dims, fp8, device)
                    checks[fp8] = (bs, [reference(b) for b in bs])
                err = check_config(cfg, *checks[fp8], sms)
                ok = within(err, cfg)
                if ok and not args.dry_run_cpu:
                    if fp8 not in timed:
                        timed[fp8] = [DecodeBatch([L] * B, q, dims=dims, kv_fp8=fp8, device=device)
                                      for B, L, q in parse_shapes(args.shapes)]
                    for b in timed[fp8]:
                        out, lse = b.new_output()
                        make_launch(cfg, b, out, lse, sms)()
                    sync()
                rec = {"label": cfg.label, "status": "ok" if ok else "wrong", **err,
                       "check_s": round(time.time() - t0, 2)}
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the probe
                rec = {"label": cfg.label, "status": "error", "error": f"{type(e).__name__}: {str(e)[:600]}"}
            print(f"  probe {cfg.label}: {rec}", flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()
    return 0


def warm_flashinfer_main(args, dims: Dims) -> int:
    """Child process: JIT-build (or load) FlashInfer's MLA module for bf16 pages, or fp8 pages (``--warm-fp8``)."""
    b = DecodeBatch([300, 64], 1, dims=dims, kv_fp8=args.warm_fp8, device="cuda")
    _, _, backend = flashinfer_launch(b)
    print(f"flashinfer MLA ready ({backend}, {'fp8' if args.warm_fp8 else 'bf16'} pages)", flush=True)
    return 0


class Runner:
    """The parent process: peers, probes, checks, timings, rows."""

    def __init__(self, args, log: Log, dims: Dims):
        self.args, self.log, self.dims = args, log, dims
        self.deadline = time.time() + args.budget_s
        self.shapes = parse_shapes(args.shapes)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sms = num_sms()
        self.batches: dict[tuple, DecodeBatch] = {}
        self.refs: dict[tuple, tuple] = {}
        self.peer_us: dict[tuple, float] = {}  # (peer, shape, fp8) -> us
        self.results: list[dict] = []
        self.fi_procs: dict[bool, subprocess.Popen] = {}  # fp8 pages? -> warm-up child

    def batch(self, shape, fp8: bool) -> DecodeBatch:
        key = (shape, fp8)
        if key not in self.batches:
            B, L, q = shape
            self.batches[key] = DecodeBatch([L] * B, q, dims=self.dims, kv_fp8=fp8, device=self.device)
            self.refs[key] = reference(self.batches[key])
        return self.batches[key]

    # ---------------- child processes ----------------
    def _spawn(self, extra: list[str], prefix: str) -> subprocess.Popen:
        cmd = [sys.executable, "-u", "-m", "benchmarks.mla_explore", "--shapes", self.args.shapes, *extra]
        if self.args.dry_run_cpu:
            cmd.append("--dry-run-cpu")
        return spawn_child(cmd, self.log, prefix, cwd=str(Path(__file__).resolve().parents[1]))

    _kill = staticmethod(kill_child)

    def probe(self, configs: list, timeout: float) -> dict[str, dict]:
        """Check configs in child processes until each has a verdict; a child that dies, or spends more than
        ``--config-timeout-s`` on one config (a kernel that hangs), takes only the config it was on with it and
        a new child goes on with the rest. Returns label -> record."""
        verdicts: dict[str, dict] = {}
        pending = list(configs)
        end = time.time() + timeout
        while pending and time.time() < end:
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
                path = tmp.name
            proc = self._spawn(["--probe-configs", json.dumps([config_to_json(c) for c in pending]),
                                "--probe-out", path], f"probe {pending[0].family}")
            rc, seen, last_progress = None, 0, time.time()
            while rc is None:
                rc = proc.poll()
                lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
                if len(lines) > seen:
                    seen, last_progress = len(lines), time.time()
                if rc is None and (time.time() > end or time.time() - last_progress > self.args.config_timeout_s):
                    self._kill(proc)
                    rc = "timeout"
                elif rc is None:
                    time.sleep(0.2)
            recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
            os.unlink(path)
            started = None
            for r in recs:
                if r["status"] == "started":
                    started = r["label"]
                else:
                    verdicts[r["label"]] = r
                    started = None
            if started is not None:
                verdicts[started] = {"label": started, "status": "timeout" if rc == "timeout" else "crashed",
                                     "error": f"child process ended ({rc}) while on this config"}
            progressed = any(c.label in verdicts for c in pending)
            pending = [c for c in pending if c.label not in verdicts]
            if not progressed:
                for c in pending:
                    verdicts[c.label] = {"label": c.label, "status": "error",
                                         "error": f"probe process ended ({rc}) before checking any config"}
                pending = []
        for c in pending:
            verdicts[c.label] = {"label": c.label, "status": "skipped", "error": "probe time budget spent"}
        return verdicts

    # ---------------- peers ----------------
    def run_current(self) -> None:
        for fp8 in (False, True):
            for shape in self.shapes:
                if shape[2] != 1:
                    continue
                name = shape_name(shape) + (" fp8" if fp8 else "")
                try:
                    b = self.batch(shape, fp8)
                    out, lse = b.new_output()
                    fn = current_kernel_launch(b, out, lse, self.sms)
                    fn()
                    sync()
                    err = compare(out, lse, *self.refs[(shape, fp8)])
                    us, timer = bench_us(fn, self.args.timer)
                    self.peer_us[("triton_current", shape, fp8)] = us
                    self.log(f"  triton (current) {name}: {us:9.1f} us {b.flops() / us / 1e6:6.1f} TFLOP/s "
                             f"[{timer}] rel {err['rel']:.1e} lse {err['lse_max_abs']:.1e}")
                except Exception as e:  # noqa: BLE001
                    self.log(f"  triton (current) {name}: failed: {type(e).__name__}: {str(e)[:300]}")

    def run_flashinfer(self, wait_s: float) -> None:
        """Time FlashInfer for each page dtype whose warm-up child has finished (waiting up to ``wait_s``)."""
        for fp8 in sorted(self.fi_procs):
            proc = self.fi_procs[fp8]
            kind = "fp8" if fp8 else "bf16"
            try:
                rc = proc.wait(timeout=max(0.0, wait_s))
            except subprocess.TimeoutExpired:
                if wait_s > 0:
                    self.log(f"  flashinfer {kind} warm-up still running past its time; not timing it")
                    self._kill(proc)
                    del self.fi_procs[fp8]
                continue
            del self.fi_procs[fp8]
            if rc != 0:
                self.log(f"  flashinfer MLA with {kind} pages unavailable (warm-up rc {rc}); no FlashInfer {kind} "
                         "column")
                continue
            self._time_flashinfer(fp8)

    def _time_flashinfer(self, fp8: bool) -> None:
        for shape in self.shapes:
            name = shape_name(shape) + (" fp8" if fp8 else "")
            try:
                b = self.batch(shape, fp8)
                fn, out, backend = flashinfer_launch(b)
                fn()
                sync()
                ref = self.refs[(shape, fp8)][0]
                diff = out.float() - ref
                rel = float(diff.norm() / ref.norm()) if torch.isfinite(diff).all() else float("inf")
                us, timer = bench_us(fn, self.args.timer)
                self.peer_us[("flashinfer", shape, fp8)] = us
                self.log(f"  flashinfer MLA ({backend}) {name}: {us:9.1f} us {b.flops() / us / 1e6:6.1f} "
                         f"TFLOP/s [{timer}] rel {rel:.1e}" + ("" if rel < TOL_BF16[0] else "  ** WRONG **"))
            except Exception as e:  # noqa: BLE001
                self.log(f"  flashinfer MLA {name}: failed: {type(e).__name__}: {str(e)[:300]}")
        self.write()

    # ---------------- candidates ----------------
    def best_configs(self) -> dict:
        """Family -> its fastest config on the first shape."""
        best: dict[str, tuple] = {}
        for r in self.results:
            e = r["shapes"].get(shape_name(self.shapes[0]), {})
            if e.get("status") == "ok" and (r["family"] not in best or e["us"] < best[r["family"]][0]):
                best[r["family"]] = (e["us"], r["cfg"])
        return {f: c for f, (_, c) in best.items()}

    def run_family(self, family: str, budget_s: float) -> None:
        t_end = time.time() + budget_s
        try:
            configs = family_configs(family, self.args.quick, self.best_configs())
        except Exception as e:  # noqa: BLE001 - e.g. Gluon missing from this Triton
            self.log(f"== candidate {family}: unavailable: {type(e).__name__}: {str(e)[:300]}")
            self.results.append({"label": f"{family} (unavailable)", "family": family, "cfg": None, "config": {},
                                 "probe": {"status": "error", "error": str(e)[:300]}, "shapes": {}})
            return
        self.log(f"== candidate {family}: {len(configs)} config(s), budget {budget_s:.0f} s")
        verdicts = self.probe(configs, timeout=0.75 * budget_s)
        for cfg in configs:
            v = verdicts.get(cfg.label, {})
            res = {"label": cfg.label, "family": family, "cfg": cfg, "config": config_to_json(cfg), "probe": v,
                   "shapes": {}}
            self.results.append(res)
            if v.get("status") != "ok":
                self.log(f"  {cfg.label}: {v.get('status')} {v.get('error', '')} "
                         + (f"rel {v['rel']:.2e} lse {v['lse_max_abs']:.2e}" if "rel" in v else ""))
                continue
            if self.args.dry_run_cpu:
                self.log(f"  {cfg.label}: ok (rel {v['rel']:.1e}, lse {v['lse_max_abs']:.1e})")
            for shape in self.shapes:
                name = shape_name(shape)
                if time.time() > min(t_end, self.deadline):
                    self.log(f"  {cfg.label}: time budget spent, not timing {name}")
                    break
                try:
                    b = self.batch(shape, cfg.kv_fp8)
                    out, lse = b.new_output()
                    fn = make_launch(cfg, b, out, lse, self.sms)
                    fn()
                    sync()
                    err = compare(out, lse, *self.refs[(shape, cfg.kv_fp8)])
                    entry: dict[str, Any] = dict(err)
                    if not within(err, cfg):
                        entry["status"] = "wrong"
                        self.log(f"  {cfg.label} {name}: WRONG vs oracle (rel {err['rel']:.2e}, lse "
                                 f"{err['lse_max_abs']:.2e}); not timed")
                    else:
                        us, timer = bench_us(fn, self.args.timer)
                        entry.update(status="ok", us=us, timer=timer, tflops=b.flops() / us / 1e6)
                        self.log(f"  {cfg.label:44s} {name:>9s} {us:9.1f} us {entry['tflops']:6.1f} TFLOP/s "
                                 f"{self._vs(shape, us, cfg.kv_fp8)}  rel {err['rel']:.1e}")
                    res["shapes"][name] = entry
                except Exception as e:  # noqa: BLE001
                    res["shapes"][name] = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    self.log(f"  {cfg.label} {name}: error {type(e).__name__}: {str(e)[:300]}")
            self.write()

    def _vs(self, shape, us, fp8) -> str:
        parts = []
        for peer in ("flashinfer", "triton_current"):
            p = self.peer_us.get((peer, shape, fp8))
            if p:
                parts.append(f"{p / us:5.2f}x {peer}{' fp8' if fp8 else ''}")
        if fp8:
            p = self.best_bf16_us(shape)
            if p:
                parts.append(f"{p / us:5.2f}x best bf16 candidate")
        return "  ".join(parts)

    def best_bf16_us(self, shape) -> Optional[float]:
        name = shape_name(shape)
        times = [r["shapes"][name]["us"] for r in self.results if r["cfg"] is not None and not r["cfg"].kv_fp8
                 and r["shapes"].get(name, {}).get("status") == "ok"]
        return min(times) if times else None

    # ---------------- output ----------------
    def rows(self) -> list[dict]:
        rows = []
        d = self.dims

        def add(backend, shape, fp8, us, extra):
            B, L, q = shape
            flops = self.batch(shape, fp8).flops()
            base = {"case": "mla_decode", "backend": backend, "B": B, "L": L, "q_len": q, "H": d.heads,
                    "dtype": "bfloat16", "kv_dtype": "fp8_e4m3" if fp8 else "auto", "us": round(us, 2),
                    "TFLOPs": round(flops / us / 1e6, 1), **extra}
            peers = [("flashinfer_mla", self.peer_us.get(("flashinfer", shape, fp8))),
                     ("triton_current", self.peer_us.get(("triton_current", shape, fp8)))]
            if fp8:
                peers.append(("best_bf16_candidate", self.best_bf16_us(shape)))
            peers = [(peer, p) for peer, p in peers if p and peer != backend]
            for peer, p in peers:
                rows.append({**base, "peer": peer, "peer_us": round(p, 2), "ratio": round(us / p, 4),
                             "peer_TFLOPs": round(flops / p / 1e6, 1)})
            if not peers:
                rows.append({**base, "peer": None})
        for (peer, shape, fp8), us in self.peer_us.items():
            add("flashinfer_mla" if peer == "flashinfer" else peer, shape, fp8, us, {})
        for r in self.results:
            for name, e in r["shapes"].items():
                if e.get("status") == "ok":
                    shape = next(s for s in self.shapes if shape_name(s) == name)
                    kind = "gluon" if r["config"].get("kind") in ("GluonConfig", "GluonWSConfig") else "triton"
                    add(f"{kind}_{r['family']}", shape, r["cfg"].kv_fp8, e["us"],
                        {"config": r["label"], "max_abs_diff": e["max_abs"], "rel_err": e["rel"],
                         "lse_max_abs_diff": e["lse_max_abs"], "timer": e.get("timer")})
        return rows

    def write(self) -> None:
        if not self.args.out:
            return
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "triton": __import__("triton").__version__,
                "command": " ".join(sys.argv), "dims": asdict(self.dims),
                "probes": [{"label": r["label"], **{k: v for k, v in r["probe"].items() if k != "label"}}
                           for r in self.results]}
        (out / "mla_explore.json").write_text(json.dumps({**meta, "rows": self.rows()}, indent=1) + "\n")
        (out / "mla_explore.md").write_text(self.table() + "\n")

    def table(self) -> str:
        names = [shape_name(s) for s in self.shapes]
        lines = ["| candidate | config | " + " | ".join(f"{n} TFLOP/s (x FlashInfer)" for n in names) + " |",
                 "|" + "---|" * (2 + len(names))]

        def cell(shape, fp8, us):
            if not us:
                return "—"
            t = self.batch(shape, fp8).flops() / us / 1e6
            fi = self.peer_us.get(("flashinfer", shape, fp8))
            return f"{t:.0f} ({fi / us:.2f})" if fi else f"{t:.0f}"
        for peer, label in (("flashinfer", "FlashInfer MLA"), ("triton_current", "attnbackends today")):
            for fp8 in (False, True):
                cells = [cell(s, fp8, self.peer_us.get((peer, s, fp8))) for s in self.shapes]
                if any(c != "—" for c in cells):
                    lines.append(f"| {label} | {'fp8 pages' if fp8 else 'bf16'} | " + " | ".join(cells) + " |")
        for r in self.results:
            cells = []
            for s, n in zip(self.shapes, names):
                e = r["shapes"].get(n)
                if e and e.get("status") == "ok":
                    cells.append(cell(s, r["cfg"].kv_fp8, e["us"]))
                elif e:
                    cells.append(e.get("status", "?"))
                else:
                    cells.append(r["probe"].get("status", "not run"))
            lines.append(f"| {r['family']} | {r['label']} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def compile_only_main(args, dims: Dims, log: Log) -> int:
    """Compile every candidate for sm_90 on this machine (no GPU needed) and report registers, spill stack,
    shared memory and wgmma shapes."""
    from benchmarks.mla_explore_triton import build_schedule
    from benchmarks.offline_compile import compile_call

    B, L = 4, 4096
    reports = []
    for family in [f.strip().upper() for f in args.families.split(",") if f.strip()]:
        try:
            configs = family_configs(family, args.quick)
        except Exception as e:  # noqa: BLE001
            log(f"{family}: unavailable: {type(e).__name__}: {str(e)[:300]}")
            continue
        for cfg in configs:
            rec: dict[str, Any] = {"label": cfg.label}
            try:
                nb = B * L // dims.page
                cache = torch.empty(nb, dims.page, dims.lkv + dims.rope,
                                    dtype=torch.float8_e4m3fn if cfg.kv_fp8 else torch.bfloat16)
                b = argparse.Namespace(q_nope=torch.empty(B, dims.heads, dims.lkv, dtype=torch.bfloat16),
                                       q_pe=torch.empty(B, dims.heads, dims.rope, dtype=torch.bfloat16))
                out = torch.empty_like(b.q_nope)
                lse = torch.empty(B, dims.heads)
                sched = build_schedule([L] * B, 1, splits=2, head_blocks=math.ceil(dims.heads / cfg.block_h))
                kw = dict(scale=dims.scale, k_scale=1.0, num_sms=132, interpret=False)
                bt = torch.zeros(B, L // dims.page, dtype=torch.int32)
                if type(cfg).__name__ == "GluonConfig":
                    from benchmarks.mla_explore_gluon import make_gluon_launch
                    launch = make_gluon_launch(cfg, b.q_nope, b.q_pe, cache, bt, sched, out, lse, **kw)
                else:
                    from benchmarks.mla_explore_triton import make_triton_launch
                    launch = make_triton_launch(cfg, b.q_nope, b.q_pe, cache, bt, sched, out, lse, **kw)
                kernel, _, kargs, kkw = launch.calls[0]
                rec.update(compile_call(kernel, kargs, kkw))
                log(f"{cfg.label:44s} regs {rec['regs']:3d} spill stack {rec['stack']:5d} B  smem "
                    f"{rec['shared']:6d} B{' (OVER THE LIMIT)' if rec['shared_over_limit'] else ''}  "
                    f"wgmma {rec['wgmma']}  ({rec['compile_s']} s)"
                    + "".join(f"\n    ptxas: {n}" for n in rec["ptxas_notes"]))
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                log(f"{cfg.label}: compile failed: {rec['error']}")
            reports.append(rec)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mla_explore_compile.json").write_text(json.dumps(reports, indent=1) + "\n")
    return 0 if all("error" not in r for r in reports) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output directory (mla_explore.json / .log / .md)")
    ap.add_argument("--quick", action="store_true", help="only the best-guess config of each candidate")
    ap.add_argument("--families", default=FAMILIES, help="candidates to run, in order")
    ap.add_argument("--shapes", default=None, help="BxL[xq_len],... (default: the five target shapes)")
    ap.add_argument("--budget-s", type=float, default=290.0, help="wall-clock budget of the whole run")
    ap.add_argument("--config-timeout-s", type=float, default=60.0,
                    help="longest a probe may spend on one config (compile, checks, one run per shape)")
    ap.add_argument("--timer", choices=("eager", "graph"), default="eager",
                    help="eager: triton.testing.do_bench (L2 flushed before each call, as benchmarks/mla.py); "
                         "graph: CUDA graph replay (no flush)")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every candidate for sm_90 here (no GPU needed): registers, spills, smem")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the whole driver on the CPU through the interpreter (TRITON_INTERPRET=1), tiny dims "
                         "and shapes, Triton families only; timings meaningless")
    ap.add_argument("--probe-configs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-flashinfer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warm-fp8", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    dims = DRY_DIMS if args.dry_run_cpu else DEEPSEEK
    if args.shapes is None:
        args.shapes = ",".join(shape_name(s) for s in (DRY_SHAPES if args.dry_run_cpu else SHAPES))
    if args.dry_run_cpu:
        if not INTERPRET:
            print("--dry-run-cpu needs TRITON_INTERPRET=1 in the environment")
            return 2
        args.no_flashinfer = True
    if args.probe_configs:
        return probe_main(args, dims)
    if args.warm_flashinfer:
        return warm_flashinfer_main(args, dims)
    log_path = str(Path(args.out) / ("mla_explore_compile.log" if args.compile_only else "mla_explore.log")) \
        if args.out else None
    if log_path:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    log = Log(log_path)
    if args.compile_only:
        if INTERPRET:
            print("--compile-only compiles for the GPU: run it without TRITON_INTERPRET")
            return 2
        return compile_only_main(args, dims, log)
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("mla_explore needs a CUDA GPU (or --dry-run-cpu / --compile-only; CPU checks: "
              "tests/test_mla_explore.py)")
        return 2

    import triton

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU dry run"
    log(f"torch {torch.__version__}, triton {triton.__version__}, {where}, shapes {args.shapes}, "
        f"families {args.families}, quick {args.quick}, timer {args.timer}, budget {args.budget_s:.0f} s")
    set_tma_allocator()
    run = Runner(args, log, dims)
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F401
            run.fi_procs[False] = run._spawn(["--warm-flashinfer"], "flashinfer bf16 warm-up")
            run.fi_procs[True] = run._spawn(["--warm-flashinfer", "--warm-fp8"], "flashinfer fp8 warm-up")
        except Exception as e:  # noqa: BLE001
            log(f"flashinfer unavailable ({type(e).__name__}: {e}); no FlashInfer column")
    log("== oracle and today's attnbackends kernel")
    for shape in run.shapes:
        run.batch(shape, False)
    run.run_current()
    run.write()
    families = [f.strip().upper() for f in args.families.split(",") if f.strip()]
    if args.dry_run_cpu:
        families = [f for f in families if f != "F"]
    reserve = 25.0 if run.fi_procs else 0.0
    run_families(families, lambda fam, budget: run.run_family(fam, budget_s=budget), run.deadline, log,
                 reserve_s=reserve, min_left_s=10, between=lambda: run.run_flashinfer(wait_s=0))
    log("== flashinfer")
    run.run_flashinfer(wait_s=max(5.0, run.deadline - time.time()))
    run.write()
    log("\nSpeed ratios in the table are FlashInfer time / candidate time (> 1: faster than FlashInfer).\n")
    log(run.table())
    if args.out:
        log(f"\nrows: {Path(args.out) / 'mla_explore.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
