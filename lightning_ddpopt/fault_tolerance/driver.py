"""How a strategy runs a fault-tolerant step: the quorum before the forward, the average and the vote before the step.

Both strategies drive the same :class:`FaultTolerantSteps`: :meth:`~FaultTolerantSteps.before_batch` at a training
micro-batch's start (the Trainer's ``on_train_batch_start``, the Fabric model's forward), and the vote before the
optimizer step (:meth:`~FaultTolerantSteps.optimizer_step` around the Trainer's closure,
:meth:`~FaultTolerantSteps.vote` on the gradients a Fabric loop's backward left); everything else (DDP inside the
island, the hooks, the callbacks) runs as without fault tolerance. With local SGD the islands meet only at its
syncs: the loop's exchange of the change goes through the quorum
(:meth:`~lightning_ddpopt.fault_tolerance.replica.Replica.sync_mean`), a sync is the commit point, and the steps
between syncs vote on nothing. The front ends' own collectives (barriers, ``sync_dist``, checkpoint broadcasts) stay
inside the island: each island is its own job, whose world is the island.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_ddpopt.fault_tolerance.config import FaultTolerance
from lightning_ddpopt.fault_tolerance.replica import CHUNK_VALUES, Replica, ReplicaStats
from lightning_ddpopt.fault_tolerance.state import broadcast_state
from lightning_ddpopt.hooks.across_islands import AcrossIslands
from lightning_ddpopt.localsgd import LocalSGDDriver

__all__ = ["CHECKPOINT_KEY", "FaultTolerantSteps"]

#: Where a checkpoint holds torchft's manager state (the run's committed steps), beside the package's own entry.
CHECKPOINT_KEY = "ddpopt_fault_tolerance"


class FaultTolerantSteps:
    """Drives :class:`~lightning_ddpopt.fault_tolerance.replica.Replica` from a strategy's hooks.

    Args:
        config: the user's :class:`~lightning_ddpopt.fault_tolerance.FaultTolerance`.
        local_sgd: the strategy's local SGD (its syncs cross the islands; the job becomes one island of them), or
            ``None``: every step's gradients cross them.
    """

    def __init__(self, config: FaultTolerance, local_sgd: LocalSGDDriver | None = None) -> None:
        self.config = config
        if local_sgd is not None:
            local_sgd.one_island = True  # each island is a job of its own: the job is one replica
        self._local_sgd = local_sgd
        #: Per step: the islands' average of each step's gradients, run by the strategy's hook in the backward pass.
        self.across = AcrossIslands(CHUNK_VALUES) if local_sgd is None else None
        self._across_steps = 0
        self.replica: Replica | None = None
        #: What the quorum did to this island (kept after the fit ends); ``None`` before the first fit.
        self.stats: ReplicaStats | None = None
        self._joined = False
        self._aligned = False
        self._island: tuple[int, int] = (0, 1)
        self._state: tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]] | None = None
        self._broadcast: Callable[[Any], Any] | None = None
        self._device = torch.device("cpu")
        self._resumed: dict[str, int] | None = None

    @property
    def per_step(self) -> bool:
        """Whether every optimizer step votes (no local SGD: its syncs vote instead)."""
        return self._local_sgd is None

    def setup(
        self,
        island_rank: int,
        island_size: int,
        store: tuple[str, int],
        device: torch.device,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        broadcast: Callable[[Any], Any],
    ) -> None:
        """Join the quorum, once the island's process group, model and optimizers exist.

        Args:
            island_rank: this rank in its island (the job).
            island_size: the island's ranks.
            store: the island's TCPStore, as its process group was set up with.
            device: where the gradients are.
            state_dict: the island's training state, for a peer that heals.
            load_state_dict: loads a peer's state into this island when it heals.
            broadcast: sends an object from the island's first rank to its others (the strategy's ``broadcast``).
        """
        sync_every = self._local_sgd.config.first_sync_every if self._local_sgd is not None else 1

        def join() -> Replica:
            return Replica(
                self.config, island_rank, island_size, store, state_dict, load_state_dict, device, sync_every
            )

        # The island's first rank first: it leaves its manager's address in the island's store, which the others
        # read (a rejoin after an earlier fit would otherwise find the address of the manager that fit closed). If it
        # fails, the others say so instead of waiting for it.
        if island_rank == 0:
            try:
                self.replica = join()
            except Exception as error:
                broadcast(f"{type(error).__name__}: {error}")
                raise
        failure = broadcast(None)
        if failure is not None:
            raise RuntimeError(f"the island's first rank could not join the quorum: {failure}")
        if self.replica is None:
            self.replica = join()
        self.stats = self.replica.stats
        self._load_resumed()
        if self.across is not None:
            replica, across = self.replica, self.across
            across.average = lambda flat: replica.average_chunk(flat, across.group)
            across.begin = replica.begin_average
            across.start()  # its thread again after a teardown (a Fabric loop's next join)
            self._across_steps = across.steps
        self._island, self._state = (island_rank, island_size), (state_dict, load_state_dict)
        self._broadcast, self._device = broadcast, device
        self._aligned = island_size == 1

    def checkpoint_state(self) -> dict[str, int] | None:
        """Torchft's manager state for a checkpoint (the run's committed steps), ``None`` outside the quorum."""
        return dict(self.replica.manager.state_dict()) if self.replica is not None else None

    def resume(self, state: dict[str, int] | None) -> None:
        """Restore a checkpoint's :meth:`checkpoint_state`, now or when this island joins the quorum.

        The run restarted whole from its checkpoints then asks its first quorum at the committed step it saved: the
        islands that saved later are ahead, and heal the others, and the run's step count goes on.
        """
        self._resumed = dict(state) if state is not None else None
        self._load_resumed()

    def _load_resumed(self) -> None:
        if self._resumed is not None and self.replica is not None:
            self.replica.manager.load_state_dict(self._resumed)
            self.replica.stats.step = self._resumed["step"]
            self._resumed = None

    def before_batch(self) -> None:
        """Start the next step's quorum unless a step is open (the first micro-batch of an accumulated step).

        With local SGD only the syncs meet the quorum: the loop's exchange across the islands becomes the replica's.
        """
        replica = self.replica
        if replica is None:
            return
        if self._local_sgd is not None:
            loop = self._local_sgd.loop
            if loop is not None:
                loop.across_islands = replica.sync_mean  # this fit's replica (a later fit joins with a new one)
            if loop is not None and not self._joined:
                # Join with a sync after the first step: at a fresh start every island (torchft gives the first
                # island's state to the others), a restarted one at the live islands' next sync, healed there instead
                # of training a window alone first. Inside a step, as the live islands' syncs are.
                self._joined = loop.sync_next = True
            return
        if not replica.step_open:
            replica.start_step()
            if self.across is not None:
                self.across.new_step()

    def vote(self, parameters: list[torch.nn.Parameter]) -> bool:
        """Per step: average ``parameters``' gradients over the islands of the quorum, then vote on the step.

        Returns whether to take the step; on ``False`` the step is dropped on every island of the quorum.

        Raises:
            RuntimeError: no step is open (a second optimizer step in one batch: one vote per step).
        """
        replica = self.replica
        assert replica is not None and self.per_step
        if not replica.step_open:
            raise RuntimeError(
                "fault_tolerance votes once per step, started by the step's first training forward: a second "
                "optimizer step without a forward between (several optimizers) is not supported; step one optimizer"
            )
        across = self.across
        if across is not None and across.steps > self._across_steps:
            self._across_steps = across.steps  # averaged by the hook in the backward pass
        else:
            # The hook's own list where it has one: the same chunks as the islands whose hook averaged this step.
            synced = across.parameters if across is not None and across.parameters else parameters
            replica.average_gradients(synced, across.group if across is not None else None)
        return replica.commit()

    def after_step(self) -> None:
        """After every optimizer step (and local SGD's sync): once this island has committed, align its ranks.

        At a run's first quorum torchft gives each rank of an island the state of another island's same rank (its
        ``init_sync``, the source chosen per rank), and per step the first average runs over different islands per
        rank: the ranks of an island can leave the first commit apart (with local SGD: in their inner optimizer
        state, GradScaler and counters; the outer loop's shards are per rank by design). The island's first rank's
        training state goes to the others once, there: its structure pickled, its tensors broadcast as tensors
        (:func:`~lightning_ddpopt.fault_tolerance.state.broadcast_state`; later heals come whole from islands at the
        same step, and keep the ranks aligned). It is no heal: error feedback, step counts and the loop's position
        stay.
        """
        replica = self.replica
        if self._aligned or replica is None or replica.stats.committed == 0:
            return
        self._aligned = True
        assert self._state is not None and self._broadcast is not None
        state_dict, load_state_dict = self._state
        state = {**state_dict(), "local_sgd": None, "heal": False} if self._island[0] == 0 else None
        state = broadcast_state(state, self._device, self._broadcast)
        if self._island[0] != 0:
            load_state_dict(state)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        parameters: list[torch.nn.Parameter],
    ) -> Any:
        """Run ``closure`` (forward, backward), average across islands, vote, then ``step`` with its result or drop.

        ``step(closure)`` is the strategy's own optimizer step; it receives a closure that returns the result
        already computed, so precision plugins (which unscale after the closure) and callbacks see the averaged
        gradients as usual. A dropped step zeroes the gradients.
        """
        if self.replica is None or not self.per_step:  # local SGD: its syncs vote, inside this step
            return step(closure)
        result = closure()
        if not self.vote(parameters):
            optimizer.zero_grad()
            return result
        return step(lambda: result)

    def teardown(self) -> None:
        """Leave the quorum (a later fit, or a Fabric loop's next training forward, joins again)."""
        self._joined = False
        self._aligned = self._island[1] == 1
        if self.across is not None:
            self.across.average = self.across.begin = None
            self.across.close()
        if self.replica is not None:
            self.replica.close()
            self.replica = None
