"""The training state a returning island heals from: what a Lightning resume needs, taken from a live peer.

torchft asks a healthy island for it at a quorum: the start of a step, or with local SGD a sync (its quorum thread
serves it while the step's forward and backward run: nothing in it changes before that step's commit), and hands it
to the healing island at its commit, in the middle of the same step or sync. The optimizer steps come over as the
peer had completed them, and the healing island counts the step it is in as begun. With local SGD the outer loop
comes too: this rank's shard of the anchor and outer momentum, and the loop's counters.

Not healed: the data position (each island draws its own batches from its own sampler: a returning island starts
its epoch again) and the comm hook's per-rank state (error feedback starts empty on the healed island, as at the
first step).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl

from lightning_ddpopt._compat import batches_that_stepped
from lightning_ddpopt.core import CoreViews

__all__ = ["Phase", "load_training_state", "training_state"]


#: Where an island is in its optimizer step when it gives or takes the state: inside a step before its optimizer
#: step (a per-step commit), just after its optimizer step (a local SGD sync), or between two steps (a local SGD
#: island joining at its first batch). Lightning counts a step completed, and a batch stepped, only after both.
Phase = Literal["in_step", "after_step", "between_steps"]


def training_state(trainer: pl.Trainer, phase: Phase) -> dict[str, Any]:
    """The island's state as a peer heals from it: tensors by reference (torchft serialises them when fetched)."""
    module = trainer.lightning_module
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    loop = trainer.fit_loop.epoch_loop
    strategy = trainer.strategy
    outer = strategy.local_sgd if isinstance(strategy, CoreViews) else None
    return {
        "local_sgd": outer.heal_state() if outer is not None else None,
        "module": module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer_progress": loop.automatic_optimization.optim_progress.state_dict(),
        "batches_that_stepped": batches_that_stepped(trainer),
        "phase": phase,
    }


def load_training_state(trainer: pl.Trainer, state: dict[str, Any], phase: Phase) -> None:
    """Load a peer's :func:`training_state` into this island, which is at ``phase`` of its step."""
    trainer.lightning_module.load_state_dict(state["module"])
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
        config.scheduler.load_state_dict(saved)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress
    progress.load_state_dict(state["optimizer_progress"])
    # The steps the peer had taken (one more than Lightning counted just after its optimizer step), less the one this
    # island is taking now if it is past its optimizer step: Lightning counts that one when the step ends. A step
    # this island is inside has begun. (The peer's own ``ready`` depends on when torchft's thread read it.)
    shift = int(state["phase"] == "after_step") - int(phase == "after_step")
    step = progress.optimizer.step
    for counts in (step.total, step.current):
        counts.completed += shift
        counts.ready = counts.completed + int(phase != "between_steps")
    batches_that_stepped(trainer, state["batches_that_stepped"] + shift)
    strategy = trainer.strategy
    outer = strategy.local_sgd if isinstance(strategy, CoreViews) else None
    if outer is not None and state["local_sgd"] is not None:
        outer.load_heal_state(state["local_sgd"])
