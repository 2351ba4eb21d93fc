"""GPU readiness on ONE GPU: the CUDA paths' stream order, host syncs, memory and failures.

Written to run the first time a GPU is there (``scripts/gpu_check.sh``); skipped cleanly without CUDA. Two kinds of
run: NCCL with world size 1 (the strategy, every hook family, the ledger, the callbacks, local SGD, a checkpoint),
and two ranks on the same GPU over gloo with CUDA tensors, which gives the stream code real peers. Host syncs are
caught with ``torch.cuda.set_sync_debug_mode("warn")`` and attributed to the file that made them: none may come from
this package in steady state.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_ddpopt
from lightning_ddpopt import AMPMonitor, CommProfiler, LocalSGDConfig, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt._groups import destroy_all_groups
from lightning_ddpopt.hooks import COMM_HOOKS, Int8Config, PowerSGDConfig
from lightning_ddpopt.hooks.registry import int8_spec, powersgd_spec
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.timing import timeline_for
from tests.helpers import fit_ddp

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, one_gpu]

PACKAGE_DIR = str(Path(lightning_ddpopt.__file__).parent)
HOOKS = {
    "allreduce": "allreduce",
    "fp16": "fp16",
    "int8": Int8Config(block_size=256),
    "powersgd": PowerSGDConfig(rank=2, start_iter=2),
    "batched_powersgd": PowerSGDConfig(rank=4, start_iter=2, batched=True),
}


class _SyncsFromThePackage(pl.Callback):
    """Records every synchronising CUDA call that this package's code makes after ``after_step`` steps."""

    def __init__(self, out: Path, after_step: int = 4) -> None:
        self.out, self.after_step = out, after_step
        self._catcher: warnings.catch_warnings | None = None
        self.found: list[str] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.after_step and self._catcher is None:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self.found = [
                f"{w.filename}:{w.lineno}: {w.message}"
                for w in self._caught
                if "synchroniz" in str(w.message) and w.filename.startswith(PACKAGE_DIR)
            ]
        torch.save(self.found, self.out / f"syncs{trainer.global_rank}.pt")


def fit_with_every_callback(tmp_path: Path, strategy: OptimizedDDPStrategy, devices: int) -> list[list[str]]:
    """Fit on ``devices`` GPUs (bf16, every measuring callback gathering every 4 steps); each rank's syncs of ours."""
    fit_ddp(
        tmp_path,
        strategy,
        devices=devices,
        accelerator="gpu",
        precision="bf16-mixed",
        callbacks=[
            CommProfiler(every_n_steps=4, probe_link=False),
            StragglerDetector(every_n_steps=4),
            AMPMonitor(),
            _SyncsFromThePackage(tmp_path),
        ],
        samples=devices * 8 * 16,
        max_steps=16,
    )
    return [torch.load(tmp_path / f"syncs{rank}.pt") for rank in range(devices)]


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_a_run_with_every_callback_makes_no_host_sync_of_ours_on_nccl(tmp_path, hook):
    # World size 1 on NCCL: DDP still calls the hook for every bucket, on the CUDA paths (the callbacks that compare
    # ranks step aside on one rank; tests/test_gpu.py runs them on two GPUs).
    strategy = OptimizedDDPStrategy(comm_hook=HOOKS[hook], bucket_cap_mb=0.3)
    assert fit_with_every_callback(tmp_path, strategy, devices=1) == [[]]


def test_local_sgd_makes_no_host_sync_of_ours_on_nccl(tmp_path):
    probe = _SyncsFromThePackage(tmp_path)
    config = LocalSGDConfig.diloco(sync_every=4, warmup_steps=2, overlap_steps=2)
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(local_sgd=config),
        devices=1,
        accelerator="gpu",
        callbacks=[AMPMonitor(), probe],
        samples=8 * 16,
        max_steps=16,
    )
    assert torch.load(tmp_path / "syncs0.pt") == []


def test_the_untested_backend_is_named_in_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="registered on backend 'nccl', on which this release has not run its tests"):
        fit_ddp(tmp_path, OptimizedDDPStrategy(comm_hook="fp16"), devices=1, accelerator="gpu", max_steps=2)


