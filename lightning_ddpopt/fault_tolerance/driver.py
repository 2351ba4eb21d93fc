"""How a strategy runs a fault-tolerant step: the quorum before the forward, the average and the vote before the step.

The strategy calls :meth:`FaultTolerantSteps.before_batch` in ``on_train_batch_start`` and hands its optimizer step
to :meth:`FaultTolerantSteps.optimizer_step`; everything else (DDP inside the island, the hooks, the callbacks) runs
as without fault tolerance. With local SGD the islands meet only at its syncs: the loop's exchange of the change
goes through the quorum (:meth:`~lightning_ddpopt.fault_tolerance.replica.Replica.sync_mean`), a sync is the commit
point, and the steps between syncs vote on nothing. Lightning's own collectives (barriers, ``sync_dist``,
checkpoint broadcasts) stay inside the island: each island is its own Lightning job, whose world is the island.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ddpopt.fault_tolerance.config import FaultTolerance
from lightning_ddpopt.fault_tolerance.replica import Replica, ReplicaStats
from lightning_ddpopt.fault_tolerance.state import load_training_state, training_state
from lightning_ddpopt.localsgd import LocalSGD

__all__ = ["FaultTolerantSteps"]


class FaultTolerantSteps:
    """Drives :class:`~lightning_ddpopt.fault_tolerance.replica.Replica` from a Lightning strategy's hooks."""

    def __init__(self, config: FaultTolerance, outer_loop: Callable[[], LocalSGD | None] | None = None) -> None:
        self.config = config
        #: With local SGD: the loop, whose syncs across the islands go through the quorum (no vote per step).
        self._outer_loop = outer_loop
        self.replica: Replica | None = None
        #: What the quorum did to this island (kept after the fit ends); ``None`` before the first fit.
        self.stats: ReplicaStats | None = None
        self._joined = False

    def setup(self, trainer: pl.Trainer, island_rank: int, island_size: int, store: tuple[str, int]) -> None:
        """Join the quorum (at the start of fit, once the island's process group and optimizers exist)."""
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "fault_tolerance needs automatic optimization: the strategy votes on each optimizer step before "
                "taking it; manual optimization is not supported yet"
            )
        self.replica = Replica(
            self.config,
            island_rank,
            island_size,
            store,
            state_dict=lambda: training_state(trainer),
            load_state_dict=lambda state: load_training_state(trainer, state),
            device=module.device,
        )
        self.stats = self.replica.stats

    def before_batch(self) -> None:
        """Start the next step's quorum unless a step is open (the first micro-batch of an accumulated step).

        With local SGD only the syncs meet the quorum: the loop's exchange across the islands becomes the replica's.
        """
        replica = self.replica
        if replica is None:
            return
        if self._outer_loop is not None:
            loop = self._outer_loop()
            if loop is not None and loop.across_islands is None:
                loop.across_islands = replica.sync_mean
            if loop is not None and not self._joined:
                # Join with a sync after the first step: at a fresh start every island (torchft gives the first
                # island's state to the others), a restarted one at the live islands' next sync, healed there instead
                # of training a window alone first. Inside a step, as the live islands' syncs are.
                self._joined = loop.sync_next = True
            return
        if not replica.step_open:
            replica.start_step()

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        module: pl.LightningModule,
    ) -> Any:
        """Run ``closure`` (forward, backward), average across islands, vote, then ``step`` with its result or drop.

        ``step(closure)`` is the strategy's own optimizer step; it receives a closure that returns the result
        already computed, so precision plugins and callbacks see the averaged gradients as usual.
        """
        replica = self.replica
        if replica is None:
            return step(closure)
        if self._outer_loop is not None:  # local SGD: its syncs vote, inside this step
            output = step(closure)
            self._log(module, replica.stats)
            return output
        result = closure()
        replica.average_gradients([p for p in module.parameters() if p.requires_grad])
        committed = replica.commit()
        self._log(module, replica.stats)
        if not committed:
            optimizer.zero_grad()
            return result
        return step(lambda: result)

    @staticmethod
    def _log(module: pl.LightningModule, stats: ReplicaStats) -> None:
        module.log("ddpopt/ft/participants", float(stats.participants), on_step=True, on_epoch=False)
        module.log("ddpopt/ft/dropped_steps", float(stats.dropped), on_step=True, on_epoch=False)
        module.log("ddpopt/ft/heals", float(stats.heals), on_step=True, on_epoch=False)

    def teardown(self) -> None:
        """Leave the quorum (a later fit joins again)."""
        self._joined = False
        if self.replica is not None:
            self.replica.close()
            self.replica = None
