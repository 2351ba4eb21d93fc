"""Bucket planning: an explicit cap, the "auto" heuristic, measured autotuning, and DDP's bucket layout."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt.units import MIB

__all__ = [
    "BUCKET_CAP_CHOICES",
    "BucketAutotuner",
    "BucketPlan",
    "auto_bucket_cap_mb",
    "autotune_candidates",
    "built_bucket_bytes",
    "choose_cap",
    "gradient_bytes",
    "plan_buckets",
    "validate_bucket_cap_mb",
]

BucketCap = float | Literal["auto", "autotune"]
BUCKET_CAP_CHOICES = ("auto", "autotune")
#: Caps "autotune" tries besides the "auto" one, in MiB (those giving the same layout are tried once).
AUTOTUNE_CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)

#: Bounds of the "auto" heuristic, in MiB.
AUTO_TARGET_BUCKETS = 8
AUTO_MAX_CAP_MB = 100.0
#: Assumed link for the "auto" floor: 10 GbE-class bandwidth (bytes/s) and per-message latency (s).
AUTO_LINK_BYTES_PER_S = 1.25e9
AUTO_LINK_LATENCY_S = 50e-6
#: The largest share of a bucket's ring-allreduce time that "auto" lets latency take.
AUTO_MAX_LATENCY_SHARE = 0.1


def validate_bucket_cap_mb(value: object) -> BucketCap:
    """Return ``value`` if it is a positive finite number or "auto", else raise naming the argument."""
    if isinstance(value, str):
        if value == "auto":
            return "auto"
        if value == "autotune":
            return "autotune"
        raise ValueError(
            f"bucket_cap_mb={value!r} is not valid; pass a positive number of MiB or one of {list(BUCKET_CAP_CHOICES)}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"bucket_cap_mb={value!r} must be a positive number of MiB or one of {list(BUCKET_CAP_CHOICES)}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"bucket_cap_mb={value!r} must be a positive, finite number of MiB")
    return float(value)


def gradient_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients DDP all-reduces: every parameter that requires a gradient."""
    return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)


def auto_bucket_cap_mb(grad_bytes: int, world_size: int) -> float:
    """The "auto" bucket cap in MiB, from the gradient bytes and the world size.

    Rules, in order:

    1. Aim for :data:`AUTO_TARGET_BUCKETS` buckets (``grad_bytes / 8``), so the allreduce of early buckets
       overlaps the rest of the backward pass. torch's fixed 25 MiB puts any model under 25 MiB in one bucket,
       which cannot overlap at all.
    2. Never below the size at which a ring allreduce's latency term, ``2 (n - 1)`` messages of
       :data:`AUTO_LINK_LATENCY_S`, is more than :data:`AUTO_MAX_LATENCY_SHARE` of the bucket's bandwidth time on
       a 10 GbE-class link: ``S >= 2 (n-1) latency bandwidth / share`` (1.2 MiB at n = 2, 8.3 MiB at n = 8).
    3. Never above :data:`AUTO_MAX_CAP_MB`, nor above the gradients themselves.

    With one process there is nothing to all-reduce; the cap is torch's default of 25 MiB.
    """
    if world_size <= 1 or grad_bytes <= 0:
        return 25.0
    target = grad_bytes / AUTO_TARGET_BUCKETS
    latency_floor = 2 * (world_size - 1) * AUTO_LINK_LATENCY_S * AUTO_LINK_BYTES_PER_S / AUTO_MAX_LATENCY_SHARE
    cap = min(max(target, latency_floor), AUTO_MAX_CAP_MB * MIB, grad_bytes)
    return round(cap / MIB, 3)


@dataclass(frozen=True)
class BucketPlan:
    """What the strategy asks DDP for, and the layout it predicts.

    Attributes:
        requested: the user's ``bucket_cap_mb`` ("auto", "autotune" or a number).
        cap_mb: the cap passed to DDP.
        gradient_bytes: bytes of all gradients to synchronise.
        predicted_bucket_bytes: bucket sizes DDP builds when gradients become ready in reverse definition order
            (the usual case; DDP rebuilds its buckets after the first step in the order it observed).
    """

    requested: BucketCap
    cap_mb: float
    gradient_bytes: int
    predicted_bucket_bytes: tuple[int, ...]


