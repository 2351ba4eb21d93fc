"""One island of a fault-tolerant run, as its own Lightning job (``tests/test_fault_tolerance.py`` starts three).

Usage: python -m tests.ft_worker ISLAND LIGHTHOUSE PORT OUT [--max-steps N] [--step-seconds S] [--devices M]
    [--local-sgd H] [--comm-hook NAME] [--ft-compression fp32|fp16|bf16]

As a user runs an island: every island the same script, ``seed_everything(0)``, the same dataset with
``shuffle=True``, its index in ``REPLICA_GROUP_ID`` and ``FaultTolerance(islands=3)``; the strategy gives each rank
its shard of the run's data. Trains StackModel with M ranks, Adam, a per-step and a per-epoch LR schedule,
``OptimizedDDPStrategy(fault_tolerance=...)`` (with ``--local-sgd``: DiLoCo every H steps across the islands) and the
three measuring callbacks; each rank records the samples of every batch it trains on. Its first rank writes the
optimizer step to ``OUT/islandI.step`` after every batch (the test kills the island at a chosen step) and, at the end,
each rank its parameters, step, LR, samples and quorum stats to ``OUT/islandI_rankR.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import (
    AMPMonitor,
    CommProfiler,
    LocalSGDConfig,
    OptimizedDDPStrategy,
    StragglerDetector,
    fp16_mixed_precision,
)
from lightning_ddpopt.fault_tolerance import FaultTolerance
from tests.helpers import WIDTH, StackModel

#: The dataset: 3 islands x 8 samples x 12 batches, an epoch of 12 steps for one-rank islands.
SAMPLES = 288


class _Paced(pl.Callback):
    """Paces the steps and lets the test act between them: the first rank writes ``islandI.started`` at the start
    of training and the step to ``islandI.step`` after each batch; every rank waits at the start while a file
    ``hold_start`` exists, and after a batch while a file ``hold`` exists whose step it has reached."""

    def __init__(self, out: Path, island: int, seconds: float) -> None:
        self.out, self.island, self.seconds = out, island, seconds

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            (self.out / f"island{self.island}.started").write_text("")
        while (self.out / "hold_start").exists():  # until the test has seen every island start
            time.sleep(0.05)

    def on_before_backward(self, trainer: pl.Trainer, *args: object) -> None:
        # ``hold_collective`` holds "STEP ISLAND": at that step that island waits here, before its backward pass
        # (in which the strategy's hook averages the gradients across the islands), while the file exists; the
        # others go into the backward pass and the average (and write islandI.averaging).
        hold = self.out / "hold_collective"
        if (text := _read(hold)) and int(text.split()[0]) == trainer.global_step:
            if int(text.split()[1]) == self.island:
                while hold.exists():
                    time.sleep(0.01)
            elif trainer.global_rank == 0:
                (self.out / f"island{self.island}.averaging").write_text("")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            (self.out / f"island{self.island}.step").write_text(str(trainer.global_step))
        time.sleep(self.seconds)
        hold = self.out / "hold"
        while (text := _read(hold)) and trainer.global_step >= int(text):
            time.sleep(0.05)


def _read(path: Path) -> str:
    """The file's text, or "" if there is none (the test removes it at any time)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


class _Save(pl.Callback):
    """At the end of fit, in each rank (the spawn launcher's ranks too): its parameters, step, LR, GradScaler scale,
    samples and quorum stats to ``OUT/islandI_rankR.pt``."""

    def __init__(self, out: Path, island: int) -> None:
        self.out, self.island = out, island

    def on_fit_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(module, _Scheduled)
        stats = strategy.fault_tolerance_stats if isinstance(strategy, OptimizedDDPStrategy) else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        torch.save(
            {
                "parameters": {name: p.detach().clone() for name, p in module.named_parameters()},
                "global_step": trainer.global_step,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "samples": module.samples,
                "scale": scaler.get_scale() if scaler is not None else None,
                "stats": dataclasses.asdict(stats) if stats is not None else None,
            },
            self.out / f"island{self.island}_rank{trainer.global_rank}.pt",
        )


