"""Shared test models and a 2-process CPU DDP runner that brings back what each rank saw."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import AMPMonitor, OptimizedDDPStrategy

WIDTH = 256
LAYERS = 6
#: Fault tolerance runs on torchft (the ``[ft]`` extra, torch >= 2.7): its tests skip without it.
needs_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="fault tolerance needs the [ft] extra (torchft)"
)


class StackModel(pl.LightningModule):
    """``LAYERS`` Linear(WIDTH, WIDTH) layers: several buckets at a 1 MiB cap, a deterministic regression loss."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd", seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        self.optimizer_name = optimizer
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class _WaitInBackward(torch.autograd.Function):
    """The identity, whose backward waits ``seconds`` (a device busy with expensive layers: the host is free)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SlowBackwardModel(StackModel):
    """StackModel whose backward pass spends ``seconds`` after the last layer's gradients: with a bucket cap under
    one layer (``bucket_cap_mb=0.25``) DDP has handed that layer's bucket to the comm hook, and the wait comes
    before every other bucket is ready (expensive early layers)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = _WaitInBackward.apply(self.net[:-2](x), self.seconds)
        return nn.functional.mse_loss(self.net[-2:](hidden), y)


class WideModel(StackModel):
    """StackModel plus a parameter of ``extra`` elements whose gradient costs one pass to compute: many gradient bytes
    for little compute (a communication-bound model)."""

    def __init__(self, extra: int = 12_000_000) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.zeros(extra))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + 1e-6 * self.extra.sum()


class NaNGradientModel(StackModel):
    """Rank ``rank`` puts a NaN into net.4.weight's gradient at (1-based) optimizer step ``step``, before any sync."""

    def __init__(self, rank: int = 1, step: int = 2) -> None:
        super().__init__()
        self.nan_rank, self.nan_step = rank, step
        self._hook: Any = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step - 1:
            self._hook = self.net[4].weight.register_hook(lambda grad: grad + float("nan"))
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class NonfiniteReport(pl.Callback):
    """Saves, per rank, the AMPMonitor's non-finite reports, the step training ended at and the warnings it gave."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self.caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        (monitor,) = [c for c in trainer.callbacks if isinstance(c, AMPMonitor)]  # type: ignore[attr-defined]
        warned = [str(w.message) for w in self.caught if "non-finite " in str(w.message)]
        record = {"reports": monitor.nonfinite_reports, "global_step": trainer.global_step, "warned": warned}
        torch.save(record, self.out / f"amp{trainer.global_rank}.pt")


class OverflowModel(StackModel):
    """Scales the loss to inf at the given 1-based optimizer steps (on ``ranks`` only, if given); optionally a
    per-step halving LR scheduler."""

    def __init__(
        self,
        overflow_at: tuple[int, ...] = (),
        scheduler: bool = False,
        lr: float = 0.05,
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(lr=lr)
        self.overflow_at = overflow_at
        self.scheduler = scheduler
        self.ranks = ranks

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        overflow = batch_idx + 1 in self.overflow_at and (self.ranks is None or self.global_rank in self.ranks)
        return loss * float("inf") if overflow else loss

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualStackModel(StackModel):
    """Manual optimization with K-step accumulation, through ``strategy.accumulate`` or a naive loop that syncs
    every micro-batch (what users write by hand)."""

    def __init__(self, every: int, use_helper: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.every = every
        self.use_helper = use_helper

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        if self.use_helper:
            with self.trainer.strategy.accumulate(every=self.every) as step:
                self.manual_backward(nn.functional.mse_loss(self.net(x), y) / step.every)
            should_step = step.should_step
        else:
            self.manual_backward(nn.functional.mse_loss(self.net(x), y) / self.every)
            should_step = (batch_idx + 1) % self.every == 0 or batch_idx + 1 == self.trainer.num_training_batches
        if should_step:
            optimizer.step()
            optimizer.zero_grad()


class WarningsProbe(pl.Callback):
    """Records, on rank 0, the text of every warning raised during fit, from the callbacks' setup on (list it
    before the callbacks whose setup warnings a test reads)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._catcher.__exit__(None, None, None)
        if trainer.global_rank == 0:
            torch.save([str(w.message) for w in self._caught], self.out)


