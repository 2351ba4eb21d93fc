"""Which ranks train together as one local SGD replica (an *island*), and the groups an island layout needs.

DiLoCo runs across islands: the ranks of a replica (a node, usually) all-reduce their gradients every step over the
fast link inside it, and the replicas sync their parameters every ``H`` steps over the slow link between them.
:func:`plan_islands` turns ``LocalSGDConfig.replica`` and the run's nodes into the islands' ranks, with the reason
for the setup log line. Their process groups are :class:`~lightning_ddpopt.topology.TierGroups` over the islands (an
island is a node to them): the island's gradient group (``intra``), its gather group (``intra_gather``: the outer
step's shards), and the group across the islands of this rank's island rank (``cross``).

The terms used here (round, verdict, meeting, in flight, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ddpopt.topology import Topology

__all__ = ["Islands", "plan_islands"]


@dataclass(frozen=True)
class Islands:
    """The replicas' ranks (``members[i]``: island ``i``'s global ranks, in island-rank order) and why.

    Attributes:
        rank: this process's global rank.
        members: every island's ranks, each island's in global-rank order.
        reason: the layout's reason, for the setup log line.
    """

    rank: int
    members: tuple[tuple[int, ...], ...]
    reason: str

    @property
    def place(self) -> int:
        """This rank's place in its island (its island rank: the shard of the outer state it owns)."""
        return next(island.index(self.rank) for island in self.members if self.rank in island)

    def spans_nodes(self, topology: Topology | None) -> bool:
        """Whether an island holds ranks of several of ``topology``'s nodes (its every-step sync crosses them)."""
        if topology is None:
            return False
        node_of = {rank: index for index, node in enumerate(topology.nodes) for rank in node}
        return any(len({node_of[rank] for rank in island}) > 1 for island in self.members)

    @property
    def size(self) -> int:
        """Ranks per island (every island has as many)."""
        return len(self.members[0])

    @property
    def count(self) -> int:
        """The islands: the replicas the outer sync averages."""
        return len(self.members)

    @property
    def leader(self) -> int:
        """The global rank of island rank 0 of this rank's island."""
        return next(island[0] for island in self.members if self.rank in island)

    def leaders(self) -> list[int]:
        """Every global rank's island's first rank, by global rank."""
        leaders = [0] * sum(len(island) for island in self.members)
        for island in self.members:
            for rank in island:
                leaders[rank] = island[0]
        return leaders

    def describe(self) -> str:
        """In words: ``2 replicas x 2 ranks (ranks [[0, 1], [2, 3]])``."""
        ranks = f"rank{'s' if self.size > 1 else ''}"
        return f"{self.count} replicas x {self.size} {ranks} ({[list(island) for island in self.members]})"


def plan_islands(replica: str | int, topology: Topology | None, world_size: int, rank: int) -> Islands:
    """The islands of ``replica`` (``LocalSGDConfig.replica``) over ``world_size`` ranks on ``topology``'s nodes.

    Args:
        replica: ``"rank"``, ``"node"``, ``"auto"`` or a number of consecutive ranks per replica.
        topology: the run's nodes, ``None`` where they were not read (one process, or not learnt).
        world_size: every rank.
        rank: this process's global rank.

    Raises:
        ValueError: ``"node"`` on a run of one node or of nodes with unequal ranks, or a number that does not divide
            the world size or makes one replica of every rank.
    """
    ranks = tuple((r,) for r in range(world_size))
    if world_size == 1:
        return Islands(rank, ranks, "one process")
    nodes = "one node" if topology is None or topology.num_nodes == 1 else topology.describe()
    # An island's ranks in global-rank order: its process groups order them so (the shards and the gather agree).
    by_node = tuple(tuple(sorted(node)) for node in topology.nodes) if topology is not None else ()
    if replica == "auto":
        if topology is not None and topology.tiered:
            return Islands(rank, by_node, f"replica='auto': a replica per node on {topology.describe()}")
        why = "several nodes with several ranks each, as many on every node"
        return Islands(rank, ranks, f"replica='auto': a replica per rank (a replica per node needs {why}; {nodes})")
    if replica == "node":
        if topology is None or topology.num_nodes == 1 or not topology.uniform:
            raise ValueError(
                f"LocalSGDConfig replica='node' needs several nodes with as many ranks on each; this run has {nodes}. "
                "Use replica='rank' or a number of ranks per replica"
            )
        return Islands(rank, by_node, f"replica='node': {topology.describe()}")
    size = 1 if replica == "rank" else int(replica)
    if world_size % size or (size == world_size and world_size > 1):
        raise ValueError(
            f"LocalSGDConfig replica={replica!r} with {world_size} ranks: the ranks per replica must divide the world "
            "size and leave at least two replicas (use 'rank', 'node' or another number)"
        )
    members = tuple(tuple(range(start, start + size)) for start in range(0, world_size, size))
    return Islands(rank, members, f"replica={replica!r}")
