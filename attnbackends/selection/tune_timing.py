"""`attnbackends tune`: time every fitting backend and phase composition for a spec on this GPU, store the profile.

Each candidate gets one builder and one impl. For every shape of the grid a whole engine step is timed as an engine
runs it: ``build()`` on a fresh copy of the step's metadata, then ``layers_per_step`` calls of ``forward`` (each
writes the step's new keys and values into the cache, then attends: a backend that reads new tokens straight from
``key``/``value`` gains by it). A candidate's time on a shape is that step's time divided by ``layers_per_step``:
its per-layer cost with the build shared out, so a composition pays for its second build and a backend whose
``plan()`` is slow pays for it, as they do in a served model. Timing is ``triton.testing.do_bench`` (median, on
CUDA) or a wall-clock loop (on the CPU, for smoke runs). The first call of each (candidate, shape) is timed apart and
logged: that is where kernels compile. Every (candidate, shape) is timed in ``rounds`` rounds, each round going over
all of them in a rotated order, and keeps its fastest round: steps of few tokens are host-bound, and a host's speed
drifts over seconds, so one pass would rank candidates by when they were timed.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..interface import AttentionBackend, AttentionImplBase
from ..metadata import CommonAttentionMetadata, build_common_metadata
from ..platform import DeviceInfo
from ..spec import AttentionSpec
from .phased import phased_name
from .registry import backend_names, environment_facts, get_backend_class, priority_list
from .tuning import Profile, environment_key

__all__ = ["GRIDS", "LAYERS_PER_STEP", "TUNE_ROUNDS", "TuneShape", "TimingBatch", "run_tune", "time_us", "timing_batch",
           "timing_impl", "tune_candidates"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneShape:
    """``num_decodes`` decodes at ``decode_context`` cached tokens, then ``num_prefills`` requests of
    ``prefill_len`` new tokens after ``prefill_context`` cached ones."""

    phase: str
    num_decodes: int = 0
    decode_context: int = 0
    num_prefills: int = 0
    prefill_len: int = 0
    prefill_context: int = 0

    @property
    def label(self) -> str:
        parts = []
        if self.num_decodes:
            parts.append(f"{self.num_decodes}x1@{self.decode_context}")
        if self.num_prefills:
            context = f"@{self.prefill_context}" if self.prefill_context else ""
            parts.append(f"{self.num_prefills}x{self.prefill_len}{context}")
        return f"{self.phase}:" + "+".join(parts)

    def as_dict(self) -> dict:
        return {"label": self.label, "phase": self.phase, "num_decodes": self.num_decodes,
                "decode_context": self.decode_context, "num_prefills": self.num_prefills,
                "prefill_len": self.prefill_len, "prefill_context": self.prefill_context}


#: Layers sharing one ``build()`` in a timed step (the layer count of a 7-8B model's attention).
LAYERS_PER_STEP = 32
#: Rounds over every (candidate, shape) in a tune; each keeps its fastest round.
TUNE_ROUNDS = 3

#: The shapes a profile is measured on: decode-only and prefill-only steps, and the mixed steps of serving traffic
#: (decodes beside prompt chunks on cached context: a chat turn's short chunk on a long conversation, a long
#: document's chunk, a few new prompts in a decode-heavy stream).
GRIDS: dict[str, tuple[TuneShape, ...]] = {
    "small": (
        TuneShape("decode", num_decodes=1, decode_context=4096),
        TuneShape("decode", num_decodes=64, decode_context=2048),
        TuneShape("decode", num_decodes=128, decode_context=4096),
        TuneShape("prefill", num_prefills=1, prefill_len=4096),
        TuneShape("prefill", num_prefills=8, prefill_len=1024),
        TuneShape("prefill", num_prefills=4, prefill_len=512, prefill_context=2048),
        TuneShape("mixed", num_decodes=60, decode_context=4096, num_prefills=4, prefill_len=512, prefill_context=2048),
        TuneShape("mixed", num_decodes=32, decode_context=2048, num_prefills=2, prefill_len=256, prefill_context=4096),
        TuneShape("mixed", num_decodes=4, decode_context=16384, num_prefills=1, prefill_len=2048,
                  prefill_context=14336),
        TuneShape("mixed", num_decodes=128, decode_context=2048, num_prefills=1, prefill_len=128),
    ),
    "tiny": (  # CPU smoke runs
        TuneShape("decode", num_decodes=2, decode_context=20),
        TuneShape("prefill", num_prefills=1, prefill_len=24),
        TuneShape("mixed", num_decodes=2, decode_context=20, num_prefills=1, prefill_len=9, prefill_context=7),
    ),
}


@dataclass
class TimingBatch:
    """A step's inputs. Standard layers: query [T, Hq, D]; key, value [T, Hkv, D] / [T, Hkv, Dv] (the step's new
    tokens); kv_cache [num_blocks, 2, block_size, Hkv, D]; output [T, Hq, Dv]. MLA layers, in the same places of
    ``forward``: query [T, N, P + R]; key = kv_c_normed [T, Lkv]; value = k_pe [T, R]; kv_cache
    [num_blocks, block_size, Lkv + R]; output [T, N, V]. The cache is filled with random values."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    output: torch.Tensor
    common: CommonAttentionMetadata

    def forward(self, impl, metadata) -> torch.Tensor:
        """One layer's step as an engine runs it: ``impl.forward`` with the new K/V (written into the cache)."""
        return impl.forward(self.query, self.key, self.value, self.kv_cache, metadata, self.output)