class _Scheduled(StackModel):
    """StackModel with Adam, a per-step and a per-epoch LR schedule (a heal must bring both schedules' positions and
    the epoch), recording ``(global step, epoch, batch index, sample indices)`` for every batch it trains on."""

    def __init__(self, *args: object, overflow_at: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.samples: list[tuple[int, int, int, list[int]]] = []
        self.overflow_at = overflow_at

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        x, y, index = batch
        self.samples.append((self.trainer.global_step, self.current_epoch, batch_idx, index.tolist()))
        loss = super().training_step((x, y), batch_idx)
        if len(self.samples) == self.overflow_at:  # this island's loss overflows at its K-th batch
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):  # type: ignore[override]
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        per_step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        per_epoch = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        return [optimizer], [{"scheduler": per_step, "interval": "step"}, {"scheduler": per_epoch, "interval": "epoch"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("island", type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("port", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--islands", type=int, default=3)
    parser.add_argument("--start-method", default="popen", help="Lightning's launcher for the island's ranks")
    parser.add_argument("--fp16", action="store_true", help="real fp16 autocast with a GradScaler (scale 2^10)")
    parser.add_argument("--overflow-at", type=int, default=0, metavar="K", help="island 0's loss is inf at batch K")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--local-sgd", type=int, default=0, metavar="H")
    parser.add_argument("--comm-hook", default="allreduce", help="the hook inside the island (a registry name)")
    parser.add_argument("--ft-compression", default="fp32", help="FaultTolerance(compression=...)")
    parser.add_argument("--address", default="127.0.0.1", help="this island's address (MASTER_ADDR)")
    parser.add_argument(
        "--whole-job",
        type=int,
        default=0,
        metavar="NODES",
        help="no fault tolerance: ISLAND is the node rank of one DDP job of NODES nodes, whose first node is at "
        "--address (the restart-from-checkpoint baseline of benchmarks/fault_tolerance.py)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps, resume one")
    parser.add_argument("--stock", action="store_true", help="with --whole-job: Lightning's own DDPStrategy")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR=args.address, MASTER_PORT=str(args.port))
    if args.whole_job:
        os.environ.update(NODE_RANK=str(args.island))
    if not args.whole_job:
        os.environ["REPLICA_GROUP_ID"] = str(args.island)  # as torchft's launchers give each island its index
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    # The same data on every island and rank: the strategy's sampler gives each rank of each island its shard.
    x = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, torch.tanh(x.flip(1)), torch.arange(SAMPLES)), batch_size=8, shuffle=True)
    config = FaultTolerance(
        islands=args.islands,
        lighthouse=args.lighthouse,
        min_replicas=args.min_replicas,
        timeout_s=5.0,
        quorum_timeout_s=60.0,
        connect_timeout_s=5.0,
        compression=args.ft_compression,
    )
    local_sgd = LocalSGDConfig.diloco(args.local_sgd) if args.local_sgd else None
    checkpoints: list[pl.Callback] = []
    # One job's nodes share a checkpoint; each island writes its own.
    saved = args.out / ("checkpoints" if args.whole_job else f"checkpoints{args.island}")
    if args.checkpoint_every:
        every = args.checkpoint_every
        checkpoints = [ModelCheckpoint(saved, every_n_train_steps=every, save_last=True)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.whole_job or 1,
        strategy=DDPStrategy(start_method=args.start_method)
        if args.stock
        else OptimizedDDPStrategy(
            fault_tolerance=None if args.whole_job else config,
            local_sgd=local_sgd,
            start_method=args.start_method,
            comm_hook=args.comm_hook,
        ),
        max_steps=args.max_steps,
        plugins=[fp16_mixed_precision("cpu", init_scale=2.0**10)] if args.fp16 else None,
        callbacks=[
            _Paced(args.out, args.island, args.step_seconds),
            _Save(args.out, args.island),
            CommProfiler(),
            StragglerDetector(),
            AMPMonitor(),
            *checkpoints,
        ],
        logger=False,
        enable_checkpointing=bool(checkpoints),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out / f"island{args.island}"),
    )
    # Each island its own initial model: torchft's first quorum makes them one (each rank from a source island of its
    # own: the island's first rank then realigns the others).
    model = _Scheduled(lr=0.05, seed=args.island, overflow_at=args.overflow_at if args.island == 0 else 0)
    last = saved / "last.ckpt"
    trainer.fit(model, data, ckpt_path=last if args.checkpoint_every and last.exists() else None)


if __name__ == "__main__":
    main()
