"""What fp16 and bf16 autocast cost on a CPU: training step time of the quickstart's model against fp32.

One process, one torch thread, the README quickstart's MLP (32 -> 512 -> 512 -> 1, AdamW, batch 64). Each round
times ``--steps`` steps of every precision, interleaved; the figure is the median over ``--rounds`` rounds of each
precision's mean step, and its ratio to fp32's. fp16 runs as ``fp16_mixed_precision("cpu")`` does: autocast to
float16 with a GradScaler; bf16 as ``precision="bf16-mixed"`` does: autocast to bfloat16 without one.

Run:  .venv/bin/python benchmarks/cpu_amp.py [--rounds 3] [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn


def step_seconds(precision: str, steps: int, seed: int = 0) -> float:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    x = torch.randn(64, 32)
    y = x.sin().sum(dim=1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        context = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
        with context:
            loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    precisions = ("fp32", "fp16", "bf16")
    for precision in precisions:  # warm-up: first calls compile and allocate
        step_seconds(precision, 3)
    rounds: dict[str, list[float]] = {precision: [] for precision in precisions}
    for _ in range(args.rounds):
        for precision in precisions:
            rounds[precision].append(step_seconds(precision, args.steps))
    base = statistics.median(rounds["fp32"])
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} interleaved rounds of {args.steps} steps")
    print("| precision | step (ms) | spread (ms) | x fp32 |")
    print("|---|---|---|---|")
    for precision, values in rounds.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}"
        print(f"| {precision} | {median * 1e3:.2f} | {spread} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
