"""What the ledger hands the callbacks: one :class:`StepRecord` per optimizer step, a :class:`BucketRecord` per bucket.

Written by :class:`~lightning_ddpopt.ledger.CommLedger`, read by the callbacks and the diagnosis.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = [
    "QUALITY_FIELDS",
    "BucketRecord",
    "StepRecord",
    "busy_seconds",
    "exposed_seconds",
    "local_drift",
    "run_quality",
]


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
        transfer_hidden: the bytes travelled while the ranks trained on (local SGD's overlapped sync): ``start_s`` to
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
        transfer_hidden: some of the step's bytes travelled while the ranks trained on (see :class:`BucketRecord`):
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
