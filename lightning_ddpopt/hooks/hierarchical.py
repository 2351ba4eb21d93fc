"""Two-tier gradient sync for N nodes x M ranks: the bucket's own precision inside a node, compressed between nodes.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

Each bucket's sync, on every rank (the groups are :class:`lightning_ddpopt.topology.TierGroups`'):

1. **inside the node**, in the bucket's own precision: the bucket's sum over the node's M ranks, of which local rank
   ``l`` keeps shard ``l`` (a 1/M slice; the bucket is zero-padded to a multiple of M). NCCL reduce-scatters; gloo,
   whose reduce-scatter is slower than its all-reduce on a CPU, all-reduces the bucket and keeps the slice;
2. **between the nodes**: the shard, divided by the world size and cast to the hook's dtype (bf16; left as it is
   for ``allreduce``; fp16: see below), is all-reduced over the N ranks of the same local rank, one per node: 1/M of
   the bucket crosses nodes from each rank, M shards in parallel over each node's link;
3. **inside the node**: the reduced shards are all-gathered into the bucket.

Every rank ends with the same bucket. Each node's link carries ``2 (N-1)/N`` of the compressed bucket, where a flat
ring over all N x M ranks puts ``2 (NM-1)/NM`` of it on the link between two nodes. fp16 is not divided by the world
size before the cast: the N ranks first agree on the shard's peak (a 4-byte all-reduce of the maximum), the shard
crosses multiplied by the power of two :func:`~lightning_ddpopt.hooks.compression.fp16_scale` gives for it, and the
sum is divided by that scale and the world size in fp32, so no world size makes small gradients underflow. The
ledger counts the cross-node payload (the shard in the hook's dtype, and fp16's peak) as the hook's wire bytes, and
the intra-node payload (the padded bucket in its own precision, the size of an all-reduce with the inner tier's
traffic) separately (:attr:`~lightning_ddpopt.ledger.StepRecord.intra_node_bytes`).

On a CPU the three stages are a pipeline: each runs on a thread of its own and issues its collectives on a group of
its own (:attr:`~lightning_ddpopt.topology.TierGroups.intra`, ``cross``, ``intra_gather``), bucket after bucket in
DDP's order, so every rank issues each group's collectives in one order; while one bucket crosses nodes, the next
is summed inside the node and the one before is gathered, and the backward pass goes on. On CUDA the stages are
issued in the hook call on a side stream (:mod:`lightning_ddpopt.hooks.streams`), whose waits order that stream
only. Memory beyond DDP's buckets, per bucket in flight: its shard in the hook's dtype and a clone for the gather,
O(P / M), and a zero-padded copy of a bucket whose size M does not divide, O(P).
"""

import functools

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._worker import TierStages, run_all
from lightning_ddpopt.hooks.base import CommHookState, TwoTierForm, squared_norm
from lightning_ddpopt.hooks.compression import fp16_scale, peak
from lightning_ddpopt.hooks.streams import SideStreams
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.topology import TierGroups

__all__ = ["HierarchicalState", "cast_form", "hierarchical_hook"]


