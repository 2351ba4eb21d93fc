"""Which ranks share a node: read once at setup, checked against the hosts, and the two tiers' process groups.

A cluster of N nodes with M ranks each has a fast link inside each node (NVLink, PCIe, shared memory) and a slow
one between nodes. :func:`discover` learns the layout from what the launcher told each rank (its node rank and
local rank, which Lightning's cluster environment reads) and checks it with one all-gather of host names: ranks
that claim one node must run on one host. Ranks on one host may claim different nodes (emulated nodes: one network
namespace per node, as the tests and benchmarks run them).

:class:`TierGroups` makes the groups a hierarchical hook needs, the same way on every rank: two *intra-node* groups
per node (its M ranks: one for the sum, one for the gather) and one *cross-node* group per local rank (the N ranks of
that local rank, one per node). Every rank takes part in making every group (torch's rule for ``new_group``), in one
order: nodes by node rank, then local ranks. What grows with the world: the topology itself is O(world) integers per
rank; every rank makes 2N + M groups and belongs to three.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from lightning_ddpopt._groups import destroy_owned_group

__all__ = ["TierGroups", "Topology", "discover"]


@dataclass(frozen=True)
class Topology:
    """The global ranks of each node, by node rank, each node's by local rank; and this process's rank.

    Attributes:
        rank: this process's global rank.
        nodes: ``nodes[n][l]`` is the global rank of local rank ``l`` on node ``n``.
    """

    rank: int
    nodes: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        """All ranks, over every node."""
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        """The nodes."""
        return len(self.nodes)

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks (a hierarchical sync needs it)."""
        return len({len(node) for node in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        """The ranks of each node; only for a :attr:`uniform` topology."""
        assert self.uniform, "ranks_per_node of a topology whose nodes differ"
        return len(self.nodes[0])

    @property
    def node_rank(self) -> int:
        """This rank's node."""
        return next(index for index, node in enumerate(self.nodes) if self.rank in node)

    @property
    def local_rank(self) -> int:
        """This rank's place in its node."""
        return self.nodes[self.node_rank].index(self.rank)

    @property
    def tiered(self) -> bool:
        """Whether a hierarchical sync has two tiers here: several nodes, each with several ranks, all alike."""
        return self.num_nodes > 1 and self.uniform and self.ranks_per_node > 1

    def layout(self) -> str:
        """Every node's ranks, as a two-tier hook's saved config records them: ``2 nodes x 2 ranks: [[0, 1], [2, 3]]``.

        A state saved on another layout does not apply (each rank's state covers what it owned there).
        """
        return f"{self.describe()}: {[list(node) for node in self.nodes]}"

    def describe(self) -> str:
        """In words, for the setup log line: ``2 nodes x 2 ranks`` or ``3 nodes with 2, 2, 1 ranks``."""
        if self.uniform:
            nodes, per_node = self.num_nodes, self.ranks_per_node
            return f"{nodes} node{'s' if nodes > 1 else ''} x {per_node} rank{'s' if per_node > 1 else ''}"
        return f"{self.num_nodes} nodes with {', '.join(str(len(node)) for node in self.nodes)} ranks"


def discover(node_rank: int, local_rank: int, group: dist.ProcessGroup | None = None) -> Topology:
    """The topology of ``group``'s ranks (default: the world), from each rank's node rank and local rank.

    One ``all_gather_object`` of ``(host name, node rank, local rank)``; a collective: every rank calls it.

    Args:
        node_rank: this rank's node, as its launcher said (Lightning's ``cluster_environment.node_rank()``).
        local_rank: this rank's place in its node, as its launcher said.
        group: the ranks to read; ``None`` for the world.

    Raises:
        ValueError: ranks that claim one node run on different hosts, or two ranks of a node claim one local rank,
            or a node's local ranks are not 0, 1, ...: the launcher's variables (``NODE_RANK``, ``LOCAL_RANK``, or
            SLURM's) disagree with where the processes run.
    """
    claims: list[tuple[str, int, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(claims, (socket.gethostname(), node_rank, local_rank), group=group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    by_node: dict[int, dict[int, int]] = {}
    hosts: dict[int, dict[str, list[int]]] = {}
    for rank, claim in zip(ranks, claims, strict=True):
        assert claim is not None
        host, node, local = claim
        hosts.setdefault(node, {}).setdefault(host, []).append(rank)
        node_ranks = by_node.setdefault(node, {})
        if local in node_ranks:
            raise ValueError(
                f"ranks {node_ranks[local]} and {rank} both claim local rank {local} on node {node}: the launcher's "
                "LOCAL_RANK (or SLURM_LOCALID) must differ between the ranks of a node"
            )
        node_ranks[local] = rank
    for node, on_hosts in sorted(hosts.items()):
        if len(on_hosts) > 1:
            where = "; ".join(f"ranks {members} on host {host!r}" for host, members in sorted(on_hosts.items()))
            raise ValueError(
                f"the ranks of node {node} run on {len(on_hosts)} hosts ({where}): ranks that claim one node "
                "(NODE_RANK, or SLURM_NODEID) must run on one host; check the launcher's node rank on each host"
            )
    if sorted(by_node) != list(range(len(by_node))):
        raise ValueError(f"node ranks {sorted(by_node)} are not 0..{len(by_node) - 1}: check NODE_RANK on each node")
    nodes = []
    for node in range(len(by_node)):
        locals_ = by_node[node]
        if sorted(locals_) != list(range(len(locals_))):
            raise ValueError(
                f"node {node}'s local ranks are {sorted(locals_)}, not 0..{len(locals_) - 1}: check LOCAL_RANK"
            )
        nodes.append(tuple(locals_[local] for local in range(len(locals_))))
    return Topology(rank=dist.get_rank(), nodes=tuple(nodes))


class TierGroups:
    """The intra-node groups of this rank's node and the cross-node group of its local rank (see the module doc).

    The node has two groups, :attr:`intra` for the sum inside it and :attr:`intra_gather` for the gather: a CPU hook
    that pipelines buckets issues each stage's collectives from a thread of its own, and a group's collectives
    must come in one order on every rank.

    Made by every rank of a :attr:`Topology.tiered` topology, together; :meth:`close` destroys both.

    Args:
        topology: the nodes' ranks.
        new_group: makes a group over the given ranks (the strategy's: its backend and timeout); ``None`` for
            ``torch.distributed.new_group`` with torch's defaults.
    """

    def __init__(self, topology: Topology, new_group: Callable[[list[int]], dist.ProcessGroup] | None = None) -> None:
        assert topology.tiered, "tier groups need several nodes with several ranks each"
        make = new_group or (lambda ranks: dist.new_group(ranks=ranks))
        self.topology = topology
        self.intra: dist.ProcessGroup | None = None
        self.intra_gather: dist.ProcessGroup | None = None
        self.cross: dist.ProcessGroup | None = None
        for node in topology.nodes:  # every rank makes every group, in one order
            for attribute in ("intra", "intra_gather"):
                group = make(list(node))
                if topology.rank in node:
                    setattr(self, attribute, group)
        for local in range(topology.ranks_per_node):
            members = [node[local] for node in topology.nodes]
            group = make(members)
            if topology.rank in members:
                self.cross = group

    def close(self) -> None:
        """Destroy both groups (every rank of the topology calls it, at teardown)."""
        for name in ("intra", "intra_gather", "cross"):
            destroy_owned_group(self, name)
