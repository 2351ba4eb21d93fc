"""How much of each hook's time the backward pass hides on a GPU, measured with CUDA events.

For each hook: the step time (forward + backward, up to DDP's end-of-backward wait) with the hook, the same step with
a hook that does nothing (compute alone), and the hook's own device time (the ledger's sync time: first bucket
handed to the hook until the last bucket's future is done). ``hidden = 1 - (step - compute) / hook``: 1 when the
hook ran entirely beside the backward pass, 0 when the backward pass waited for all of it.

    python benchmarks/gpu_overlap.py                      # NCCL, one rank on GPU 0
    python benchmarks/gpu_overlap.py --peers 2            # two ranks on GPU 0 over gloo: real peers, host transfers
    python benchmarks/gpu_overlap.py --peers 2 --backend nccl   # two ranks on two GPUs over NCCL

Needs a CUDA build of torch and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_ddpopt._groups import destroy_all_groups  # noqa: E402
from lightning_ddpopt.hooks import COMM_HOOKS, Int8Config, PowerSGDConfig  # noqa: E402
from lightning_ddpopt.hooks.registry import int8_spec, powersgd_spec  # noqa: E402
from lightning_ddpopt.ledger import CommLedger  # noqa: E402
from lightning_ddpopt.timing import timeline_for  # noqa: E402

HOOKS = ("allreduce", "fp16", "int8", "powersgd")


def _spec(name: str) -> Any:
    if name == "int8":
        return int8_spec(Int8Config())
    if name == "powersgd":
        return powersgd_spec(PowerSGDConfig(rank=4, start_iter=2))
    return COMM_HOOKS[name]


def _noop(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[bucket.buffer().device])
    future.set_result(bucket.buffer())
    return future


def _time_steps(name: str | None, device: torch.device, steps: int, width: int, layers: int) -> tuple[float, float]:
    """Median step ms (CUDA events) and median hook ms (ledger) with hook ``name`` (``None``: the no-op hook)."""
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    model = DistributedDataParallel(module, device_ids=[device.index], bucket_cap_mb=25)
    ledger = CommLedger(timeline=timeline_for(device))
    if name is None:
        model.register_comm_hook(None, _noop)
    else:
        spec = _spec(name)
        state = spec.build(None, ledger)
        if hasattr(state, "bind_module"):
            state.bind_module(module)
        model.register_comm_hook(state, ledger.record_hook(spec.hook))
    x = torch.randn(64, width, device=device)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(x).square().mean().backward()
        end.record()
        model.zero_grad(set_to_none=False)
        ledger.close_step()
        times.append((start, end))
    torch.cuda.synchronize()
    ledger.flush()
    warm = max(steps // 3, 3)
    step_ms = statistics.median(s.elapsed_time(e) for s, e in times[warm:])
    syncs = [record.sync_time_s * 1e3 for record in list(ledger.steps)[warm:]]
    return step_ms, statistics.median(syncs) if syncs else 0.0


def _rank(
    rank: int, world: int, backend: str, port: int, hooks: list[str], steps: int, width: int, layers: int, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    rows = []
    compute_ms, _ = _time_steps(None, device, steps, width, layers)
    for name in hooks:
        step_ms, hook_ms = _time_steps(name, device, steps, width, layers)
        exposed = max(step_ms - compute_ms, 0.0)
        hidden = min(max(1 - exposed / hook_ms, 0.0), 1.0) if hook_ms > 0 else None
        rows.append(
            {
                "hook": name,
                "step_ms": step_ms,
                "compute_ms": compute_ms,
                "hook_ms": hook_ms,
                "exposed_ms": exposed,
                "hidden": hidden,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    destroy_all_groups()


def measure(
    hooks: list[str], steps: int = 20, width: int = 2048, layers: int = 8, peers: int = 1, backend: str = "nccl"
) -> list[dict[str, Any]]:
    """One row per hook (see the module doc); ``peers`` ranks (gloo: all on GPU 0; nccl: one GPU each)."""
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rows.json")
        port = 29600 + os.getpid() % 300
        if peers == 1:
            _rank(0, 1, backend, port, hooks, steps, width, layers, out)
        else:
            args = (peers, backend, port, hooks, steps, width, layers, out)
            mp.start_processes(_rank, args=args, nprocs=peers, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hooks", default=",".join(HOOKS))
    parser.add_argument("--peers", type=int, default=1)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    backend = args.backend or ("nccl" if args.peers == 1 else "gloo")
    rows = measure(args.hooks.split(","), args.steps, args.width, args.layers, args.peers, backend)
    print(
        f"{args.peers} rank(s) over {backend}, {args.layers} x Linear({args.width}), median of the steps after warm-up"
    )
    print("| hook | step ms | compute ms | hook ms | exposed ms | hidden |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        hidden = f"{row['hidden']:.2f}" if row["hidden"] is not None else "-"
        print(
            f"| {row['hook']} | {row['step_ms']:.2f} | {row['compute_ms']:.2f} | {row['hook_ms']:.2f} | "
            f"{row['exposed_ms']:.2f} | {hidden} |"
        )


if __name__ == "__main__":
    main()
