"""Reading a device tensor later without making the host wait: the one way the package brings values to the host.

On a GPU, ``tensor.item()`` or ``.cpu()`` makes the host wait until the device has computed the tensor, which throws
away the host's lead over the device (every later kernel launch waits too). A :class:`DeferredRead` queues the copy
instead, on a stream of its own that waits for the tensor (and for the collective that fills it, if one is given),
into pinned host memory, and records an event; :meth:`DeferredRead.read`, called a step or a meeting later, finds the
event long passed. The compute stream never waits for the collective: a rank that is early does not stall its device
for the others. On a CPU it reads the tensor (after the collective) when asked.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DeferredRead", "to_device"]


class DeferredRead:
    """``tensor``'s values on their way to the host.

    ``work``: the collective that fills ``tensor``, if any; ``inputs``: the tensors it reads, kept alive (and marked
    in use by the copying stream, for the caching allocator) until the collective is done with them.
    """

    def __init__(
        self, tensor: torch.Tensor, work: dist.Work | None = None, inputs: tuple[torch.Tensor, ...] = ()
    ) -> None:
        self._tensor, self._work, self._inputs = tensor, work, inputs
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if not tensor.is_cuda:
            return
        # From the high-priority pool: torch hands out pooled streams in turn, and a default-priority one could be a
        # comm hook's side stream (hooks/streams.py), which would then wait for this copy's collective.
        stream = torch.cuda.Stream(device=tensor.device, priority=-1)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after the kernels that wrote the tensor
        with torch.cuda.stream(stream):
            if work is not None:
                work.wait()  # orders this stream (not the compute stream) after the collective
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        for used in (tensor, *inputs):
            used.record_stream(stream)

    def read(self) -> torch.Tensor:
        """The values, on the host (on a CPU: the tensor itself, once its collective is done)."""
        if self._copied is not None:
            self._copied.synchronize()  # long passed when read a step or a meeting later
            self._inputs = ()
            assert self._host is not None
            return self._host
        if self._work is not None:
            self._work.wait()
        return self._tensor


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the CPU to a GPU through pinned memory, so the host does not wait for the device.

    A copy from ordinary host memory to a GPU waits until the device has run what was queued before it.
    """
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
