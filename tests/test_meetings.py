"""The meeting rules' small parts in one process: Exchange's gather in flight and DeferredRead."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.meetings import Exchange

pytestmark = pytest.mark.quick


def test_a_gather_in_passing_arrives_at_the_next_meeting(gloo_group):
    exchange = Exchange()
    assert exchange.arrived() is None
    now = exchange.gather(torch.tensor([1.0, 2.0]), world_size=1, in_passing=False)
    assert torch.equal(now, torch.tensor([[1.0, 2.0]]))
    assert exchange.gather(torch.tensor([3.0, 4.0]), world_size=1, in_passing=True) is None
    assert torch.equal(exchange.arrived(), torch.tensor([[3.0, 4.0]]))
    assert exchange.arrived() is None  # read once


def test_a_gather_in_flight_must_be_read_before_the_next(gloo_group):
    exchange = Exchange()
    exchange.gather(torch.tensor([1.0]), world_size=1, in_passing=True)
    with pytest.raises(AssertionError, match="read the gather in flight"):
        exchange.gather(torch.tensor([2.0]), world_size=1, in_passing=True)


def test_a_deferred_read_waits_for_its_collective_on_the_cpu(gloo_group):
    flag = torch.tensor([3])
    read = DeferredRead(flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
    assert read.read().tolist() == [3]
    assert DeferredRead(torch.tensor(True)).read().item() is True