def plan_buckets(module: torch.nn.Module, requested: BucketCap, world_size: int) -> BucketPlan:
    """Choose the cap for ``module`` and predict DDP's layout with the assignment function DDP itself uses."""
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    grad_bytes = gradient_bytes(params)
    cap_mb = auto_bucket_cap_mb(grad_bytes, world_size) if requested in ("auto", "autotune") else float(requested)
    predicted: tuple[int, ...] = ()
    if params:
        cap_bytes = int(cap_mb * MIB)
        ordered: list[torch.Tensor] = list(reversed(params))
        assignment, _ = dist._compute_bucket_assignment_by_size(ordered, [cap_bytes], [False] * len(ordered))
        predicted = tuple(gradient_bytes(ordered[i] for i in bucket) for bucket in assignment)
    return BucketPlan(requested, cap_mb, grad_bytes, predicted)


def autotune_candidates(module: torch.nn.Module, world_size: int) -> list[float]:
    """The caps "autotune" measures: the "auto" cap first, then :data:`AUTOTUNE_CANDIDATES_MB`, one per layout."""
    candidates: list[float] = []
    layouts: set[tuple[int, ...]] = set()
    auto = plan_buckets(module, "auto", world_size).cap_mb
    for cap in (auto, *AUTOTUNE_CANDIDATES_MB):
        layout = plan_buckets(module, cap, world_size).predicted_bucket_bytes
        if layout not in layouts:
            layouts.add(layout)
            candidates.append(cap)
    return candidates


class BucketAutotuner:
    """Measures each candidate cap for a few optimizer steps and picks the fastest.

    Every candidate runs ``warmup_steps`` unmeasured steps (DDP builds its buckets on the first one and rebuilds
    them after it) and then ``measure_steps`` timed ones; its score is the median step time. The search takes
    ``len(candidates) * (warmup_steps + measure_steps)`` optimizer steps, then training goes on with the best cap.

    Args:
        candidates: caps in MiB, tried in this order; the first is the one training starts with.
        warmup_steps: steps per candidate that are not timed.
        measure_steps: timed steps per candidate.
    """

    def __init__(self, candidates: list[float], warmup_steps: int = 2, measure_steps: int = 3) -> None:
        if not candidates:
            raise ValueError("autotune needs at least one candidate cap")
        if warmup_steps < 1 or measure_steps < 1:
            raise ValueError(f"warmup_steps={warmup_steps} and measure_steps={measure_steps} must be at least 1")
        self.candidates = list(candidates)
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.scores: dict[float, float] = {}
        self.best: float | None = None
        self._index = 0
        self._steps = 0

    @property
    def current(self) -> float:
        """The cap being measured (or the chosen one, once done)."""
        return self.best if self.best is not None else self.candidates[self._index]

    @property
    def done(self) -> bool:
        """Whether every candidate has been measured and the best chosen."""
        return self.best is not None

    @property
    def total_steps(self) -> int:
        """Optimizer steps the search takes."""
        return len(self.candidates) * (self.warmup_steps + self.measure_steps)

    def observe(self) -> bool:
        """Count one optimizer step; ``True`` when the candidate is complete.

        Then score its last ``measure_steps`` steps with :meth:`score` and call :meth:`advance`.
        """
        if self.done:
            return False
        self._steps += 1
        return self._steps == self.warmup_steps + self.measure_steps

    @staticmethod
    def score(step_times_s: list[float]) -> float:
        """A candidate's score on this rank: the median of its measured step times (infinite when none)."""
        if not step_times_s:
            return math.inf
        ordered = sorted(step_times_s)
        return ordered[len(ordered) // 2]

    def advance(self, agreed_score: float) -> float:
        """Store the current candidate's score (the same on every rank) and return the cap to run next.

        After the last candidate this chooses the best and returns it.
        """
        self.scores[self.candidates[self._index]] = agreed_score
        self._steps = 0
        if self._index + 1 < len(self.candidates):
            self._index += 1
        else:
            self.best = choose_cap(self.scores)
        return self.current


def choose_cap(scores: dict[float, float]) -> float:
    """The cap with the lowest step time; within 1% of it, the larger cap (fewer collectives, same speed)."""
    fastest = min(scores.values())
    return max(cap for cap, score in scores.items() if score <= fastest * 1.01)


def built_bucket_bytes(model: DistributedDataParallel) -> tuple[int, ...]:
    """The bucket sizes, in bytes and DDP's order, that DDP's reducer holds now."""
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return tuple(b.buffer().numel() * b.buffer().element_size() for b in buckets)
