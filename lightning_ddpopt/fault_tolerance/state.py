"""The training state a returning island heals from: what a Lightning resume needs, taken from a live peer.

torchft asks a healthy island for it at the start of a step (its quorum thread serves it while the step's forward
and backward run: nothing in it changes before that step's commit) and hands it to the healing island at its commit,
mid-step. So the loop counters come over as they stood at the peer's step start, and the healing island, in the
middle of the same step, counts it as begun.

Not healed: the data position (each island draws its own batches from its own sampler: a returning island starts
its epoch again) and the comm hook's per-rank state (error feedback starts empty on the healed island, as at the
first step).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_ddpopt._compat import batches_that_stepped

__all__ = ["load_training_state", "training_state"]


def training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The island's state as a peer heals from it: tensors by reference (torchft serialises them when fetched)."""
    module = trainer.lightning_module
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    loop = trainer.fit_loop.epoch_loop
    return {
        "module": module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer_progress": loop.automatic_optimization.optim_progress.state_dict(),
        "batches_that_stepped": batches_that_stepped(trainer),
    }


def load_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Load a peer's :func:`training_state` into this island, mid-step (at the step's commit)."""
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
    # The peer's counters stood at its step start; this island is inside that step: it has begun it.
    progress.optimizer.step.increment_ready()
    batches_that_stepped(trainer, state["batches_that_stepped"])
