"""``comm_hook="auto"``: choose allreduce, fp16, int8 or PowerSGD from measurements of this link and this model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.int8 import Int8Config, dequantize_blocks, quantize_blocks
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig

__all__ = ["AUTO_HOOK", "HookChoice", "choose_hook", "measure_hook_costs"]

AUTO_HOOK = "auto"
#: A hook must beat plain allreduce's estimated sync time by this factor to be chosen.
MIN_GAIN = 1.1
_PROBE_ELEMENTS = 4 * 1024 * 1024  # 16 MiB of fp32


@dataclass(frozen=True)
class HookChoice:
    """The chosen registry name, the estimated sync seconds per step of each candidate, and why."""

    name: str
    estimates_s: dict[str, float]
    reason: str


def choose_hook(estimates_s: dict[str, float]) -> HookChoice:
    """The candidate with the lowest estimate, if it beats ``allreduce`` by :data:`MIN_GAIN`; else ``allreduce``."""
    baseline = estimates_s["allreduce"]
    best = min(estimates_s, key=estimates_s.__getitem__)
    listed = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in estimates_s.items())
    if best != "allreduce" and estimates_s[best] * MIN_GAIN <= baseline:
        reason = f"estimated sync per step: {listed}; {best} is {baseline / estimates_s[best]:.1f}x faster"
        return HookChoice(best, dict(estimates_s), reason)
    reason = f"estimated sync per step: {listed}; compression does not pay on this link"
    return HookChoice("allreduce", dict(estimates_s), reason)


def measure_hook_costs(
    module: torch.nn.Module, process_group: dist.ProcessGroup | None, device: torch.device, repeats: int = 3
) -> dict[str, float]:
    """Estimate each candidate's sync seconds per step for ``module``'s gradients, agreed across ranks.

    * ``allreduce`` and ``fp16``: time allreduces of a 16 MiB probe (or the gradients, if smaller) in fp32 and
      fp16, scale to the gradient size, and add fp16's cast to and from the wire dtype.
    * ``int8``: time an allreduce of the probe's packed int8 bytes (its traffic is an allreduce's), plus its
      quantisation and two dequantisations of the probe, scaled to the gradient size.
    * ``powersgd``: PowerSGD (rank 4) sends almost nothing; its cost is its matrix work, timed on the largest
      weight matrix and scaled to all compressible ones.

    Each figure is the slowest rank's (an all-reduce of the vector), so every rank chooses the same hook.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    elements = sum(p.numel() for p in params)
    probe = min(elements, _PROBE_ELEMENTS)
    scale = elements / probe
    fp32 = torch.ones(probe, dtype=torch.float32, device=device)
    fp16 = torch.ones(probe, dtype=torch.float16, device=device)
    gradients = torch.ones(elements, dtype=torch.float32, device=device)
    block = Int8Config().block_size
    estimates = {
        "allreduce": _time(lambda: dist.all_reduce(fp32, group=process_group), device, repeats) * scale,
        "fp16": _time(lambda: dist.all_reduce(fp16, group=process_group), device, repeats) * scale
        + _time(lambda: gradients.copy_(gradients.to(torch.float16)), device, repeats),
    }
    if probe >= block:  # a model smaller than one block has nothing for int8 to save
        packed = torch.ones(probe + -(-probe // block) * 4, dtype=torch.uint8, device=device)
        estimates["int8"] = (
            _time(lambda: dist.all_reduce(packed, group=process_group), device, repeats)
            + _time(lambda: _int8_work(fp32, block), device, repeats)
        ) * scale
    matrices = [p for p in params if p.dim() > 1]
    if matrices:
        largest = max(matrices, key=lambda p: p.numel())
        matrix = torch.randn(largest.shape[0], largest.numel() // largest.shape[0], device=device)
        per_element = _time(lambda: _powersgd_work(matrix, PowerSGDConfig().rank), device, repeats) / matrix.numel()
        compressible = sum(p.numel() for p in matrices)
        estimates["powersgd"] = per_element * compressible
    agreed = torch.tensor(list(estimates.values()), dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
    return dict(zip(estimates, agreed.tolist(), strict=True))


def _powersgd_work(matrix: torch.Tensor, rank: int) -> None:
    """The local work of one PowerSGD step on one matrix: error feedback, P, Q, the error and the decompression."""
    q = torch.randn(matrix.shape[1], rank, device=matrix.device)
    matrix.add_(0.0)
    p = torch.linalg.qr(matrix @ q).Q
    q = (p.t() @ matrix).t()
    torch.addmm(matrix, p, q.t(), alpha=-1)
    torch.matmul(p, q.t())


def _int8_work(values: torch.Tensor, block: int) -> None:
    """The int8 hook's local work on ``values``: quantise, dequantise the contributions, dequantise the result."""
    rows = values[: values.numel() // block * block].view(-1, block)
    payload, scales = quantize_blocks(rows)
    dequantize_blocks(payload, scales)
    dequantize_blocks(payload, scales)


def _time(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``work`` after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
