"""OptimizedDDPStrategy: Lightning's DDPStrategy with planned buckets, comm hooks on every backend, and a ledger."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ddpopt._compat import check_lightning_version
from lightning_ddpopt._groups import destroy_owned_group, destroy_process_group_at_exit, group_like
from lightning_ddpopt._sigterm import SigtermAtSyncs
from lightning_ddpopt._validate import require_number
from lightning_ddpopt.accumulation import AccumulationStep, next_accumulation_step
from lightning_ddpopt.affinity import CoreBinding, available_cores, plan_given_cores, validate_cpu_affinity
from lightning_ddpopt.buckets import (
    BucketAutotuner,
    BucketPlan,
    autotune_candidates,
    built_bucket_bytes,
    plan_buckets,
    validate_bucket_cap_mb,
)
from lightning_ddpopt.checkpoint import CHECKPOINT_KEY, SavedRun, gather_hook_states, restore_hook_state
from lightning_ddpopt.hooks.auto import AUTO_HOOK, HookChoice, choose_hook, measure_hook_costs
from lightning_ddpopt.hooks.base import CommHookState
from lightning_ddpopt.hooks.int8 import Int8Config, Int8State
from lightning_ddpopt.hooks.powersgd import CPUKernels, PowerSGDConfig, PowerSGDState, local_cpu_kernels
from lightning_ddpopt.hooks.registry import (
    TESTED_BACKENDS,
    HookSpec,
    get_hook_spec,
    int8_spec,
    powersgd_spec,
    validate_hook_callable,
)
from lightning_ddpopt.ledger import CommHook, CommLedger
from lightning_ddpopt.localsgd import LocalSGD, LocalSGDConfig
from lightning_ddpopt.precision import current_loss_scale
from lightning_ddpopt.timing import timeline_for
from lightning_ddpopt.units import format_bytes

__all__ = ["OptimizedDDPStrategy"]

_DEFAULT_COMM_HOOK = "allreduce"
#: DDP settles its bucket layout after its first synchronised step; by the end of the second the layout is final.
_LAYOUT_FINAL_AFTER_STEPS = 2


class OptimizedDDPStrategy(DDPStrategy):
    """A drop-in :class:`~lightning.pytorch.strategies.DDPStrategy` that makes data-parallel training scale.

    Differences from the stock strategy:

    * ``comm_hook`` is registered on **every** backend (gloo on CPU, NCCL on GPU) and checked to be attached;
      Lightning's ``DDPStrategy`` registers hooks on CUDA only and silently drops them elsewhere.
    * ``bucket_cap_mb="auto"`` sizes DDP's gradient buckets from the model and the world size
      (see :func:`lightning_ddpopt.buckets.auto_bucket_cap_mb`); ``"autotune"`` measures candidate caps during the
      first optimizer steps and keeps the fastest (:class:`~lightning_ddpopt.buckets.BucketAutotuner`); rank 0 logs
      the plan at setup and the layout DDP actually built once it is final.
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
            setup and picks ``allreduce``, ``fp16``, ``int8`` or ``powersgd`` (see
            :mod:`lightning_ddpopt.hooks.auto`). The hook's state is saved in checkpoints (see
            :mod:`lightning_ddpopt.checkpoint`) and restored.
        comm_state: the state passed to a callable ``comm_hook``.
        bucket_cap_mb: DDP's bucket cap in MiB, a positive number, ``"auto"`` or ``"autotune"``.
        gradient_as_bucket_view: let gradients be views into DDP's buckets (saves a gradient-sized copy per step
            and its memory; ``param.grad`` must then not be detached or resized in place). DDP's default is False.
        find_unused_parameters: see ``DistributedDataParallel``.
        static_graph: see ``DistributedDataParallel``.
        cpu_affinity: ``True`` gives each local rank its own cores within those it was given: ranks given the same
            cores (``os.sched_getaffinity``) split them evenly, a rank a launcher bound keeps its own (see
            :func:`lightning_ddpopt.affinity.plan_given_cores`), with torch's thread count to match; a list gives
            each local rank its cores explicitly; ``False`` (default) leaves affinity alone.
        checkpoint_timeout: seconds a checkpoint save waits for every rank before it raises (stateful hooks only).
        local_sgd: a :class:`~lightning_ddpopt.localsgd.LocalSGDConfig` (e.g. ``LocalSGDConfig.diloco(16)``): after
            its warm-up, gradients are not synchronised at all and the ranks average their parameter changes every
            ``sync_every`` optimizer steps (see :mod:`lightning_ddpopt.localsgd`). ``comm_hook`` then applies
            during the warm-up only.
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
        comm_hook: str | PowerSGDConfig | Int8Config | Callable | None = _DEFAULT_COMM_HOOK,
        comm_state: object | None = None,
        bucket_cap_mb: float | Literal["auto", "autotune"] = "auto",
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        cpu_affinity: bool | list[list[int]] = False,
        checkpoint_timeout: float = 30.0,
        local_sgd: LocalSGDConfig | None = None,
        **kwargs: Any,
    ) -> None:
        check_lightning_version()
        _validate_local_sgd(local_sgd, comm_hook, ddp_comm_hook, model_averaging_period, bucket_cap_mb)
        self._hook_spec, self._hook_callable = _validate_comm_hook(comm_hook, comm_state, ddp_comm_hook)
        self._auto_hook = comm_hook == AUTO_HOOK
        if ddp_comm_hook is not None:
            validate_hook_callable(ddp_comm_hook, "ddp_comm_hook")
        if ddp_comm_wrapper is not None and ddp_comm_hook is None:
            raise ValueError(
                f"ddp_comm_wrapper={ddp_comm_wrapper!r} wraps ddp_comm_hook, which is not given; pass "
                "ddp_comm_hook too, or use comm_hook="
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
        # DistributedDataParallel gets only what differs from its own defaults (all False).
        ddp_flags = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
        }
        self._ddp_kwargs.update((name, True) for name, value in ddp_flags.items() if value)
        self._comm_state_arg = comm_state
        self._bucket_cap_mb = validate_bucket_cap_mb(bucket_cap_mb)
        self._cpu_affinity = validate_cpu_affinity(cpu_affinity)
        self._checkpoint_timeout = require_number("checkpoint_timeout", checkpoint_timeout)
        self._checkpoint_saves = 0
        self._checkpoint_nonce = ""
        self._owns_comm_state = False
        self.ledger: CommLedger | None = None
        self.comm_state: object | None = None
        self.comm_hook_name: str | None = None
        self.bucket_plan: BucketPlan | None = None
        self.bucket_layout: tuple[int, ...] | None = None
        self.core_binding: CoreBinding | None = None
        self._saved: SavedRun | None = None
        self._hook_state_pending = False
        self._local_sgd_pending = False
        self._micro_batch_in_group = 0
        self._warned_extra_syncs = False
        self.autotuner: BucketAutotuner | None = None
        self.hook_choice: HookChoice | None = None
        self._registered_hook: CommHook | None = None
        self._layout_due_step = _LAYOUT_FINAL_AFTER_STEPS
        self._local_sgd_config = local_sgd
        self._hook_group: torch.distributed.ProcessGroup | None = None
        self._local_sgd_group: torch.distributed.ProcessGroup | None = None
        self.local_sgd: LocalSGD | None = None
        self._sigterm: SigtermAtSyncs | None = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._bind_cores()
        # CUDA events on a GPU (host clocks would time kernel queueing), host clocks on CPU.
        self.ledger = CommLedger(timeline=timeline_for(self.root_device))

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_process_group_at_exit()

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
        if self.world_size > 1:
            # Names this run's checkpoint meetings on the store, which outlives a Trainer in the same processes.
            self._checkpoint_nonce = self.broadcast(secrets.token_hex(8))
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if self._local_sgd_config is not None and not any(isinstance(c, _FinalAverage) for c in callbacks):
            # First in line, so that the callbacks' and the module's on_train_end see the averaged model.
            callbacks.insert(0, _FinalAverage())
        if self._local_sgd_config is not None and trainer.state.fn == TrainerFn.FITTING and self.world_size > 1:
            self._sigterm_checks_at_syncs(trainer)

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        reused = self._reused_decision("bucket_cap_mb") if self._bucket_cap_mb == "autotune" else None
        if reused is not None:
            replanned = plan_buckets(model, reused, self.world_size)
            self.bucket_plan = dataclasses.replace(replanned, requested="autotune")
            rank_zero_info(f"ddpopt: bucket_cap_mb='autotune' reuses the checkpoint's cap of {reused:g} MiB")
        else:
            self.bucket_plan = plan_buckets(model, self._bucket_cap_mb, self.world_size)
            if self._bucket_cap_mb == "autotune" and self.world_size > 1:
                self.autotuner = BucketAutotuner(autotune_candidates(model, self.world_size))
        self._ddp_kwargs["bucket_cap_mb"] = self.bucket_plan.cap_mb
        return super()._setup_model(model)

    def _reused_decision(self, name: Literal["hook_choice", "bucket_cap_mb"]) -> Any:
        """The checkpoint's measured decision ``name`` if this run may reuse it; says why when it may not."""
        saved = self._saved
        if saved is None or getattr(saved, name) is None:
            return None
        note = saved.decision_note(self.world_size)
        if note is not None:
            what = "comm_hook='auto'" if name == "hook_choice" else "bucket_cap_mb='autotune'"
            rank_zero_info(f"ddpopt: {what} measures again: {note}")
            return None
        return getattr(saved, name)

    @override
    def _register_ddp_hooks(self) -> None:
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        self._check_post_local_sgd(self.root_device)
        backend = self._get_process_group_backend()
        hook = self._build_hook(model, backend)
        if hook is not None:
            if backend not in TESTED_BACKENDS:
                rank_zero_warn(
                    f"ddpopt: comm hook {self.comm_hook_name!r} registered on backend {backend!r}, which is not "
                    f"tested ({', '.join(TESTED_BACKENDS)} are); check its results."
                )
            assert self.ledger is not None
            self._registered_hook = self.ledger.record_hook(hook)
            model.register_comm_hook(self.comm_state, self._registered_hook)
            attached = model._get_ddp_logging_data().get("comm_hook")
            if attached != hook.__qualname__:
                raise RuntimeError(
                    f"ddpopt: registered comm hook {hook.__qualname__!r} but DDP reports {attached!r} attached"
                )
            self._restore_hook_state()
        if self._local_sgd_config is not None:
            group = model.process_group
            if self._local_sgd_config.overlap_steps:
                # The change travels while training goes on: on a group of its own, so that what training issues
                # meanwhile (the SIGTERM meeting, validation's collectives) does not queue behind it.
                group = self._local_sgd_group = self._group_of_own(model)
            self.local_sgd = LocalSGD(self._local_sgd_config, model.module, group)
            self._restore_local_sgd()
        self._log_plan(backend)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Add the hook's state (every rank's, gathered to rank 0) and the measured decisions to the checkpoint.

        Every rank must call this, as with Lightning's ``DDPStrategy``; with a stateful hook a call on fewer ranks
        raises within ``checkpoint_timeout`` seconds (see :mod:`lightning_ddpopt.checkpoint`).
        """
        state = self.comm_state.state_dict() if isinstance(self.comm_state, CommHookState) else {}
        states: list[dict[str, Any]] | None = []
        if state:  # the same hook on every rank, so every rank takes this branch or none does
            self._checkpoint_saves += 1
            states = gather_hook_states(
                state,
                rank=self.global_rank,
                world_size=self.world_size,
                timeout_s=self._checkpoint_timeout,
                tag=f"{self._checkpoint_nonce}/{self._checkpoint_saves}",
            )
        local_states: list[dict[str, Any]] | None = []
        if self.local_sgd is not None and "optimizer_states" in checkpoint:  # not for weights-only checkpoints
            # Each rank's inner optimizer state: local, as in DiLoCo. On the CPU, like the hook states, so that rank
            # 0 does not materialise the other ranks' tensors on their devices.
            self._checkpoint_saves += 1
            local_states = gather_hook_states(
                {"optimizer_states": [_to_cpu(optimizer.state_dict()) for optimizer in self.optimizers]},
                rank=self.global_rank,
                world_size=self.world_size,
                timeout_s=self._checkpoint_timeout,
                tag=f"{self._checkpoint_nonce}/{self._checkpoint_saves}",
            )
        if self.is_global_zero:
            checkpoint[CHECKPOINT_KEY] = SavedRun(
                world_size=self.world_size,
                comm_hook=self.comm_hook_name,
                hook_states=states or [],
                hook_choice=self.hook_choice if self._auto_hook else None,
                bucket_cap_mb=self._autotuned_cap(),
                local_sgd=self.local_sgd.state_dict() if self.local_sgd is not None else None,
                local_sgd_ranks=local_states or [],
            ).to_checkpoint()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        entry = checkpoint.get(CHECKPOINT_KEY)
        self._saved = SavedRun.from_checkpoint(entry) if entry else None
        self._hook_state_pending = self._local_sgd_pending = self._saved is not None
        self._restore_hook_state()
        self._restore_local_sgd()
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # With local SGD each rank's inner optimizer state is its own: load this rank's, saved beside rank 0's.
        saved = self._saved
        if (
            self.local_sgd is not None
            and saved is not None
            and saved.world_size == self.world_size
            and len(saved.local_sgd_ranks) == self.world_size
        ):
            checkpoint = {**checkpoint, "optimizer_states": saved.local_sgd_ranks[self.global_rank]["optimizer_states"]}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.ledger is not None:
            try:
                samples: int | None = extract_batch_size(batch)
            except (MisconfigurationException, RecursionError):
                samples = None
            self.ledger.add_micro_batch(samples, first_of_epoch=batch_idx == 0)
        if self.local_sgd is not None and isinstance(self.model, DistributedDataParallel):
            sync = self.local_sgd.before_batch()
            # DDP reads these in forward: no reducer preparation (so no bucket reaches a hook) and no buffer
            # broadcast; Lightning's no_sync for accumulation restores what is set here.
            self.model.require_backward_grad_sync = sync
            if not sync:
                self.model.require_forward_param_sync = False
        super().on_train_batch_start(batch, batch_idx)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        scale = self._loss_scale() if self.local_sgd is not None else None
        scale_before = scale.detach().clone() if scale is not None else None
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        ledger = self.ledger if isinstance(self.model, DistributedDataParallel) else None
        if self.local_sgd is not None:
            self._local_sgd_step(scale_before)
        if ledger is None:
            return output
        # On a GPU the steps resolved now are usually earlier ones; the checks below need no timing.
        for record in ledger.close_step():
            self._check_syncs_per_step(record.sync_rounds, record.micro_batches)
            if record.samples and self.lightning_module is not None:
                # Assumes every rank runs batches of the same size, as DistributedSampler makes them.
                self.lightning_module.log(
                    "ddpopt/effective_batch_size", float(record.samples * self.world_size), on_step=True, on_epoch=False
                )
        if self.bucket_layout is None and ledger.closed_steps >= self._layout_due_step:
            self._log_layout()
        if self.autotuner is not None and not self.autotuner.done:
            self._autotune_step(ledger)
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

        Raises:
            ValueError: ``every`` is not a positive int, or the strategy runs with ``static_graph=True``
                (DDP's static graph mode mis-syncs under ``no_sync``, pytorch#143580).
            RuntimeError: the LightningModule uses automatic optimization (use
                ``Trainer(accumulate_grad_batches=K)`` there).
        """
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            raise RuntimeError(
                "OptimizedDDPStrategy.accumulate() is for manual optimization; with automatic optimization use "
                "Trainer(accumulate_grad_batches=K), which already syncs once per optimizer step"
            )
        if self._ddp_kwargs.get("static_graph") and every != 1:
            raise ValueError(
                f"accumulate(every={every}) cannot run with static_graph=True: DDP's static graph mode mis-syncs "
                "gradients under no_sync (pytorch#143580). Use static_graph=False."
            )
        last_batch = module.trainer.fit_loop.epoch_loop._num_ready_batches_reached()
        step = next_accumulation_step(self._micro_batch_in_group, every, last_batch)
        self._micro_batch_in_group = 0 if step.should_step else step.micro_batch
        with nullcontext() if step.should_step else self.block_backward_sync():
            yield step

    @override
    def on_train_end(self) -> None:
        if self.bucket_layout is None and isinstance(self.model, DistributedDataParallel):
            self._log_layout()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        sigterm, self._sigterm = self._sigterm, None
        if sigterm is not None:
            sigterm.remove()  # Lightning's own again, should the trainer fit once more
        super().teardown()
        # Nothing of ours may keep the process group alive past Lightning's exit-time destroy_process_group: a
        # gloo group destroyed later, during interpreter shutdown, can abort the process with its threads running.
        # The hook state keeps its figures (for a checkpoint saved after fit) and falls back to the default group.
        if self._owns_comm_state and isinstance(self.comm_state, CommHookState):
            if self.comm_state.close():
                self.comm_state.process_group = None
                if isinstance(self.comm_state, Int8State):
                    self.comm_state.exchange_group = None
                destroy_owned_group(self, "_hook_group")
            else:
                rank_zero_warn(
                    f"ddpopt: {self.comm_hook_name}'s worker thread is still busy after a minute; its group is kept"
                )
        if self.local_sgd is not None:
            self.local_sgd.abandon_in_flight()  # only after a failure: fit's end applies it
            if self._local_sgd_group is not None:
                self.local_sgd.process_group = None  # the group's last reference is the strategy's
        destroy_owned_group(self, "_local_sgd_group")
        if self.core_binding is not None:
            self.core_binding.release()
            self.core_binding = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_optimized[_spawn|_fork|_notebook]`` and hook presets such as ``ddp_optimized_fp16``."""
        start_methods = {"": "popen", "_spawn": "spawn", "_fork": "fork", "_notebook": "fork"}
        for suffix, start_method in start_methods.items():
            strategy_registry.register(
                f"{cls.strategy_name}{suffix}",
                cls,
                description=f"OptimizedDDPStrategy with start_method={start_method!r}",
                start_method=start_method,
            )
        for hook in ("fp16", "bf16"):
            for suffix in ("", "_spawn"):
                strategy_registry.register(
                    f"{cls.strategy_name}{suffix}_{hook}",
                    cls,
                    description=f"OptimizedDDPStrategy with comm_hook={hook!r}, start_method={start_methods[suffix]!r}",
                    comm_hook=hook,
                    start_method=start_methods[suffix],
                )

    def _check_post_local_sgd(self, device: torch.device) -> None:
        """Refuse a post-local SGD state that would fail mid-training on this device."""
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

        state = self._ddp_comm_state
        if (
            isinstance(state, PostLocalSGDState)
            and state.subgroup is None
            and state.post_local_gradient_allreduce
            and device.type != "cuda"
        ):
            raise ValueError(
                "ddp_comm_state=PostLocalSGDState(subgroup=None, post_local_gradient_allreduce=True) makes torch "
                f"build one subgroup per node from the CUDA device count, which is 0 on {device.type}, and fails "
                "once local SGD starts. Pass post_local_gradient_allreduce=False (no gradient sync between "
                "averagings) or an explicit subgroup."
            )

    def _autotune_step(self, ledger: CommLedger) -> None:
        """Count one step for the autotuner; score the candidate and switch DDP's buckets when it is complete."""
        tuner = self.autotuner
        assert tuner is not None
        if not tuner.observe():
            return
        # The candidate's measured steps are the ledger's latest: wait for the device once per candidate, so
        # they are timed on the device's clock (host times on a GPU would be queueing times).
        ledger.flush()
        times = [record.step_time_s for record in list(ledger.steps)[-tuner.measure_steps :]]
        local = tuner.score([t for t in times if t is not None])
        # Every rank scores a candidate by the slowest rank's median, so every rank takes the same decision.
        score = torch.tensor([local], dtype=torch.float64, device=self.root_device)
        torch.distributed.all_reduce(score, op=torch.distributed.ReduceOp.MAX)
        previous = tuner.current
        next_cap = tuner.advance(float(score))
        if tuner.done:
            scores = ", ".join(f"{cap:g} MiB: {t * 1e3:.1f} ms" for cap, t in tuner.scores.items())
            rank_zero_info(
                f"ddpopt: autotune chose bucket_cap_mb={tuner.best:g} after {tuner.total_steps} steps "
                f"(median step time per cap: {scores})"
            )
        if next_cap != previous:
            self._rebuild_buckets(next_cap)

    def _rebuild_buckets(self, cap_mb: float) -> None:
        """Wrap the module in a new DDP with ``cap_mb``; the parameters, optimizer state and hook state stay."""
        assert isinstance(self.model, DistributedDataParallel) and self.bucket_plan is not None
        module = self.model.module
        self._ddp_kwargs["bucket_cap_mb"] = cap_mb
        self.model = super()._setup_model(module)
        if self._registered_hook is not None:
            self.model.register_comm_hook(self.comm_state, self._registered_hook)
        replanned = plan_buckets(module, cap_mb, self.world_size)
        self.bucket_plan = dataclasses.replace(replanned, requested=self.bucket_plan.requested)
        self.bucket_layout = None
        self._layout_due_step = (self.ledger.closed_steps if self.ledger is not None else 0) + _LAYOUT_FINAL_AFTER_STEPS

    def _group_of_own(self, model: DistributedDataParallel) -> torch.distributed.ProcessGroup:
        """A new process group over the model's ranks, on its backend, for traffic that must not interleave with it."""
        return group_like(model.process_group, self._get_process_group_backend(), self._timeout)

    def _sigterm_checks_at_syncs(self, trainer: pl.Trainer) -> None:
        """Between local SGD's syncs the ranks do not wait for each other: the SIGTERM check once a window, in passing.

        Lightning's check makes every batch a barrier, so each local step lasted as long as the slowest rank's
        (measured: 4-7% of the local steps' time on the emulated cluster); in the local phase the check once a window
        does not wait either. See :mod:`lightning_ddpopt._sigterm`.
        """

        def phase() -> tuple[bool, bool, int]:
            local = self.local_sgd
            if local is None:
                return False, True, 0
            return local.local, local.window_starts, local.steps

        sigterm = SigtermAtSyncs(trainer, phase, self.root_device)
        if sigterm.install():
            self._sigterm = sigterm

    def _finish_local_sgd(self) -> None:
        """Ranks that trained alone since the last sync end with their average: one model on every rank."""
        if self.local_sgd is None:
            return
        if self.local_sgd.finish() is not None:
            self._say_during_training(
                "ddpopt: local SGD averaged the ranks' parameters at the end of training (they had trained apart "
                "since the last sync)"
            )

    def _local_sgd_step(self, scale_before: torch.Tensor | None) -> None:
        """Count the optimizer step for local SGD (skipped if the GradScaler backed off) and record its sync."""
        assert self.local_sgd is not None
        scale = self._loss_scale()
        # A GradScaler backs off exactly when it skipped the step (a host read: only with fp16 AMP in local SGD).
        skipped = scale_before is not None and scale is not None and bool(scale < scale_before)
        start = self.ledger.timeline.mark() if self.ledger is not None else None
        sync = self.local_sgd.after_optimizer_step(skipped)
        if sync is not None and self.ledger is not None and start is not None:
            self.ledger.add_parameter_sync(
                sync.num_elements, sync.logical_bytes, sync.wire_bytes, start, transfer_hidden=sync.overlapped
            )

    def _restore_local_sgd(self) -> None:
        """Load the saved outer loop once both the checkpoint and this fit's local SGD loop exist.

        A checkpoint is loaded before setup: a loop left by an earlier fit (its model unwrapped at teardown) waits for
        the one this fit builds.
        """
        saved = self._saved
        if saved is None or self.local_sgd is None or not self._local_sgd_pending:
            return
        if not isinstance(self.model, DistributedDataParallel):
            return
        self._local_sgd_pending = False
        if saved.local_sgd is None:
            rank_zero_warn("ddpopt: the checkpoint holds no local SGD state; the outer loop starts from the weights")
            return
        problem = self.local_sgd.load_state_dict(saved.local_sgd)
        if problem is not None:
            rank_zero_warn(f"ddpopt: {problem}")

    def _check_syncs_per_step(self, sync_rounds: int, micro_batches: int) -> None:
        """Warn once when a manual-optimization loop synchronised gradients on more than one micro-batch."""
        module = self.lightning_module
        if self._warned_extra_syncs or sync_rounds <= 1 or module is None or module.automatic_optimization:
            return
        self._warned_extra_syncs = True
        rank_zero_warn(
            f"ddpopt: this manual-optimization loop synchronised gradients {sync_rounds} times for one optimizer "
            f"step ({micro_batches} micro-batches): every micro-batch paid a full allreduce. Run forward and "
            "manual_backward inside `with self.trainer.strategy.accumulate(every=K) as step:` and call "
            "opt.step() only `if step.should_step`, so only the last micro-batch of each group syncs."
        )

    def _restore_hook_state(self) -> None:
        """Load this rank's saved hook state once both the checkpoint and the registered hook exist."""
        saved = self._saved
        if saved is None or not self._hook_state_pending or not isinstance(self.model, DistributedDataParallel):
            return
        self._hook_state_pending = False
        if not saved.hook_states:
            return
        if isinstance(self.comm_state, CommHookState):
            problem = restore_hook_state(
                self.comm_state, saved, hook_name=self.comm_hook_name, world_size=self.world_size, rank=self.global_rank
            )
        else:
            problem = (
                f"the checkpoint holds state of comm hook {saved.comm_hook!r}; this run's hook "
                f"{self.comm_hook_name!r} keeps no state of this package's kind, so the saved state is not used"
            )
        if problem is not None:
            rank_zero_warn(f"ddpopt: {problem}")

    def _autotuned_cap(self) -> float | None:
        """The cap ``bucket_cap_mb="autotune"`` settled on (measured now or reused), ``None`` while it searches."""
        if self._bucket_cap_mb != "autotune" or self.bucket_plan is None:
            return None
        if self.autotuner is not None and not self.autotuner.done:
            return None
        return self.bucket_plan.cap_mb

    def _bind_cores(self) -> None:
        """Pin this rank to its cores (every thread of it, the process group's too) once the ranks can talk.

        ``cpu_affinity=True`` plans from the cores each local rank was given (``os.sched_getaffinity``): gathered
        from the ranks, so that ranks a launcher bound keep their cores and ranks given the same cores split them.
        """
        if self._cpu_affinity is False:
            return
        local_world_size = self.num_processes
        if self._cpu_affinity is True:
            given = self._local_ranks_cores(available_cores())
            core_sets, how = plan_given_cores(given)
        else:
            core_sets, how = [list(cores) for cores in self._cpu_affinity], "as given"
            if len(core_sets) != local_world_size:
                raise ValueError(
                    f"cpu_affinity gives {len(core_sets)} core sets but there are {local_world_size} local ranks; "
                    "pass one list of cores per local rank"
                )
        self.core_binding = CoreBinding(core_sets[self.local_rank])
        rank_zero_info(
            f"ddpopt: cores per local rank {core_sets}, torch threads {[len(cores) for cores in core_sets]} "
            f"(cpu_affinity={self._cpu_affinity}: {how})"
        )

    def _local_ranks_cores(self, own: list[int]) -> list[list[int]]:
        """The cores each rank on this node was given, in local-rank order (one all-gather at setup)."""
        if not torch.distributed.is_initialized() or self.world_size == 1:
            return [own] * self.num_processes  # no other rank to ask: as if each was given what this one was
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, (self.node_rank, self.local_rank, own))
        on_this_node = sorted((local, cores) for node, local, cores in gathered if node == self.node_rank)
        return [cores for _, cores in on_this_node]

    def _build_hook(self, model: DistributedDataParallel, backend: str) -> CommHook | None:
        if self._auto_hook and self._hook_spec is None:
            reused: HookChoice | None = self._reused_decision("hook_choice")
            if reused is not None:
                self.hook_choice = reused
                rank_zero_info(f"ddpopt: comm_hook='auto' reuses the checkpoint's choice {reused.name!r}")
            elif self.world_size > 1:
                costs = measure_hook_costs(model.module, model.process_group, self.root_device)
                self.hook_choice = choose_hook(costs)
            else:
                self.hook_choice = HookChoice("allreduce", {}, "one process: nothing to communicate")
            if reused is None:
                rank_zero_info(f"ddpopt: comm_hook='auto' chose {self.hook_choice.name!r}: {self.hook_choice.reason}")
            self._hook_spec = get_hook_spec(self.hook_choice.name)
        if self._hook_spec is not None:
            reason = self._hook_spec.unsupported_reason(backend)
            if reason is not None:
                raise ValueError(f"comm_hook={self._hook_spec.name!r} cannot run on backend {backend!r}: {reason}")
            self.comm_state = self._hook_spec.build(model.process_group, self.ledger)
            self._owns_comm_state = True
            self.comm_state.loss_scale = self._loss_scale
            self.comm_state.bind_module(model.module)
            self.comm_hook_name = self._hook_spec.name
            if isinstance(self.comm_state, PowerSGDState) and self.root_device.type == "cpu":
                # PowerSGD's chains run on a worker thread beside the backward pass, in a group of their own: the
                # backward pass may issue collectives on the model's group meanwhile (DDP's unused-parameter map
                # with find_unused_parameters=True, a loss's all_gather), which must not interleave with them.
                self.comm_state.process_group = self._hook_group = self._group_of_own(model)
                self.comm_state.pipelined = True
                # The decompression must give the same bits on every rank: computed the same way everywhere, the
                # way the least able rank can ("blas" with more threads somewhere, else "blocked" without numba).
                order: tuple[CPUKernels, ...] = ("numba", "blocked", "blas")
                kernels = torch.tensor([order.index(local_cpu_kernels())], device=self.root_device)
                torch.distributed.all_reduce(kernels, op=torch.distributed.ReduceOp.MAX, group=model.process_group)
                self.comm_state.cpu_kernels = order[int(kernels)]
            elif isinstance(self.comm_state, Int8State) and self.root_device.type == "cpu":
                # int8's stages travel point to point, driven by worker threads beside the backward pass: on a
                # group of their own, which nothing else uses meanwhile.
                self.comm_state.exchange_group = self._hook_group = self._group_of_own(model)
            return self._hook_spec.hook
        hook: Callable | None = self._hook_callable
        self.comm_state = self._comm_state_arg
        self._owns_comm_state = False
        if hook is None and self._ddp_comm_hook is not None:
            hook = self._ddp_comm_hook
            self.comm_state = self._ddp_comm_state
            if self._ddp_comm_wrapper is not None:
                hook = self._ddp_comm_wrapper(hook)
        self.comm_hook_name = hook.__qualname__ if hook is not None else None
        if isinstance(self.comm_state, CommHookState):
            self.comm_state.bind_module(model.module)
            if self.comm_state.ledger is None:
                self.comm_state.ledger = self.ledger
            if self.comm_state.loss_scale is None:
                self.comm_state.loss_scale = self._loss_scale
        return hook

    def _loss_scale(self) -> torch.Tensor | None:
        return current_loss_scale(self.precision_plugin)

    def _log_plan(self, backend: str) -> None:
        plan = self.bucket_plan
        assert plan is not None
        auto = f", auto for {self.world_size} ranks" if plan.requested == "auto" else ""
        if self.autotuner is not None:
            tried = ", ".join(f"{cap:g}" for cap in self.autotuner.candidates)
            auto = f", autotune tries [{tried}] MiB over {self.autotuner.total_steps} steps"
        rank_zero_info(f"ddpopt: plan {self._describe_buckets(plan.predicted_bucket_bytes, auto)} on {backend}")

    def _log_layout(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        ledger = self.ledger
        # The latest record shows the buckets the hooks saw, unless a step closed since is still on the device.
        last = ledger.steps[-1] if ledger is not None and ledger.steps and not ledger.pending_steps else None
        if self.local_sgd is not None and self.local_sgd.local:
            last = None  # a parameter sync's round is not a bucket layout
        recorded = last.bucket_bytes if last is not None else ()
        self.bucket_layout = recorded or built_bucket_bytes(self.model)
        sizes = ", ".join(format_bytes(size) for size in self.bucket_layout)
        self._say_during_training(
            f"ddpopt: {self._describe_buckets(self.bucket_layout)} on {self._get_process_group_backend()}, "
            f"bucket sizes [{sizes}]"
        )

    def _say_during_training(self, message: str) -> None:
        """Log ``message`` on rank 0; through the progress bar while one is drawn, so the line does not cut it."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        bar = trainer.progress_bar_callback if trainer is not None and trainer.training else None
        try:  # Lightning's TQDM bar raises TypeError before its train bar exists; other bars have none
            train_bar = bar.train_progress_bar if bar is not None else None  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            train_bar = None
        if (
            bar is not None
            and train_bar is not None
            and not getattr(train_bar, "disable", True)
            and self.is_global_zero
        ):
            bar.print(message)
        else:
            rank_zero_info(message)

    def _describe_buckets(self, sizes: tuple[int, ...], cap_note: str = "") -> str:
        assert self.bucket_plan is not None
        count = f"{len(sizes)} bucket" + ("" if len(sizes) == 1 else "s")
        hook = self.comm_hook_name or "none (DDP built-in allreduce)"
        cap = f"cap {self.bucket_plan.cap_mb:g} MiB{cap_note}"
        return f"{format_bytes(sum(sizes))} of gradients in {count} ({cap}), hook {hook}"


def _validate_comm_hook(
    comm_hook: object, comm_state: object, ddp_comm_hook: Callable | None
) -> tuple[HookSpec | None, Callable | None]:
    """Check ``comm_hook`` at construction; return its registry entry or the callable."""
    if ddp_comm_hook is not None and comm_hook not in (None, _DEFAULT_COMM_HOOK):
        raise ValueError(
            f"comm_hook={comm_hook!r} and ddp_comm_hook={ddp_comm_hook!r} both given; pass one of them "
            "(comm_hook takes a registry name or a callable)"
        )
    if isinstance(comm_hook, PowerSGDConfig):
        return powersgd_spec(comm_hook), None
    if isinstance(comm_hook, Int8Config):
        return int8_spec(comm_hook), None
    if isinstance(comm_hook, str):
        if comm_state is not None:
            raise ValueError(
                f"comm_state={comm_state!r} is only used with a callable comm_hook; registry hooks such as "
                f"{comm_hook!r} build their own state"
            )
        if ddp_comm_hook is not None or comm_hook == AUTO_HOOK:
            return None, None
        return get_hook_spec(comm_hook), None
    if comm_hook is None:
        if comm_state is not None:
            raise ValueError(f"comm_state={comm_state!r} given without a callable comm_hook to receive it")
        return None, None
    if not callable(comm_hook):
        raise TypeError(
            f"comm_hook={comm_hook!r} must be a registry name (str), a PowerSGDConfig, an Int8Config, "
            "a callable hook(state, bucket), or None"
        )
    validate_hook_callable(comm_hook)
    return None, comm_hook


def _validate_local_sgd(
    local_sgd: object,
    comm_hook: object,
    ddp_comm_hook: Callable | None,
    model_averaging_period: int | None,
    bucket_cap_mb: object,
) -> None:
    """Refuse local SGD settings that cannot apply, at construction."""
    if local_sgd is None:
        return
    if not isinstance(local_sgd, LocalSGDConfig):
        raise TypeError(f"local_sgd={local_sgd!r} must be a LocalSGDConfig (e.g. LocalSGDConfig.diloco(16)) or None")
    if model_averaging_period is not None:
        raise ValueError(
            f"local_sgd and model_averaging_period={model_averaging_period} both given: they are two local SGD "
            "schemes; use local_sgd=LocalSGDConfig.post_local_sgd(...) for Lightning's post-local SGD"
        )
    if bucket_cap_mb == "autotune":
        raise ValueError(
            "bucket_cap_mb='autotune' with local_sgd: autotune rewraps the model in a new DDP, which broadcasts rank "
            "0's parameters over the other ranks' local progress, and most local steps do not sync at all; use "
            "bucket_cap_mb='auto' or a number"
        )
    if comm_hook == AUTO_HOOK:
        raise ValueError(
            "comm_hook='auto' with local_sgd: auto picks a gradient hook for every step, but with local SGD gradients "
            "sync only during the warm-up; name the warm-up's hook (e.g. comm_hook='fp16') or leave the default"
        )
    custom_hook = ddp_comm_hook is not None or comm_hook not in (None, _DEFAULT_COMM_HOOK)
    if custom_hook and local_sgd.warmup_steps == 0:
        hook = ddp_comm_hook if ddp_comm_hook is not None else comm_hook
        raise ValueError(
            f"comm_hook={hook!r} would never run: with local_sgd and warmup_steps=0 no gradient is ever "
            "synchronised. Set LocalSGDConfig(warmup_steps=N) to run it for the first N steps, or drop it; "
            f"the parameter syncs are compressed by LocalSGDConfig(compression=...) ({local_sgd.compression!r} now)"
        )


class _FinalAverage(pl.Callback):
    """Local SGD's end-of-training average, run before the other callbacks' ``on_train_end``."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, OptimizedDDPStrategy):
            strategy._finish_local_sgd()


def _to_cpu(state: Any) -> Any:
    return apply_to_collection(state, torch.Tensor, lambda tensor: tensor.detach().cpu())
