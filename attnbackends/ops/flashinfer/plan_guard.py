"""Ordering a FlashInfer wrapper's plans against the GPU copies of the plans before them.

A wrapper's ``plan()`` (and the compiled module's ``plan`` that :mod:`.fast_plan` calls) writes the batch's schedule
into the wrapper's pinned host integer workspace and enqueues an asynchronous copy of it to the GPU. A second plan
of the same wrapper rewrites that pinned buffer in place: if the GPU has not yet run the first copy (the host is a
step ahead, as in an engine that schedules the next step while this one runs), the first batch's kernels read the
second batch's schedule and index pages that are not theirs. :func:`planning` closes that window: before a wrapper
is planned again, the host waits until the copy enqueued by its previous plan has run (an event recorded after that
plan), which bounds the host's lead to one plan per wrapper and costs nothing when the GPU keeps up.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["planning"]

# wrapper -> the event recorded on the stream right after its last plan's copy was enqueued
_LAST_PLAN: "weakref.WeakKeyDictionary[Any, torch.cuda.Event]" = weakref.WeakKeyDictionary()


@contextmanager
def planning(wrapper: Any) -> Iterator[None]:
    """Wrap one plan of ``wrapper`` (a FlashInfer wrapper on a CUDA device): waits for its previous plan's copy to
    the GPU, then records when this one's is done. Without CUDA (a stand-in wrapper) and inside CUDA-graph
    capture (plans are not captured) it does nothing."""
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        yield
        return
    event = _LAST_PLAN.get(wrapper)
    if event is not None:
        event.synchronize()
    yield
    if event is None:
        event = _LAST_PLAN[wrapper] = torch.cuda.Event()
    event.record()
