"""Per-step fault tolerance's average across the islands, as a comm hook around the island's own: overlapped.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

:func:`across_islands_hook` wraps the strategy's hook (the sync inside the island). As DDP hands it a bucket during
the backward pass, the island's hook syncs it as always, and one thread (:class:`AcrossIslands`) then averages the
island's result across the islands while the backward pass goes on: in chunks of consecutive parameters, the same
on every island whatever DDP's bucket layout (a returning island's first step has other buckets than the live
islands' rebuilt ones), in canonical order, each chunk as soon as every bucket holding its parameters has been
synced in the island. For each chunk, each rank of the island sends its 1/M across (rank r of every island meets
rank r of the others, through torchft's fault-tolerant group) and the island's ranks gather the averaged shards on a
group of their own (the hook's collectives inside the island run on DDP's group meanwhile). A bucket's future
completes once every chunk holding its parameters is averaged, so DDP copies the islands' average into the
gradients. A failed cross-island collective leaves the chunk as it was (torchft reports the error) and the vote
drops the step.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.base import CommHookState

__all__ = ["AcrossIslands", "AcrossIslandsState", "across_islands_hook", "parameter_chunks"]


def parameter_chunks(parameters: list[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """``parameters`` in runs of consecutive ones of at most ``limit`` values (a larger one alone)."""
    chunks: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in parameters:
        if chunks and size + p.numel() <= limit:
            chunks[-1].append(p)
            size += p.numel()
        else:
            chunks.append([p])
            size = p.numel()
    return chunks


@dataclass(eq=False)  # told apart by identity: its fields hold a future and a tensor
class _Waiting:
    """A bucket whose island sync is done, waiting for the chunks that hold its parameters."""

    future: torch.futures.Future
    tensor: torch.Tensor
    parameters: list[int]


class AcrossIslands:
    """The cross-island average of each step's gradients, chunk by chunk as the buckets' island syncs end.

    ``average`` averages one chunk's values (fp32, flat, the island's ranks holding the same) across the islands in
    place: each rank its shard, the island gathering the averages on :attr:`group` (the replica's
    :meth:`~lightning_ddpopt.fault_tolerance.replica.Replica.average_chunk`); ``None`` before the island joins the
    quorum (the hook then syncs inside the island only).

    On a CPU the chunks cross as soon as their buckets are synced in the island, beside the backward pass. On CUDA
    they wait for the step's last bucket: the gathers and torchft's all-reduce then follow every collective DDP
    issued, in one order on every rank (NCCL may hang on communicators used in different orders by different ranks).

    Args:
        chunk_values: values of a chunk at most.
    """

    def __init__(self, chunk_values: int) -> None:
        self.average: Callable[[torch.Tensor], None] | None = None
        #: Called once a step before its first chunk (the quorum's participants, for the wire's division).
        self.begin: Callable[[], None] | None = None
        #: Steps whose gradients were averaged across the islands in the backward pass (the vote reads it).
        self.steps = 0
        #: The island's own group for the gathers (``None`` for an island of one rank), made at the hook's install.
        self.group: dist.ProcessGroup | None = None
        #: The parameters DDP syncs, in the order their gradients are ready (the module's, reversed).
        self.parameters: list[torch.nn.Parameter] = []
        self._chunk_values = chunk_values
        self._chunks: list[list[torch.nn.Parameter]] = []
        self._chunk_of: dict[int, int] = {}
        self._device = torch.device("cpu")
        self._worker: Worker | None = None
        self._clear()

    def bind(self, parameters: list[torch.nn.Parameter], device: torch.device) -> None:
        """The parameters DDP syncs, in module order, and the device their gradients are on.

        They are averaged in reverse (the order DDP's buckets become ready), in one order on every island.
        """
        self.parameters = list(reversed(parameters))
        self._chunks = parameter_chunks(self.parameters, self._chunk_values)
        self._chunk_of = {id(p): index for index, chunk in enumerate(self._chunks) for p in chunk}
        self._device = device
        self.start()

    def start(self) -> None:
        """Start the thread that averages (again after :meth:`close`: a later fit, a Fabric loop's next join)."""
        if self._worker is None or not self._worker.alive():
            self._worker = Worker("ddpopt-across-islands")
            if self._device.type == "cuda":  # a new thread's current device is the first GPU
                device = self._device
                self._worker.submit(lambda: torch.cuda.set_device(device))
            self._worker.submit(self._clear)

    def close(self) -> None:
        """End the thread (at teardown)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def new_step(self) -> None:
        """A new optimizer step begins: forget the last one's state (after whatever the thread still holds)."""
        if self._worker is not None:
            self._worker.submit(self._clear)

    def _clear(self) -> None:
        self._where: dict[int, tuple[torch.Tensor, int]] = {}
        self._waiting: list[_Waiting] = []
        self._next = 0
        self._failed: BaseException | None = None

    def submit(self, inner: torch.futures.Future, parameters: list[torch.Tensor]) -> torch.futures.Future:
        """The future of a bucket whose island sync is ``inner``: its tensor once averaged across the islands."""
        if self.average is None or self._worker is None:
            return inner.then(_value)
        result: torch.futures.Future = torch.futures.Future()
        ids = [id(p) for p in parameters]

        def job() -> None:
            if self._failed is not None:  # an earlier bucket of this step failed: so does this one, at once
                result.set_exception(self._failed)
                return
            try:
                value = inner.wait()
                self._take(value[0] if isinstance(value, list) else value, parameters, ids, result)
            except BaseException as error:
                self._failed = error
                for future in [*(waiting.future for waiting in self._waiting), result]:
                    if not future.done():
                        future.set_exception(error)
                self._waiting = []

        self._worker.submit(job)
        return result

    def _take(
        self,
        tensor: torch.Tensor,
        parameters: list[torch.Tensor],
        ids: list[int],
        result: torch.futures.Future,
    ) -> None:
        offset = 0
        for p in parameters:
            self._where[id(p)] = (tensor, offset)
            offset += p.numel()
        self._waiting.append(_Waiting(result, tensor, ids))
        if self._device.type == "cuda" and any(id(p) not in self._where for p in self.parameters):
            return  # on CUDA after the step's last bucket (see the class)
        while self._next < len(self._chunks) and all(id(p) in self._where for p in self._chunks[self._next]):
            if self._next == 0 and self.begin is not None:
                self.begin()
            self._average(self._chunks[self._next])
            self._next += 1
        done = [w for w in self._waiting if all(self._chunk_of.get(i, -1) < self._next for i in w.parameters)]
        self._waiting = [w for w in self._waiting if w not in done]
        if self._next == len(self._chunks):
            assert not self._waiting, "a bucket waits for no chunk"
            # Counted before the last future completes: DDP's backward returns then, and the vote reads the count.
            self.steps += 1
            self._clear()
        for waiting in done:
            waiting.future.set_result(waiting.tensor)

    def _average(self, chunk: list[torch.nn.Parameter]) -> None:
        places = [(*self._where[id(p)], p.numel()) for p in chunk]
        flat = torch.cat([tensor[offset : offset + size].to(torch.float32) for tensor, offset, size in places])
        assert self.average is not None
        self.average(flat)
        start = 0
        for tensor, offset, size in places:
            tensor[offset : offset + size].copy_(flat[start : start + size])
            start += size


def _value(future: torch.futures.Future) -> torch.Tensor:
    value = future.value()
    return value[0] if isinstance(value, list) else value


@dataclass(kw_only=True)
class AcrossIslandsState(CommHookState):
    """The state of :func:`across_islands_hook`.

    Args:
        hook: the strategy's hook (the sync inside the island), and ``hook_state`` its state.
        across: the cross-island average (shared by the strategy's fault tolerance, which sets what it averages with).
    """

    hook: Callable[..., torch.futures.Future[torch.Tensor]]
    hook_state: object
    across: AcrossIslands = field(repr=False)


def across_islands_hook(state: AcrossIslandsState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The island's hook on ``bucket``, then its result averaged across the islands (see the module)."""
    return state.across.submit(state.hook(state.hook_state, bucket), bucket.parameters())
