"""Overhead of CommProfiler + StragglerDetector on the example's step time, measured side by side.

Trains the digits example (2 CPU processes, fp16 hook) alternately without and with the callbacks, ``--rounds``
times each, and compares the median optimizer-step time measured by the same minimal timer in every run.

Run:  .venv/bin/python benchmarks/profiler_overhead.py [--epochs 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_ddpopt import CommProfiler, OptimizedDDPStrategy, StragglerDetector

_spec = importlib.util.spec_from_file_location("train_digits", Path(__file__).parents[1] / "examples/train_digits.py")
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
sys.modules["train_digits"] = example
_spec.loader.exec_module(example)


class StepTimer(pl.Callback):
    """Median time between consecutive training-batch ends on rank 0, printed at the end of fit."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            print(f"RESULT {self.label} {statistics.median(self.times) * 1e3:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    train, _ = example.digits_split()
    for _ in range(args.rounds):
        for label in ("without", "with"):
            callbacks: list[pl.Callback] = [StepTimer(label)]
            if label == "with":
                callbacks += [CommProfiler(report=False), StragglerDetector()]
            pl.seed_everything(0, verbose=False)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=OptimizedDDPStrategy(comm_hook="fp16", start_method="fork"),
                max_epochs=args.epochs,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=callbacks,
            )
            trainer.fit(example.DigitsClassifier(), DataLoader(train, batch_size=32, shuffle=True))


if __name__ == "__main__":
    main()