class LaggingTimeline:
    """Host clocks that behave like a device running behind its host: a mark resolves only once ``lag`` later
    marks were taken. Counts the blocking :meth:`wait` calls, which training must never make."""

    device_clock = True

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.waits = 0
        self._taken = 0
        self._lock = threading.Lock()

    def mark(self) -> tuple[int, float]:
        with self._lock:
            self._taken += 1
            return self._taken, time.perf_counter()

    def seconds(self, mark: tuple[int, float]) -> float | None:
        with self._lock:
            return mark[1] if self._taken - mark[0] >= self.lag else None

    def wait(self, mark: tuple[int, float]) -> float:
        with self._lock:
            self.waits += 1
        return mark[1]


class LaggingStrategy(OptimizedDDPStrategy):
    """OptimizedDDPStrategy whose ledger runs on a :class:`LaggingTimeline`, with its own lag on each rank."""

    def __init__(self, lags: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lags = lags

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.ledger is not None
        self.ledger.timeline = LaggingTimeline(self.lags[self.global_rank])


def straggler_excess_ms(last: dict[str, Any]) -> float:
    """The excess a StragglerDetector verdict must report, from its own per-rank figures: the slowest rank's own time
    (data, compute, optimizer) above the sum of the other ranks' per-phase medians (the lower middle one of an even
    count, as torch's median takes). What the detector guarantees on any load, unlike the excess's size, which a
    loaded machine's scheduler stretches."""
    phases = ("data", "compute", "optimizer")
    rows = {int(rank): figures for rank, figures in last["per_rank_ms"].items()}
    slowest = last["slowest_rank"]
    others = [rows[rank] for rank in sorted(rows) if rank != slowest]
    medians = [torch.tensor([row[phase] for row in others], dtype=torch.float64).median().item() for phase in phases]
    return sum(rows[slowest][phase] for phase in phases) - sum(medians)


def stack_gradient_bytes() -> int:
    return LAYERS * (WIDTH * WIDTH + WIDTH) * 4


def regression_data(samples: int = 64, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, WIDTH, generator=generator)
    y = torch.randn(samples, WIDTH, generator=generator)
    return TensorDataset(x, y)


class RankProbe(pl.Callback):
    """Saves, on every rank at the end of fit, what the tests assert on."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.first_grads: torch.Tensor | None = None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.first_grads is None:
            self.first_grads = torch.cat([p.grad.detach().flatten() for p in pl_module.parameters()]).cpu()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        model = strategy.model
        record: dict[str, Any] = {
            "rank": trainer.global_rank,
            "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]).cpu(),
            "cores": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "first_grads": self.first_grads,
        }
        if isinstance(model, DistributedDataParallel):
            record["ddp_comm_hook"] = model._get_ddp_logging_data().get("comm_hook")
        if isinstance(strategy, OptimizedDDPStrategy):
            record["comm_hook_name"] = strategy.comm_hook_name
            record["bucket_layout"] = strategy.bucket_layout
            record["bucket_plan"] = asdict(strategy.bucket_plan) if strategy.bucket_plan else None
            record["steps"] = [asdict(step) for step in strategy.ledger.steps] if strategy.ledger else []
            record["hook_iteration"] = getattr(strategy.comm_state, "iteration", None)
            record["hook_rank"] = getattr(strategy.comm_state, "rank", None)  # PowerSGD's rank in use
            record["hook_bound"] = getattr(strategy.comm_state, "error_bound", None)  # and its error bound
        torch.save(record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def user_environment(root: Path) -> dict[str, str]:
    """This process's environment for a script started as a user starts it: nothing of a cluster this test may run in
    (nor what Lightning sets in its launching process: ``MASTER_PORT``, the seed), ``root`` importable, one thread."""
    cluster = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK", "GROUP_RANK")
    cluster += ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in cluster and not name.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))
    }
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    return env


def load_script(relative_path: str) -> Any:
    """Import a script of this repository (``examples/...``, ``benchmarks/...``) as a module of its file's name."""
    path = Path(__file__).parents[1] / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def fit_ddp(
    out_dir: Path,
    strategy: pl.strategies.Strategy,
    *,
    model: pl.LightningModule | None = None,
    loader: DataLoader | None = None,
    devices: int = 2,
    batch_size: int = 8,
    samples: int = 64,
    ckpt_path: str | None = None,
    save_last_to: Path | None = None,
    save_epochs_to: Path | None = None,
    callbacks: list[pl.Callback] | None = None,
    **trainer_kwargs: Any,
) -> list[dict[str, Any]]:
    """Fit on ``devices`` CPU processes and return each rank's :class:`RankProbe` record, ordered by rank.

    ``save_last_to`` saves ``last.ckpt`` there at the end of every epoch; ``save_epochs_to`` keeps every epoch's
    checkpoint there, ``epoch=0.ckpt``, ``epoch=1.ckpt``, ...
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer_kwargs.setdefault("max_epochs", 1)
    callbacks = [RankProbe(str(out_dir)), *(callbacks or [])]
    if save_last_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_last_to, save_last=True, save_top_k=0))
    if save_epochs_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_epochs_to, filename="{epoch}", save_top_k=-1))
    trainer_kwargs.setdefault("accelerator", "cpu")
    trainer_kwargs.setdefault("logger", False)
    trainer = pl.Trainer(
        devices=devices,
        strategy=strategy,
        default_root_dir=out_dir,
        enable_checkpointing=trainer_kwargs.pop("enable_checkpointing", (save_last_to or save_epochs_to) is not None),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    pl.seed_everything(0)
    model = model if model is not None else StackModel()
    loader = loader if loader is not None else DataLoader(regression_data(samples), batch_size=batch_size)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]


def uninterrupted_and_resumed(
    tmp_path: Path,
    make_strategy: Callable[[], pl.strategies.Strategy],
    samples: int = 64,
    against_unsaved: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """Two epochs straight, saving at each epoch's end, as a user's run does; then resumed from the first epoch's
    checkpoint to two. Adam, so optimizer state matters.

    ``samples``: per epoch, over both ranks at batch 8 (64: 4 optimizer steps per epoch). ``against_unsaved``: also
    fit two epochs without saving and check that saving changed nothing (a save drains a hook's workers and settles
    its round). Returns the saving and the resumed run's per-rank records and the checkpoint's path.
    """
    adam = {"model": StackModel(optimizer="adam"), "samples": samples}
    uninterrupted = fit_ddp(tmp_path / "full", make_strategy(), max_epochs=2, save_epochs_to=tmp_path, **adam)
    checkpoint = tmp_path / "epoch=0.ckpt"
    if against_unsaved:
        adam = {"model": StackModel(optimizer="adam"), "samples": samples}
        unsaved = fit_ddp(tmp_path / "unsaved", make_strategy(), max_epochs=2, **adam)
        for saving, plain in zip(uninterrupted, unsaved, strict=True):
            torch.testing.assert_close(saving["params"], plain["params"], rtol=0, atol=0)
    resumed = fit_ddp(
        tmp_path / "resumed",
        make_strategy(),
        model=StackModel(optimizer="adam"),
        samples=samples,
        max_epochs=2,
        ckpt_path=str(checkpoint),
    )
    return uninterrupted, resumed, checkpoint


def jitter_backward(delays: random.Random):
    """A forward hook whose output's gradient waits 0-2 ms (drawn from ``delays``) in the backward pass."""

    def sleep_then(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(delays.random() * 0.002)
        return grad

    def forward_hook(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        output.register_hook(sleep_then)

    return forward_hook
