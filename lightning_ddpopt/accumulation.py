"""Gradient accumulation for manual optimization: which micro-batch syncs and steps."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ddpopt._validate import require_int

__all__ = ["AccumulationStep", "next_accumulation_step"]


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
