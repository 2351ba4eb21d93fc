"""NCCL layer: the same strategy and hooks on CUDA GPUs. Skipped without at least two GPUs."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import fit_ddp, stack_gradient_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL DDP"),
]


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16"])
def test_cast_hooks_on_nccl(tmp_path, hook):
    strategy = OptimizedDDPStrategy(comm_hook=hook, bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=3)
    width = 4 if hook == "allreduce" else 2
    for record in ranks:
        assert [s["wire_bytes"] for s in record["steps"]] == [stack_gradient_bytes() // 4 * width] * 3
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


def test_powersgd_multi_bucket_on_nccl(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook=PowerSGDConfig(start_iter=2), bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=20)
    for record in ranks:
        assert all(s["sync_rounds"] == 1 for s in record["steps"])
        assert record["steps"][-1]["wire_bytes"] < stack_gradient_bytes() // 10
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
