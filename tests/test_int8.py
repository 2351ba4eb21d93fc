"""The int8 hook in real multi-process CPU (gloo) DDP: parity within one quantisation step, exact bytes on 2 and 3
ranks with buckets that do not divide by the world size, error feedback, many buckets, bad configs."""

from __future__ import annotations

import copy
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
from lightning_ddpopt.hooks import COMM_HOOKS, Int8Config, Int8State, get_hook_spec, int8_hook
from lightning_ddpopt.ledger import CommLedger
from tests.helpers import fit_ddp, jitter_backward, stack_gradient_bytes

BLOCK = 64


def _parity_worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    # Odd sizes: no bucket divides by the world size or the block size; a 0.001 MiB cap makes three buckets
    # (once DDP has rebuilt them).
    module = nn.Sequential(nn.Linear(101, 37), nn.Tanh(), nn.Linear(37, 53), nn.Tanh(), nn.Linear(53, 7))
    alone = copy.deepcopy(module)
    model = DistributedDataParallel(module, bucket_cap_mb=0.001)
    ledger = CommLedger()
    state = Int8State(config=Int8Config(block_size=BLOCK), ledger=ledger)
    state.bind_module(module)
    sizes: dict[int, list[int]] = {}

    def noting_sizes(state, bucket):  # unannotated: DDP checks real types, this module has string annotations
        sizes[bucket.index()] = [g.numel() for g in bucket.gradients()]
        return int8_hook(state, bucket)

    model.register_comm_hook(state, ledger.record_hook(noting_sizes))
    # Ranks see very different gradients (the last rank's are 100x larger), as after a loss spike on one rank.
    inputs = torch.randn(8, 101, generator=torch.Generator().manual_seed(rank))
    inputs *= 100.0 if rank == world_size - 1 else 1.0
    # DDP puts everything in one bucket until its rebuild after the first synchronised backward pass: sync once,
    # then forget that step's error feedback and compare the next sync, at the same weights.
    model(inputs).pow(2).mean().backward()
    ledger.close_step()
    model.zero_grad()
    state.load_shared_state_dict({"iteration": 0})
    model(inputs).pow(2).mean().backward()
    ledger.close_step()

    # Every rank's local gradients, from the same weights without DDP.
    alone(inputs).pow(2).mean().backward()
    flat_local = torch.cat([p.grad.flatten() for p in alone.parameters()])
    gathered = [torch.empty_like(flat_local) for _ in range(world_size)]
    dist.all_gather(gathered, flat_local)
    synced = torch.cat([p.grad.flatten() for p in module.parameters()])
    everyone = [torch.empty_like(synced) for _ in range(world_size)]
    dist.all_gather(everyone, synced)
    if rank == 0:
        torch.save(
            {
                "local": torch.stack(gathered),
                "synced": synced,
                "identical": all(torch.equal(s, synced) for s in everyone),
                "bucket_sizes": [sizes[index] for index in sorted(sizes)],
                "wire_bytes": ledger.steps[-1].wire_bytes,
            },
            out,
        )
    del model, state  # the reducer must not be the one to destroy the group (see test_powersgd_state)
    destroy_all_groups()


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_step_is_within_one_quantisation_step_of_the_mean_with_exact_bytes(tmp_path, world_size):
    out = str(tmp_path / "parity.pt")
    mp.start_processes(
        _parity_worker, args=(world_size, 29541 + world_size, out), nprocs=world_size, start_method="fork"
    )
    result = torch.load(out)
    local, synced = result["local"], result["synced"]
    mean = local.mean(dim=0)
    # One quantisation step: each contribution g_i / n is rounded to within half its block's step (max / 127 / 2),
    # the owner's sum once more to within half its step. Bounded here with the largest value of the whole model.
    bound = (local.abs().amax(dim=1) / world_size).sum() / 254 + mean.abs().max() / 254
    error = (synced - mean).abs()
    assert error.max() <= bound * (1 + 1e-5), (error.max(), bound)
    assert error.max() > 0  # it really was quantised
    assert result["identical"]  # every rank decoded the same bytes
    # Two roundings to 8 bits: about 1% of the gradient's norm (measured 0.5-1.2% here), not more.
    relative = ((synced - mean).norm() / mean.norm()).item()
    print(f"int8 relative error after one step, {world_size} ranks: {relative:.4f}")
    assert relative < 0.02
    # Exact bytes: every parameter starts a block; per bucket, world_size equal chunks of whole blocks, each block
    # 1 byte per element plus a 4-byte scale.
    blocks = [sum(math.ceil(numel / BLOCK) for numel in bucket) for bucket in result["bucket_sizes"]]
    per_rank = [math.ceil(count / world_size) for count in blocks]
    assert result["wire_bytes"] == sum(world_size * count * (BLOCK + 4) for count in per_rank)
    assert len(result["bucket_sizes"]) == 3


