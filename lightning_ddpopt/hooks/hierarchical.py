"""Two-tier gradient sync for N nodes x M ranks: full precision inside a node, compressed only between nodes.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

Each bucket's sync, on every rank (the groups are :class:`lightning_ddpopt.topology.TierGroups`'):

1. **inside the node**, in the bucket's own precision: the bucket's sum over the node's M ranks, of which local rank
   ``l`` keeps shard ``l`` (a 1/M slice; the bucket is zero-padded to a multiple of M). NCCL reduce-scatters; gloo,
   which lacks a reduce-scatter in older torch releases, all-reduces the bucket and keeps the slice;
2. **between the nodes**: the shard, divided by the world size and cast to the hook's dtype (fp32, fp16 or bf16),
   is all-reduced over the N ranks of the same local rank, one per node: only 1/M of the bucket crosses nodes from
   each rank, M shards in parallel over each node's link;
3. **inside the node**: the reduced shards are all-gathered into the bucket.

Every rank ends with the same bucket. Against the flat cast hooks, the slow link carries the same compressed bytes
in all (a ring all-reduce of the bucket over N nodes instead of N x M ranks: its bytes per node do not grow with
M), and fp16's sum runs over N node sums, each already divided by the world size in full precision, so
a rank's small gradients underflow fp16 M times less often. The ledger counts the cross-node payload (the shard, in
the hook's dtype) as the hook's wire bytes, and the intra-node payload (the bucket in its own precision)
separately (:attr:`~lightning_ddpopt.ledger.StepRecord.intra_node_bytes`).

On a CPU a bucket's three stages run on a worker thread of the state's own, bucket after bucket in DDP's order (the
backward pass goes on meanwhile); on CUDA they are issued in the hook call on a side stream
(:mod:`lightning_ddpopt.hooks.streams`), whose waits order that stream only.
"""

import time

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
        self._worker: Worker | None = None

    def close(self) -> bool:
        """Stop the worker thread (its jobs finished first); False if it is still busy."""
        worker, self._worker = self._worker, None
        return worker is None or worker.stop()


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over every rank in two tiers: inside each node in full precision, between nodes cast.

    Args:
        state: a :class:`HierarchicalState`.
        bucket: the gradient bucket DDP hands the hook.
    """
    buffer = bucket.buffer()
    shard_numel = -(-buffer.numel() // state.ranks_per_node)
    cross_dtype = state.dtype or buffer.dtype
    state.record_wire_bytes(bucket, shard_numel * cross_dtype.itemsize)
    state.record_wire_bytes(bucket, shard_numel * state.ranks_per_node * buffer.element_size(), intra_node=True)
    if buffer.is_cuda:
        return state._streams.run(buffer, lambda: _completed(_sync(state, bucket, shard_numel)))
    if state._worker is None or not state._worker.alive():
        if state._worker is not None and state._worker.failed is not None:
            failed = state._worker.failed
            raise RuntimeError(f"the hierarchical sync stopped after an earlier bucket failed: {failed!r}")
        state._worker = Worker("ddpopt-hierarchical")
    worker = state._worker
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def job() -> None:
        if worker.failed is not None:  # issuing this bucket's collectives would put this rank out of step
            future.set_exception(RuntimeError(f"an earlier bucket's hierarchical sync failed: {worker.failed!r}"))  # type: ignore[arg-type]
            return
        try:
            future.set_result(_sync(state, bucket, shard_numel))
        except Exception as error:  # DDP waits on the future: never leave it pending
            worker.failed = error
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result

    worker.submit(job)
    return future


def _sync(state: HierarchicalState, bucket: dist.GradBucket, shard_numel: int) -> torch.Tensor:
    start = time.perf_counter()
    buffer = bucket.buffer()
    ranks_per_node = state.ranks_per_node
    padded = buffer
    if shard_numel * ranks_per_node != buffer.numel():
        padded = torch.zeros(shard_numel * ranks_per_node, dtype=buffer.dtype, device=buffer.device)
        padded[: buffer.numel()].copy_(buffer)
    shards = list(padded.view(ranks_per_node, shard_numel).unbind(0))
    shard = shards[state.local_rank]
    intra, cross = state.tiers.intra, state.tiers.cross
    if dist.get_backend(intra) == "nccl":
        reduced = torch.empty_like(shard)
        state.wait(dist.reduce_scatter_tensor(reduced, padded, group=intra, async_op=True))
        shard.copy_(reduced)
    else:
        state.wait(dist.all_reduce(padded, group=intra, async_op=True))
    shard.div_(state.world_size)
    send = shard if state.dtype is None else shard.to(state.dtype)
    if send is not shard and state.measuring:
        state.record_compression(bucket, squared_norm(shard), squared_norm(shard - send.to(shard.dtype)))
    state.wait(dist.all_reduce(send, group=cross, async_op=True))
    if send is not shard:
        shard.copy_(send)
    state.wait(dist.all_gather(shards, shard.clone(), group=intra, async_op=True))
    if padded is not buffer:
        buffer.copy_(padded[: buffer.numel()])
    state.add_seconds(time.perf_counter() - start)
    return buffer


def _completed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buffer.device])
    future.set_result(buffer)
    return future
