"""GPU layer: CUDA-event timing on one GPU; the same strategy, hooks and callbacks on NCCL with two GPUs.

Skipped cleanly where the GPUs are missing.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_ddpopt import CommProfiler, LocalSGDConfig, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.checkpoint import read_saved_run
from lightning_ddpopt.hooks import COMM_HOOKS, PowerSGDConfig
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.timing import CudaTimeline, timeline_for
from tests.helpers import fit_ddp, regression_data, stack_gradient_bytes

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL DDP")
pytestmark = [pytest.mark.gpu]


@one_gpu
def test_cuda_marks_time_the_device_not_the_launch():
    device = torch.device("cuda", 0)
    timeline = timeline_for(device)
    assert isinstance(timeline, CudaTimeline) and timeline.device_clock
    before = timeline.mark()
    host_start = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # a kernel that spins for about 0.1 s at 2 GHz
    after = timeline.mark()
    host_s = time.perf_counter() - host_start
    assert timeline.seconds(after) is None  # still running: resolving never waits
    device_s = timeline.wait(after) - timeline.wait(before)
    assert device_s > 0.02 and device_s > 20 * host_s  # the kernel's time, not its launch's


@one_gpu
def test_ledger_on_cuda_takes_no_host_sync_per_step(tmp_path):
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        device = torch.device("cuda", 0)
        ledger = CommLedger(timeline=timeline_for(device))
        model = DistributedDataParallel(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).to(device))
        spec = COMM_HOOKS["fp16"]
        model.register_comm_hook(spec.build(None, ledger), ledger.record_hook(spec.hook))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(64, 1024, device=device)

        def step() -> None:
            ledger.add_micro_batch(64)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            ledger.close_step()

        for _ in range(3):  # DDP builds and rebuilds its buckets
            step()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call from here on raises
        try:
            for _ in range(20):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ledger.flush()
        assert ledger.total_steps == ledger.closed_steps == 23
        records = list(ledger.steps)[3:]
        assert all(r.wire_bytes == 2 * (1024 * 1024 + 1024) * 2 and r.sync_time_s > 0 for r in records)
        assert all(r.step_time_s is not None and r.step_time_s >= r.sync_time_s for r in records)
    finally:
        torch.distributed.destroy_process_group()


@two_gpus
@pytest.mark.parametrize("measured", [False, True], ids=["alone", "with_comm_profiler"])
def test_the_default_allreduce_on_nccl_is_ddps_own_unless_something_measures(tmp_path, measured):
    # Nothing reads the ledger: DDP's C++ allreduce, no Python call per bucket. A CommProfiler: our hook, measured.
    strategy = OptimizedDDPStrategy(bucket_cap_mb=0.3, start_method="spawn")
    callbacks = [CommProfiler(every_n_steps=1, probe_link=False, report=False)] if measured else []
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=3, callbacks=callbacks)
    for record in ranks:
        assert record["ddp_comm_hook"] == ("allreduce_mean_hook" if measured else None)
        assert [s["wire_bytes"] for s in record["steps"]] == ([stack_gradient_bytes()] * 3 if measured else [])
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@two_gpus
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_cast_hooks_on_nccl(tmp_path, hook):
    strategy = OptimizedDDPStrategy(comm_hook=hook, bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=3)
    for record in ranks:
        assert [s["wire_bytes"] for s in record["steps"]] == [stack_gradient_bytes() // 2] * 3
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@two_gpus
def test_powersgd_multi_bucket_on_nccl(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook=PowerSGDConfig(start_iter=2), bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=20)
    for record in ranks:
        assert all(s["sync_rounds"] == 1 for s in record["steps"])
        assert record["steps"][-1]["wire_bytes"] < stack_gradient_bytes() // 10
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@two_gpus
def test_straggler_named_from_cuda_events_on_nccl(tmp_path):
    from tests.test_profiling import DetectorProbe, slow_collate_on_rank

    detector = StragglerDetector(every_n_steps=4)
    loader = DataLoader(regression_data(64), batch_size=4, collate_fn=slow_collate_on_rank(1, 0.2))
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook="fp16", start_method="spawn"),
        loader=loader,
        callbacks=[CommProfiler(every_n_steps=4), detector, DetectorProbe(detector, str(tmp_path))],
        accelerator="gpu",
        max_steps=8,
    )
    last = torch.load(tmp_path / "detector.pt")
    assert last["is_straggler"] and last["slowest_rank"] == 1 and last["phase"] == "data"
    assert last["per_rank_ms"]["0"]["wait"] > 150


@two_gpus
def test_int8_on_nccl(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook="int8", bucket_cap_mb=0.3, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=4)
    for record in ranks:
        # Three buckets, each 2 ranks x 65 blocks of 1024 int8 elements plus a 4-byte scale per block.
        assert [s["wire_bytes"] for s in record["steps"]] == [3 * 2 * 65 * (1024 + 4)] * 4
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@two_gpus
@pytest.mark.parametrize("compression", ["fp16", "int8"])
def test_local_sgd_on_nccl(tmp_path, compression):
    # 8 steps, warm-up 2, H = 3: syncs at steps 5 and 8 over NCCL, parameters identical after the last one.
    config = LocalSGDConfig.diloco(sync_every=3, warmup_steps=2, compression=compression)
    strategy = OptimizedDDPStrategy(local_sgd=config, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, accelerator="gpu", max_steps=8)
    for record in ranks:
        assert [s["sync_rounds"] for s in record["steps"]] == [1, 1, 0, 0, 1, 0, 0, 1]
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@two_gpus
@pytest.mark.parametrize(
    "kwargs",
    [
        {"comm_hook": PowerSGDConfig(rank=2, start_iter=2)},
        {"comm_hook": "int8"},
        {"local_sgd": LocalSGDConfig.diloco(sync_every=4, warmup_steps=2, overlap_steps=2)},
    ],
    ids=["powersgd", "int8", "diloco-overlap"],
)
def test_the_callbacks_gathers_make_no_host_sync_of_ours_on_nccl(tmp_path, kwargs):
    from tests.test_gpu_ready import fit_with_every_callback

    strategy = OptimizedDDPStrategy(bucket_cap_mb=0.3, start_method="spawn", **kwargs)
    assert fit_with_every_callback(tmp_path, strategy, devices=2) == [[], []]


class _SaveAndMeasure(pl.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        trainer.save_checkpoint(self.out / "saved.ckpt")
        torch.cuda.synchronize()
        torch.save(torch.cuda.max_memory_allocated() - before, self.out / f"extra{trainer.global_rank}.pt")


@two_gpus
def test_a_checkpoint_gathers_hook_state_without_gpu_memory_on_nccl(tmp_path):
    # The states travel rank by rank over a gloo group of the strategy's own; before, gather_object put every rank's
    # pickled state into CUDA tensors (world size x the largest on rank 0).
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook=PowerSGDConfig(rank=2, start_iter=2), start_method="spawn"),
        accelerator="gpu",
        callbacks=[_SaveAndMeasure(tmp_path)],
        max_steps=6,
    )
    assert all(torch.load(tmp_path / f"extra{rank}.pt") < 1024 * 1024 for rank in (0, 1))
    saved = read_saved_run(tmp_path / "saved.ckpt")
    assert saved is not None and all("iteration" in saved.hook_state(rank) for rank in range(2))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs for 2 nodes x 2 ranks on NCCL")
def test_two_tier_hooks_on_nccl(tmp_path):
    # 2 emulated nodes of 2 GPUs each (CUDA_VISIBLE_DEVICES per node), every two-tier hook with hierarchical=True.
    from tests.test_hierarchical import _records, _run_nodes

    fits = ["allreduce", "bf16", "fp16_tiers", "int8_tiers", "powersgd"]
    _run_nodes(tmp_path, 2, 2, fits, gpus=True)
    states = {"int8_tiers": "HierarchicalInt8State", "powersgd": "HierarchicalPowerSGDState"}
    for name in fits:
        ranks = _records(tmp_path, name, 4)
        assert {r["state"] for r in ranks} == {states.get(name, "HierarchicalState")}, name
        for r in ranks[1:]:  # every rank ends with the same parameters, bit for bit
            torch.testing.assert_close(r["params"], ranks[0]["params"], rtol=0, atol=0, msg=name)
        assert all(intra > 0 for r in ranks for _, _, intra, _ in r["steps"]), name
