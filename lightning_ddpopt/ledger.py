"""CommLedger: what each gradient sync did, per rank - the single source the callbacks read."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BucketRecord", "CommLedger", "StepRecord"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class BucketRecord:
    """One bucket of one sync round.

    Attributes:
        index: DDP's bucket index.
        num_elements: number of gradient elements in the bucket.
        logical_bytes: bytes the gradients occupy as DDP holds them (what a plain allreduce sends).
        wire_bytes: bytes this rank contributed to collectives for the bucket, after compression; ``None`` when
            the hook does not report them (a user-supplied hook).
        start_s: ``time.perf_counter()`` when DDP handed the bucket to the hook.
        end_s: ``time.perf_counter()`` when the hook's future completed.
    """

    index: int
    num_elements: int
    logical_bytes: int
    wire_bytes: int | None
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepRecord:
    """All gradient syncs between two optimizer steps.

    Attributes:
        step: 1-based count of optimizer steps this ledger has closed.
        sync_rounds: how many times DDP synchronised gradients for this step (1 is ideal with accumulation).
        logical_bytes: uncompressed gradient bytes over all rounds.
        wire_bytes: bytes sent after compression over all rounds; ``None`` when a hook did not report them.
        sync_time_s: summed over rounds, first bucket handed to the hook until the last bucket's future completed.
        bucket_bytes: the logical size of each bucket in the last round, in DDP's bucket order.
        micro_batches: training batches this rank ran for this step (the accumulation group's length).
        samples: samples in those batches on this rank; ``None`` when a batch's size could not be determined.
        sync_start_s: ``time.perf_counter()`` when the step's first bucket reached its hook: this rank's arrival at
            the sync point (``None`` without syncs).
    """

    step: int
    sync_rounds: int
    logical_bytes: int
    wire_bytes: int | None
    sync_time_s: float
    bucket_bytes: tuple[int, ...]
    micro_batches: int = 0
    samples: int | None = None
    sync_start_s: float | None = None

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed over sent bytes; ``None`` when unknown or nothing was sent."""
        if not self.wire_bytes:
            return None
        return self.logical_bytes / self.wire_bytes


class _OpenBucket:
    __slots__ = ("index", "num_elements", "logical_bytes", "wire_bytes", "start_s", "end_s")

    def __init__(self, index: int, num_elements: int, logical_bytes: int, start_s: float) -> None:
        self.index = index
        self.num_elements = num_elements
        self.logical_bytes = logical_bytes
        self.wire_bytes: int | None = None
        self.start_s = start_s
        self.end_s: float | None = None

    def freeze(self) -> BucketRecord:
        end = self.end_s if self.end_s is not None else self.start_s
        return BucketRecord(self.index, self.num_elements, self.logical_bytes, self.wire_bytes, self.start_s, end)


class CommLedger:
    """Records, on one rank, every bucket each comm hook handled and groups them into optimizer steps.

    Hooks write (through :meth:`record_hook` and :meth:`add_wire_bytes`); the strategy counts training batches
    (:meth:`add_micro_batch`) and closes a step at every optimizer step (:meth:`close_step`); callbacks read
    :attr:`steps` and the running totals. Nothing here communicates: figures are this rank's own.

    Args:
        history: how many closed steps to keep in :attr:`steps` (older ones only count in the totals).
    """

    def __init__(self, history: int = 4096) -> None:
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int, got {history!r}")
        self._lock = threading.Lock()
        self._rounds: list[list[_OpenBucket]] = []
        self._micro_batches = 0
        self._samples: int | None = 0
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.total_steps = 0
        self.total_sync_rounds = 0
        self.total_logical_bytes = 0
        self.total_wire_bytes = 0

    def record_hook(self, hook: CommHook) -> CommHook:
        """Wrap ``hook`` so that every bucket it handles is timed and its uncompressed size recorded.

        The wrapper keeps the hook's name, which DDP reports as ``comm_hook`` in its logging data.
        """

        @functools.wraps(hook)
        def recorded(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            entry = self._open_bucket(bucket.index(), buffer.numel(), buffer.numel() * buffer.element_size())
            future = hook(state, bucket)

            def finish(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                entry.end_s = time.perf_counter()
                return done.value()

            return future.then(finish)

        return recorded

    def add_wire_bytes(self, bucket_index: int, nbytes: int) -> None:
        """Add bytes that a hook put into collectives for bucket ``bucket_index`` of the current round."""
        with self._lock:
            for entry in self._rounds[-1] if self._rounds else ():
                if entry.index == bucket_index:
                    entry.wire_bytes = (entry.wire_bytes or 0) + nbytes
                    return
        raise RuntimeError(f"no open bucket {bucket_index} in the ledger: add_wire_bytes called outside a hook")

    def add_micro_batch(self, samples: int | None) -> None:
        """Count one training batch of the current step; ``samples=None`` when its size is unknown."""
        with self._lock:
            self._micro_batches += 1
            self._samples = None if samples is None or self._samples is None else self._samples + samples

    def close_step(self) -> StepRecord:
        """Close the current optimizer step: group the rounds recorded since the last call into a record."""
        with self._lock:
            rounds, self._rounds = self._rounds, []
            micro_batches, samples = self._micro_batches, self._samples
            self._micro_batches, self._samples = 0, 0
            frozen = [[entry.freeze() for entry in round_] for round_ in rounds]
            buckets = [record for round_ in frozen for record in round_]
            wire: int | None = sum(b.wire_bytes or 0 for b in buckets)
            if any(b.wire_bytes is None for b in buckets):
                wire = None
            record = StepRecord(
                step=self.total_steps + 1,
                sync_rounds=len(frozen),
                logical_bytes=sum(b.logical_bytes for b in buckets),
                wire_bytes=wire,
                sync_time_s=sum(max(b.end_s for b in r) - min(b.start_s for b in r) for r in frozen),
                bucket_bytes=tuple(b.logical_bytes for b in frozen[-1]) if frozen else (),
                micro_batches=micro_batches,
                samples=samples if micro_batches else None,
                sync_start_s=frozen[0][0].start_s if frozen else None,
            )
            self.steps.append(record)
            self.total_steps += 1
            self.total_sync_rounds += record.sync_rounds
            self.total_logical_bytes += record.logical_bytes
            self.total_wire_bytes += record.wire_bytes or 0
            return record

    @property
    def open_sync_rounds(self) -> int:
        """Sync rounds recorded since the last closed step."""
        with self._lock:
            return len(self._rounds)

    def _open_bucket(self, index: int, num_elements: int, logical_bytes: int) -> _OpenBucket:
        entry = _OpenBucket(index, num_elements, logical_bytes, time.perf_counter())
        with self._lock:
            # DDP launches buckets strictly in index order, so bucket 0 starts a new round.
            if index == 0 or not self._rounds:
                self._rounds.append([])
            self._rounds[-1].append(entry)
        return entry
