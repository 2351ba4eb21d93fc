"""Failure behaviour with real multi-process CPU DDP: a rank that raises or dies ends every rank promptly, the
callbacks' collectives never leave a rank waiting, and the bf16 hook refuses emulated bf16 on GPUs."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.checkpoint import read_saved_run
from lightning_ddpopt.hooks import COMM_HOOKS, PowerSGDConfig, PowerSGDState
from tests.helpers import StackModel, fit_ddp

TIMEOUT = timedelta(seconds=20)


class FailingRank(StackModel):
    """On ``rank``, at the third batch: raise, or kill the process with SIGKILL."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__()
        self.failing_rank, self.how = rank, how

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.failing_rank and batch_idx == 2:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"boom on rank {self.failing_rank}")
        return super().training_step(batch, batch_idx)


def _callbacks() -> list[pl.Callback]:
    return [CommProfiler(every_n_steps=2), StragglerDetector(every_n_steps=2), AMPMonitor()]


@pytest.mark.quick
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_ends_every_rank_with_its_error(tmp_path, rank):
    strategy = OptimizedDDPStrategy(comm_hook="fp16", start_method="fork", timeout=TIMEOUT)
    start = time.perf_counter()
    with pytest.raises(ProcessRaisedException, match=f"RuntimeError: boom on rank {rank}"):
        fit_ddp(tmp_path, strategy, model=FailingRank(rank, "raise"), callbacks=_callbacks(), max_steps=8)
    assert time.perf_counter() - start < TIMEOUT.total_seconds()


@pytest.mark.quick
def test_a_killed_rank_ends_the_run_with_a_clear_error_and_keeps_the_checkpoint(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook=PowerSGDConfig(start_iter=2), start_method="fork", timeout=TIMEOUT)
    every_2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    start = time.perf_counter()
    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGKILL"):
        fit_ddp(
            tmp_path,
            strategy,
            model=FailingRank(1, "kill"),
            callbacks=[*_callbacks(), every_2],
            save_last_to=tmp_path / "last",
            max_steps=8,
        )
    assert time.perf_counter() - start < TIMEOUT.total_seconds()
    # The checkpoint written before the failure is whole: weights, optimizer and both ranks' hook state.
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 and checkpoint["optimizer_states"]
    saved = read_saved_run(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert saved is not None and [saved.hook_state(rank)["iteration"] for rank in range(2)] == [2, 2]


@pytest.mark.quick
@pytest.mark.parametrize("owned", [True, False])
def test_teardown_releases_the_process_group_it_holds(gloo_group, owned):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    strategy = OptimizedDDPStrategy(CPUAccelerator(), comm_hook="powersgd", cluster_environment=LightningEnvironment())
    group = torch.distributed.group.WORLD
    strategy._core.hooks.comm_state = PowerSGDState(config=PowerSGDConfig(), process_group=group)
    strategy._core.hooks._owns_state = owned  # built from the registry, or a user's own state
    strategy.teardown()
    # Lightning destroys the group at exit; a reference kept here would leave it to interpreter shutdown. A
    # user's own state is theirs: it keeps its group for the next fit.
    assert strategy.comm_state.process_group is (None if owned else group)


class DropGradientsOnRank1(pl.Callback):
    """Before AMPMonitor looks, rank 1 has no gradients at all (as a rank whose loss touched no parameter)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 1:
            for param in pl_module.parameters():
                param.grad = None


class NonfiniteProbe(pl.Callback):
    def __init__(self, monitor: AMPMonitor, out) -> None:
        self.monitor, self.out = monitor, out

    def on_train_end(self, trainer, pl_module):
        torch.save((self.monitor.steps, self.monitor.nonfinite_steps), self.out / f"amp{trainer.global_rank}.pt")


@pytest.mark.quick
def test_amp_monitor_check_joins_the_reduce_on_a_rank_without_gradients(tmp_path):
    monitor = AMPMonitor()
    strategy = OptimizedDDPStrategy(start_method="fork", timeout=TIMEOUT)
    start = time.perf_counter()
    fit_ddp(
        tmp_path,
        strategy,
        callbacks=[DropGradientsOnRank1(), monitor, NonfiniteProbe(monitor, tmp_path)],
        max_steps=4,
    )
    assert time.perf_counter() - start < TIMEOUT.total_seconds()
    for rank in (0, 1):
        assert torch.load(tmp_path / f"amp{rank}.pt") == (4, 0)


@pytest.mark.quick
def test_bf16_hook_refuses_emulated_bf16_on_nccl(monkeypatch):
    # A pre-A100 GPU: torch runs bf16 there by emulation, which the hook's promised clear error must not count.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert COMM_HOOKS["bf16"].unsupported_reason("nccl") == (
        "this GPU has no native bfloat16 (it needs compute capability 8.0, A100 or later)"
    )
    assert COMM_HOOKS["bf16"].unsupported_reason("gloo") is None


_LATE_CALLBACK_SCRIPT = '''
import sys, time
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_ddpopt import OptimizedDDPStrategy
from tests.helpers import fit_ddp

_KEEP = []


class LateCallback(pl.Callback):
    """At the end of fit, leave a collective in flight whose Python callback runs on a gloo thread later."""

    def on_train_end(self, trainer, pl_module):
        rank = trainer.global_rank
        if rank == 1:
            time.sleep(1.0)  # rank 0 reaches the end of its script before the collective can complete

        def report(future):
            print(f"late callback ran on rank {rank}", flush=True)
            return future.value()

        work = dist.all_reduce(torch.ones(8), async_op=True)
        _KEEP.append(work.get_future().then(report))


if __name__ == "__main__":
    from pathlib import Path
    strategy = OptimizedDDPStrategy(comm_hook="fp16", start_method="spawn")
    fit_ddp(Path(sys.argv[1]), strategy, callbacks=[LateCallback()], max_steps=2)
'''


def test_a_collective_still_in_flight_at_exit_completes_before_the_interpreter_shuts_down(tmp_path):
    """The exit crash: a Python callback of a gloo future that runs during interpreter shutdown aborts the process
    ("terminate called without an active exception"). The strategy destroys the group at exit, which waits for it."""
    import subprocess
    import sys

    script = tmp_path / "late_callback.py"
    script.write_text(_LATE_CALLBACK_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True, timeout=120, env=env
    )
    output = result.stdout + result.stderr
    assert "terminate called" not in output, output[-3000:]
    assert result.returncode == 0, output[-3000:]
    assert "late callback ran on rank 0" in output and "late callback ran on rank 1" in output
