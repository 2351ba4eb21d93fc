"""Gradients inside a local SGD island: all-reduced over the island's ranks while the replicas train apart.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

With local SGD islands (``LocalSGDConfig.replica``) DDP still syncs gradients every step, over the world group
it was built with. :func:`island_hook` wraps the strategy's hook: in the warm-up (every rank in step) it runs that
hook unchanged; in the local phase it averages the bucket over this rank's island only, in the bucket's own
precision (the island is the fast link: a node), so the island's ranks keep identical parameters and nothing
crosses the islands between parameter syncs. The ledger counts those bytes as intra-node bytes (none cross).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.base import CommHookState

__all__ = ["IslandState", "island_hook"]


@dataclass(kw_only=True)
class IslandState(CommHookState):
    """The state of :func:`island_hook`.

    Args:
        island: returns the island's group (``None`` once it was destroyed at teardown).
        local: whether local SGD trains apart now (the island's sync), else the warm-up (``hook`` over every rank).
        hook: the strategy's hook for the warm-up, and ``hook_state`` its state.
    """

    island: Callable[[], dist.ProcessGroup | None]
    local: Callable[[], bool]
    hook: Callable[..., torch.futures.Future[torch.Tensor]]
    hook_state: object


def island_hook(state: IslandState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The strategy's hook in the warm-up; in the local phase the bucket's mean over the island."""
    if not state.local():
        return state.hook(state.hook_state, bucket)
    group = state.island()
    assert group is not None, "the island's group was destroyed"
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    state.record_wire_bytes(bucket, 0)
    state.record_wire_bytes(bucket, buffer.numel() * buffer.element_size(), intra_node=True)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda future: future.value()[0])
