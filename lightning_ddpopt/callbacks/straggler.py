"""StragglerDetector: which rank is slow, by how much, and whether data loading or compute makes it slow."""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ddpopt._validate import require_int, require_number
from lightning_ddpopt.callbacks._cursor import LedgerCursor
from lightning_ddpopt.ledger import StepRecord
from lightning_ddpopt.timing import Mark, Timeline

__all__ = ["StragglerDetector"]

PHASES = ("data", "compute", "wait")


class _Batch(NamedTuple):
    """Marks of one training batch: the previous batch's end (``None`` at an epoch's start), its start and end."""

    previous_end: Mark | None
    start: Mark
    end: Mark

    def seconds(self, timeline: Timeline, wait: bool) -> tuple[float, float] | None:
        """(data, busy) seconds, or ``None`` while a mark has not resolved."""
        read = timeline.wait if wait else timeline.seconds
        start, end = read(self.start), read(self.end)
        previous = read(self.previous_end) if self.previous_end is not None else start
        if start is None or end is None or previous is None:
            return None
        return start - previous, end - start


class StragglerDetector(Callback):
    """Finds the rank that makes every other rank wait.

    The allreduce is a barrier, so a rank's backward wall time is the same everywhere and cannot point at the slow
    rank. Instead each rank measures, per optimizer step: time waiting for its next batch (**data**), time from
    batch start until its first gradient bucket reaches the sync point (**compute**, forward and backward up to the
    sync), and time from there until the sync completed (**wait**, which the fast ranks spend waiting for the slow
    one). Every ``every_n_steps`` steps the per-rank means are gathered (one small all-gather); the rank with the
    most data + compute is the slowest, and it is named a straggler when it exceeds the median of the others by
    both ``min_excess_ms`` and ``min_excess_fraction`` of the median step. The phase named is the one in which it
    exceeds the others most.

    On CPU the phases are host times. On a GPU every boundary is a CUDA event on the current stream, read back a
    step or so later without a host sync: data is then the time the device sat idle waiting for the next batch,
    compute and wait are device times (host clocks would time the queueing of kernels). Each gather happens at
    the same optimizer step on every rank and covers the steps each rank's device has finished by then.

    Without :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s ledger (Lightning's stock ``DDPStrategy``) the sync
    point is unknown: a fast rank's wait would look like compute, so only data time can name a rank; it warns once
    and reports compute with the wait in it. On one device it warns once and steps aside.

    ===================================  ========================================================================
    key                                  meaning (over the last ``every_n_steps`` steps)
    ===================================  ========================================================================
    ``ddpopt/straggler/slowest_rank``    the rank with the most data + compute time (data alone without a ledger)
    ``ddpopt/straggler/excess_ms``       that time above the median of the other ranks
    ``ddpopt/straggler/is_straggler``    1 when the excess crosses both thresholds, else 0
    ``ddpopt/straggler/data_ms``         the slowest rank's mean data time per step
    ``ddpopt/straggler/compute_ms``      the slowest rank's mean compute time per step
    ``ddpopt/straggler/wait_ms``         the largest mean wait of any rank
    ===================================  ========================================================================

    Args:
        every_n_steps: optimizer steps between two gathers.
        min_excess_ms: smallest excess, in ms per step, that names a straggler.
        min_excess_fraction: smallest excess, as a fraction of the median step time, that names a straggler.
    """

    summary_key = "stragglers"

    def __init__(self, every_n_steps: int = 20, min_excess_ms: float = 20.0, min_excess_fraction: float = 0.1) -> None:
        require_int("every_n_steps", every_n_steps, 1)
        require_number("min_excess_ms", min_excess_ms, strict=False)
        require_number("min_excess_fraction", min_excess_fraction, strict=False)
        self.every_n_steps = every_n_steps
        self.min_excess_ms = min_excess_ms
        self.min_excess_fraction = min_excess_fraction
        self.last: dict[str, Any] | None = None
        self.straggler_windows: dict[int, int] = {}
        self.windows = 0
        self._cursor = LedgerCursor()
        self._active = False
        self._previous_end: Mark | None = None
        self._batch_start: Mark | None = None
        self._step_batches: list[_Batch] = []
        self._unresolved: deque[list[_Batch]] = deque()  # host-closed steps, oldest first
        self._records: deque[StepRecord] = deque()  # ledger records not yet matched with their batches
        self._totals = torch.zeros(4, dtype=torch.float64)  # data, compute, wait (seconds), resolved steps
        self._steps_in_window = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = trainer.world_size > 1
        if not self._active:
            rank_zero_warn("ddpopt: StragglerDetector needs more than one process; it is off.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        self._cursor.start(trainer)  # the strategy has registered its hook by now
        if self._cursor.ledger is None:
            rank_zero_warn(
                "ddpopt: StragglerDetector sees no sync point (use OptimizedDDPStrategy with a comm_hook other than "
                "None); it can name only ranks that are slow in data loading."
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._previous_end = None  # the gap across an epoch boundary (validation, loader restart) is not data time

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active:
            self._batch_start = self._cursor.timeline.mark()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or self._batch_start is None:
            return
        end = self._cursor.timeline.mark()
        self._step_batches.append(_Batch(self._previous_end, self._batch_start, end))
        self._previous_end, self._batch_start = end, None
        steps = self._cursor.new_steps(trainer)
        if steps:
            # Several optimizers step once each per batch: the batch belongs to the first, the others ran no batch.
            self._unresolved.append(self._step_batches)
            self._unresolved.extend([] for _ in range(steps - 1))
            self._step_batches = []
        self._records.extend(self._cursor.new_records())
        self._resolve(wait=False)
        self._steps_in_window += steps
        if self._steps_in_window >= self.every_n_steps:
            self._analyse(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._records.extend(self._cursor.new_records(wait=True))
            self._resolve(wait=True)

    def summary(self) -> dict[str, Any]:
        """The latest analysis and how often each rank was named, for the diagnosis."""
        return {
            "last": self.last,
            "windows": self.windows,
            "straggler_windows": {str(rank): count for rank, count in self.straggler_windows.items()},
        }

    def _resolve(self, wait: bool) -> None:
        """Add the host-closed steps whose marks (and ledger record) have resolved to the window's totals."""
        while self._unresolved and (self._records or self._cursor.ledger is None):
            batches = self._unresolved[0]
            times = [batch.seconds(self._cursor.timeline, wait) for batch in batches]
            if any(t is None for t in times):
                return
            self._unresolved.popleft()
            data = busy = 0.0
            for t in times:
                assert t is not None
                data, busy = data + t[0], busy + t[1]
            wait_s = self._records.popleft().sync_time_s if self._cursor.ledger is not None else 0.0
            self._totals += torch.tensor([data, max(busy - wait_s, 0.0), wait_s, 1.0], dtype=torch.float64)

    def _analyse(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (world, [data, compute, wait, steps]): every rank's sums over the steps it has resolved so far.
        per_rank = trainer.strategy.all_gather(self._totals.to(pl_module.device)).reshape(-1, 4).double().cpu()
        self._steps_in_window = 0
        if bool((per_rank[:, 3] == 0).any()):
            return  # a rank's device has not finished a step yet: keep the sums, decide after the next window
        self._totals.zero_()
        per_rank = per_rank[:, :3] / per_rank[:, 3:] * 1e3  # mean ms per step
        # Without the ledger, compute holds the fast ranks' wait: only data can tell the ranks apart.
        phases = 2 if self._cursor.ledger is not None else 1
        busy = per_rank[:, :phases].sum(dim=1)
        slowest = int(busy.argmax())
        others = [r for r in range(per_rank.shape[0]) if r != slowest]
        median_others = per_rank[others].median(dim=0).values
        excess = float(busy[slowest] - median_others[:phases].sum())
        step_ms = float(per_rank.sum(dim=1).median())
        is_straggler = excess >= self.min_excess_ms and excess >= self.min_excess_fraction * step_ms
        phase_excess = per_rank[slowest, :phases] - median_others[:phases]
        phase = PHASES[int(phase_excess.argmax())]
        self.windows += 1
        self.last = {
            "step": trainer.global_step,
            "slowest_rank": slowest,
            "excess_ms": excess,
            "phase": phase,
            "is_straggler": is_straggler,
            "step_ms": step_ms,
            "per_rank_ms": {str(r): dict(zip(PHASES, row, strict=True)) for r, row in enumerate(per_rank.tolist())},
        }
        if is_straggler:
            self.straggler_windows[slowest] = self.straggler_windows.get(slowest, 0) + 1
            rank_zero_info(
                f"ddpopt: rank {slowest} is a straggler: {excess:.0f} ms/step slower than the median rank, "
                f"in {phase} ({per_rank[slowest, PHASES.index(phase)]:.0f} ms vs "
                f"{median_others[PHASES.index(phase)]:.0f} ms)"
            )
        metrics = {
            "slowest_rank": float(slowest),
            "excess_ms": excess,
            "is_straggler": float(is_straggler),
            "data_ms": float(per_rank[slowest, 0]),
            "compute_ms": float(per_rank[slowest, 1]),
            "wait_ms": float(per_rank[:, 2].max()),
        }
        for key, value in metrics.items():
            pl_module.log(f"ddpopt/straggler/{key}", value, on_step=True, on_epoch=False)
