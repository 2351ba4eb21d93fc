"""The training state a returning island heals from: what a Lightning resume needs, taken from a live peer.

torchft asks a live island for it at a quorum and hands it to the healing island at that quorum's commit. Both are
then at the same point of the same step: per step, the quorum is asked before the step's forward and the commit
comes before its optimizer step; with local SGD both are inside a sync, after the step's inner optimizer step (a
restarted island joins with a sync after its first step). So the optimizer steps come over as the peer had
completed them, and the healing island counts the step it is in as begun. With local SGD the outer loop comes too:
this rank's shard of the anchor and outer momentum, and the loop's counters. Nothing in the state changes between
the quorum and the commit, except, per step, what the forward updates in place (BatchNorm's running statistics),
which may come over half-updated.

A Fabric loop's island heals the same: its model, its optimizers (those set up through the strategy), the
GradScaler, the strategy's optimizer-step count, local SGD's state, and what the loop put in the strategy's
``heal_state`` (its schedulers, its own counters), as ``fabric.load`` restores a checkpoint's.

The loop's progress comes too: a Trainer island takes the peer's epoch and position in it (its samplers set to that
epoch, the batches the peer has passed read and dropped once), so its next batch is the one its shard gives there
and epoch-interval schedulers step with the others'. A Fabric loop's epoch and position are its own: keep them in
``heal_state`` and move the data as the loop resumes from a checkpoint.

Not healed: the comm hook's error feedback, which the healed island forgets (it was computed on the weights it had
before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_ddpopt._compat import batches_that_stepped, move_training_data
from lightning_ddpopt.hooks.base import ErrorFeedbackState
from lightning_ddpopt.localsgd import LocalSGD
from lightning_ddpopt.measuring import CoreViews

__all__ = [
    "FabricIsland",
    "broadcast_state",
    "fabric_state",
    "load_fabric_state",
    "load_training_state",
    "training_state",
]


class FabricIsland(Protocol):
    """What a Fabric loop's training state is held in: :class:`lightning_ddpopt.fabric.OptimizedDDPStrategy`."""

    model: DistributedDataParallel | None
    optimizers: list[Optimizer]
    optimizer_steps: int
    resumes: int
    heal_state: dict[str, Any]

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler under fp16 AMP."""

    @property
    def comm_state(self) -> object | None:
        """The comm hook's state."""

    @property
    def local_sgd(self) -> LocalSGD | None:
        """Local SGD's outer loop."""


def training_state(trainer: pl.Trainer) -> dict[str, Any]:
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
        "epoch_progress": trainer.fit_loop.epoch_progress.state_dict(),
        "batch_progress": loop.batch_progress.state_dict(),
    }


def load_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Load a peer's :func:`training_state` into this island, at the same point of the same step (see the module)."""
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
    # The peer's completed steps are exact wherever it was in the step (Lightning counts one when it ends); this
    # island is inside the same step, so it has begun it. (The peer's ``ready`` depends on when torchft read it.)
    step = progress.optimizer.step
    for counts in (step.total, step.current):
        counts.ready = counts.completed + 1
    batches_that_stepped(trainer, state["batches_that_stepped"])
    if state.get("heal", True):
        _move_to_peers_position(trainer, state["epoch_progress"], state["batch_progress"])
    if isinstance(trainer.strategy, CoreViews):
        _load_ours(trainer.strategy, state)


def _move_to_peers_position(
    trainer: pl.Trainer, epoch_progress: dict[str, Any], batch_progress: dict[str, Any]
) -> None:
    """Take the peer's epoch and its position in it, inside the step this island heals in (see the module).

    The peer has completed ``completed`` batches of its epoch and is in the next, as this island is: the batches up
    to and including that one are read past, so the loop's next batch is the shard's batch after it.
    """
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress
    epochs: Any = fit_loop.epoch_progress.current  # a tracker with processed counts (typed as its base)
    here = (epochs.processed, progress.current.completed)
    if here == (epoch_progress["current"]["processed"], batch_progress["current"]["completed"]):
        return  # already there (an island healed one step behind the others, after a step it dropped alone)
    fit_loop.epoch_progress.load_state_dict(epoch_progress)
    progress.load_state_dict(batch_progress)
    trackers: tuple[Any, ...] = (progress.total, progress.current)
    for counts in trackers:  # begun, whenever the peer's state was read in its step
        counts.ready = counts.started = counts.completed + 1
        counts.processed = counts.completed
    move_training_data(trainer, epochs.processed, progress.current.ready)


