"""The link inside an emulated host: gloo's collectives between two processes over this machine's loopback.

``benchmarks/cluster.py --ranks-per-host 2`` runs the ranks of a host over its loopback, unshaped; this measures that
link, for ``ddpopt plan --intra-gbps`` when its predictions are checked against that bench. Two processes, one
torch thread each, fp32 tensors of ``--mb`` MB: all-reduce, reduce-scatter and all-gather, each the median of
``--rounds`` timed calls after one untimed one; the bandwidth is the ring model's (``ddpopt plan``'s): an all-reduce
of S sends ``2 (n-1)/n x S``, a reduce-scatter or all-gather ``(n-1)/n x S``.

Run:  .venv/bin/python benchmarks/loopback_collectives.py [--mb 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, mb: float, rounds: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    full = torch.randn(int(mb * 1e6 / 4))
    half = torch.empty(full.numel() // 2)
    full = full[: half.numel() * 2]
    collectives = {
        "all_reduce": (lambda: dist.all_reduce(full), 1.0),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(half, full), 0.5),
        "all_gather": (lambda: dist.all_gather_into_tensor(full, half), 0.5),
    }
    for name, (call, sent_fraction) in collectives.items():
        call()
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        if rank == 0:
            gbit = full.numel() * 4 * sent_fraction / median * 8 / 1e9
            print(f"{name:<15}{median * 1e3:8.1f} ms  {gbit:6.2f} Gbit/s (ring model, {full.numel() * 4 / 1e6:.0f} MB)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="MB of fp32 per collective (default 100)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    mp.start_processes(_rank, args=(_free_port(), args.mb, args.rounds), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