@pytest.mark.quick
def test_int8_in_a_lightning_run_sends_a_quarter_and_keeps_ranks_identical(tmp_path):
    strategy = OptimizedDDPStrategy(comm_hook="int8", bucket_cap_mb=0.3, start_method="fork")
    ranks = fit_ddp(tmp_path, strategy, max_steps=4)
    for record in ranks:
        # Three buckets of two Linear(256, 256) layers: per bucket 2 x (64 + 1) blocks of 1024 (a weight fills 64, a
        # bias of 256 elements starts its own), split over 2 ranks, each block 1024 bytes plus a 4-byte scale. The
        # first step's buckets (before DDP rebuilds them) hold the same layers, so the same bytes.
        assert [s["wire_bytes"] for s in record["steps"]] == [3 * 2 * 65 * (1024 + 4)] * 4
        assert stack_gradient_bytes() == 1579008
        assert record["comm_hook_name"] == "int8"
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


class _ExchangeProbe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.comm_state
        record = {
            "own_group": state.exchange_group not in (None, dist.group.WORLD, trainer.strategy.model.process_group),
            "workers": sorted(w.name for w in state._workers if w.alive()),
            "iteration": state.iteration,
        }
        torch.save(record, self.out / f"exchange{trainer.global_rank}.pt")


@pytest.mark.quick
def test_strategy_exchanges_int8_point_to_point_in_a_group_of_its_own(tmp_path):
    # With find_unused_parameters=True DDP all-reduces its unused-parameter map on the model's group, on the
    # backward thread, while the workers still exchange: on a group of the hook's own, nothing interleaves.
    strategy = OptimizedDDPStrategy(
        comm_hook="int8", find_unused_parameters=True, bucket_cap_mb=0.3, start_method="fork"
    )
    ranks = fit_ddp(tmp_path, strategy, max_epochs=3, callbacks=[_ExchangeProbe(tmp_path)])
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)
    for rank in range(2):
        record = torch.load(tmp_path / f"exchange{rank}.pt")
        assert record == {"own_group": True, "workers": ["ddpopt-int8-gather", "ddpopt-int8-reduce"], "iteration": 12}


@pytest.mark.quick
def test_registry_entry_and_bad_configs():
    assert COMM_HOOKS["int8"].summary == (
        "block-wise int8 (blocks of 1024), with error feedback: a quarter of the bytes"
    )
    with pytest.raises(ValueError, match="Int8Config block_size=8 must be an int >= 16"):
        Int8Config(block_size=8)
    with pytest.raises(ValueError, match="Int8Config block_size=True must be an int >= 16"):
        Int8Config(block_size=True)
    with pytest.raises(TypeError, match="Int8Config error_feedback='yes' must be a bool"):
        Int8Config(error_feedback="yes")


@pytest.mark.quick
def test_loading_state_of_another_config_is_refused(gloo_group):
    state = Int8State(config=Int8Config(block_size=256))
    other = Int8State(config=Int8Config(block_size=1024))
    with pytest.raises(ValueError, match=r"cannot load int8 state: the int8 config changed \(block_size 256 -> 1024\)"):
        other.load_state_dict(state.state_dict())


