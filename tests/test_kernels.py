"""PowerSGD's CPU passes: numba's fused loops against torch's arithmetic, error feedback on every path, and the
strategy agreeing one path across ranks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_ddpopt.hooks._kernels as kernels
from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.hooks import PowerSGDConfig, PowerSGDState, powersgd_spec
from tests.helpers import WIDTH, StackModel, fit_ddp

pytest.importorskip("numba")


def _factors(rows: int, cols: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=generator)
    p = torch.linalg.qr(torch.randn(rows, rank, generator=generator)).Q
    local_q, q = torch.randn(cols, rank, generator=generator), torch.randn(cols, rank, generator=generator)
    return m, p, local_q, q


@pytest.mark.quick
@pytest.mark.parametrize(("rows", "cols", "rank"), [(64, 96, 4), (67, 33, 1), (130, 70, 3), (9, 2048, 8)])
def test_the_loops_compute_what_torch_computes(rows, cols, rank):
    m, p, local_q, q = _factors(rows, cols, rank)
    error = torch.empty_like(m)
    # Row counts that are not a multiple of 4 exercise the product's tail; q arrives as a transposed view.
    torch.testing.assert_close(kernels.transposed_product(m, p), m.t() @ p, rtol=1e-5, atol=1e-5)
    scale = torch.tensor(0.5)
    stored = torch.randn(rows, cols)
    for feedback, added in ((None, m), ((stored, None), m + stored), ((stored, scale), m + 0.5 * stored)):
        target = m.clone()
        out = kernels.add_and_project(target, q, feedback)
        torch.testing.assert_close(target, added, rtol=0, atol=1e-6)  # the error is added in place
        torch.testing.assert_close(out, added @ q, rtol=1e-5, atol=1e-4)
    target = m.clone()
    kernels.error_and_decompress(target, p, local_q, q.t().contiguous().t(), error)
    torch.testing.assert_close(error, m - p @ local_q.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target, p @ q.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_non_finite_values_come_through():
    m, p, local_q, q = _factors(8, 16, 2)
    m[3, 5] = float("inf")
    p[1, 0] = float("nan")
    error = torch.empty_like(m)
    assert not kernels.transposed_product(m, p).isfinite().all()
    kernels.error_and_decompress(m, p, local_q, q, error)
    assert error[1].isnan().all() and m[1].isnan().all() and m[0].isfinite().all()


@pytest.mark.quick
def test_only_row_major_fp32_cpu_matrices_fit():
    m = torch.zeros(4, 6)
    assert kernels.fits(m, m[1:3])
    assert not kernels.fits(m.t())  # written in place: a copy would lose the result
    assert not kernels.fits(m.double()) and not kernels.fits(m.half()) and not kernels.fits(m.flatten())


@pytest.mark.quick
@pytest.mark.parametrize("path", ["numba", "blocked", "blas"])
def test_error_feedback_keeps_every_gradient_on_every_path(gloo_group, path):
    """Sum of the applied gradients + the last error = the sum of the true gradients, conv kernels included.

    With one rank Q is the local Q, so each step applies P P^T M and keeps M - P P^T M: what is not applied now is
    applied later. A conv kernel's error, kept as the matrix PowerSGD compressed, must be added back too.
    """
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(8, 16, 3), nn.Flatten(), nn.Linear(16 * 6 * 6, 10))
    model = DistributedDataParallel(module)
    config = PowerSGDConfig(rank=1, start_iter=2, min_compression_rate=1.0)
    state = PowerSGDState(config=config, cpu_kernels=path)
    state.bind_module(module)
    model.register_comm_hook(state, powersgd_spec(config).hook)
    x = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    applied = {name: torch.zeros_like(p) for name, p in module.named_parameters()}
    for step in range(8):
        model.zero_grad()
        model(x).pow(2).mean().backward()
        if step >= 2:  # compressed from the third step on
            for name, p in module.named_parameters():
                applied[name] += p.grad
    module.zero_grad()
    module(x).pow(2).mean().backward()  # the true gradient, the same every step
    for name in ("0.weight", "2.weight"):
        true = module.get_parameter(name).grad
        kept = state.errors[name].reshape(true.shape)
        assert kept.norm() > 0.01 * true.norm(), name  # rank 1 leaves an error: the test can tell
        torch.testing.assert_close(applied[name] + kept, 6 * true, rtol=1e-4, atol=1e-5, msg=name)
    del model


@pytest.mark.quick
def test_the_strategy_agrees_one_path_across_ranks(tmp_path):

    class WithoutNumbaOnRank1(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            torch.set_num_threads(1)  # as Lightning gives each of 2 processes on 2 cores; more would mean "blas"
            if trainer.global_rank == 1:
                kernels.available = lambda: False  # a forked rank's module: the parent keeps its own

        def on_train_end(self, trainer, pl_module):
            path = trainer.strategy.comm_state.kernels()
            torch.save(path, tmp_path / f"path{trainer.global_rank}.pt")

    strategy = OptimizedDDPStrategy(comm_hook="powersgd", start_method="fork")
    ranks = fit_ddp(tmp_path, strategy, callbacks=[WithoutNumbaOnRank1()], max_steps=4)
    assert {torch.load(tmp_path / f"path{rank}.pt") for rank in (0, 1)} == {"blocked"}
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


class _Threads(pl.Callback):
    """Rank 0 runs two torch threads, rank 1 one; records each rank's threads and kernel path at the end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.loop_calls = 0

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(2 if trainer.global_rank == 0 else 1)
        quantize = kernels.quantize_parameter

        def counted(*args, **kwargs):  # int8's fused quantisation, counted in this rank
            self.loop_calls += 1
            return quantize(*args, **kwargs)

        kernels.quantize_parameter = counted

    def on_train_end(self, trainer, pl_module):
        state = trainer.strategy.comm_state
        path = state.kernels() if hasattr(state, "kernels") else self.loop_calls > 0
        torch.save((torch.get_num_threads(), path), f"{self.out}/path{trainer.global_rank}.pt")


