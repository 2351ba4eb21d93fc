"""OptimizedDDPStrategy: Lightning's DDPStrategy with planned buckets, comm hooks on every backend, and a ledger.

The strategy is wiring: each concern lives in the component that owns its rules, and the methods below are
Lightning's hooks, each handing over to the components, in the order Lightning calls them in a fit (a checkpoint
to resume from is loaded before ``setup``; its parts wait for the components that restore them).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddpopt._compat import (
    PathType,
    StrategyRegistryType,
    check_ddp_strategy_internals,
    say_during_training,
)
from lightning_ddpopt._groups import destroy_process_group_at_exit
from lightning_ddpopt._registration import register_strategy_names
from lightning_ddpopt.accumulation import AccumulationStep, ManualAccumulation
from lightning_ddpopt.checkpoint import CHECKPOINT_KEY
from lightning_ddpopt.checkpoint_shards import remove_shards
from lightning_ddpopt.core import CoreStrategy, StrategyCore
from lightning_ddpopt.fault_tolerance.config import FaultTolerance
from lightning_ddpopt.fault_tolerance.driver import CHECKPOINT_KEY as FT_CHECKPOINT_KEY
from lightning_ddpopt.fault_tolerance.state import load_training_state, training_state
from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig
from lightning_ddpopt.hooks.registry import DEFAULT_COMM_HOOK
from lightning_ddpopt.localsgd import LocalSGDConfig
from lightning_ddpopt.measuring import MeasuringCallback
from lightning_ddpopt.precision import current_loss_scale

__all__ = ["OptimizedDDPStrategy"]


class OptimizedDDPStrategy(CoreStrategy, DDPStrategy):
    """A drop-in :class:`~lightning.pytorch.strategies.DDPStrategy` that makes data-parallel training scale.

    Differences from the stock strategy:

    * ``comm_hook`` is registered on **every** backend (gloo on CPU, NCCL on GPU) and checked to be attached;
      Lightning's ``DDPStrategy`` registers hooks on CUDA only and silently drops them elsewhere.
    * ``bucket_cap_mb="auto"`` sizes DDP's gradient buckets from the model and the world size
      (see :func:`lightning_ddpopt.buckets.auto_bucket_cap_mb`); rank 0 logs the plan at setup and the layout DDP
      actually built once it is final.
    * Every hook of the registry reports to a per-rank :class:`~lightning_ddpopt.ledger.CommLedger` (bytes before
      and after compression, sync time, sync rounds per optimizer step), which the callbacks read.
    * ``cpu_affinity`` pins each local rank to its own cores, within those its launcher gave it.
    * ``static_graph=True`` with gradient accumulation is refused (pytorch#143580 makes it compute wrong results).

    Every ``DDPStrategy`` argument keeps its name, position and default; the arguments this class adds are
    keyword-only. ``DistributedDataParallel`` receives only what differs from its own defaults.

    Args:
        accelerator: see ``DDPStrategy``.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        ddp_comm_state: Lightning's name for a hook state; use with ``ddp_comm_hook``.
        ddp_comm_hook: Lightning's name for a callable hook; unlike in ``DDPStrategy`` it runs on every backend.
            Give either this or ``comm_hook``, not both.
        ddp_comm_wrapper: Lightning's hook wrapper, applied around ``ddp_comm_hook``.
        model_averaging_period: see ``DDPStrategy`` (post-local SGD; on CPU the ``PostLocalSGDState`` needs an
            explicit ``subgroup`` or ``post_local_gradient_allreduce=False``).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: NCCL on CUDA, gloo otherwise.
        timeout: process-group timeout.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        comm_hook: a registry name (see :data:`lightning_ddpopt.hooks.COMM_HOOKS`), a
            :class:`~lightning_ddpopt.hooks.PowerSGDConfig` or :class:`~lightning_ddpopt.hooks.Int8Config`, a
            torch-style hook ``hook(state, bucket) -> Future[Tensor]`` (its state in ``comm_state``), or ``None``
            for DDP's built-in allreduce with nothing recorded; ``"auto"`` measures the link and the model at
            setup and picks ``allreduce``, ``fp16`` or ``int8`` (PowerSGD too only if listed in an
            :class:`~lightning_ddpopt.hooks.AutoConfig`; see :mod:`lightning_ddpopt.hooks.auto`). The hook's state
            is saved in checkpoints (see :mod:`lightning_ddpopt.checkpoint`) and restored.
        comm_state: the state passed to a callable ``comm_hook``.
        bucket_cap_mb: DDP's bucket cap in MiB, a positive number or ``"auto"`` (``"autotune"`` is deprecated and
            means ``"auto"``).
        gradient_as_bucket_view: let gradients be views into DDP's buckets (saves a gradient-sized copy per step
            and its memory; ``param.grad`` must then not be detached or resized in place). DDP's default is False.
        find_unused_parameters: see ``DistributedDataParallel``.
        static_graph: see ``DistributedDataParallel``.
        cpu_affinity: ``True`` gives each local rank its own cores within those it was given: ranks given the same
            cores (``os.sched_getaffinity``) split them evenly, a rank a launcher bound keeps its own (see
            :func:`lightning_ddpopt.affinity.plan_given_cores`; whole physical cores, SMT siblings together, in
            NUMA-node order where Linux describes the CPUs), with torch's thread count to match; a list gives
            each local rank its cores explicitly; ``False`` (default) leaves affinity alone.
        checkpoint_timeout: seconds a checkpoint save waits for every rank before it raises (stateful hooks and
            local SGD only); ``None``: the process group's ``timeout``.
        local_sgd: a :class:`~lightning_ddpopt.localsgd.LocalSGDConfig` (e.g. ``LocalSGDConfig.diloco(16)``): after
            its warm-up, gradients are not synchronised at all and the ranks average their parameter changes every
            ``sync_every`` optimizer steps (see :mod:`lightning_ddpopt.localsgd`). ``comm_hook`` then applies
            during the warm-up only.
        hierarchical: on N nodes x M ranks, sync in two tiers (:mod:`lightning_ddpopt.hooks.hierarchical`,
            :mod:`lightning_ddpopt.hooks.hierarchical_int8`, :mod:`lightning_ddpopt.hooks.hierarchical_powersgd`):
            sum inside each node in the bucket's own precision, send 1/M of each bucket per rank (PowerSGD: of the
            parameters) between nodes in the hook's precision, gather inside the node. ``"auto"`` (default) does
            where the run spans several nodes with several ranks each, as many on every node, the hook is
            ``allreduce``, ``fp16``, ``bf16`` or ``int8`` and the backend is one the tests run (gloo; NCCL keeps its
            own sync unless ``True``); ``True`` requires a hook with a two-tier form (those, or PowerSGD unless
            batched), or ``"auto"`` (a one-node run warns and syncs flat); ``False`` never. The nodes come from the
            launcher (``NODE_RANK``/``LOCAL_RANK``, SLURM's), checked against the host names at setup
            (:mod:`lightning_ddpopt.topology`; with ``"auto"`` a mismatch warns and the sync stays flat, with ``True``
            it raises); the choice and why are logged on rank 0.
        fault_tolerance: a :class:`~lightning_ddpopt.fault_tolerance.FaultTolerance`: this job is one island of a
            fault-tolerant run on torchft (the ``[ft]`` extra; see :mod:`lightning_ddpopt.fault_tolerance`): each
            step's gradients are averaged over the islands of the quorum and the step commits only where all of
            them succeeded (with ``local_sgd``: each sync's change, the sync the commit point); a lost island's step
            is dropped, and a restarted island heals from a live one. Each island trains on its own shards of the
            data (``FaultTolerance(islands=N)``): Lightning's ``DistributedSampler`` splits the training data over
            every rank of every island.
        **kwargs: forwarded to ``DistributedDataParallel``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=OptimizedDDPStrategy(comm_hook="fp16"))
    """

    strategy_name = "ddp_optimized"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
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
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        check_ddp_strategy_internals(self)
        self._fault_tolerance = self._core.fault_tolerance
        self._ddp_kwargs.update(self._core.ddp_flags)
        self._accumulation = ManualAccumulation()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, except with ``fault_tolerance`` in training: this rank's shard of every island's data.

        Validation, test and predict keep the island's own split: each island evaluates the whole set.
        """
        ft, module = self._fault_tolerance, self.lightning_module
        try:
            stage = module.trainer.state.stage if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            stage = None
        if ft is None or stage != RunningStage.TRAINING:
            return super().distributed_sampler_kwargs
        return ft.config.sampler_kwargs(self.world_size, self.global_rank)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_core()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_process_group_at_exit()

    @override
    def load_checkpoint(self, checkpoint_path: PathType, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        wrapped = isinstance(self.model, DistributedDataParallel)
        self._core.load(checkpoint.get(CHECKPOINT_KEY), wrapped, checkpoint_path)
        if self._fault_tolerance is not None:
            self._fault_tolerance.resume(checkpoint.get(FT_CHECKPOINT_KEY))
        return checkpoint

    @override
    def remove_checkpoint(self, filepath: PathType) -> None:
        """Remove the checkpoint file and the shards beside it (``ModelCheckpoint`` keeping its top k).

        A link (``save_last="link"``) goes alone: the shards are its target's.
        """
        linked = os.path.islink(filepath)
        super().remove_checkpoint(filepath)
        if self.is_global_zero and not linked:
            remove_shards(filepath)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if (
            trainer.state.fn == TrainerFn.FITTING
            and self._ddp_kwargs.get("static_graph")
            and trainer.accumulate_grad_batches > 1
        ):
            raise ValueError(
                f"static_graph=True cannot be combined with accumulate_grad_batches={trainer.accumulate_grad_batches}:"
                " DDP's static graph mode mis-syncs gradients under no_sync (pytorch#143580). Use static_graph=False."
            )
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # the optimizers are set up by now, after the hook was registered
            self._core.fit_to_optimizers(self.optimizers)
        self._name_run()
        if self._core.local_sgd is not None:
            self._core.local_sgd.setup(trainer, self.world_size, self.root_device)
        if self._fault_tolerance is not None and trainer.state.fn == TrainerFn.FITTING:
            if not trainer.lightning_module.automatic_optimization:
                raise ValueError(
                    "fault_tolerance needs automatic optimization: the strategy votes on each optimizer step before "
                    "taking it; manual optimization is not supported yet"
                )
            if is_param_in_hook_signature(trainer.lightning_module.training_step, "dataloader_iter", explicit=True):
                raise ValueError(
                    "fault_tolerance cannot heal a training_step that takes dataloader_iter: a returning island is "
                    "moved to the live islands' position in the epoch by reading past the batches they have passed, "
                    "and a step that reads its own batches has no position to move to; take the batch as an argument"
                )
            self._join_islands(lambda: training_state(trainer), lambda saved: load_training_state(trainer, saved))

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        self._ddp_kwargs["bucket_cap_mb"] = self._core.bucket_cap(model, self.root_device)
        return super()._setup_model(model)

    @override
    def _register_ddp_hooks(self) -> None:
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        self._install_hook(model, measured=self._ledger_read())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # With local SGD each rank's inner optimizer state is its own: load this rank's, saved beside rank 0's.
        own = self._core.saved_optimizer_states()
        super().load_optimizer_state_dict(checkpoint if own is None else {**checkpoint, "optimizer_states": own})

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        try:
            samples: int | None = extract_batch_size(batch)
        except (MisconfigurationException, RecursionError):
            samples = None
        self._core.before_micro_batch(self.model, samples, first_of_epoch=batch_idx == 0)
        if self._fault_tolerance is not None:
            self._fault_tolerance.before_batch()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def take(closure: Callable[[], Any]) -> Any:
            return super(OptimizedDDPStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

        ft, module = self._fault_tolerance, self.lightning_module

        def run() -> Any:
            if ft is None or module is None:
                return take(closure)
            return ft.optimizer_step(optimizer, closure, take, [p for p in module.parameters() if p.requires_grad])

        output, records = self._core.optimizer_step(optimizer, run, self.model, self._say)
        if ft is not None:
            ft.after_step()
            if ft.stats is not None and module is not None:
                for name, value in ft.stats.metrics().items():
                    module.log(name, value, on_step=True, on_epoch=False)
        # On a GPU the steps resolved now are usually earlier ones; the checks below need no timing.
        for record in records:
            self._accumulation.check_syncs_per_step(self.lightning_module, record.sync_rounds, record.micro_batches)
            if record.samples and self.lightning_module is not None:
                # Assumes every rank runs batches of the same size, as DistributedSampler makes them.
                self.lightning_module.log(
                    "ddpopt/effective_batch_size", float(record.samples * self.world_size), on_step=True, on_epoch=False
                )
        return output

    @contextmanager
    def accumulate(self, every: int) -> Iterator[AccumulationStep]:
        """Gradient accumulation for manual optimization, with one gradient sync per optimizer step.

        Run the forward pass and ``manual_backward`` of one micro-batch inside; the gradients are synchronised
        only on the last micro-batch of each group of ``every`` (or the epoch's last batch, which ends a shorter
        group). Step the optimizer when the yielded step says so::

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                with self.trainer.strategy.accumulate(every=4) as step:
                    loss = self.loss(batch)
                    self.manual_backward(loss / step.every)
                if step.should_step:
                    opt.step()
                    opt.zero_grad()

        Args:
            every: micro-batches per optimizer step (K).

        Raises:
            ValueError: ``every`` is not a positive int, or the strategy runs with ``static_graph=True``
                (DDP's static graph mode mis-syncs under ``no_sync``, pytorch#143580).
            RuntimeError: the LightningModule uses automatic optimization (use
                ``Trainer(accumulate_grad_batches=K)`` there).
        """
        static_graph = bool(self._ddp_kwargs.get("static_graph"))
        step = self._accumulation.next_step(self.lightning_module, every, static_graph)
        with nullcontext() if step.should_step else self.block_backward_sync():
            yield step

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathType, storage_options: Any | None = None
    ) -> None:
        """Add the measured decisions to the checkpoint, and write what differs per rank to its shards.

        Every rank writes its own comm-hook state (and with local SGD its replica's inner optimizer state and its
        island's outer slices) to the directory ``filepath + ".ddpopt"`` (see
        :mod:`lightning_ddpopt.checkpoint_shards`); a URL ``filepath`` gathers them into the file on rank 0 instead.
        Every rank must call this, as with Lightning's ``DDPStrategy``; with per-rank state a call on fewer ranks
        raises once the process group's timeout (or ``checkpoint_timeout``) has passed (see
        :mod:`lightning_ddpopt.checkpoint`).

        Args:
            checkpoint: the checkpoint Lightning built; the entry goes under ``"ddpopt"``.
            filepath: where rank 0 writes it.
            storage_options: passed on to the checkpoint IO plugin.
        """
        # Local SGD's per-rank inner optimizer states, except in weights-only checkpoints.
        optimizers = self.optimizers if "optimizer_states" in checkpoint else None
        entry = self._core.checkpoint_entry(optimizers, filepath)
        if entry is not None:
            checkpoint[CHECKPOINT_KEY] = entry
        if self._fault_tolerance is not None and (quorum := self._fault_tolerance.checkpoint_state()) is not None:
            checkpoint[FT_CHECKPOINT_KEY] = quorum
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def on_train_end(self) -> None:
        self._log_final_layout(self._say)
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._core.stop()
        super().teardown()
        # Nothing of ours may keep a process group alive past Lightning's exit-time destroy_process_group.
        self._core.close()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        """Register ``ddp_optimized[_spawn|_fork|_notebook]`` and hook presets such as ``ddp_optimized_fp16``.

        Args:
            strategy_registry: Lightning's strategy registry (Lightning calls this itself).
        """
        register_strategy_names(cls, strategy_registry, "OptimizedDDPStrategy")

    def _loss_scale(self) -> torch.Tensor | None:
        return current_loss_scale(self.precision_plugin)

    def _ledger_read(self) -> bool:
        """Whether this fit reads the ledger's syncs: a measuring callback, or manual optimization's per-step check."""
        module = self.lightning_module
        if module is None or not module.automatic_optimization:
            return True
        callbacks = module.trainer.callbacks  # type: ignore[attr-defined]
        return any(isinstance(c, MeasuringCallback) for c in callbacks)

    def _say(self, message: str) -> None:
        say_during_training(self.lightning_module, self.is_global_zero, message)


if OptimizedDDPStrategy.strategy_name not in StrategyRegistry:
    OptimizedDDPStrategy.register_strategies(StrategyRegistry)
