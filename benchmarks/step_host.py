"""Host cost of an engine step's common metadata: :class:`attnbackends.PersistentBatch` (the step's page appends and
``prepare``) against :func:`attnbackends.build_common_metadata` from Python lists (what the engine path cost before),
at B requests holding ``B * --pages-per-req`` pages.

    python -m benchmarks.run --suite step_host                        # on the GPU host: results/ and RESULTS.md
    python -m benchmarks.step_host --out rows.json                    # the rows alone (CUDA)
    python -m benchmarks.step_host --device cpu --smoke               # a quick CPU run; prints the rows

The times are host wall-clock times per call (the device copy is asynchronous and not waited for; the GPU only
copies, so it keeps up). Rows (PERF.md ``step_host`` / ``persistent`` / ``build_common_metadata``), one per
``batch``:

- ``decode``: B single-token decodes, every request's context inside its last page at staggered offsets, so about
  B / block_size requests cross into a new page and get one appended each step;
- ``mixed``: B - 4 such decodes and four 512-token chunks of prompts on 2048 cached tokens (the chunked requests
  are set back after each step, so every step has the same shape).

Fields: ``us`` (the median step: appends + ``prepare`` with a ``{req_id: tokens}`` dict; ``mean_us`` the mean),
``array_us`` (the median step with the token counts as an array in row order), ``peer_us``
(``build_common_metadata`` from lists of page ids), ``ratio`` = us / peer_us; ``add_us`` and ``finish_us`` (one
``add_request`` of a request with --pages-per-req pages given as a NumPy array, one ``finish_request``, with B
requests live; medians), ``add_list_us`` (the pages as a list); ``copy_kib`` (the step's one host-to-device copy:
the device's rows of the block table are copied whole, max_pages_per_req wide). With ``--device cpu`` the copy is
a memcpy on the host and counts in ``us``; on CUDA it is one asynchronous copy launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from attnbackends import PersistentBatch, build_common_metadata

from .report import write_rows

__all__ = ["main", "measure"]

CHUNK, CHUNK_CONTEXT, NUM_CHUNKS = 512, 2048, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_us(fn: Callable[[], float], repeats: int) -> float:
    """Median of ``repeats`` calls of ``fn`` (each returns microseconds per call)."""
    return statistics.median(fn() for _ in range(repeats))


def _step_times(work: "_Workload", steps: int, repeats: int, as_array: bool) -> tuple[float, float]:
    """(median, mean) µs per step over ``repeats`` runs of ``steps`` steps: the median is what a step costs
    (a shared host's preemptions left out), the mean what steps cost in all."""
    times = [t for _ in range(repeats) for t in work.timed_steps(steps, as_array)]
    return statistics.median(times), statistics.fmean(times)


class _Workload:
    """B requests in a PersistentBatch, and the engine's own bookkeeping beside it (each decode's context, so it
    knows which request needs a page before the step: outside the timing, as the engine's scheduler does it)."""

    def __init__(self, batch_kind: str, num_reqs: int, pages_per_req: int, block_size: int, steps: int,
                 device: torch.device, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.bs = block_size
        chunks = NUM_CHUNKS if batch_kind == "mixed" else 0
        grow = steps // block_size + 2  # pages a decode appends over every step this workload runs
        chunk_pages = -(-(CHUNK_CONTEXT + CHUNK) // block_size)
        width = max(pages_per_req + grow, chunk_pages)
        num_blocks = num_reqs * (width + 1)
        self.pool = rng.permutation(num_blocks).astype(np.int32)
        self.next_page = 0
        self.batch = PersistentBatch(num_reqs, 8192, width, block_size, device, num_blocks=num_blocks)
        self.decodes = list(range(num_reqs - chunks))
        self.chunks = list(range(num_reqs - chunks, num_reqs))
        # each decode's context inside its last page, at offsets staggered across requests
        self.context = (pages_per_req - 1) * block_size + (np.arange(len(self.decodes)) * 7) % block_size
        for r in self.decodes:
            self.batch.add_request(r, self._take(pages_per_req), int(self.context[r]))
        for r in self.chunks:
            self.batch.add_request(r, self._take(chunk_pages), CHUNK_CONTEXT)
        self.scheduled = {r: 1 for r in self.decodes} | {r: CHUNK for r in self.chunks}

    def _take(self, n: int) -> np.ndarray:
        pages = self.pool[self.next_page : self.next_page + n]
        self.next_page += n
        return pages

    def timed_steps(self, steps: int, as_array: bool) -> list[float]:
        """µs of each of ``steps`` steps (the step's page appends and its prepare)."""
        batch = self.batch
        counts = np.array([self.scheduled[r] for r in batch.req_ids], dtype=np.int64)  # rows never move here
        times = []
        for _ in range(steps):
            opening = np.flatnonzero(self.context % self.bs == 0).tolist()  # the new token opens a page
            pages = [self._take(1) for _ in opening]
            start = time.perf_counter()
            for r, page in zip(opening, pages):
                batch.append_pages(r, page)
            batch.prepare(counts if as_array else self.scheduled)
            times.append((time.perf_counter() - start) * 1e6)
            self.context += 1
            for r in self.chunks:  # the same chunk shape every step
                batch.set_num_computed_tokens(r, CHUNK_CONTEXT)
        return times

    def peer_lists(self) -> tuple[list[int], list[int], list[list[int]]]:
        """The next step as build_common_metadata takes it (decode-first lists, page ids as Python lists), after
        its page appends."""
        for r in np.flatnonzero(self.context % self.bs == 0).tolist():
            self.batch.append_pages(r, self._take(1))
        order = self.decodes + self.chunks
        return ([self.scheduled[r] for r in order], [self.batch.num_computed_tokens(r) for r in order],
                [self.batch.pages(r).tolist() for r in order])


def _add_finish_us(num_reqs: int, pages_per_req: int, block_size: int, device: torch.device, calls: int,
                   seed: int = 1) -> dict:
    """Median µs of one finish_request and one add_request (pages as an array, and as a list) with B requests
    live: each call finishes a random request and adds a new one on its pages."""
    rng = np.random.default_rng(seed)
    num_blocks = num_reqs * pages_per_req
    batch = PersistentBatch(num_reqs, 8192, pages_per_req, block_size, device, num_blocks=num_blocks)
    pool = rng.permutation(num_blocks).astype(np.int32)
    computed = pages_per_req * block_size - 3
    for r in range(num_reqs):
        batch.add_request(r, pool[r * pages_per_req : (r + 1) * pages_per_req], computed)
    add, add_list, finish = [], [], []
    for i in range(2 * calls):
        victim = batch.req_ids[int(rng.integers(len(batch)))]
        start = time.perf_counter()
        pages = batch.finish_request(victim)
        finish.append(time.perf_counter() - start)
        given = pages.tolist() if i % 2 else pages
        start = time.perf_counter()
        batch.add_request(num_reqs + i, given, computed)
        (add_list if i % 2 else add).append(time.perf_counter() - start)
    batch.prepare({r: 1 for r in batch.req_ids})
    _sync(device)
    return {"add_us": round(statistics.median(add) * 1e6, 2),
            "add_list_us": round(statistics.median(add_list) * 1e6, 2),
            "finish_us": round(statistics.median(finish) * 1e6, 2)}


def measure(num_reqs: int = 256, pages_per_req: int = 256, block_size: int = 16, device: str = "cuda",
            steps: int = 200, repeats: int = 5, peer_calls: int = 5) -> list[dict]:
    """The rows of the module docstring."""
    dev = torch.device(device)
    updates = _add_finish_us(num_reqs, pages_per_req, block_size, dev, calls=max(steps, 50))
    rows = []
    for kind in ("decode", "mixed"):
        work = _Workload(kind, num_reqs, pages_per_req, block_size, steps * (2 * repeats + 1), dev)
        work.timed_steps(max(steps // 4, 2), as_array=False)  # warm: views cached, first copies done
        _sync(dev)
        us, mean_us = _step_times(work, steps, repeats, as_array=False)
        array_us, _ = _step_times(work, steps, repeats, as_array=True)
        _sync(dev)
        query, context, tables = work.peer_lists()
        build_common_metadata(query, context, tables, block_size, dev)

        def peer() -> float:
            start = time.perf_counter()
            for _ in range(peer_calls):
                build_common_metadata(query, context, tables, block_size, dev)
            return (time.perf_counter() - start) / peer_calls * 1e6

        peer_us = _median_us(peer, repeats)
        _sync(dev)
        batch = work.batch
        rows.append({
            "case": "step_host", "backend": "persistent", "peer": "build_common_metadata", "batch": kind,
            "B": num_reqs, "pages": num_reqs * pages_per_req, "tokens": sum(query), "block_size": block_size,
            "max_pages_per_req": batch.max_pages_per_req, "device": str(dev),
            "us": round(us, 2), "peer_us": round(peer_us, 2), "ratio": round(us / peer_us, 5),
            "mean_us": round(mean_us, 2), "array_us": round(array_us, 2), **updates,
            "copy_kib": round((batch._off_table + 4 * len(query) * batch.max_pages_per_req) / 1024, 1),
        })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write {\"rows\": [...]} here (JSON)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a host-only smoke run)")
    parser.add_argument("--batch-size", type=int, default=256, help="requests per step (B)")
    parser.add_argument("--pages-per-req", type=int, default=256, help="pages each request holds (64k in all at B=256)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="few steps and repeats; prints the rows")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; pass --device cpu for a host-only run")
    steps, repeats, peer_calls = (10, 1, 1) if args.smoke else (200, 5, 5)
    rows = measure(args.batch_size, args.pages_per_req, args.block_size, args.device, steps, repeats, peer_calls)
    if args.out:
        write_rows(args.out, rows)
    if args.smoke or not args.out:
        for row in rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
