"""CPU-core binding: each local rank gets its own cores, within those it was given, and as many torch threads.

Where Linux describes the CPUs (``/sys/devices/system/cpu/cpu*/topology``, ``/sys/devices/system/node``), ranks get
whole physical cores, SMT siblings together, in NUMA-node order: with the usual numbering (physical cores first,
then their siblings) a split of the logical ids in order would put ranks 4-7 of an 8-rank node on the siblings of
ranks 0-3's cores. On a GPU, a rank's cores are on its GPU's NUMA node (read from the GPU's PCI device) where every
local rank's GPU reports one.
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

__all__ = [
    "CoreBinding",
    "available_cores",
    "bind_cores",
    "cpu_layout",
    "gpu_numa_node",
    "plan_core_sets",
    "plan_given_cores",
    "validate_cpu_affinity",
]

CpuAffinity = bool | Sequence[Sequence[int]]
#: A logical CPU's place: (NUMA node, package, physical core id).
CpuPlace = tuple[int, int, int]


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


def _cpu_list(text: str) -> list[int]:
    """Linux's CPU list format (``0-3,8-11``) as ids."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            ids.extend(range(int(first), int(last or first) + 1))
    return ids


def cpu_layout(cores: Sequence[int], root: str = "/sys/devices/system") -> dict[int, CpuPlace] | None:
    """Each of ``cores``'s (NUMA node, package, physical core id) from Linux's sysfs; ``None`` where unreadable.

    Args:
        cores: logical CPU ids.
        root: where sysfs describes the CPUs (a test's fake tree).
    """
    numa: dict[int, int] = {}
    for node_dir in glob.glob(os.path.join(root, "node", "node[0-9]*")):
        try:
            with open(os.path.join(node_dir, "cpulist")) as cpulist:
                for cpu in _cpu_list(cpulist.read()):
                    numa[cpu] = int(os.path.basename(node_dir)[4:])
        except (OSError, ValueError):
            continue
    layout: dict[int, CpuPlace] = {}
    for cpu in cores:
        topology = os.path.join(root, "cpu", f"cpu{cpu}", "topology")
        try:
            with (
                open(os.path.join(topology, "physical_package_id")) as package,
                open(os.path.join(topology, "core_id")) as core,
            ):
                layout[cpu] = (numa.get(cpu, 0), int(package.read()), int(core.read()))
        except (OSError, ValueError):
            return None
    return layout


