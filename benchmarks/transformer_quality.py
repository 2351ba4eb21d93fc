"""Held-out loss of a small byte-level GPT trained with AdamW on 2 CPU ranks, for each comm hook and local SGD.

The text ships with Python itself (``pydoc_data/topics.py``: the language reference's topics), so nothing is
downloaded: 90% trains, the last 10% is held out. Every run has the same seed, model, batches and step count; only
the strategy's sync differs. The held-out loss is in nats per byte, the mean over the held-out set.

    .venv/bin/python benchmarks/transformer_quality.py                       # every variant, AdamW
    .venv/bin/python benchmarks/transformer_quality.py --optimizer sgd --out ...   # SGD with Nesterov momentum
    .venv/bin/python benchmarks/transformer_quality.py --variants allreduce,powersgd_r4 --steps 200

Variants: a registry hook's name (``allreduce``, ``fp16``, ``int8``, ``auto``, ``powersgd``: the default PowerSGD,
whose rank rises while its error is above its bound, 0.6 with AdamW and 0.9 with SGD);
``powersgd_r<rank>[_s<start_iter>]`` (a fixed rank); ``localsgd<H>`` (parameter averaging every H steps);
``diloco<H>[_overlap[<tau>]][_int8|_fp32][_ranks|_replica<k>][_lr<x>][_m<x>][_a<alpha>][_w<steps>]``
(:func:`diloco_config`; ``_replica<k>``: islands of k ranks, with ``--devices`` above 2).

    .venv/bin/python benchmarks/transformer_quality.py --devices 4 --variants allreduce,diloco16,diloco16_replica2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pydoc_data.topics
import re
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
from lightning_ddpopt.hooks import PowerSGDConfig, PowerSGDState  # noqa: E402
from lightning_ddpopt.ledger import local_drift  # noqa: E402
from lightning_ddpopt.units import format_bytes  # noqa: E402

CONTEXT = 64


def _strategy(variant: str) -> OptimizedDDPStrategy:
    common: dict[str, Any] = {"start_method": "fork"}
    if variant.startswith("powersgd_r"):
        # powersgd_r<rank>[_s<start_iter>]: a fixed rank (the default, "powersgd", raises it to bound the error)
        rank, _, start = variant.removeprefix("powersgd_r").partition("_s")
        config = PowerSGDConfig(rank=int(rank), max_error=None, **({"start_iter": int(start)} if start else {}))
        return OptimizedDDPStrategy(comm_hook=config, **common)
    if variant.startswith("localsgd"):  # localsgd<H>: plain averaging of the parameters every H steps
        config = LocalSGDConfig.post_local_sgd(int(variant.removeprefix("localsgd")))
        return OptimizedDDPStrategy(local_sgd=config, **common)
    if variant.startswith("diloco"):
        return OptimizedDDPStrategy(local_sgd=diloco_config(variant), **common)
    return OptimizedDDPStrategy(comm_hook=variant, **common)


def diloco_config(variant: str) -> LocalSGDConfig:
    """``diloco<H|auto>[_overlap[<tau>]][_int8|_fp32][_ranks|_replica<k>][_lr<x>][_m<x>][_a<x>][_w<n>]`` as a config.

    DiLoCo every H steps (or ``auto``); overlapped by tau steps (H/2 when not given); the parameter change in int8 or
    fp32 (fp16 by default); a replica per rank, or islands of k ranks (else ``replica="auto"``: a replica per node
    where there are several nodes); the outer learning rate and momentum (``diloco()``'s otherwise); the overlap's
    mixing ``alpha`` (0.5 otherwise); ``n`` synchronous warm-up steps first.
    """
    match = re.fullmatch(
        r"diloco(\d+|auto)(_overlap(\d*))?(?:_(int8|fp32))?(?:(_ranks)|_replica(\d+))?(?:_lr(\d*\.?\d+))?(?:_m(\d*\.?\d+))?"
        r"(?:_a(\d*\.?\d+))?(?:_w(\d+))?",
        variant,
    )
    if match is None:
        raise ValueError(
            f"variant {variant!r} is not "
            "diloco<H>[_overlap[<tau>]][_int8|_fp32][_ranks|_replica<k>][_lr<x>][_m<x>][_a<alpha>][_w<warm-up>]"
        )
    every, overlapped, overlap, compression, ranks, replica, lr, momentum, mixing, warmup = match.groups()
    overrides: dict[str, Any] = {"replica": "rank" if ranks else int(replica) if replica else "auto"}
    if overlapped:
        overrides["overlap_steps"] = int(overlap) if overlap else (16 if every == "auto" else int(every)) // 2
    if compression:
        overrides["compression"] = compression
    if lr:
        overrides["outer_lr"] = float(lr)
    if momentum:
        overrides["outer_momentum"] = float(momentum)
        overrides["nesterov"] = float(momentum) > 0  # _m0: no momentum, so no Nesterov
    if mixing:
        overrides["overlap_mixing"] = float(mixing)
    if warmup:
        overrides["warmup_steps"] = int(warmup)
    return LocalSGDConfig.diloco(every if every == "auto" else int(every), **overrides)


VARIANTS = (
    "allreduce",
    "fp16",
    "bf16",
    "int8",
    "auto",
    "powersgd",
    "powersgd_r1",
    "powersgd_r2",
    "powersgd_r4",
    "powersgd_r8",
    "powersgd_r16",
    "powersgd_r32",
    "localsgd4",
    "localsgd8",
    "diloco16",
    "diloco16_overlap",
)


def text_bytes() -> torch.Tensor:
    text = "\n".join(pydoc_data.topics.topics.values()).encode("utf-8")
    return torch.tensor(list(text), dtype=torch.long)


class TinyGPT(pl.LightningModule):
    """A causal transformer over bytes: 2 layers, width 128, 4 heads, context 64."""

    def __init__(
        self,
        lr: float = 3e-3,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        optimizer: str = "adamw",
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr, self.optimizer = lr, optimizer
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
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def windows(data: torch.Tensor, stride: int) -> TensorDataset:
    starts = torch.arange(0, data.numel() - CONTEXT - 1, stride)
    inputs = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
    targets = torch.stack([data[s + 1 : s + CONTEXT + 1] for s in starts.tolist()])
    return TensorDataset(inputs, targets)


class HeldOut(pl.Callback):
    """Rank 0 writes the held-out loss at the end of fit, and its mean compression error over the measured steps."""

    def __init__(self, held_out: TensorDataset, out: Path) -> None:
        self.held_out, self.out = held_out, out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.ledger.error_every = 5

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        pl_module.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in DataLoader(self.held_out, batch_size=256):
                total += float(pl_module.loss(batch)) * batch[0].shape[0]
                count += batch[0].shape[0]
        steps = trainer.strategy.ledger.steps
        errors = [s.compression_error for s in steps if s.compression_error is not None]
        feedback = [s.error_feedback for s in steps if s.error_feedback is not None]
        drift = [s.drift_ratio for s in steps if s.drift_ratio is not None]
        last = list(steps)[-50:]  # after PowerSGD's rank has settled
        state = trainer.strategy.comm_state
        ranks = state.ranks if isinstance(state, PowerSGDState) else None
        self.out.write_text(
            json.dumps(
                {
                    "held_out": total / count,
                    "error": sum(errors) / len(errors) if errors else math.nan,
                    "error_feedback": sum(feedback) / len(feedback) if feedback else math.nan,
                    "drift_ratio": sum(drift) / len(drift) if drift else math.nan,
                    "bytes_per_step": sum(s.wire_bytes or 0 for s in last) / len(last),
                    "rank": ranks.highest if ranks is not None else None,
                    "lowest_rank": ranks.lowest if ranks is not None else None,
                    "rises": sum(c.new > c.old for c in ranks.changes) if ranks is not None else 0,
                    "falls": sum(c.new < c.old for c in ranks.changes) if ranks is not None else 0,
                }
            )
        )


def run(
    variant: str, steps: int, batch_size: int, optimizer: str, lr: float, devices: int = 2, seed: int = 0
) -> dict[str, Any]:
    """One fit; ``seed`` draws the initial weights and the batches' order (the same on every rank)."""
    data = text_bytes()
    split = int(0.9 * data.numel())
    train, held_out = windows(data[:split], stride=CONTEXT), windows(data[split:], stride=CONTEXT)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        pl.seed_everything(seed, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=_strategy(variant),
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[HeldOut(held_out, out)],
        )
        start = time.perf_counter()
        loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
        trainer.fit(TinyGPT(lr=lr, optimizer=optimizer, seed=seed), loader)
        seconds = time.perf_counter() - start
        return {"variant": variant, **json.loads(out.read_text()), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--devices", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: Nesterov momentum 0.9")
    parser.add_argument("--lr", type=float, default=None, help="default: 3e-3 for adamw, 0.1 for sgd")
    parser.add_argument("--seeds", default="0", help="comma-separated; the held-out loss is the mean over them")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "transformer_quality.md")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    torch.set_num_threads(1)
    lr = args.lr if args.lr is not None else (3e-3 if args.optimizer == "adamw" else 0.1)
    rows = []
    for variant in args.variants.split(","):
        runs = [run(variant, args.steps, args.batch_size, args.optimizer, lr, args.devices, seed) for seed in seeds]
        losses = [r["held_out"] for r in runs]
        rows.append({**runs[0], "held_out": sum(losses) / len(losses), "held_out_seeds": losses})
    optimizer_name = "AdamW" if args.optimizer == "adamw" else "SGD with Nesterov momentum 0.9"
    baseline = next((row["held_out"] for row in rows if row["variant"] == "allreduce"), math.nan)
    lines = [
        f"TinyGPT (2 x width 128, context 64) on Python's pydoc topics, {optimizer_name} {lr:g}, {args.steps} "
        f"steps, batch {args.batch_size} per rank, {args.devices} CPU ranks; held-out loss in nats per byte"
        + (f", the mean over seeds {args.seeds} (each seed's in the last column)" if len(seeds) > 1 else ""),
        "",
        f"Command: `{' '.join(['benchmarks/transformer_quality.py', *sys.argv[1:]])}`",
        f"Run {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores, one torch thread per rank. Compression error: "
        "the mean over every 5th step of rank 0's relative error (local SGD: the drift of the ranks' changes at a "
        "sync); ranks: PowerSGD's matrices' lowest-highest at the end, and its rises / falls of a matrix's rank; sent "
        "per step: rank 0's mean over the last 50 steps.",
        "",
        "| variant | held-out loss | vs allreduce | compression error | error fed back | ranks (rises / falls) "
        "| sent per step | fit s |" + (" per seed |" if len(seeds) > 1 else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if len(seeds) > 1 else ""),
    ]
    for row in rows:
        change = (row["held_out"] / baseline - 1) * 100 if baseline == baseline else math.nan
        rank = "-"
        if row["rank"] is not None:
            rank = str(row["rank"]) if row["lowest_rank"] == row["rank"] else f"{row['lowest_rank']}-{row['rank']}"
        if row["rises"] or row["falls"]:
            rank += f" ({row['rises']} / {row['falls']})"
        error = "-" if math.isnan(row["error"]) else f"{row['error']:.3f}"
        fed_back = "-" if math.isnan(row["error_feedback"]) else f"{row['error_feedback']:.3f}"
        if not math.isnan(row["drift_ratio"]):
            error = f"drift {local_drift([row['drift_ratio']]):.2f}"
        lines.append(
            f"| {row['variant']} | {row['held_out']:.4f} | {change:+.1f}% | {error} | {fed_back} | {rank} | "
            f"{format_bytes(row['bytes_per_step'])} | {row['seconds']:.0f} |"
            + (f" {', '.join(f'{x:.4f}' for x in row['held_out_seeds'])} |" if len(seeds) > 1 else "")
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
