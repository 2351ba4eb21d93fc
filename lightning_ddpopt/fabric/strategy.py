"""OptimizedDDPStrategy for Lightning Fabric: the Trainer strategy's hooks, buckets, local SGD, ledger and checkpoints.

Fabric's ``DDPStrategy`` takes no comm hook at all. This subclass hands Fabric's events to the same
:class:`~lightning_ddpopt.core.StrategyCore` the Trainer's strategy uses, so both front ends register the same hooks
and keep the same state. Where Fabric has no event of its own, the strategy makes one:

* a training micro-batch starts at the wrapped model's forward with gradients enabled (a forward pre-hook on DDP):
  the ledger counts it there and local SGD turns DDP's gradient sync off for a local batch; a forward without
  gradients or in eval mode (validation) marks a break, so the next step's time starts at its own batch;
* ``fabric.no_backward_sync(model)`` goes through the strategy's own sync control, which also refuses
  ``static_graph=True`` there (pytorch#143580);
* ``optimizer.step()`` reaches :meth:`OptimizedDDPStrategy.optimizer_step`: the step is closed in the ledger, local
  SGD syncs when due, and the observers of :attr:`OptimizedDDPStrategy.before_optimizer_step` (a
  :class:`~lightning_ddpopt.fabric.Monitor`'s callbacks) see the gradients unscaled, as the Trainer's callbacks do;
* :meth:`OptimizedDDPStrategy.finish` ends training (local SGD's final average), as the Trainer's end of fit does;
* with ``fault_tolerance``, the first training forward joins the quorum and each step's starts the step's quorum;
  ``optimizer.step()`` averages the gradients across the islands and votes before anything unscales them;
* ``fabric.save`` adds this package's state and ``fabric.load`` restores it: what every rank shares (local SGD's outer
  loop, the measured decisions, the GradScaler's state, which Fabric does not save, and the optimizer-step count)
  goes into the file under ``"ddpopt"``, what differs per rank into shards beside it
  (:mod:`lightning_ddpopt.checkpoint_shards`).
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddpopt._compat import (
    FABRIC_DDP_STRATEGY_ATTRIBUTES,
    FABRIC_DDP_STRATEGY_INTERNALS,
    BackwardSyncControl,
    PathType,
    StrategyRegistryType,
    check_ddp_strategy_internals,
    set_ddp_sync,
    unscale_once,
)
from lightning_ddpopt._groups import destroy_process_group_at_exit
from lightning_ddpopt._registration import register_strategy_names
from lightning_ddpopt.accumulation import ExtraSyncs
from lightning_ddpopt.checkpoint import CHECKPOINT_KEY
from lightning_ddpopt.core import CoreStrategy, StrategyCore
from lightning_ddpopt.fault_tolerance.config import FaultTolerance
from lightning_ddpopt.fault_tolerance.driver import CHECKPOINT_KEY as FT_CHECKPOINT_KEY
from lightning_ddpopt.fault_tolerance.state import fabric_state, load_fabric_state
from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig
from lightning_ddpopt.hooks.registry import DEFAULT_COMM_HOOK
from lightning_ddpopt.localsgd import LocalSGDConfig
from lightning_ddpopt.precision import current_loss_scale

__all__ = ["OptimizedDDPStrategy"]


class OptimizedDDPStrategy(CoreStrategy, FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` with the comm hooks, bucket planning, local SGD, ledger and checkpoints of this package.

    The keyword arguments are those of the Trainer's :class:`lightning_ddpopt.OptimizedDDPStrategy`, with the same
    meaning (Lightning's ``ddp_comm_*`` and ``model_averaging_period`` belong to the Trainer's only); its names are
    registered in Fabric's strategy registry too (``Fabric(strategy="ddp_optimized_fp16")``). One model per
    strategy: set up a second one and it raises.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=OptimizedDDPStrategy(comm_hook="powersgd"))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)

    Checkpoints: ``fabric.save`` adds local SGD's outer loop, the measured decisions and the GradScaler's state
    (which Fabric does not save) under ``"ddpopt"``, and each rank writes its own hook state and inner optimizer
    states beside the file (:mod:`lightning_ddpopt.checkpoint_shards`); ``fabric.load`` restores them (before or
    after ``fabric.setup``) and does not return that key. With local SGD, each rank's optimizer in the loaded
    ``state`` gets its own saved state, matched by order: keep the optimizers in the same order in the saved and the
    loaded ``state``. Every rank must call both, as Fabric requires.

    Fault tolerance (``fault_tolerance=FaultTolerance(...)``, see :mod:`lightning_ddpopt.fault_tolerance`): the
    Fabric job is one island. ``optimizer.step()`` averages the step's gradients over the islands of the quorum and
    takes the step only where all of them succeeded; a dropped step returns ``None`` with the gradients zeroed
    (:attr:`fault_tolerance_stats` counts them). A restarted island heals from a live one: the model, the optimizers
    set up through ``fabric.setup``, the GradScaler, :attr:`optimizer_steps`, local SGD's state, and whatever the
    loop puts in :attr:`heal_state` (``strategy.heal_state["scheduler"] = scheduler``: objects with
    ``load_state_dict`` load the peer's in place, other values are replaced in the dict, as ``fabric.load`` does).
    One optimizer step per batch.

    With local SGD, call :meth:`finish` on every rank when training ends (a :class:`~lightning_ddpopt.fabric.Monitor`'s
    ``finish()`` does): the ranks trained apart since the last sync and end with their average.

    Args:
        accelerator: see Fabric's ``DDPStrategy``.
        parallel_devices: see Fabric's ``DDPStrategy``.
        cluster_environment: see Fabric's ``DDPStrategy``.
        checkpoint_io: see Fabric's ``DDPStrategy``.
        precision: see Fabric's ``DDPStrategy``.
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: NCCL on CUDA, gloo otherwise.
        timeout: process-group timeout.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        comm_hook: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        comm_state: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        bucket_cap_mb: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        gradient_as_bucket_view: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        find_unused_parameters: see ``DistributedDataParallel``.
        static_graph: see ``DistributedDataParallel``; refused with ``fabric.no_backward_sync`` (pytorch#143580).
        cpu_affinity: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        checkpoint_timeout: seconds a checkpoint save waits for every rank before it raises (stateful hooks and
            local SGD only); ``None``: the process group's ``timeout``.
        local_sgd: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        hierarchical: see :class:`lightning_ddpopt.OptimizedDDPStrategy`.
        fault_tolerance: see :class:`lightning_ddpopt.OptimizedDDPStrategy` and above.
        **kwargs: forwarded to ``DistributedDataParallel``.
    """

    strategy_name = "ddp_optimized"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        comm_hook: str | PowerSGDConfig | Int8Config | Callable | None = DEFAULT_COMM_HOOK,
        comm_state: object | None = None,
        bucket_cap_mb: float | Literal["auto", "autotune"] = "auto",
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        cpu_affinity: bool | list[list[int]] = False,
        checkpoint_timeout: float | None = None,
        local_sgd: LocalSGDConfig | None = None,
        hierarchical: bool | Literal["auto"] = "auto",
        fault_tolerance: FaultTolerance | None = None,
        **kwargs: Any,
    ) -> None:
        self._core = StrategyCore(
            comm_hook=comm_hook,
            comm_state=comm_state,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            cpu_affinity=cpu_affinity,
            checkpoint_timeout=checkpoint_timeout,
            local_sgd=local_sgd,
            hierarchical=hierarchical,
            fault_tolerance=fault_tolerance,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        check_ddp_strategy_internals(
            self, FabricDDPStrategy, FABRIC_DDP_STRATEGY_INTERNALS, FABRIC_DDP_STRATEGY_ATTRIBUTES
        )
        self._ddp_kwargs.update(self._core.ddp_flags)
        self._fault_tolerance = self._core.fault_tolerance
        #: With ``fault_tolerance``: more of the loop's state a healing island receives from a peer (see above).
        self.heal_state: dict[str, Any] = {}
        self._vote: bool | None = None  # this step's, per step, once voted (at a clip or the step)
        self._backward_sync_control = _SyncControl(self)
        #: Called with the optimizer before each optimizer step, its gradients unscaled (a Monitor's callbacks).
        self.before_optimizer_step: list[Callable[[Optimizer], None]] = []
        #: The optimizers set up through this strategy, in order.
        self.optimizers: list[Optimizer] = []
        #: Optimizer steps taken (the Trainer's ``global_step``), those before a resume included.
        self.optimizer_steps = 0
        #: Checkpoints loaded with a step count, and heals (a Monitor restarts its callbacks' step counting after one).
        self.resumes = 0
        self._warned_partial_load = False  # fabric.load(path, module) leaves our state behind: said once
        self._restored = False  # a checkpoint's state of ours was restored (a later whole read loses nothing)
        #: Forwards outside training (validation) so far: a Monitor's break between batches.
        self.breaks = 0
        self.model: DistributedDataParallel | None = None
        self._sync_blocked = 0
        self._between_steps = True  # a break (start, validation) since the last training forward
        self._extra_syncs = ExtraSyncs(
            "Fabric loop",
            "Run forward and fabric.backward of every micro-batch but the last inside "
            "`with fabric.no_backward_sync(model):`, so only the last micro-batch of each step syncs.",
        )
        self._closed = False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, except with ``fault_tolerance``: this rank's shard of every island's data.

        For each loader that ``fabric.setup_dataloaders`` gives a sampler.
        """
        ft = self._fault_tolerance
        if ft is None:
            return super().distributed_sampler_kwargs
        return ft.config.sampler_kwargs(self.world_size, self.global_rank)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()
        # Registered after the process group's exit handler, so it runs first: our groups and threads go before it.
        # A weak reference: the handler does not keep the strategy (and its model) alive until the process ends.
        atexit.register(_close_at_exit, weakref.ref(self))
        self._start_core()
        self._name_run()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self.model is not None:
            raise ValueError(
                f"OptimizedDDPStrategy sets up one model and already holds {type(self.model.module).__name__}; "
                f"{type(module).__name__} would be a second one. Wrap the models in one nn.Module and set that up."
            )
        self._ddp_kwargs["bucket_cap_mb"] = self._core.bucket_cap(module, self.root_device)
        model = super().setup_module(module)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.model = model
        self._install_hook(model)
        if self.optimizers:
            self._core.fit_to_optimizers(self.optimizers)
        return model

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        if self.model is not None:  # PowerSGD's max_error="auto" and local SGD's outer "auto" follow the optimizers
            self._core.fit_to_optimizers(self.optimizers)
        return super().setup_optimizer(optimizer)

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
        if self._fault_tolerance is not None and (quorum := self._fault_tolerance.checkpoint_state()) is not None:
            state = {**state, FT_CHECKPOINT_KEY: quorum}  # torchft's manager state (the run's commits)
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
        quorum = remainder.pop(FT_CHECKPOINT_KEY, None)
        if self._fault_tolerance is not None and quorum is not None:
            self._fault_tolerance.resume(quorum)  # the manager state goes back to the quorum
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

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        take, self._vote = self._voted(optimizer), None
        ft = self._fault_tolerance
        scaler = self.grad_scaler
        if take and self.before_optimizer_step:
            if scaler is not None and isinstance(optimizer, Optimizer):
                unscale_once(scaler, optimizer)  # as the Trainer does before on_before_optimizer_step
            for observe in self.before_optimizer_step:
                observe(optimizer)
        output, records = self._core.optimizer_step(
            optimizer,
            (lambda: super(OptimizedDDPStrategy, self).optimizer_step(optimizer, **kwargs)) if take else lambda: None,
            self.model,
            rank_zero_info,
        )
        if ft is not None:
            ft.after_step()
        self.optimizer_steps += 1
        for record in records:
            self._extra_syncs.check(record.sync_rounds, record.micro_batches)
        return output

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip as Fabric does; with per-step fault tolerance the islands vote first (a dropped step: zeros, 0)."""
        if not self._voted(optimizer):
            return torch.zeros((), device=self.root_device)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip as Fabric does; with per-step fault tolerance the islands vote first (a dropped step: zeros)."""
        if self._voted(optimizer):
            super().clip_gradients_value(module, optimizer, clip_val)

    def _voted(self, optimizer: Optimizer) -> bool:
        """Per-step fault tolerance: whether this step commits, voted once (at the clip or the step).

        The gradients are averaged across the islands before anything unscales them (a clip, the step), so every
        island's GradScaler sees the same average; a dropped step's gradients are zeroed.
        """
        ft = self._fault_tolerance
        if ft is None or not ft.per_step:
            return True
        if self._vote is None:
            if ft.replica is None or self.model is None:
                raise RuntimeError(
                    "fault_tolerance joins the quorum at the model's first training forward: call the model that "
                    "fabric.setup returned (in train mode, with gradients enabled) before optimizer.step()"
                )
            self._vote = ft.vote([p for p in self.model.module.parameters() if p.requires_grad])
            if not self._vote:
                optimizer.zero_grad()
        return self._vote

    def finish(self) -> None:
        """End training, on every rank: local SGD averages the ranks; DDP's bucket layout is logged if not yet.

        Ranks under local SGD trained apart since the last parameter sync; after this every rank holds the same
        model. Call it before a final ``fabric.save``.
        """
        if self._core.local_sgd is not None:
            self._core.local_sgd.finish(rank_zero_info)
        if self._fault_tolerance is not None:
            self._fault_tolerance.teardown()  # leaves the quorum: a later training forward joins again
        self._log_final_layout(rank_zero_info)

    @override
    def teardown(self) -> None:
        """Stop the hook's threads, destroy the groups of our own, release the cores (Fabric itself never calls it).

        The process's exit does this too; call it to release them earlier (a notebook that trains again).
        """
        self._close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``ddp_optimized[_spawn|_fork|_notebook]`` and hook presets such as ``ddp_optimized_fp16``."""
        register_strategy_names(cls, strategy_registry, "OptimizedDDPStrategy (Fabric)")

    def _before_forward(self, model: Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward starts a micro-batch; any other (validation) is a break between steps."""
        if not (torch.is_grad_enabled() and model.training):
            if not self._between_steps:
                self.breaks += 1
            self._between_steps = True
            return
        with warnings.catch_warnings():  # Lightning's advice for an ambiguous batch names the Trainer's self.log
            warnings.simplefilter("ignore")
            try:
                samples: int | None = extract_batch_size((args, kwargs))
            except (MisconfigurationException, RecursionError):
                samples = None
        self._core.before_micro_batch(model, samples, first_of_epoch=self._between_steps)
        self._between_steps = False
        ft = self._fault_tolerance
        if ft is not None:
            if ft.replica is None:  # joins at the first training forward: the model and optimizers are set up by then
                self._join_islands(lambda: fabric_state(self), lambda state: load_fabric_state(self, state))
            if ft.replica is not None and not ft.replica.step_open:
                self._vote = None  # a new step: a vote at a clip not followed by a step does not carry over
            ft.before_batch()
        if self._sync_blocked:  # fabric.no_backward_sync outranks local SGD's warm-up, which just allowed the sync
            assert isinstance(model, DistributedDataParallel)
            set_ddp_sync(model, gradients=False)

    @contextmanager
    def _blocking_sync(self, model: DistributedDataParallel) -> Iterator[None]:
        if self._core.ddp_flags.get("static_graph"):
            raise ValueError(
                "fabric.no_backward_sync cannot run with static_graph=True: DDP's static graph mode mis-syncs "
                "gradients under no_sync (pytorch#143580). Use static_graph=False."
            )
        self._sync_blocked += 1
        try:
            with model.no_sync():
                yield
        finally:
            self._sync_blocked -= 1

    def _loss_scale(self) -> torch.Tensor | None:
        return current_loss_scale(self.precision)

    def _close(self) -> None:
        """Our threads and groups go before the process group (Fabric calls no teardown; exit does this)."""
        if not self._closed:
            self._closed = True
            self._core.stop()
            self._core.close()


class _SyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync`` through the strategy, which knows when a micro-batch's sync is blocked."""

    def __init__(self, strategy: OptimizedDDPStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to no_backward_sync is wrapped in "
                f"DistributedDataParallel. Got: {type(module).__name__}."
            )
        return self._strategy._blocking_sync(module)


if OptimizedDDPStrategy.strategy_name not in STRATEGY_REGISTRY:
    OptimizedDDPStrategy.register_strategies(STRATEGY_REGISTRY)


def _close_at_exit(strategy: weakref.ref[OptimizedDDPStrategy]) -> None:
    alive = strategy()
    if alive is not None:
        alive._close()
