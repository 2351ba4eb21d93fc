"""Driving local SGD from the strategy's hooks: the owner of every meeting of the ranks while they train apart.

In the local phase the ranks meet only at parameter syncs. :class:`LocalSGDDriver` keeps it so: it turns DDP's
gradient sync and buffer broadcast off for local batches, replaces Lightning's per-batch SIGTERM barrier with a
check once a window (:mod:`lightning_ddpopt.localsgd.sigterm`); the loop's schedule says in which batches the
ranks meet (read through :mod:`lightning_ddpopt.meetings`), so that the measuring callbacks hold their own
collectives until then. It also counts the steps a GradScaler skipped, records each sync in the ledger, averages the
ranks at the end of fit, and carries each rank's inner optimizer state in checkpoints.

It measures what ``sync_every="auto"`` chooses from, in the ledger: this rank's median step time over the local
steps of the first window after the warm-up (the ledger's records of them), and the first sync's seconds on the
ledger's timeline (a blocking sync's own; an overlapped one's from its start to its application). The loop agrees on
them with the other ranks and chooses (:meth:`~lightning_ddpopt.localsgd.outer.LocalSGD.agree_sync_every`); rank 0
says the choice. ``outer_lr`` and ``outer_momentum`` ``"auto"`` are resolved here for the strategy's optimizers.

The terms used here (round, verdict, meeting, in flight, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt._compat import say_during_training, set_ddp_sync
from lightning_ddpopt._groups import destroy_owned_group
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.localsgd.config import LocalSGDConfig
from lightning_ddpopt.localsgd.islands import Islands, plan_islands
from lightning_ddpopt.localsgd.outer import LocalSGD, ParameterSync
from lightning_ddpopt.localsgd.sigterm import SigtermAtSyncs
from lightning_ddpopt.timing import Mark
from lightning_ddpopt.topology import TierGroups, Topology

__all__ = ["LocalSGDDriver"]


class LocalSGDDriver:
    """Local SGD's outer loop as the strategy runs it, from setup to teardown.

    Args:
        config: the strategy's ``local_sgd``.
    """

    def __init__(self, config: LocalSGDConfig) -> None:
        self.config = config
        self.loop: LocalSGD | None = None
        #: The replicas' ranks, from :meth:`plan` on.
        self.islands: Islands | None = None
        #: Islands of several ranks: their groups (an island is a node to them: ``intra``, ``intra_gather``, ``cross``).
        self.groups: TierGroups | None = None
        self._group: dist.ProcessGroup | None = None
        self._sigterm: SigtermAtSyncs | None = None
        #: Fault-tolerant islands: the job is one island, whatever ``replica`` says (the islands are jobs).
        self.one_island = False
        # sync_every="auto": the ledger's closed steps when the measured window began, and an overlapped measured
        # sync's start mark with the window's step time.
        self._window_opened: int | None = None
        self._started: tuple[Mark, float] | None = None
        # The outer step's "auto" settings last said on rank 0.
        self._said_outer: tuple[object, ...] | None = None

    def setup(self, trainer: pl.Trainer, world_size: int, device: torch.device) -> None:
        """Average the ranks first thing at the end of fit; check for SIGTERM once a window, not every batch."""
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _FinalAverage) for c in callbacks):
            # First in line, so that the callbacks' and the module's on_train_end see the averaged model.
            callbacks.insert(0, _FinalAverage(self))
        if trainer.state.fn == TrainerFn.FITTING and world_size > 1:
            # Lightning's check makes every batch a barrier, so each local step lasted as long as the slowest rank's.
            sigterm = SigtermAtSyncs(trainer, self._phase, device)
            if sigterm.install():
                self._sigterm = sigterm

    def _phase(self) -> tuple[bool, bool, int]:
        loop = self.loop
        if loop is None:
            return False, True, 0
        return loop.local, loop.window_starts, loop.steps

    def plan(
        self,
        topology: Topology | None,
        world_size: int,
        rank: int,
        new_group: Callable[[list[int]], dist.ProcessGroup],
    ) -> tuple[Callable[[], dist.ProcessGroup | None], Callable[[], bool]] | None:
        """Lay out the replicas (logged on rank 0) and make their groups, before the comm hook is registered.

        Every rank calls it, in the same order relative to other group creations. Returns, for islands of several
        ranks, what the comm hook needs to sync gradients inside the island: its group and whether the ranks train
        apart now (``None`` when every rank is a replica: no gradient syncs apart from the warm-up).
        """
        if self.one_island and world_size > 1:
            # DDP's own sync over the job's ranks is the island's every step; the islands' exchange is torchft's.
            members = (tuple(range(world_size)),)
            self.islands = Islands(rank, members, "fault tolerance: this job is one island of the quorum")
            return None
        self.islands = plan_islands(self.config.replica, topology, world_size, rank)
        if world_size > 1:
            rank_zero_info(f"ddpopt: local SGD replicas: {self.islands.describe()}; {self.islands.reason}")
        if self.islands.size == 1:
            return None
        if self.islands.spans_nodes(topology):
            assert topology is not None
            rank_zero_warn(
                f"ddpopt: local SGD replica={self.config.replica!r} puts ranks of several nodes into one replica "
                f"({self.islands.describe()} on {topology.describe()}): its gradients cross the nodes every step; "
                "replica='node' keeps each replica inside a node"
            )
        groups = self.groups = TierGroups(Topology(rank=rank, nodes=self.islands.members), new_group)
        return (lambda: groups.intra), (lambda: self.loop is not None and self.loop.local)

    def start(self, model: DistributedDataParallel, own_group: Callable[[], dist.ProcessGroup]) -> None:
        """Build the outer loop over ``model``'s parameters once DDP has wrapped them."""
        self._window_opened = self._started = self._said_outer = None  # an earlier fit's, on its own ledger
        if self.groups is not None:  # the replicas' exchange and the island's gather: groups of their own
            assert self.islands is not None
            if model.find_unused_parameters or getattr(model, "static_graph", False):
                rank_zero_warn(
                    "ddpopt: with local SGD islands, DDP's find_unused_parameters or static_graph all-reduce which "
                    "parameters were used over every rank at every step: the islands then meet every step"
                )
            self.loop = LocalSGD(
                self.config, model.module, self.groups.cross, island=self.groups.intra_gather, place=self.islands.place
            )
            layout = self.loop.layout
            if self.loop.params[0].device.type == "cpu":  # the island's gather buffers, mapped by its ranks together
                layout.buffers(self.loop.params[0].device)
                if layout.shared:
                    rank_zero_info(
                        "ddpopt: local SGD islands gather the outer step's shards through the host's shared memory"
                    )
                elif self.islands.place == 0:  # each island decides alone: its first rank says why
                    island = next(list(m) for m in self.islands.members if self.islands.rank in m)
                    warnings.warn(
                        f"ddpopt: local SGD island {island} gathers the outer "
                        f"step's shards through gloo ({layout.unshared_reason}), slower than the host's shared memory",
                        stacklevel=2,
                    )
            return
        group = model.process_group
        if self.one_island and self.islands is not None and self.islands.size > 1:
            # The job's ranks are the island: its shards gathered over DDP's group, each rank alone in the replicas'
            # group (the exchange across the islands goes through the fault-tolerant quorum instead).
            self._group, _ = dist.new_subgroups(group_size=1)
            self.loop = LocalSGD(self.config, model.module, self._group, island=group, place=self.islands.place)
            return
        if self.config.overlap_steps:
            # The change is in flight while training goes on: on a group of its own, so that what training issues
            # meanwhile (the SIGTERM meeting, validation's collectives) does not queue behind it.
            group = self._group = own_group()
        self.loop = LocalSGD(self.config, model.module, group)

    def before_batch(self, model: DistributedDataParallel) -> None:
        """Turn DDP's gradient sync (and buffer broadcast) off for a local batch; islands keep the sync.

        DDP reads these in forward: no reducer preparation (so no bucket reaches a hook) and no buffer broadcast;
        Lightning's ``no_sync`` for accumulation restores what is set here. In islands of several ranks the
        gradients still sync, inside the island (:func:`~lightning_ddpopt.hooks.island.island_hook`); the buffers
        are not broadcast (from rank 0, over every rank) until the next parameter sync averages them.
        """
        assert self.loop is not None
        sync = self.loop.before_batch()
        inside = self.groups is not None or (self.one_island and self.islands is not None and self.islands.size > 1)
        set_ddp_sync(model, gradients=sync or inside, buffers=None if sync else False)

    def after_optimizer_step(self, skipped: bool, ledger: CommLedger | None, say: Callable[[str], None]) -> None:
        """Count the optimizer step (``skipped``: the GradScaler skipped it) and record its sync in the ledger.

        With ``sync_every="auto"``, until the ranks have chosen H: measure the window and its sync, and choose after
        it (``say`` tells the choice on rank 0).
        """
        loop = self.loop
        assert loop is not None
        start = ledger.timeline.mark() if ledger is not None else None
        # A local step of a window whose sync chooses H (the same on every rank).
        measured = loop.choosing and loop.local and loop.anchor is not None
        if measured and self._window_opened is None and ledger is not None:
            self._window_opened = ledger.closed_steps  # this step closes as the next one
        sync = loop.after_optimizer_step(skipped)
        end = None
        if sync is not None and ledger is not None and start is not None:
            end = ledger.add_parameter_sync(
                sync.num_elements,
                sync.logical_bytes,
                sync.wire_bytes,
                start,
                transfer_hidden=sync.overlapped,
                drift=sync.drift,
            )
        if measured:
            self._measure(sync, start, end, ledger, say)

    def _measure(
        self,
        sync: ParameterSync | None,
        start: Mark | None,
        end: Mark | None,
        ledger: CommLedger | None,
        say: Callable[[str], None],
    ) -> None:
        """``sync_every="auto"``: note an overlapped sync's start; after a sync (or its application) choose H.

        ``start`` and ``end``: the step's marks before and after its sync. Waiting for them is a host sync on a GPU,
        once per run. A sync whose start this rank did not see (a resume meanwhile) is not measured.
        """
        loop = self.loop
        assert loop is not None
        if sync is None:
            if loop.sync_started and ledger is not None:
                self._started = (start, self._step_seconds(ledger))
            return
        sync_s = compute_s = 0.0
        if ledger is not None and end is not None:
            if not sync.overlapped:
                sync_s = ledger.timeline.wait(end) - ledger.timeline.wait(start)
                compute_s = self._step_seconds(ledger)
            elif self._started is not None:
                began, compute_s = self._started
                sync_s = ledger.timeline.wait(end) - ledger.timeline.wait(began)
        self._window_opened = self._started = None  # measured afresh if the ranks cannot choose yet
        choice = loop.agree_sync_every(sync_s, compute_s)
        if choice is not None:
            say(choice.describe(loop.config.overlap_steps))

    def _step_seconds(self, ledger: CommLedger) -> float:
        """The median seconds of this rank's steps closed since the measured window began (0: none resolved yet)."""
        opened = self._window_opened
        times = [
            record.step_time_s
            for record in ledger.steps
            if opened is not None and record.step > opened and record.step_time_s is not None
        ]
        return statistics.median(times) if times else 0.0

    def fit_to_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve the outer step's ``"auto"`` settings for the inner optimizers (said on rank 0 when they change)."""
        loop = self.loop
        if loop is None or not loop.fit_outer_to(optimizers):
            return
        names = ", ".join(type(optimizer).__name__ for optimizer in optimizers) or "no optimizer"
        self._say_outer("as the checkpoint saved them" if loop.outer_from_checkpoint else f"for {names}")

    def _say_outer(self, source: str) -> None:
        assert self.loop is not None
        config = self.loop.config
        values = (config.outer_lr, config.outer_momentum, config.nesterov)
        if values == self._said_outer:
            return
        self._said_outer = values
        asked = (("outer_lr", self.config.outer_lr), ("outer_momentum", self.config.outer_momentum))
        auto = " and ".join(f"{name}='auto'" for name, value in asked if value == "auto")
        nesterov = ", Nesterov" if config.nesterov else ""
        rank_zero_info(
            f"ddpopt: local SGD's outer step {source}: learning rate {config.outer_lr:g}, momentum "
            f"{config.outer_momentum:g}{nesterov} ({auto})"
        )

    def finish(self, say: Callable[[str], None]) -> None:
        """Ranks that trained alone since the last sync end with their average: one model on every rank.

        An island's ranks then hold the whole outer state each (for a checkpoint saved after fit).
        """
        if self.loop is None:
            return
        if self.loop.finish() is not None:
            say(
                "ddpopt: local SGD averaged the ranks' parameters at the end of training (they had trained apart "
                "since the last sync)"
            )
        self.loop.unshard()

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Load the saved outer loop (warns on rank 0 about what could not be)."""
        assert self.loop is not None
        if saved is None:
            rank_zero_warn("ddpopt: the checkpoint holds no local SGD state; the outer loop starts from the weights")
            return
        problem = self.loop.load_state_dict(saved)
        if problem is not None:
            rank_zero_warn(f"ddpopt: {problem}")
        elif self.loop.outer_from_checkpoint:
            self._say_outer("as the checkpoint saved them")

    def rank_state(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """This rank's inner optimizer states, on the CPU: local, as in DiLoCo (each replica's saved).

        In an island they are its first rank's (the same gradients, the same steps): the others name that rank.
        """
        islands = self.islands
        if islands is not None and islands.leader != islands.rank:
            return {"optimizer_states": None, "same_as": islands.leader}
        return {"optimizer_states": [_to_cpu(optimizer.state_dict()) for optimizer in optimizers]}

    def teardown(self) -> None:
        """Lightning's SIGTERM handling again; a sync still in flight after a failure is dropped; the group goes."""
        sigterm, self._sigterm = self._sigterm, None
        if sigterm is not None:
            sigterm.remove()  # Lightning's own again, should the trainer fit once more
        if self.loop is not None:
            if not self.loop.close():
                rank_zero_warn("ddpopt: local SGD's overlapped sync is still busy after a minute; its groups are kept")
                return
            if self._group is not None or self.groups is not None:
                self.loop.process_group = self.loop.island = None  # the groups' last references are ours
        destroy_owned_group(self, "_group")
        if self.groups is not None:
            self.groups.close()


class _FinalAverage(pl.Callback):
    """Local SGD's end-of-training average, run before the other callbacks' ``on_train_end``."""

    def __init__(self, driver: LocalSGDDriver) -> None:
        self.driver = driver

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.driver.finish(lambda message: say_during_training(pl_module, trainer.is_global_zero, message))


def _to_cpu(state: Any) -> Any:
    return apply_to_collection(state, torch.Tensor, lambda tensor: tensor.detach().cpu())
