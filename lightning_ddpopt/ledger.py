"""CommLedger: what each gradient sync did, per rank - the single source the callbacks read.

What it hands the callbacks and the diagnosis: one :class:`StepRecord` per optimizer step, a :class:`BucketRecord`
per bucket, and the figures computed from them.

Times are taken on a :mod:`~lightning_ddpopt.timing` timeline: host clocks on CPU, CUDA events on a GPU (where
host clocks would time the queueing of kernels, not the transfer). A closed step becomes a :class:`StepRecord`
once every mark in it has resolved, which on a GPU is a step or so later; nothing here waits for the device
except :meth:`CommLedger.flush`.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.timing import HostTimeline, Mark, Timeline

__all__ = [
    "QUALITY_FIELDS",
    "BucketRecord",
    "CommHook",
    "CommLedger",
    "StepRecord",
    "busy_seconds",
    "exposed_seconds",
    "local_drift",
    "run_quality",
]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class BucketRecord:
    """One bucket of one sync round.

    Attributes:
        index: DDP's bucket index.
        num_elements: number of gradient elements in the bucket.
        logical_bytes: bytes the gradients occupy as DDP holds them (what a plain allreduce sends).
        wire_bytes: bytes this rank contributed to collectives for the bucket, after compression; ``None`` when
            the hook does not report them (a user-supplied hook). With a hierarchical hook: what crossed nodes.
        intra_node_bytes: with a hierarchical hook, the bytes this rank put into collectives inside its node (the
            bucket in its own precision); 0 otherwise.
        intra_node_s: with a hierarchical hook on a CPU, host seconds of its stages inside the node (their
            collectives, waits and copies); 0 otherwise.
        cross_node_s: likewise, host seconds of its stage between the nodes.
        start_s: when DDP handed the bucket to the hook (on a GPU: when the bucket's gradients were computed).
        end_s: when the hook's result was ready (on a GPU: when its collectives had finished on the device).
        transfer_hidden: the bytes in flight while the ranks trained on (local SGD's overlapped sync): ``start_s`` to
            ``end_s`` is what the step waited for them, not their transfer.
        compression: squared norms ``(given, dropped, fed_back)`` of what this rank's lossy hook compressed, what
            the compression dropped of it and the stored error it added first (0 without error feedback); ``None``
            when not measured (see :attr:`CommLedger.error_every`). This rank's own part: int8's re-quantisation of
            the summed chunks and the rounding of a half-precision sum are not counted.
        drift: for a parameter sync of local SGD, squared norms ``(own, mean)`` of this rank's parameter change
            since the last sync and of the mean change over the ranks; ``None`` otherwise.
    """

    index: int
    num_elements: int
    logical_bytes: int
    wire_bytes: int | None
    start_s: float
    end_s: float
    intra_node_bytes: int = 0
    intra_node_s: float = 0.0
    cross_node_s: float = 0.0
    transfer_hidden: bool = False
    compression: tuple[float, float, float] | None = None
    drift: tuple[float, float] | None = None


@dataclass(frozen=True)
class StepRecord:
    """All gradient syncs between two optimizer steps, and the step's own times.

    Times are seconds on the ledger's timeline (see :mod:`lightning_ddpopt.timing`): differences between them are
    durations; on a GPU they are device times.

    Attributes:
        step: 1-based count of optimizer steps this ledger has closed.
        sync_rounds: how many times DDP synchronised gradients for this step (1 is ideal with accumulation).
        logical_bytes: uncompressed gradient bytes over all rounds.
        wire_bytes: bytes sent after compression over all rounds; ``None`` when a hook did not report them. With a
            hierarchical hook, the bytes that crossed nodes.
        intra_node_bytes: with a hierarchical hook, the bytes sent inside the node over all rounds; 0 otherwise.
        intra_node_s: with a hierarchical hook on a CPU, host seconds of its stages inside the node, summed over the
            buckets (stages of different buckets run at once: a sum of work, not a span); 0 otherwise.
        cross_node_s: likewise, host seconds of its stage between the nodes.
        sync_time_s: summed over rounds, first bucket handed to the hook until the last bucket's future completed: the
            sync's span, which overlaps the backward pass (DDP hands a bucket over as soon as its gradients are
            computed, while the backward pass goes on with the rest).
        exposed_time_s: summed over rounds, from the last bucket handed to the hook (the backward pass has computed
            every gradient by then) until the last bucket's future completed: what the step waits for the sync after
            its own compute, the part of the span the backward pass does not hide.
        busy_time_s: summed over rounds, the time during which at least one bucket was in the hook's hands (the
            union of the buckets' hand-over-to-result intervals): when the link was busy with this rank's sync or
            its compression, or the collectives queued behind one another. Bytes over this time is the bandwidth
            the sync achieved.
        bucket_bytes: the logical size of each bucket in the last round, in DDP's bucket order.
        micro_batches: training batches this rank ran for this step (the accumulation group's length).
        samples: samples in those batches on this rank; ``None`` when a batch's size could not be determined.
        sync_start_s: when the step's first bucket reached its hook: this rank's arrival at the sync point
            (``None`` without syncs).
        start_s: when the step's first micro-batch started (``None`` when the strategy did not report batches).
        end_s: when the optimizer step was done.
        step_time_s: ``end_s`` minus the previous step's ``end_s``, data loading included; for the first step of a
            run or an epoch, ``end_s - start_s`` (the loader's start-up is not a step's cost). ``None`` when unknown.
        transfer_hidden: some of the step's bytes were in flight while the ranks trained on (see :class:`BucketRecord`):
            ``sync_time_s`` is not their transfer time, so no bandwidth follows from it.
        compression_error: this rank's relative compression error, ``||dropped|| / ||given||`` over the step's
            measured buckets: what the lossy hook dropped over what it was given (gradient plus the error fed back,
            before the dropped part is kept to be fed back next step); ``None`` when not measured.
        error_feedback: the norm of the error fed back, over the norm of what was given; ``None`` when not measured.
        drift_ratio: at a local SGD parameter sync, ``||own change||^2 / ||mean change||^2``; its mean over the ranks
            minus 1 is the squared spread of the ranks' changes around their mean, relative to the mean
            (:func:`local_drift`); ``None`` at other steps.
    """

    step: int
    sync_rounds: int
    logical_bytes: int
    wire_bytes: int | None
    sync_time_s: float
    bucket_bytes: tuple[int, ...]
    intra_node_bytes: int = 0
    intra_node_s: float = 0.0
    cross_node_s: float = 0.0
    exposed_time_s: float = 0.0
    busy_time_s: float = 0.0
    micro_batches: int = 0
    samples: int | None = None
    sync_start_s: float | None = None
    start_s: float | None = None
    end_s: float | None = None
    step_time_s: float | None = None
    transfer_hidden: bool = False
    compression_error: float | None = None
    error_feedback: float | None = None
    drift_ratio: float | None = None

    @property
    def compression_ratio(self) -> float | None:
        """Uncompressed over sent bytes; ``None`` when unknown or nothing was sent."""
        if not self.wire_bytes:
            return None
        return self.logical_bytes / self.wire_bytes


def local_drift(drift_ratios: list[float]) -> float | None:
    """The spread of the ranks' parameter changes around their mean, relative to the mean change.

    ``drift_ratios``: every rank's :attr:`StepRecord.drift_ratio` of one sync. Since the mean change is the same on
    every rank, ``mean(||own_i||^2) - ||mean||^2`` is the mean squared distance of the ranks' changes from it.
    """
    if not drift_ratios:
        return None
    return math.sqrt(max(0.0, statistics.fmean(drift_ratios) - 1.0))


def exposed_seconds(round_: list[BucketRecord]) -> float:
    """From the last bucket's hand-over (every gradient computed) to the last result: the sync the step waits for."""
    return max(0.0, max(b.end_s for b in round_) - max(b.start_s for b in round_))


def busy_seconds(round_: list[BucketRecord]) -> float:
    """The length of the union of the buckets' hand-over-to-result intervals."""
    busy, reached = 0.0, -math.inf
    for start, end in sorted((b.start_s, b.end_s) for b in round_):
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy


#: Per-step quality figures of the ledger (see :class:`StepRecord`), kept over the run for the report.
QUALITY_FIELDS = ("compression_error", "error_feedback", "drift_ratio")


def run_quality(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """The run's quality figures from every rank's (sum, count) of each: mean and largest rank mean, local drift.

    Empty for a run that measured none (a lossless hook, or ``error_every=0``).
    """
    out: dict[str, float] = {}
    for name in ("compression_error", "error_feedback"):
        means = [total / count for total, count in (rank[name] for rank in per_rank) if count]
        if means:
            out[name] = statistics.fmean(means)
            out[f"{name}_max"] = max(means)
            out[f"{name}_measured_syncs"] = sum(rank[name][1] for rank in per_rank)
    ratios = [total / count for total, count in (rank["drift_ratio"] for rank in per_rank) if count]
    drift = local_drift(ratios)
    if drift is not None:
        out["local_drift"] = drift
        out["local_drift_syncs"] = min(rank["drift_ratio"][1] for rank in per_rank)
    return out


@dataclass(slots=True, eq=False)
class _OpenBucket:
    """A bucket of the current step as its hook reports it; its marks resolve into a :class:`BucketRecord`."""

    index: int
    num_elements: int
    logical_bytes: int
    start: Mark
    wire_bytes: int | None = None
    intra_node_bytes: int = 0
    intra_node_s: float = 0.0
    cross_node_s: float = 0.0
    end: Mark | None = None
    hidden: bool = False
    compression: list[DeferredRead] = field(default_factory=list)
    drift: DeferredRead | None = None

    def marks(self) -> tuple[Mark, ...]:
        return (self.start,) if self.end is None else (self.start, self.end)

    def freeze(self, seconds: dict[int, float]) -> BucketRecord:
        start = seconds[id(self.start)]
        compression = None
        if self.compression:
            given, dropped, fed_back = map(sum, zip(*(read.read().tolist() for read in self.compression), strict=True))
            compression = (given, dropped, fed_back)
        drift = None
        if self.drift is not None:
            own, mean = self.drift.read().tolist()
            drift = (own, mean)
        return BucketRecord(
            self.index,
            self.num_elements,
            self.logical_bytes,
            self.wire_bytes,
            start,
            seconds[id(self.end)] if self.end is not None else start,
            intra_node_bytes=self.intra_node_bytes,
            intra_node_s=self.intra_node_s,
            cross_node_s=self.cross_node_s,
            transfer_hidden=self.hidden,
            compression=compression,
            drift=drift,
        )


@dataclass
class _ClosedStep:
    """A closed step whose marks may not have resolved yet."""

    rounds: list[list[_OpenBucket]]
    micro_batches: int
    samples: int | None
    start: Mark | None
    end: Mark
    contiguous: bool

    def marks(self) -> list[Mark]:
        marks = [mark for round_ in self.rounds for bucket in round_ for mark in bucket.marks()]
        return [*marks, *(() if self.start is None else (self.start,)), self.end]


class CommLedger:
    """Records, on one rank, every bucket each comm hook handled and groups them into optimizer steps.

    Hooks write (through :meth:`record_hook` and :meth:`add_wire_bytes`); the strategy counts training batches
    (:meth:`add_micro_batch`) and closes a step at every optimizer step (:meth:`close_step`); callbacks read
    :attr:`steps` and the running totals after :meth:`poll`. Nothing here communicates: figures are this rank's own.

    A closed step joins :attr:`steps` once its marks have resolved: at once on the host timeline, when the device
    has passed them on a CUDA timeline. :meth:`poll` resolves what is ready without waiting; :meth:`flush` waits.

    :attr:`recording` says whether a hook reports here: with none (``comm_hook=None``, DDP's built-in allreduce)
    steps are still counted and timed, but their syncs are unseen.

    Lossy hooks measure their compression error every :attr:`error_every`-th sync round (:attr:`measuring`; 0, the
    default, measures none: ``CommProfiler`` turns it on). A measurement costs a pass or two over the bucket, so it
    is taken on a sample of the rounds; local SGD's drift is measured at every parameter sync (it is cheap there).

    Args:
        history: how many resolved steps to keep in :attr:`steps` (older ones only count in the totals).
        timeline: where times come from; host clocks by default
            (:func:`~lightning_ddpopt.timing.timeline_for` picks CUDA events for a GPU).
        error_every: measure the compression error every this many sync rounds; 0 for never.
    """

    def __init__(self, history: int = 4096, timeline: Timeline | None = None, error_every: int = 0) -> None:
        if not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be a positive int, got {history!r}")
        if not isinstance(error_every, int) or isinstance(error_every, bool) or error_every < 0:
            raise ValueError(f"error_every must be an int >= 0, got {error_every!r}")
        self.timeline: Timeline = timeline if timeline is not None else HostTimeline()
        self.recording = False
        self.error_every = error_every
        self._rounds_opened = 0
        self._lock = threading.Lock()
        self._rounds: list[list[_OpenBucket]] = []
        self._micro_batches = 0
        self._samples: int | None = 0
        self._step_start: Mark | None = None
        self._contiguous = False
        self._pending: deque[_ClosedStep] = deque()
        self._last_end_s: float | None = None
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.total_steps = 0
        self.total_sync_rounds = 0
        self.total_logical_bytes = 0
        self.total_wire_bytes = 0

    def record_hook(self, hook: CommHook) -> CommHook:
        """Wrap ``hook`` so that every bucket it handles is timed and its uncompressed size recorded.

        Sets :attr:`recording`. The wrapper keeps the hook's name, which DDP reports as ``comm_hook`` in its logging
        data. The end mark is taken in a callback of the hook's future: on a GPU that callback runs on a stream
        that waits for the hook's collectives, so the mark fires when they are done on the device, not when they
        were queued.

        Args:
            hook: a comm hook with torch's ``(state, bucket) -> Future[Tensor]`` signature.
        """
        self.recording = True

        @functools.wraps(hook)
        def recorded(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer, index = bucket.buffer(), bucket.index()
            entry = _OpenBucket(index, buffer.numel(), buffer.numel() * buffer.element_size(), self.timeline.mark())
            with self._lock:
                # DDP launches buckets strictly in index order, so bucket 0 starts a new round.
                if index == 0 or not self._rounds:
                    self._rounds.append([])
                    self._rounds_opened += 1
                self._rounds[-1].append(entry)
            future = hook(state, bucket)

            def finish(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                entry.end = self.timeline.mark()
                return done.value()

            return future.then(finish)

        return recorded

    def add_wire_bytes(self, bucket_index: int, nbytes: int, intra_node: bool = False) -> None:
        """Add bytes that a hook put into collectives for bucket ``bucket_index`` of the current round.

        Args:
            bucket_index: the bucket's index in this round.
            nbytes: the bytes this rank sent for it.
            intra_node: the bytes went to ranks of this rank's node only (a hierarchical hook's inner tier).
        """
        with self._lock:
            entry = self._open_entry(bucket_index, "add_wire_bytes")
            if intra_node:
                entry.intra_node_bytes += nbytes
            else:
                entry.wire_bytes = (entry.wire_bytes or 0) + nbytes

    def _open_entry(self, bucket_index: int, caller: str) -> _OpenBucket:
        """Bucket ``bucket_index`` of the current round (hold the lock); a hook's report outside a hook raises."""
        for entry in self._rounds[-1] if self._rounds else ():
            if entry.index == bucket_index:
                return entry
        raise RuntimeError(f"no open bucket {bucket_index} in the ledger: {caller} called outside a hook")

    def add_tier_seconds(self, bucket_index: int, seconds: float, intra_node: bool) -> None:
        """Add host seconds a hierarchical hook's stage spent on bucket ``bucket_index`` of the current round.

        Args:
            bucket_index: the bucket's index in this round.
            seconds: the stage's host seconds (its collectives, waits and copies).
            intra_node: a stage inside the node; else the one between the nodes.
        """
        with self._lock:
            entry = self._open_entry(bucket_index, "add_tier_seconds")
            if intra_node:
                entry.intra_node_s += seconds
            else:
                entry.cross_node_s += seconds

    @property
    def measuring(self) -> bool:
        """Whether the current sync round's compression error is to be measured (see :attr:`error_every`)."""
        return self.error_every > 0 and (self._rounds_opened - 1) % self.error_every == 0

    def add_compression(
        self, bucket_index: int, given_sq: torch.Tensor, dropped_sq: torch.Tensor, fed_back_sq: torch.Tensor
    ) -> None:
        """Add a lossy hook's squared norms for bucket ``bucket_index`` of the current round (0-dim tensors).

        They are read when the step resolves, without a host sync on a GPU.

        Args:
            bucket_index: the bucket's index in this round.
            given_sq: the squared norm of what was compressed (gradient plus the error fed back).
            dropped_sq: the squared norm of what the compression dropped.
            fed_back_sq: the squared norm of the stored error that was added.
        """
        values = DeferredRead(torch.stack([given_sq, dropped_sq, fed_back_sq]).detach().double())
        with self._lock:
            self._open_entry(bucket_index, "add_compression").compression.append(values)

    def add_parameter_sync(
        self,
        num_elements: int,
        logical_bytes: int,
        wire_bytes: int,
        start: Mark,
        transfer_hidden: bool = False,
        drift: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Mark:
        """Record a sync of parameters (local SGD's averaging) as one round of one bucket, from ``start`` until now.

        Returns the mark of its end (``sync_every="auto"`` times the sync between the two).

        Args:
            num_elements: parameters synchronised.
            logical_bytes: their fp32 bytes.
            wire_bytes: the bytes this rank sent.
            start: the mark taken when the sync began.
            transfer_hidden: the bytes in flight while the ranks trained on (an overlapped sync's arrival).
            drift: squared norms (0-dim tensors) of this rank's parameter change and of the ranks' mean change, or
                ``None`` when not measured.
        """
        entry = _OpenBucket(0, num_elements, logical_bytes, start, wire_bytes=wire_bytes, hidden=transfer_hidden)
        if drift is not None:
            entry.drift = DeferredRead(torch.stack(drift).detach().double())
        entry.end = end = self.timeline.mark()
        with self._lock:
            self._rounds.append([entry])
        return end

    def add_micro_batch(self, samples: int | None, first_of_epoch: bool = False) -> None:
        """Count one training batch of the current step; ``samples=None`` when its size is unknown.

        Args:
            samples: the batch's size, or ``None``.
            first_of_epoch: the time since the previous step includes an epoch boundary (validation, the loader's
                restart), so the step's time is counted from this batch instead.
        """
        mark = self.timeline.mark() if self._micro_batches == 0 else None
        with self._lock:
            if mark is not None:
                self._step_start = mark
            if first_of_epoch:
                self._contiguous = False
            self._micro_batches += 1
            self._samples = None if samples is None or self._samples is None else self._samples + samples

    def close_step(self) -> list[StepRecord]:
        """Close the current optimizer step; return the steps that resolved now, oldest first.

        On the host timeline that is the step just closed; on a CUDA timeline usually an earlier one.
        """
        end = self.timeline.mark()
        with self._lock:
            self._pending.append(
                _ClosedStep(
                    rounds=self._rounds,
                    micro_batches=self._micro_batches,
                    samples=self._samples if self._micro_batches else None,
                    start=self._step_start,
                    end=end,
                    contiguous=self._contiguous,
                )
            )
            self._rounds, self._micro_batches, self._samples, self._step_start = [], 0, 0, None
            self._contiguous = True
        return self.poll()

    def poll(self) -> list[StepRecord]:
        """Turn the closed steps whose marks have all resolved into records, in order; never waits."""
        return self._resolve(wait=False)

    def flush(self) -> list[StepRecord]:
        """Wait for every closed step's marks and turn them into records (a host sync on a GPU: for the end of fit)."""
        return self._resolve(wait=True)

    @property
    def pending_steps(self) -> int:
        """Closed steps still waiting for the device."""
        with self._lock:
            return len(self._pending)

    @property
    def closed_steps(self) -> int:
        """Optimizer steps closed so far: resolved (:attr:`total_steps`) or pending."""
        with self._lock:
            return self.total_steps + len(self._pending)

    @property
    def open_sync_rounds(self) -> int:
        """Sync rounds recorded since the last closed step."""
        with self._lock:
            return len(self._rounds)

    def _resolve(self, wait: bool) -> list[StepRecord]:
        resolved: list[StepRecord] = []
        with self._lock:
            while self._pending:
                closed = self._pending[0]
                seconds: dict[int, float] = {}
                for mark in closed.marks():
                    value = self.timeline.wait(mark) if wait else self.timeline.seconds(mark)
                    if value is None:
                        return resolved
                    seconds[id(mark)] = value
                self._pending.popleft()
                resolved.append(self._record(closed, seconds))
        return resolved

    def _record(self, closed: _ClosedStep, seconds: dict[int, float]) -> StepRecord:
        frozen = [[entry.freeze(seconds) for entry in round_] for round_ in closed.rounds if round_]
        buckets = [record for round_ in frozen for record in round_]
        wire = None if any(b.wire_bytes is None for b in buckets) else sum(b.wire_bytes or 0 for b in buckets)
        compression = [b.compression for b in buckets if b.compression is not None]
        given, dropped, fed_back = (sum(norms[i] for norms in compression) for i in range(3))
        drifts = [b.drift for b in buckets if b.drift is not None]
        start = seconds[id(closed.start)] if closed.start is not None else None
        end = seconds[id(closed.end)]
        if closed.contiguous and self._last_end_s is not None:
            step_time: float | None = end - self._last_end_s
        else:
            step_time = end - start if start is not None else None
        self._last_end_s = end
        record = StepRecord(
            step=self.total_steps + 1,
            sync_rounds=len(frozen),
            logical_bytes=sum(b.logical_bytes for b in buckets),
            wire_bytes=wire,
            intra_node_bytes=sum(b.intra_node_bytes for b in buckets),
            intra_node_s=sum(b.intra_node_s for b in buckets),
            cross_node_s=sum(b.cross_node_s for b in buckets),
            sync_time_s=sum(max(b.end_s for b in r) - min(b.start_s for b in r) for r in frozen),
            exposed_time_s=sum(exposed_seconds(r) for r in frozen),
            busy_time_s=sum(busy_seconds(r) for r in frozen),
            bucket_bytes=tuple(b.logical_bytes for b in frozen[-1]) if frozen else (),
            micro_batches=closed.micro_batches,
            samples=closed.samples,
            sync_start_s=frozen[0][0].start_s if frozen else None,
            start_s=start,
            end_s=end,
            step_time_s=step_time,
            transfer_hidden=any(b.transfer_hidden for b in buckets),
            compression_error=math.sqrt(dropped / given) if compression and given > 0 else None,
            error_feedback=math.sqrt(fed_back / given) if compression and given > 0 else None,
            drift_ratio=drifts[-1][0] / drifts[-1][1] if drifts and drifts[-1][1] > 0 else None,
        )
        self.steps.append(record)
        self.total_steps += 1
        self.total_sync_rounds += record.sync_rounds
        self.total_logical_bytes += record.logical_bytes
        self.total_wire_bytes += record.wire_bytes or 0
        return record
