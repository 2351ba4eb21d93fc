"""Train an MLP on scikit-learn's digits with 2 CPU processes, OptimizedDDPStrategy, the measuring callbacks and
a CSV logger; prints what the strategy did, the findings, and the held-out accuracy.

Run:  python examples/train_digits.py [--hook fp16] [--devices 2] [--epochs 10] [--no-callbacks]
      python examples/train_digits.py --epochs 1 --stall-rank 1    # see the diagnosis find a straggler
      python examples/train_digits.py --epochs 1 --stall-rank 0 --stall-phase backward
      python examples/train_digits.py --local-sgd 16                 # DiLoCo: parameters synced every 16 steps
      python examples/train_digits.py --local-sgd 16 --local-sgd-overlap 8 --local-sgd-compression int8
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
import warnings

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import default_collate

from lightning_ddpopt import (
    COMM_HOOKS,
    AMPMonitor,
    CommProfiler,
    LocalSGDConfig,
    OptimizedDDPStrategy,
    StragglerDetector,
)
from lightning_ddpopt.units import format_bytes

# Lightning 2.6 calls a pytree check that torch 2.13 deprecates; the warning is Lightning's, not actionable here, and
# every rank printed it.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1797 8x8 digits, scaled to [0, 1], split 80/20 with a fixed permutation."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitsClassifier(pl.LightningModule):
    """A 64 -> hidden -> hidden -> 10 MLP with torchmetrics accuracy."""

    def __init__(self, hidden: int = 1024, lr: float = 1e-3, stall: tuple[int, str, float] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["stall"])
        self.stall = stall  # demo: (rank, "forward" | "backward" | "optimizer", seconds)
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )
        self.test_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self._stall("forward")
        loss = nn.functional.cross_entropy(self(x), y)
        if self._stalls("backward"):
            loss.register_hook(lambda grad: (self._stall("backward"), grad)[1])  # runs inside the backward pass
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._stall("optimizer")

    def _stalls(self, phase: str) -> bool:
        return self.stall is not None and self.stall[:2] == (self.global_rank, phase)

    def _stall(self, phase: str) -> None:
        if self.stall is not None and self._stalls(phase):
            time.sleep(self.stall[2])

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self(x), y)
        self.log("test_accuracy", self.test_accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class StalledCollate:
    """Collates a batch, sleeping first on one rank: a data-loading straggler for StragglerDetector to find."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def __call__(self, samples: list) -> list[torch.Tensor]:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == self.rank:
            time.sleep(self.seconds)
        return default_collate(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hook", choices=sorted(COMM_HOOKS), help="comm hook (default: fp16; allreduce for --local-sgd's warm-up)"
    )
    parser.add_argument("--bucket-cap-mb", default="auto", help="bucket cap in MiB or 'auto' (default)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--log-dir", default="runs")
    parser.add_argument("--no-callbacks", action="store_true", help="train without the measuring callbacks")
    parser.add_argument("--stall-rank", type=int, help="demo: make this rank slow (see --stall-phase)")
    parser.add_argument(
        "--stall-phase",
        default="data",
        choices=("data", "forward", "backward", "optimizer"),
        help="where the stalled rank is slow (default: data loading)",
    )
    parser.add_argument("--stall-ms", type=float, default=200.0, help="the stall per batch (default 200 ms)")
    parser.add_argument(
        "--local-sgd", type=int, metavar="H", help="DiLoCo: no gradient syncs, parameters synced every H steps"
    )
    parser.add_argument("--local-sgd-warmup", type=int, default=0, metavar="N", help="synchronous steps first")
    parser.add_argument(
        "--local-sgd-overlap", type=int, default=0, metavar="TAU", help="steps a sync travels while training goes on"
    )
    parser.add_argument(
        "--local-sgd-compression",
        choices=("fp32", "fp16", "bf16", "int8"),
        default="fp16",
        help="how the parameter change travels (default fp16, DiLoCo's)",
    )
    args = parser.parse_args()
    bucket_cap = args.bucket_cap_mb if args.bucket_cap_mb == "auto" else float(args.bucket_cap_mb)

    pl.seed_everything(0, workers=True)
    train, test = digits_split()
    local_sgd = None
    if args.local_sgd is not None:
        local_sgd = LocalSGDConfig.diloco(
            args.local_sgd,
            warmup_steps=args.local_sgd_warmup,
            overlap_steps=args.local_sgd_overlap,
            compression=args.local_sgd_compression,
        )
    hook = args.hook or ("allreduce" if local_sgd is not None else "fp16")
    strategy = OptimizedDDPStrategy(comm_hook=hook, bucket_cap_mb=bucket_cap, local_sgd=local_sgd)
    csv = CSVLogger(args.log_dir, name="digits")
    loggers: list[Logger] = [csv]
    if importlib.util.find_spec("tensorboard") is not None:  # the same run directory: scalars, layout, findings
        loggers.append(TensorBoardLogger(args.log_dir, name="digits", version=csv.version, default_hp_metric=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=loggers,
        enable_checkpointing=False,
        log_every_n_steps=10,
        callbacks=[] if args.no_callbacks else [CommProfiler(probe_link=True), StragglerDetector(), AMPMonitor()],
    )
    stalled = args.stall_rank is not None
    model_stall = (args.stall_rank, args.stall_phase, args.stall_ms / 1e3) if stalled else None
    model = DigitsClassifier(stall=model_stall if args.stall_phase != "data" else None)
    collate = StalledCollate(args.stall_rank, args.stall_ms / 1e3) if stalled and args.stall_phase == "data" else None
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate))
    ledger = strategy.ledger
    if trainer.is_global_zero and ledger is not None and ledger.total_steps:
        steps = ledger.total_steps
        sent = f"{format_bytes(ledger.total_wire_bytes / steps)}" if ledger.total_wire_bytes else "not recorded"
        print(
            f"ddpopt summary: hook {strategy.comm_hook_name}, buckets "
            f"[{', '.join(format_bytes(b) for b in strategy.bucket_layout or ())}], {steps} optimizer steps, "
            f"{ledger.total_sync_rounds / steps:.2f} sync rounds/step, "
            f"{format_bytes(ledger.total_logical_bytes / steps)} of gradients/step, {sent} sent/step, "
            f"{sum(s.sync_time_s for s in ledger.steps) / len(ledger.steps) * 1e3:.2f} ms sync/step, of which "
            f"{sum(s.exposed_time_s for s in ledger.steps) / len(ledger.steps) * 1e3:.2f} ms exposed "
            f"(rank 0's means over all {steps} steps, warm-up included)"
            + (
                f"; local SGD: {strategy.local_sgd.syncs} parameter syncs, every {strategy.local_sgd.sync_every}"
                f" steps{', then the final average' if strategy.local_sgd.averaged_at_end else ''}"
                if strategy.local_sgd is not None
                else ""
            )
        )
    # Test on one process, as Lightning recommends: under DDP a DistributedSampler would pad the held-out set so that
    # every rank gets the same number of batches, and some digits would count twice.
    if torch.distributed.is_initialized():
        gc.collect()  # the group's threads are joined when its last reference goes: collect cycles holding it first
        torch.distributed.destroy_process_group()
    if not trainer.is_global_zero:
        return
    tester = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    results = tester.test(model, DataLoader(test, batch_size=args.batch_size), verbose=False)
    print(f"test accuracy: {results[0]['test_accuracy']:.4f} ({len(test)} held-out digits)")
    print(f"metrics: {trainer.logger.log_dir}/metrics.csv")
    if len(loggers) > 1:
        print(
            f"TensorBoard (ddpopt charts under Custom Scalars, findings under Text): "
            f".venv/bin/tensorboard --logdir {args.log_dir}"
        )
    if not args.no_callbacks:
        print(f"plot the run: .venv/bin/ddpopt report {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