def timing_batch(spec: AttentionSpec, query_lens: Sequence[int], context_lens: Sequence[int],
                 device: "torch.device | str", seed: int = 0) -> TimingBatch:
    """A random decode-first batch over random pages (built fast: no per-token Python on the cache, the random
    values drawn on ``device``); standard or MLA inputs as ``spec`` says."""
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    bs = spec.block_size
    pages = [-(-(q + c) // bs) for q, c in zip(query_lens, context_lens)]
    num_blocks = sum(pages) + 16
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(perm[at: at + n])
        at += n
    common = build_common_metadata(query_lens, context_lens, tables, bs, device)
    if spec.is_mla:  # one latent head per token: [kv_c ; k_pe]
        shape: tuple[int, ...] = (num_blocks, bs, spec.head_size)
        inputs = ((spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim), (spec.kv_lora_rank,),
                  (spec.qk_rope_head_dim,))
    else:
        shape = (num_blocks, 2, bs, spec.num_kv_heads, spec.head_size)
        inputs = ((spec.num_heads, spec.head_size), (spec.num_kv_heads, spec.head_size),
                  (spec.num_kv_heads, spec.value_head_size))
    kv_cache = torch.randn(shape, generator=device_gen, device=device, dtype=spec.torch_dtype)
    if spec.kv_cache_torch_dtype != spec.torch_dtype:
        kv_cache = kv_cache.to(spec.kv_cache_torch_dtype)
    tokens = sum(query_lens)
    query, key, value = (torch.randn(tokens, *size, generator=device_gen, device=device, dtype=spec.torch_dtype)
                         for size in inputs)
    output = torch.empty(tokens, spec.num_heads, spec.value_head_size, device=device, dtype=spec.torch_dtype)
    return TimingBatch(query, key, value, kv_cache, output, common)


def timing_impl(backend: type[AttentionBackend], spec: AttentionSpec, device: "torch.device | str",
                seed: int = 0) -> AttentionImplBase:
    """``backend``'s impl for ``spec`` with random weights where the layer has any: zero sink logits, and for MLA a
    random up-projection ``kv_b_proj`` [N * (P + V), Lkv] (N(0, 1/Lkv): keys and values about N(0, 1)), processed
    as after loading."""
    sinks = torch.zeros(spec.num_heads) if spec.has_sinks else None
    if not spec.is_mla:
        return backend.get_impl_cls()(spec, sinks=sinks)
    rows = spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    gen = torch.Generator().manual_seed(seed)
    kv_b_proj = (torch.randn(rows, spec.kv_lora_rank, generator=gen) / math.sqrt(spec.kv_lora_rank)).to(
        device=device, dtype=spec.torch_dtype)
    impl = backend.get_impl_cls()(spec, sinks=sinks, kv_b_proj=kv_b_proj)
    impl.process_weights_after_loading()
    return impl


def batch_for(spec: AttentionSpec, shape: TuneShape, device: "torch.device | str", seed: int = 0) -> TimingBatch:
    q = [1] * shape.num_decodes + [shape.prefill_len] * shape.num_prefills
    c = [shape.decode_context] * shape.num_decodes + [shape.prefill_context] * shape.num_prefills
    return timing_batch(spec, q, c, device, seed)


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median µs of ``fn``: ``triton.testing.do_bench`` on CUDA, a wall-clock loop on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return 1000.0 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[1]


def tune_candidates(spec: AttentionSpec, device: DeviceInfo) -> list[str]:
    """Every registered backend that fits (the reference backend only where it is the only one), then every
    composition of two of them (decode on one, the rest on the other) that fits."""
    singles = []
    for name in backend_names():
        try:
            cls = get_backend_class(name)
        except ValueError:
            continue
        if not cls.not_supported_reasons(spec, device):
            singles.append(name)
    if device.is_cuda and len(singles) > 1:
        singles = [n for n in singles if n not in ("reference", "reference_mla")]
    order = {n: i for i, n in enumerate(priority_list(device, spec))}
    singles.sort(key=lambda n: (order.get(n, len(order)), n))
    pairs = []
    for decode, prefill in itertools.permutations(singles, 2):
        name = phased_name(decode, prefill)
        if not get_backend_class(name).not_supported_reasons(spec, device):
            pairs.append(name)
    return singles + pairs


def _progress(items: list, desc: str) -> Iterable:
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="run")


def run_tune(spec: AttentionSpec, device: Optional[DeviceInfo] = None, *, grid: str = "small",
             candidates: Optional[Sequence[str]] = None, seed: int = 0,
             layers_per_step: int = LAYERS_PER_STEP, rounds: int = TUNE_ROUNDS) -> Profile:
    """Time ``candidates`` (default: :func:`tune_candidates`) on the grid's shapes, one engine step of
    ``layers_per_step`` layers per timing, the fastest of ``rounds`` rounds (see the module docstring); returns the
    profile (unsaved) with µs per layer."""
    device = device or DeviceInfo.current()
    if grid not in GRIDS:
        raise ValueError(f"grid {grid!r} is unknown; allowed: {', '.join(GRIDS)}")
    if layers_per_step < 1:
        raise ValueError(f"layers_per_step must be >= 1, got {layers_per_step}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    shapes = GRIDS[grid]
    names = list(candidates) if candidates is not None else tune_candidates(spec, device)
    if not names:
        raise ValueError(f"no backend fits this spec on {device.describe()}: nothing to tune")
    torch_device = device.torch_device
    batches = {shape.label: batch_for(spec, shape, torch_device, seed) for shape in shapes}
    times: dict[str, dict[str, Optional[float]]] = {name: {} for name in names}
    errors: dict[str, str] = {}
    pairs = [(name, shape) for name in names for shape in shapes]
    # round r starts r * len(pairs) // rounds pairs later: no pair is always timed at the same point of a round
    runs = [pairs[(j + r * len(pairs) // rounds) % len(pairs)] for r in range(rounds) for j in range(len(pairs))]
    logger.info("tuning %d candidates on %d shapes, %d rounds: %s", len(names), len(shapes), rounds,
                ", ".join(names))
    objects: dict[str, tuple] = {}
    failed: set[tuple[str, str]] = set()
    for i, (name, shape) in enumerate(_progress(runs, "attnbackends tune")):
        if (name, shape.label) in failed:
            continue
        try:
            if name not in objects:
                cls = get_backend_class(name)
                objects[name] = (cls.get_builder_cls()(spec, torch_device, max_num_reqs=256, max_num_tokens=16384),
                                 timing_impl(cls, spec, torch_device, seed))
            builder, impl = objects[name]
            batch = batches[shape.label]

            def step() -> None:
                # a fresh metadata object per step, as an engine makes one: nothing a builder caches on it carries over
                metadata = builder.build(dataclasses.replace(batch.common))
                for _ in range(layers_per_step):
                    batch.forward(impl, metadata)

            if shape.label not in times[name]:
                start = time.perf_counter()
                step()
                if torch_device.type == "cuda":
                    torch.cuda.synchronize(torch_device)
                first = time.perf_counter() - start
                if first > 1.0:
                    logger.info("%s on %s: first call %.1f s%s", name, shape.label, first,
                                " (kernel compilation)" if get_backend_class(name).needs_triton
                                or get_backend_class(name).required_packages else "")
            us = time_us(step, torch_device) / layers_per_step
            earlier = times[name].get(shape.label)
            times[name][shape.label] = us if earlier is None else min(earlier, us)
        except Exception as exc:  # one failing candidate must not end the run; the profile records why
            times[name][shape.label] = None
            failed.add((name, shape.label))
            errors.setdefault(name, f"{type(exc).__name__}: {exc}")
            logger.warning("%s on %s failed: %s: %s", name, shape.label, type(exc).__name__, exc)
        if not _has_tqdm():
            logger.info("tune %d/%d: %s on %s: %s µs", i + 1, len(runs), name, shape.label,
                        _fmt(times[name].get(shape.label)))
    return Profile(
        key=environment_key(spec, device, environment_facts()),
        shapes=[s.as_dict() for s in shapes],
        times_us=times,
        errors=errors,
        layers_per_step=layers_per_step,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _fmt(value: Optional[float]) -> str:
    return "failed" if value is None else f"{value:.1f}"
