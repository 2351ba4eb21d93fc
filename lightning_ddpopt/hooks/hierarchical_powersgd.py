"""Two-tier PowerSGD for N nodes x M ranks: the node's mean inside a node, low-rank factors of 1/M of it between nodes.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

Each bucket's sync, on every rank (the groups are :class:`lightning_ddpopt.topology.TierGroups`'):

1. **inside the node**: the bucket is all-reduced over the node's M ranks in its own precision and divided by M,
   the node's mean;
2. **between the nodes**: every parameter has one owner among the local ranks, and each rank syncs the gradients it
   owns over the N ranks of its local rank, one per node (:attr:`~lightning_ddpopt.topology.TierGroups.cross`),
   exactly as flat PowerSGD syncs a bucket over N ranks (:mod:`lightning_ddpopt.hooks.powersgd`): the matrices worth
   compressing as rank-r factors P and Q with error feedback and warm start, the rest exactly; so the mean of the N
   node means is every rank's mean;
3. **inside the node**: each rank zeroes the gradients it does not own and the bucket is all-reduced again: every
   value is its owner's plus zeros, exact, so every rank ends with the same bucket, bit for bit.

Only the owners' factors cross nodes, M rings of one rank per node in parallel on each node's link; each rank
compresses, and keeps error feedback and Q memories for, about 1/M of the model. A parameter's owner follows from
the model alone (parameters in model order, each to the local rank that owns the fewest elements so far), never
from DDP's buckets, so the state survives DDP's bucket rebuild after the first step and a resume bit for bit. The
saved config records every node's ranks (``tiers``): a resume on another layout starts the state afresh.

One verdict for the world: a round is committed only if every rank's gathered buckets are finite (the gathered
bucket holds every owner's results, so a non-finite factor anywhere is seen by every rank), and ``max_error``'s
measurement is summed over the cross-node group, then inside the node: every rank raises the rank at the same
sync. ``batched=True`` has no two-tier form (it makes one matrix of a whole bucket, which has no single owner).

Each bucket's chain runs on one thread, as the flat hook's: on a CPU the state's worker thread beside the backward
pass, bucket after bucket in DDP's order (the intra-node exchanges are loopback or shared memory, small beside the
power iteration); on CUDA in the hook call on the state's side stream. The ledger counts the factors and exact
tensors sent between nodes as the hook's wire bytes, and the two intra-node all-reduces of the bucket as its
intra-node bytes.
"""

import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.hooks.powersgd import (
    _RANK_DECISION_LAG,
    PowerSGDState,
    _allreduce_mean_inplace,
    _completed,
    _write_back,
    compress_listed,
    dispatch,
)
from lightning_ddpopt.topology import TierGroups

__all__ = ["HierarchicalPowerSGDState", "hierarchical_powersgd_hook"]


