"""Local SGD's passes over the model at a sync, on one CPU thread: torch's kernels, and the same fused in numba loops.

25.2M fp32 values (the cluster benchmark's MLP). The start of an overlapped sync: the change ``anchor - params``, its
squared norm, the division by the replicas. Its apply: the mean change's norm, Nesterov momentum, the anchor's step,
the new parameters (a copy, or a mix with ``lerp``). The numba loops (``fastmath={"contract"}``: a multiply-add
rounds once, as torch's vectorised kernels do) are checked bit for bit against torch's results; they are timed to
see what fusing would save, not used by the package.

Run:  .venv/bin/python benchmarks/sync_passes.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

VALUES = 25_200_000
ROUNDS = 5


def timed(work: Callable[[], object]) -> float:
    work()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        work()
    return (time.perf_counter() - start) / ROUNDS * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params, mean = torch.randn(VALUES), torch.randn(VALUES) * 1e-3
    anchor, work, wire, momentum = params + 1e-3, torch.zeros(VALUES), torch.zeros(VALUES), torch.zeros(VALUES)
    start = {
        "change": lambda: torch.sub(anchor, params, out=work),
        "norm": lambda: torch.dot(work, work),
        "divide into the wire": lambda: wire.copy_(work.div_(2)),
    }
    apply = {
        "arrival's copy": lambda: work.copy_(wire),
        "norm": lambda: torch.dot(work, work),
        "momentum": lambda: torch.add(work, momentum, alpha=0.9, out=momentum),
        "nesterov": lambda: torch.add(work, momentum, alpha=0.9, out=work),
        "anchor": lambda: anchor.sub_(work, alpha=0.7),
        "parameters": lambda: params.copy_(anchor),
    }
    for name, passes in (("start", start), ("apply", apply)):
        times = {step: timed(run) for step, run in passes.items()}
        print(f"{name}: {sum(times.values()):.1f} ms  " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    try:
        import numba
        import numpy
    except ImportError:
        print("numba is not installed: no fused loops to compare")
        return

    @numba.njit(fastmath={"contract"}, nogil=True)
    def outer(mean, momentum, anchor, mu, lr):
        for i in range(mean.shape[0]):
            velocity = mean[i] + mu * momentum[i]
            momentum[i] = velocity
            anchor[i] = anchor[i] - lr * (mean[i] + mu * velocity)

    @numba.njit(fastmath={"contract"}, nogil=True)
    def change(anchor, params, out, divisor):
        for i in range(params.shape[0]):
            out[i] = (anchor[i] - params[i]) / divisor

    mu, lr, two = numpy.float32(0.9), numpy.float32(0.7), numpy.float32(2.0)
    expected_momentum, expected_anchor, step = momentum.clone(), anchor.clone(), mean.clone()
    torch.add(step, expected_momentum, alpha=0.9, out=expected_momentum)
    expected_anchor.sub_(torch.add(step, expected_momentum, alpha=0.9, out=step), alpha=0.7)
    got_momentum, got_anchor = momentum.clone(), anchor.clone()
    outer(mean.numpy(), got_momentum.numpy(), got_anchor.numpy(), mu, lr)
    same = torch.equal(got_momentum, expected_momentum) and torch.equal(got_anchor, expected_anchor)
    fused_outer = timed(lambda: outer(mean.numpy(), got_momentum.numpy(), got_anchor.numpy(), mu, lr))
    expected_change = torch.sub(anchor, params).div_(2)
    change(anchor.numpy(), params.numpy(), work.numpy(), two)
    same = same and torch.equal(work, expected_change)
    fused_change = timed(lambda: change(anchor.numpy(), params.numpy(), work.numpy(), two))
    print(
        f"numba, fused: outer step (momentum, nesterov, anchor) {fused_outer:.1f} ms, change and division "
        f"{fused_change:.1f} ms; bit for bit torch's: {same}"
    )


if __name__ == "__main__":
    main()
