"""Decode as an engine drives it, on heavy-tailed ragged batches, against FlashInfer's own wrappers (issue 42).

    python -m benchmarks.run --suite decode [-- --quick]         # results kept in benchmarks/results/
    python -m benchmarks.decode --out rows.json [--quick] [--batches two_mode b1_16384]
    python -m benchmarks.decode --cpu-smoke [--out rows.json]    # no GPU: tiny batches, every code path it can

The layer is Llama-3-8B's (32 query / 8 KV heads, head 128, bf16, page 16); every batch lives on its own random cache
with its pages in random order (a shuffled page-id permutation, each request's pages a run of it). Batches are seeded
(``--seed``) and their parameters are in :func:`batch_defs` and in every row (``params``):

- ``lognormal_1500``: 128 decodes, lengths lognormal (median 1500, sigma 0.9, at least 16, at most 32768);
- ``lognormal_12k``: 32 decodes, lognormal (median 12000, sigma 0.9, at most 32768);
- ``two_mode``: 96 decodes at 600 and 8 at 24000, in shuffled order;
- ``uniform_8192``: 128 at 8192; ``uniform_lognormal_mean``: 128 at the mean length of ``lognormal_1500`` (the same
  KV bytes, uniform); ``uniform_4096``: 64 at 4096; ``b1_16384``: 1 at 16384; ``b4_32768``: 4 at 32768;
- ``mixed_chunks``: 96 ragged decodes (lognormal as above) + 4 chunks of 512 new tokens on 1024-8192 cached ones;
- ``mixed_prompts``: 64 ragged decodes + 32 fresh prompts of 64-512 tokens.

A decode of length L is one new token on L - 1 cached ones. Decodes come first in a batch (the builders' order).

Ours: the ``triton`` backend through the public API, as an engine calls it: a builder per model
(``num_blocks=`` the cache's pages where the builder takes it), ``build(common)`` once per step, ``impl.forward``
timed per layer: ``forward(q, k, v, ...)`` with the step's new keys and values (written to the cache inside the
timed call; ``kv_in_forward: true``) and attention alone, ``forward(q, None, None, ...)`` (``kv_in_forward:
false``). Where the builder takes a ``decode_schedule`` option, each of "balanced" and "uniform" it accepts gives
rows of its own (``backend``: ``triton_balanced``, ``triton_uniform``); the default ("auto") is ``triton``.

The peer (``peer: flashinfer_wrappers``): FlashInfer's own wrappers driven the way vLLM's FlashInfer backend drives
them: ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)`` for the decodes and
``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")`` (causal) for a mixed step's chunks and prompts, each
planned once per step (host indptr / last-page arrays, page ids on the device, from the same block tables) over the
same cache tensor ([num_blocks, 2, page, kv heads, head]: FlashInfer's NHD layout with K/V on dim 1); ``run()``
timed. The peer's time never includes writing the step's keys (its ``append_paged_kv_cache`` is a launch of its
own): compare ``kv_in_forward: false`` rows for attention alone. Our FlashInfer adapter (the ``flashinfer`` backend,
through the same public API as ours) gives ``backend: flashinfer_adapter`` rows beside.

Rows (PERF.md names; ``ratio`` = us / peer_us; every row that compares outputs carries ``max_abs_diff`` and
``diff_ok`` = max_abs_diff <= 2e-2):

- ``copy_roof``: device-to-device ``copy_`` of a 1 GiB buffer, GB/s = bytes read + written / time (the roof).
- ``decode_ragged`` (``batch`` names the batch; ``mode`` eager or graph; ``kv_in_forward``): ``backend`` triton,
  triton_balanced / triton_uniform (where they exist) and flashinfer_adapter, ``peer`` flashinfer_wrappers. ``us`` /
  ``peer_us``: ``triton.testing.do_bench`` medians; ``GBps`` / ``peer_GBps``: K+V bytes of every request's tokens +
  query and output bytes, / time; ``kv_tokens``; ``L`` the longest request, ``L_mean`` the mean. Mode ``graph``
  (decode-only batches): our ``forward`` and FlashInfer's ``run()`` (a ``use_cuda_graph=True`` wrapper on page-table
  buffers of its own, as vLLM captures) each replayed from a CUDA graph, ``max_abs_diff`` from the replayed output;
  a capture that fails is a row with ``error`` (``peer_error`` for the peer's).
- ``decode_host``: host time per step with the GPU idle (thread CPU time, median, calls interleaved): ``us`` =
  ours ``build()`` + ``forward(q, k, v)`` (``build_host_us``, ``forward_host_us``), ``peer_us`` = FlashInfer's
  ``plan()`` + ``run()`` (``peer_plan_host_us``, ``peer_run_host_us``); the adapter's beside.
- ``decode_roof`` (decode-only batches, bf16 and fp8): ``us`` ours (eager, with the step's K/V), ``peer:
  copy_roof``, ``peer_us`` the time of the same bytes at the measured copy roof, so ``ratio`` = roof_GBps / GBps;
  ``GBps``, ``roof_GBps``, ``fraction_of_roof``, and FlashInfer's and the graphs' GB/s beside.
- ``decode_fp8`` (``uniform_4096``, ``uniform_8192``, ``lognormal_1500``): ours on fp8 e4m3 pages (the bf16 cache's
  values quantised, per-tensor scale) vs ours on the bf16 pages, ``peer: triton_bf16``, ratio = fp8 time / bf16
  time; FlashInfer's fp8 decode beside where its wrapper takes fp8 pages (``flashinfer_fp8_us``,
  ``ratio_vs_flashinfer_fp8``; ``max_abs_diff`` against it).

``--cpu-smoke`` (alias ``--dry-run``) runs the same code on the CPU: the same batch generators with tiny parameters
and a small layer (8 / 2 heads, head 64), ours the ``triton`` backend where it runs there (``TRITON_INTERPRET=1``)
or else the ``reference`` one, the peer a torch stand-in with FlashInfer's wrapper signatures
(:func:`torch_paged_wrappers`) planned and run exactly as the real one is, the adapter rows from the ``reference``
backend; wall-clock timings, no CUDA graphs. Its numbers mean nothing; its rows check the batches, the page tables
handed to the peer and the row format (tests/test_bench_decode.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch

from attnbackends import AttentionSpec, DeviceInfo, build_common_metadata, get_backend_class

__all__ = ["BatchDef", "Layer", "LLAMA3_8B", "SMOKE_LAYER", "batch_defs", "main", "torch_paged_wrappers"]

DIFF_LIMIT = 2e-2  # rows whose outputs differ from the peer's by more are flagged (diff_ok: false)
FP8_SCALE = 1.0 / 32  # per-tensor k/v scale of the fp8 pages: randn values up to ~14 fit e4m3's 448
SCHEDULES = ("balanced", "uniform")  # decode_schedule values timed as rows of their own where the builder has them
PEER = "flashinfer_wrappers"
WORKSPACE_BYTES = 256 << 20
COPY_ROOF_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Layer:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int

    def spec(self, kv_cache_dtype: str = "auto") -> AttentionSpec:
        return AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                             dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, block_size=self.block_size)


LLAMA3_8B = Layer(32, 8, 128, 16)
SMOKE_LAYER = Layer(8, 2, 64, 16)


# ---------------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BatchDef:
    """One seeded batch: ``decodes`` the sequence lengths of its decodes (one new token each), ``prefills`` the
    (new tokens, cached tokens) of its chunks and prompts, which follow the decodes."""

    name: str
    kind: str  # "ragged", "uniform" or "mixed"
    decodes: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]
    params: dict
    quick: bool
    fp8: bool

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(query_len, context_len) per request, decodes first."""
        return [(1, L - 1) for L in self.decodes] + list(self.prefills)

    @property
    def seq_lens(self) -> list[int]:
        return [q + c for q, c in self.shapes]

    @property
    def decode_only(self) -> bool:
        return not self.prefills


