"""Checkpoints against the world size: the file, the shards beside it, and how much a save raises each rank's memory.

A 4.2M-parameter MLP with AdamW (16.8 MB of weights), CPU processes on one machine (spawned), one checkpoint saved
by ``trainer.save_checkpoint`` on every rank after the 4th step, while training. DiLoCo (H = 4, right after a sync)
runs with a replica per rank and with two islands (``replica=world / 2``; 2 ranks: one replica per rank either way);
the int8 comm hook (each rank's own error feedback) with plain DDP.

Run:  .venv/bin/python benchmarks/checkpoint_size.py [--worlds 2,4,8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy

WIDTH, LAYERS, STEPS = 1024, 4, 4


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class SaveAtEnd(pl.Callback):
    """Saves on every rank after the last step, while training (islands still shard their outer state); each rank
    records how much the save raised its peak resident memory."""

    def __init__(self, path: Path, out: Path) -> None:
        self.path, self.out = path, out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: object) -> None:
        if trainer.global_step != STEPS:
            return
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        trainer.save_checkpoint(self.path)
        raised = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out = self.out.with_name(f"{self.out.stem}_rank{trainer.global_rank}.json")
        out.write_text(json.dumps({"peak_raised_kb": raised, "peak_kb": before + raised}))


def measure(world: int, replica: str | int | None, directory: Path) -> dict[str, float]:
    name = f"w{world}_{replica}"
    path, out = directory / f"{name}.ckpt", directory / f"{name}.json"
    strategy = (
        OptimizedDDPStrategy(comm_hook="int8", start_method="spawn")
        if replica is None
        else OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(4, replica=replica), start_method="spawn")
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveAtEnd(path, out)],
    )
    generator, samples = torch.Generator().manual_seed(0), 8 * STEPS * world
    data = TensorDataset(torch.randn(samples, WIDTH, generator=generator), torch.randn(samples, WIDTH))
    trainer.fit(MLP(), DataLoader(data, batch_size=8))
    figures = [json.loads((directory / f"{name}_rank{rank}.json").read_text()) for rank in range(world)]
    raised = [rank["peak_raised_kb"] for rank in figures]
    shards = Path(str(path) + ".ddpopt")
    written = [p.stat().st_size for p in shards.iterdir()] if shards.is_dir() else [0]
    return {
        "file_mb": path.stat().st_size / 1e6,
        "shards_mb": sum(written) / 1e6,
        "largest_shard_mb": max(written) / 1e6,
        "save_peak_raised_mb": raised[0] / 1e3,
        "largest_peak_raised_mb": max(raised) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for world in (int(w) for w in args.worlds.split(",")):
            for replica in (None, "rank", world // 2) if world > 2 else (None, "rank"):
                figures = measure(world, replica, Path(directory))
                variant = "int8 hook" if replica is None else f"DiLoCo, replica={replica!r}"
                rows.append({"world": world, "variant": variant, **figures})
                print(f"world {world}, replica={replica!r}: {figures}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"Checkpoints of a {WIDTH}x{WIDTH} x {LAYERS} MLP ({LAYERS * (WIDTH * WIDTH + WIDTH) / 1e6:.1f}M "
        "parameters), AdamW; saved on every rank after 4 steps. The file is rank 0's; the shards, beside it, hold "
        "what differs per rank, each rank's written by itself. "
        f"Command: `benchmarks/checkpoint_size.py --worlds {args.worlds}`, "
        f"{datetime.datetime.now(datetime.timezone.utc).date().isoformat()}",
        "",
        "| ranks | variant | file MB | shards MB | largest rank's shard MB | rank 0's peak raised by the save, MB "
        "| largest peak raised on any rank, MB |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['world']} | {r['variant']} | {r['file_mb']:.1f} | {r['shards_mb']:.1f} | {r['largest_shard_mb']:.1f} "
        f"| {r['save_peak_raised_mb']:.1f} | {r['largest_peak_raised_mb']:.1f} |"
        for r in rows
    ]
    (out / "checkpoint_size.md").write_text("\n".join(lines) + "\n")
    (out / "checkpoint_size.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