class _WideModel(StackModel):
    """A 16384 x 256 weight: PowerSGD's P has 65536 values, above the size from which torch splits a sum by thread."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 16384), nn.Tanh(), nn.Linear(16384, WIDTH))


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["powersgd", "int8"])
def test_numba_loops_run_whatever_the_thread_count_with_the_same_bits_on_every_rank(tmp_path, hook):
    """Lightning gives each rank cores / local ranks torch threads; the loops must not switch off with more than one.
    Rank 0 runs two threads and rank 1 one: PowerSGD still agrees on numba's loops and int8 still takes them, and the
    ranks end with identical parameters. Spawned ranks: libgomp hangs in a forked child that starts more threads."""
    config = PowerSGDConfig(start_iter=2) if hook == "powersgd" else hook  # compressing from the third step
    strategy = OptimizedDDPStrategy(comm_hook=config, start_method="spawn")
    ranks = fit_ddp(tmp_path, strategy, model=_WideModel(), callbacks=[_Threads(str(tmp_path))], max_steps=6)
    seen = [torch.load(tmp_path / f"path{rank}.pt") for rank in (0, 1)]
    assert [threads for threads, _ in seen] == [2, 1]
    assert {path for _, path in seen} == ({"numba"} if hook == "powersgd" else {True})
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.quick
@pytest.mark.parametrize("true_rank", [4, 2])
def test_orthogonalize_gives_orthonormal_columns_even_below_full_rank(true_rank):
    """Gram-Schmidt with a second pass: orthonormal to rounding, as QR is, also when P has lower rank than its
    columns (one pass left errors of about 1e-3 there); the same span as QR's; a zero column stays zero."""
    generator = torch.Generator().manual_seed(0)
    p = torch.randn(5000, true_rank, generator=generator) @ torch.randn(true_rank, 4, generator=generator)
    reference = torch.linalg.qr(p.double()).Q
    kernels.orthogonalize(p, 0.0)
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    if true_rank == 4:  # full rank: P spans what QR's Q spans, column by column up to sign
        torch.testing.assert_close(p.double().abs(), reference.abs(), rtol=0, atol=1e-5)
    zero = torch.zeros(64, 2)
    kernels.orthogonalize(zero, 0.0)
    assert torch.equal(zero, torch.zeros(64, 2))


@pytest.mark.quick
def test_orthogonalize_adds_epsilon_to_each_norm_as_the_torch_path_does():
    p = torch.tensor([[3.0, 1.0], [4.0, 0.0]])
    kernels.orthogonalize(p, 1.0)  # the first column's norm is 5: divided by 6
    torch.testing.assert_close(p[:, 0], torch.tensor([0.5, 4.0 / 6.0]))