def fabric_state(strategy: FabricIsland) -> dict[str, Any]:
    """A Fabric island's state as a peer heals from it (see the module): tensors by reference."""
    assert strategy.model is not None
    scaler = strategy.grad_scaler
    outer = strategy.local_sgd
    return {
        "local_sgd": outer.heal_state() if outer is not None else None,
        "module": strategy.model.module.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in strategy.optimizers],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "optimizer_steps": strategy.optimizer_steps,
        "heal_state": {
            key: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
            for key, value in strategy.heal_state.items()
        },
    }


def load_fabric_state(strategy: FabricIsland, state: dict[str, Any]) -> None:
    """Load a peer's :func:`fabric_state` into this Fabric island, inside the same optimizer step (see the module).

    The objects of ``strategy.heal_state`` with ``load_state_dict`` load the peer's in place; any other value is
    replaced in the dict by the peer's, as ``fabric.load`` does.
    """
    assert strategy.model is not None
    strategy.model.module.load_state_dict(state["module"])
    for optimizer, saved in zip(strategy.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    scaler = strategy.grad_scaler
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    if state.get("heal", True) and strategy.optimizer_steps != state["optimizer_steps"]:
        strategy.optimizer_steps = state["optimizer_steps"]  # the peer's, inside this step: it counts it as we will
        strategy.resumes += 1  # a Monitor's callbacks count steps from here, as after a fabric.load
    extra = strategy.heal_state
    for key, saved in state["heal_state"].items():
        mine = extra.get(key)
        if callable(getattr(mine, "load_state_dict", None)):
            mine.load_state_dict(saved)  # type: ignore[union-attr]
        elif isinstance(mine, torch.Tensor) and isinstance(saved, torch.Tensor):
            extra[key] = saved.to(mine.device)  # where this island kept it (it came through the CPU)
        else:
            extra[key] = saved
    _load_ours(strategy, state)


def _load_ours(strategy: CoreViews | FabricIsland, state: dict[str, Any]) -> None:
    """At a heal, the comm hook's error feedback forgotten; local SGD's state loaded: what both front ends share.

    ``state["heal"]`` is ``False`` where an island's first rank aligns the others (no heal: nothing to forget).
    """
    comm_state = strategy.comm_state
    if state.get("heal", True) and isinstance(comm_state, ErrorFeedbackState):
        comm_state.forget_errors()  # computed on the weights this island had before: they would mislead
    outer = strategy.local_sgd
    if outer is not None and state["local_sgd"] is not None:
        outer.load_heal_state(state["local_sgd"])


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a state sent by :func:`broadcast_state`: its place in the order sent, its kind."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def broadcast_state(
    state: dict[str, Any] | None, device: torch.device, broadcast: Callable[[Any], Any]
) -> dict[str, Any]:
    """``state`` from the island's first rank (global rank 0 of the island's job) to its other ranks.

    Its structure goes through ``broadcast`` (a pickle of names and numbers), its tensors as tensors, one broadcast
    each on ``device`` (the process group's: CUDA under NCCL), received in place: no copy of the whole state. A
    tensor that was on the CPU arrives on the CPU, any other on ``device``. Every rank calls it; only the first
    rank's ``state`` is read.
    """
    tensors: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor)
        return _Slot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, tensor.device.type == "cpu")

    layout = broadcast(apply_to_collection(state, torch.Tensor, slot) if state is not None else None)
    received: dict[int, torch.Tensor] = {}

    def send(where: _Slot) -> None:
        if state is not None:
            tensor = tensors[where.index].detach().to(device)
        else:
            tensor = torch.empty(where.shape, dtype=where.dtype, device=device)
        dist.broadcast(tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor, src=0)  # gloo: no bool
        received[where.index] = tensor.cpu() if where.on_cpu else tensor

    apply_to_collection(layout, _Slot, send)  # in the order the structure walks, the same on every rank
    return apply_to_collection(layout, _Slot, lambda where: received[where.index])
