"""Held-out loss of a small byte-level GPT trained with AdamW on 2 CPU ranks, for each comm hook and local SGD.

The text ships with Python itself (``pydoc_data/topics.py``: the language reference's topics), so nothing is
downloaded: 90% trains, the last 10% is held out. Every run has the same seed, model, batches and step count; only
the strategy's sync differs. The held-out loss is in nats per byte, the mean over the held-out set.

    .venv/bin/python benchmarks/transformer_quality.py                       # every variant
    .venv/bin/python benchmarks/transformer_quality.py --variants allreduce,powersgd_r4 --steps 200
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy  # noqa: E402
from lightning_ddpopt.hooks import PowerSGDConfig  # noqa: E402

CONTEXT = 64


def _strategy(variant: str) -> OptimizedDDPStrategy:
    common: dict[str, Any] = {"start_method": "fork"}
    if variant.startswith("powersgd_r"):
        return OptimizedDDPStrategy(comm_hook=PowerSGDConfig(rank=int(variant.removeprefix("powersgd_r"))), **common)
    if variant == "diloco16_overlap":
        return OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(16, overlap_steps=8), **common)
    return OptimizedDDPStrategy(comm_hook=variant, **common)


VARIANTS = ("allreduce", "fp16", "int8", "powersgd_r1", "powersgd_r2", "powersgd_r4", "powersgd_r8", "diloco16_overlap")


def text_bytes() -> torch.Tensor:
    text = "\n".join(pydoc_data.topics.topics.values()).encode("utf-8")
    return torch.tensor(list(text), dtype=torch.long)


class TinyGPT(pl.LightningModule):
    """A causal transformer over bytes: 2 layers, width 128, 4 heads, context 64."""

    def __init__(self, lr: float = 3e-3, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        hidden = self.blocks(hidden, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(hidden))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.cross_entropy(self(inputs).reshape(-1, 256), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def windows(data: torch.Tensor, stride: int) -> TensorDataset:
    starts = torch.arange(0, data.numel() - CONTEXT - 1, stride)
    inputs = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
    targets = torch.stack([data[s + 1 : s + CONTEXT + 1] for s in starts.tolist()])
    return TensorDataset(inputs, targets)


class HeldOut(pl.Callback):
    """Rank 0 writes the held-out loss at the end of fit."""

    def __init__(self, held_out: TensorDataset, out: Path) -> None:
        self.held_out, self.out = held_out, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        pl_module.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in DataLoader(self.held_out, batch_size=256):
                total += float(pl_module.loss(batch)) * batch[0].shape[0]
                count += batch[0].shape[0]
        self.out.write_text(json.dumps({"held_out": total / count}))


def run(variant: str, steps: int, batch_size: int) -> dict[str, Any]:
    data = text_bytes()
    split = int(0.9 * data.numel())
    train, held_out = windows(data[:split], stride=CONTEXT), windows(data[split:], stride=CONTEXT)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy(variant),
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[HeldOut(held_out, out)],
        )
        start = time.perf_counter()
        loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
        trainer.fit(TinyGPT(), loader)
        seconds = time.perf_counter() - start
        return {"variant": variant, "held_out": json.loads(out.read_text())["held_out"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "transformer_quality.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [run(variant, args.steps, args.batch_size) for variant in args.variants.split(",")]
    baseline = next((row["held_out"] for row in rows if row["variant"] == "allreduce"), math.nan)
    lines = [
        f"TinyGPT (2 x width 128, context 64) on Python's pydoc topics, AdamW 3e-3, {args.steps} steps, batch "
        f"{args.batch_size} per rank, 2 CPU ranks; held-out loss in nats per byte",
        "",
        "| variant | held-out loss | vs allreduce | fit s |",
        "|---|---|---|---|",
    ]
    for row in rows:
        change = (row["held_out"] / baseline - 1) * 100 if baseline == baseline else math.nan
        lines.append(f"| {row['variant']} | {row['held_out']:.4f} | {change:+.1f}% | {row['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
