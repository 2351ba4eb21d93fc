"""Timelines: marking points in a rank's work and reading them back as seconds, without waiting for the device.

On CPU a mark is ``time.perf_counter()`` and is known at once. On a CUDA device the host runs ahead of the
kernels it queues, so host clocks measure queueing, not work: there a mark is a CUDA event recorded on the
current stream, and it becomes a time only once the device has passed it. :meth:`Timeline.seconds` never
blocks (it answers ``None`` until then); :meth:`Timeline.wait` blocks and is meant for the end of a run.
Readers (the ledger, the callbacks) keep marks and resolve them later, so training never pays a host sync.

Seconds on a CUDA timeline count on the device's clock from a reference event taken at construction, offset
so that they start at the ``time.perf_counter()`` of that moment; compare them with marks of the same timeline,
not with host clocks.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["CudaTimeline", "HostTimeline", "Timeline", "timeline_for"]

Mark = Any
"""What :meth:`Timeline.mark` returns: a float on the host, a ``torch.cuda.Event`` on a CUDA device."""


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
        """The mark itself."""
        return mark

    def wait(self, mark: float) -> float:
        """The mark itself."""
        return mark


class CudaTimeline:
    """Marks are timing events recorded on the current CUDA stream of ``device``; resolved once the device passed them.

    Args:
        device: the CUDA device whose streams are marked.
    """

    device_clock = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device={device!r}: CudaTimeline marks CUDA streams, pass a 'cuda' device")
        self.device = device
        self._reference = torch.cuda.Event(enable_timing=True)
        self._reference.record(torch.cuda.current_stream(device))
        self._reference.synchronize()  # once, at construction: every later mark is read without waiting
        self._reference_s = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        """A timing event recorded on ``device``'s current stream: it fires when the work queued before it is done."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, mark: torch.cuda.Event) -> float | None:
        """Seconds on the device clock, or ``None`` while the device is still busy with work before the mark."""
        if not mark.query():
            return None
        return self._reference_s + self._reference.elapsed_time(mark) / 1e3

    def wait(self, mark: torch.cuda.Event) -> float:
        """Seconds on the device clock, after blocking until the device has reached the mark."""
        mark.synchronize()
        return self._reference_s + self._reference.elapsed_time(mark) / 1e3


def timeline_for(device: torch.device) -> Timeline:
    """CUDA events on a CUDA device, host clocks everywhere else."""
    if device.type == "cuda":
        return CudaTimeline(device)
    return HostTimeline()
