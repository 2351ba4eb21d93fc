"""Gradient accumulation in loops of one's own: which micro-batch syncs and steps, and the warning when all do."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ddpopt._compat import last_batch_of_epoch
from lightning_ddpopt._validate import require_int

__all__ = ["AccumulationStep", "ExtraSyncs", "ManualAccumulation", "next_accumulation_step"]


@dataclass(frozen=True)
class AccumulationStep:
    """What one micro-batch of a manual-optimization loop should do.

    Attributes:
        micro_batch: 1-based position of this micro-batch in its accumulation group.
        every: the accumulation factor K the loop asked for; divide the loss by it, as Lightning's automatic
            accumulation does (also in the shorter last group of an epoch).
        should_step: this micro-batch ends its group: its backward synchronises the gradients across ranks and the
            loop should call ``optimizer.step()`` (and ``zero_grad()``) after it.
    """

    micro_batch: int
    every: int
    should_step: bool


def next_accumulation_step(previous_micro_batch: int, every: int, last_batch_of_epoch: bool) -> AccumulationStep:
    """The step after ``previous_micro_batch`` micro-batches of the current group (0 at a group's start).

    A group ends after ``every`` micro-batches, or early on the epoch's last batch, so gradients of a short last
    group are never carried into the next epoch.
    """
    require_int("every", every, 1, " (the number of micro-batches per optimizer step)")
    micro_batch = previous_micro_batch + 1
    return AccumulationStep(micro_batch, every, micro_batch >= every or last_batch_of_epoch)


class ExtraSyncs:
    """Warns once when a loop synchronised gradients on more than one micro-batch of an optimizer step.

    Args:
        loop: what the loop is, in words (``"manual-optimization loop"``).
        advice: how to sync only the last micro-batch, in the loop's own terms.
    """

    def __init__(self, loop: str, advice: str) -> None:
        self.loop = loop
        self.advice = advice
        self.warned = False

    def check(self, sync_rounds: int, micro_batches: int) -> None:
        """Warn (once, on rank 0) if this step's ``sync_rounds`` were more than one."""
        if self.warned or sync_rounds <= 1:
            return
        self.warned = True
        rank_zero_warn(
            f"ddpopt: this {self.loop} synchronised gradients {sync_rounds} times for one optimizer step "
            f"({micro_batches} micro-batches): every micro-batch paid a full allreduce. {self.advice}"
        )


class ManualAccumulation:
    """The strategy's ``accumulate()`` for manual optimization, and the warning for loops that sync every batch."""

    def __init__(self) -> None:
        self._micro_batch_in_group = 0
        self._extra_syncs = ExtraSyncs(
            "manual-optimization loop",
            "Run forward and manual_backward inside `with self.trainer.strategy.accumulate(every=K) as step:` and "
            "call opt.step() only `if step.should_step`, so only the last micro-batch of each group syncs.",
        )

    def next_step(self, module: pl.LightningModule | None, every: int, static_graph: bool) -> AccumulationStep:
        """The current micro-batch's step; raises for automatic optimization and for DDP's static graph."""
        if module is None or module.automatic_optimization:
            raise RuntimeError(
                "OptimizedDDPStrategy.accumulate() is for manual optimization; with automatic optimization use "
                "Trainer(accumulate_grad_batches=K), which already syncs once per optimizer step"
            )
        if static_graph and every != 1:
            raise ValueError(
                f"accumulate(every={every}) cannot run with static_graph=True: DDP's static graph mode mis-syncs "
                "gradients under no_sync (pytorch#143580). Use static_graph=False."
            )
        step = next_accumulation_step(self._micro_batch_in_group, every, last_batch_of_epoch(module.trainer))
        self._micro_batch_in_group = 0 if step.should_step else step.micro_batch
        return step

    def check_syncs_per_step(self, module: pl.LightningModule | None, sync_rounds: int, micro_batches: int) -> None:
        """Warn once when a manual-optimization loop synchronised gradients on more than one micro-batch."""
        if module is not None and not module.automatic_optimization:
            self._extra_syncs.check(sync_rounds, micro_batches)