def lognormal_lengths(rng: random.Random, n: int, median: float, sigma: float, floor: int, cap: int) -> list[int]:
    """``n`` lengths drawn from lognormal(ln median, sigma), rounded and clipped to [floor, cap]."""
    mu = math.log(median)
    return [min(cap, max(floor, int(round(rng.lognormvariate(mu, sigma))))) for _ in range(n)]


def _draw(name: str, seed: int, dist: dict, table: dict[str, dict]) -> list[int]:
    """The decode lengths of ``dist`` (one batch's parameters), from a generator seeded by (seed, batch name)."""
    rng = random.Random(f"{seed}/{name}")
    kind = dist["dist"]
    if kind == "lognormal":
        return lognormal_lengths(rng, dist["n"], dist["median"], dist["sigma"], dist["floor"], dist["cap"])
    if kind == "two_mode":
        lengths = [L for count, L in dist["modes"] for _ in range(count)]
        rng.shuffle(lengths)
        return lengths
    if kind == "uniform":
        return [dist["L"]] * dist["n"]
    if kind == "mean_of":
        source = dist["of"]
        mean = statistics.fmean(_draw(source, seed, table[source]["decodes"], table))
        return [int(round(mean))] * dist["n"]
    raise ValueError(f"unknown decode distribution {kind!r}")


def _prefills(name: str, seed: int, spec: Optional[dict]) -> list[tuple[int, int]]:
    if not spec:
        return []
    rng = random.Random(f"{seed}/{name}/prefills")
    if spec["kind"] == "chunks":
        return [(spec["q"], rng.randint(spec["ctx_lo"], spec["ctx_hi"])) for _ in range(spec["n"])]
    if spec["kind"] == "prompts":
        return [(rng.randint(spec["q_lo"], spec["q_hi"]), 0) for _ in range(spec["n"])]
    raise ValueError(f"unknown prefill kind {spec['kind']!r}")


def _lognormal(n, median, sigma=0.9, floor=16, cap=32768):
    return dict(dist="lognormal", n=n, median=median, sigma=sigma, floor=floor, cap=cap)


def _uniform(n, L):
    return dict(dist="uniform", n=n, L=L)


# name -> kind, decodes, prefills, in --quick, with fp8 rows. The batches (Llama-3-8B layer on an H100).
FULL_BATCHES: dict[str, dict] = {
    "lognormal_1500": dict(kind="ragged", decodes=_lognormal(128, 1500), quick=True, fp8=True),
    "lognormal_12k": dict(kind="ragged", decodes=_lognormal(32, 12000)),
    "two_mode": dict(kind="ragged", decodes=dict(dist="two_mode", modes=[[96, 600], [8, 24000]]), quick=True),
    "uniform_8192": dict(kind="uniform", decodes=_uniform(128, 8192), fp8=True),
    "uniform_lognormal_mean": dict(kind="uniform", decodes=dict(dist="mean_of", of="lognormal_1500", n=128),
                                   quick=True),
    "uniform_4096": dict(kind="uniform", decodes=_uniform(64, 4096), quick=True, fp8=True, quick_fp8=True),
    "b1_16384": dict(kind="uniform", decodes=_uniform(1, 16384), quick=True),
    "b4_32768": dict(kind="uniform", decodes=_uniform(4, 32768)),
    "mixed_chunks": dict(kind="mixed", decodes=_lognormal(96, 1500),
                         prefills=dict(kind="chunks", n=4, q=512, ctx_lo=1024, ctx_hi=8192), quick=True),
    "mixed_prompts": dict(kind="mixed", decodes=_lognormal(64, 1500),
                          prefills=dict(kind="prompts", n=32, q_lo=64, q_hi=512)),
}

# The same batches in miniature, for --cpu-smoke (same names, generators and structure; tiny lengths).
SMOKE_BATCHES: dict[str, dict] = {
    "lognormal_1500": dict(kind="ragged", decodes=_lognormal(6, 48, floor=2, cap=256), quick=True, fp8=True),
    "lognormal_12k": dict(kind="ragged", decodes=_lognormal(3, 160, floor=2, cap=320)),
    "two_mode": dict(kind="ragged", decodes=dict(dist="two_mode", modes=[[5, 20], [2, 200]]), quick=True),
    "uniform_8192": dict(kind="uniform", decodes=_uniform(4, 96), fp8=True),
    "uniform_lognormal_mean": dict(kind="uniform", decodes=dict(dist="mean_of", of="lognormal_1500", n=6),
                                   quick=True),
    "uniform_4096": dict(kind="uniform", decodes=_uniform(3, 64), quick=True, fp8=True, quick_fp8=True),
    "b1_16384": dict(kind="uniform", decodes=_uniform(1, 300), quick=True),
    "b4_32768": dict(kind="uniform", decodes=_uniform(4, 160)),
    "mixed_chunks": dict(kind="mixed", decodes=_lognormal(4, 48, floor=2, cap=256),
                         prefills=dict(kind="chunks", n=2, q=24, ctx_lo=30, ctx_hi=120), quick=True),
    "mixed_prompts": dict(kind="mixed", decodes=_lognormal(3, 48, floor=2, cap=256),
                          prefills=dict(kind="prompts", n=2, q_lo=8, q_hi=24)),
}


def batch_defs(seed: int = 0, smoke: bool = False, quick: bool = False,
               names: Optional[Sequence[str]] = None) -> list[BatchDef]:
    """The suite's batches (``smoke``: the miniature ones), seeded; ``quick``: the --quick subset (fp8 rows on
    ``uniform_4096`` alone); ``names``: only these (ValueError naming the allowed ones for another)."""
    table = SMOKE_BATCHES if smoke else FULL_BATCHES
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise ValueError(f"unknown batch {', '.join(unknown)}; allowed: {', '.join(table)}")
    out = []
    for name, d in table.items():
        if names and name not in names:
            continue
        if quick and not names and not d.get("quick"):
            continue
        decodes = tuple(_draw(name, seed, d["decodes"], table))
        prefills = tuple(_prefills(name, seed, d.get("prefills")))
        params = {"decodes": d["decodes"], **({"prefills": d["prefills"]} if d.get("prefills") else {}),
                  "seed": seed, "order": "decodes first" + (", shuffled" if d["decodes"]["dist"] == "two_mode" else "")}
        fp8 = bool(d.get("quick_fp8") if quick else d.get("fp8"))
        out.append(BatchDef(name, d["kind"], decodes, prefills, params, bool(d.get("quick")), fp8))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# One batch on one cache
