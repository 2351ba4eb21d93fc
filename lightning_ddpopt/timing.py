"""Timelines: marking points in a rank's work and reading them back as seconds, without waiting for the device.

On CPU a mark is ``time.perf_counter()`` and is known at once. On a CUDA device the host runs ahead of the
kernels it queues, so host clocks measure queueing, not work: there a mark is a CUDA event recorded on the
current stream, and it becomes a time only once the device has passed it. :meth:`Timeline.seconds` never
blocks (it answers ``None`` until then); :meth:`Timeline.wait` blocks and is meant for the end of a run.
Readers (the ledger, the callbacks) keep marks and resolve them later, so training never pays a host sync.

Seconds on a CUDA timeline count on the device's clock from a reference event taken at construction (through a
chain of recent anchors, so that float32 event times keep their resolution), offset so that they start at the
``time.perf_counter()`` of that moment; compare them with marks of the same timeline, not with host clocks.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["CudaTimeline", "HostTimeline", "Timeline", "timeline_for"]

Mark = Any
"""What :meth:`Timeline.mark` returns: a float on the host, a ``torch.cuda.Event`` and its anchor on a CUDA device."""


class Timeline(Protocol):
    """Where marks come from and how they become seconds."""

    @property
    def device_clock(self) -> bool:
        """Whether marks are taken on a device's clock (resolved later) rather than the host's."""

    def mark(self) -> Mark:
        """Mark this point of the work queued so far (on the current stream for a device)."""

    def seconds(self, mark: Mark) -> float | None:
        """The mark's time in seconds, or ``None`` while the device has not reached it; never blocks."""

    def wait(self, mark: Mark) -> float:
        """The mark's time in seconds, blocking until the device has reached it."""


class HostTimeline:
    """Marks are ``time.perf_counter()`` readings: resolved the moment they are taken."""

    device_clock = False

    def mark(self) -> float:
        """Now, in seconds."""
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        """The mark itself: known the moment it is taken, so reading it never waits."""
        return mark

    wait = seconds


@dataclass(slots=True, eq=False)
class _Anchor:
    """A reference event and, once resolved, its distance in seconds from the timeline's first reference."""

    event: torch.cuda.Event
    host_s: float
    offset_s: float | None


class CudaTimeline:
    """Marks are timing events recorded on the current CUDA stream of ``device``; resolved once the device passed them.

    CUDA gives the time between two events as float32 milliseconds, whose resolution falls with the distance
    (about 8 ms after a day). So each mark is timed from a recent reference event (an anchor, renewed every
    ``reanchor_s`` seconds), and anchors are chained to the first one in float64: durations keep a resolution of
    about a microsecond however long the run.

    Args:
        device: the CUDA device whose streams are marked.
        reanchor_s: host seconds after which a mark records a new anchor first.
    """

    device_clock = True

    def __init__(self, device: torch.device, reanchor_s: float = 10.0) -> None:
        if device.type != "cuda":
            raise ValueError(f"device={device!r}: CudaTimeline marks CUDA streams, pass a 'cuda' device")
        self.device = device
        self.reanchor_s = reanchor_s
        self._lock = threading.Lock()
        first = torch.cuda.Event(enable_timing=True)
        first.record(torch.cuda.current_stream(device))
        first.synchronize()  # once, at construction: every later mark is read without waiting
        self._reference_s = time.perf_counter()
        self._current = _Anchor(first, self._reference_s, 0.0)
        # Anchors not yet placed on the chain, after the newest one that is.
        self._resolved = self._current
        self._unresolved: list[_Anchor] = []

    def mark(self) -> tuple[torch.cuda.Event, _Anchor]:
        """A timing event on ``device``'s current stream (fires once the work before it is done), and its anchor."""
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            now = time.perf_counter()
            if now - self._current.host_s >= self.reanchor_s:
                anchor_event = torch.cuda.Event(enable_timing=True)
                anchor_event.record(stream)
                self._current = _Anchor(anchor_event, now, None)
                self._unresolved.append(self._current)
            anchor = self._current
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event, anchor

    def seconds(self, mark: tuple[torch.cuda.Event, _Anchor]) -> float | None:
        """Seconds on the device clock, or ``None`` while the device is still busy with work before the mark."""
        event, anchor = mark
        if not event.query() or not self._place(anchor, wait=False):
            return None
        assert anchor.offset_s is not None
        return self._reference_s + anchor.offset_s + anchor.event.elapsed_time(event) / 1e3

    def wait(self, mark: tuple[torch.cuda.Event, _Anchor]) -> float:
        """Seconds on the device clock, after blocking until the device has reached the mark."""
        event, anchor = mark
        event.synchronize()
        self._place(anchor, wait=True)
        assert anchor.offset_s is not None
        return self._reference_s + anchor.offset_s + anchor.event.elapsed_time(event) / 1e3

    def _place(self, anchor: _Anchor, wait: bool) -> bool:
        """Chain the anchors up to ``anchor``; whether it is placed (it always is with ``wait``)."""
        with self._lock:
            while anchor.offset_s is None and self._unresolved:
                following = self._unresolved[0]
                if wait:
                    following.event.synchronize()
                elif not following.event.query():
                    return False
                previous = self._resolved
                assert previous.offset_s is not None
                following.offset_s = previous.offset_s + previous.event.elapsed_time(following.event) / 1e3
                self._resolved = self._unresolved.pop(0)
            return anchor.offset_s is not None


def timeline_for(device: torch.device) -> Timeline:
    """CUDA events on a CUDA device, host clocks everywhere else."""
    if device.type == "cuda":
        return CudaTimeline(device)
    return HostTimeline()


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median host seconds of ``work`` (run to completion on ``device``) over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
