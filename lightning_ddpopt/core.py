"""What the Trainer's and Fabric's strategies share: the components of an optimized DDP run and the order between them.

Lightning has two front ends, and each has a ``DDPStrategy`` of its own: :class:`lightning_ddpopt.OptimizedDDPStrategy`
subclasses the Trainer's, :class:`lightning_ddpopt.fabric.OptimizedDDPStrategy` Fabric's. Both hand their events to one
:class:`StrategyCore`, which owns the components (the hook installer, the bucket controller, the ledger, the checkpoint
gathers, local SGD's driver, fault tolerance's steps, the core binding) and calls them in the order their rules need, so
the two front ends cannot drift apart. :class:`CoreStrategy`, mixed into both beside Lightning's or Fabric's
``DDPStrategy``, holds the steps both take alike: each strategy says *when* a step runs, :class:`CoreStrategy` *what* it
does. What it reads of the ``DDPStrategy`` it is mixed with is :class:`_DDPStrategyLike`, whose private parts are
checked at construction by :func:`lightning_ddpopt._compat.check_ddp_strategy_internals`.
:class:`~lightning_ddpopt.measuring.CoreViews` gives both strategies the same public properties over the core.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt._compat import PathType, check_versions
from lightning_ddpopt._groups import destroy_owned_group, group_like
from lightning_ddpopt._validate import require_number
from lightning_ddpopt.affinity import CoreBinding, bind_cores, validate_cpu_affinity
from lightning_ddpopt.buckets import BucketController, validate_bucket_cap_mb
from lightning_ddpopt.checkpoint import SavedRun, write_rank_states
from lightning_ddpopt.checkpoint_meeting import RankStates
from lightning_ddpopt.checkpoint_shards import shards_supported
from lightning_ddpopt.fault_tolerance.config import FaultTolerance, check_fault_tolerance
from lightning_ddpopt.fault_tolerance.driver import FaultTolerantSteps
from lightning_ddpopt.hooks.base import CommHookState
from lightning_ddpopt.hooks.install import HookInstaller
from lightning_ddpopt.hooks.registry import DEFAULT_COMM_HOOK, validate_local_sgd
from lightning_ddpopt.ledger import CommLedger, StepRecord
from lightning_ddpopt.localsgd import LocalSGDConfig, LocalSGDDriver
from lightning_ddpopt.measuring import CoreViews
from lightning_ddpopt.precision import OptimizerSteps
from lightning_ddpopt.timing import timeline_for
from lightning_ddpopt.topology import Topology, discover

__all__ = ["CoreStrategy", "StrategyCore"]


class StrategyCore:
    """The components of one strategy, from its arguments to its teardown, whichever front end drives them.

    Built first in either strategy's construction: it warns outside the tested versions before anything else.

    Args: those of :class:`~lightning_ddpopt.OptimizedDDPStrategy` of the same names (Lightning's ``ddp_comm_*``
    and ``model_averaging_period`` only through the Trainer's).

    Raises:
        ValueError, TypeError: at construction, for arguments that cannot work together, naming them.
    """

    def __init__(
        self,
        *,
        comm_hook: object,
        comm_state: object | None,
        bucket_cap_mb: object,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
        static_graph: bool,
        cpu_affinity: bool | list[list[int]],
        checkpoint_timeout: float | None,
        local_sgd: LocalSGDConfig | None,
        hierarchical: bool | Literal["auto"] = "auto",
        fault_tolerance: FaultTolerance | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
    ) -> None:
        check_versions()
        check_fault_tolerance(fault_tolerance, local_sgd)
        validate_local_sgd(
            local_sgd,
            comm_hook=comm_hook,
            default_hook=DEFAULT_COMM_HOOK,
            ddp_comm_hook=ddp_comm_hook,
            model_averaging_period=model_averaging_period,
        )
        self.hooks = HookInstaller(
            comm_hook, comm_state, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper, hierarchical=hierarchical
        )
        # DistributedDataParallel gets only what differs from its own defaults (all False).
        flags = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
        }
        self.ddp_flags = {name: True for name, value in flags.items() if value}
        self.buckets = BucketController(validate_bucket_cap_mb(bucket_cap_mb))
        self.cpu_affinity = validate_cpu_affinity(cpu_affinity)
        self.checkpoints = RankStates(
            None if checkpoint_timeout is None else require_number("checkpoint_timeout", checkpoint_timeout)
        )
        self.local_sgd = LocalSGDDriver(local_sgd) if local_sgd is not None else None
        self.fault_tolerance = (
            FaultTolerantSteps(fault_tolerance, self.local_sgd) if fault_tolerance is not None else None
        )
        #: Per-step fault tolerance's average across the islands, run by the hook.
        self.across_islands = self.fault_tolerance.across if self.fault_tolerance is not None else None
        self.model_averaging = model_averaging_period is not None  # Lightning's post-local SGD
        self.optimizer_steps = OptimizerSteps()
        self.ledger: CommLedger | None = None
        self.core_binding: CoreBinding | None = None
        self.topology: Topology | None = None
        self.world_size = 1
        self.rank = 0
        # A loaded checkpoint's entry, and which of its parts still wait for the component that restores them.
        self._saved: SavedRun | None = None
        self._hook_state_pending = False
        self._local_sgd_pending = False

    def start(
        self,
        device: torch.device,
        *,
        local_rank: int,
        local_world_size: int,
        node_rank: int,
        world_size: int,
        rank: int,
    ) -> None:
        """Once the process group exists: bind this rank's cores, learn the nodes and open its ledger.

        The ledger times with CUDA events on a GPU (host clocks would time kernel queueing), host clocks on CPU.
        """
        self.world_size, self.rank = world_size, rank
        self.core_binding = bind_cores(
            self.cpu_affinity,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            world_size=world_size,
            device=device,
        )
        self.topology = None
        # Local SGD's replicas follow the nodes ("auto", "node") or are checked against them (k ranks each).
        by_node = self.local_sgd is not None and self.local_sgd.config.replica not in ("rank", 1)
        if world_size > 1 and (self.hooks.hierarchical is not False or by_node):
            # A collective, checked against the host names: on every rank, before anything uses the nodes. Every rank
            # gathers the same claims, so every rank decides alike.
            try:
                self.topology = discover(node_rank, local_rank)
            except ValueError as error:
                node_replicas = self.local_sgd is not None and self.local_sgd.config.replica == "node"
                if self.hooks.hierarchical is True or node_replicas:
                    raise
                rank_zero_warn(f"ddpopt: {error}. The sync stays flat (hierarchical='auto').")
        self.ledger = CommLedger(timeline=timeline_for(device))

    def bucket_cap(self, module: torch.nn.Module, device: torch.device) -> float:
        """DDP's ``bucket_cap_mb`` for ``module``: as planned, or a checkpoint's measured cap that still applies."""
        latency = self.reused_decision("bucket_latency_s") if self.buckets.measures(self.world_size) else None
        return self.buckets.cap_for(module, self.world_size, device, latency)

    def install(
        self,
        model: DistributedDataParallel,
        *,
        backend: str,
        timeout: timedelta | None,
        device: torch.device,
        loss_scale: Callable[[], torch.Tensor | None],
        measured: bool = True,
    ) -> None:
        """Register the hook on the freshly wrapped ``model``, start local SGD over it, restore what waited for them.

        Groups of our own (a hook's beside the backward pass, the tiers', the islands') are made on the strategy's
        ``backend`` with its ``timeout``; every rank makes them in one order. ``measured``: something of the front
        end's reads the ledger's syncs (the Fabric strategy cannot know before a ``Monitor`` attaches: it passes
        ``True``); local SGD reads them too.
        """
        assert self.ledger is not None, "start() first"

        def own_group() -> dist.ProcessGroup:  # over the model's ranks, for traffic that must not interleave with it
            return group_like(model.process_group, backend, timeout)

        def new_group(ranks: list[int]) -> dist.ProcessGroup:
            return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)

        # The replicas' groups first: the hook syncs inside an island (every rank makes groups in one order).
        island = None
        if self.local_sgd is not None:
            island = self.local_sgd.plan(self.topology, self.world_size, self.rank, new_group)
        self.hooks.install(
            model,
            backend=backend,
            ledger=self.ledger,
            device=device,
            world_size=self.world_size,
            loss_scale=loss_scale,
            own_group=own_group,
            reused_choice=self.reused_decision("hook_choice") if self.hooks.choosing else None,
            topology=self.topology,
            new_group=new_group,
            island=island,
            across=self.across_islands,
            observed=measured or self.local_sgd is not None,
        )
        if self.hooks.registered is not None:
            self._restore_hook_state()
        if self.local_sgd is not None:
            self.local_sgd.start(model, own_group)
            self._restore_local_sgd()
        state = self.hooks.comm_state
        stateful = isinstance(state, CommHookState) and type(state).state_dict is not CommHookState.state_dict
        self.checkpoints.start(timeout, needed=stateful or self.local_sgd is not None)
        self.buckets.log_plan(backend, self.hooks.comm_hook_name)

    def load(self, entry: dict[str, Any] | None, model_wrapped: bool, path: PathType | None = None) -> SavedRun | None:
        """Take a checkpoint's entry; restore its parts now if the model is wrapped, else once it is.

        ``path``: the checkpoint file, whose shards (this rank's part of them) are read from beside it.
        """
        self._saved = SavedRun.from_checkpoint(entry, path) if entry else None
        self._hook_state_pending = self._local_sgd_pending = self._saved is not None
        if model_wrapped:
            self._restore_hook_state()
            self._restore_local_sgd()
        return self._saved

    def warn_decisions_not_reused(self) -> None:
        """Warn (rank 0) about a checkpoint's measured decisions that came too late: the model was wrapped already.

        ``"auto"`` chose its hook when the model was wrapped; a checkpoint loaded after that cannot change it.
        """
        saved = self._saved
        if saved is None or saved.decision_note(self.world_size) is not None:
            return
        late = []
        choice, saved_choice = self.hooks.hook_choice, saved.hook_choice
        if self.hooks.auto and choice is not None and saved_choice is not None and choice.name != saved_choice.name:
            late.append(f"comm_hook='auto' chose {choice.name!r} and the checkpoint holds {saved_choice.name!r}")
        measured = self.buckets.latency_s
        if saved.bucket_latency_s is not None and measured is not None and measured != saved.bucket_latency_s:
            saved_us = saved.bucket_latency_s * 1e6
            late.append(
                f"bucket_cap_mb='auto' measured {measured * 1e6:g} us instead of reusing {saved_us:g} us (the buckets "
                "may differ)"
            )
        if late:
            rank_zero_warn(
                f"ddpopt: the checkpoint was loaded after the model was set up: {'; '.join(late)}. Load it before "
                "setting up the model to reuse what was measured."
            )

    def saved_optimizer_states(self) -> list[dict[str, Any]] | None:
        """With local SGD, this rank's inner optimizer states from the loaded checkpoint (``None``: use rank 0's).

        Each replica's inner optimizer state is its own, saved beside rank 0's; another world size cannot map them.
        An island's ranks all take its first rank's (saved on any layout): their gradients are the same.
        """
        saved = self._saved
        if self.local_sgd is None or saved is None or saved.world_size != self.world_size:
            return None
        islands = self.local_sgd.islands
        return saved.inner_states(islands.leader if islands is not None else self.rank)

    def fit_to_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve what depends on the inner optimizers: PowerSGD's ``max_error="auto"``, local SGD's outer ``"auto"``.

        Each is said on rank 0. Once the model is wrapped, and again whenever the optimizers change.
        """
        self.hooks.fit_to_optimizers(optimizers)
        if self.local_sgd is not None:
            self.local_sgd.fit_to_optimizers(optimizers)

    def before_micro_batch(self, model: torch.nn.Module | None, samples: int | None, first_of_epoch: bool) -> None:
        """Count a training micro-batch in the ledger; local SGD turns DDP's gradient sync off for a local one."""
        if self.ledger is not None:
            self.ledger.add_micro_batch(samples, first_of_epoch=first_of_epoch)
        if self.local_sgd is not None and isinstance(model, DistributedDataParallel):
            self.local_sgd.before_batch(model)

    def optimizer_step(
        self,
        optimizer: object,
        step: Callable[[], Any],
        model: torch.nn.Module | None,
        say: Callable[[str], None],
    ) -> tuple[Any, list[StepRecord]]:
        """Take the optimizer step (``step``), then close it: local SGD counts it, the ledger closes it.

        Returns ``step``'s output and the ledger's records that resolved now (on a GPU usually an earlier step's).
        A step the GradScaler skipped is told by the optimizer's step count
        (:class:`~lightning_ddpopt.precision.OptimizerSteps`), without reading the device.
        """
        before = self.optimizer_steps.count(optimizer) if self.local_sgd is not None else None
        output = step()
        ddp = model if isinstance(model, DistributedDataParallel) else None
        if self.local_sgd is not None and self.local_sgd.loop is not None:
            skipped = self.optimizer_steps.skipped(optimizer, before)
            self.local_sgd.after_optimizer_step(skipped, self.ledger if ddp else None, say)
        if ddp is None or self.ledger is None:
            return output, []
        records = self.ledger.close_step()
        self.buckets.after_step(self.ledger, say, self.local_phase)
        return output, records

    @property
    def local_phase(self) -> bool:
        """Whether local SGD trains apart now (its gradients are not synchronised)."""
        loop = self.local_sgd.loop if self.local_sgd is not None else None
        return loop is not None and loop.local

    def gradients_identical(self, model: torch.nn.Module | None) -> bool:
        """See :attr:`CoreStrategy.synced_gradients_identical`."""
        ignored = getattr(model, "parameters_to_ignore", None)
        # Evidence that this step's gradients went through the hook: the ledger saw a sync round since the last step.
        synced = self.ledger is not None and self.ledger.recording and self.ledger.open_sync_rounds > 0
        return (
            isinstance(model, DistributedDataParallel)
            and self.hooks.results_identical
            and not self.model_averaging
            and not ignored
            and synced
        )

    def checkpoint_entry(
        self,
        optimizers: list[torch.optim.Optimizer] | None,
        path: PathType,
        grad_scaler: dict[str, Any] | None = None,
        optimizer_steps: int | None = None,
    ) -> dict[str, Any] | None:
        """The ``checkpoint["ddpopt"]`` entry on rank 0 (``None`` elsewhere); every rank must call it.

        What differs per rank goes to the shards beside ``path`` (:mod:`lightning_ddpopt.checkpoint_shards`), each
        rank writing its own, where ``path`` can have them; else it is gathered to rank 0 into the entry.
        ``optimizers``: the inner optimizers whose per-rank states local SGD saves (``None`` for a checkpoint
        without optimizer states). ``grad_scaler`` and ``optimizer_steps``: what front ends that keep neither in
        their own checkpoints (Fabric) save here.
        """
        rank, world_size = self.rank, self.world_size
        hook_state = self.hooks.state_dict()
        local_sgd = self.local_sgd
        loop = local_sgd.loop if local_sgd is not None else None
        inner = optimizers if loop is not None else None  # the inner optimizers whose per-rank states are saved
        sharded = loop is not None and loop.sharded  # an island's outer state is sharded over its ranks
        run = SavedRun(
            world_size=world_size,
            comm_hook=self.hooks.comm_hook_name,
            hook_choice=self.hooks.hook_choice if self.hooks.auto else None,
            bucket_latency_s=self.buckets.latency_s,
            grad_scaler=grad_scaler,
            optimizer_steps=optimizer_steps,
        )
        # The same hook and layout on every rank, so every rank writes (or gathers) or none does.
        if world_size > 1 and (hook_state or inner is not None or sharded) and shards_supported(path):
            return write_rank_states(run, path, self.checkpoints, hook_state, local_sgd, inner, rank=rank)
        states = self.checkpoints.gather(hook_state, rank=rank, world_size=world_size) if hook_state else []
        local_states: list[dict[str, Any]] = []
        if local_sgd is not None and inner is not None:
            local_states = self.checkpoints.gather(local_sgd.rank_state(inner), rank=rank, world_size=world_size)
        # Gathering a sharded outer state is a collective, entered only once every rank has arrived.
        if sharded and not hook_state and inner is None:
            self.checkpoints.agree(rank=rank, world_size=world_size)
        outer = loop.state_dict() if loop is not None and (rank == 0 or sharded) else None
        if rank != 0:
            return None
        return dataclasses.replace(
            run, hook_states=states, local_sgd=outer, local_sgd_ranks=local_states
        ).to_checkpoint()

    def stop(self) -> None:
        """Local SGD's and fault tolerance's teardown: the SIGTERM check goes, the island leaves the quorum.

        A local SGD sync still in flight after a failure is dropped.
        """
        if self.local_sgd is not None:
            self.local_sgd.teardown()
        if self.fault_tolerance is not None:
            self.fault_tolerance.teardown()

    def close(self) -> None:
        """Stop the hook's threads, destroy our groups, release the cores (after :meth:`stop`).

        Nothing of ours may keep a process group alive past the exit-time ``destroy_process_group``.
        """
        self.hooks.close()
        if self.across_islands is not None:
            self.across_islands.close()
            destroy_owned_group(self.across_islands, "group")
        self.checkpoints.close()
        self.optimizer_steps.close()
        if self.core_binding is not None:
            self.core_binding.release()
            self.core_binding = None

    def reused_decision(self, name: Literal["hook_choice", "bucket_latency_s"]) -> Any:
        """A checkpoint's measured decision that this run may reuse, or ``None``."""
        return self._saved.reused(name, self.world_size) if self._saved is not None else None

    def _restore_hook_state(self) -> None:
        """Load this rank's saved hook state once both the checkpoint and the registered hook exist."""
        if self._saved is None or not self._hook_state_pending:
            return
        self._hook_state_pending = False
        self.hooks.restore(self._saved, self.world_size, self.rank)

    def _restore_local_sgd(self) -> None:
        """Load the saved outer loop once both the checkpoint and this run's local SGD loop exist.

        A Trainer's checkpoint is loaded before setup: a loop left by an earlier fit (its model unwrapped at
        teardown) waits for the one this fit builds.
        """
        if self._saved is None or self.local_sgd is None or self.local_sgd.loop is None or not self._local_sgd_pending:
            return
        self._local_sgd_pending = False
        self.local_sgd.restore(self._saved.local_sgd)


class _DDPStrategyLike(Protocol):
    """What :class:`CoreStrategy` reads of the strategy it is mixed into (Lightning's or Fabric's ``DDPStrategy``)."""

    _core: StrategyCore

    @property
    def _timeout(self) -> timedelta | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def bucket_layout(self) -> tuple[int, ...] | None: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    @property
    def ledger(self) -> Any: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def _get_process_group_backend(self) -> str: ...

    def _loss_scale(self) -> torch.Tensor | None: ...


class CoreStrategy(CoreViews):
    """The steps both strategies take with their :class:`~lightning_ddpopt.core.StrategyCore`, and its views."""

    @property
    def synced_gradients_identical(self: _DDPStrategyLike) -> bool:
        """Whether a batch whose gradients DDP syncs leaves the same gradients on every rank.

        It does with DDP's allreduce or a registry hook over every parameter (each rank receives the same result), once
        the ledger has seen this step's sync; not with a user's hook or none, parameters DDP ignores, or Lightning's
        post-local SGD (``model_averaging_period``).
        See :func:`lightning_ddpopt.meetings.gradients_identical`.
        """
        return self._core.gradients_identical(self.model)

    def _start_core(self: _DDPStrategyLike) -> None:
        """Once the process group exists: the core learns this rank's place (cores, nodes, ledger)."""
        self._core.start(
            self.root_device,
            local_rank=self.local_rank,
            local_world_size=self.num_processes,
            node_rank=self.node_rank,
            world_size=self.world_size,
            rank=self.global_rank,
        )

    def _name_run(self: _DDPStrategyLike) -> None:
        """Name this run's checkpoint saves (every rank): a save's shards are told apart from an earlier run's."""
        if self.world_size > 1:
            self._core.checkpoints.name_run(self.broadcast(secrets.token_hex(8)))

    def _install_hook(self: _DDPStrategyLike, model: DistributedDataParallel, measured: bool = True) -> None:
        """Register the hook on the freshly wrapped ``model`` (see :meth:`StrategyCore.install`)."""
        self._core.install(
            model,
            backend=self._get_process_group_backend(),
            timeout=self._timeout,
            device=self.root_device,
            loss_scale=self._loss_scale,
            measured=measured,
        )

    def _log_final_layout(self: _DDPStrategyLike, say: Callable[[str], None]) -> None:
        """At the end of training: DDP's bucket layout, if no step logged it yet."""
        if self.bucket_layout is None and isinstance(self.model, DistributedDataParallel):
            self._core.buckets.log_layout(self.ledger, say, self._core.local_phase, final=True)

    def _join_islands(
        self: _DDPStrategyLike,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
    ) -> None:
        """Join the fault-tolerant quorum as one island: this job's ranks, its store, its training state."""
        environment, ft = self.cluster_environment, self._core.fault_tolerance
        assert environment is not None and ft is not None
        ft.setup(
            self.global_rank,
            self.world_size,
            (environment.main_address, environment.main_port),
            self.root_device,
            state_dict=state_dict,
            load_state_dict=load_state_dict,
            broadcast=self.broadcast,
        )
