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

Buffers. Both kinds of table are planned straight into host rows (pinned on CUDA) and copied from there without
waiting; host rows are rewritten only once their previous copy has run (an event per set of rows).

- An eager batch's table is a fresh device tensor, held by its plan until its launches have run (the caching
  allocator hands its block out again only to work queued after them): a builder may build the next step, or
  every draft step, before the GPU runs this one, and a persistent device table could not serve that (a later
  build's copy is queued before this plan's launches, which would then read another batch's units). Its host
  rows are a few staging slots used in turn; where the next slot's copy has not run (the host is further ahead
  of the GPU than the slots), another slot is added, up to :data:`MAX_STAGING_SLOTS`, and beyond that the build
  waits for the oldest copy.
- A shape captured for CUDA graphs has a persistent table of fixed size (:func:`unit_capacity` rows, padding rows
  empty) that later builds of the shape rewrite, each after the previous rewrite's copy has run (the host's lead
  is one build per shape, as FlashInfer's plans), and every plan on it launches all its rows. A request's first
  unit starts at key 0 and its last ends past any sequence (:data:`OPEN_END`; the kernel clips units to the keys
  the rows see), so any table of the shape's decodes covers every key of any batch of that shape exactly once: a
  launch that reads a table rewritten by a later build of its shape (built ahead, draft steps) is still right,
  only less balanced.

Host time. ``build()`` plans every step, and a numpy call's fixed cost dwarfs its cost per element at these
lengths: a few decodes are planned in Python (:data:`PYTHON_PLAN_MAX`), more in as few numpy calls over
``[num_decodes]`` and ``[num_units]`` arrays as the rule allows; the only torch calls are the copy and its event,
and the description (:meth:`DecodeSchedule.describe`) is made only when asked for.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import torch

from .kv_load import dots_in_fp16
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
# The host-side rule (numpy over [num_decodes] arrays; a few decodes in Python)
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
        return _window_starts(hi, query_lens, sliding_window, align), hi
    return np.zeros(hi.shape[0], np.int64), hi


def _window_starts(hi: np.ndarray, query_lens: np.ndarray, sliding_window: int, align: int) -> np.ndarray:
    """``lo`` of :func:`decode_key_ranges` with a window: [n] int64 from ``hi`` [n] int64."""
    lo = hi - query_lens
    lo -= int(sliding_window) - 1
    np.maximum(lo, 0, out=lo)
    lo -= lo % align
    return lo


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
    n = keys.shape[0]
    if mode != "auto" or graph_balanced or not n:
        return _reason(mode, n, 0, 0, params, graph_balanced)
    return _reason(mode, n, int(keys.sum()), int(keys.max()), params, graph_balanced)


def _reason(mode: str, n: int, total: int, longest: int, params: BalancedParams, graph_balanced: bool) -> Optional[str]:
    """:func:`balanced_reason` of ``n`` decodes with ``total`` keys, the longest ``longest``."""
    if graph_balanced:
        return "a shape captured balanced in a CUDA graph"
    if mode != "auto":
        return "decode_schedule='balanced'" if mode == "balanced" else None
    if n and float(longest) * n > params.ragged_ratio * float(total):
        return _ragged_reason(params.ragged_ratio)
    return None


