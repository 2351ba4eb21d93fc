"""The islands finding of a fault-tolerant run: its quorum's changes, the steps dropped and the heals.

An island sees the quorum from its side: the other islands' comings and goings as changes of the quorum's size, and
its own return as a heal (a restarted island's process starts its counts afresh). The finding reports both, and
calls the quorum unsteady when islands left it again and again: an island that keeps failing and coming back (it
flaps) costs every step it is away and a heal each time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_ddpopt.finding import Finding
from lightning_ddpopt.units import format_bytes

if TYPE_CHECKING:
    from lightning_ddpopt.fault_tolerance.replica import ReplicaStats

__all__ = ["FLAPPING_LOSSES", "across_islands_finding", "islands_finding", "islands_summary"]

#: The quorum shrinking this many times in a run is reported as an island that flaps.
FLAPPING_LOSSES = 2


def islands_summary(stats: ReplicaStats) -> dict[str, Any]:
    """The island's stats for the report (JSON-ready)."""
    summary = dataclasses.asdict(stats)
    summary["history"] = [list(change) for change in stats.history]
    return summary


def across_islands_finding(summary: dict[str, Any], share_problem: float) -> Finding | None:
    """The network finding of an island with no sync of its own measured (one rank): what crosses the islands.

    Its bytes, its time and that time's share of the island's time (the average runs beside the backward pass as
    the buckets are synced, so part of it may be hidden: the share is an upper bound of what the step waits for); a
    problem from ``share_problem`` of the time, the network finding's own threshold. ``None`` without a
    fault-tolerant average measured.
    """
    stats = summary.get("fault_tolerance")
    if stats is None or not stats.get("averages"):
        return None
    averages, seconds = stats["averages"], stats["average_seconds"]
    share = seconds / stats["seconds"] if stats["seconds"] > 0 else 0.0
    evidence = (
        f"across the islands: {format_bytes(stats['average_bytes'] / averages)} sent per average by each rank, "
        f"{seconds / averages * 1e3:.1f} ms each ({share:.0%} of the island's time over {averages} averages, at "
        "most that exposed); no sync inside the island (one rank)"
    )
    if share < share_problem:
        return Finding("network", "ok", evidence)
    return Finding(
        "network",
        "problem",
        evidence,
        "the average across the islands holds the step: send it in bf16 (FaultTolerance(compression='bf16')) or "
        "meet every H steps (local_sgd=LocalSGDConfig.diloco(H))",
    )


def islands_finding(summary: dict[str, Any]) -> Finding | None:
    """The islands finding, from a summary's ``"fault_tolerance"`` (``None`` without fault tolerance)."""
    stats = summary.get("fault_tolerance")
    if stats is None:
        return None
    sizes = [size for _, size in stats["history"]]
    losses = sum(after < before for before, after in zip(sizes, sizes[1:], strict=False))
    changes = ", ".join(f"{size} from step {step}" for step, size in stats["history"]) or "none yet"
    evidence = (
        f"island {stats['replica_id']}: {stats['step']} commits in the run, {stats['committed']} of them its own, "
        f"{stats['dropped']} dropped, healed {stats['heals']} time(s) ({stats['heal_seconds'] * 1e3:.0f} ms loading); "
        f"islands in the quorum: {changes}"
    )
    if losses >= FLAPPING_LOSSES:
        return Finding(
            "islands",
            "problem",
            f"{evidence}; the quorum lost an island {losses} times",
            "an island keeps failing and coming back: find the one whose log shows repeated heals (each restarted "
            "island's own islands finding says it healed) and fix or drain its machine; each absence drops its share "
            "of every step",
        )
    recommendation = ""
    if stats["dropped"]:
        recommendation = (
            "dropped steps come from a collective that failed mid-step (an island lost): raise FaultTolerance "
            "timeout_s if a slow link, not a failure, timed it out"
        )
    return Finding("islands", "ok", evidence, recommendation)
