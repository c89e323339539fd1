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
from pathlib import Path
from typing import Callable, Optional, Sequence


from attnbackends import AttentionSpec, build_common_metadata
from attnbackends.interface import AttentionImpl
from attnbackends.metadata import CommonAttentionMetadata, MetadataOrigin
from attnbackends.validation import check_batch_for_spec

__all__ = ["main", "measure"]


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
            rows.append({"case": "check_cost", "B": num_reqs, "us": round(us, 3), "mode": mode, "batch": name,
                         "tokens": from_lists.num_actual_tokens, "L": context + 1, "block_size": block_size})
    impl = _NoOpImpl(spec)
    meta = _Metadata()
    meta.origin = MetadataOrigin.of(_NoOpImpl, spec)
    impl.check_metadata(meta)  # accepted once: later calls compare one attribute
    unchecked = _NoOpImpl.forward.__wrapped__
    checked_us = _per_call_us(lambda: impl.forward(None, None, None, None, meta, None), 20 * calls, repeats)
    plain_us = _per_call_us(lambda: unchecked(impl, None, None, None, None, meta, None), 20 * calls, repeats)
    rows.append({"case": "forward_check_cost", "B": num_reqs, "us": round(max(checked_us - plain_us, 0.0), 3),
                 "with_check_us": round(checked_us, 3), "without_check_us": round(plain_us, 3)})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write {\"rows\": [...]} here (JSON)")
    parser.add_argument("--batch-size", type=int, default=256, help="requests per step (B)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per request")
    parser.add_argument("--smoke", action="store_true", help="fewer repeats; prints the rows")
    args = parser.parse_args(argv)
    calls, repeats = (200, 3) if args.smoke else (2000, 7)
    rows = measure(args.batch_size, args.context, calls=calls, repeats=repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if args.smoke or not args.out:
        for row in rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
