"""One island of a fault-tolerant run as a Fabric loop, started by torchrun (``tests/test_fault_tolerance.py``).

Usage: torchrun --standalone --nproc-per-node M -m tests.ft_fabric_worker ISLAND LIGHTHOUSE OUT [--max-steps N]
    [--step-seconds S] [--overflow-at K] [--local-sgd H]

A hand-written Fabric loop over an MLP with Adam, a per-step LR schedule (healed through the strategy's
``heal_state``), real fp16 autocast with a GradScaler, gradient clipping, the int8 hook inside the island, and a
Monitor with the three measuring callbacks; with ``--local-sgd H`` DiLoCo every H steps across the islands (and no
hook). The loop runs until the strategy's optimizer-step count (which a heal brings) reaches N. With
``--overflow-at K`` this island's loss is inf at the K-th batch: per step, the average across the islands is inf,
so every island's GradScaler skips that step (the islands vote at the clip, before it unscales). The first rank writes
``OUT/islandI.started`` and the step after every batch to ``OUT/islandI.step``; every rank holds at its start while
``OUT/hold_start`` exists and after a batch while ``OUT/hold`` names a step it has reached; at the end each rank
writes its parameters, step, LR, loss scale, the Monitor's figures and the quorum stats to ``OUT/islandI_rankR.pt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import LocalSGDConfig
from lightning_ddpopt.fabric import Monitor, OptimizedDDPStrategy, fp16_mixed_precision
from lightning_ddpopt.fault_tolerance import FaultTolerance
from tests.helpers import WIDTH

SAMPLES = 288  # 3 islands x 2 ranks x 8 samples x 6 batches


def _hold(path: Path, step: int | None = None) -> None:
    while path.exists() and (step is None or ((text := path.read_text()) and step >= int(text))):
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("island", type=int)
    parser.add_argument("lighthouse")
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--overflow-at", type=int, default=0)
    parser.add_argument("--local-sgd", type=int, default=0, metavar="H")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = FaultTolerance(
        islands=3,
        island=args.island,
        lighthouse=args.lighthouse,
        min_replicas=2,
        timeout_s=5.0,
        quorum_timeout_s=60.0,
        connect_timeout_s=5.0,
    )
    local_sgd = LocalSGDConfig.diloco(args.local_sgd) if args.local_sgd else None
    # Per step the int8 hook syncs inside the island; with DiLoCo DDP's own sync does (no warm-up, no hook).
    hook = "int8" if local_sgd is None else None
    strategy = OptimizedDDPStrategy(comm_hook=hook, fault_tolerance=config, local_sgd=local_sgd)
    fabric = Fabric(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        plugins=[fp16_mixed_precision("cpu", init_scale=2.0**10)],
    )
    fabric.launch()
    torch.manual_seed(args.island)  # each island its own model: torchft's first quorum makes them one
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    strategy.heal_state["scheduler"] = scheduler
    monitor = Monitor(fabric, report_dir=args.out / f"island{args.island}")
    # The same data on every island and rank, shuffled: setup_dataloaders gives each rank its shard of the run's.
    data = torch.randn(SAMPLES, WIDTH, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data, torch.arange(SAMPLES)), batch_size=8, shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    epoch, batches_iter = 0, iter(loader)
    samples: list[tuple[int, int, list[int]]] = []
    if fabric.global_rank == 0:
        (args.out / f"island{args.island}.started").write_text("")
    _hold(args.out / "hold_start")
    batches = 0
    while strategy.optimizer_steps < args.max_steps:
        try:
            x, index = next(batches_iter)
        except StopIteration:
            epoch += 1
            batches_iter = iter(loader)  # Fabric sets the sampler's epoch to the count of iter() calls
            x, index = next(batches_iter)
        samples.append((strategy.optimizer_steps, epoch, index.tolist()))
        batches += 1
        with monitor.batch():
            loss = nn.functional.mse_loss(model(x), torch.tanh(x.flip(1)))
            if batches == args.overflow_at:
                loss = loss * float("inf")
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()
        if fabric.global_rank == 0:
            (args.out / f"island{args.island}.step").write_text(str(strategy.optimizer_steps))
        time.sleep(args.step_seconds)
        _hold(args.out / "hold", strategy.optimizer_steps)
    monitor.finish()
    scaler = strategy.grad_scaler
    stats = strategy.fault_tolerance_stats
    torch.save(
        {
            "parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
            "global_step": strategy.optimizer_steps,
            "lr": optimizer.param_groups[0]["lr"],
            "scale": scaler.get_scale() if scaler is not None else None,
            "metrics": monitor.metrics,
            "samples": samples,
            "stats": dataclasses.asdict(stats) if stats is not None else None,
        },
        args.out / f"island{args.island}_rank{fabric.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
