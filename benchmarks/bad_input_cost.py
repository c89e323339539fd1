"""Host cost of the per-step bad-input checks: what every builder's ``build`` adds
(:func:`attnbackends.validation.check_batch_for_spec`) and what every impl's ``forward`` adds (the metadata-origin
comparison), at B requests per step.

    python -m benchmarks.bad_input_cost --out benchmarks/results/<gpu>-<date>-bad-input-cost.json
    python -m benchmarks.bad_input_cost --smoke        # fewer repeats, prints the rows

The checks read host data only, so the numbers are CPU time wherever they run; on a GPU host they measure that
host's CPU. Rows (PERF.md):

- ``check_cost`` (``mode`` ``host_tensors``): a batch whose block table and slot mapping the engine gives as CPU
  tensors it built itself (``CommonAttentionMetadata`` made directly): the slots are checked against the block table,
  lengths and duplicates, with NumPy;
- ``check_cost`` (``mode`` ``from_lists``): the same batch from :func:`attnbackends.build_common_metadata`, which
  checked it while building it: the build check reads attributes only;
- ``check_cost`` (``mode`` ``device_only``): the attribute checks alone (what a GPU batch without host slots costs);
- ``forward_check_cost``: one impl ``forward`` call's metadata check once the builder's origin was accepted.
- ``bad_input_cost`` (the PERF.md row, ``mode`` ``persistent_batch``): the default-mode checks one engine step pays
  once, on the documented path: a :class:`~attnbackends.PersistentBatch` step of B decodes (``num_blocks`` given)
  through a builder's checked ``build`` (the batch's devices and index dtypes, its limits, its lengths against the
  spec, the page guard's pending-fault read, the origin mark), on the GPU where there is one (``device``). ``us``
  is that per-step cost, ``target_us`` 30. Beside it, ``forward_us``: the checks each layer's ``forward`` starts
  with (the metadata origin, the tensors against the recorded layout, the cache's page count; part of the
  ``host_overhead`` row's budget), and ``step_total_us`` = ``us`` + ``layers`` x ``forward_us``. ``mode``
  ``hand_made``: the same step as an engine would hand-build it (no producer marks: the host table is compared
  and range-checked, the device table scanned, the slots checked where they are on the host).

``batch`` ``decode``: B single-token decodes after ``--context`` cached tokens; ``mixed``: B - 4 such decodes and
four 128-token chunked prefills.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from typing import Callable, Optional, Sequence


import torch

from attnbackends import AttentionSpec, PersistentBatch, build_common_metadata
from attnbackends.interface import AttentionImpl, AttentionMetadataBuilder
from attnbackends.metadata import CommonAttentionMetadata, MetadataOrigin
from attnbackends.validation import check_batch_for_spec, check_forward_inputs

from .report import write_rows

__all__ = ["TARGET_US", "main", "measure", "measure_step"]


def _batch(num_reqs: int, context: int, prefills: int, block_size: int, seed: int = 0) -> CommonAttentionMetadata:
    """``num_reqs`` requests (the last ``prefills`` of them 128-token chunks), pages in random order."""
    rng = random.Random(seed)
    query_lens = [1] * (num_reqs - prefills) + [128] * prefills
    context_lens = [context] * num_reqs
    pages_per_req = [-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)]
    pages = list(range(sum(pages_per_req)))
    rng.shuffle(pages)
    tables, start = [], 0
    for n in pages_per_req:
        tables.append(pages[start : start + n])
        start += n
    return build_common_metadata(query_lens, context_lens, tables, block_size, "cpu")


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of one call (µs) over ``calls`` calls."""
    for _ in range(min(calls, 100)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


class _NoOpImpl(AttentionImpl):
    """An impl whose forward does nothing: what remains is the per-call metadata check."""

    def update_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        pass

    def forward(self, query, key, value, kv_cache, metadata, output):
        return output


class _Metadata:
    origin: Optional[MetadataOrigin] = None


#: The per-step budget of the default-mode checks at B=256 (docs/PERF.md, ``bad_input_cost``).
TARGET_US = 30.0


@dataclasses.dataclass(frozen=True)
class _StepMetadata:
    common: CommonAttentionMetadata


class _NoOpBuilder(AttentionMetadataBuilder):
    """A builder whose ``build`` does nothing: what its checked ``build`` adds is the checks and the origin mark."""

    def build(self, common: CommonAttentionMetadata) -> _StepMetadata:
        return _StepMetadata(common)


class _CheckingImpl(AttentionImpl[_StepMetadata]):
    """An impl whose ``forward`` runs only the checks every backend's ``forward`` starts with."""

    def update_kv_cache(self, key, value, kv_cache, slot_mapping) -> None:
        pass

    def forward(self, query, key, value, kv_cache, metadata, output):
        check_forward_inputs(self, metadata, metadata.common, query, key, value, kv_cache, output)
        return output


class _PlainImpl(_CheckingImpl):
    """The same call without any check: the baseline the checks are measured against."""

    def forward(self, query, key, value, kv_cache, metadata, output):
        return output


def _persistent_step(spec: AttentionSpec, num_reqs: int, context: int, device: torch.device,
                     seed: int = 0) -> tuple[CommonAttentionMetadata, int]:
    """A PersistentBatch decode step of ``num_reqs`` requests after ``context`` tokens, pages in random order;
    returns the step's metadata and the cache's page count."""
    bs = spec.block_size
    per_req = -(-(context + 1) // bs)
    num_blocks = num_reqs * per_req
    pages = list(range(num_blocks))
    random.Random(seed).shuffle(pages)
    batch = PersistentBatch(max_num_reqs=num_reqs, max_num_tokens=max(num_reqs, 8192), max_pages_per_req=per_req,
                            block_size=bs, device=device, num_blocks=num_blocks)
    for r in range(num_reqs):
        batch.add_request(r, pages[r * per_req : (r + 1) * per_req], context)
    return batch.prepare({r: 1 for r in range(num_reqs)}), num_blocks


def measure_step(num_reqs: int = 256, context: int = 1024, layers: int = 32, device: Optional[str] = None,
                 calls: int = 2000, repeats: int = 7) -> list[dict]:
    """The ``bad_input_cost`` rows of the module docstring: one engine step's default-mode checks."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=16)
    common, num_blocks = _persistent_step(spec, num_reqs, context, dev)
    hand_made = dataclasses.replace(common, block_table=common.block_table.clone(),
                                    block_table_cpu=common.block_table_cpu.clone(),
                                    slot_mapping=common.slot_mapping.clone())
    hand_made_host = dataclasses.replace(common, block_table=common.block_table_cpu.clone(),
                                         slot_mapping=common.slot_mapping.cpu(),
                                         block_table_cpu=common.block_table_cpu.clone())
    t = num_reqs
    query = torch.empty(t, spec.num_heads, spec.head_size, dtype=torch.bfloat16, device=dev)
    key = torch.empty(t, spec.num_kv_heads, spec.head_size, dtype=torch.bfloat16, device=dev)
    value, output = torch.empty_like(key), torch.empty_like(query)
    kv_cache = torch.empty(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=torch.bfloat16,
                           device=dev)
    builder = _NoOpBuilder(spec, dev, max_num_reqs=num_reqs, max_num_tokens=max(num_reqs, 8192),
                           num_blocks=num_blocks)
    unchecked_build = _NoOpBuilder.build.__wrapped__
    checking, plain = _CheckingImpl(spec), _PlainImpl(spec)
    rows = []
    for mode, batch in (("persistent_batch", common), ("hand_made", hand_made)):
        build_us = _per_call_us(lambda b=batch: builder.build(b), calls, repeats) - _per_call_us(
            lambda b=batch: unchecked_build(builder, b), calls, repeats)
        meta = builder.build(batch)
        checking.forward(query, key, value, kv_cache, meta, output)  # the first call validates in full
        fwd = _per_call_us(lambda m=meta: checking.forward(query, key, value, kv_cache, m, output), 5 * calls,
                           repeats)
        base = _per_call_us(lambda m=meta: _PlainImpl.forward.__wrapped__(plain, query, key, value, kv_cache, m,
                                                                           output), 5 * calls, repeats)
        forward_us, build_us = max(fwd - base, 0.0), max(build_us, 0.0)
        rows.append({"case": "bad_input_cost", "backend": "checks", "peer": None, "B": num_reqs, "L": context + 1,
                     "mode": mode, "device": str(dev), "us": round(build_us, 3),
                     **({"target_us": TARGET_US, "meets_target": build_us <= TARGET_US}
                        if mode == "persistent_batch" else {}), "forward_us": round(forward_us, 3), "layers": layers,
                     "step_total_us": round(build_us + layers * forward_us, 3)})
    host_build = _per_call_us(lambda: check_batch_for_spec(spec, hand_made_host), calls, repeats)
    rows.append({"case": "bad_input_cost", "backend": "checks", "peer": None, "B": num_reqs, "L": context + 1,
                 "mode": "host_tensors_spec_check", "device": "cpu", "us": round(host_build, 3)})
    return rows


def measure(num_reqs: int = 256, context: int = 1024, block_size: int = 16, calls: int = 2000,
            repeats: int = 7) -> list[dict]:
    """The rows of the module docstring."""
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, dtype="bfloat16", block_size=block_size)
    rows = []
    for name, prefills in (("decode", 0), ("mixed", 4)):
        from_lists = _batch(num_reqs, context, prefills, block_size)
        host_tensors = dataclasses.replace(from_lists)  # the same tensors, not marked as checked
        assert not host_tensors.host_checked and from_lists.host_checked
        device_only = dataclasses.replace(from_lists, block_size=None)
        device_only.host_checked = True  # stands for device slots: the host check has nothing to read
        for mode, common in (("host_tensors", host_tensors), ("from_lists", from_lists),
                             ("device_only", device_only)):
            us = _per_call_us(lambda c=common: check_batch_for_spec(spec, c), calls, repeats)
            rows.append({"case": "check_cost", "backend": "validation", "peer": None, "B": num_reqs,
                         "us": round(us, 3), "mode": mode, "batch": name,
                         "tokens": from_lists.num_actual_tokens, "L": context + 1, "block_size": block_size})
    impl = _NoOpImpl(spec)
    meta = _Metadata()
    meta.origin = MetadataOrigin.of(_NoOpImpl, spec)
    impl.check_metadata(meta)  # accepted once: later calls compare one attribute
    unchecked = _NoOpImpl.forward.__wrapped__
    checked_us = _per_call_us(lambda: impl.forward(None, None, None, None, meta, None), 20 * calls, repeats)
    plain_us = _per_call_us(lambda: unchecked(impl, None, None, None, None, meta, None), 20 * calls, repeats)
    rows.append({"case": "forward_check_cost", "backend": "validation", "peer": None, "B": num_reqs,
                 "us": round(max(checked_us - plain_us, 0.0), 3),
                 "with_check_us": round(checked_us, 3), "without_check_us": round(plain_us, 3)})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write {\"rows\": [...]} here (JSON)")
    parser.add_argument("--batch-size", type=int, default=256, help="requests per step (B)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    parser.add_argument("--layers", type=int, default=32, help="forward calls per step (bad_input_cost row)")
    parser.add_argument("--device", default=None, help="where the step's tensors live (default: cuda if present)")
    parser.add_argument("--smoke", action="store_true", help="fewer repeats; prints the rows")
    args = parser.parse_args(argv)
    calls, repeats = (200, 3) if args.smoke else (2000, 7)
    rows = measure_step(args.batch_size, args.context, args.layers, args.device, calls=calls, repeats=repeats)
    rows += measure(args.batch_size, args.context, calls=calls, repeats=repeats)
    if args.out:
        write_rows(args.out, rows)
    if args.smoke or not args.out:
        for row in rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
