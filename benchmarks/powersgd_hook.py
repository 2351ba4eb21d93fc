"""PowerSGD hook micro-benchmark: this package's hook against torch's ``powerSGD_hook``, side by side in one run.

The setting is the one where torch's hook runs on gloo: one bucket (``bucket_cap_mb`` above the gradient size), two
CPU ranks on loopback, one torch thread each, the cluster benchmark's model (6 x Linear(2048, 2048), 25.2M
parameters). Each variant trains ``--steps`` steps after ``--warmup`` untimed ones (PowerSGD starts compressing at
step 2 in both); a variant with a hook that returns the bucket untouched (no communication at all) is the
baseline, so ``hook ms`` = step time minus the baseline's: what the hook adds to a step, maths and waiting.

Ours also reports its own work inside the hook (hook time minus waiting) against a memory floor: the time of one
copy pass over the weight gradients, measured in the same process, times the passes the algorithm needs (``PASSES``).

Run:  .venv/bin/python benchmarks/powersgd_hook.py [--rank 4] [--steps 12]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt.hooks import PowerSGDConfig, PowerSGDState, powersgd_hook

# PowerSGD with error feedback reads each gradient matrix M four times and its stored error once (add the error,
# P = M Q, Q = M^T P, new error M - P Q^T) and writes M twice and the new error once: 8 one-way traversals, i.e. the
# memory traffic of 4 copies of the gradients. The rank-r products add arithmetic, not traffic.
PASSES = 4
VARIANTS = ("no_comm", "builtin_allreduce", "torch_powersgd", "ours_powersgd")


def _untouched(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _attach(model: DistributedDataParallel, module: nn.Module, variant: str, rank: int, seen: set[int]) -> object:
    """Register the variant's hook (wrapped to note the bucket indices it sees); return its state."""
    state: object = None
    hook = None
    if variant == "no_comm":
        hook = _untouched
    elif variant == "torch_powersgd":
        state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, random_seed=0
        )
        hook = torch_powersgd.powerSGD_hook
    elif variant == "ours_powersgd":
        state = PowerSGDState(config=PowerSGDConfig(rank=rank, start_iter=2))
        state.bind_module(module)
        hook = powersgd_hook
    if hook is not None:
        inner = hook

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks real types
            seen.add(bucket.index())
            return inner(state, bucket)

        model.register_comm_hook(state, counted)
    return state


def _one_pass_seconds(module: nn.Module) -> float:
    """The best of 5 times one read and one write of every weight matrix's gradient bytes (a copy) takes."""
    sources = [p.detach().clone() for p in module.parameters() if p.dim() > 1]
    targets = [torch.empty_like(source) for source in sources]
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for source, target in zip(sources, targets, strict=True):
            target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def _worker(process: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=process, world_size=2)
    results = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        module = nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(2048, 2048), nn.Tanh())])
        model = DistributedDataParallel(module, bucket_cap_mb=1024)
        seen: set[int] = set()
        state = _attach(model, module, variant, args.rank, seen)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        data = torch.Generator().manual_seed(process)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup and isinstance(state, PowerSGDState):
                state.hook_seconds = state.wait_seconds = 0.0
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            model(torch.randn(16, 2048, generator=data)).pow(2).mean().backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        assert len(seen) <= 1, f"{variant}: {len(seen)} buckets; torch's hook needs one on gloo"
        results[variant] = {"step_s": statistics.median(times)}
        if isinstance(state, PowerSGDState):
            results[variant]["own_s"] = (state.hook_seconds - state.wait_seconds) / args.steps
            results[variant]["wait_s"] = state.wait_seconds / args.steps
        if variant == "no_comm":
            results["floor_pass_s"] = _one_pass_seconds(module)
        del model, state  # the reducer must not be the one to destroy the group
    if process == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first (compression starts at step 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.pt")
        mp.start_processes(_worker, args=(29571, args, out), nprocs=2, start_method="spawn")
        results = torch.load(out)
    floor_pass = results.pop("floor_pass_s")
    base = results["no_comm"]["step_s"]
    print(f"2 ranks (gloo, loopback, 1 thread each), one bucket, 6 x Linear(2048), PowerSGD rank {args.rank}")
    print(f"{'variant':<20}{'step ms':>10}{'hook ms':>10}")
    for variant, result in results.items():
        print(f"{variant:<20}{result['step_s'] * 1e3:>10.1f}{(result['step_s'] - base) * 1e3:>10.1f}")
    ratio = results["torch_powersgd"]["step_s"] / results["ours_powersgd"]["step_s"]
    print(f"torch's step time / ours: {ratio:.2f}")
    ours = results["ours_powersgd"]
    floor = PASSES * floor_pass
    print(
        f"ours inside the hook: {ours['own_s'] * 1e3:.1f} ms own work + {ours['wait_s'] * 1e3:.1f} ms waiting "
        "per step; "
        f"memory floor {PASSES} x {floor_pass * 1e3:.1f} ms (one copy pass over the weight gradients) = "
        f"{floor * 1e3:.1f} ms; own work / floor: {ours['own_s'] / floor:.2f}"
    )


if __name__ == "__main__":
    main()
