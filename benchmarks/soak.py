"""Soak test: many short 3-rank CPU DDP runs in a row, every hook and the callbacks, beside a competing CPU load.

Each run is a fresh ``python benchmarks/soak.py --worker`` process that fits a small model on 3 spawned ranks
(``OptimizedDDPStrategy``, 15 steps, ``CommProfiler`` + ``StragglerDetector`` + ``AMPMonitor``, a checkpoint every
7 steps), cycling through the hooks. A run counts as a crash when its process exits non-zero or any rank prints
``terminate called`` (C++ ``std::terminate``, e.g. a thread alive at exit), and as a hang when it outlives
``--timeout`` seconds. With ``--stock`` it runs Lightning's ``DDPStrategy`` instead, for comparison.

Run:  .venv/bin/python benchmarks/soak.py [--runs 50] [--load 1] [--timeout 180]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.hooks import PowerSGDConfig

HOOKS = ("allreduce", "fp16", "bf16", "int8", "powersgd", "powersgd_fp16", "batched_powersgd", "auto")


def _spin(stop_at: float) -> None:
    """Keep one core busy until ``stop_at`` (the competing load)."""
    x = 0
    while time.time() < stop_at:
        x = (x * 31 + 7) % 1_000_003


class Model(pl.LightningModule):
    """Six Linear(128, 128) layers: several buckets at a 0.1 MiB cap."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def worker(hook: str, stock: bool, out: Path) -> None:
    """One run: 3 spawned ranks, 15 steps, the callbacks, checkpoints every 7 steps."""
    comm_hook: object = PowerSGDConfig(start_iter=2) if hook == "powersgd" else hook
    strategy = (
        DDPStrategy(start_method="spawn")
        if stock
        else OptimizedDDPStrategy(comm_hook=comm_hook, bucket_cap_mb=0.1, start_method="spawn")
    )
    data = TensorDataset(torch.randn(3 * 8 * 15, 128), torch.randn(3 * 8 * 15, 128))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=strategy,
        max_steps=15,
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            CommProfiler(every_n_steps=5),
            StragglerDetector(every_n_steps=5),
            AMPMonitor(),
            ModelCheckpoint(dirpath=out, every_n_train_steps=7, save_top_k=-1),
        ],
    )
    trainer.fit(Model(), DataLoader(data, batch_size=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--load", type=int, default=1, help="busy processes competing for the CPU (default 1)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    parser.add_argument("--stock", action="store_true", help="Lightning's DDPStrategy instead of ours")
    parser.add_argument("--hooks", default=",".join(HOOKS), help=f"comma-separated, cycled (default {','.join(HOOKS)})")
    parser.add_argument("--save-failures", metavar="DIR", help="write each failed run's whole output there")
    parser.add_argument("--worker", metavar="HOOK", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.stock, Path(args.out))
        return

    crashes, hangs, started = [], [], time.perf_counter()
    for run in range(args.runs):
        hooks = args.hooks.split(",")
        hook = "stock" if args.stock else hooks[run % len(hooks)]
        stop_at = time.time() + args.timeout
        load = [multiprocessing.Process(target=_spin, args=(stop_at,), daemon=True) for _ in range(args.load)]
        for process in load:
            process.start()
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, __file__, "--worker", hook, "--out", out, *(["--stock"] if args.stock else [])]
            try:
                # Python stacks of every thread on a fatal signal, in each rank, for a crash's post-mortem.
                env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
                result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
                output = result.stdout + result.stderr
                if result.returncode != 0 or "terminate called" in output:
                    tail = " | ".join(output.strip().splitlines()[-3:])
                    if args.save_failures:
                        Path(args.save_failures).mkdir(parents=True, exist_ok=True)
                        (Path(args.save_failures) / f"run{run + 1}-{hook}.log").write_text(output)
                    crashes.append(f"run {run + 1} ({hook}): exit {result.returncode}: {tail}")
                    verdict = "CRASH"
                else:
                    verdict = "ok"
            except subprocess.TimeoutExpired:
                hangs.append(f"run {run + 1} ({hook})")
                verdict = "HANG"
        for process in load:
            process.kill()
        print(f"run {run + 1:3d}/{args.runs} {hook:17s} {verdict}", flush=True)
    minutes = (time.perf_counter() - started) / 60
    print(f"\nruns {args.runs}, crashes {len(crashes)}, hangs {len(hangs)} ({minutes:.1f} min, load {args.load})")
    for line in crashes + hangs:
        print(f"  {line}")
    sys.exit(1 if crashes or hangs else 0)


if __name__ == "__main__":
    main()