# ---------------------------------------------------------------------------------------------------------------------

class Case:
    """A batch on a random cache of its own (pages in random order): the common metadata an engine hands the
    builders, the step's query / new keys / new values, and FlashInfer's plan inputs for any run of requests.

    ``source``: a Case whose page tables, query and new keys this one shares, its cache holding the source cache's
    values quantised to this one's fp8 dtype (stored = saturate(x / scale))."""

    def __init__(self, bdef: BatchDef, layer: Layer, device: torch.device, kv_cache_dtype: str = "auto",
                 seed: int = 0, source: Optional["Case"] = None):
        self.bdef, self.layer, self.device = bdef, layer, device
        self.spec = layer.spec(kv_cache_dtype)
        self.kv_scale = FP8_SCALE if self.spec.is_fp8_kv_cache else 1.0
        shapes = bdef.shapes
        self.num_reqs, self.num_decodes = len(shapes), len(bdef.decodes)
        self.q_lens = [q for q, _ in shapes]
        self.seq_lens = [q + c for q, c in shapes]
        page = layer.block_size
        self.pages = [-(-s // page) for s in self.seq_lens]
        self.num_blocks = sum(self.pages)
        backend = get_backend_class("reference")  # kv_cache_shape / allocate_kv_cache: the standard layout
        self.kv = backend.allocate_kv_cache(self.num_blocks, self.spec, device)
        if source is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
            self.tables, at = [], 0
            for n in self.pages:
                self.tables.append(perm[at:at + n])
                at += n
            self._fill_random(gen)
            T = sum(self.q_lens)
            self.query = torch.randn(T, layer.num_heads, layer.head_size, device=device, dtype=torch.bfloat16,
                                     generator=gen)
            self.new_k = torch.randn(T, layer.num_kv_heads, layer.head_size, device=device, dtype=torch.bfloat16,
                                     generator=gen)
            self.new_v = torch.randn(T, layer.num_kv_heads, layer.head_size, device=device, dtype=torch.bfloat16,
                                     generator=gen)
        else:
            self.tables, self.query, self.new_k, self.new_v = source.tables, source.query, source.new_k, source.new_v
            self._fill_from(source.kv)
        self.num_tokens = self.query.shape[0]
        self.common = build_common_metadata(self.q_lens, [c for _, c in shapes], self.tables, page, device)
        # FlashInfer's page table of the whole batch, built on the host from the same block tables
        self.kv_indptr = [0]
        for n in self.pages:
            self.kv_indptr.append(self.kv_indptr[-1] + n)
        self.qo_indptr = [0]
        for q in self.q_lens:
            self.qo_indptr.append(self.qo_indptr[-1] + q)
        self.kv_indices = torch.tensor([p for t in self.tables for p in t], dtype=torch.int32, device=device)
        self.last_page_len = [(s - 1) % page + 1 for s in self.seq_lens]
        el = self.kv.element_size()
        self.kv_bytes = sum(self.seq_lens) * layer.num_kv_heads * layer.head_size * 2 * el
        self.qo_bytes = 2 * self.num_tokens * layer.num_heads * layer.head_size * self.query.element_size()

    def _chunks(self):
        per_page = self.kv[0].numel()
        step = max(1, (64 << 20) // per_page)
        for lo in range(0, self.num_blocks, step):
            yield slice(lo, min(lo + step, self.num_blocks))

    def _fill_random(self, gen: torch.Generator) -> None:
        for s in self._chunks():  # in chunks: no float32 copy of a multi-GB cache
            x = torch.randn(self.kv[s].shape, device=self.device, dtype=torch.float32, generator=gen)
            self.kv[s].copy_(self._stored(x))

    def _fill_from(self, src: torch.Tensor) -> None:
        for s in self._chunks():
            self.kv[s].copy_(self._stored(src[s].float()))

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.is_fp8_kv_cache:
            limit = torch.finfo(self.kv.dtype).max
            return (x / self.kv_scale).clamp_(-limit, limit).to(self.kv.dtype)
        return x.to(self.kv.dtype)

    def plan_inputs(self, lo: int, hi: int) -> SimpleNamespace:
        """FlashInfer's plan inputs of requests lo..hi-1, as vLLM passes them: indptr / last-page lengths / sequence
        lengths on the host (pinned where there is a GPU), page ids on the device."""
        pin = self.device.type == "cuda"

        def host(values):
            t = torch.tensor(values, dtype=torch.int32)
            return t.pin_memory() if pin else t

        base_kv, base_q = self.kv_indptr[lo], self.qo_indptr[lo]
        return SimpleNamespace(
            qo_indptr=host([x - base_q for x in self.qo_indptr[lo:hi + 1]]),
            kv_indptr=host([x - base_kv for x in self.kv_indptr[lo:hi + 1]]),
            kv_indices=self.kv_indices[base_kv:self.kv_indptr[hi]],
            last_page_len=host(self.last_page_len[lo:hi]),
            seq_lens=host(self.seq_lens[lo:hi]),
            num_pages=self.kv_indptr[hi] - base_kv,
            tokens=slice(base_q, self.qo_indptr[hi]),
            num_reqs=hi - lo,
        )

    def fields(self) -> dict:
        """The batch's identifying row fields."""
        b = self.bdef
        return {"batch": b.name, "kind": b.kind, "B": self.num_reqs, "L": max(self.seq_lens),
                "L_mean": round(statistics.fmean(self.seq_lens), 1), "kv_tokens": sum(self.seq_lens),
                "num_decodes": self.num_decodes, "num_prefills": self.num_reqs - self.num_decodes,
                "num_tokens": self.num_tokens, "dtype": "bfloat16", "kv_dtype": self.spec.kv_cache_dtype,
                "params": b.params}

    def gbps(self, us: Optional[float]) -> Optional[float]:
        """Bytes moved (K+V of every request's tokens, the query and the output) per time, GB/s."""
        return round((self.kv_bytes + self.qo_bytes) / us / 1e3, 2) if us else None


# ---------------------------------------------------------------------------------------------------------------------
# Ours (and the adapter): a backend through the public API
# ---------------------------------------------------------------------------------------------------------------------

def construct_builder(builder_cls, spec: AttentionSpec, device, optional: dict, **kwargs):
    """``builder_cls(spec, device, **kwargs, **optional)``, dropping each ``optional`` keyword the builder does not
    take (a TypeError naming it); returns (builder, the optional keywords it took). A TypeError for a keyword of
    ``kwargs`` propagates (the caller decides what an unsupported option means)."""
    optional = dict(optional)
    while True:
        try:
            return builder_cls(spec, device, **kwargs, **optional), optional
        except TypeError as exc:
            refused = [k for k in optional if f"'{k}'" in str(exc)]
            if not refused:
                raise
            for k in refused:
                del optional[k]


class ApiRunner:
    """One backend as an engine drives it: a builder per model, ``build(common)`` once per step, ``impl.forward``
    per layer into a caller-owned output."""

    def __init__(self, backend_cls, case: Case, **builder_kw):
        self.case = case
        spec = case.spec
        optional = dict(num_blocks=case.num_blocks, max_model_len=max(32768, max(case.seq_lens)))
        self.builder, self.took = construct_builder(
            backend_cls.get_builder_cls(), spec, case.device, optional, max_num_reqs=max(256, case.num_reqs),
            max_num_tokens=max(8192, case.num_tokens), **builder_kw)
        self.impl = backend_cls.get_impl_cls()(spec, k_scale=case.kv_scale, v_scale=case.kv_scale)
        self.meta = self.builder.build(case.common)
        self.out = torch.full_like(case.query, float("nan"))

    def forward(self, with_kv: bool, meta=None, out: Optional[torch.Tensor] = None) -> Callable[[], Any]:
        c = self.case
        k, v = (c.new_k, c.new_v) if with_kv else (None, None)
        meta = self.meta if meta is None else meta
        out = self.out if out is None else out
        return lambda: self.impl.forward(c.query, k, v, c.kv, meta, out)

    def build(self) -> Callable[[], Any]:
        return lambda: self.builder.build(self.case.common)

    def schedule(self) -> Optional[str]:
        """The decode schedule the metadata records, where it records one."""
        for holder in (self.meta, getattr(self.meta, "plan", None)):
            value = getattr(holder, "decode_schedule", None)
            if value is not None:
                return str(value)[:80]
        return None


def schedule_runner(backend_cls, case: Case, value: str) -> tuple[Optional[ApiRunner], Optional[str]]:
    """Ours built with ``decode_schedule=value``; (None, why) where the builder has no such option or refuses the
    value."""
    try:
        return ApiRunner(backend_cls, case, decode_schedule=value), None
    except TypeError as exc:
        if "decode_schedule" in str(exc):
            return None, "the builder takes no decode_schedule option"
        raise
    except ValueError as exc:
        if "decode_schedule" in str(exc) or repr(value) in str(exc):
            return None, f"decode_schedule={value!r} refused: {exc}"[:300]
        raise


# ---------------------------------------------------------------------------------------------------------------------
# The peer: FlashInfer's own wrappers, as vLLM's FlashInfer backend drives them
# ---------------------------------------------------------------------------------------------------------------------

class WrapperPeer:
    """A decode wrapper (tensor cores) for the leading decodes and a causal prefill wrapper for the chunks and
    prompts after them, on their own workspaces, planned together once per step (:meth:`plan`) and run over the
    case's cache (:meth:`run`). ``graph``: the decode wrapper in CUDA-graph mode, on page-table buffers of its own
    (decode-only batches)."""

    def __init__(self, fi, case: Case, graph: bool = False):
        self.case = case
        dev = case.device
        layer = case.layer
        self.dims = (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.block_size)
        self.kv_data_type = case.kv.dtype
        self.run_kw = dict(k_scale=case.kv_scale, v_scale=case.kv_scale) if case.spec.is_fp8_kv_cache else {}
        self.out = torch.full_like(case.query, float("nan"))
        nd, n = case.num_decodes, case.num_reqs
        self.decode = self.prefill = None
        self._dropped: set[str] = set()
        self.d_in = case.plan_inputs(0, nd) if nd else None
        self.p_in = case.plan_inputs(nd, n) if n > nd else None

        def workspace():
            return torch.zeros(WORKSPACE_BYTES if dev.type == "cuda" else 1 << 10, dtype=torch.uint8, device=dev)

        if self.d_in is not None:
            if graph:
                self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
                    workspace(), "NHD", use_cuda_graph=True, use_tensor_cores=True,
                    paged_kv_indptr_buffer=torch.zeros(nd + 1, dtype=torch.int32, device=dev),
                    paged_kv_indices_buffer=torch.zeros(self.d_in.num_pages, dtype=torch.int32, device=dev),
                    paged_kv_last_page_len_buffer=torch.zeros(nd, dtype=torch.int32, device=dev))
            else:
                self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
        if self.p_in is not None:
            if graph:
                raise ValueError("CUDA-graph peers are for decode-only batches")
            self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")

    #: plan() keywords a FlashInfer version may not know: dropped (once, remembered) where plan() refuses them
    OPTIONAL_PLAN_KW = ("seq_lens", "o_data_type")

    def plan(self) -> None:
        hq, hkv, d, page = self.dims
        kw = dict(pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=self.kv_data_type,
                  o_data_type=torch.bfloat16, sm_scale=1.0 / math.sqrt(d), non_blocking=True)
        if self.decode is not None:
            p = self.d_in
            self._plan(self.decode, (p.kv_indptr, p.kv_indices, p.last_page_len, hq, hkv, d, page),
                       dict(kw, seq_lens=p.seq_lens))
        if self.prefill is not None:
            p = self.p_in
            self._plan(self.prefill, (p.qo_indptr, p.kv_indptr, p.kv_indices, p.last_page_len, hq, hkv, d, page),
                       dict(kw, causal=True, seq_lens=p.seq_lens))

    def _plan(self, wrapper, args: tuple, kw: dict) -> None:
        kw = {k: v for k, v in kw.items() if k not in self._dropped}
        while True:
            try:
                return wrapper.plan(*args, **kw)
            except TypeError as exc:
                refused = [k for k in self.OPTIONAL_PLAN_KW if k in kw and f"'{k}'" in str(exc)]
                if not refused:
                    raise
                for k in refused:
                    del kw[k]
                self._dropped.update(refused)

    def run(self) -> None:
        c = self.case
        if self.decode is not None:
            t = self.d_in.tokens
            self.decode.run(c.query[t], c.kv, out=self.out[t], **self.run_kw)
        if self.prefill is not None:
            t = self.p_in.tokens
            self.prefill.run(c.query[t], c.kv, out=self.out[t], **self.run_kw)


# ---------------------------------------------------------------------------------------------------------------------
# The CPU stand-in for FlashInfer's wrappers (--cpu-smoke)
# ---------------------------------------------------------------------------------------------------------------------

def _check_int32(name: str, t: torch.Tensor, length: Optional[int] = None, device: Optional[str] = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 tensor, got {t!r}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} has {t.numel()} entries, expected {length}")
    if device is not None and t.device.type != device:
        raise ValueError(f"{name} must be on {device}, is on {t.device}")


class _TorchPagedBase:
    """Shared by the stand-ins: FlashInfer's constructor, the page-table checks, attention per request in float32
    from the NHD paged cache ([pages, 2, page, kv heads, head]: K at [:, 0], V at [:, 1])."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, **buffers: Any):
        if kv_layout != "NHD":
            raise ValueError(f"the stand-in serves NHD only, got {kv_layout!r}")
        if use_cuda_graph and not buffers:
            raise ValueError("use_cuda_graph needs the page-table buffers")
        self.device = float_workspace_buffer.device
        self.plan_args: Optional[dict] = None

    def _plan_pages(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                    q_data_type, kv_data_type, o_data_type, sm_scale, seq_lens) -> None:
        B = last_page_len.numel()
        _check_int32("indptr", indptr, B + 1, "cpu")
        _check_int32("last_page_len", last_page_len, B, "cpu")
        _check_int32("indices", indices, int(indptr[-1]), self.device.type)
        ptr = indptr.tolist()
        if ptr[0] != 0 or any(b < a + 1 for a, b in zip(ptr, ptr[1:])):
            raise ValueError(f"indptr must start at 0 and grow by >= 1 page per request, got {ptr}")
        last = last_page_len.tolist()
        if not all(1 <= x <= page_size for x in last):
            raise ValueError(f"last_page_len must be in [1, {page_size}], got {last}")
        kv_lens = [(b - a - 1) * page_size + x for a, b, x in zip(ptr, ptr[1:], last)]
        if seq_lens is not None and seq_lens.tolist() != kv_lens:
            raise ValueError(f"seq_lens {seq_lens.tolist()} disagree with the page table's lengths {kv_lens}")
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        self.plan_args = dict(ptr=ptr, indices=indices.tolist(), kv_lens=kv_lens, hq=num_qo_heads, hkv=num_kv_heads,
                              d=head_dim, page=page_size, q_dtype=q_data_type, kv_dtype=kv_data_type or q_data_type,
                              o_dtype=o_data_type or q_data_type, scale=sm_scale or 1.0 / math.sqrt(head_dim))

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, qo_ptr: list[int], causal: bool,
                out: Optional[torch.Tensor], k_scale, v_scale) -> torch.Tensor:
        a = self.plan_args
        if a is None:
            raise RuntimeError("run() before plan()")
        if q.dtype != a["q_dtype"] or kv_cache.dtype != a["kv_dtype"]:
            raise TypeError(f"q {q.dtype} / cache {kv_cache.dtype} differ from the planned {a['q_dtype']} / "
                            f"{a['kv_dtype']}")
        if tuple(kv_cache.shape[1:]) != (2, a["page"], a["hkv"], a["d"]):
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [pages, 2, {a['page']}, {a['hkv']}, {a['d']}]")
        if q.shape != (qo_ptr[-1], a["hq"], a["d"]):
            raise ValueError(f"q {tuple(q.shape)} is not [{qo_ptr[-1]}, {a['hq']}, {a['d']}]")
        if out is None:
            out = torch.empty(q.shape, dtype=a["o_dtype"], device=q.device)
        if out.shape != q.shape or out.dtype != a["o_dtype"]:
            raise ValueError("out must have q's shape and the planned output dtype")
        group = a["hq"] // a["hkv"]
        for i in range(len(a["kv_lens"])):
            pages = torch.tensor(a["indices"][a["ptr"][i]:a["ptr"][i + 1]], dtype=torch.long, device=kv_cache.device)
            n = a["kv_lens"][i]
            k = kv_cache[pages, 0].reshape(-1, a["hkv"], a["d"])[:n].float() * (k_scale or 1.0)
            v = kv_cache[pages, 1].reshape(-1, a["hkv"], a["d"])[:n].float() * (v_scale or 1.0)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            qi = q[qo_ptr[i]:qo_ptr[i + 1]].float()  # [m, hq, d]
            m = qi.shape[0]
            s = torch.einsum("mhd,nhd->hmn", qi, k) * a["scale"]
            if causal:
                pos = torch.arange(n - m, n, device=q.device)[:, None]  # query j sits at position n - m + j
                s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, float("-inf"))
            out[qo_ptr[i]:qo_ptr[i + 1]] = torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).to(out.dtype)
        return out


class _TorchDecodeWrapper(_TorchPagedBase):
    """``flashinfer.BatchDecodeWithPagedKVCacheWrapper``'s signatures; optional plan arguments keyword-only."""

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        if pos_encoding_mode != "NONE" or window_left != -1 or logits_soft_cap:
            raise NotImplementedError("the stand-in serves plain attention only")
        self._plan_pages(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                         q_data_type, kv_data_type, o_data_type, sm_scale, seq_lens)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        if args or return_lse or lse is not None:
            raise NotImplementedError("the stand-in takes no positional extras and returns no LSE")
        return self._attend(q, paged_kv_cache, list(range(q.shape[0] + 1)), False, out, k_scale, v_scale)


class _TorchPrefillWrapper(_TorchPagedBase):
    """``flashinfer.BatchPrefillWithPagedKVCacheWrapper``'s signatures; optional plan arguments keyword-only."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, seq_lens=None, seq_lens_q=None, block_tables=None):
        if custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode != "NONE" \
                or window_left != -1 or logits_soft_cap:
            raise NotImplementedError("the stand-in serves plain causal attention only")
        B = paged_kv_last_page_len.numel()
        _check_int32("qo_indptr", qo_indptr, B + 1, "cpu")
        self._plan_pages(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                         head_dim_qk, page_size, q_data_type, kv_data_type, o_data_type, sm_scale, seq_lens)
        qo = qo_indptr.tolist()
        if any(b - a > n for a, b, n in zip(qo, qo[1:], self.plan_args["kv_lens"])):
            raise ValueError("a request has more queries than keys")
        self.plan_args.update(qo=qo, causal=causal)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None):
        if args or return_lse or lse is not None:
            raise NotImplementedError("the stand-in takes no positional extras and returns no LSE")
        a = self.plan_args or {}
        return self._attend(q, paged_kv_cache, a.get("qo", [0]), a.get("causal", False), out, k_scale, v_scale)


def torch_paged_wrappers() -> SimpleNamespace:
    """A stand-in for the ``flashinfer`` module (its two paged wrappers) that computes in torch on any device: what
    --cpu-smoke drives where FlashInfer cannot run, checking the page tables and arguments it is handed."""
    return SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_TorchDecodeWrapper,
                           BatchPrefillWithPagedKVCacheWrapper=_TorchPrefillWrapper, __version__="torch-stand-in")


# ---------------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------------

class Timer:
    """do_bench medians, CUDA-graph capture and host CPU time on the GPU; wall-clock stand-ins on the CPU."""

    def __init__(self, device: torch.device, quick: bool):
        self.cuda = device.type == "cuda"
        self.device = device
        self.warmup, self.rep = (10, 50) if quick else (25, 100)
        self.host_iters, self.host_rounds = (8, 3) if quick else (10, 5)
        if not self.cuda:
            self.host_iters, self.host_rounds = 1, 1

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def bench(self, fn: Callable[[], Any]) -> float:
        """Median time per call in us."""
        if self.cuda:
            import triton.testing

            return triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median") * 1e3
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def capture(self, fn: Callable[[], Any]) -> "torch.cuda.CUDAGraph":
        """``fn`` captured in a CUDA graph (run twice on a side stream first: compiles, validations, lazy state)."""
        if not self.cuda:
            raise RuntimeError("CUDA graphs need a GPU")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        self.sync()
        return graph

    def host_us(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Per function, the median thread CPU time of one call with the GPU drained before it, the functions' calls
        interleaved round by round (a noisy stretch of the host falls on all of them)."""
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(self.host_rounds):
            for name, fn in fns.items():
                for _ in range(self.host_iters):
                    self.sync()
                    t0 = time.thread_time_ns()
                    fn()
                    times[name].append((time.thread_time_ns() - t0) / 1e3)
        self.sync()
        return {k: round(statistics.median(v), 2) for k, v in times.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def diff_fields(d: Optional[float]) -> dict:
    """``max_abs_diff`` against the peer (None: not compared, or not finite) and ``diff_ok`` (<= DIFF_LIMIT);
    non-finite outputs flag the row."""
    if d is None:
        return {"max_abs_diff": None}
    if not math.isfinite(d):
        return {"max_abs_diff": None, "diff_ok": False, "diff_note": "non-finite output (NaN or inf)"}
    return {"max_abs_diff": round(d, 6), "diff_ok": d <= DIFF_LIMIT}


def _info_diff(d: float) -> Optional[float]:
    """A difference recorded for information (not judged): None where not finite."""
    return round(d, 6) if math.isfinite(d) else None


def _step(with_kv: bool) -> str:
    """The call timed (shown in the results tables' step column): an engine's, or the attention alone."""
    return "forward(q, k, v)" if with_kv else "forward(q, None, None)"


def _r(x: Optional[float]) -> Optional[float]:
    return round(x, 2) if x is not None else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return float(f"{a / b:.4g}") if a is not None and b else None  # four significant digits


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


# ---------------------------------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Context:
    device: torch.device
    layer: Layer
    timer: Timer
    ours: Any  # backend class
    ours_label: str  # "triton" (the reference backend where --cpu-smoke cannot run Triton)
    adapter: Any  # backend class or None
    adapter_label: str
    fi: Any  # the flashinfer module (or its stand-in) or None
    fi_error: Optional[str]
    graphs: bool
    variant_graphs: bool  # graph rows for the decode_schedule variants too
    seed: int
    emit: Callable[[dict], None]
    roof_GBps: Optional[float] = None
    failures: int = 0


def copy_roof(ctx: Context) -> None:
    """The device-to-device copy bandwidth of this GPU, bytes read + written per time: the decode roof."""
    nbytes = COPY_ROOF_BYTES if ctx.timer.cuda else 8 << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    us = ctx.timer.bench(lambda: dst.copy_(src))
    del src, dst
    ctx.roof_GBps = round(2 * nbytes / us / 1e3, 1)
    ctx.emit({"case": "copy_roof", "backend": "torch_copy", "peer": None, "B": None, "L": None, "dtype": "uint8",
              "kv_dtype": "auto", "us": _r(us), "peer_us": None, "ratio": None, "GBps": ctx.roof_GBps,
              "bytes": 2 * nbytes, "what": "torch.Tensor.copy_ device to device, bytes read + written / time"})


def _row(case: Case, backend: str, mode: str, with_kv: bool, us: Optional[float], peer_us: Optional[float],
         diff: Optional[float], **extra) -> dict:
    row = {"case": "decode_ragged", "backend": backend, "peer": PEER, **case.fields(), "mode": mode,
           "kv_in_forward": with_kv, "step": _step(with_kv), "us": _r(us), "peer_us": _r(peer_us),
           "ratio": _ratio(us, peer_us),
           "GBps": case.gbps(us), "peer_GBps": case.gbps(peer_us), **diff_fields(diff)}
    if with_kv and peer_us is not None:
        row["peer_includes_kv_write"] = False
    row.update(extra)
    return row


def _api_rows(ctx: Context, case: Case, runner: ApiRunner, backend: str, peer: Optional[dict],
              graph: bool, **extra) -> dict:
    """Eager rows (with the step's K/V, then attention alone) and, for a decode-only batch, graph rows of one API
    runner; returns the times (for the roof and fp8 rows)."""
    timer = ctx.timer
    ref = peer["out"] if peer else None
    times: dict[str, Optional[float]] = {}
    for with_kv in (True, False):
        fn = runner.forward(with_kv)
        runner.out.fill_(float("nan"))
        fn()
        timer.sync()
        d = max_abs_diff(runner.out, ref) if ref is not None else None
        us = timer.bench(fn)
        times[f"eager_{with_kv}"] = us
        ctx.emit(_row(case, backend, "eager", with_kv, us, peer["eager_us"] if peer else None, d, **extra))
    if graph and case.bdef.decode_only and timer.cuda:
        for with_kv in (True, False) if backend == ctx.ours_label else (True,):
            key = f"graph_{with_kv}"
            g = None
            try:
                meta = runner.builder.build_for_cudagraph_capture(case.common)
                out = torch.full_like(case.query, float("nan"))
                g = timer.capture(runner.forward(with_kv, meta, out))
                out.fill_(float("nan"))
                g.replay()
                timer.sync()
                d = max_abs_diff(out, ref) if ref is not None else None
                us = timer.bench(g.replay)
                times[key] = us
                ctx.emit(_row(case, backend, "graph", with_kv, us, peer.get("graph_us") if peer else None, d,
                              **_peer_graph_fields(peer), **extra))
            except Exception as exc:  # a capture that fails is a row, not the end of the suite
                times[key] = None
                _recover(timer)
                ctx.emit(_row(case, backend, "graph", with_kv, None, peer.get("graph_us") if peer else None, None,
                              error=_err(exc), **_peer_graph_fields(peer), **extra))
            finally:
                del g
    return times


def _peer_graph_fields(peer: Optional[dict]) -> dict:
    """The peer's graph replay against its own eager run, or why it has no graph time."""
    if not peer:
        return {}
    if peer.get("graph_error"):
        return {"peer_error": peer["graph_error"]}
    d = peer.get("graph_diff")
    return {"peer_graph_vs_eager_diff": _info_diff(d)} if d is not None else {}


def _recover(timer: Timer) -> None:
    try:
        timer.sync()
    except Exception:  # the error already went into the row; a sticky one will fail the next batch's rows too
        pass


def _peer(ctx: Context, case: Case) -> Optional[dict]:
    """FlashInfer's wrappers on the case (whose cache already holds the step's keys): planned, run, timed eager and
    (decode-only) from a CUDA graph; None without FlashInfer."""
    if ctx.fi is None:
        return None
    timer = ctx.timer
    peer = WrapperPeer(ctx.fi, case)
    peer.plan()
    peer.run()
    timer.sync()
    res = {"wrapper": peer, "out": peer.out, "eager_us": timer.bench(peer.run)}
    if ctx.graphs and case.bdef.decode_only and timer.cuda:
        g = None
        try:
            gp = WrapperPeer(ctx.fi, case, graph=True)
            gp.plan()
            g = timer.capture(gp.run)
            gp.out.fill_(float("nan"))
            g.replay()
            timer.sync()
            res["graph_diff"] = max_abs_diff(gp.out, peer.out)
            res["graph_us"] = timer.bench(g.replay)
        except Exception as exc:
            _recover(timer)
            res["graph_error"] = _err(exc)
            res["graph_us"] = None
        finally:
            del g
    return res


def run_batch(ctx: Context, bdef: BatchDef) -> None:
    timer = ctx.timer
    case = Case(bdef, ctx.layer, ctx.device, seed=ctx.seed)
    ours = ApiRunner(ctx.ours, case)
    print(f"[{bdef.name}] {case.num_reqs} requests ({case.num_decodes} decodes), {sum(case.seq_lens)} KV tokens, "
          f"longest {max(case.seq_lens)}, {case.num_blocks} pages; builder took {sorted(ours.took)}", flush=True)
    ours.forward(True)()  # the step's keys into the cache: the peers read them from there
    timer.sync()
    peer = None
    try:
        peer = _peer(ctx, case)
    except Exception as exc:
        _recover(timer)
        print(f"[{bdef.name}] FlashInfer wrappers failed: {_err(exc)}", flush=True)
        ctx.emit({"case": "decode_ragged", "backend": ctx.ours_label, "peer": PEER, **case.fields(), "mode": "eager",
                  "us": None, "peer_us": None, "ratio": None, "peer_error": _err(exc)})
    graph = ctx.graphs
    extra = {"schedule": ours.schedule()} if ours.schedule() else {}
    if ctx.fi is None and ctx.fi_error:
        extra["peer_error"] = ctx.fi_error  # no FlashInfer here: the rows say why they have no peer
    times = _api_rows(ctx, case, ours, ctx.ours_label, peer, graph, **extra)

    for value in SCHEDULES:
        try:
            runner, why = schedule_runner(ctx.ours, case, value)
            if runner is None:
                print(f"[{bdef.name}] decode_schedule={value}: {why}", flush=True)
                continue
            _api_rows(ctx, case, runner, f"{ctx.ours_label}_{value}", peer, graph and ctx.variant_graphs,
                      schedule=runner.schedule() or value)
        except Exception as exc:
            _recover(timer)
            ctx.emit(_row(case, f"{ctx.ours_label}_{value}", "eager", True, None, None, None, error=_err(exc)))

    adapter_ok = False
    if ctx.adapter is not None:
        try:
            _api_rows(ctx, case, ApiRunner(ctx.adapter, case), ctx.adapter_label, peer, graph)
            adapter_ok = True
        except Exception as exc:
            _recover(timer)
            ctx.emit(_row(case, ctx.adapter_label, "eager", True, None, None, None, error=_err(exc)))

    # Host times last, on builders of their own that never planned a CUDA graph (the adapter's next build() after a
    # capture re-plans the captured wrapper): an eager engine step's build() and forward(q, k, v).
    try:
        fresh = ApiRunner(ctx.ours, case)
        fns = {"build": fresh.build(), "forward": fresh.forward(True)}
        if peer:
            fns.update(plan=peer["wrapper"].plan, run=peer["wrapper"].run)
        if adapter_ok:
            fresh_adapter = ApiRunner(ctx.adapter, case)
            fns.update(adapter_build=fresh_adapter.build(), adapter_forward=fresh_adapter.forward(True))
        host = timer.host_us(fns)
        ctx.emit({"case": "decode_host", "backend": ctx.ours_label, "peer": PEER, **case.fields(),
                  "step": "build + forward(q, k, v)", "us": _r(host["build"] + host["forward"]),
                  "peer_us": _r(host["plan"] + host["run"]) if peer else None,
                  "ratio": _ratio(host["build"] + host["forward"], host["plan"] + host["run"]) if peer else None,
                  "build_host_us": host["build"], "forward_host_us": host["forward"],
                  "peer_plan_host_us": host.get("plan"), "peer_run_host_us": host.get("run"),
                  "adapter_build_host_us": host.get("adapter_build"),
                  "adapter_forward_host_us": host.get("adapter_forward"),
                  "what": "thread CPU time per call, GPU idle: us = build() + forward(q, k, v); peer_us = plan() + "
                          "run()"})
    except Exception as exc:
        _recover(timer)
        ctx.emit({"case": "decode_host", "backend": ctx.ours_label, "peer": PEER, **case.fields(), "us": None,
                  "peer_us": None, "ratio": None, "error": _err(exc)})

    if bdef.decode_only:
        roof_row(ctx, case, times, peer)
    if bdef.fp8:
        fp8_rows(ctx, case, times, ours.out.clone())
    del ours, peer, case
    if timer.cuda:
        torch.cuda.empty_cache()


def roof_row(ctx: Context, case: Case, times: dict, peer: Optional[dict]) -> None:
    us = times.get("eager_True")
    roof = ctx.roof_GBps
    gbps = case.gbps(us)
    at_roof = (case.kv_bytes + case.qo_bytes) / roof / 1e3 if roof else None
    ctx.emit({"case": "decode_roof", "backend": ctx.ours_label, "peer": "copy_roof", **case.fields(),
              "mode": "eager",
              "kv_in_forward": True, "step": _step(True), "us": _r(us), "peer_us": _r(at_roof),
              "ratio": _ratio(us, at_roof),
              "GBps": gbps, "roof_GBps": roof,
              "fraction_of_roof": round(gbps / roof, 3) if gbps is not None and roof else None,
              "attention_only_GBps": case.gbps(times.get("eager_False")),
              "graph_GBps": case.gbps(times.get("graph_True")),
              "attention_only_graph_GBps": case.gbps(times.get("graph_False")),
              "peer_GBps": case.gbps(peer["eager_us"]) if peer else None,
              "peer_graph_GBps": case.gbps(peer.get("graph_us")) if peer else None,
              "bytes": case.kv_bytes + case.qo_bytes})


def fp8_rows(ctx: Context, bf16: Case, bf16_times: dict, bf16_out: torch.Tensor) -> None:
    """Ours on fp8 e4m3 pages holding the bf16 cache's values vs ours on the bf16 pages; FlashInfer fp8 beside."""
    timer = ctx.timer
    try:
        case = Case(bf16.bdef, ctx.layer, ctx.device, "fp8_e4m3", seed=ctx.seed, source=bf16)
        ours = ApiRunner(ctx.ours, case)
        ours.forward(True)()
        timer.sync()
    except Exception as exc:
        _recover(timer)
        ctx.emit({"case": "decode_fp8", "backend": ctx.ours_label, "peer": f"{ctx.ours_label}_bf16",
                  **bf16.fields(),
                  "kv_dtype": "fp8_e4m3", "us": None, "peer_us": None, "ratio": None, "error": _err(exc)})
        return
    fi_us = fi_out = fi_err = None
    if ctx.fi is not None:
        try:  # FlashInfer's decode on fp8 pages, where its wrapper takes them
            p = WrapperPeer(ctx.fi, case)
            p.plan()
            p.run()
            timer.sync()
            fi_out, fi_us = p.out, timer.bench(p.run)
        except Exception as exc:
            _recover(timer)
            fi_err = _err(exc)
    times = {}
    for with_kv in (True, False):
        fn = ours.forward(with_kv)
        ours.out.fill_(float("nan"))
        fn()
        timer.sync()
        us = timer.bench(fn)
        times[f"eager_{with_kv}"] = us
        base = bf16_times.get(f"eager_{with_kv}")
        ctx.emit({"case": "decode_fp8", "backend": ctx.ours_label, "peer": f"{ctx.ours_label}_bf16",
                  **case.fields(), "mode": "eager",
                  "kv_in_forward": with_kv, "step": _step(with_kv), "us": _r(us), "peer_us": _r(base),
                  "ratio": _ratio(us, base),
                  "GBps": case.gbps(us), "peer_GBps": bf16.gbps(base), "kv_scale": case.kv_scale,
                  "flashinfer_fp8_us": _r(fi_us), "ratio_vs_flashinfer_fp8": _ratio(us, fi_us),
                  **({"flashinfer_fp8_error": fi_err} if fi_err else {}),
                  **diff_fields(max_abs_diff(ours.out, fi_out) if fi_out is not None else None),
                  "max_abs_diff_vs_bf16": _info_diff(max_abs_diff(ours.out, bf16_out))})
    roof_row(ctx, case, times, {"eager_us": fi_us} if fi_us else None)
    del ours, case


def _load_flashinfer() -> tuple[Any, Optional[str]]:
    try:
        import flashinfer
    except Exception as exc:  # not installed, or its import fails here: the rows say so
        return None, _err(exc)
    needed = ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper")
    missing = [n for n in needed if not hasattr(flashinfer, n)]
    return (None, f"flashinfer lacks {missing}") if missing else (flashinfer, None)


def _summary(rows: list[dict]) -> str:
    lines = [f"{'case':<14}{'batch':<24}{'backend':<22}{'mode':<6}{'kv':>3}{'us':>10}{'peer_us':>10}{'ratio':>8}"
             f"{'GB/s':>8}{'diff':>10}"]
    for r in rows:
        if r.get("case") not in ("decode_ragged", "decode_roof", "decode_fp8"):
            continue
        kv = "k" if r.get("kv_in_forward") else "-"
        d = r.get("max_abs_diff")
        flag = "" if r.get("diff_ok", True) else " !"
        lines.append(f"{r['case']:<14}{r.get('batch', ''):<24}{r['backend']:<22}{r.get('mode', ''):<6}{kv:>3}"
                     f"{_s(r.get('us')):>10}{_s(r.get('peer_us')):>10}{_s(r.get('ratio')):>8}{_s(r.get('GBps')):>8}"
                     f"{_s(d):>10}{flag}" + (f"  error: {r['error'][:80]}" if r.get("error") else ""))
    return "\n".join(lines)


def _s(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def main(argv: Optional[Sequence[str]] = None, *, ours_backend=None, flashinfer_module=None) -> int:
    """Run the suite; ``ours_backend`` / ``flashinfer_module`` replace ours / the peer (tests)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="JSON rows to write (PERF.md format)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer batches (the --quick ones: " + ", ".join(k for k, v in FULL_BATCHES.items()
                                                                        if v.get("quick")) + "), fp8 on uniform_4096 "
                    "only, no graph rows for the schedule variants, shorter do_bench")
    ap.add_argument("--batches", nargs="+", default=None, metavar="NAME",
                    help="only these batches (of " + ", ".join(FULL_BATCHES) + ")")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph rows")
    ap.add_argument("--no-adapter", action="store_true", help="skip our FlashInfer adapter's rows")
    ap.add_argument("--cpu-smoke", "--dry-run", dest="cpu_smoke", action="store_true",
                    help="no GPU: the miniature batches, ours interpreted (or the reference backend), a torch "
                         "stand-in for FlashInfer's wrappers")
    args = ap.parse_args(argv)

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("the decode suite needs a CUDA GPU (use --cpu-smoke for a check of its code on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    layer = SMOKE_LAYER if smoke else LLAMA3_8B
    try:
        bdefs = batch_defs(args.seed, smoke=smoke, quick=args.quick, names=args.batches)
    except ValueError as exc:
        ap.error(str(exc))
    info = DeviceInfo.current(device)
    spec = layer.spec()
    ours = ours_backend or get_backend_class("triton")
    if smoke and ours_backend is None and ours.not_supported_reasons(spec, info):
        print(f"triton does not run here ({'; '.join(ours.not_supported_reasons(spec, info))}): ours is the "
              "reference backend", flush=True)
        ours = get_backend_class("reference")
    else:
        reasons = ours.not_supported_reasons(spec, info)
        if reasons:
            print(f"{ours.name} cannot run here: {'; '.join(reasons)}", file=sys.stderr)
            return 1
    if flashinfer_module is not None:
        fi, fi_error = flashinfer_module, None
    elif smoke:
        fi, fi_error = torch_paged_wrappers(), None
    else:
        fi, fi_error = _load_flashinfer()
        if fi is None:
            print(f"FlashInfer unavailable ({fi_error}): rows without the peer", flush=True)
    adapter, adapter_label = None, "flashinfer_adapter"
    if not args.no_adapter:
        if smoke:  # the adapter's code path, on the backend that runs here (its rows say which)
            adapter, adapter_label = get_backend_class("reference"), "reference_as_adapter"
        else:
            cls = get_backend_class("flashinfer")
            reasons = cls.not_supported_reasons(spec, info)
            if reasons:
                print(f"adapter rows skipped: {'; '.join(reasons)}", flush=True)
            else:
                adapter = cls

    rows: list[dict] = []
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "suite": "decode",
                                            "command": " ".join(sys.argv), "smoke": smoke,
                                            "flashinfer": getattr(fi, "__version__", None) if fi else None,
                                            "rows": rows}, indent=1, default=str) + "\n")

    timer = Timer(device, args.quick)
    ctx = Context(device=device, layer=layer, timer=timer, ours=ours, ours_label=ours.name, adapter=adapter,
                  adapter_label=adapter_label,
                  fi=fi, fi_error=fi_error, graphs=not args.no_graphs and not smoke, variant_graphs=not args.quick,
                  seed=args.seed, emit=emit)
    print(f"{gpu}: ours {ours.name}, peer {getattr(fi, '__version__', 'flashinfer') if fi else 'none'}, "
          f"{len(bdefs)} batches: {', '.join(b.name for b in bdefs)}", flush=True)
    t0 = time.perf_counter()
    copy_roof(ctx)
    for bdef in bdefs:
        t = time.perf_counter()
        try:
            run_batch(ctx, bdef)
        except Exception as exc:  # one broken batch must not cost the others' rows
            _recover(timer)
            ctx.failures += 1
            traceback.print_exc()
            emit({"case": "decode_ragged", "backend": ctx.ours_label, "peer": PEER, "batch": bdef.name,
                  "B": len(bdef.shapes), "L": max(bdef.seq_lens), "us": None, "peer_us": None, "ratio": None,
                  "error": _err(exc)})
        if timer.cuda:
            torch.cuda.empty_cache()
        print(f"[{bdef.name}] {time.perf_counter() - t:.1f} s", flush=True)
    print(_summary(rows))
    flagged = [r for r in rows if r.get("diff_ok") is False]
    for r in flagged:
        print(f"WARNING: {r['case']} {r.get('batch')} {r['backend']} {r.get('mode')}: outputs differ from the "
              f"peer's by {r.get('max_abs_diff')} (limit {DIFF_LIMIT})", flush=True)
    print(f"decode suite: {len(rows)} rows in {time.perf_counter() - t0:.0f} s; {ctx.failures} batches failed, "
          f"{len(flagged)} rows flagged", flush=True)
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())
