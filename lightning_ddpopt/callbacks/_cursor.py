"""Reading a strategy's ledger step by step from a callback: shared by the measuring callbacks."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_ddpopt.ledger import CommLedger, StepRecord
from lightning_ddpopt.measuring import CoreViews
from lightning_ddpopt.timing import HostTimeline, Timeline, timeline_for

__all__ = ["LedgerCursor"]


class LedgerCursor:
    """Follows a run's optimizer steps in two ways that must not be confused.

    :meth:`new_steps` counts the steps the host has taken (``trainer.global_step``): the same on every rank at
    the same point, so it is what decides when the ranks meet in a collective. :meth:`new_records` yields the
    records of :attr:`ledger` as they resolve: at once on CPU, a step or so later on a GPU, where each rank's
    device runs behind its host by its own amount.

    Call :meth:`start` when training starts, once the strategy has registered its comm hook. :attr:`timeline`
    is where a callback takes its own marks: the ledger's, so they share its clock, or one for the device.
    """

    def __init__(self) -> None:
        self.ledger: CommLedger | None = None
        self.timeline: Timeline = HostTimeline()
        self._seen_records = 0
        self._seen_global_step = 0

    def start(self, trainer: pl.Trainer) -> None:
        """Begin at the trainer's and ledger's present position (a resumed run starts mid-way).

        :attr:`ledger` is the strategy's when a comm hook reports to it; ``None`` with any strategy other than
        :class:`~lightning_ddpopt.OptimizedDDPStrategy` (Lightning's stock ``DDPStrategy``), and with
        ``comm_hook=None``, where DDP's built-in allreduce runs unseen.
        """
        strategy = trainer.strategy
        ledger = strategy.ledger if isinstance(strategy, CoreViews) else None
        self.ledger = ledger if ledger is not None and ledger.recording else None
        self.timeline = self.ledger.timeline if self.ledger is not None else timeline_for(trainer.strategy.root_device)
        self._seen_global_step = trainer.global_step
        self._seen_records = self.ledger.total_steps if self.ledger is not None else 0

    def new_steps(self, trainer: pl.Trainer) -> int:
        """Optimizer steps the host took since the previous call."""
        count = trainer.global_step - self._seen_global_step
        self._seen_global_step = trainer.global_step
        return max(count, 0)

    def new_records(self, wait: bool = False) -> list[StepRecord]:
        """Ledger records resolved since the previous call, oldest first; ``wait`` waits for the device first."""
        ledger = self.ledger
        if ledger is None:
            return []
        ledger.flush() if wait else ledger.poll()
        count = ledger.total_steps - self._seen_records
        self._seen_records = ledger.total_steps
        return list(ledger.steps)[-count:] if count > 0 else []
