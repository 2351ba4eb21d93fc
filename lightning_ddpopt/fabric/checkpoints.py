"""Fabric's ``OptimizedDDPStrategy`` checkpoints: ``fabric.save`` adds our state, ``fabric.load`` restores it.

What every rank shares (local SGD's outer loop, the measured decisions, the GradScaler's state, which Fabric does not
save, and the optimizer-step count) goes into the file under ``"ddpopt"``; what differs per rank (comm-hook state,
local SGD's inner optimizer states) into shards beside it (:mod:`lightning_ddpopt.checkpoint_shards`), through the
:class:`~lightning_ddpopt.core.StrategyCore` the Trainer's strategy checkpoints with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddpopt._compat import PathType
from lightning_ddpopt.checkpoint import CHECKPOINT_KEY

if TYPE_CHECKING:
    from lightning_ddpopt.core import StrategyCore

__all__ = ["CheckpointingDDPStrategy"]


class CheckpointingDDPStrategy(FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` whose checkpoints carry this package's state (the base of its ``OptimizedDDPStrategy``).

    Checkpoints: ``fabric.save`` adds local SGD's outer loop, the measured decisions and the GradScaler's state
    (which Fabric does not save) under ``"ddpopt"``, and each rank writes its own hook state and inner optimizer
    states beside the file (:mod:`lightning_ddpopt.checkpoint_shards`); ``fabric.load`` restores them (before or
    after ``fabric.setup``) and does not return that key. With local SGD, each rank's optimizer in the loaded
    ``state`` gets its own saved state, matched by order: keep the optimizers in the same order in the saved and the
    loaded ``state``. Every rank must call both, as Fabric requires.
    """

    _core: StrategyCore
    #: The DDP-wrapped model once set up.
    model: DistributedDataParallel | None
    #: Optimizer steps taken (the Trainer's ``global_step``), those before a resume included.
    optimizer_steps: int
    #: Checkpoints loaded with a step count, and heals (a Monitor restarts its callbacks' step counting after one).
    resumes: int
    _warned_partial_load: bool  # fabric.load(path, module) leaves our state behind: said once
    _restored: bool  # a checkpoint's state of ours was restored (a later whole read loses nothing)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """Fabric's GradScaler when fp16 AMP runs with one (``None`` without, or disabled)."""
        scaler = getattr(self.precision, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    @override
    def save_checkpoint(
        self,
        path: PathType,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Add local SGD's state, the GradScaler's and the step count, write what differs per rank to shards, save.

        What differs per rank (comm-hook state, local SGD's inner optimizer and island outer states) goes to the
        directory ``path + ".ddpopt"``, each rank writing its own (see :mod:`lightning_ddpopt.checkpoint_shards`).

        Every rank must call it, as Fabric requires; with a stateful hook a call on fewer ranks raises once the
        process group's timeout (or ``checkpoint_timeout``) has passed (see :mod:`lightning_ddpopt.checkpoint`).

        Args:
            path: where the checkpoint goes, as for ``fabric.save``.
            state: what ``fabric.save`` was given; it must not hold a key ``"ddpopt"``.
            storage_options: passed on to Fabric's checkpoint IO.
            filter: Fabric's per-key filters of what to save.
        """
        if CHECKPOINT_KEY in state:
            raise ValueError(f"the checkpoint state has a key {CHECKPOINT_KEY!r}, which OptimizedDDPStrategy uses")
        if state and all(isinstance(value, torch.Tensor) for value in state.values()):
            # The weights alone (fabric.save(path, model.state_dict())): a file to load into a module, as it is.
            super().save_checkpoint(path, state, storage_options, filter)
            return
        optimizers = [value for value in state.values() if isinstance(value, Optimizer)]
        scaler = self.grad_scaler
        entry = self._core.checkpoint_entry(
            optimizers or None,
            path,
            grad_scaler=scaler.state_dict() if scaler is not None else None,
            optimizer_steps=self.optimizer_steps,
        )
        if entry is not None:
            state = {**state, CHECKPOINT_KEY: entry}
        state = {**state, **self._extra_checkpoint_state()}
        super().save_checkpoint(path, state, storage_options, filter)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a module's weights, without our entry: said once not to be restored.

        A checkpoint of the weights alone read back with ``fabric.load_raw(path, model)`` holds no entry of ours
        (:meth:`save_checkpoint` adds none to a state of tensors alone), except one saved by an earlier release: the
        entry is taken out, so the weights load, strictly or not.

        Args:
            module: the module to load into.
            state_dict: its weights (a whole checkpoint, for ``fabric.load_raw``).
            strict: whether every key must match.
        """
        if CHECKPOINT_KEY in state_dict:
            state_dict = {key: value for key, value in state_dict.items() if key != CHECKPOINT_KEY}
            self._warn_partial_load("fabric.load_raw(path, model) restores the weights alone")
        super().load_module_state_dict(module, state_dict, strict)

    def _extra_checkpoint_state(self) -> dict[str, Any]:
        """More of a subclass's state for a whole checkpoint, beside our entry (none here)."""
        return {}

    def _load_extra_checkpoint_state(self, remainder: dict[str, Any]) -> None:
        """Take a subclass's :meth:`_extra_checkpoint_state` back out of a loaded checkpoint's ``remainder``."""

    def _warn_partial_load(self, what: str) -> None:
        """Say once that a load left this package's part of the checkpoint behind, and which load restores it."""
        if not self._warned_partial_load:
            self._warned_partial_load = True
            rank_zero_warn(
                f"ddpopt: {what}: this checkpoint's comm-hook state, local SGD's outer loop, GradScaler and step "
                "count are restored by fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )

    @override
    def load_checkpoint(
        self,
        path: PathType,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load as Fabric does, then restore this package's part of the checkpoint (not returned to the caller).

        Args:
            path: the checkpoint, as for ``fabric.load``.
            state: the objects to restore in place, as for ``fabric.load``.
            strict: whether every key of ``state`` must be in the checkpoint.
            weights_only: passed on to ``torch.load``.
        """
        remainder = super().load_checkpoint(path, state, strict, weights_only)
        entry = remainder.pop(CHECKPOINT_KEY, None)
        self._load_extra_checkpoint_state(remainder)
        if not isinstance(state, dict) or not state:  # a raw state dict, or the file read whole: nothing to restore
            if entry is not None and not self._restored:  # (read again after a load that restored it: nothing lost)
                self._warn_partial_load("fabric.load(path) without the objects to restore returns the checkpoint alone")
            return remainder
        saved = self._core.load(entry, model_wrapped=self.model is not None, path=path)
        if saved is None:
            return remainder
        self._restored = True
        scaler = self.grad_scaler
        if saved.grad_scaler and scaler is not None:
            scaler.load_state_dict(saved.grad_scaler)
        if saved.optimizer_steps is not None:
            self.optimizer_steps = saved.optimizer_steps
            self.resumes += 1
        if self.model is not None:
            self._core.warn_decisions_not_reused()
        own = self._core.saved_optimizer_states()
        optimizers = [value for value in state.values() if isinstance(value, Optimizer)]
        if own is not None and optimizers:
            if len(own) != len(optimizers):
                rank_zero_warn(
                    f"ddpopt: the checkpoint holds {len(own)} inner optimizer states per rank and the loaded state "
                    f"has {len(optimizers)} optimizers; every rank keeps rank 0's optimizer state"
                )
            else:
                for optimizer, optimizer_state in zip(optimizers, own, strict=True):
                    optimizer.load_state_dict(optimizer_state)
        return remainder