@pytest.mark.quick
def test_blocks_too_small_for_their_scale_quantise_to_zero_and_stay_finite():
    from lightning_ddpopt.hooks.int8_codec import dequantize_blocks, quantize_blocks, quantize_into

    # 127 / peak overflows float32 below about 3.7e-37: such blocks are sent as zeros, their values stay in the
    # error (finite), instead of becoming inf and NaN that a finite scale would let into the committed state.
    rows = torch.tensor([[1e-39, -1e-39, 0.0, 2e-39], [1e-37, 0.0, -1e-37, 5e-38], [0.5, -1.0, 0.25, 0.0]])
    payload, scales = quantize_blocks(rows)
    assert payload[:2].eq(0).all() and payload[2].tolist() == [64, -127, 32, 0]
    packed = torch.empty(1, rows.numel() + 4 * rows.shape[0], dtype=torch.int8)
    dequantized = quantize_into(rows.clone(), packed, rows.numel())
    assert bool(dequantized.isfinite().all()) and dequantized[:2].eq(0).all()
    assert bool(dequantize_blocks(payload, scales).isfinite().all())
    # Non-finite blocks keep it in their scale.
    _, bad = quantize_blocks(torch.tensor([[1.0, float("inf")], [float("nan"), 1.0]]))
    assert not bool(bad.isfinite().any())


@pytest.mark.quick
def test_auto_skips_int8_for_a_model_smaller_than_one_block(gloo_group):
    from lightning_ddpopt.hooks.auto import measure_hook_costs

    # Nor for PowerSGD: a 10 x 10 matrix is not worth compressing at rank 4, so it would be sent exactly.
    estimates = measure_hook_costs(nn.Linear(10, 10), None, torch.device("cpu"), repeats=1, lookup=get_hook_spec)
    assert set(estimates) == {"allreduce", "fp16"}
    estimates = measure_hook_costs(nn.Linear(64, 64), None, torch.device("cpu"), repeats=1, lookup=get_hook_spec)
    assert set(estimates) == {"allreduce", "fp16", "int8", "powersgd"}