@functools.lru_cache(maxsize=16)
def _ragged_reason(ratio: float) -> str:
    return f"auto: ragged, the longest decode over {ratio:g}x the mean"


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
                      ranges: Optional[tuple[np.ndarray, np.ndarray]] = None,
                      out: Optional[np.ndarray] = None) -> UnitTable:
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
    out : [>= unit_capacity(n, num_sms, num_kv_heads, params.waves), UNIT_FIELDS] int32 rows the table is written
        to (the table's ``units`` is then a view of them), e.g. pinned memory a copy goes from; None: a fresh array.
    """
    _check_plan_args(align, max_units_per_request)
    lo, hi = ranges if ranges is not None else decode_key_ranges(seq_lens, query_lens, sliding_window=sliding_window,
                                                                 align=align)
    n = lo.shape[0]
    if n == 0:
        return UnitTable(np.zeros((0, UNIT_FIELDS), np.int32), align, np.zeros(0, np.int64))
    keys = hi - lo
    kw = dict(num_sms=num_sms, num_kv_heads=num_kv_heads, align=align, cap=max_units_per_request, params=params,
              out=out)
    if n <= PYTHON_PLAN_MAX:
        keys_list = keys.tolist()
        return _plan_units_py(keys_list, lo.tolist(), sum(keys_list), max(keys_list), **kw)
    return _plan_units(keys, lo, int(keys.sum()), int(keys.max()), **kw)


def _check_plan_args(align: int, max_units_per_request: int) -> None:
    if align < 1 or max_units_per_request < 1:
        raise ValueError(f"align ({align}) and max_units_per_request ({max_units_per_request}) must be positive")
    if max_units_per_request >= 1 << COUNT_SHIFT:
        raise ValueError(f"max_units_per_request must be below {1 << COUNT_SHIFT}, got {max_units_per_request}")


#: Decodes up to this many are planned in Python (:func:`_plan_units_py`), more with numpy (:func:`_plan_units`):
#: below it, a request's units in Python cost less than numpy's fixed cost per call (measured in ``build()``).
PYTHON_PLAN_MAX = 16

#: Most tiles a unit of :func:`_plan_units` may have for its sort to run on int16 keys.
_INT16_TILES = 2 ** 15

#: The row of a request with one unit (unit 0 of 1, open at both ends), its request index written over column 0.
_WHOLE_REQUEST = np.array([0, 0, OPEN_END, 1 << COUNT_SHIFT], np.int32)


def _unit_keys(total: int, num_sms: int, num_kv_heads: int, align: int, params: BalancedParams) -> int:
    """``S``, the unit size of decodes with ``total`` visible keys: whole tiles, at least ``params.min_unit_keys``."""
    unit = max(params.min_unit_keys, -(-total // target_units(num_sms, num_kv_heads, params.waves)), 1)
    return -(-unit // align) * align


def _plan_units(keys: np.ndarray, lo: Optional[np.ndarray], total: int, longest: int, *, num_sms: int,
                num_kv_heads: int, align: int, cap: int, params: BalancedParams,
                out: Optional[np.ndarray]) -> UnitTable:
    """:func:`plan_decode_units` of ``n >= 1`` decodes with ``keys`` [n] (integers) visible keys from ``lo`` [n]
    int64 on (None: from 0), ``total`` and ``longest`` their sum and maximum; ``cap``: ``max_units_per_request``.

    ``build()`` runs this every step: the work is in as few numpy calls as the rule allows (quantities negated
    where that saves one, ``-ceil(a / b) == a // -b``; the table's rows from one repeat of a [4, n] array of
    per-request terms)."""
    n = keys.shape[0]
    unit = _unit_keys(total, num_sms, num_kv_heads, align, params)
    if cap == 1 or longest < 2 * unit - unit // 2:  # round(w / S) < 2 for every decode: nothing split
        table = _rows(out, n)
        table[:] = _WHOLE_REQUEST
        table[:, 0] = np.negative(keys).argsort(kind="stable")  # one unit per request, longest first
        return UnitTable(table, unit, np.ones(n, np.int64))
    thresholds, divisors = _count_steps(unit, align, cap)
    # round(w / S) units, at least one, at most the cap: one more than the thresholds w reaches
    count = thresholds.searchsorted(keys, side="right")
    # ... of equal whole-tile size ceil(w / (count * align)) * align, negated (`neg_size`): the sort is ascending
    keys1 = np.maximum(keys, 1, dtype=np.int64)  # a decode without keys: one (empty) unit of one tile
    neg_size = np.floor_divide(keys1, divisors.take(count), out=count)  # in tiles
    # largest units first, a request's units together; in 16 bits where they hold the tiles (a radix sort)
    order = (neg_size.astype(np.int16) if longest <= _INT16_TILES * align else neg_size).argsort(kind="stable")
    neg_size *= align
    # where rounding the pieces up leaves the last ones empty, fewer of them: ceil(w / size)
    count = np.floor_divide(keys1, neg_size, out=keys1)
    np.negative(count, out=count)
    # The table in the order `order`: request k's units are rows first[k] .. ends[k] - 1, and its unit in row u
    # starts at lo + (u - first[k]) * size = terms[1] - u * neg_size, with terms[1] = lo + first[k] * neg_size.
    # The per-request terms (request, terms[1], neg_size, count << 16 - first) repeated once give every unit's.
    counts = count.take(order)
    ends = np.add.accumulate(counts)
    first = ends - counts
    terms = np.empty((UNIT_FIELDS, n), np.int64)
    terms[0] = order
    np.multiply(first, neg_size.take(order, out=terms[2]), out=terms[1])
    if lo is not None:
        terms[1] += lo.take(order)
    np.left_shift(counts, COUNT_SHIFT, out=terms[3])
    terms[3] -= first
    rows = terms.repeat(counts, axis=1)
    m = rows.shape[1]
    u = np.arange(m)
    rows[1] -= u * rows[2]  # key start
    np.subtract(rows[1], rows[2], out=rows[2])  # key end
    rows[3] += u  # index | count << 16
    if lo is not None:
        rows[1][first] = 0  # the open ends (OPEN_END)
    ends -= 1
    rows[2][ends] = OPEN_END
    table = _rows(out, m)
    table[:] = rows.T
    return UnitTable(table, unit, count)


@functools.lru_cache(maxsize=64)
def _count_steps(unit: int, align: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds, divisors): a decode of ``w`` keys gets ``c = 1 + thresholds.searchsorted(w, "right")`` units,
    ``clip(round(w / unit), 1, cap)`` (thresholds ``k * unit - unit // 2`` for ``k`` = 2 .. cap), and
    ``divisors[c - 1] = -c * align``. Read-only: shared by every plan of these numbers."""
    thresholds = np.arange(2, cap + 1, dtype=np.int64) * unit - unit // 2
    divisors = np.arange(1, cap + 1, dtype=np.int64) * -align
    thresholds.flags.writeable = divisors.flags.writeable = False
    return thresholds, divisors


def _plan_units_py(keys: list, lo: Optional[list], total: int, longest: int, *, num_sms: int, num_kv_heads: int,
                   align: int, cap: int, params: BalancedParams, out: Optional[np.ndarray]) -> UnitTable:
    """:func:`_plan_units` in Python, for a few decodes (``keys``, ``lo``: lists); the same table."""
    n = len(keys)
    unit = _unit_keys(total, num_sms, num_kv_heads, align, params)
    whole = 1 << COUNT_SHIFT
    rows: list[int] = []  # the table, flat
    if cap == 1 or longest < 2 * unit - unit // 2:
        for r in sorted(range(n), key=keys.__getitem__, reverse=True):  # stable: ties in request order
            rows += (r, 0, OPEN_END, whole)
        counts = [1] * n
    else:
        split_from = 2 * unit - unit // 2  # round(w / S) >= 2
        sizes = [-(-max(w, 1) // align) * align for w in keys]
        counts = [1] * n
        for r, w in enumerate(keys):
            if w >= split_from:
                size = sizes[r] = -(-w // (min((w + unit // 2) // unit, cap) * align)) * align
                counts[r] = -(-w // size)
        for r in sorted(range(n), key=sizes.__getitem__, reverse=True):
            count = counts[r]
            if count == 1:
                rows += (r, 0, OPEN_END, whole)
                continue
            size, start, c = sizes[r], lo[r] if lo is not None else 0, count << COUNT_SHIFT
            for i in range(count):
                rows += (r, start, start + size, c | i)
                start += size
            rows[-4 * count + 1] = 0  # the open ends
            rows[-2] = OPEN_END
    table = _rows(out, len(rows) // UNIT_FIELDS)
    table.reshape(-1)[:] = rows
    return UnitTable(table, unit, np.array(counts, np.int64))


def _rows(out: Optional[np.ndarray], m: int) -> np.ndarray:
    """The first ``m`` rows of ``out``, or ``m`` fresh ones."""
    if out is None:
        return np.empty((m, UNIT_FIELDS), np.int32)
    if out.shape[0] < m:
        raise ValueError(f"{m} units exceed the {out.shape[0]} rows given (unit_capacity)")
    return out[:m]


# --------------------------------------------------------------------------------------------------------------
# The schedule a launch plan carries, and the builder's scheduler (device buffers)
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DecodeSchedule:
    """A batch's balanced decode schedule on the launch device (carried by :class:`.launch.LaunchPlan`).

    Attributes
    ----------
    units : [>= num_programs, UNIT_FIELDS] int32 on the device (:data:`UNIT_FIELDS`); rows from ``num_units`` to
        ``num_programs`` are empty (count 0), rows past ``num_programs`` are never read (stale in an eager table:
        the rows of the staging slot it was copied from).
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


#: Most staging slots of a scheduler's eager builds: the host's lead over the GPU's copies, in builds, that costs no
#: wait (draft steps built at once, a step built ahead); a build beyond it waits for the oldest slot's copy.
MAX_STAGING_SLOTS = 8


class _Staging:
    """Host rows a table is planned into and copied to the device from (pinned on CUDA), and the event after that
    copy: the rows are rewritten only once it has passed (:meth:`ready`, :meth:`wait`)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros((rows, UNIT_FIELDS), dtype=torch.int32, pin_memory=cuda)
        self.rows = self.host.numpy()
        self.device = device
        self.event: Optional["torch.cuda.Event"] = torch.cuda.Event() if cuda else None
        self.copied = False  # the event is recorded

    def ready(self) -> bool:
        """No copy from these rows is pending."""
        return not self.copied or self.event.query()

    def wait(self) -> None:
        """Until no copy from these rows is pending."""
        if self.copied:
            self.event.synchronize()

    def copy_to(self, device_units: torch.Tensor) -> None:
        """Copy every row into ``device_units`` (as many rows), ordered after the work queued before it."""
        device_units.copy_(self.host, non_blocking=self.event is not None)
        self._recorded()

    def to_device(self) -> torch.Tensor:
        """A fresh device tensor of every row (those past the table's are stale: no program reads them), copied
        without waiting."""
        units = self.host.to(self.device, non_blocking=True)
        self._recorded()
        return units

    def _recorded(self) -> None:
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
            self.copied = True


class _StagingRing:
    """The staging slots of a scheduler's eager builds, used in turn (the module docstring's rule): where the next
    slot's copy is still pending (the host is ahead of the GPU by every slot), a new slot goes before it, up to
    :data:`MAX_STAGING_SLOTS`; past that, the build waits for that copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[_Staging] = []
        self.turn = 0

    def take(self, rows: int) -> _Staging:
        """A slot of at least ``rows`` rows that may be rewritten now."""
        slots, i = self.slots, self.turn
        slot = slots[i] if slots else None
        if slot is None or not slot.ready():
            if len(slots) < MAX_STAGING_SLOTS:
                slot = _Staging(next_power_of_2(rows), self.device)
                slots.insert(i, slot)
            else:
                slot.wait()
        if slot.rows.shape[0] < rows:  # a larger batch than this slot has served (its copy has run)
            slot = slots[i] = _Staging(next_power_of_2(rows), self.device)
        self.turn = (i + 1) % len(slots)
        return slot


class _GraphBuffer:
    """The persistent unit table of one captured shape: [capacity, UNIT_FIELDS] int32 on the device, its staging
    rows (pinned, with the event after the last copy), and the params it was sized with."""

    def __init__(self, capacity: int, device: torch.device, params: BalancedParams) -> None:
        self.device_units = torch.zeros((capacity, UNIT_FIELDS), dtype=torch.int32, device=device)
        self.staging = _Staging(capacity, device)
        self.used = 0  # rows the last table wrote (the rest are zero)
        self.params = params

    @property
    def capacity(self) -> int:
        return self.device_units.shape[0]

    def rows(self) -> np.ndarray:
        """The host rows to plan the next table into: the previous rewrite's copy has run."""
        self.staging.wait()
        return self.staging.rows

    def write(self, num_units: int) -> None:
        """Rewrite the device table with the first ``num_units`` host rows and empty rows after them (every row: the
        graph launches them all), ordered after the launches enqueued before it."""
        if num_units < self.used:
            self.staging.rows[num_units:self.used] = 0
        self.used = num_units
        self.staging.copy_to(self.device_units)


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
        _check_plan_args(align, max_units_per_request)
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
        self._staging = _StagingRing(self.device) if self.device.type == "cuda" else None

    @classmethod
    def for_spec(cls, mode: str, spec: "AttentionSpec", device: "torch.device | str", *, num_sms: int,
                 workspace_segments: int) -> "DecodeScheduler":
        """The scheduler of a builder of ``spec`` whose split-KV workspace holds ``workspace_segments`` partials a
        row: units aligned to the decode tile a scheduled plan uses (:func:`.heuristics.pick_kernel_config` without
        a per-split key count: fixed by the spec), at most :func:`units_cap` a request."""
        align = pick_kernel_config(spec.head_size, spec.num_queries_per_kv, 1, has_decode_path=True,
                                   has_generic_path=False, kv_fp8=dots_in_fp16(spec)).decode_tile_n
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
        graphs = self._graphs
        graph = graphs.get((common.num_reqs, common.num_actual_tokens)) if decode_only and graphs else None
        if graph is None and self.mode == "uniform":
            return None
        keys, lo, total, longest = self._visible_keys(common, num_decodes)
        why = _reason(self.mode, num_decodes, total, longest, self.params, graph is not None)
        if why is None:
            return None
        if graph is None and self._capturing and decode_only:
            graph = graphs[(common.num_reqs, common.num_actual_tokens)] = _GraphBuffer(
                unit_capacity(num_decodes, self.num_sms, self.num_kv_heads, self.params.waves), self.device,
                self.params)
        params = self.params
        if graph is not None:
            params, out = graph.params, graph.rows()
        elif self._staging is not None:
            staging = self._staging.take(unit_capacity(num_decodes, self.num_sms, self.num_kv_heads, params.waves))
            out = staging.rows
        else:
            out = None  # a fresh table, which the schedule's tensor keeps
        plan = _plan_units_py if num_decodes <= PYTHON_PLAN_MAX else _plan_units
        table = plan(keys, lo, total, longest, num_sms=self.num_sms, num_kv_heads=self.num_kv_heads,
                     align=self.align, cap=self.max_units_per_request, params=params, out=out)
        if graph is not None:
            graph.write(table.num_units)
            return _schedule(table, graph.device_units, graph.capacity, self.align, self.max_units_per_request, why)
        if out is not None:
            units = staging.to_device()
        else:
            units = torch.from_numpy(table.units)
            if self.device.type != "cpu":
                units = units.to(self.device)
        return _schedule(table, units, table.num_units, self.align, self.max_units_per_request, why)

    def _visible_keys(self, common: "CommonAttentionMetadata", n: int) -> tuple:
        """(keys, lo, total, longest) of the first ``n`` requests (:func:`decode_key_ranges`): their visible key
        counts and first visible keys (None: from 0), lists for :func:`_plan_units_py` (``n`` up to
        :data:`PYTHON_PLAN_MAX`), else [n] arrays for :func:`_plan_units`; their sum and maximum."""
        seq = common.seq_lens_cpu.numpy()[:n]  # a view of the batch's tensor: never written
        window, align = self.sliding_window, self.align
        if n <= PYTHON_PLAN_MAX:
            keys, lo = seq.tolist(), None
            if window:
                qsl = common.query_start_loc_cpu.numpy()[:n + 1].tolist()
                lo = [max(w - (qsl[i + 1] - qsl[i]) - (window - 1), 0) for i, w in enumerate(keys)]
                lo = [x - x % align for x in lo]
                keys = [w - x for w, x in zip(keys, lo)]
            return keys, lo, sum(keys), max(keys)
        keys, lo = seq.astype(np.int64), None
        if window:
            qsl = common.query_start_loc_cpu.numpy()
            lo = _window_starts(keys, qsl[1:n + 1] - qsl[:n], window, align)
            keys -= lo
        return keys, lo, int(keys.sum()), int(keys.max())


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