def gpu_numa_node(device: torch.device | None, root: str = "/sys/bus/pci/devices") -> int | None:
    """The NUMA node of ``device``'s PCI device (Linux's ``numa_node``); ``None`` for a CPU or where unknown.

    Args:
        device: the rank's device.
        root: where sysfs lists the PCI devices (a test's fake tree).
    """
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(device)
    address = [getattr(properties, field, None) for field in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if not all(isinstance(part, int) for part in address):  # a torch that does not report the PCI address
        return None
    domain, bus, slot = address
    try:
        with open(os.path.join(root, f"{domain:04x}:{bus:02x}:{slot:02x}.0", "numa_node")) as numa_node:
            node = int(numa_node.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None  # -1: the platform does not say


def plan_core_sets(
    cores: Sequence[int], local_world_size: int, layout: dict[int, CpuPlace] | None = None
) -> list[list[int]]:
    """Split ``cores`` into ``local_world_size`` disjoint sets as equal in size as possible.

    With ``layout`` (:func:`cpu_layout`) and at least one physical core per rank, the physical cores, in NUMA-node
    order, are split into contiguous runs and each rank gets every logical CPU of its run's cores (SMT siblings
    stay together, no two ranks share a core); otherwise the logical ids, in order.

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
    if layout is not None:
        physical: dict[CpuPlace, list[int]] = {}
        for cpu in cores:
            physical.setdefault(layout[cpu], []).append(cpu)
        if len(physical) >= local_world_size:
            runs = _contiguous(sorted(physical), local_world_size)
            return [sorted(cpu for place in run for cpu in physical[place]) for run in runs]
    return _contiguous(list(cores), local_world_size)


def _contiguous(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous runs as equal in length as possible, the longer ones first."""
    base, extra = divmod(len(items), parts)
    bounds = [index * base + min(index, extra) for index in range(parts + 1)]
    return [items[start:end] for start, end in itertools.pairwise(bounds)]


def plan_given_cores(
    given: Sequence[Sequence[int]],
    layout: dict[int, CpuPlace] | None = None,
    gpu_nodes: Sequence[int | None] | None = None,
) -> tuple[list[list[int]], str]:
    """Each local rank's cores for ``cpu_affinity=True``, from the cores each was given (in local-rank order).

    Ranks that were given the same cores split them evenly: all of them when Lightning (or a launcher that does not
    bind) started them, a socket's ranks under ``srun --cpu-bind=sockets``. A rank given cores no other rank was
    given (``srun --cpu-bind=cores``, a container per rank) keeps them. No rank is ever given a core it could not
    use. Returns the sets and a sentence saying which it was. ``layout`` splits by physical core
    (:func:`plan_core_sets`). ``gpu_nodes``: each local rank's GPU's NUMA node (:func:`gpu_numa_node`); where every
    rank's is known and each node has a physical core for each of its ranks, ranks given the same cores split those
    of their GPU's NUMA node.

    Raises:
        ValueError: when ranks given the same cores are more than those cores.
    """
    sets = [sorted(cores) for cores in given]
    if len(sets) == 1:
        return sets, f"one local rank, given cores {sets[0]}: kept"
    sharing: dict[tuple[int, ...], list[int]] = {}
    for rank, cores in enumerate(sets):
        sharing.setdefault(tuple(cores), []).append(rank)
    plan = list(sets)
    near_gpus = False
    for shared, ranks in sharing.items():
        by_gpu = _split_by_gpu_node(shared, ranks, layout, gpu_nodes)
        near_gpus = near_gpus or by_gpu is not None
        for rank, part in by_gpu or zip(ranks, plan_core_sets(shared, len(ranks), layout), strict=True):
            plan[rank] = part
    distinct = list(sharing)
    overlap = any(set(a) & set(b) for i, a in enumerate(distinct) for b in distinct[i + 1 :])
    note = " (some cores given to more than one of them: each rank stays within its own)" if overlap else ""
    if len(sharing) == 1:
        how = f"the local ranks were given the same cores {sets[0]}: split"
    elif all(len(ranks) == 1 for ranks in sharing.values()):
        how = f"the launcher gave each local rank cores of its own{note}: kept"
    else:
        others = ", the others keep theirs" if any(len(ranks) == 1 for ranks in sharing.values()) else ""
        how = f"ranks given the same cores split them{others}{note}"
    if near_gpus:
        nodes = ", ".join(f"rank {rank}: node {node}" for rank, node in enumerate(gpu_nodes or ()))
        how += f", each rank on its GPU's NUMA node ({nodes})"
    return plan, how


def _split_by_gpu_node(
    shared: Sequence[int],
    ranks: list[int],
    layout: dict[int, CpuPlace] | None,
    gpu_nodes: Sequence[int | None] | None,
) -> list[tuple[int, list[int]]] | None:
    """``ranks`` with their part of ``shared``, each on its GPU's NUMA node; ``None`` where that cannot be done."""
    if layout is None or gpu_nodes is None or any(gpu_nodes[rank] is None for rank in ranks):
        return None
    parts = []
    for node in sorted({gpu_nodes[rank] for rank in ranks}, key=lambda n: n if n is not None else -1):
        on_node = [rank for rank in ranks if gpu_nodes[rank] == node]
        cores = [cpu for cpu in shared if layout[cpu][0] == node]
        if len({layout[cpu] for cpu in cores}) < len(on_node):  # fewer physical cores there than ranks
            return None
        parts += list(zip(on_node, plan_core_sets(cores, len(on_node), layout), strict=True))
    return parts


@dataclass
class CoreBinding:
    """Pins every thread of this process to ``cores`` and sets torch's intra-op threads to match.

    Every thread: the process group's and torch's threads may be running already. :meth:`release` undoes both.
    """

    cores: list[int]

    def __post_init__(self) -> None:
        self._previous_cores = os.sched_getaffinity(0)
        self._previous_threads = torch.get_num_threads()
        _pin_every_thread(self.cores)
        torch.set_num_threads(len(self.cores))

    def release(self) -> None:
        """Restore the affinity and thread count this process had before."""
        _pin_every_thread(self._previous_cores)
        torch.set_num_threads(self._previous_threads)


def _pin_every_thread(cores: Collection[int]) -> None:
    """``sched_setaffinity`` for each thread of this process (a call with pid 0 pins the calling thread only)."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread, and the threads it starts from now on
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def bind_cores(
    cpu_affinity: CpuAffinity,
    *,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    world_size: int,
    device: torch.device | None = None,
) -> CoreBinding | None:
    """Pin this rank to its cores (every thread of it, the process group's too) once the ranks can talk.

    ``cpu_affinity=True`` plans from the cores each local rank was given (``os.sched_getaffinity``): gathered
    from the ranks, so that ranks a launcher bound keep their cores and ranks given the same cores split them, on
    their GPUs' NUMA nodes where ``device`` is a GPU whose node Linux reports. ``None`` with ``cpu_affinity=False``.
    """
    if cpu_affinity is False:
        return None
    if cpu_affinity is True:
        given, gpu_nodes = _local_ranks_cores(
            available_cores(), gpu_numa_node(device), local_rank, local_world_size, node_rank, world_size
        )
        layout = cpu_layout(sorted({cpu for cores in given for cpu in cores}))
        known = gpu_nodes if any(node is not None for node in gpu_nodes) else None
        core_sets, how = plan_given_cores(given, layout, known)
        if layout is None:
            rank_zero_warn(
                "ddpopt: cpu_affinity=True found no CPU topology in /sys/devices/system (physical cores, SMT siblings, "
                "NUMA nodes): the cores are split in id order, and two ranks may share a physical core"
            )
        elif len({layout[cpu] for cpu in layout}) < len(layout):
            how += "; whole physical cores, SMT siblings together, in NUMA-node order"
    else:
        core_sets, how = [list(cores) for cores in cpu_affinity], "as given"
        if len(core_sets) != local_world_size:
            raise ValueError(
                f"cpu_affinity gives {len(core_sets)} core sets but there are {local_world_size} local ranks; "
                "pass one list of cores per local rank"
            )
    binding = CoreBinding(core_sets[local_rank])
    rank_zero_info(
        f"ddpopt: cores per local rank {core_sets}, torch threads {[len(cores) for cores in core_sets]} "
        f"(cpu_affinity={cpu_affinity}: {how})"
    )
    return binding


def _local_ranks_cores(
    own: list[int], gpu_node: int | None, local_rank: int, local_world_size: int, node_rank: int, world_size: int
) -> tuple[list[list[int]], list[int | None]]:
    """The cores each rank on this node was given and its GPU's NUMA node, in local-rank order (one all-gather)."""
    if not dist.is_initialized() or world_size == 1:
        # No other rank to ask: as if each was given what this one was (its GPU's node: unknown).
        return [own] * local_world_size, [gpu_node] + [None] * (local_world_size - 1)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (node_rank, local_rank, own, gpu_node))
    on_this_node = sorted((local, cores, gpu) for node, local, cores, gpu in gathered if node == node_rank)
    return [cores for _, cores, _ in on_this_node], [gpu for _, _, gpu in on_this_node]
