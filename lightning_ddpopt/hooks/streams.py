"""Where a lossy hook's CUDA work runs: a side stream of its own, so that its waits never hold back the backward pass.

DDP calls a comm hook on the thread of the backward pass, with the backward pass's stream (the *compute* stream)
current. ``Work.wait()`` makes the *current* stream wait for a collective, so a hook that waits between its stages
(PowerSGD: P's all-reduce before Q is computed; int8: the all-to-all before the reduction) would queue every later
gradient kernel behind the network. On CUDA, :meth:`SideStreams.run` runs a bucket's chain like this instead:

1. ``side.wait_stream(compute)``: the chain starts after the kernels that wrote the bucket's gradients;
2. with ``side`` current, everything the chain launches - compression, the collectives' waits, decompression, the
   state it keeps between steps (error feedback, Q memories) - is ordered on ``side``; the compute stream goes on
   with the next buckets' gradients;
3. the bucket's buffer (made on the compute stream, used on ``side``) is marked with ``record_stream(side)``, so the
   caching allocator does not hand its memory out again before ``side`` is done with it;
4. the future handed to DDP is CUDA-aware (``Future(devices=[device])``) and completed with ``side`` current: it
   records an event on ``side``, and DDP's wait for it at the end of the backward pass makes the compute stream (not
   the host) wait for that event;
5. whoever reads the kept state on another stream (a checkpoint) first calls :meth:`SideStreams.join`.

On a CPU :meth:`SideStreams.run` calls the chain as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["SideStreams"]

T = TypeVar("T")


class SideStreams:
    """One side stream per CUDA device for a hook state's chains (see the module doc)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def run(self, buffer: torch.Tensor, chain: Callable[[], T]) -> T:
        """Run ``chain`` (a bucket's work on ``buffer``) on the side stream of its device; on a CPU, as it is."""
        if not buffer.is_cuda:
            return chain()
        device = buffer.device
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        buffer.record_stream(side)
        with torch.cuda.stream(side):
            return chain()

    def call(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the side stream, after what the current stream queued; with no side stream yet, as it is.

        For work on the kept state outside a hook call (a commit at a save).
        """
        if not self._streams:
            return work()
        ((device, side),) = self._streams.items()  # one device per rank
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            return work()

    def join(self) -> None:
        """Order each device's current stream after everything its side stream was given so far (no host wait)."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)
