"""``comm_hook="auto"``: choose among allreduce, fp16 and int8 (PowerSGD if allowed) from measurements of this link.

By default ``auto`` chooses among the near-lossless hooks only: allreduce, fp16 and int8 with error feedback.
PowerSGD's low-rank compression can cost quality, which a time estimate does not see, so ``auto`` considers it only
when the user lists it: ``AutoConfig(candidates=(..., "powersgd"))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig, PowerSGDState
from lightning_ddpopt.timing import median_seconds

if TYPE_CHECKING:
    from lightning_ddpopt.hooks.registry import HookSpec

__all__ = ["AUTO_HOOK", "AutoConfig", "HookChoice", "choose_hook", "measure_hook_costs"]

AUTO_HOOK = "auto"
"""The ``comm_hook`` value that measures the candidates at setup and chooses (:class:`AutoConfig` sets which)."""
#: What ``auto`` may measure and choose: the near-lossless hooks, and PowerSGD (lossy) when listed.
NEAR_LOSSLESS = ("allreduce", "fp16", "int8")
CANDIDATES = (*NEAR_LOSSLESS, "powersgd")
#: A hook must beat plain allreduce's estimated sync time by this factor to be chosen.
MIN_GAIN = 1.1
_PROBE_ELEMENTS = 4 * 1024 * 1024  # 16 MiB of fp32


@dataclass(frozen=True)
class AutoConfig:
    """What ``comm_hook="auto"`` chooses from (``comm_hook="auto"`` is ``AutoConfig()``).

    Args:
        candidates: the hooks to measure and choose among; ``"allreduce"`` (the baseline) must be one. By default
            the near-lossless ones: ``("allreduce", "fp16", "int8")``. Add ``"powersgd"`` to allow PowerSGD's
            low-rank compression (rank 4, :class:`~lightning_ddpopt.hooks.PowerSGDConfig`'s defaults), which can
            cost quality: check its loss on a held-out set.
    """

    candidates: tuple[str, ...] = NEAR_LOSSLESS

    def __post_init__(self) -> None:
        if isinstance(self.candidates, str) or not isinstance(self.candidates, tuple | list):
            raise TypeError(f"AutoConfig candidates={self.candidates!r} must be a tuple of hook names")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        unknown = [name for name in self.candidates if name not in CANDIDATES]
        if unknown or "allreduce" not in self.candidates:
            raise ValueError(
                f"AutoConfig candidates={self.candidates!r} must list 'allreduce' (the baseline) and only hooks from "
                f"{list(CANDIDATES)}"
            )

    @property
    def allows_lossy(self) -> bool:
        """Whether a low-rank (lossy) hook is among the candidates."""
        return "powersgd" in self.candidates


@dataclass(frozen=True)
class HookChoice:
    """What ``comm_hook="auto"`` chose (``strategy.hook_choice``).

    Args:
        name: the chosen registry name.
        estimates_s: each candidate's estimated sync seconds per step, the slowest rank's.
        reason: why, as the log line says it.
    """

    name: str
    estimates_s: dict[str, float]
    reason: str


def choose_hook(estimates_s: dict[str, float], config: AutoConfig | None = None) -> HookChoice:
    """The candidate with the lowest estimate, if it beats ``allreduce`` by :data:`MIN_GAIN`; else ``allreduce``.

    Only ``config``'s candidates are considered (by default the near-lossless ones); the reason says which were left
    out for quality.

    Args:
        estimates_s: estimated sync seconds per step of each candidate, ``allreduce`` among them.
        config: the candidates; ``None``: :class:`AutoConfig`'s defaults.
    """
    config = config if config is not None else AutoConfig()
    considered = {name: seconds for name, seconds in estimates_s.items() if name in config.candidates}
    baseline = considered["allreduce"]
    best = min(considered, key=considered.__getitem__)
    listed = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in considered.items())
    left_out = "" if config.allows_lossy else "; powersgd not considered (lossy: allow it with AutoConfig)"
    if best != "allreduce" and considered[best] * MIN_GAIN <= baseline:
        reason = f"estimated sync per step: {listed}; {best} is {baseline / considered[best]:.1f}x faster{left_out}"
        if best == "powersgd":
            reason += (
                f" (PowerSGD estimated at rank {PowerSGDConfig().rank}; its rank rises while its measured compression "
                "error is above its bound, which costs more)"
            )
        return HookChoice(best, dict(considered), reason)
    reason = f"estimated sync per step: {listed}; compression does not pay on this link{left_out}"
    return HookChoice("allreduce", dict(considered), reason)


def measure_hook_costs(
    module: torch.nn.Module,
    process_group: dist.ProcessGroup | None,
    device: torch.device,
    repeats: int = 3,
    candidates: tuple[str, ...] = CANDIDATES,
    *,
    lookup: Callable[[str], HookSpec],
) -> dict[str, float]:
    """Estimate each candidate's sync seconds per step for ``module``'s gradients, agreed across ranks.

    ``lookup`` is the registry's (:func:`~lightning_ddpopt.hooks.registry.get_hook_spec`), which lists ``"auto"``
    among its choices and so is not imported here.

    Each candidate's real hook (the registry's, as ``comm_hook="auto"`` registers it) syncs a probe bucket of at
    most 16 MiB of fp32 gradients: its work, communication and waits, the median of ``repeats`` after a warm-up
    round. The probe is scaled to the model's gradient size:

    * ``allreduce``, ``fp16``, ``int8``: one flat probe of ``min(gradient elements, 4 Mi)`` values, scaled by
      gradient elements / probe elements (int8 only for a model of at least one block).
    * ``powersgd``: the model's largest compressible weight matrices in their own shapes, as many as fit in the
      probe (the largest one cut to its first rows if it alone does not), scaled by compressible elements /
      probed elements.

    Memory stays bounded whatever the model's size: the probe, plus what the hook keeps per probe (error feedback).
    Each figure is the slowest rank's (an all-reduce of the vector), so every rank chooses the same hook.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    elements = sum(p.numel() for p in params)
    probe = min(elements, _PROBE_ELEMENTS)
    estimates = {}
    for name in [name for name in NEAR_LOSSLESS if name in candidates]:
        if name == "int8" and probe < Int8Config().block_size:  # nothing for int8 to save below one block
            continue
        estimates[name] = _time_hook(lookup(name), [(probe,)], process_group, device, repeats) * elements / probe
    rank = PowerSGDConfig().rank
    matrices = [(p.shape[0], p.numel() // p.shape[0]) for p in params if p.dim() > 1]
    compressible = [shape for shape in matrices if PowerSGDConfig().compresses(*shape)]
    if compressible and "powersgd" in candidates:
        shapes = _largest_within(compressible, _PROBE_ELEMENTS, min_rows=2 * rank)
        probed = sum(rows * cols for rows, cols in shapes)
        seconds = _time_hook(lookup("powersgd"), shapes, process_group, device, repeats)
        estimates["powersgd"] = seconds * sum(rows * cols for rows, cols in compressible) / probed
    agreed = torch.tensor(list(estimates.values()), dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
    return dict(zip(estimates, agreed.tolist(), strict=True))


def _largest_within(shapes: list[tuple[int, int]], budget: int, min_rows: int) -> list[tuple[int, int]]:
    """The largest ``(rows, cols)`` shapes whose elements fit in ``budget``; the largest cut to fewer rows if needed.

    A cut keeps at least ``min_rows`` rows, so a matrix wider than ``budget / min_rows`` is probed above the budget.
    """
    ordered = sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True)
    rows, cols = ordered[0]
    if rows * cols > budget:
        return [(min(rows, max(min_rows, budget // cols)), cols)]
    taken, used = [], 0
    for rows, cols in ordered:
        if used + rows * cols <= budget:
            taken.append((rows, cols))
            used += rows * cols
    return taken


class _ProbeBucket:
    """A stand-in for DDP's ``GradBucket``: random gradients of the given shapes, views into one flat buffer."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: torch.device) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self._buffer = torch.randn(sum(sizes), device=device)
        self._gradients = [part.view(shape) for part, shape in zip(self._buffer.split(sizes), shapes, strict=True)]
        # The hooks key their state by the names of the bucket's parameters and read their shapes: parameters of the
        # gradients' shapes on the meta device, which holds no values.
        self.module = torch.nn.Module()
        for index, shape in enumerate(shapes):
            self.module.register_parameter(f"probe{index}", torch.nn.Parameter(torch.empty(shape, device="meta")))

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _time_hook(
    spec: HookSpec,
    shapes: Sequence[tuple[int, ...]],
    process_group: dist.ProcessGroup | None,
    device: torch.device,
    repeats: int,
) -> float:
    """Median seconds the registry's hook ``spec`` takes to sync a probe bucket of ``shapes``, until its result."""
    bucket = _ProbeBucket(shapes, device)
    state = spec.build(process_group, None)
    state.bind_module(bucket.module)
    if isinstance(state, PowerSGDState):
        state.iteration = state.config.start_iter  # compressing, as after the warm-up steps
    try:
        return median_seconds(lambda: spec.hook(state, bucket).wait(), device, repeats)  # type: ignore[arg-type]
    finally:
        state.close()
