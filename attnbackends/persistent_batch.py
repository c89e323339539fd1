"""The engine's batch kept across steps: request page tables in preallocated host arrays, updated incrementally, and
each step's :class:`~attnbackends.metadata.CommonAttentionMetadata` written into persistent device buffers with one
host-to-device copy.

:func:`~attnbackends.metadata.build_common_metadata` rebuilds a step from Python lists (milliseconds at a hundred
requests); :class:`PersistentBatch` is what an engine keeps instead. Its rows are the live requests; adding,
finishing and growing a request touches only that request's row, and :meth:`PersistentBatch.prepare` turns the
step's token counts into the metadata with a fixed number of NumPy operations, whatever the number of requests.

Buffers
-------
- the host page table ``[max_num_reqs, max_pages_per_req]`` int32 (NumPy), row r holding the pages of the request in
  row r and 0 past them, with each row's page count and cached-token count beside it;
- two pinned staging buffers, each one contiguous block laid out as
  ``query_start_loc [max_num_reqs + 1] int32 | seq_lens [max_num_reqs] int32 | slot_mapping [max_num_tokens]
  int64 | block_table [max_num_reqs, max_pages_per_req] int32``;
- one device buffer of the same layout: every step's metadata tensors are views of it, at the same addresses every
  step (what CUDA graphs and kept launch plans rely on). With ``device="cpu"`` (tests) it is a host buffer and the
  copy a memcpy.

A step writes its small arrays into a staging buffer, brings that buffer's block table up to date with the rows
changed since the buffer was last used (only the changed page-table entries are copied), and copies the buffer's
prefix up to the step's last block-table row to the device in one asynchronous copy.

Run-ahead: the two staging buffers alternate between steps. Step N's host copies (``query_start_loc_cpu``,
``seq_lens_cpu``, ``block_table_cpu``) are views of its staging buffer, which step N + 2 rewrites; before that,
``prepare`` waits until the GPU has run everything enqueued before step N + 1's ``prepare`` (an event recorded
there), so a pending copy out of the buffer (its own, or one a builder enqueued from the host copies) is never
overwritten. The host may thus be one step ahead of the GPU without ever waiting; further ahead, ``prepare``
blocks. The device buffer is single: step N + 1's copy is enqueued after step N's kernels on the same stream, so
enqueue a step's kernels before preparing the next one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Hashable, Optional

import numpy as np
import torch

from .metadata import CommonAttentionMetadata
from .platform import check_device_available

__all__ = ["PersistentBatch"]

_INT32_MAX = np.iinfo(np.int32).max
_VIEW_CACHE_SIZE = 64  # (staging buffer, num_reqs, padded tokens) shapes whose tensor views are kept


def _positive(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` for every (s, n) of ``starts``, ``lengths`` (int64 [k] each)."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


class PersistentBatch:
    """The engine's requests across steps, and each step's metadata in persistent device buffers.

    Parameters
    ----------
    max_num_reqs : requests the batch holds at once (rows).
    max_num_tokens : tokens per step, padding included (the length of the slot-mapping buffer).
    max_pages_per_req : pages a request may hold: ceil(max_model_len / block_size), plus room for speculative
        tokens. The width of every step's ``block_table``.
    block_size : tokens per KV-cache page.
    device : where the metadata tensors live ("cuda", "cuda:N" or "cpu"; CPU for tests and host-only use).
    num_blocks : pages in the KV cache. When given, every page id is range-checked as it is added, and each step's
        metadata records ``pages_checked_for = num_blocks`` (the page guard then has nothing left to check).
    decode_threshold : requests with at most this many new tokens count as decodes and go first in every step
        (the builder's ``reorder_batch_threshold``).
    exclusive_pages : refuse a page that another live request (or the same request) already holds (needs
        ``num_blocks``). Off by default: requests of a prefix cache share their full prefix pages. Either way,
        two requests never write one page in a step (checked per step, as :func:`build_common_metadata` does).

    Requests are identified by any hashable id. A request's row moves when others finish (the last row fills the
    hole) and when ``prepare`` puts decodes first; ``req_ids`` is the current row order.

    Memory: the host table 4 * R * W bytes, and three buffers (two pinned staging, one device) of about
    4 * R * W + 8 * max_num_tokens bytes each (R = max_num_reqs, W = max_pages_per_req).

    Attributes
    ----------
    step_req_ids : list
        The last prepared step's requests in its order (decodes first): request i of the metadata.
    num_decodes : int
        How many of them are decodes (at most ``decode_threshold`` new tokens).
    step_positions : numpy.ndarray
        [num_actual_tokens] int64: the position of each of the step's tokens (context + i), for the engine's
        position ids.

    Examples
    --------
    >>> batch = PersistentBatch(max_num_reqs=256, max_num_tokens=8192, max_pages_per_req=512, block_size=16,
    ...                         device="cpu")
    >>> batch.add_request("a", [7, 8], num_computed_tokens=0)
    >>> common = batch.prepare({"a": 20})      # a 20-token prompt: context 0, seq_len 20
    >>> batch.step_req_ids, common.num_actual_tokens
    (['a'], 20)
    >>> common = batch.prepare({"a": 1})       # its first decode: context 20
    >>> int(common.seq_lens_cpu[0]), int(common.slot_mapping[0])
    (21, 132)
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_pages_per_req: int,
        block_size: int,
        device: "torch.device | str" = "cpu",
        *,
        num_blocks: Optional[int] = None,
        decode_threshold: int = 1,
        exclusive_pages: bool = False,
    ) -> None:
        self.max_num_reqs = _positive("max_num_reqs", max_num_reqs)
        self.max_num_tokens = _positive("max_num_tokens", max_num_tokens)
        self.max_pages_per_req = _positive("max_pages_per_req", max_pages_per_req)
        self.block_size = _positive("block_size", block_size)
        self.num_blocks = None if num_blocks is None else _positive("num_blocks", num_blocks)
        self.decode_threshold = _positive("decode_threshold", decode_threshold)
        if self.max_pages_per_req * self.block_size > _INT32_MAX:
            raise ValueError(f"max_pages_per_req * block_size ({self.max_pages_per_req * self.block_size}) must fit "
                             "seq_lens' int32")
        if exclusive_pages and self.num_blocks is None:
            raise ValueError("exclusive_pages=True needs num_blocks (the owner of every page is tracked)")
        self.exclusive_pages = bool(exclusive_pages)
        self._page_limit = self.num_blocks if self.num_blocks is not None else _INT32_MAX + 1
        self.device = check_device_available(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        R, T, W = self.max_num_reqs, self.max_num_tokens, self.max_pages_per_req

        # Host state, row r = the request self._ids[r]; rows [num_requests, R) are free and all-zero.
        self._table = np.zeros((R, W), dtype=np.int32)
        self._table_flat = self._table.reshape(-1)
        self._num_pages = np.zeros(R, dtype=np.int64)
        self._computed = np.zeros(R, dtype=np.int64)
        self._ids: list[Hashable] = []
        self._row: dict[Hashable, int] = {}
        self._row_base = np.arange(R, dtype=np.int64) * W  # flat index of each row's column 0
        self._arange = np.arange(T, dtype=np.int64)
        if self.exclusive_pages:
            self._owner = np.full(self.num_blocks, -1, dtype=np.int64)  # page -> serial of the request holding it
            self._serial = np.full(R, -1, dtype=np.int64)
            self._next_serial = 0

        # One contiguous layout for the staging buffers and the device buffer (byte offsets).
        self._off_qsl = 0
        self._off_seq = 4 * (R + 1)
        self._off_slots = -(-(self._off_seq + 4 * R) // 8) * 8
        self._off_table = self._off_slots + 8 * T
        nbytes = self._off_table + 4 * R * W
        self._device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._device_views = self._typed_views(self._device_bytes)
        self._staging = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)]
        self._staging_views = [self._typed_views(s) for s in self._staging]
        self._staging_np = [tuple(v.numpy() for v in views) for views in self._staging_views]
        for qsl, _, _, _ in self._staging_np:
            qsl[0] = 0  # never written again: every step's cumulative sums go from index 1
        # The page-table entries changed on the host, as runs (flat index of the first, length), and how far into
        # this log each staging buffer has copied: a step copies what changed since its buffer's previous step.
        self._change_at: list[int] = []
        self._change_len: list[int] = []
        self._synced = [0, 0]
        self._next = 0
        self._events = [torch.cuda.Event() for _ in range(2)] if self._cuda else None
        self._used = [False, False]  # whether a step has used the staging buffer (then its event is recorded)
        self._views: dict[tuple[int, int, int], tuple] = {}
        self._keys: Optional[list] = None  # the last mapping's request ids, and their rows
        self._keys_rows = np.zeros(0, dtype=np.int64)

        self.step_req_ids: list[Hashable] = []
        self.num_decodes = 0
        self.step_positions = np.zeros(0, dtype=np.int64)

    def _typed_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        R, T, W = self.max_num_reqs, self.max_num_tokens, self.max_pages_per_req
        return (buf[self._off_qsl : self._off_qsl + 4 * (R + 1)].view(torch.int32),
                buf[self._off_seq : self._off_seq + 4 * R].view(torch.int32),
                buf[self._off_slots : self._off_slots + 8 * T].view(torch.int64),
                buf[self._off_table :].view(torch.int32).view(R, W))

    @property
    def num_requests(self) -> int:
        """Live requests (the rows in use)."""
        return len(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._row

    @property
    def req_ids(self) -> list[Hashable]:
        """The live requests in row order (a copy): the order an array given to :meth:`prepare` follows."""
        return list(self._ids)

    def pages(self, req_id: Hashable) -> np.ndarray:
        """[num_pages] int32, a copy of the request's page ids."""
        row = self._row_of(req_id)
        return self._table[row, : self._num_pages[row]].copy()

    def num_computed_tokens(self, req_id: Hashable) -> int:
        """Tokens of the request whose K/V are in the cache (or will be, once the prepared steps have run)."""
        return int(self._computed[self._row_of(req_id)])

    def _row_of(self, req_id: Hashable) -> int:
        try:
            return self._row[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} is not in the batch (never added, or finished)") from None
        except TypeError:
            raise ValueError(f"request ids must be hashable, got {req_id!r}") from None

    def _page_array(self, req_id: Hashable, pages: Any, have: int) -> np.ndarray:
        """``pages`` as a checked integer array: ids >= 0, inside the cache, fitting the row after ``have``."""
        if type(pages) is not np.ndarray:
            pages = pages.cpu().numpy() if isinstance(pages, torch.Tensor) else np.asarray(pages)
        k = pages.size
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            if k == 0:
                return np.zeros(0, dtype=np.int64)
            raise ValueError(f"pages of request {req_id!r} must be a 1-D sequence of int page ids, got "
                             f"{pages.dtype} with shape {pages.shape}")
        if have + k > self.max_pages_per_req:
            raise ValueError(f"request {req_id!r} would hold {have + k} pages; max_pages_per_req is "
                             f"{self.max_pages_per_req}")
        if k == 1:
            low = high = int(pages[0])
        elif k:
            low, high = int(pages.min()), int(pages.max())
        else:
            return pages
        limit = self._page_limit
        if low < 0 or high >= limit:
            j = int(np.argmax(pages < 0)) if low < 0 else int(np.argmax(pages >= limit))
            allowed = f"[0, {limit}) (num_blocks)" if self.num_blocks is not None else "[0, 2**31)"
            raise ValueError(f"pages[{j}] = {int(pages[j])} of request {req_id!r} is outside {allowed}")
        return pages

    def _claim(self, req_id: Hashable, arr: np.ndarray, serial: int) -> None:
        """exclusive_pages: make ``serial`` the owner of ``arr``; ValueError naming a page already held."""
        owners = self._owner[arr]
        held = np.flatnonzero(owners != -1)
        if held.size == 0 and arr.size > 1:
            ordered = np.sort(arr)
            twice = np.flatnonzero(ordered[1:] == ordered[:-1])
            if twice.size:
                raise ValueError(f"page {int(ordered[twice[0]])} is given twice to request {req_id!r} "
                                 "(exclusive_pages)")
        if held.size:
            page, owner = int(arr[held[0]]), int(owners[held[0]])
            rows = np.flatnonzero(self._serial[: len(self._ids)] == owner)
            holder = self._ids[int(rows[0])] if rows.size else req_id
            raise ValueError(f"page {page} of request {req_id!r} is already held by request {holder!r} "
                             "(exclusive_pages: live requests share no page)")
        self._owner[arr] = serial

    def _changed(self, row: int, first: int, count: int) -> None:
        """Entries [first, first + count) of ``row`` changed: the staging buffers copy them at their next steps."""
        self._change_at.append(row * self.max_pages_per_req + first)
        self._change_len.append(count)

    def add_request(self, req_id: Hashable, pages: Any = (), num_computed_tokens: int = 0) -> None:
        """Add a request in the next free row.

        Parameters
        ----------
        req_id : any hashable id, not already in the batch.
        pages : [k] int page ids (a NumPy array is fastest; lists and CPU tensors are accepted), in token order:
            token t of the request lives in ``pages[t // block_size]``. More may follow with :meth:`append_pages`.
        num_computed_tokens : tokens already in the cache (a prefix-cache hit, a resumed request); the request's
            next step starts at this position. They must fit in ``pages``.
        """
        try:
            known = req_id in self._row
        except TypeError:
            raise ValueError(f"request ids must be hashable, got {req_id!r}") from None
        if known:
            raise ValueError(f"request {req_id!r} is already in the batch (finish it before adding it again)")
        row = len(self._ids)
        if row >= self.max_num_reqs:
            raise ValueError(f"the batch holds max_num_reqs ({self.max_num_reqs}) requests; finish one before adding "
                             f"request {req_id!r}")
        if (isinstance(num_computed_tokens, (bool, np.bool_)) or not isinstance(num_computed_tokens, (int, np.integer))
                or num_computed_tokens < 0):
            raise ValueError(f"num_computed_tokens of request {req_id!r} must be an int >= 0, got "
                             f"{num_computed_tokens!r}")
        arr = self._page_array(req_id, pages, 0)
        k = arr.size
        if num_computed_tokens > k * self.block_size:
            raise ValueError(f"request {req_id!r}: {num_computed_tokens} computed tokens need "
                             f"{-(-int(num_computed_tokens) // self.block_size)} pages, {k} given "
                             f"(block_size {self.block_size})")
        if self.exclusive_pages:
            self._claim(req_id, arr, self._next_serial)
            self._serial[row] = self._next_serial
            self._next_serial += 1
        self._table[row, :k] = arr
        self._num_pages[row] = k
        self._computed[row] = num_computed_tokens
        self._ids.append(req_id)
        self._row[req_id] = row
        if k:
            self._changed(row, 0, k)

    def append_pages(self, req_id: Hashable, pages: Any) -> None:
        """Give the request more pages, after the ones it holds.

        pages : [k] int page ids (as for :meth:`add_request`).
        """
        try:
            row = self._row[req_id]
        except (KeyError, TypeError):
            row = self._row_of(req_id)  # raises, naming the request
        have = int(self._num_pages[row])
        arr = self._page_array(req_id, pages, have)
        k = arr.size
        if k == 0:
            return
        if self.exclusive_pages:
            self._claim(req_id, arr, int(self._serial[row]))
        self._table[row, have : have + k] = arr
        self._num_pages[row] = have + k
        self._changed(row, have, k)

    def truncate_pages(self, req_id: Hashable, num_pages: int) -> np.ndarray:
        """Keep the request's first ``num_pages`` pages (e.g. after rejected speculative tokens); returns the pages
        dropped ([k] int32), which the engine may free. The request's cached tokens must still fit in what is
        kept when it is next scheduled (see :meth:`set_num_computed_tokens`)."""
        row = self._row_of(req_id)
        have = int(self._num_pages[row])
        if (isinstance(num_pages, (bool, np.bool_)) or not isinstance(num_pages, (int, np.integer))
                or not 0 <= num_pages <= have):
            raise ValueError(f"num_pages for request {req_id!r} must be an int in [0, {have}] (the pages it holds), "
                             f"got {num_pages!r}")
        dropped = self._table[row, num_pages:have].copy()
        if self.exclusive_pages:
            self._owner[dropped] = -1
        self._table[row, num_pages:have] = 0
        self._num_pages[row] = num_pages
        if num_pages < have:
            self._changed(row, int(num_pages), have - int(num_pages))
        return dropped

    def set_num_computed_tokens(self, req_id: Hashable, num_computed_tokens: int) -> None:
        """Set the request's cached-token count: :meth:`prepare` advances it by the step's tokens, and an engine
        sets it back where fewer were kept (rejected speculative tokens, a preempted request resumed)."""
        row = self._row_of(req_id)
        if (isinstance(num_computed_tokens, (bool, np.bool_)) or not isinstance(num_computed_tokens, (int, np.integer))
                or num_computed_tokens < 0):
            raise ValueError(f"num_computed_tokens of request {req_id!r} must be an int >= 0, got "
                             f"{num_computed_tokens!r}")
        self._computed[row] = num_computed_tokens

    def finish_request(self, req_id: Hashable) -> np.ndarray:
        """Remove the request; the last row moves into its row. Returns its pages ([k] int32) for the engine to
        free or keep in its prefix cache."""
        row = self._row_of(req_id)
        self._keys = None  # rows move
        last = len(self._ids) - 1
        k = int(self._num_pages[row])
        pages = self._table[row, :k].copy()
        if self.exclusive_pages:
            self._owner[pages] = -1
        if row != last:
            k_last = int(self._num_pages[last])
            width = max(k, k_last)
            self._table[row, :width] = self._table[last, :width]
            self._num_pages[row] = k_last
            self._computed[row] = self._computed[last]
            moved = self._ids[last]
            self._ids[row] = moved
            self._row[moved] = row
            if self.exclusive_pages:
                self._serial[row] = self._serial[last]
            if width:
                self._changed(row, 0, width)
            k = k_last
        self._table[last, :k] = 0
        if k:
            self._changed(last, 0, k)
        self._num_pages[last] = 0
        self._computed[last] = 0
        self._ids.pop()
        del self._row[req_id]
        return pages

    def _counts_per_row(self, scheduled: Any) -> np.ndarray:
        """The step's new tokens per row (int64 [num_requests], 0 = not scheduled; the array form unchecked for
        negative counts)."""
        n_rows = len(self._ids)
        if isinstance(scheduled, Mapping):
            k = len(scheduled)
            keys = list(scheduled)
            if keys == self._keys:  # the same requests in the same order as the last step, and no row moved since
                rows = self._keys_rows
            else:
                try:
                    rows = np.fromiter(map(self._row.__getitem__, keys), np.int64, k)
                except (KeyError, TypeError):
                    unknown = next(r for r in keys if r not in self._row)
                    raise ValueError(f"scheduled request {unknown!r} is not in the batch (never added, or "
                                     "finished)") from None
                self._keys, self._keys_rows = keys, rows
            counts = self._token_counts(scheduled, k)
            if counts is None and k == n_rows:
                return np.ones(n_rows, dtype=np.int64)
            per_row = np.zeros(n_rows, dtype=np.int64)
            per_row[rows] = 1 if counts is None else counts
            return per_row
        counts = np.asarray(scheduled)
        if counts.shape != (n_rows,) or (counts.dtype.kind not in "iu" and n_rows):
            raise ValueError(f"scheduled must map request ids to new tokens, or be an int array of shape "
                             f"({n_rows},) in req_ids order (0: not scheduled); got {counts.dtype} of shape "
                             f"{counts.shape}")
        return counts.astype(np.int64)  # a copy: the rows are reordered below

    @staticmethod
    def _token_counts(scheduled: Mapping, k: int) -> Optional[np.ndarray]:
        """The mapping's values as int64 [k], each an int >= 1, or None where every one is 1 (a decode step needs
        no array); ValueError naming the first that is not an int >= 1."""
        values = scheduled.values()
        try:
            total = sum(values)
        except TypeError:
            total = None
        if type(total) is int and total == k and k and min(values) == 1:  # ints >= 1 summing to k: all 1
            return None
        try:
            counts = np.fromiter(values, np.int64, k)
            # fromiter would cut 1.5 to 1 and read "1" as 1: a float or a string makes Python's sum differ from
            # the counts' in type or value, or fail
            good = isinstance(total, (int, np.integer)) and total == counts.sum() and (not k or counts.min() >= 1)
        except (TypeError, ValueError, OverflowError):
            good = False
        if not good:
            for r, c in scheduled.items():
                if isinstance(c, (bool, np.bool_)) or not isinstance(c, (int, np.integer)) or c < 1:
                    raise ValueError(f"scheduled[{r!r}] must be an int >= 1 (the request's new tokens), got {c!r}")
            raise ValueError("scheduled token counts must be ints >= 1 that fit int64")
        return counts

    def _swap_rows(self, a: np.ndarray, b: np.ndarray) -> None:
        """Exchange rows ``a[i]`` and ``b[i]`` (int64 [m] each, all distinct)."""
        self._keys = None
        rows, other = np.concatenate([a, b]), np.concatenate([b, a])
        width = int(self._num_pages[rows].max())
        self._table[rows, :width] = self._table[other, :width]
        self._num_pages[rows] = self._num_pages[other]
        self._computed[rows] = self._computed[other]
        if self.exclusive_pages:
            self._serial[rows] = self._serial[other]
        ids, where = self._ids, self._row
        for i, j in zip(a.tolist(), b.tolist()):
            ids[i], ids[j] = ids[j], ids[i]
            where[ids[i]], where[ids[j]] = i, j
        if width:
            self._change_at.extend((rows * self.max_pages_per_req).tolist())
            self._change_len.extend([width] * rows.size)

    def _order_rows(self, counts: np.ndarray) -> int:
        """Move rows (and ``counts`` with them) so that decodes come first, then the other scheduled requests, then
        the unscheduled ones, with as few row exchanges as that takes. Returns the number of decodes."""
        kind = (counts > self.decode_threshold).astype(np.int8)  # 0 decode, 1 longer, 2 not scheduled
        kind[counts == 0] = 2
        if kind.size > 1 and np.count_nonzero(kind[1:] < kind[:-1]):
            start = 0
            for k in (0, 1):
                end = start + int(np.count_nonzero(kind == k))
                a = start + np.flatnonzero(kind[start:end] != k)
                if a.size:
                    b = end + np.flatnonzero(kind[end:] == k)
                    self._swap_rows(a, b)
                    counts[a], counts[b] = counts[b], counts[a].copy()
                    kind[a], kind[b] = k, kind[a].copy()
                start = end
        return int(np.count_nonzero(kind == 0))

    def _sync_staging(self, b: int) -> None:
        """Copy the page-table entries changed since staging buffer ``b`` was last used into it."""
        at, lengths, start = self._change_at, self._change_len, self._synced[b]
        count = len(at) - start
        if count == 0:
            return
        table = self._staging_np[b][3].reshape(-1)
        if count == 1:
            first, stop = at[start], at[start] + lengths[start]
            table[first:stop] = self._table_flat[first:stop]
        else:
            idx = np.array(at[start:], dtype=np.int64)
            if max(lengths[start:]) > 1:
                idx = _ranges(idx, np.array(lengths[start:], dtype=np.int64))
            table[idx] = self._table_flat[idx]
        self._synced[b] = len(at)
        done = min(self._synced)
        if done:  # runs both buffers have copied
            del at[:done], lengths[:done]
            self._synced = [self._synced[0] - done, self._synced[1] - done]

    def _views_for(self, b: int, n: int, padded: int) -> tuple:
        """The step's tensor views (device, host) and the copy's two byte ranges, kept per shape: slicing a
        tensor costs about a microsecond, and steady steps repeat their shapes."""
        key = (b, n, padded)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _VIEW_CACHE_SIZE:
                self._views.clear()
            dq, ds, dslots, dtab = self._device_views
            hq, hs, _, htab = self._staging_views[b]
            nbytes = self._off_table + 4 * n * self.max_pages_per_req
            dst, src = self._device_bytes[:nbytes], self._staging[b][:nbytes]
            if not self._cuda:  # NumPy copies host memory at memcpy speed, torch's byte copy far slower
                dst, src = dst.numpy(), src.numpy()
            views = self._views[key] = (dq[: n + 1], hq[: n + 1], ds[:n], hs[:n], dtab[:n], htab[:n],
                                        dslots[:padded], dst, src)
        return views

    def prepare(self, scheduled: Any, *, num_padded_tokens: Optional[int] = None) -> CommonAttentionMetadata:
        """The step's metadata, decodes first, in the persistent device buffers.

        Parameters
        ----------
        scheduled : the step's new tokens per request: a mapping ``{req_id: num_new_tokens}`` (each >= 1; requests
            left out do not run), or an int array [num_requests] in :attr:`req_ids` order (0: not scheduled).
            Request i of the step has context ``num_computed_tokens`` (see :meth:`add_request`) and its new tokens
            sit at the positions after it; the step advances ``num_computed_tokens`` by them.
        num_padded_tokens : the slot mapping's length (a CUDA-graph size; padding slots are -1); default: the
            step's tokens. At most ``max_num_tokens``.

        Returns
        -------
        CommonAttentionMetadata
            Its tensors are views of the persistent buffers (the device ones at the same addresses every step);
            the host copies (``query_start_loc_cpu``, ``seq_lens_cpu``, ``block_table_cpu``) stay valid until the
            step after next's ``prepare``. ``block_table`` is [num_reqs, max_pages_per_req] int32 with 0 past each
            request's pages; ``slot_mapping`` [num_padded_tokens] int64. The host checks are done
            (``host_checked``), and, with ``num_blocks``, so is the page range check (``pages_checked_for``).

        The step's request order is :attr:`step_req_ids` (the first :attr:`num_decodes` are the decodes); lay out
        the step's tokens in that order. :attr:`step_positions` ([num_actual_tokens] int64) gives each token's
        position. Raises ValueError for an unknown request, a bad token count, more tokens than
        ``max_num_tokens``, a request without the pages its new tokens need, or two requests writing one page; a
        refused step changes no request's state (rows may have moved) and nothing on the device.
        """
        counts = self._counts_per_row(scheduled)
        n_rows = counts.size
        thr = self.decode_threshold
        if n_rows:
            low, high = counts.min(), counts.max()
            if low < 0:
                i = int(np.argmax(counts < 0))
                raise ValueError(f"scheduled[{i}] (request {self._ids[i]!r}) is {int(counts[i])}: new tokens must "
                                 "be >= 0")
        if n_rows and low >= 1 and high <= thr:
            n = num_decodes = n_rows  # every request decodes: already in order
        elif n_rows and low >= 1:  # every request runs: in order when no longer query precedes a decode
            longer = counts > thr
            n, num_decodes = n_rows, n_rows - int(np.count_nonzero(longer))
            if np.count_nonzero(longer[:num_decodes]):
                num_decodes = self._order_rows(counts)
        else:
            num_decodes = self._order_rows(counts) if n_rows else 0
            n = n_rows - int(np.count_nonzero(counts == 0))
        q = counts[:n]
        b = self._next
        stg_qsl, stg_seq, stg_slots, _ = self._staging_np[b]
        if self._cuda:
            if self._used[1 - b]:
                # Marks the end of everything enqueued for the previous step (its kernels, its builders' copies out
                # of the other staging buffer); the step after this one waits for it before rewriting that buffer.
                self._events[1 - b].record(torch.cuda.current_stream(self.device))
            if self._used[b]:
                self._events[b].synchronize()
        # Nothing below reaches the device until the copy at the end: an error leaves the device buffers as
        # they were, and a staging buffer is only read once it is complete.
        ends = q.cumsum()
        T = int(ends[-1]) if n else 0
        if T > self.max_num_tokens:
            raise ValueError(f"the step schedules {T} tokens; max_num_tokens is {self.max_num_tokens}")
        padded = T
        if num_padded_tokens is not None:
            if (isinstance(num_padded_tokens, (bool, np.bool_)) or not isinstance(num_padded_tokens, (int, np.integer))
                    or not T <= num_padded_tokens <= self.max_num_tokens):
                raise ValueError(f"num_padded_tokens must be an int in [{T}, {self.max_num_tokens}] (the step's "
                                 f"tokens, max_num_tokens), got {num_padded_tokens!r}")
            padded = int(num_padded_tokens)
        bs = self.block_size
        ctx = self._computed[:n]
        seq = ctx + q
        num_pages = self._num_pages[:n]
        last_col = seq - 1
        last_col //= bs
        if n and np.count_nonzero(last_col >= num_pages):
            self._raise_short(seq, q, num_pages)
        stg_qsl[1 : n + 1] = ends
        stg_seq[:n] = seq
        slots = stg_slots[:T]
        if T == n:  # single-token requests: each token sits at its context length
            pos = seq - 1
            col = last_col
            flat = self._row_base[:n] + col
        else:
            pos = self._arange[:T] + np.repeat(ctx - (ends - q), q)
            col = pos // bs
            flat = np.repeat(self._row_base[:n], q) + col
        page = self._table_flat.take(flat)
        np.subtract(page, col, out=slots, dtype=np.int64)  # slot = page * bs + pos % bs = (page - col) * bs + pos
        slots *= bs
        slots += pos
        if not self.exclusive_pages and n > 1:
            self._check_written_pages(page, flat, T == n)
        if padded > T:
            stg_slots[T:padded] = -1
        self._sync_staging(b)

        dqsl, hqsl, dseq, hseq, dtab, htab, dslots, dst, src = self._views_for(b, n, padded)
        if self._cuda:
            dst.copy_(src, non_blocking=True)
        else:
            np.copyto(dst, src)
        self._used[b] = True
        self._next = 1 - b
        common = CommonAttentionMetadata(
            query_start_loc=dqsl,
            query_start_loc_cpu=hqsl,
            seq_lens=dseq,
            seq_lens_cpu=hseq,
            block_table=dtab,
            slot_mapping=dslots,
            num_reqs=n,
            num_actual_tokens=T,
            max_query_len=(1 if T == n else int(q.max())) if n else 0,
            max_seq_len=int(seq.max()) if n else 0,
            block_table_cpu=htab,
            block_size=bs,
        )
        common.host_checked = True
        if self.num_blocks is not None:
            common.pages_checked_for = self.num_blocks
        self._computed[:n] = seq
        self.num_decodes = num_decodes
        self.step_req_ids = self._ids[:n]
        self.step_positions = pos
        return common

    def _raise_short(self, seq: np.ndarray, q: np.ndarray, num_pages: np.ndarray) -> None:
        bs = self.block_size
        need = -(-seq // bs)
        i = int(np.argmax(need > num_pages))
        raise ValueError(f"request {self._ids[i]!r} holds {int(num_pages[i])} pages; its {int(seq[i])} tokens "
                         f"({int(seq[i] - q[i])} computed + {int(q[i])} new) need {int(need[i])} "
                         f"(block_size {bs}): append_pages first")

    def _check_written_pages(self, page: np.ndarray, flat: np.ndarray, one_per_request: bool) -> None:
        """No page receives new tokens of two requests (or two columns of one): they would share cache slots.
        ``page`` and ``flat`` (the block-table entry, row * width + column) per token of the step."""
        if one_per_request:
            written, entries = page, flat
        else:
            first = np.empty(flat.size, dtype=bool)
            first[0] = True
            np.not_equal(flat[1:], flat[:-1], out=first[1:])
            written, entries = page[first], flat[first]
        ordered = written.copy()
        ordered.sort()
        twice = ordered[1:] == ordered[:-1]
        if not np.count_nonzero(twice):
            return
        value = int(ordered[np.argmax(twice)])
        (r1, c1), (r2, c2) = (divmod(int(e), self.max_pages_per_req) for e in entries[written == value][:2])
        raise ValueError(f"page {value} receives new tokens of request {self._ids[r1]!r} (its page {c1}) and of "
                         f"request {self._ids[r2]!r} (its page {c2}) this step: two tokens would share a cache "
                         "slot (duplicate slots)")

    def __repr__(self) -> str:
        return (f"PersistentBatch({len(self._ids)}/{self.max_num_reqs} requests, max_num_tokens={self.max_num_tokens}, "
                f"max_pages_per_req={self.max_pages_per_req}, block_size={self.block_size}, device={self.device})")
