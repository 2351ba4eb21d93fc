"""Compression hooks in real 2-process CPU (gloo) DDP: parity, exact bytes, multi-bucket PowerSGD."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt._groups import destroy_all_groups
from lightning_ddpopt.hooks import COMM_HOOKS, PowerSGDConfig, PowerSGDState, powersgd_hook, powersgd_spec
from lightning_ddpopt.ledger import CommLedger
from tests.helpers import LAYERS, WIDTH, StackModel, fit_ddp, jitter_backward, stack_gradient_bytes

PSGD_VARIANTS = {
    "powersgd": PowerSGDConfig(start_iter=2),
    "powersgd_fp16": PowerSGDConfig(start_iter=2, matrix_dtype="fp16"),
    "powersgd_bf16": PowerSGDConfig(start_iter=2, matrix_dtype="bf16"),
    "batched_powersgd": PowerSGDConfig(start_iter=2, batched=True),
}
BUCKET_CAP_MB = 0.3  # three buckets of two Linear(256, 256) layers each
BUCKET_ELEMENTS = 2 * (WIDTH * WIDTH + WIDTH)


def compressed_wire_bytes(config: PowerSGDConfig) -> int:
    """(m + n) x r elements per compressed m x n matrix, everything else uncompressed fp32."""
    width = 2 if config.matrix_dtype != "fp32" else 4
    if config.batched:
        side = math.isqrt(BUCKET_ELEMENTS - 1) + 1
        return 3 * (2 * side * config.rank) * width
    per_layer = (WIDTH + WIDTH) * config.rank * width + WIDTH * 4
    return LAYERS * per_layer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    strategy = OptimizedDDPStrategy(comm_hook="allreduce", bucket_cap_mb=BUCKET_CAP_MB, start_method="fork")
    return fit_ddp(tmp_path_factory.mktemp("allreduce"), strategy, max_steps=4)


@pytest.mark.quick
@pytest.mark.parametrize(("name", "rtol"), [("fp16", 1e-3), ("bf16", 8e-3)])
def test_cast_hooks_match_allreduce_and_send_half(tmp_path, reference, name, rtol):
    strategy = OptimizedDDPStrategy(comm_hook=name, bucket_cap_mb=BUCKET_CAP_MB, start_method="fork")
    ranks = fit_ddp(tmp_path, strategy, max_steps=4)
    for record, ref in zip(ranks, reference, strict=True):
        # One synced step: each element is rounded twice (cast, then the sum): within rtol of itself, and within
        # rtol of the largest gradient for elements near fp16's subnormal range.
        scale = ref["first_grads"].abs().max().item()
        torch.testing.assert_close(record["first_grads"], ref["first_grads"], rtol=rtol, atol=rtol * scale)
        assert [s["wire_bytes"] for s in record["steps"]] == [stack_gradient_bytes() // 2] * 4
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(PSGD_VARIANTS))
def test_powersgd_exact_before_start_then_formula_bytes(tmp_path, reference, name):
    config = PSGD_VARIANTS[name]
    strategy = OptimizedDDPStrategy(comm_hook=config, bucket_cap_mb=BUCKET_CAP_MB, start_method="fork")
    ranks = fit_ddp(tmp_path, strategy, max_steps=4)
    for record, ref in zip(ranks, reference, strict=True):
        assert torch.equal(record["first_grads"], ref["first_grads"])
        wire = [s["wire_bytes"] for s in record["steps"]]
        assert wire == [stack_gradient_bytes()] * 2 + [compressed_wire_bytes(config)] * 2
        assert all(s["sync_rounds"] == 1 for s in record["steps"])
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
def test_registry_presets_use_the_documented_configs():
    assert COMM_HOOKS["powersgd"].summary == powersgd_spec(PowerSGDConfig()).summary
    assert "P/Q sent in fp16" in COMM_HOOKS["powersgd_fp16"].summary
    assert COMM_HOOKS["batched_powersgd"].summary.startswith("batched PowerSGD")


def _multi_bucket_worker(rank: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for name, config in PSGD_VARIANTS.items():
        torch.manual_seed(0)
        module = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
        model = DistributedDataParallel(module, bucket_cap_mb=1)
        ledger = CommLedger()
        state = PowerSGDState(config=config, ledger=ledger)
        state.bind_module(module)
        model.register_comm_hook(state, ledger.record_hook(powersgd_spec(config).hook))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(4, 512, generator=data)).pow(2).mean().backward()
            optimizer.step()
            ledger.close_step()
        params = torch.cat([p.detach().flatten() for p in module.parameters()])
        gathered = [torch.empty_like(params) for _ in range(2)]
        dist.all_gather(gathered, params)
        results[name] = {
            "identical": torch.equal(gathered[0], gathered[1]),
            "finite": bool(params.isfinite().all()),
            "buckets": len(ledger.steps[-1].bucket_bytes),
            "compressed_steps": sum(s.wire_bytes < s.logical_bytes for s in ledger.steps),
        }
    if rank == 0:
        torch.save(results, out)
    del model, state  # see test_powersgd_state: the reducer must not destroy the group
    destroy_all_groups()


def test_every_powersgd_variant_runs_multi_bucket_on_gloo(tmp_path):
    # torch's powerSGD_hook aborts here (gloo "Received data size doesn't match expected size").
    out = str(tmp_path / "results.pt")
    mp.start_processes(_multi_bucket_worker, args=(29531, 12, out), nprocs=2, start_method="fork")
    results = torch.load(out)
    for name, result in results.items():
        # 12 steps: 2 of plain allreduce (start_iter), then compressed.
        assert result == {"identical": True, "finite": True, "buckets": 6, "compressed_steps": 10}, name


@pytest.mark.quick
def test_loading_state_of_another_config_is_refused(gloo_group):
    state = PowerSGDState(config=PowerSGDConfig(rank=2))
    other = PowerSGDState(config=PowerSGDConfig(rank=4))
    with pytest.raises(ValueError, match=r"cannot load PowerSGD state: the PowerSGD config changed \(rank 2 -> 4\)"):
        other.load_state_dict(state.state_dict())


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank=0 must be an int >= 1"),
        ({"start_iter": 1}, "start_iter=1 must be at least 2 with error_feedback or warm_start"),
        ({"start_iter": -1}, "start_iter=-1 must be an int >= 0"),
        ({"min_compression_rate": 0.5}, "min_compression_rate=0.5 must be >= 1"),
        ({"matrix_dtype": "fp8"}, "matrix_dtype='fp8' is not valid; choose one of \\['bf16', 'fp16', 'fp32'\\]"),
        ({"orthogonalization_epsilon": -1.0}, "orthogonalization_epsilon=-1.0 must be >= 0"),
        # Several wrong: the first in the signature's order is named.
        ({"matrix_dtype": "fp8", "orthogonalization_epsilon": -1.0}, "matrix_dtype='fp8' is not valid"),
    ],
)
def test_bad_powersgd_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PowerSGDConfig(**kwargs)


@pytest.mark.quick
def test_start_iter_below_two_is_fine_without_state():
    assert PowerSGDConfig(start_iter=0, error_feedback=False, warm_start=False).start_iter == 0


def _pipelined_worker(rank: int, port: int, world_size: int, steps: int, jitter: bool, out: str) -> None:
    """PowerSGD on many buckets, with the CPU worker thread and without, the ranks' backward passes jittered."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for pipelined in (True, False):
        torch.manual_seed(0)
        layers = [nn.Linear(64, 64) for _ in range(9)]
        module = nn.Sequential(*[block for layer in layers for block in (layer, nn.Tanh())])
        delays = random.Random(rank)
        if jitter:  # each rank sleeps at random points of its backward pass: buckets arrive in any timing
            for layer in layers:
                layer.register_forward_hook(jitter_backward(delays))
        model = DistributedDataParallel(module, bucket_cap_mb=0.01)  # one bucket per layer: 9 buckets
        config = PowerSGDConfig(rank=2, start_iter=2)
        state = PowerSGDState(config=config, pipelined=pipelined)
        state.bind_module(module)
        model.register_comm_hook(state, powersgd_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(rank)
        seen_threads: set[str] = set()
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(4, 64, generator=data)).pow(2).mean().backward()
            optimizer.step()
        seen_threads.add(state._worker.name if state._worker is not None else "backward")
        params = torch.cat([p.detach().flatten() for p in module.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(gathered, params)
        results[pipelined] = {
            "params": params,
            "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
            "iteration": state.iteration,
            "threads": seen_threads,
        }
        state.close()
        del model, state  # see test_powersgd_state: the reducer must not destroy the group
    if rank == 0:
        torch.save(results, out)
    destroy_all_groups()


@pytest.mark.slow
def test_pipelined_powersgd_keeps_ranks_identical_whatever_the_timing(tmp_path):
    # 3 ranks, 9 buckets, random per-rank sleeps inside every backward pass, 60 steps: the worker thread issues
    # every bucket's collectives in DDP's order on every rank, and the result equals the in-hook chain bit for bit.
    out = str(tmp_path / "results.pt")
    mp.start_processes(_pipelined_worker, args=(29561, 3, 60, True, out), nprocs=3, start_method="fork")
    results = torch.load(out)
    for pipelined in (True, False):
        assert results[pipelined]["identical"], pipelined
        assert results[pipelined]["iteration"] == 60
    assert results[True]["threads"] == {"ddpopt-powersgd"} and results[False]["threads"] == {"backward"}
    assert torch.equal(results[True]["params"], results[False]["params"])


class _WorkerProbe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.comm_state
        record = {
            "pipelined": state.pipelined,
            "own_group": state.process_group is not None and state.process_group != dist.group.WORLD,
            "worker": state._worker is not None and state._worker.alive(),
            "iteration": state.iteration,
        }
        torch.save(record, self.out / f"worker{trainer.global_rank}.pt")


def test_strategy_runs_powersgd_on_a_worker_in_a_group_of_its_own(tmp_path):
    # With find_unused_parameters=True DDP all-reduces its unused-parameter map (every step, unused parameters or
    # not) on the backward thread right after the last bucket's hook, while the worker still communicates: on one
    # group the two would interleave differently per rank (measured: gloo aborts the process). The strategy gives
    # the worker a group of its own.
    strategy = OptimizedDDPStrategy(
        comm_hook=PowerSGDConfig(rank=2, start_iter=2),
        find_unused_parameters=True,
        bucket_cap_mb=0.3,
        start_method="fork",
    )
    ranks = fit_ddp(tmp_path, strategy, model=StackModel(), max_epochs=3, callbacks=[_WorkerProbe(tmp_path)])
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    for rank in range(2):
        record = torch.load(tmp_path / f"worker{rank}.pt")
        assert record == {"pipelined": True, "own_group": True, "worker": True, "iteration": 12}