@dataclass(kw_only=True)
class HierarchicalPowerSGDState(PowerSGDState):
    """The state of :func:`hierarchical_powersgd_hook`: PowerSGD's, for the parameters this rank owns, and the tiers.

    The strategy builds it from ``comm_hook="powersgd"`` (or a :class:`~lightning_ddpopt.hooks.PowerSGDConfig`)
    on a hierarchical run; build one yourself only to register the hook on a DDP model of your own, then call
    :meth:`bind_module` with the wrapped module.

    Args:
        tiers: the intra- and cross-node groups.
        config: PowerSGD's settings (``batched=False``).
        process_group: ignored: the factors are averaged over ``tiers.cross``, which it is set to.
        ledger: where the hook reports its bytes; ``None`` records nothing.
        loss_scale: returns the current loss scale (the strategy sets it under fp16 AMP).
        iteration: sync rounds so far (restored from a checkpoint; leave it 0).
        skipped_rounds: rounds whose reduced values were not finite and left the state untouched.
        errors: this rank's error feedback per parameter name, for the parameters it owns.
        error_scales: the loss scale each error was computed at.
        q_memories: the warm-start Q of each compressed matrix this rank owns.
        pipelined: run the buckets' chains on a worker thread (CPU only); the strategy sets it on CPUs.
        cpu_kernels: numba's fused loops, agreed on by every rank (the strategy sets them); ``None``: torch's.
        rank: the rank in use; 0 starts at ``config.rank``.
        rank_changes: ``(step, error, old rank, new rank)`` for each rise of the rank, in order.

    Raises:
        ValueError: without ``tiers``, or with ``config.batched``.
    """

    label: ClassVar[str] = "PowerSGD"

    tiers: TierGroups | None = field(default=None, repr=False)
    #: Each parameter's owner among the node's local ranks.
    owners: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tiers is None:
            raise ValueError("HierarchicalPowerSGDState needs tiers= (the intra- and cross-node groups)")
        if self.config.batched:
            raise ValueError(
                "PowerSGDConfig(batched=True) has no two-tier form (a whole bucket is one matrix, with no single "
                "owner among a node's ranks); use batched=False or hierarchical=False"
            )
        self.process_group = self.tiers.cross
        super().__post_init__()
        topology = self.tiers.topology
        self.ranks_per_node, self.local_rank = topology.ranks_per_node, topology.local_rank

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names and each parameter's owner (in model order, to the least loaded local rank).

        Args:
            module: the module DDP wraps.
        """
        super().bind_module(module)
        loads = [0] * self.ranks_per_node
        self.owners = {}
        for name, param in module.named_parameters():
            if param.requires_grad:
                owner = loads.index(min(loads))
                self.owners[name] = owner
                loads[owner] += param.numel()

    def config_dict(self) -> dict[str, object]:
        """The PowerSGDConfig and the tiers (every node's ranks), as saved: state of another layout does not apply."""
        assert self.tiers is not None
        topology = self.tiers.topology
        return {**asdict(self.config), "tiers": f"{topology.describe()}: {[list(node) for node in topology.nodes]}"}

    def send_probe(self, device: torch.device | None = None) -> None:
        """At the round's last bucket: sum the round's measurement over the cross-node group, then the node.

        Every rank takes part while the round measures, with zeros where it compressed nothing.

        Args:
            device: where a rank that compressed nothing makes its zeros.
        """
        sums, self._probe_sums = self._probe_sums, None
        if sums is None:
            return
        assert self.tiers is not None
        total = sums[0].clone() if sums else torch.zeros(2, dtype=torch.float64, device=device)
        self.wait(dist.all_reduce(total, group=self.tiers.cross, async_op=True))
        work = dist.all_reduce(total, group=self.tiers.intra, async_op=True)
        self._probe = (DeferredRead(total, work), self.iteration + _RANK_DECISION_LAG)


def hierarchical_powersgd_hook(
    state: HierarchicalPowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank: the node's mean inside it, PowerSGD between nodes; see the module doc.

    Before ``start_iter`` the owners' gradients cross nodes exactly (a mean all-reduce).

    Args:
        state: a :class:`HierarchicalPowerSGDState`.
        bucket: the gradient bucket DDP hands the hook.
    """
    return dispatch(state, bucket, _sync_bucket)  # type: ignore[arg-type]  # the flat sync's signature, this state


def _sync_bucket(state: HierarchicalPowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's three steps, here and now; the returned future is complete."""
    start = time.perf_counter()
    tiers = state.tiers
    assert tiers is not None
    buffer = bucket.buffer()
    names, gradients = state.names_in(bucket), bucket.gradients()
    state.record_wire_bytes(bucket, 2 * buffer.numel() * buffer.element_size(), intra_node=True)
    state.record_wire_bytes(bucket, 0)  # between nodes: what it owns, if anything, is added as it is sent
    state.wait(dist.all_reduce(buffer, group=tiers.intra, async_op=True))
    buffer.div_(state.ranks_per_node)
    mine = [state.owners[name] == state.local_rank for name in names]
    own_names = [name for name, own in zip(names, mine, strict=True) if own]
    own_gradients = [gradient for gradient, own in zip(gradients, mine, strict=True) if own]
    round_ = None
    if state.iteration >= state.config.start_iter:
        if bucket.index() == 0:
            state.adapt_rank()
        round_ = state._open_round()
        if own_names:
            compress_listed(state, round_, bucket, own_names, own_gradients)
    elif own_gradients:
        flat = torch.cat([gradient.reshape(-1) for gradient in own_gradients])
        _allreduce_mean_inplace(state, bucket, flat)
        _write_back(flat, own_gradients)
    for gradient, own in zip(gradients, mine, strict=True):
        if not own:
            gradient.zero_()
    state.wait(dist.all_reduce(buffer, group=tiers.intra, async_op=True))
    if round_ is not None:
        round_.check([buffer])  # every owner's results: the same verdict on every rank of the world
    if bucket.is_last():
        state.send_probe(buffer.device)
        state._close_round()
    state.add_seconds(time.perf_counter() - start)
    return _completed(buffer)
