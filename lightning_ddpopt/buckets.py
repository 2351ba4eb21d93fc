"""Bucket planning: an explicit cap or the "auto" heuristic, and DDP's bucket layout.

:class:`BucketController` is the strategy's one owner of DDP's buckets: it plans the cap at setup (measuring the
latency "auto" needs from :data:`AUTO_MEASURED_FROM_RANKS` ranks on, or reusing a checkpoint's measurement) and logs
the plan and, once DDP has settled it, the layout DDP built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info

from lightning_ddpopt._compat import bucket_assignment
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.timing import median_seconds
from lightning_ddpopt.units import MIB, format_bytes

__all__ = [
    "BUCKET_CAP_CHOICES",
    "BucketController",
    "BucketPlan",
    "auto_bucket_cap_mb",
    "measure_latency",
    "gradient_bytes",
    "plan_buckets",
    "validate_bucket_cap_mb",
]

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
#: From this many ranks "auto" measures the latency of an all-reduce at setup instead of assuming a ring of
#: ``2 (n - 1)`` hops of :data:`AUTO_LINK_LATENCY_S` (a floor of 8.3 MiB at 8 ranks, 37 MiB at 32: fabrics whose
#: collectives are trees or hierarchical do not grow so). Below it the assumed floor is small (under 8.3 MiB) and
#: the cap the same in every run, which keeps DDP's buckets, so sums, alike between runs.
AUTO_MEASURED_FROM_RANKS = 8
#: The bounds of a measured latency: one all-reduce of 4 bytes, in seconds.
AUTO_LATENCY_BOUNDS_S = (5e-6, 5e-3)
#: All-reduces timed (after three untimed) for the measured latency.
LATENCY_PROBES = 20


def validate_bucket_cap_mb(value: object) -> BucketCap:
    """Return ``value`` if it is a positive finite number or "auto", else raise naming the argument.

    ``"autotune"`` (deprecated) warns and returns ``"auto"``: its search of caps during the first steps kept the
    "auto" cap on the benchmark it was measured on, and caps from 1 to 25 MiB were within 6% of each other there.
    """
    if isinstance(value, str):
        if value == "auto":
            return "auto"
        if value == "autotune":
            rank_zero_deprecation(
                "bucket_cap_mb='autotune' is deprecated and now means 'auto' (measured, the search kept the 'auto' "
                "cap and gained nothing over it); it will be removed in the next release: pass 'auto' or a number of "
                "MiB"
            )
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


def auto_bucket_cap_mb(grad_bytes: int, world_size: int, latency_s: float | None = None) -> float:
    """The "auto" bucket cap in MiB, from the gradient bytes, the world size and, if measured, the latency.

    Rules, in order:

    1. Aim for :data:`AUTO_TARGET_BUCKETS` buckets (``grad_bytes / 8``), so the allreduce of early buckets
       overlaps the rest of the backward pass. torch's fixed 25 MiB puts any model under 25 MiB in one bucket,
       which cannot overlap at all.
    2. Never below the size at which a ring allreduce's latency term, ``2 (n - 1)`` messages of
       :data:`AUTO_LINK_LATENCY_S`, is more than :data:`AUTO_MAX_LATENCY_SHARE` of the bucket's bandwidth time on
       a 10 GbE-class link: ``S >= 2 (n-1) latency bandwidth / share`` (1.2 MiB at n = 2, 8.3 MiB at n = 8). With
       ``latency_s`` (one small all-reduce's measured time, :func:`measure_latency`) that time replaces the ring's
       ``2 (n-1)`` latencies: ``S >= latency_s bandwidth / share``.
    3. Never above :data:`AUTO_MAX_CAP_MB`, nor above the gradients themselves.

    With one process there is nothing to all-reduce; the cap is torch's default of 25 MiB.

    Args:
        grad_bytes: the bytes of the gradients DDP all-reduces.
        world_size: the ranks.
        latency_s: a measured all-reduce latency, or ``None`` for the ring model's.
    """
    if world_size <= 1 or grad_bytes <= 0:
        return 25.0
    target = grad_bytes / AUTO_TARGET_BUCKETS
    latency = 2 * (world_size - 1) * AUTO_LINK_LATENCY_S if latency_s is None else latency_s
    latency_floor = latency * AUTO_LINK_BYTES_PER_S / AUTO_MAX_LATENCY_SHARE
    cap = min(max(target, latency_floor), AUTO_MAX_CAP_MB * MIB, grad_bytes)
    return round(cap / MIB, 3)


def measure_latency(device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The time of one all-reduce of 4 bytes on ``group``, agreed by every rank (every rank calls it, together).

    The median of :data:`LATENCY_PROBES` timed all-reduces (after three untimed), the slowest rank's, rounded to a
    power of two microseconds (runs on one fabric mostly measure alike, though a value near a rounding boundary can
    go either way: a checkpoint keeps the value, for a resume) and held within :data:`AUTO_LATENCY_BOUNDS_S`. On
    NCCL a message this small takes its low-latency path, which a large bucket does not.

    Args:
        device: where the all-reduced tensor lives (the backend's device).
        group: the group to time (``None``: the default group).
    """
    probe = torch.zeros(1, device=device)
    median = median_seconds(lambda: dist.all_reduce(probe, group=group), device, LATENCY_PROBES, warmup=3)
    slowest = torch.tensor([median], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    rounded = 2.0 ** round(math.log2(max(float(slowest), 1e-9) / 1e-6)) * 1e-6
    low, high = AUTO_LATENCY_BOUNDS_S
    return min(max(rounded, low), high)


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


def plan_buckets(
    module: torch.nn.Module, requested: BucketCap, world_size: int, latency_s: float | None = None
) -> BucketPlan:
    """Choose the cap for ``module`` and predict DDP's layout with the assignment function DDP itself uses.

    Args:
        module: the module DDP wraps.
        requested: the ``bucket_cap_mb`` asked for.
        world_size: the ranks.
        latency_s: "auto"'s measured latency (:func:`auto_bucket_cap_mb`), ``None`` for the ring model's.
    """
    params: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    grad_bytes = gradient_bytes(params)
    auto = requested == "auto"
    cap_mb = auto_bucket_cap_mb(grad_bytes, world_size, latency_s) if auto else float(requested)
    predicted: tuple[int, ...] = ()
    if params:
        cap_bytes = int(cap_mb * MIB)
        ordered: list[torch.Tensor] = list(reversed(params))
        predicted = tuple(
            gradient_bytes(ordered[i] for i in bucket) for bucket in bucket_assignment(ordered, cap_bytes)
        )
    return BucketPlan(requested, cap_mb, grad_bytes, predicted)


#: DDP settles its bucket layout after its first synchronised step; by the end of the second the layout is final.
LAYOUT_FINAL_AFTER_STEPS = 2


class BucketController:
    """DDP's bucket cap from plan to layout: planned at setup, logged on rank 0.

    Args:
        requested: the validated ``bucket_cap_mb`` (a number of MiB or ``"auto"``).
    """

    def __init__(self, requested: BucketCap) -> None:
        self.requested = requested
        self.plan: BucketPlan | None = None
        self.layout: tuple[int, ...] | None = None
        self._world_size = 1
        self._backend = ""
        self._hook_name: str | None = None
        #: "auto"'s measured all-reduce latency (from AUTO_MEASURED_FROM_RANKS ranks), ``None`` when not measured.
        self.latency_s: float | None = None

    def measures(self, world_size: int) -> bool:
        """Whether "auto" measures the latency on ``world_size`` ranks (from :data:`AUTO_MEASURED_FROM_RANKS`).

        Args:
            world_size: the ranks.
        """
        return self.requested == "auto" and world_size >= AUTO_MEASURED_FROM_RANKS

    def cap_for(
        self,
        module: torch.nn.Module,
        world_size: int,
        device: torch.device,
        reused_latency_s: float | None = None,
    ) -> float:
        """Plan the cap DDP wraps ``module`` with, from what a checkpoint measured where it still applies.

        Every rank calls it together: "auto" measures the latency it needs where :meth:`measures` says so
        (:func:`measure_latency`), unless a checkpoint of this world size holds it.

        Args:
            module: the module DDP wraps.
            world_size: the ranks.
            device: the backend's device.
            reused_latency_s: the latency ``"auto"`` measured, from a checkpoint of this world size: the cap follows
                from it and this model.
        """
        self._world_size = world_size
        if self.measures(world_size):
            self.latency_s = reused_latency_s if reused_latency_s is not None else measure_latency(device)
            self.plan = plan_buckets(module, self.requested, world_size, self.latency_s)
            rank_zero_info(self.latency_note(reused=reused_latency_s is not None))
        else:
            self.plan = plan_buckets(module, self.requested, world_size)
        return self.plan.cap_mb

    def latency_note(self, reused: bool = False) -> str:
        """What "auto" measured (``reused``: a checkpoint had measured) and the floor it gives, for the log line.

        Args:
            reused: the latency came from a checkpoint.
        """
        assert self.latency_s is not None and self.plan is not None
        low, high = AUTO_LATENCY_BOUNDS_S
        floor = self.latency_s * AUTO_LINK_BYTES_PER_S / AUTO_MAX_LATENCY_SHARE
        source = (
            "(the checkpoint's measurement)"
            if reused
            else f"(the slowest rank's median of {LATENCY_PROBES}, to a power of two, within {low * 1e6:g} us.."
            f"{high * 1e3:g} ms)"
        )
        return (
            f"ddpopt: bucket_cap_mb='auto': an all-reduce of 4 bytes over {self._world_size} ranks takes "
            f"{self.latency_s * 1e6:g} us {source}; buckets of at least {format_bytes(floor)} keep it under "
            f"{AUTO_MAX_LATENCY_SHARE:.0%} of a bucket's time at 10 Gbit/s: cap {self.plan.cap_mb:g} MiB"
        )

    def log_plan(self, backend: str, hook_name: str | None) -> None:
        """Log the plan on rank 0 (once the hook is known)."""
        assert self.plan is not None
        self._backend, self._hook_name = backend, hook_name
        note = f", auto for {self._world_size} ranks" if self.plan.requested == "auto" else ""
        rank_zero_info(f"ddpopt: plan {self._describe(self.plan.predicted_bucket_bytes, note)} on {backend}")

    def after_step(self, ledger: CommLedger, say: Callable[[str], None], local_phase: bool = False) -> None:
        """After each optimizer step: log the layout once it is final."""
        if self.layout is None and ledger.closed_steps >= LAYOUT_FINAL_AFTER_STEPS:
            self.log_layout(ledger, say, local_phase, final=False)

    def log_layout(self, ledger: CommLedger | None, say: Callable[[str], None], local_phase: bool, final: bool) -> None:
        """Log the bucket sizes DDP built, from the ledger's latest record of them; without one, the plan's prediction.

        Nothing is allocated to read them. While the latest step's record is still on the device, it waits for the
        next step (``final``: the end of fit, it logs what it has).
        """
        assert self.plan is not None
        if final and ledger is not None:
            ledger.flush()  # the end of fit: the last steps' records, off the device
        # The latest record shows the buckets the hooks saw, unless a step closed since is still on the device; a
        # local SGD parameter sync's round is not a bucket layout.
        pending = ledger is not None and bool(ledger.pending_steps)
        last = ledger.steps[-1] if ledger is not None and ledger.steps and not pending else None
        recorded = last.bucket_bytes if last is not None and not local_phase else ()
        if not recorded and pending and not final:
            return
        self.layout = recorded or self.plan.predicted_bucket_bytes
        sizes = ", ".join(format_bytes(size) for size in self.layout)
        note = "" if recorded else " (predicted: no hook reported the buckets DDP built)"
        say(f"ddpopt: {self._describe(self.layout)} on {self._backend}, bucket sizes [{sizes}]{note}")

    def _describe(self, sizes: tuple[int, ...], cap_note: str = "") -> str:
        assert self.plan is not None
        count = f"{len(sizes)} bucket" + ("" if len(sizes) == 1 else "s")
        hook = self._hook_name or "none (DDP built-in allreduce)"
        # One unit family on the line: the cap in decimal MB as the sizes, then the argument's own value (MiB).
        cap = f"cap {format_bytes(self.plan.cap_mb * MIB)}: bucket_cap_mb={self.plan.cap_mb:g}{cap_note}"
        return f"{format_bytes(sum(sizes))} of gradients in {count} ({cap}), hook {hook}"
