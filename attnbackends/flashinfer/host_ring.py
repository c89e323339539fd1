"""Pinned host buffers for the page-table arrays of successive plans, used in turn without waiting for the GPU."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HostBufferRing"]


class HostBufferRing:
    """A few pinned 1-D int32 host buffers, handed out in turn.

    The arrays of a plan are copied to the GPU asynchronously out of its buffer, so the buffer must not be rewritten
    before those copies have run. :meth:`release` records an event after the plan's copies were enqueued;
    :meth:`take` hands the next buffer out only when its event has completed and otherwise returns None (the caller
    then allocates a fresh one: never a wait). A buffer too small for a batch is replaced by the caller's larger one
    at :meth:`release`.

    Off CUDA (``enabled=False``) nothing is kept: :meth:`take` returns None and :meth:`release` does nothing.
    """

    def __init__(self, enabled: bool, slots: int = 2):
        self.enabled = enabled
        self._buffers: list[Optional[torch.Tensor]] = [None] * slots
        self._events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._turn = 0

    def take(self) -> Optional[torch.Tensor]:
        """The next buffer, free of pending copies; None when there is none yet or it is still in use."""
        if not self.enabled:
            return None
        event = self._events[self._turn]
        if event is not None and not event.query():
            return None
        return self._buffers[self._turn]

    def release(self, buffer: Optional[torch.Tensor]) -> None:
        """Keep ``buffer`` (the one just used, possibly a new, larger one) in the current slot and mark the point after
        which the copies out of it have run; the next :meth:`take` moves on to the following slot."""
        if not self.enabled or buffer is None:
            return
        slot = self._turn
        if self._events[slot] is None:
            self._events[slot] = torch.cuda.Event()
        self._buffers[slot] = buffer
        self._events[slot].record()
        self._turn = (slot + 1) % len(self._buffers)
