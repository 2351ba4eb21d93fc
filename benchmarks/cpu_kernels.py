"""The lossy hooks' own time per step on the CPU, numba's fused loops against torch's kernels, at 1 and 2 threads.

Lightning gives each DDP process cores / local processes torch threads, so on a CPU node a rank often runs more
than one. This measures what int8 and PowerSGD (rank 4, error feedback) cost per step in one process (a 1-rank
gloo group: the collectives are copies, so what remains is the hook's own work), on the cluster benchmark's model
(6 x Linear(2048, 2048), 25.2M parameters, one bucket), for each kernel path and torch thread count, in rounds so
that the variants share the machine's state. ``hook ms`` = step time minus the step time of a hook that returns the
bucket untouched, median over the timed steps; the table gives the median over rounds.

Run:  .venv/bin/python benchmarks/cpu_kernels.py [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_ddpopt.hooks._kernels as kernels
from lightning_ddpopt.hooks import Int8State, PowerSGDConfig, PowerSGDState, int8_hook, powersgd_hook

WIDTH, LAYERS, BATCH = 2048, 6, 32


def _untouched(state, bucket):  # unannotated: DDP checks a hook's annotations, which this module makes strings
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _step_seconds(hook: str, path: str, threads: int, steps: int, warmup: int) -> float:
    torch.set_num_threads(threads)
    kernels.available = (lambda: True) if path == "numba" else (lambda: False)  # int8 reads it per bucket
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model = DistributedDataParallel(module, bucket_cap_mb=1024)
    if hook == "int8":
        state: object = Int8State()
        state.bind_module(module)  # type: ignore[attr-defined]
        model.register_comm_hook(state, int8_hook)
    elif hook == "powersgd":
        cpu_kernels = path if path == "numba" else ("blas" if threads > 1 else "blocked")
        state = PowerSGDState(config=PowerSGDConfig(rank=4, start_iter=2), cpu_kernels=cpu_kernels)
        state.bind_module(module)  # type: ignore[attr-defined]
        model.register_comm_hook(state, powersgd_hook)
    else:
        model.register_comm_hook(None, _untouched)
    x = torch.randn(BATCH, WIDTH)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps (PowerSGD compresses from step 2)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("numba is not installed: pip install 'lightning-ddpopt[cpu-kernels]'")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        variants = [
            (hook, path, threads) for threads in (1, 2) for hook in ("int8", "powersgd") for path in ("numba", "torch")
        ]
        own: dict[tuple[str, str, int], list[float]] = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            base = {threads: _step_seconds("none", "torch", threads, args.steps, args.warmup) for threads in (1, 2)}
            for hook, path, threads in variants:
                seconds = _step_seconds(hook, path, threads, args.steps, args.warmup)
                own[(hook, path, threads)].append(seconds - base[threads])
        dist.destroy_process_group()
    print("| hook | torch threads | numba's loops (ms) | torch's kernels (ms) | torch / numba |\n|---|---|---|---|---|")
    for threads in (1, 2):
        for hook in ("int8", "powersgd"):
            numba = statistics.median(own[(hook, "numba", threads)]) * 1e3
            torch_ms = statistics.median(own[(hook, "torch", threads)]) * 1e3
            print(f"| {hook} | {threads} | {numba:.1f} | {torch_ms:.1f} | {torch_ms / numba:.2f} |")


if __name__ == "__main__":
    main()
