"""StragglerDetector: which rank is slow, by how much, and in which phase: data, compute or the optimizer step.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ddpopt._compat import time_fetches
from lightning_ddpopt._validate import require_int, require_number
from lightning_ddpopt.callbacks._cursor import LedgerCursor
from lightning_ddpopt.callbacks._report import report_if_last
from lightning_ddpopt.callbacks._tensorboard import charts, write_layout_if_first
from lightning_ddpopt.deferred import to_device
from lightning_ddpopt.ledger import StepRecord
from lightning_ddpopt.measuring import MeasuringCallback
from lightning_ddpopt.meetings import Exchange, meets_in_passing, ranks_meet
from lightning_ddpopt.timing import Mark, Timeline

__all__ = ["StragglerDetector"]

PHASES = ("data", "compute", "wait", "optimizer")
#: A rank's own work; ``wait`` is time it spent waiting for the others.
OWN_PHASES = ("data", "compute", "optimizer")


class _Batch(NamedTuple):
    """Marks of one training batch.

    ``previous_end`` is the previous batch's end (``None`` at an epoch's start); ``fetches`` the (start, end) marks
    of the data loading between the two, ``None`` when the loader could not be timed; ``before_optimizer`` the
    mark after the backward pass, ``None`` when the batch did not step an optimizer.
    """

    previous_end: Mark | None
    fetches: tuple[tuple[Mark, Mark], ...] | None
    start: Mark
    before_optimizer: Mark | None
    end: Mark

    def seconds(self, timeline: Timeline, wait: bool) -> tuple[float, float, float, float] | None:
        """(data, wait before the batch, batch start to optimizer, optimizer) seconds; ``None`` if unresolved."""
        read = timeline.wait if wait else timeline.seconds
        marks = [self.start, self.end, self.before_optimizer or self.end, self.previous_end or self.start]
        marks += [mark for fetch in self.fetches or () for mark in fetch]
        times = [read(mark) for mark in marks]
        if any(t is None for t in times):
            return None
        start, end, before, previous, *fetched = (t for t in times if t is not None)
        if self.previous_end is None:  # the loader's start-up at an epoch's start is not a step's cost
            return 0.0, 0.0, before - start, end - before
        gap = start - previous
        if self.fetches is None:  # the whole gap counts as data, as it would without this split
            return gap, 0.0, before - start, end - before
        data = min(sum(b - a for a, b in zip(fetched[::2], fetched[1::2], strict=True)), gap)
        # The rest of the gap is spent in Lightning's per-batch collective (its SIGTERM broadcast): waiting for
        # the ranks still busy with the previous step.
        return data, gap - data, before - start, end - before


class StragglerDetector(MeasuringCallback):
    """Finds the rank that makes every other rank wait, and the phase of the step in which it is slow.

    Each rank measures, per optimizer step:

    * **data**: time spent fetching its batches (the Trainer's data fetcher, timed around each fetch);
    * **compute**: from the batch's start until its gradients are ready for the sync: forward and backward, minus
      the exposed gradient sync (backward compute that overlaps the sync counts as compute);
    * **wait**: time waiting for the other ranks: in the exposed gradient sync (the last bucket handed to the comm
      hook until the last finished; see :class:`~lightning_ddpopt.ledger.StepRecord`) and in Lightning's per-batch
      collective before a batch starts;
    * **optimizer**: from the end of the backward pass (``on_before_optimizer_step``) to the batch's end: the
      optimizer step, gradient clipping, the GradScaler.

    The slowest rank is the one with the most own work (data + compute + optimizer); it is named a straggler when
    that exceeds the median of the other ranks by both ``min_excess_ms`` and ``min_excess_fraction`` of the median
    step. The phase named is the own phase in which it exceeds the others most. A rank's wait is not compared:
    whoever is slow makes the others wait, wherever their next sync point is. Every ``every_n_steps`` steps the
    per-rank means are gathered (one small all-gather; under local SGD at the next parameter sync, where the ranks
    meet anyway: see :func:`lightning_ddpopt.meetings.ranks_meet`; with ``overlap_steps`` the ranks do not wait for
    each other at a sync's start, so the gather stays in flight and its verdict comes at the next sync); at the end of
    fit the steps since the last window get a verdict too, so a run shorter than one window still gets one.

    On CPU the phases are host times. On a GPU every boundary is a CUDA event on the current stream, read back a
    step or so later without a host sync: data is then the time the device sat idle while the host fetched,
    compute and wait are device times (host clocks would time the queueing of kernels). Each gather happens at
    the same optimizer step on every rank and covers the steps each rank's device has finished by then.

    Without :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s ledger (Lightning's stock ``DDPStrategy``) the sync
    point is unknown: a fast rank's wait in the gradient sync would look like compute, so only data and optimizer
    time can name a rank; it warns once and reports compute with that wait in it. On one device it warns once and
    steps aside.

    ===================================  ========================================================================
    key                                  meaning (over the last ``every_n_steps`` steps)
    ===================================  ========================================================================
    ``ddpopt/straggler/slowest_rank``    the rank with the most own work (data + compute + optimizer)
    ``ddpopt/straggler/excess_ms``       that time above the median of the other ranks
    ``ddpopt/straggler/is_straggler``    1 when the excess crosses both thresholds, else 0
    ``ddpopt/straggler/data_ms``         the slowest rank's mean data time per step
    ``ddpopt/straggler/compute_ms``      the slowest rank's mean compute time per step
    ``ddpopt/straggler/optimizer_ms``    the slowest rank's mean optimizer time per step
    ``ddpopt/straggler/wait_ms``         the largest mean wait of any rank
    ===================================  ========================================================================

    Args:
        every_n_steps: optimizer steps between two gathers.
        min_excess_ms: smallest excess, in ms per step, that names a straggler.
        min_excess_fraction: smallest excess, as a fraction of the median step time, that names a straggler.
    """

    summary_key = "stragglers"
    tensorboard_charts = charts(
        "ddpopt stragglers",
        "ddpopt/straggler",
        {
            "slowest rank's time per step (ms)": ["data_ms", "compute_ms", "optimizer_ms", "wait_ms"],
            "excess over the median rank (ms)": ["excess_ms"],
            "slowest rank": ["slowest_rank"],
            "straggler named (1) or not (0)": ["is_straggler"],
        },
    )

    def __init__(self, every_n_steps: int = 20, min_excess_ms: float = 20.0, min_excess_fraction: float = 0.1) -> None:
        require_int("every_n_steps", every_n_steps, 1)
        require_number("min_excess_ms", min_excess_ms, strict=False)
        require_number("min_excess_fraction", min_excess_fraction, strict=False)
        self.every_n_steps = every_n_steps
        self.min_excess_ms = min_excess_ms
        self.min_excess_fraction = min_excess_fraction
        self.last: dict[str, Any] | None = None
        self.no_verdict: str | None = None
        self.straggler_windows: dict[int, int] = {}
        self.windows = 0
        self._cursor = LedgerCursor()
        self._active = False
        self._previous_end: Mark | None = None
        self._batch_start: Mark | None = None
        self._batch_fetches: tuple[tuple[Mark, Mark], ...] | None = None
        self._before_optimizer: Mark | None = None
        self._fetch_start: Mark | None = None
        self._fetches: list[tuple[Mark, Mark]] = []
        self._timed_fetcher: Callable[[], None] | None = None
        self._step_batches: list[_Batch] = []
        self._unresolved: deque[list[_Batch]] = deque()  # host-closed steps, oldest first
        self._records: deque[StepRecord] = deque()  # ledger records not yet matched with their batches
        # data, compute, wait, optimizer (seconds), resolved steps; made in `setup`, in the rank that writes it
        self._totals: torch.Tensor | None = None
        self._steps_in_window = 0
        self._undecided = False
        self._exchange = Exchange()  # every rank's sums, in flight from a meeting in passing to the next one
        self._in_flight_step = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Per-rank state is born in the rank, anew for each fit: a tensor made in `__init__` (or in a fit in the
        # launching process) is pickled into every rank that `spawn` starts, and torch moves its storage to shared
        # memory, so all ranks would add into one tensor.
        if stage == TrainerFn.FITTING or self._totals is None:
            self._totals = torch.zeros(len(PHASES) + 1, dtype=torch.float64)
            self._steps_in_window, self._undecided, self._exchange = 0, False, Exchange()
            self._step_batches, self._unresolved, self._records = [], deque(), deque()
        self._active = trainer.world_size > 1
        if not self._active:
            self.no_verdict = "one process: no other rank to compare with"
            rank_zero_warn("ddpopt: StragglerDetector needs more than one process; it is off.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_layout_if_first(trainer, self)
        if not self._active:
            return
        self._cursor.start(trainer)  # the strategy has registered its hook by now
        if self._cursor.ledger is None:
            rank_zero_warn(
                "ddpopt: StragglerDetector sees no sync point (use OptimizedDDPStrategy with a comm_hook other than "
                "None); it can name only ranks that are slow in data loading or in the optimizer step."
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._previous_end = None  # the gap across an epoch boundary (validation, loader restart) is not data time

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._time_fetches(trainer)
        self._batch_fetches = tuple(self._fetches) if self._timed_fetcher is not None else None
        self._fetches.clear()
        self._before_optimizer = None
        self._batch_start = self._cursor.timeline.mark()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._active and self._batch_start is not None and self._before_optimizer is None:
            self._before_optimizer = self._cursor.timeline.mark()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active or self._batch_start is None:
            return
        end = self._cursor.timeline.mark()
        batch_marks = _Batch(self._previous_end, self._batch_fetches, self._batch_start, self._before_optimizer, end)
        self._step_batches.append(batch_marks)
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
        if self._steps_in_window >= self.every_n_steps and ranks_meet(trainer):
            self._analyse(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            report_if_last(trainer, self)
            return
        self._records.extend(self._cursor.new_records(wait=True))
        self._resolve(wait=True)
        # The end of fit is a meeting: the gather in flight arrives.
        self._decide(trainer, pl_module, self._exchange.arrived(), self._in_flight_step, final=False, log=False)
        # The steps since the last window (all of a run shorter than one window) get a verdict too. Host step
        # counts and gathered figures decide, so every rank takes this branch or none does.
        if self._steps_in_window > 0 or self._undecided:
            self._analyse(trainer, pl_module, final=True)
        elif self.last is None:
            self.no_verdict = "no optimizer step was measured"
        report_if_last(trainer, self)

    def summary(self) -> dict[str, Any]:
        """The latest analysis, how often each rank was named, and why there is no verdict if there is none."""
        return {
            "last": self.last,
            "windows": self.windows,
            "straggler_windows": {str(rank): count for rank, count in sorted(self.straggler_windows.items())},
            "no_verdict": self.no_verdict,
        }

    def _time_fetches(self, trainer: pl.Trainer) -> None:
        """Mark the start and end of every fetch of the Trainer's training data fetcher.

        Through the fetcher's profiler calls around each fetch (:func:`~lightning_ddpopt._compat.time_fetches`).
        Without them, data time is the whole gap between batches, which includes Lightning's per-batch collective.
        """
        timeline = self._cursor.timeline

        def on_start() -> None:
            self._fetch_start = timeline.mark()

        def on_stop() -> None:
            if self._fetch_start is not None:
                self._fetches.append((self._fetch_start, timeline.mark()))
                self._fetch_start = None

        self._timed_fetcher = time_fetches(trainer, on_start, on_stop, self._timed_fetcher)

    def _resolve(self, wait: bool) -> None:
        """Add the host-closed steps whose marks (and ledger record) have resolved to the window's totals."""
        while self._unresolved and (self._records or self._cursor.ledger is None):
            batches = self._unresolved[0]
            times = [batch.seconds(self._cursor.timeline, wait) for batch in batches]
            if any(t is None for t in times):
                return
            self._unresolved.popleft()
            data, gap_wait, busy, optimizer = (sum(t[i] for t in times if t is not None) for i in range(4))
            # The exposed sync, not its span: backward compute that overlaps the sync is this rank's own work.
            sync = self._records.popleft().exposed_time_s if self._cursor.ledger is not None else 0.0
            step = [data, max(busy - sync, 0.0), sync + gap_wait, optimizer, 1.0]
            assert self._totals is not None  # made in setup
            self._totals += torch.tensor(step, dtype=torch.float64)

    def _analyse(self, trainer: pl.Trainer, pl_module: pl.LightningModule, final: bool = False) -> None:
        """Gather every rank's sums since the last gather, and decide (in passing: at the next gather)."""
        self._decide(trainer, pl_module, self._exchange.arrived(), self._in_flight_step, final=False, log=not final)
        assert self._totals is not None  # made in setup
        local = to_device(self._totals.clone(), pl_module.device)
        self._totals.zero_()
        self._steps_in_window = 0
        in_passing = not final and meets_in_passing(trainer)
        gathered = self._exchange.gather(local, trainer.world_size, in_passing, final=final)
        if gathered is None:
            self._in_flight_step = trainer.global_step
        self._decide(trainer, pl_module, gathered, trainer.global_step, final=final, log=not final)

    def _decide(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        gathered: torch.Tensor | None,
        step: int,
        final: bool,
        log: bool,
    ) -> None:
        """Name the straggler of a window from every rank's sums, if they have arrived."""
        if gathered is None:
            return
        # (world, phases + 1): every rank's sums over the steps it resolved in the window.
        assert self._totals is not None  # made in setup
        per_rank = gathered.double().cpu()
        if bool((per_rank[:, -1] == 0).any()):
            # A rank's device has not finished a step yet: keep the sums, decide at the next window (or the end).
            self._totals += per_rank[trainer.global_rank]
            self._undecided = True
            if final:
                self.no_verdict = "a rank finished no optimizer step that could be timed"
            return
        self._undecided = False
        per_rank = per_rank[:, :-1] / per_rank[:, -1:] * 1e3  # mean ms per step
        # Without the ledger, compute holds the fast ranks' wait in the gradient sync: it cannot tell ranks apart.
        own = [PHASES.index(p) for p in OWN_PHASES if self._cursor.ledger is not None or p != "compute"]
        work = per_rank[:, own].sum(dim=1)
        slowest = int(work.argmax())
        others = [r for r in range(per_rank.shape[0]) if r != slowest]
        median_others = per_rank[others].median(dim=0).values
        excess = float(work[slowest] - median_others[own].sum())
        step_ms = float(per_rank.sum(dim=1).median())
        is_straggler = excess >= self.min_excess_ms and excess >= self.min_excess_fraction * step_ms
        phase = PHASES[own[int((per_rank[slowest, own] - median_others[own]).argmax())]]
        self.windows += 1
        self.no_verdict = None
        self.last = {
            "step": step,
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
        if not log:
            return  # Lightning takes no logs at the end of fit; the verdict goes to the report
        metrics = {
            "slowest_rank": float(slowest),
            "excess_ms": excess,
            "is_straggler": float(is_straggler),
            "data_ms": float(per_rank[slowest, 0]),
            "compute_ms": float(per_rank[slowest, 1]),
            "optimizer_ms": float(per_rank[slowest, 3]),
            "wait_ms": float(per_rank[:, 2].max()),
        }
        for key, value in metrics.items():
            pl_module.log(f"ddpopt/straggler/{key}", value, on_step=True, on_epoch=False)
