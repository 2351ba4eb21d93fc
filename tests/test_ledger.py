"""CommLedger bookkeeping with real DDP buckets on a 1-rank gloo group."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt.hooks import COMM_HOOKS
from lightning_ddpopt.ledger import CommLedger

pytestmark = pytest.mark.quick


def _ddp_with_hook(name: str, ledger: CommLedger) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01)
    spec = COMM_HOOKS[name]
    model.register_comm_hook(spec.build(None, ledger), ledger.record_hook(spec.hook))
    return model


@pytest.mark.parametrize(("name", "wire_width"), [("allreduce", 4), ("fp16", 2), ("bf16", 2)])
def test_bytes_rounds_and_layout_per_step(gloo_group, name, wire_width):
    ledger = CommLedger()
    model = _ddp_with_hook(name, ledger)
    elements = 2 * (64 * 64 + 64)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        [step] = ledger.close_step()
        assert step.sync_rounds == 1
        assert step.logical_bytes == elements * 4
        assert step.wire_bytes == elements * wire_width
        assert step.compression_ratio == 4 / wire_width
        assert step.sync_time_s > 0
    # After DDP's rebuild, a bucket fills until it reaches the 0.01 MiB cap: one layer's bias + weight each.
    assert step.bucket_bytes == ((64 * 64 + 64) * 4,) * 2
    assert ledger.total_steps == 3 and ledger.total_sync_rounds == 3
    assert ledger.total_wire_bytes == 3 * elements * wire_width


def test_rounds_without_optimizer_step_accumulate(gloo_group):
    ledger = CommLedger()
    model = _ddp_with_hook("allreduce", ledger)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
    assert ledger.open_sync_rounds == 3
    [step] = ledger.close_step()
    assert step.sync_rounds == 3 and step.logical_bytes == 3 * 2 * (64 * 64 + 64) * 4
    with model.no_sync():
        model(torch.randn(4, 64)).sum().backward()
    assert [s.sync_rounds for s in ledger.close_step()] == [0]


def test_wire_bytes_outside_a_hook_is_an_error():
    with pytest.raises(RuntimeError, match="add_wire_bytes called outside a hook"):
        CommLedger().add_wire_bytes(0, 10)
    with pytest.raises(ValueError, match="history must be a positive int"):
        CommLedger(history=0)