class HierarchicalState(CommHookState):
    """The state of :func:`hierarchical_hook`: the two tiers' groups and the dtype that crosses nodes.

    Args:
        tiers: the intra- and cross-node groups (the strategy makes them at setup).
        dtype: what crosses nodes: ``None`` (the bucket's own precision), ``torch.float16`` or ``torch.bfloat16``.
        process_group: the model's group (its size is the world size the gradients are averaged over).
        ledger: where the hook reports its bytes.
    """

    def __init__(
        self,
        *,
        tiers: TierGroups,
        dtype: torch.dtype | None,
        process_group: dist.ProcessGroup | None = None,
        ledger: CommLedger | None = None,
    ) -> None:
        super().__init__(process_group=process_group, ledger=ledger)
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype!r} must be None, torch.float16 or torch.bfloat16")
        self.tiers = tiers
        self.dtype = dtype
        self.ranks_per_node = tiers.topology.ranks_per_node
        self.local_rank = tiers.topology.local_rank
        self._streams = SideStreams()
        #: On a CPU, one thread per stage (inside, between, gather), each issuing on a group of its own.
        self.stages = TierStages("ddpopt-hierarchical")

    def close(self) -> bool:
        """Stop the stages' threads (see :meth:`TierStages.close`)."""
        return self.stages.close()


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank in two tiers: inside each node in its own precision, between nodes cast.

    Args:
        state: a :class:`HierarchicalState`.
        bucket: the gradient bucket DDP hands the hook.
    """
    state.stages.check()  # before the bytes are recorded: an earlier bucket failed
    buffer = bucket.buffer()
    shard_numel = -(-buffer.numel() // state.ranks_per_node)
    cross_dtype = state.dtype or buffer.dtype
    # fp16: and the shard's fp32 peak, for the scale the nodes agree on.
    state.record_wire_bytes(bucket, shard_numel * cross_dtype.itemsize + (4 if state.dtype == torch.float16 else 0))
    state.record_wire_bytes(bucket, shard_numel * state.ranks_per_node * buffer.element_size(), intra_node=True)
    sync = _BucketSync(state, bucket, shard_numel)
    if buffer.is_cuda:
        return state._streams.run(buffer, lambda: run_all(sync))
    return state.stages.run(state, sync, bucket.index())


class _BucketSync:
    """One bucket's three stages (a :class:`~lightning_ddpopt.hooks._worker.TierSync`) for the casts."""

    def __init__(self, state: HierarchicalState, bucket: dist.GradBucket, shard_numel: int) -> None:
        self.state, self.bucket = state, bucket
        self.buffer = bucket.buffer()
        self.padded = self.buffer
        self.shard_numel = shard_numel
        self.ranks_per_node = state.ranks_per_node
        self.send: torch.Tensor | None = None
        self.shards: list[torch.Tensor] = []
        #: fp16: what the shard's reduced sum is divided by (the world size, times the scale).
        self.divisor: torch.Tensor | None = None

    def abandon(self) -> None:
        """Nothing is kept across steps."""

    def reduce_inside(self) -> None:
        """The node's sum; this rank keeps its shard, divided by the world size and cast to cross (fp16: later)."""
        state, buffer = self.state, self.buffer
        numel = self.shard_numel * self.ranks_per_node
        if numel != buffer.numel():
            self.padded = torch.zeros(numel, dtype=buffer.dtype, device=buffer.device)
            self.padded[: buffer.numel()].copy_(buffer)
        self.shards = list(self.padded.view(self.ranks_per_node, self.shard_numel).unbind(0))
        shard = self.shards[state.local_rank]
        tiers = state.tiers
        if dist.get_backend(tiers.intra) == "nccl":
            reduced = torch.empty_like(shard)
            state.wait(dist.reduce_scatter_tensor(reduced, self.padded, group=tiers.intra, async_op=True))
            shard.copy_(reduced)
        else:
            state.wait(dist.all_reduce(self.padded, group=tiers.intra, async_op=True))
        if state.dtype != torch.float16:
            shard.div_(state.world_size)
            self._cast(shard)

    def _cast(self, shard: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Cast the shard to cross; a measured round records what the cast dropped, in the gradients' units."""
        state = self.state
        self.send = shard if state.dtype is None else shard.to(state.dtype)
        if self.send is not shard and state.measuring:
            given, dropped = squared_norm(shard), squared_norm(shard - self.send.to(shard.dtype))
            if scale is not None:  # the step's error sums the buckets: each in the same units
                given, dropped = given / scale.double().square(), dropped / scale.double().square()
            state.record_compression(self.bucket, given, dropped)

    def reduce_between(self) -> None:
        """The shard's sum over the nodes, among the ranks of this local rank.

        fp16: the nodes first agree on the shard's peak (a 4-byte all-reduce), and the shard crosses scaled by
        :func:`~lightning_ddpopt.hooks.compression.fp16_scale`, so no world size makes it underflow.
        """
        state = self.state
        cross = state.tiers.cross
        if state.dtype == torch.float16:
            shard = self.shards[state.local_rank]
            top = peak(shard)
            state.wait(dist.all_reduce(top, op=dist.ReduceOp.MAX, group=cross, async_op=True))
            scale = fp16_scale(top, dist.get_world_size(cross))
            self._cast(shard.mul_(scale), scale)
            self.divisor = scale * state.world_size
        assert self.send is not None
        state.wait(dist.all_reduce(self.send, group=cross, async_op=True))

    def gather(self) -> None:
        """Every reduced shard from the node's ranks into the bucket."""
        state = self.state
        shard = self.shards[state.local_rank]
        assert self.send is not None
        if self.send is not shard:
            shard.copy_(self.send)
        if self.divisor is not None:
            shard.div_(self.divisor)
        state.wait(dist.all_gather(self.shards, shard.clone(), group=state.tiers.intra_gather, async_op=True))
        if self.padded is not self.buffer:
            self.buffer.copy_(self.padded[: self.buffer.numel()])


def _cast_state(
    dtype: torch.dtype | None,
    *,
    tiers: TierGroups,
    process_group: dist.ProcessGroup,
    ledger: CommLedger,
    **_: object,
) -> CommHookState:
    return HierarchicalState(tiers=tiers, dtype=dtype, process_group=process_group, ledger=ledger)


def cast_form(dtype: torch.dtype | None) -> TwoTierForm:
    """The casts' two-tier form (:mod:`~lightning_ddpopt.hooks.hierarchical`): the shard crosses nodes in ``dtype``.

    Args:
        dtype: what crosses the nodes (``None``: the bucket's own dtype).
    """
    crossing = "the bucket's precision" if dtype is None else {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return TwoTierForm(hierarchical_hook, functools.partial(_cast_state, dtype), crossing)
