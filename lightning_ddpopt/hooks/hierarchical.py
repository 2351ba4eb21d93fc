"""Two-tier gradient sync for N nodes x M ranks: the bucket's own precision inside a node, compressed between nodes.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

Each bucket's sync, on every rank (the groups are :class:`lightning_ddpopt.topology.TierGroups`'):

1. **inside the node**, in the bucket's own precision: the bucket's sum over the node's M ranks, of which local rank
   ``l`` keeps shard ``l`` (a 1/M slice; the bucket is zero-padded to a multiple of M). NCCL reduce-scatters; gloo,
   whose reduce-scatter is slower than its all-reduce on a CPU, all-reduces the bucket and keeps the slice;
2. **between the nodes**: the shard, divided by the world size and cast to the hook's dtype (fp16 or bf16; left as
   it is for ``allreduce``), is all-reduced over the N ranks of the same local rank, one per node: 1/M of the bucket
   crosses nodes from each rank, M shards in parallel over each node's link;
3. **inside the node**: the reduced shards are all-gathered into the bucket.

Every rank ends with the same bucket. Each node's link carries ``2 (N-1)/N`` of the compressed bucket, where a flat
ring over all N x M ranks puts ``2 (NM-1)/NM`` of it on the link between two nodes. What fp16 casts is a node's sum
divided by the world size, not one rank's gradient divided by it: values M times larger on average, so fewer small
gradients underflow. The ledger counts the cross-node payload (the shard, in the hook's dtype) as the hook's wire
bytes, and the intra-node payload (the padded bucket in its own precision, the size of an all-reduce with the inner
tier's traffic) separately (:attr:`~lightning_ddpopt.ledger.StepRecord.intra_node_bytes`).

On a CPU the three stages are a pipeline: each runs on a thread of its own and issues its collectives on a group of
its own (:attr:`~lightning_ddpopt.topology.TierGroups.intra`, ``cross``, ``intra_gather``), bucket after bucket in
DDP's order, so every rank issues each group's collectives in one order; while one bucket crosses nodes, the next
is summed inside the node and the one before is gathered, and the backward pass goes on. On CUDA the stages are
issued in the hook call on a side stream (:mod:`lightning_ddpopt.hooks.streams`), whose waits order that stream
only. Memory beyond DDP's buckets, per bucket in flight: its shard in the hook's dtype and a clone for the gather,
O(P / M), and a zero-padded copy of a bucket whose size M does not divide, O(P).
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.base import CommHookState, squared_norm
from lightning_ddpopt.hooks.streams import SideStreams
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.topology import TierGroups

__all__ = ["HierarchicalState", "hierarchical_hook"]


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
        self._stages: list[Worker] = []
        self.failed: BaseException | None = None

    def close(self) -> bool:
        """Stop the stages' threads, first to last, each after its jobs; False at the first still busy.

        The later stages are then kept: the busy one may still hand them a bucket.
        """
        for index, stage in enumerate(self._stages):
            if not stage.stop():
                self._stages = self._stages[index:]
                return False
        self._stages = []
        return True


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank in two tiers: inside each node in its own precision, between nodes cast.

    Args:
        state: a :class:`HierarchicalState`.
        bucket: the gradient bucket DDP hands the hook.
    """
    if state.failed is not None:
        raise RuntimeError(f"the hierarchical sync stopped after an earlier bucket failed: {state.failed!r}")
    buffer = bucket.buffer()
    shard_numel = -(-buffer.numel() // state.ranks_per_node)
    cross_dtype = state.dtype or buffer.dtype
    state.record_wire_bytes(bucket, shard_numel * cross_dtype.itemsize)
    state.record_wire_bytes(bucket, shard_numel * state.ranks_per_node * buffer.element_size(), intra_node=True)
    sync = _BucketSync(state, bucket, shard_numel)
    if buffer.is_cuda:
        return state._streams.run(buffer, sync.run_all)
    if not state._stages or not all(stage.alive() for stage in state._stages):
        state._stages = [Worker(f"ddpopt-hierarchical-{name}") for name in ("inside", "between", "gather")]
    sync.future = torch.futures.Future()
    inside, between, gather = state._stages
    sync.then(
        inside,
        sync.reduce_inside,
        lambda: sync.then(between, sync.reduce_between, lambda: sync.then(gather, sync.gather, None)),
    )
    return sync.future


class _BucketSync:
    """One bucket's three stages; on a CPU each runs on its stage's thread and hands the bucket to the next."""

    def __init__(self, state: HierarchicalState, bucket: dist.GradBucket, shard_numel: int) -> None:
        self.state, self.bucket = state, bucket
        self.buffer = bucket.buffer()
        self.padded = self.buffer
        self.shard_numel = shard_numel
        self.ranks_per_node = state.ranks_per_node
        self.future: torch.futures.Future[torch.Tensor] | None = None
        self.send: torch.Tensor | None = None
        self.shards: list[torch.Tensor] = []

    def then(self, stage: Worker, work: Callable[[], None], after: Callable[[], None] | None) -> None:
        """Run ``work`` on ``stage``'s thread, then ``after`` (which hands the bucket on), or complete the future."""
        future = self.future
        assert future is not None

        def job() -> None:
            state = self.state
            if state.failed is not None:  # issuing this bucket's collectives would put this rank out of step
                error = RuntimeError(f"an earlier bucket's hierarchical sync failed: {state.failed!r}")
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result
                return
            start = time.perf_counter()
            try:
                work()
            except Exception as error:  # DDP waits on the future: never leave it pending
                state.failed = error
                future.set_exception(error)  # type: ignore[arg-type]
                return
            finally:
                state.add_seconds(time.perf_counter() - start)
            if after is None:
                future.set_result(self.buffer)
            else:
                after()

        stage.submit(job)

    def run_all(self) -> torch.futures.Future[torch.Tensor]:
        """Every stage here and now (CUDA: on the side stream, whose waits order that stream only)."""
        self.reduce_inside()
        self.reduce_between()
        self.gather()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[self.buffer.device])
        future.set_result(self.buffer)
        return future

    def reduce_inside(self) -> None:
        """The node's sum; this rank keeps its shard, divided by the world size and cast for the trip between nodes."""
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
        shard.div_(state.world_size)
        self.send = shard if state.dtype is None else shard.to(state.dtype)
        if self.send is not shard and state.measuring:
            dropped = squared_norm(shard - self.send.to(shard.dtype))
            state.record_compression(self.bucket, squared_norm(shard), dropped)

    def reduce_between(self) -> None:
        """The shard's sum over the nodes, among the ranks of this local rank."""
        assert self.send is not None
        self.state.wait(dist.all_reduce(self.send, group=self.state.tiers.cross, async_op=True))

    def gather(self) -> None:
        """Every reduced shard from the node's ranks into the bucket."""
        state = self.state
        shard = self.shards[state.local_rank]
        assert self.send is not None
        if self.send is not shard:
            shard.copy_(self.send)
        state.wait(dist.all_gather(self.shards, shard.clone(), group=state.tiers.intra_gather, async_op=True))
        if self.padded is not self.buffer:
            self.buffer.copy_(self.padded[: self.buffer.numel()])