def _paths_worker(rank: int, world_size: int, port: int, out: str, loops: bool) -> None:
    import lightning_ddpopt.hooks._kernels as kernels

    if not loops:
        kernels.available = lambda: False  # this forked process takes the torch path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(101, 37), nn.Tanh(), nn.Linear(37, 53), nn.Tanh(), nn.Linear(53, 7))
    model = DistributedDataParallel(module, bucket_cap_mb=0.001)
    scale = torch.ones(())
    state = Int8State(config=Int8Config(block_size=BLOCK), loss_scale=lambda: scale)
    state.bind_module(module)
    model.register_comm_hook(state, int8_hook)
    data = torch.Generator().manual_seed(rank)
    grads = []
    for step, loss_scale in enumerate((1.0, 1.0, 8.0, 4.0, 4.0)):  # a GradScaler's growth and backoff
        scale.fill_(loss_scale)
        model.zero_grad()
        inputs = torch.randn(8, 101, generator=data) * (100.0 if rank == step % world_size else 1.0)
        (model(inputs).pow(2).mean() * loss_scale).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    state.state_dict()  # seals the last round
    torch.save({"grads": grads, "errors": dict(state.errors)}, f"{out}.{rank}")
    del model, state
    destroy_all_groups()


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [2, 3])
def test_numba_loops_send_and_decode_the_same_bytes_as_torch(tmp_path, world_size):
    pytest.importorskip("numba")
    results = {}
    for loops in (True, False):
        out = str(tmp_path / f"paths-{loops}")
        mp.start_processes(
            _paths_worker, args=(world_size, 29561 + world_size, out, loops), nprocs=world_size, start_method="fork"
        )
        results[loops] = [torch.load(f"{out}.{rank}") for rank in range(world_size)]
    for rank in range(world_size):
        fast, reference = results[True][rank], results[False][rank]
        for step, (a, b) in enumerate(zip(fast["grads"], reference["grads"], strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank}, step {step}")
        assert fast["errors"].keys() == reference["errors"].keys() and fast["errors"]
        for name in fast["errors"]:
            torch.testing.assert_close(fast["errors"][name], reference["errors"][name], rtol=0, atol=0, msg=name)
    # Every rank decoded the same bytes.
    for rank in range(1, world_size):
        torch.testing.assert_close(results[True][rank]["grads"][-1], results[True][0]["grads"][-1], rtol=0, atol=0)


def _exchange_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """The same steps through point-to-point exchanges (worker threads) and through collectives (the hook calls)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    exchange = dist.new_group(list(range(world_size)))
    results = {}
    for group in (exchange, None):
        torch.manual_seed(0)
        layers = [nn.Linear(61, 61) for _ in range(7)]
        module = nn.Sequential(*[block for layer in layers for block in (layer, nn.Tanh())])
        delays = random.Random(rank)
        for layer in layers:  # each rank sleeps at random points of its backward pass: buckets arrive in any timing
            layer.register_forward_hook(jitter_backward(delays))
        model = DistributedDataParallel(module, bucket_cap_mb=0.01)  # one bucket per layer: 7 buckets
        scale = torch.ones(())
        state = Int8State(
            config=Int8Config(block_size=BLOCK), loss_scale=lambda scale=scale: scale, exchange_group=group
        )
        state.bind_module(module)
        model.register_comm_hook(state, int8_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(rank)
        grads = []
        for step in range(24):
            scale.fill_(2.0 ** (step % 3))  # a GradScaler's growth and backoff
            optimizer.zero_grad()
            inputs = torch.randn(8, 61, generator=data)
            if step == 9 and rank == world_size - 1:
                inputs[0, 0] = math.inf  # non-finite on one rank: non-finite everywhere, the step skipped
            (model(inputs).pow(2).mean() * scale).backward()
            grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
            if grads[-1].isfinite().all():
                optimizer.step()
        threads = sorted(w.name for w in state._workers) if state._workers else []
        state.state_dict()  # seals the last round
        results[group is not None] = {"grads": grads, "errors": dict(state.errors), "threads": threads}
        assert state.close()
        del model, state
    torch.save(results, f"{out}.{rank}")
    destroy_all_groups()


@pytest.mark.parametrize("world_size", [2, 3])
def test_point_to_point_exchange_gives_the_collectives_bits_whatever_the_timing(tmp_path, world_size):
    out = str(tmp_path / "exchange")
    mp.start_processes(
        _exchange_worker, args=(world_size, 29571 + world_size, out), nprocs=world_size, start_method="fork"
    )
    ranks = [torch.load(f"{out}.{rank}") for rank in range(world_size)]
    for rank, result in enumerate(ranks):
        exchanged, collective = result[True], result[False]
        assert exchanged["threads"] == ["ddpopt-int8-gather", "ddpopt-int8-reduce"] and collective["threads"] == []
        for step, (a, b) in enumerate(zip(exchanged["grads"], collective["grads"], strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"rank {rank}, step {step}")
            # Every rank decoded the same bytes; the step with an inf on one rank is non-finite on all.
            torch.testing.assert_close(a, ranks[0][True]["grads"][step], rtol=0, atol=0, equal_nan=True)
            assert bool(a.isfinite().all()) == (step != 9), step
        assert exchanged["errors"].keys() == collective["errors"].keys() and exchanged["errors"]
        for name in exchanged["errors"]:
            torch.testing.assert_close(exchanged["errors"][name], collective["errors"][name], rtol=0, atol=0)


@pytest.mark.quick
def test_numba_block_quantisation_matches_torch_on_edge_cases():
    pytest.importorskip("numba")
    import lightning_ddpopt.hooks._kernels as kernels
    from lightning_ddpopt.hooks.int8_codec import quantize_into

    inf, nan = float("inf"), float("nan")
    # Blocks of 4: too small for a finite 127 / peak, ordinary with a tie at .5, +inf, -inf, NaN after an inf,
    # and a last block padded with zeros (the parameter has 22 elements).
    gradient = torch.tensor(
        [1e-39, -1e-39, 0.0, 2e-39, 0.5, -1.0, 0.25, 127 / 254, 1.0, inf, 0.0, 2.0]
        + [-inf, 1.0, 0.0, 0.0, 3.0, inf, nan, 1.0, 0.3, -0.7]
    )
    rows = torch.cat([gradient, torch.zeros(2)]).view(-1, 4) / 3  # 3 ranks
    reference = torch.empty(3, 8 + 4 * 2, dtype=torch.int8)  # 6 blocks of 4 over 3 ranks: 2 blocks each, 2 scales
    dequantized = quantize_into(rows.clone(), reference, 8)
    packed = torch.empty_like(reference)
    scales = torch.zeros(3, 2)
    errors = torch.empty(24)
    kernels.quantize_parameter(gradient, None, 3, 0, errors, packed, scales, 4)
    expected_scales = reference[:, 8:].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0, equal_nan=True)
    finite = expected_scales.isfinite().view(-1)
    assert finite.tolist() == [True, True, False, False, False, True]
    payloads, ours = reference[:, :8].reshape(-1, 4), packed[:, :8].reshape(-1, 4)
    assert torch.equal(ours[finite], payloads[finite])
    assert ours[0].eq(0).all() and ours[1].tolist() == [64, -127, 32, 64]  # 63.5 rounds to the even 64
    expected_errors = (rows - dequantized).view(-1) * 3
    torch.testing.assert_close(errors, expected_errors, rtol=0, atol=0, equal_nan=True)


@pytest.mark.quick
@pytest.mark.parametrize("world_size", [2, 3, 20])
def test_the_owners_sum_is_the_same_bytes_through_numba_and_torch(world_size):
    pytest.importorskip("numba")
    from lightning_ddpopt.hooks.int8_codec import quantize_into, reduce_and_requantize

    # 20 ranks: torch's sum(dim=0) would reorder the additions; both paths add in rank order. One block is all -0.0.
    generator = torch.Generator().manual_seed(world_size)
    per_rank, block = 5, 64
    values = torch.randn(world_size, per_rank, block, generator=generator) * torch.logspace(-3, 3, per_rank).view(
        1, -1, 1
    )
    values[:, 2] = -0.0
    received = torch.empty(world_size, per_rank * block + 4 * per_rank, dtype=torch.int8)
    quantize_into(values.view(-1, block), received, per_rank * block)
    fast = reduce_and_requantize(received, per_rank * block, block, loops=True)
    reference = reduce_and_requantize(received, per_rank * block, block, loops=False)
    assert torch.equal(fast, reference)
    assert fast[0, per_rank * block :].view(torch.float32)[2].item() == 0.0


@pytest.mark.quick
@pytest.mark.parametrize("ranks", [2, 3])
def test_packed_rows_and_their_mean_are_the_same_bits_through_numba_and_torch(monkeypatch, ranks):
    # Local SGD's int8 changes: each rank packs its blocks (payloads, then scales) and every rank averages the
    # gathered rows in rank order. Each rank may take either path: both must give the same bytes and the same mean.
    pytest.importorskip("numba")
    import lightning_ddpopt.hooks._kernels as kernels
    from lightning_ddpopt.hooks.int8_codec import average_packed, quantize_packed

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    generator = torch.Generator().manual_seed(ranks)
    rows = [
        torch.randn(6, BLOCK, generator=generator) * 10.0 ** torch.arange(-3, 3).unsqueeze(-1) for _ in range(ranks)
    ]
    rows[-1][2, 5] = math.inf  # a non-finite block on one rank: non-finite in the mean, the other blocks as usual
    packed = {}
    for loops in (True, False):
        monkeypatch.setattr(kernels, "available", lambda loops=loops: loops)
        gathered = torch.cat([quantize_packed(r.clone()) for r in rows])
        for row, own in zip(rows, gathered, strict=True):  # into a kept row that holds the last sync's bytes
            kept = torch.full((1, own.numel()), 77, dtype=torch.int8)
            assert quantize_packed(row.clone(), out=kept) is kept and torch.equal(kept[0], own)
        mean = torch.empty(6, BLOCK)
        average_packed(gathered, mean)
        packed[loops] = (gathered, mean)
    assert torch.equal(packed[True][0], packed[False][0])
    torch.testing.assert_close(packed[True][1], packed[False][1], rtol=0, atol=0, equal_nan=True)
    size = 6 * BLOCK + 6 * 4
    with pytest.raises(ValueError, match=rf"out must be a contiguous \(1, {size}\) int8 row, got \(1, {size - 4}\)"):
        quantize_packed(rows[0], out=torch.empty(1, size - 4, dtype=torch.int8))
    mean = packed[True][1]
    assert not mean[2].isfinite().all() and mean[[0, 1, 3, 4, 5]].isfinite().all()
    exact = sum(rows) / ranks
    step = torch.stack([r.abs().amax(dim=1) for r in rows]).sum(dim=0) / 127 / ranks  # per block, all ranks' steps
    finite = [0, 1, 3, 4, 5]
    assert ((mean[finite] - exact[finite]).abs() <= step[finite].unsqueeze(-1) / 2 + 1e-12).all()
