"""One island of a fault-tolerant run, as its own Lightning job (``tests/test_fault_tolerance.py`` starts three).

Usage: python -m tests.ft_worker ISLAND LIGHTHOUSE PORT OUT [--max-steps N] [--step-seconds S]

Trains StackModel on its own data (seeded by ISLAND) with one rank, ``OptimizedDDPStrategy(fault_tolerance=...)``
and the three measuring callbacks; writes its optimizer step to ``OUT/islandI.step`` after every batch (the test
kills it at a chosen step) and, at the end, its parameters, step and quorum stats to ``OUT/islandI.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.fault_tolerance import FaultTolerance
from tests.helpers import WIDTH, StackModel


class _Paced(pl.Callback):
    """Writes the step after each batch and paces the steps (so that the test can act between them)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.path.write_text(str(trainer.global_step))
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("island", type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("port", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--min-replicas", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(100 + args.island)
    x = torch.randn(64 * args.max_steps, WIDTH, generator=generator)
    data = DataLoader(TensorDataset(x, torch.tanh(x.flip(1))), batch_size=8)
    config = FaultTolerance(
        lighthouse=args.lighthouse,
        min_replicas=args.min_replicas,
        replica_id=f"island{args.island}",
        timeout_s=5.0,
        quorum_timeout_s=60.0,
        connect_timeout_s=5.0,
    )
    profiler = CommProfiler()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=OptimizedDDPStrategy(fault_tolerance=config),
        max_steps=args.max_steps,
        callbacks=[
            _Paced(args.out / f"island{args.island}.step", args.step_seconds),
            profiler,
            StragglerDetector(),
            AMPMonitor(),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out / f"island{args.island}"),
    )
    model = StackModel(lr=0.05, optimizer="adam")
    trainer.fit(model, data)
    strategy = trainer.strategy
    assert isinstance(strategy, OptimizedDDPStrategy) and strategy.fault_tolerance_stats is not None
    torch.save(
        {
            "parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
            "global_step": trainer.global_step,
            "stats": dataclasses.asdict(strategy.fault_tolerance_stats),
        },
        args.out / f"island{args.island}.pt",
    )


if __name__ == "__main__":
    main()
