"""K-step accumulation with manual optimization: ``strategy.accumulate`` against a loop that syncs every micro-batch.

Runs both side by side, twice each, on 2 CPU processes (gloo) and prints sync rounds, gradient bytes and median
sync time per optimizer step from each run's ledger.

Run:  .venv/bin/python benchmarks/accumulation.py [--every 4] [--samples 640]
"""

from __future__ import annotations

import argparse
import statistics

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import OptimizedDDPStrategy


class ManualAccumulation(pl.LightningModule):
    """Six Linear(256, 256) layers trained with manual K-step accumulation."""

    def __init__(self, every: int, use_accumulate: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.every, self.use_accumulate = every, use_accumulate
        self.net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        if self.use_accumulate:
            with self.trainer.strategy.accumulate(every=self.every) as step:
                self.manual_backward(nn.functional.mse_loss(self.net(x), y) / step.every)
            should_step = step.should_step
        else:
            self.manual_backward(nn.functional.mse_loss(self.net(x), y) / self.every)
            should_step = (batch_idx + 1) % self.every == 0 or batch_idx + 1 == self.trainer.num_training_batches
        if should_step:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LedgerReport(pl.Callback):
    def __init__(self, label: str) -> None:
        self.label = label

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = list(trainer.strategy.ledger.steps)[2:]  # after DDP's bucket rebuild
        if trainer.global_rank == 0:
            print(
                f"{self.label:24s} {len(steps):3d} steps  "
                f"{statistics.mean(s.sync_rounds for s in steps):.2f} sync rounds/step  "
                f"{statistics.mean(s.logical_bytes for s in steps) / 1e6:.2f} MB/step  "
                f"{statistics.median(s.sync_time_s for s in steps) * 1e3:.1f} ms sync/step (median)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--samples", type=int, default=640)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 256, generator=generator), torch.randn(args.samples, 256))
    for label, use_accumulate in [("accumulate()", True), ("sync every micro-batch", False)] * 2:
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=OptimizedDDPStrategy(start_method="fork"),
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[LedgerReport(label)],
        )
        trainer.fit(ManualAccumulation(args.every, use_accumulate), DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
