"""The balanced decode schedule: a batch's decodes cut into work units of near-equal size, decided in ``build()``.

The uniform split (:func:`.heuristics.choose_num_kv_splits`) gives every decode the same number of KV segments, so in
a heavy-tailed batch (most requests short, a few very long) the long requests' few programs finish last while the
rest of the GPU idles. The balanced schedule cuts each decode's visible keys into units instead: long requests get
many units, short ones one, every unit at most about ``unit_keys`` keys, and the unified kernel runs one unit per
program (:mod:`.kernels`, ``DECODE_SCHEDULED``). A request with one unit writes its output directly; the units of a
split request write partials, and the last of them to finish merges them in the same launch (the fused split-KV
merge, with the request's own unit count).

Unit sizing (:func:`plan_decode_units`), from host data only (``seq_lens_cpu``, ``query_lens_cpu``):

- each decode's visible keys are ``[lo, seq_len)``: ``lo = 0``, or with a sliding window ``W`` the first key its
  first query token sees, ``context - W + 1``, rounded down to the unit alignment;
- the target is ``T = ceil(waves * num_sms / num_kv_heads)`` units (each unit is ``num_kv_heads`` programs, so about
  ``waves`` programs per SM) and the unit size ``S = max(min_unit_keys, ceil(total_keys / T))`` rounded up to
  ``align`` (the kernel's decode tile: a unit is whole tiles);
- a decode of ``w`` keys gets ``max(1, round(w / S))`` units (at most :func:`units_cap`: the split-KV
  workspace's segments and the launch's merge tile; 16 at head 128), of equal whole-tile size;
- the units of a request are adjacent; requests are ordered by unit size, largest first, so the largest units start
  first and the short requests' units fill the tail (a GPU starts programs in grid order; the scheduled grid is
  (KV heads, units): all the KV heads of a unit start together).

So a unit has at most about ``1.5 S`` keys (but the units of a request at the cap), ``S`` is ``1 / waves`` of an SM's
share of the batch's keys (unless ``min_unit_keys`` bounds it), and a batch has at most ``num_decodes + T`` units: a
CUDA graph's fixed grid (:func:`unit_capacity`).

Which schedule a batch gets (:func:`balanced_reason`, the one rule): ``decode_schedule="balanced"`` always,
``"uniform"`` never, ``"auto"`` when the decodes' key counts are ragged (the longest over ``ragged_ratio`` times the
mean). A shape captured in a CUDA graph with the balanced schedule keeps it: every later build of that shape writes
its schedule into the buffer the graph reads (:class:`DecodeScheduler`).

Buffers. An eager batch's unit table is a fresh device tensor (from a pinned host copy, no sync), held by its plan
until its launches have run: a builder may build the next step, or every draft step, before the GPU runs this one.
A shape captured for CUDA graphs has a persistent table of fixed size (:func:`unit_capacity` rows, padding rows
empty) that later builds of the shape rewrite, each after the previous rewrite's copy has run (the host's lead is
one build per shape, as FlashInfer's plans), and every plan on it launches all its rows. A request's first unit
starts at key 0 and its last ends past any sequence (:data:`OPEN_END`; the kernel clips units to the keys the rows
see), so any table of the shape's decodes covers every key of any batch of that shape exactly once: a launch that
reads a table rewritten by a later build of its shape (built ahead, draft steps) is still right, only less
balanced.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import torch

from ..ops.launch_math import next_power_of_2
from .heuristics import pick_kernel_config

if TYPE_CHECKING:
    from ..metadata import CommonAttentionMetadata
    from ..spec import AttentionSpec

__all__ = [
    "BalancedParams",
    "DECODE_SCHEDULE_MODES",
    "DecodeSchedule",
    "DecodeScheduler",
    "UNIT_FIELDS",
    "UnitTable",
    "balanced_reason",
    "decode_key_ranges",
    "decode_schedule_note",
    "make_decode_schedule",
    "units_cap",
    "plan_decode_units",
    "target_units",
    "unit_capacity",
]


#: Values of the builder's ``decode_schedule`` option.
DECODE_SCHEDULE_MODES = ("auto", "balanced", "uniform")

#: int32 fields of one unit: request, first key, end key (exclusive), unit index within the request | unit count << 16.
#: A request's first unit starts at key 0 and its last ends at :data:`OPEN_END`: the kernel clips every unit to the
#: keys the request's rows see on the device, so the units cover them even where the host's lengths were off (the
#: inner boundaries, tile-aligned, only set the balance).
UNIT_FIELDS = 4
COUNT_SHIFT = 16
OPEN_END = 2 ** 31 - 2 ** 16  # past any sequence, and the kernel's ceil(end / tile) stays within int32

#: Most float32 partial values a scheduled launch's merge loads at once (rows x segments x head), half the uniform
#: split's :data:`.heuristics.MERGE_TILE_VALUES`: the scheduled kernel holds both the direct and the partial store,
#: and with a 4096-value merge tile ptxas went to 255 registers a thread with spills on fp8 pages and on verify
#: (head 128, offline for sm_90), against 208-223 with 2048, as the unscheduled decode.
SCHEDULED_MERGE_VALUES = 2048


@dataclass(frozen=True)
class BalancedParams:
    """The balanced schedule's constants (tune them on the GPU; ``benchmarks/NOTES.md``).

    waves : target programs per SM (units x KV heads ~ ``waves`` x SMs): a unit is then at most ``1 / waves`` of an
        SM's share of the batch's keys; the kernel keeps about two decode programs resident per SM.
    min_unit_keys : no unit is cut smaller (its query load, partial write and merge are paid per unit).
    ragged_ratio : ``auto`` schedules a batch balanced when its longest decode has more than this times the mean
        number of visible keys.
    """

    waves: int = 4
    min_unit_keys: int = 128
    ragged_ratio: float = 1.5


DEFAULT_PARAMS = BalancedParams()


def units_cap(head_size: int, workspace_segments: int) -> int:
    """The most units a request gets: as many as the workspace holds partials for, and as the launch's merge takes
    in one tile of :data:`SCHEDULED_MERGE_VALUES` values a row (head 128: 16, head 64: 32, head 256: 8; a
    wider merge tile costs the whole kernel registers). B=1 at head 128 and 8 KV heads: 128 programs, about one per
    SM (the uniform split's 16 segments, measured 2-5% faster than 32 at B=1 x 16384: benchmarks/NOTES.md)."""
    per_tile = SCHEDULED_MERGE_VALUES // next_power_of_2(head_size)
    return max(1, min(workspace_segments, 1 << (max(per_tile, 1).bit_length() - 1)))


# --------------------------------------------------------------------------------------------------------------
# The host-side rule (numpy over [num_decodes] arrays; no per-request Python loop)
# --------------------------------------------------------------------------------------------------------------
def target_units(num_sms: int, num_kv_heads: int, waves: int = DEFAULT_PARAMS.waves) -> int:
    """``T``: the units that give about ``waves`` programs per SM (each unit runs ``num_kv_heads`` programs)."""
    return max(1, -(-waves * num_sms // num_kv_heads))


def unit_capacity(num_decodes: int, num_sms: int, num_kv_heads: int, waves: int = DEFAULT_PARAMS.waves) -> int:
    """The most units :func:`plan_decode_units` makes for ``num_decodes`` decodes, whatever their lengths:
    ``num_decodes + T`` (each request rounds its ``w / S`` units up by less than one, and ``sum(w) / S <= T``)."""
    return num_decodes + target_units(num_sms, num_kv_heads, waves)


def decode_key_ranges(seq_lens: np.ndarray, query_lens: Optional[np.ndarray], *, sliding_window: Optional[int],
                      align: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) [n] int64: the keys the decodes' query tokens see, ``[lo, hi)``, ``lo`` rounded down to ``align``.

    ``hi`` is the sequence length (a causal decode's last token sees every key; a cross-attention decode every key
    of its encoder sequence). With a sliding window ``W`` the first query token, at position ``seq_len - query_len``,
    sees keys from ``seq_len - query_len - W + 1`` on (``query_lens`` may be None without a window)."""
    hi = seq_lens.astype(np.int64)
    if sliding_window:
        lo = np.maximum(hi - query_lens - (int(sliding_window) - 1), 0)
        lo -= lo % align
        return lo, hi
    return np.zeros(hi.shape[0], np.int64), hi


def balanced_reason(mode: str, keys: np.ndarray, params: BalancedParams = DEFAULT_PARAMS, *,
                    graph_balanced: bool = False) -> Optional[str]:
    """The one rule that picks a batch's decode schedule: why decodes with ``keys`` [n] visible keys each run the
    balanced schedule, or None for the uniform split.

    - ``graph_balanced`` (the batch's shape was captured balanced in a CUDA graph, which reads this schedule): balanced;
    - ``mode="balanced"``: balanced; ``mode="uniform"``: uniform;
    - ``mode="auto"``: balanced when the key counts are ragged, the longest over ``params.ragged_ratio`` times the
      mean (uniform batches keep the uniform split, which already fills the GPU evenly and was measured at the
      copy roof). A CUDA-graph capture applies the same rule to its capture batch: capturing a uniform batch keeps
      the uniform split for the graph (pass ``decode_schedule="balanced"`` to capture the balanced one).
    """
    if graph_balanced:
        return "a shape captured balanced in a CUDA graph"
    if mode != "auto":
        return "decode_schedule='balanced'" if mode == "balanced" else None
    n = keys.shape[0]
    if n and float(keys.max()) * n > params.ragged_ratio * float(keys.sum()):
        return f"auto: ragged, the longest decode over {params.ragged_ratio:g}x the mean"
    return None


@dataclass(frozen=True, eq=False)
class UnitTable:
    """A planned schedule on the host.

    units : [num_units, UNIT_FIELDS] int32: (request, key start, key end, index | count << 16) per unit; a request's
        units adjacent and in key order, key starts multiples of ``align``, the first from 0, the last to
        :data:`OPEN_END`.
    unit_keys : ``S``, the target unit size in keys.
    units_per_request : [n] int64, each decode's unit count.
    """

    units: np.ndarray
    unit_keys: int
    units_per_request: np.ndarray

    @property
    def num_units(self) -> int:
        return self.units.shape[0]


def plan_decode_units(seq_lens: np.ndarray, query_lens: Optional[np.ndarray], *, num_sms: int, num_kv_heads: int,
                      align: int, max_units_per_request: int, sliding_window: Optional[int] = None,
                      params: BalancedParams = DEFAULT_PARAMS,
                      ranges: Optional[tuple[np.ndarray, np.ndarray]] = None) -> UnitTable:
    """Cut ``n`` decodes' keys into balanced work units (the rule in the module docstring).

    Parameters
    ----------
    seq_lens, query_lens : [n] integer arrays (host): each decode's sequence and query length (the query lengths
        matter with a window only: None without one).
    num_sms, num_kv_heads : the GPU's SMs and the layer's KV heads (programs per unit).
    align : unit boundaries fall on multiples of this many keys (the kernel's decode tile).
    max_units_per_request : the most units one request gets (:func:`units_cap`).
    sliding_window : the layer's window (None: none).
    ranges : ``decode_key_ranges``' result when the caller has it.
    """
    if align < 1 or max_units_per_request < 1:
        raise ValueError(f"align ({align}) and max_units_per_request ({max_units_per_request}) must be positive")
    if max_units_per_request >= 1 << COUNT_SHIFT:
        raise ValueError(f"max_units_per_request must be below {1 << COUNT_SHIFT}, got {max_units_per_request}")
    lo, hi = ranges if ranges is not None else decode_key_ranges(seq_lens, query_lens, sliding_window=sliding_window,
                                                                 align=align)
    n = lo.shape[0]
    if n == 0:
        return UnitTable(np.zeros((0, UNIT_FIELDS), np.int32), align, np.zeros(0, np.int64))
    keys = hi - lo
    total = int(keys.sum())
    unit = max(params.min_unit_keys, -(-total // target_units(num_sms, num_kv_heads, params.waves)), 1)
    unit = -(-unit // align) * align
    # numpy on [n] / [num_units] arrays, no loop: an op costs about as much for 256 requests as for one, so few ops
    count = (keys + unit // 2) // unit  # round(w / S) units ...
    np.maximum(count, 1, out=count)  # ... at least one,
    np.minimum(count, max_units_per_request, out=count)  # at most the cap
    if count.max() == 1:  # nothing split: one unit per request, longest first
        order = np.argsort(-keys, kind="stable")
        table = np.empty((n, UNIT_FIELDS), np.int32)
        table[:, 0] = order
        table[:, 1] = 0
        table[:, 2] = OPEN_END
        table[:, 3] = 1 << COUNT_SHIFT
        return UnitTable(table, unit, count)
    # equal whole-tile pieces: ceil(w / count) rounded up to align = ceil(w / (count * align)) * align (one tile at
    # least: w may be 0) ...
    keys_m1 = keys - 1
    size = (keys_m1 // (count * align) + 1) * align
    np.maximum(size, align, out=size)
    count = keys_m1 // size + 1  # ... where rounding the pieces up leaves the last ones empty, fewer of them
    np.maximum(count, 1, out=count)
    order = np.argsort(-size, kind="stable")  # largest units first; a request's units stay together
    counts = count[order]
    req = np.repeat(order, counts)  # [num_units] the request of each unit
    first = np.empty_like(count)
    first[order] = np.cumsum(counts) - counts  # each request's first unit
    u = np.arange(req.shape[0])  # unit u is unit u - first[r] of its request r: it starts at lo + (u - first) * size
    unit_size = size[req]
    start = (lo - first * size)[req] + u * unit_size
    table = np.empty((req.shape[0], UNIT_FIELDS), np.int32)
    table[:, 0] = req
    table[:, 1] = start
    start += unit_size
    table[:, 2] = start
    table[:, 3] = u + ((count << COUNT_SHIFT) - first)[req]
    table[first, 1] = 0  # the open ends (OPEN_END)
    table[first + count - 1, 2] = OPEN_END
    return UnitTable(table, unit, count)


# --------------------------------------------------------------------------------------------------------------
# The schedule a launch plan carries, and the builder's scheduler (device buffers)
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DecodeSchedule:
    """A batch's balanced decode schedule on the launch device (carried by :class:`.launch.LaunchPlan`).

    Attributes
    ----------
    units : [>= num_programs, UNIT_FIELDS] int32 on the device (:data:`UNIT_FIELDS`); rows from ``num_units`` on are
        empty (count 0).
    num_decodes : the decodes it schedules (the batch's first requests).
    num_units : units in the table.
    num_programs : rows of the launch's unit axis: ``num_units``, or a CUDA-graph buffer's fixed capacity.
    unit_keys : the target unit size ``S`` in keys.
    align : keys per unit boundary (a multiple of the kernel's decode tile).
    max_units_per_request : the per-request cap (:func:`units_cap`; the kernel's merge tile).
    units_per_request : [num_decodes] int64 (host), each decode's unit count.
    why : why this batch is scheduled balanced.
    """

    units: torch.Tensor
    num_decodes: int
    num_units: int
    num_programs: int
    unit_keys: int
    align: int
    max_units_per_request: int
    units_per_request: np.ndarray
    why: str

    @property
    def num_split(self) -> int:
        """Requests with more than one unit."""
        return int((self.units_per_request > 1).sum())

    @property
    def most_units(self) -> int:
        """The most units of one request."""
        return int(self.units_per_request.max()) if self.num_decodes else 0

    def describe(self) -> str:
        """How the batch's decodes are scheduled, in words."""
        graph = f" (a CUDA-graph buffer of {self.num_programs} rows)" if self.num_programs != self.num_units else ""
        return (f"balanced ({self.why}): {self.num_decodes} decodes in {self.num_units} units of up to about "
                f"{self.unit_keys} keys{graph}; {self.num_split} requests split, into at most {self.most_units} units, "
                "merged in the launch")


def make_decode_schedule(table: UnitTable, *, device: "torch.device | str", align: int, max_units_per_request: int,
                         why: str = "balanced", pin_memory: Optional[bool] = None) -> DecodeSchedule:
    """A :class:`DecodeSchedule` of ``table`` in a fresh device tensor (from pinned memory on CUDA, so the copy does
    not wait; torch keeps the pinned block until the copy has run)."""
    device = torch.device(device)
    n = table.num_units
    if device.type == "cuda":
        host = torch.empty((max(n, 1), UNIT_FIELDS), dtype=torch.int32,
                           pin_memory=True if pin_memory is None else pin_memory)
        host.numpy()[:n] = table.units
        units = host.to(device, non_blocking=True)
    else:
        units = torch.from_numpy(table.units if n else np.zeros((1, UNIT_FIELDS), np.int32)).to(device)
    return _schedule(table, units, n, align, max_units_per_request, why)


def _schedule(table: UnitTable, units: torch.Tensor, num_programs: int, align: int, max_units_per_request: int,
              why: str) -> DecodeSchedule:
    counts = table.units_per_request
    return DecodeSchedule(
        units=units, num_decodes=counts.shape[0], num_units=table.num_units, num_programs=num_programs,
        unit_keys=table.unit_keys, align=align, max_units_per_request=max_units_per_request,
        units_per_request=counts, why=why)


class _GraphBuffer:
    """The persistent unit table of one captured shape: [capacity, UNIT_FIELDS] int32 on the device, its pinned host
    copy, the event after the last copy, and the params it was sized with."""

    def __init__(self, capacity: int, device: torch.device, params: BalancedParams) -> None:
        cuda = device.type == "cuda"
        self.device_units = torch.zeros((capacity, UNIT_FIELDS), dtype=torch.int32, device=device)
        self.host_units = torch.zeros((capacity, UNIT_FIELDS), dtype=torch.int32, pin_memory=cuda)
        self.event: Optional["torch.cuda.Event"] = torch.cuda.Event() if cuda else None
        self.copied = False
        self.params = params

    @property
    def capacity(self) -> int:
        return self.device_units.shape[0]

    def write(self, units: np.ndarray) -> None:
        """Rewrite the table with ``units`` (the rest empty), ordered after the launches enqueued before it."""
        n = units.shape[0]
        if n > self.capacity:
            raise AssertionError(f"{n} units exceed the captured buffer's {self.capacity} rows")
        if self.event is not None and self.copied:
            self.event.synchronize()  # the previous schedule's copy has run: its pinned rows may change
        host = self.host_units.numpy()
        host[:n] = units
        host[n:] = 0
        self.device_units.copy_(self.host_units, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
            self.copied = True


class DecodeScheduler:
    """A builder's balanced decode schedules: the mode, the GPU's numbers, and the CUDA-graph buffers of the shapes
    captured balanced.

    Parameters
    ----------
    mode : ``"auto"``, ``"balanced"`` or ``"uniform"`` (:data:`DECODE_SCHEDULE_MODES`).
    device : the launch device.
    num_sms, num_kv_heads, align, max_units_per_request, sliding_window : as in :func:`plan_decode_units`.
    params : the rule's constants (an attribute: a benchmark may replace it between builds; a captured shape keeps
        the params it was captured with).
    """

    def __init__(self, mode: str, device: "torch.device | str", *, num_sms: int, num_kv_heads: int, align: int,
                 max_units_per_request: int, sliding_window: Optional[int] = None,
                 params: BalancedParams = DEFAULT_PARAMS) -> None:
        if mode not in DECODE_SCHEDULE_MODES:
            raise ValueError(f"decode_schedule must be one of {DECODE_SCHEDULE_MODES}, got {mode!r}")
        self.mode = mode
        self.device = torch.device(device)
        self.num_sms = num_sms
        self.num_kv_heads = num_kv_heads
        self.align = align
        self.max_units_per_request = max_units_per_request
        self.sliding_window = sliding_window
        self.params = params
        self._graphs: dict[tuple[int, int], _GraphBuffer] = {}
        self._capturing = False

    @classmethod
    def for_spec(cls, mode: str, spec: "AttentionSpec", device: "torch.device | str", *, num_sms: int,
                 workspace_segments: int) -> "DecodeScheduler":
        """The scheduler of a builder of ``spec`` whose split-KV workspace holds ``workspace_segments`` partials a
        row: units aligned to the decode tile a scheduled plan uses (:func:`.heuristics.pick_kernel_config` without
        a per-split key count: fixed by the spec), at most :func:`units_cap` a request."""
        align = pick_kernel_config(spec.head_size, spec.num_queries_per_kv, 1, has_decode_path=True,
                                   has_generic_path=False, kv_fp8=spec.is_fp8_kv_cache).decode_tile_n
        return cls(mode, device, num_sms=num_sms, num_kv_heads=spec.num_kv_heads, align=align,
                   max_units_per_request=units_cap(spec.head_size, workspace_segments),
                   sliding_window=spec.sliding_window)

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """Builds inside schedule for a CUDA-graph capture: a decode-only shape scheduled balanced gets a persistent
        buffer of fixed capacity that later builds of the shape rewrite."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def schedule(self, common: "CommonAttentionMetadata", num_decodes: int, *,
                 decode_only: bool) -> Optional[DecodeSchedule]:
        """The balanced schedule of ``common``'s first ``num_decodes`` requests (its decodes), or None where they run
        the uniform split (:func:`balanced_reason`). ``decode_only``: the batch has no other requests (a shape a
        CUDA graph may capture and replay: (num_reqs, num_tokens))."""
        shape = (common.num_reqs, common.num_actual_tokens) if decode_only else None
        graph = self._graphs.get(shape) if shape is not None else None
        if graph is None and self.mode == "uniform":
            return None
        seq = common.seq_lens_cpu.numpy()[:num_decodes]
        qlen = np.diff(common.query_start_loc_cpu.numpy()[:num_decodes + 1]) if self.sliding_window else None
        ranges = decode_key_ranges(seq, qlen, sliding_window=self.sliding_window, align=self.align)
        why = balanced_reason(self.mode, ranges[1] - ranges[0], self.params, graph_balanced=graph is not None)
        if why is None:
            return None
        if graph is None and self._capturing and shape is not None:
            graph = self._graphs[shape] = _GraphBuffer(
                unit_capacity(num_decodes, self.num_sms, self.num_kv_heads, self.params.waves), self.device,
                self.params)
        params = graph.params if graph is not None else self.params
        table = plan_decode_units(seq, qlen, num_sms=self.num_sms, num_kv_heads=self.num_kv_heads, align=self.align,
                                  max_units_per_request=self.max_units_per_request, params=params, ranges=ranges)
        if graph is not None:
            graph.write(table.units)
            return _schedule(table, graph.device_units, graph.capacity, self.align, self.max_units_per_request, why)
        return make_decode_schedule(table, device=self.device, align=self.align,
                                    max_units_per_request=self.max_units_per_request, why=why)


def decode_schedule_note(mode: str = "auto", params: BalancedParams = DEFAULT_PARAMS, *, cuda: bool = True) -> str:
    """How a builder with ``decode_schedule=mode`` schedules a batch's decodes on a CUDA device (``cuda``) or the
    CPU, in words (``kernel_notes``, so ``attnbackends explain``)."""
    balanced = (f"each decode's keys cut into units of near-equal size sized to the GPU (about {params.waves} programs "
                "per SM; long requests many units, short ones one), one unit per program, a split request's units "
                "merged in the launch")
    uniform = "the uniform split (every decode the same number of KV segments, several only for small batches)"
    if mode == "uniform":
        return f"decode schedule: {uniform} (decode_schedule='uniform')"
    if mode == "balanced":
        return f"decode schedule: balanced (decode_schedule='balanced'): {balanced}"
    if not cuda:
        return (f"decode schedule: {uniform} on the CPU (no split-KV workspace there unless "
                "decode_schedule='balanced')")
    return (f"decode schedule: balanced where the decodes' lengths are ragged (the longest over "
            f"{params.ragged_ratio:g}x the mean; decode_schedule='auto'): {balanced}; else {uniform}; a CUDA-graph "
            "capture keeps its capture batch's choice; deterministic mode: no split")
