"""One training script run under every launcher: ``python -m tests.launcher_worker LAUNCHER OUT_DIR SLOW_RANK``.

``LAUNCHER`` is how the ranks start: ``script`` (Lightning starts the other ranks as subprocesses of this script),
``spawn`` and ``fork`` (Lightning's multiprocessing launcher), ``torchrun`` (every rank started by
``torch.distributed.run``), ``nodes`` (every rank started by the test, one per "node", with ``MASTER_ADDR``,
``NODE_RANK`` and ``WORLD_SIZE`` set as a cluster launcher sets them) or ``slurm`` (every rank started by the test
with the variables ``srun`` sets, each bound to a core of its own as ``srun --cpu-bind=cores`` binds it). The script
fits several times in a row, as users do, and every rank writes what it saw to ``OUT_DIR/<fit>_rank<r>.pt``;
tests/test_launchers.py asserts on it.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddpopt import AMPMonitor, CommProfiler, LocalSGDConfig, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import StackModel, regression_data

#: Milliseconds the slow rank sleeps in every training step.
SLOW_MS = 60


class SlowStackModel(StackModel):
    """StackModel whose ``slow_rank`` sleeps in each forward pass (the compute phase)."""

    def __init__(self, slow_rank: int | None = None, optimizer: str = "sgd") -> None:
        super().__init__(optimizer=optimizer)
        self.slow_rank = slow_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.slow_rank:
            time.sleep(SLOW_MS / 1e3)
        return super().training_step(batch, batch_idx)


def shared_tensors(root: object, name: str, shared_only: bool = True) -> list[str]:
    """Paths of tensors reachable from ``root`` through this package's objects whose memory is shared (or of all
    tensors, with ``shared_only=False``).

    Under ``spawn`` torch moves a CPU tensor that is pickled into a rank to shared memory: every rank then writes
    into the same tensor. Only per-rank state created in the ranks is safe. Descends into this package's objects,
    containers and torchmetrics metrics, not into the user's model or data.
    """
    found: list[str] = []
    seen: set[int] = set()

    def visit(value: object, path: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if not shared_only or (value.device.type == "cpu" and value.is_shared()):
                found.append(path)
            return
        if isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]")
            return
        if isinstance(value, list | tuple | collections.deque | set):
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]")
            return
        module = type(value).__module__
        if not module.startswith(("lightning_ddpopt", "torchmetrics")):
            return
        fields = dict(vars(value)) if hasattr(value, "__dict__") else {}
        for cls in type(value).__mro__:  # slotted classes (the ledger's records) keep their fields in slots
            slots = cls.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if hasattr(value, slot):
                    fields[slot] = getattr(value, slot)
        if isinstance(value, torch.nn.Module):
            fields.update(value.named_buffers())
        for key, item in fields.items():
            visit(item, f"{path}.{key}")

    visit(root, name)
    return found


class Probe(pl.Callback):
    """Saves, on every rank at the end of fit, what the launcher tests assert on."""

    def __init__(self, out: Path, fit: str) -> None:
        self.out = out
        self.fit = fit
        self.shared: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every component is set up by now: nothing of ours that a rank writes may be shared with another rank.
        self.shared = shared_tensors(trainer.strategy, "strategy")
        for index, callback in enumerate(trainer.callbacks):  # type: ignore[attr-defined]
            self.shared += shared_tensors(callback, f"callbacks[{index}]:{type(callback).__name__}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, OptimizedDDPStrategy)
        environment = strategy.cluster_environment
        assert environment is not None
        record: dict[str, Any] = {
            "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]).cpu(),
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "environment": type(environment).__name__,
            "pid": os.getpid(),
            "cores": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "shared": self.shared,
            "comm_hook_name": strategy.comm_hook_name,
            "hook_iteration": getattr(strategy.comm_state, "iteration", None),
            "global_step": trainer.global_step,
            "anchor": strategy.local_sgd.anchor.clone()
            if strategy.local_sgd and strategy.local_sgd.anchor is not None
            else None,
            "local_sgd_syncs": strategy.local_sgd.syncs if strategy.local_sgd else None,
            "sync_every": strategy.local_sgd.sync_every if strategy.local_sgd else None,
            "sync_every_chosen": strategy.local_sgd.sync_every_choice is not None if strategy.local_sgd else None,
        }
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, StragglerDetector | CommProfiler | AMPMonitor):
                record[type(callback).__name__] = callback.summary() if hasattr(callback, "summary") else None
            if isinstance(callback, CommProfiler):
                record["comm_metrics"] = dict(callback.last_metrics)
        torch.save(record, self.out / f"{self.fit}_rank{trainer.global_rank}.pt")


def fit(
    launcher: str,
    out: Path,
    name: str,
    strategy_kwargs: dict[str, Any],
    *,
    slow_rank: int | None = None,
    callbacks: list[pl.Callback] | None = None,
    optimizer: str = "sgd",
    samples: int = 64,
    max_epochs: int = 1,
    save_every_epoch: bool = False,
    ckpt_path: Path | None = None,
) -> pl.Trainer:
    start_method = launcher if launcher in ("spawn", "fork") else "popen"
    nodes = launcher == "nodes"
    all_callbacks: list[pl.Callback] = [*(callbacks or []), Probe(out, name)]  # last: it reads their verdicts
    if save_every_epoch:  # epoch=0.ckpt, epoch=1.ckpt, ...
        all_callbacks.append(ModelCheckpoint(dirpath=out / name, filename="{epoch}", save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if nodes else 2,
        num_nodes=2 if nodes else 1,
        strategy=OptimizedDDPStrategy(start_method=start_method, **strategy_kwargs),
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=save_every_epoch,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out / name,
        callbacks=all_callbacks,
    )
    pl.seed_everything(0)
    model = SlowStackModel(slow_rank, optimizer=optimizer)
    trainer.fit(model, DataLoader(regression_data(samples), batch_size=8), ckpt_path=ckpt_path)
    return trainer


def main(launcher: str, out: Path, slow_rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # The full callback set with one slow rank: 12 optimizer steps, one verdict at the end of fit.
    fit(
        launcher,
        out,
        "callbacks",
        # Lightning's launchers give both ranks the same cores (split); srun gave each its own (kept).
        {"comm_hook": "allreduce", "cpu_affinity": launcher in ("script", "slurm")},
        slow_rank=slow_rank,
        callbacks=[CommProfiler(every_n_steps=4, report=False), StragglerDetector(every_n_steps=100), AMPMonitor()],
        samples=192,
    )
    if launcher != "spawn":  # each spawned fit starts fresh interpreters (about 10 s); int8 has no state to share
        fit(launcher, out, "int8", {"comm_hook": "int8"})
    powersgd = {"comm_hook": PowerSGDConfig(rank=2, start_iter=2)}
    # PowerSGD (with error feedback) two epochs straight, saving at each epoch's end, then resumed from the first
    # epoch's checkpoint to two: Adam, so the optimizer's state matters as well as the hook's.
    fit(launcher, out, "powersgd", powersgd, optimizer="adam", max_epochs=2, save_every_epoch=True)
    checkpoint = out / "powersgd" / "epoch=0.ckpt"
    fit(launcher, out, "powersgd_resumed", powersgd, optimizer="adam", max_epochs=2, ckpt_path=checkpoint)
    # DiLoCo choosing H: 20 steps of 2 ranks x 8 samples, the first sync after the provisional window of 16 steps,
    # where the ranks agree on H.
    last = fit(launcher, out, "localsgd", {"local_sgd": LocalSGDConfig.diloco(sync_every="auto")}, samples=320)
    # Under spawn and fork only the launching process gets here (as rank 0); every other launcher's ranks all do.
    (out / f"done_rank{last.global_rank}").write_text("ok")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