def test_a_checkpoint_takes_no_gpu_memory_for_the_hook_state(tmp_path):
    class SaveWithProbe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            trainer.save_checkpoint(tmp_path / "saved.ckpt")
            torch.cuda.synchronize()
            torch.save(torch.cuda.max_memory_allocated() - before, tmp_path / "extra.pt")

    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook=HOOKS["powersgd"]),
        devices=1,
        accelerator="gpu",
        callbacks=[SaveWithProbe()],
        max_steps=6,
    )
    assert torch.load(tmp_path / "extra.pt") < 1024 * 1024  # the state goes to the CPU as it is read
    saved = torch.load(tmp_path / "saved.ckpt", weights_only=True, map_location="cpu")["ddpopt"]
    assert all(error.device.type == "cpu" for error in saved["hook_states"][0]["errors"].values())


def test_int8_failure_reraises_the_original_error_on_cuda(tmp_path, monkeypatch):
    from lightning_ddpopt.hooks import int8 as int8_module

    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        device = torch.device("cuda", 0)
        module = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).to(device)
        model = DistributedDataParallel(module, bucket_cap_mb=0.5)
        spec = int8_spec(Int8Config(block_size=256))
        ledger = CommLedger(timeline=timeline_for(device))
        state = spec.build(None, ledger)
        state.bind_module(module)
        model.register_comm_hook(state, ledger.record_hook(spec.hook))
        x = torch.randn(8, 512, device=device)
        model(x).square().mean().backward()

        def broken(*args, **kwargs):
            raise ValueError("the original failure")

        monkeypatch.setattr(int8_module, "unpack", broken)
        with pytest.raises(Exception, match="the original failure"):
            model(x).square().mean().backward()
            torch.cuda.synchronize()
        monkeypatch.undo()
        model.zero_grad()
        model(x).square().mean().backward()  # the failed round is dropped on the device, with no device error
        torch.cuda.synchronize()
        assert state.state_dict()["skipped_rounds"] == 1
        assert all(bool(p.grad.isfinite().all()) for p in module.parameters())
        del model, state
    finally:
        destroy_all_groups()


def _two_ranks_on_one_gpu(rank: int, port: int, hook: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).to(device)
    model = DistributedDataParallel(module, bucket_cap_mb=0.3)
    ledger = CommLedger(timeline=timeline_for(device))
    spec = {"int8": int8_spec(Int8Config(block_size=256)), "powersgd": powersgd_spec(HOOKS["powersgd"])}.get(
        hook, COMM_HOOKS.get(hook)
    )
    state = spec.build(None, ledger)
    if hasattr(state, "bind_module"):
        state.bind_module(module)
    model.register_comm_hook(state, ledger.record_hook(spec.hook))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator(device=device).manual_seed(rank)
    for _ in range(12):
        optimizer.zero_grad()
        model(torch.randn(16, 256, device=device, generator=data)).square().mean().backward()
        optimizer.step()
        ledger.close_step()
    params = torch.cat([p.detach().flatten() for p in module.parameters()]).cpu()
    ledger.flush()
    if rank == 0:
        torch.save({"params": params, "wire": [s.wire_bytes for s in ledger.steps]}, out)
    else:
        torch.save({"params": params}, out + ".1")
    del model, state
    destroy_all_groups()


@pytest.mark.parametrize("hook", ["fp16", "int8", "powersgd"])
def test_two_ranks_on_one_gpu_over_gloo_keep_identical_parameters(tmp_path, hook):
    # Real peers for the stream code: gloo moves the CUDA tensors through the host on its own streams.
    out = str(tmp_path / "result.pt")
    mp.start_processes(_two_ranks_on_one_gpu, args=(29581, hook, out), nprocs=2, start_method="spawn")
    first, second = torch.load(out), torch.load(out + ".1")
    torch.testing.assert_close(first["params"], second["params"], rtol=0, atol=0)
    assert bool(first["params"].isfinite().all())
    assert first["wire"][-1] < 6 * (256 * 256 + 256) * 4  # compressed


def test_overlap_measurement_runs(tmp_path):
    from benchmarks import gpu_overlap

    rows = gpu_overlap.measure(["allreduce", "fp16"], steps=6, width=512, layers=4)
    assert {row["hook"] for row in rows} == {"allreduce", "fp16"}
    assert all(0.0 <= row["hidden"] <= 1.0 for row in rows if row["hidden"] is not None)
