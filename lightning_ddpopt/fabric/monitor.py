"""Monitor: the Trainer's measuring callbacks in a Fabric loop, with the same figures, findings and report.

The callbacks (:class:`~lightning_ddpopt.CommProfiler`, :class:`~lightning_ddpopt.StragglerDetector`,
:class:`~lightning_ddpopt.AMPMonitor`) are the Trainer's own, unchanged: the monitor calls their hooks at the points
the Trainer would (a batch's start and end from :meth:`Monitor.batch`, the optimizer step from the strategy, the end
of fit from :meth:`Monitor.finish`) and hands them a view of the Fabric run with the few attributes of a Trainer and
a LightningModule they read. Their logs go through ``fabric.log_dict``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ddpopt.callbacks import AMPMonitor, CommProfiler, StragglerDetector
from lightning_ddpopt.diagnosis import REPORT_NAME
from lightning_ddpopt.measuring import CoreViews, FrontEnd, MeasuringCallback

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

    from lightning_ddpopt.fabric.strategy import OptimizedDDPStrategy

__all__ = ["Monitor"]

_MEASURING = (CommProfiler, StragglerDetector, AMPMonitor)


class Monitor:
    """What the measuring callbacks give a Trainer user, in a Fabric loop: three lines.

    ::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=OptimizedDDPStrategy(comm_hook="powersgd"))
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        monitor = Monitor(fabric)                      # 1: after fabric.setup
        for batch in loader:
            with monitor.batch(batch):                 # 2: around each batch's work, optimizer step included
                loss = model(batch)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if monitor.should_stop:                    # only with AMPMonitor(on_nonfinite="stop")
                break
        monitor.finish()                               # 3: on every rank; prints the findings, writes the report

    Every figure the callbacks log on a Trainer is logged through ``fabric.log_dict`` at the optimizer step it
    belongs to, and kept in :attr:`metrics`. At :meth:`finish`, rank 0 prints the findings (network, compression,
    AMP from Fabric's GradScaler, accumulation, stragglers) and writes ``ddpopt_report.json``, which
    ``ddpopt report`` plots. :meth:`finish` also ends training on the strategy (local SGD's final average).

    With gradient accumulation, wrap every micro-batch in :meth:`batch` (the optimizer step in the last one's),
    as the Trainer calls its batch hooks per micro-batch. The time between two batches (the loader's) is the
    straggler detector's data time; so is any other work of the loop there, except validation: a forward of the
    model without gradients or in eval mode marks a break, as an epoch boundary does on the Trainer.

    Resume: create the monitor after ``fabric.load``, which restores the optimizer step count (a monitor made
    before restarts its callbacks' step counting at the next batch); the callbacks' counts (skipped steps,
    straggler windows) start afresh.

    Args:
        fabric: the launched Fabric whose model was set up with :class:`lightning_ddpopt.fabric.OptimizedDDPStrategy`.
        callbacks: the measuring callbacks; default ``CommProfiler()``, ``StragglerDetector()`` and ``AMPMonitor()``.
            ``AMPMonitor(skip_scheduler_on_overflow=True)`` is for the Trainer's schedulers: in a Fabric loop, skip
            ``scheduler.step()`` when :attr:`step_skipped` is true.
        report_dir: where ``ddpopt_report.json`` goes; default: the first logger's ``log_dir``, else the working
            directory.

    Raises:
        TypeError: Fabric runs another strategy, or a callback is not one of the three.
        RuntimeError: no model was set up yet.
    """

    def __init__(
        self, fabric: Fabric, callbacks: Iterable[Callback] | None = None, report_dir: str | Path | None = None
    ) -> None:
        # Ours is the one Fabric strategy that is also a CoreViews.
        if not (isinstance(fabric.strategy, FabricDDPStrategy) and isinstance(fabric.strategy, CoreViews)):
            raise TypeError(
                "Monitor measures through lightning_ddpopt.fabric.OptimizedDDPStrategy; this Fabric runs "
                f"{type(fabric.strategy).__name__}. Pass Fabric(strategy=OptimizedDDPStrategy(...)) or "
                "strategy='ddp_optimized'"
            )
        strategy = cast("OptimizedDDPStrategy", fabric.strategy)
        if strategy.model is None:
            raise RuntimeError("Monitor(fabric) comes after fabric.setup(model, optimizer): no model is set up yet")
        defaults: list[Callback] = [CommProfiler(), StragglerDetector(), AMPMonitor()]
        chosen = list(callbacks) if callbacks is not None else defaults
        for callback in chosen:
            if not isinstance(callback, _MEASURING):
                raise TypeError(
                    f"callbacks holds {callback!r}; Monitor runs CommProfiler, StragglerDetector and AMPMonitor only"
                )
            if isinstance(callback, AMPMonitor) and callback.skip_scheduler_on_overflow:
                raise ValueError(
                    "AMPMonitor(skip_scheduler_on_overflow=True) holds back the Trainer's schedulers; a Fabric loop "
                    "steps its own: call scheduler.step() only `if not monitor.step_skipped`"
                )
        self.callbacks: list[Callback] = chosen
        #: The latest value of every figure the callbacks logged.
        self.metrics: dict[str, float] = {}
        #: ``ddpopt_report.json`` once :meth:`finish` wrote it (rank 0).
        self.report_path: Path | None = None
        self._fabric = fabric
        self._strategy = strategy
        self._run = _RunView(fabric, strategy, chosen, report_dir)
        self._module = _ModuleView(strategy)
        self._batches = 0
        self._finished = False
        self._resumes, self._breaks = strategy.resumes, strategy.breaks
        strategy.before_optimizer_step.append(self._before_optimizer_step)
        self._call("setup", TrainerFn.FITTING)
        for hook in ("on_fit_start", "on_train_start", "on_train_epoch_start"):
            self._call(hook)

    @contextmanager
    def batch(self, batch: Any = None) -> Iterator[None]:
        """Run one batch (or micro-batch) of training inside: its forward, backward and any optimizer step.

        Args:
            batch: what the callbacks see as the batch (not read by the default three).
        """
        if self._finished:
            raise RuntimeError("Monitor.batch() after finish(): make a new Monitor for another run")
        index = self._batches
        if self._strategy.resumes != self._resumes:
            # A checkpoint loaded after the monitor started moved the step count: the callbacks count from there.
            self._resumes = self._strategy.resumes
            self._call("on_train_start")
        if self._strategy.breaks != self._breaks:
            # Validation ran since the last batch: what the Trainer calls an epoch boundary, not data time.
            self._breaks = self._strategy.breaks
            self._call("on_train_epoch_start")
        self._call("on_train_batch_start", batch, index)
        yield
        self._call("on_train_batch_end", None, batch, index)
        self._batches += 1
        self._log()

    @property
    def should_stop(self) -> bool:
        """Whether a callback asked training to stop (``AMPMonitor(on_nonfinite="stop")``); the same on every rank."""
        return self._run.should_stop

    @property
    def step_skipped(self) -> bool:
        """Whether the GradScaler skipped the last optimizer step (an overflow), as an ``AMPMonitor`` saw it."""
        return any(callback.last_step_skipped for callback in self.callbacks if isinstance(callback, AMPMonitor))

    def finish(self) -> Path | None:
        """End training on every rank: the strategy's end of training, then the callbacks' end of fit.

        The loggers are asked to save what they hold (``logger.save()``), not finalized: the loop may log on.

        Returns the path of ``ddpopt_report.json`` on rank 0 (``None`` elsewhere, or when a ``CommProfiler`` has
        ``report=False``).
        """
        if self._finished:
            return self.report_path
        self._finished = True
        self._strategy.finish()
        self._call("on_train_end")
        self._call("teardown", TrainerFn.FITTING)
        self._strategy.before_optimizer_step.remove(self._before_optimizer_step)
        for logger in self._fabric.loggers:  # what was logged reaches the loggers' files (a CSV logger buffers it)
            logger.save()
        path = Path(self._run.log_dir) / REPORT_NAME
        written = self._run.is_global_zero and all(c.report for c in self.callbacks if isinstance(c, MeasuringCallback))
        self.report_path = path if written and path.exists() else None
        return self.report_path

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._call("on_before_optimizer_step", optimizer)

    def _call(self, hook: str, *args: Any) -> None:
        trainer, module = cast(pl.Trainer, self._run), cast(pl.LightningModule, self._module)
        for callback in self.callbacks:
            getattr(callback, hook)(trainer, module, *args)

    def _log(self) -> None:
        logged, self._module.logged = self._module.logged, {}
        stats = self._strategy.fault_tolerance_stats
        if stats is not None:
            logged.update(stats.metrics())
        if logged:
            self.metrics.update(logged)
            self._fabric.log_dict(logged, step=self._run.global_step)


class _RunView(FrontEnd):
    """The attributes of a Trainer the measuring callbacks read, over a Fabric run."""

    def __init__(
        self, fabric: Fabric, strategy: OptimizedDDPStrategy, callbacks: list[Callback], report_dir: str | Path | None
    ) -> None:
        self.strategy = strategy
        self.callbacks = callbacks
        self.loggers = fabric.loggers
        self.should_stop = False
        self.lightning_module = None
        self.lr_scheduler_configs: list[Any] = []
        self.accumulate_grad_batches = None  # a Fabric loop accumulates as it likes; the ledger counts it
        self.fit_loop = None  # no data fetcher: the time between batches is the data time
        self.training = True
        logger_dir = getattr(fabric.logger, "log_dir", None) if fabric.loggers else None
        self.log_dir = str(report_dir if report_dir is not None else logger_dir or os.getcwd())
        self.default_root_dir = self.log_dir

    world_size = property(lambda self: self.strategy.world_size)
    global_rank = property(lambda self: self.strategy.global_rank)
    local_rank = property(lambda self: self.strategy.local_rank)
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    global_step = property(lambda self: self.strategy.optimizer_steps)
    optimizers = property(lambda self: self.strategy.optimizers)
    precision_plugin = property(lambda self: self.strategy.precision)


class _ModuleView:
    """The attributes of a LightningModule the measuring callbacks read: its device, parameters and ``log``."""

    def __init__(self, strategy: OptimizedDDPStrategy) -> None:
        self._strategy = strategy
        self.logged: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self._strategy.root_device

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        model = self._strategy.model
        assert model is not None
        return model.module.named_parameters()

    def log(self, name: str, value: float, **_: Any) -> None:
        self.logged[name] = float(value)
