"""Reading a strategy's ledger step by step from a callback: shared by the measuring callbacks."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_ddpopt.ledger import CommLedger, StepRecord

__all__ = ["LedgerCursor"]


class LedgerCursor:
    """Yields the optimizer steps closed since the last call.

    With :class:`~lightning_ddpopt.OptimizedDDPStrategy` these are the ledger's records; with any other strategy
    (Lightning's stock ``DDPStrategy``) only the step count is known, and the records are ``None``.
    """

    def __init__(self) -> None:
        self._seen_steps = 0
        self._seen_global_step = 0

    @staticmethod
    def ledger_of(trainer: pl.Trainer) -> CommLedger | None:
        """The strategy's ledger, if it keeps one."""
        ledger = getattr(trainer.strategy, "ledger", None)
        return ledger if isinstance(ledger, CommLedger) else None

    def new_steps(self, trainer: pl.Trainer) -> list[StepRecord | None]:
        """Records of the optimizer steps closed since the previous call, oldest first."""
        ledger = self.ledger_of(trainer)
        if ledger is None:
            count = trainer.global_step - self._seen_global_step
            self._seen_global_step = trainer.global_step
            return [None] * max(count, 0)
        count = ledger.total_steps - self._seen_steps
        self._seen_steps = ledger.total_steps
        if count <= 0:
            return []
        recent = list(ledger.steps)[-count:]
        return [None] * (count - len(recent)) + list(recent)
