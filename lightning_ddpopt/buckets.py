"""Bucket planning: validate an explicit cap, derive the "auto" cap, predict and read DDP's bucket layout."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "BUCKET_CAP_CHOICES",
    "BucketPlan",
    "auto_bucket_cap_mb",
    "built_bucket_bytes",
    "format_mb",
    "gradient_bytes",
    "plan_buckets",
    "validate_bucket_cap_mb",
]

MB = 1024 * 1024
BucketCap = float | Literal["auto"]
BUCKET_CAP_CHOICES = ("auto",)

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
        if value in BUCKET_CAP_CHOICES:
            return "auto"
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
    cap = min(max(target, latency_floor), AUTO_MAX_CAP_MB * MB, grad_bytes)
    return round(cap / MB, 3)


@dataclass(frozen=True)
class BucketPlan:
    """What the strategy asks DDP for, and the layout it predicts.

    Attributes:
        requested: the user's ``bucket_cap_mb`` ("auto" or a number).
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
    cap_mb = auto_bucket_cap_mb(grad_bytes, world_size) if requested == "auto" else float(requested)
    predicted: tuple[int, ...] = ()
    if params:
        cap_bytes = int(cap_mb * MB)
        ordered: list[torch.Tensor] = list(reversed(params))
        assignment, _ = dist._compute_bucket_assignment_by_size(ordered, [cap_bytes], [False] * len(ordered))
        predicted = tuple(gradient_bytes(ordered[i] for i in bucket) for bucket in assignment)
    return BucketPlan(requested, cap_mb, grad_bytes, predicted)


def built_bucket_bytes(model: DistributedDataParallel) -> tuple[int, ...]:
    """The bucket sizes, in bytes and DDP's order, that DDP's reducer holds now."""
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return tuple(b.buffer().numel() * b.buffer().element_size() for b in buckets)


def format_mb(nbytes: float) -> str:
    """Bytes as MB with one decimal, e.g. ``'103.2 MB'`` (MiB, as DDP's ``bucket_cap_mb`` counts them)."""
    return f"{nbytes / MB:.1f} MB"
