"""Bucket planning: the "auto" heuristic and the predicted layout."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_ddpopt import OptimizedDDPStrategy, buckets
from lightning_ddpopt.buckets import (
    AUTO_LATENCY_BOUNDS_S,
    BucketController,
    auto_bucket_cap_mb,
    gradient_bytes,
    plan_buckets,
)
from lightning_ddpopt.units import MIB, format_bytes

pytestmark = pytest.mark.quick


def test_auto_targets_eight_buckets_between_the_latency_floor_and_the_ceiling():
    # 400 MiB of gradients on 2 ranks: 400 / 8 = 50 MiB, between the floor and 100 MiB.
    assert auto_bucket_cap_mb(400 * MIB, 2) == 50.0
    # 4 GiB: capped at 100 MiB.
    assert auto_bucket_cap_mb(4096 * MIB, 2) == 100.0
    # 4 MiB on 2 ranks: 0.5 MiB would be latency-bound; floor = 2 x 1 x 50 us x 1.25 GB/s / 0.1 = 1.25e6 bytes.
    assert auto_bucket_cap_mb(4 * MIB, 2) == round(1.25e6 / MIB, 3)
    # The floor grows with the ring: 8 ranks -> 14 messages -> 8.75e6 bytes.
    assert auto_bucket_cap_mb(40 * MIB, 8) == round(8.75e6 / MIB, 3)
    # Never above the gradients themselves; one process needs no buckets of its own size.
    assert auto_bucket_cap_mb(MIB // 2, 8) == 0.5
    assert auto_bucket_cap_mb(400 * MIB, 1) == 25.0


def test_a_measured_latency_replaces_the_ring_model_in_the_floor():
    # 32 ranks: the ring model's floor is 62 x 50 us x 1.25 GB/s / 0.1 = 38.75e6 bytes, all of a 4 MiB model.
    assert auto_bucket_cap_mb(4 * MIB, 32) == 4.0
    # An all-reduce measured at 64 us (a tree, not 62 hops): floor 64 us x 1.25 GB/s / 0.1 = 0.8e6 bytes.
    assert auto_bucket_cap_mb(4 * MIB, 32, latency_s=64e-6) == round(0.8e6 / MIB, 3)
    # Above the floor the target of 8 buckets holds whatever the latency.
    assert auto_bucket_cap_mb(400 * MIB, 32, latency_s=64e-6) == 50.0


def _latency_worker(rank: int, port: int, out: str) -> None:
    # Spawned (a fresh interpreter): a rank forked from pytest after earlier tests hung on torch 2.4 in two of three
    # runs (a lock some thread of the parent held at the fork).
    buckets.AUTO_MEASURED_FROM_RANKS = 2
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    module = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    measured = BucketController("auto")
    cap = measured.cap_for(module, 2, torch.device("cpu"))
    reused = BucketController("auto")  # a checkpoint's latency: nothing measured, the cap from this model
    again = reused.cap_for(nn.Linear(256, 256), 2, torch.device("cpu"), reused_latency_s=measured.latency_s)
    torch.save(
        {
            "cap": cap,
            "latency": measured.latency_s,
            "note": measured.latency_note(),
            "reused": (again, reused.latency_s, reused.latency_note(reused=True)),
        },
        f"{out}.{rank}",
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_auto_measures_the_latency_at_scale_the_same_on_every_rank(tmp_path):
    # From AUTO_MEASURED_FROM_RANKS ranks (lowered to 2 in the ranks, for this test) "auto" times an all-reduce.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "latency")
    mp.start_processes(_latency_worker, args=(port, out), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert ranks[0] == ranks[1]  # agreed: the slowest rank's median, so the same buckets everywhere
    latency, cap = ranks[0]["latency"], ranks[0]["cap"]
    low, high = AUTO_LATENCY_BOUNDS_S
    # A power of two microseconds, or a bound where the measurement fell outside them.
    assert latency in (low, high) or (low <= latency <= high and math.log2(latency / 1e-6).is_integer())
    assert cap == auto_bucket_cap_mb(2 * (256 * 256 + 256) * 4, 2, latency)
    floor = latency * 1.25e9 / 0.1
    assert ranks[0]["note"] == (
        f"ddpopt: bucket_cap_mb='auto': an all-reduce of 4 bytes over 2 ranks takes {latency * 1e6:g} us (the "
        f"slowest rank's median of 20, to a power of two, within 5 us..5 ms); buckets of at least "
        f"{format_bytes(floor)} keep it under 10% of a bucket's time at 10 Gbit/s: cap {cap:g} MiB"
    )
    # Resumed on as many ranks: the checkpoint's latency, the cap from the model now trained (another size here).
    again, reused_latency, note = ranks[0]["reused"]
    assert (again, reused_latency) == (auto_bucket_cap_mb((256 * 256 + 256) * 4, 2, latency), latency)
    assert f"takes {latency * 1e6:g} us (the checkpoint's measurement)" in note


def test_plan_predicts_layout_in_reverse_definition_order():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4))
    plan = plan_buckets(model, 1.0, world_size=2)
    layer = (512 * 512 + 512) * 4
    head = (512 * 4 + 4) * 4
    assert plan.gradient_bytes == 2 * layer + head
    # Reverse order: head + first big layer reaches 1 MiB, then the last layer.
    assert plan.predicted_bucket_bytes == (head + layer, layer)
    assert plan.cap_mb == 1.0 and plan.requested == 1.0


def test_plan_auto_and_frozen_parameters():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    model[0].requires_grad_(False)
    plan = plan_buckets(model, "auto", world_size=2)
    assert plan.gradient_bytes == gradient_bytes(model[1].parameters()) == (1024 * 1024 + 1024) * 4
    assert plan.cap_mb == auto_bucket_cap_mb(plan.gradient_bytes, 2)
    assert sum(plan.predicted_bucket_bytes) == plan.gradient_bytes


def test_gradient_bytes_counts_dtype_width():
    half = nn.Linear(10, 10).to(torch.float16)
    assert gradient_bytes(half.parameters()) == 110 * 2


def test_autotune_is_deprecated_and_means_auto():
    with pytest.deprecated_call(match=r"bucket_cap_mb='autotune' is deprecated and now means 'auto'"):
        assert buckets.validate_bucket_cap_mb("autotune") == "auto"
    with pytest.deprecated_call(match="autotune"):
        strategy = OptimizedDDPStrategy(bucket_cap_mb="autotune")
    assert strategy._core.buckets.requested == "auto"
