"""PowerSGD hook micro-benchmark: this package's hook against torch's ``powerSGD_hook``, side by side in one run.

The setting is the one where torch's hook runs on gloo: one bucket (``bucket_cap_mb`` above the gradient size), two
CPU ranks on loopback, one torch thread each, the cluster benchmark's model (6 x Linear(2048, 2048), 25.2M
parameters). Each variant trains ``--steps`` steps after ``--warmup`` untimed ones (PowerSGD starts compressing at
step 2 in both); a variant with a hook that returns the bucket untouched (no communication at all) is the
baseline, so ``hook ms`` = step time minus the baseline's: what the hook adds to a step, maths and waiting.

Ours also reports its own work inside the hook (hook time minus waiting) against a memory floor: the time of one
copy pass over the weight gradients, measured in the same processes, times the passes the algorithm needs
(``PASSES``). The two ranks share this machine's memory and their hooks run at the same time, so the floor is timed
with both ranks copying at once, and with one rank copying alone; and the hook runs once more in a process of its
own (one rank, nothing competing for memory) against a floor timed there. ``ours_torch_kernels`` is ours with
torch's kernels instead of numba's fused loops, side by side.

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
# ours_torch_kernels: ours with torch's kernels (no numba), to show what the fused loops save.
VARIANTS = ("no_comm", "builtin_allreduce", "torch_powersgd", "ours_powersgd", "ours_torch_kernels")
ALONE = ("no_comm", "ours_powersgd")


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
    elif variant in ("ours_powersgd", "ours_torch_kernels"):
        kernels = "blocked" if variant == "ours_torch_kernels" else None  # None: numba where installed
        state = PowerSGDState(config=PowerSGDConfig(rank=rank, start_iter=2), cpu_kernels=kernels)
        state.bind_module(module)
        hook = powersgd_hook
    if hook is not None:
        inner = hook

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks real types
            seen.add(bucket.index())
            return inner(state, bucket)

        model.register_comm_hook(state, counted)
    return state


def _pass_seconds(module: nn.Module, process: int) -> tuple[float, float]:
    """The best of 5 times one read and one write of every weight matrix's gradient bytes (a copy) takes: alone
    (the other rank waiting) and together (both ranks copying at once, as both ranks' hooks run at once here).
    """
    sources = [p.detach().clone() for p in module.parameters() if p.dim() > 1]
    targets = [torch.empty_like(source) for source in sources]

    def best_of_5(synchronised: bool) -> float:
        best = math.inf
        for _ in range(5):
            if synchronised:
                dist.barrier()
            start = time.perf_counter()
            for source, target in zip(sources, targets, strict=True):
                target.copy_(source)
            best = min(best, time.perf_counter() - start)
        return best

    alone = math.inf
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == process:
            alone = best_of_5(synchronised=False)
    dist.barrier()
    return alone, best_of_5(synchronised=True)


def _worker(
    process: int, port: int, args: argparse.Namespace, out: str, world_size: int, variants: tuple[str, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=process, world_size=world_size)
    results = {}
    for variant in variants:
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
            results[variant]["kernels"] = state.kernels()
        if variant == "no_comm":
            results["floor_pass_s"] = _pass_seconds(module, process)
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
        mp.start_processes(_worker, args=(29571, args, out, 2, VARIANTS), nprocs=2, start_method="spawn")
        results = torch.load(out)
        # The same hook in one process (its collectives are local): its own work and the floor, both uncontended.
        mp.start_processes(_worker, args=(29572, args, out, 1, ALONE), nprocs=1, start_method="spawn")
        alone_results = torch.load(out)
    alone, together = results.pop("floor_pass_s")
    base = results["no_comm"]["step_s"]
    print(f"2 ranks (gloo, loopback, 1 thread each), one bucket, 6 x Linear(2048), PowerSGD rank {args.rank}")
    print(f"{'variant':<20}{'step ms':>10}{'hook ms':>10}")
    for variant, result in results.items():
        print(f"{variant:<20}{result['step_s'] * 1e3:>10.1f}{(result['step_s'] - base) * 1e3:>10.1f}")
    ratio = results["torch_powersgd"]["step_s"] / results["ours_powersgd"]["step_s"]
    print(f"torch's step time / ours: {ratio:.2f}")
    for variant in ("ours_torch_kernels", "ours_powersgd"):
        result = results[variant]
        print(
            f"{variant} inside the hook: {result['own_s'] * 1e3:.1f} ms own work + {result['wait_s'] * 1e3:.1f} ms "
            f"waiting per step (CPU kernels: {result['kernels']})"
        )
    ours = results["ours_powersgd"]
    for name, one_pass in (("both ranks copying at once, as their hooks run", together), ("one rank alone", alone)):
        floor = PASSES * one_pass
        print(
            f"  memory floor, {name}: {PASSES} x {one_pass * 1e3:.1f} ms (one copy pass over the weight gradients) = "
            f"{floor * 1e3:.1f} ms; own work / floor: {ours['own_s'] / floor:.2f}"
        )
    single, (single_pass, _) = alone_results["ours_powersgd"], alone_results["floor_pass_s"]
    print(
        f"one process alone (no other rank competing for memory): {single['own_s'] * 1e3:.1f} ms own work; memory "
        f"floor {PASSES} x {single_pass * 1e3:.1f} ms = {PASSES * single_pass * 1e3:.1f} ms; own work / floor: "
        f"{single['own_s'] / (PASSES * single_pass):.2f}"
    )


if __name__ == "__main__":
    main()
