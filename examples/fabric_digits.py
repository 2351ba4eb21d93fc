"""Train an MLP on scikit-learn's digits with Lightning Fabric: 2 CPU processes, the Fabric OptimizedDDPStrategy and
its Monitor (the measuring callbacks in a hand-written loop); prints the findings and the held-out accuracy.

Run:  python examples/fabric_digits.py [--hook powersgd] [--devices 2] [--epochs 5] [--accumulate 2]
      python examples/fabric_digits.py --local-sgd 16                 # DiLoCo: parameters synced every 16 steps
      python examples/fabric_digits.py --epochs 4 --resume            # go on from the last run's checkpoint
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import digits_split  # noqa: E402 (the same data as the Trainer example)

from lightning_ddpopt import COMM_HOOKS, LocalSGDConfig  # noqa: E402
from lightning_ddpopt.fabric import Monitor, OptimizedDDPStrategy  # noqa: E402

warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def train(fabric: Fabric, args: argparse.Namespace, checkpoint: str) -> None:
    """Train up to ``args.epochs`` epochs (from ``checkpoint``'s with ``--resume``), then save ``checkpoint``."""
    fabric.seed_everything(0)
    train_set, _ = digits_split()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=args.batch_size, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.resume:
        fabric.load(checkpoint, state)  # the hook's and local SGD's state come back too
    monitor = Monitor(fabric)  # 1: after fabric.setup
    for epoch in range(state["epoch"], args.epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        for index, (x, y) in enumerate(loader):
            last_micro_batch = (index + 1) % args.accumulate == 0 or index + 1 == len(loader)
            with monitor.batch((x, y)):  # 2: around each (micro-)batch's work
                with fabric.no_backward_sync(model, enabled=not last_micro_batch):
                    loss = nn.functional.cross_entropy(model(x), y) / args.accumulate
                    fabric.backward(loss)
                if last_micro_batch:
                    optimizer.step()
                    optimizer.zero_grad()
    report = monitor.finish()  # 3: findings, report, local SGD's final average
    fabric.save(checkpoint, {**state, "epoch": args.epochs})
    if report is not None:
        print(f"plot the run: .venv/bin/ddpopt report {report.parent}")


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hook", choices=sorted(COMM_HOOKS), default="fp16", help="comm hook (default: fp16)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--local-sgd", type=int, metavar="H", help="DiLoCo: parameters synced every H steps")
    parser.add_argument("--resume", action="store_true", help="go on from the last run's checkpoint")
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args()

    local_sgd = LocalSGDConfig.diloco(args.local_sgd) if args.local_sgd else None
    strategy = OptimizedDDPStrategy(comm_hook="allreduce" if local_sgd else args.hook, local_sgd=local_sgd)
    fabric = Fabric(
        accelerator="cpu", devices=args.devices, strategy=strategy, loggers=CSVLogger(args.log_dir, "fabric_digits")
    )
    fabric.launch()
    checkpoint = os.path.join(args.log_dir, "fabric_digits.ckpt")
    train(fabric, args, checkpoint)
    if fabric.is_global_zero:
        _, test_set = digits_split()
        model, _ = _model_and_optimizer()
        model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
        x, y = test_set.tensors
        with torch.no_grad():
            accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
        print(f"held-out accuracy: {accuracy:.3f} ({len(y)} digits)")


if __name__ == "__main__":
    main()
