"""CPU-core binding: give each local rank its own disjoint set of cores and a matching torch thread count."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CoreBinding", "available_cores", "plan_core_sets", "validate_cpu_affinity"]

CpuAffinity = bool | Sequence[Sequence[int]]


def available_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def validate_cpu_affinity(value: object) -> CpuAffinity:
    """Check ``cpu_affinity`` at construction: a bool, or one non-empty list of core ids per local rank.

    Explicit core lists must be disjoint and name cores this process may use.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(
            f"cpu_affinity={value!r} must be True, False, or one list of core ids per local rank, e.g. [[0, 1], [2, 3]]"
        )
    allowed = set(available_cores())
    seen: set[int] = set()
    core_sets: list[list[int]] = []
    for rank, cores in enumerate(value):
        if isinstance(cores, str) or not isinstance(cores, Sequence) or not cores:
            raise TypeError(f"cpu_affinity[{rank}]={cores!r} must be a non-empty list of core ids")
        for core in cores:
            if isinstance(core, bool) or not isinstance(core, int):
                raise TypeError(f"cpu_affinity[{rank}] contains {core!r}; core ids are ints")
            if core not in allowed:
                raise ValueError(
                    f"cpu_affinity[{rank}] names core {core}, which this process cannot use; usable cores: "
                    f"{sorted(allowed)}"
                )
            if core in seen:
                raise ValueError(f"cpu_affinity gives core {core} to more than one rank; the sets must be disjoint")
            seen.add(core)
        core_sets.append(list(cores))
    if not core_sets:
        raise ValueError("cpu_affinity=[] names no cores; pass True, False, or one list of core ids per local rank")
    return core_sets


def plan_core_sets(cores: Sequence[int], local_world_size: int) -> list[list[int]]:
    """Split ``cores`` into ``local_world_size`` contiguous, disjoint sets as equal in size as possible.

    Raises:
        ValueError: when there are fewer cores than local ranks.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    if len(cores) < local_world_size:
        raise ValueError(
            f"cpu_affinity=True needs at least one core per local rank: {local_world_size} local ranks but only "
            f"{len(cores)} usable cores {list(cores)}; lower `devices` or pass cpu_affinity=False"
        )
    base, extra = divmod(len(cores), local_world_size)
    sets, start = [], 0
    for rank in range(local_world_size):
        size = base + (1 if rank < extra else 0)
        sets.append(list(cores[start : start + size]))
        start += size
    return sets


@dataclass
class CoreBinding:
    """Pins this process to ``cores`` and sets torch's intra-op threads to match; :meth:`release` undoes both."""

    cores: list[int]

    def __post_init__(self) -> None:
        self._previous_cores = os.sched_getaffinity(0)
        self._previous_threads = torch.get_num_threads()
        os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(len(self.cores))

    def release(self) -> None:
        """Restore the affinity and thread count this process had before."""
        os.sched_setaffinity(0, self._previous_cores)
        torch.set_num_threads(self._previous_threads)
