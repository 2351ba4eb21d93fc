"""Accumulation-aware sync skipping, automatic and manual, counted by the ledger in real 2-process CPU DDP."""

from __future__ import annotations

import csv

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.accumulation import AccumulationStep, next_accumulation_step
from lightning_ddpopt.hooks import PowerSGDConfig
from tests.helpers import ManualStackModel, StackModel, WarningsProbe, fit_ddp

pytestmark = pytest.mark.quick

BATCH = 4
SAMPLES = 80  # 10 batches of 4 per rank per epoch: not divisible by 3 or 4
BATCHES_PER_EPOCH = SAMPLES // (2 * BATCH)
EPOCHS = 2
HOOKS = {"allreduce": "allreduce", "fp16": "fp16", "int8": "int8", "powersgd": PowerSGDConfig(start_iter=2)}


def groups(every: int) -> list[int]:
    """Micro-batches per optimizer step: full groups of ``every``, then the epoch's shorter remainder."""
    full, rest = divmod(BATCHES_PER_EPOCH, every)
    return ([every] * full + ([rest] if rest else [])) * EPOCHS


def run(tmp_path, hook, every, manual, use_helper=True, **kwargs):
    strategy = OptimizedDDPStrategy(comm_hook=HOOKS[hook], start_method="fork")
    if manual:
        model = ManualStackModel(every, use_helper=use_helper)
    else:
        model, kwargs["accumulate_grad_batches"] = StackModel(), every
    return fit_ddp(tmp_path, strategy, model=model, batch_size=BATCH, samples=SAMPLES, max_epochs=EPOCHS, **kwargs)


def assert_one_sync_per_step(ranks, every):
    for record in ranks:
        assert [s["micro_batches"] for s in record["steps"]] == groups(every)
        assert [s["sync_rounds"] for s in record["steps"]] == [1] * len(groups(every))
        assert [s["samples"] for s in record["steps"]] == [BATCH * n for n in groups(every)]
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_one_sync_per_optimizer_step_with_short_last_group(tmp_path, hook, manual):
    ranks = run(tmp_path, hook, every=3, manual=manual)
    assert_one_sync_per_step(ranks, every=3)
    if hook == "powersgd":
        # PowerSGD's counter advances once per optimizer step, not per micro-batch.
        assert [r["hook_iteration"] for r in ranks] == [len(groups(3))] * 2


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("every", [1, 4])
def test_one_sync_per_optimizer_step_other_factors(tmp_path, every, manual):
    assert_one_sync_per_step(run(tmp_path, "allreduce", every=every, manual=manual), every=every)


def test_skipping_matches_syncing_every_micro_batch_and_only_the_naive_loop_warns(tmp_path):
    skipping = run(
        tmp_path / "skip", "allreduce", every=4, manual=True, callbacks=[WarningsProbe(str(tmp_path / "w1"))]
    )
    naive = run(
        tmp_path / "naive",
        "allreduce",
        every=4,
        manual=True,
        use_helper=False,
        callbacks=[WarningsProbe(str(tmp_path / "w2"))],
    )
    assert [s["sync_rounds"] for s in naive[0]["steps"]] == groups(4)  # every micro-batch synced
    for fast, slow in zip(skipping, naive, strict=True):
        # Sum of local gradients then one mean, against a mean per micro-batch then their sum: float rounding only.
        torch.testing.assert_close(fast["first_grads"], slow["first_grads"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(fast["params"], slow["params"], rtol=1e-4, atol=1e-6)

    message = (
        "ddpopt: this manual-optimization loop synchronised gradients 4 times for one optimizer step "
        "(4 micro-batches): every micro-batch paid a full allreduce."
    )
    naive_warnings = [w for w in torch.load(tmp_path / "w2") if w.startswith("ddpopt: this manual")]
    assert len(naive_warnings) == 1 and naive_warnings[0].startswith(message)
    assert "strategy.accumulate(every=K)" in naive_warnings[0]
    assert not [w for w in torch.load(tmp_path / "w1") if w.startswith("ddpopt:")]


def test_effective_batch_size_is_logged(tmp_path):
    run(tmp_path, "allreduce", every=3, manual=False, logger=CSVLogger(tmp_path, name="logs"), log_every_n_steps=1)
    (metrics,) = tmp_path.glob("logs/version_*/metrics.csv")
    with metrics.open() as handle:
        key = "ddpopt/effective_batch_size"
        values = [float(row[key]) for row in csv.DictReader(handle) if row[key]]
    assert values == [2 * BATCH * n for n in groups(3)]


def test_next_accumulation_step():
    assert next_accumulation_step(0, 3, False) == AccumulationStep(1, 3, False)
    assert next_accumulation_step(2, 3, False) == AccumulationStep(3, 3, True)
    assert next_accumulation_step(0, 3, True) == AccumulationStep(1, 3, True)  # short last group of an epoch
    assert next_accumulation_step(0, 1, False).should_step
    with pytest.raises(ValueError, match=r"every=0 must be an int >= 1"):
        next_accumulation_step(0, 0, False)


def test_accumulate_refuses_automatic_optimization_and_static_graph():
    strategy = OptimizedDDPStrategy()
    strategy._lightning_module = StackModel()
    with pytest.raises(RuntimeError, match=r"accumulate\(\) is for manual optimization; .*accumulate_grad_batches=K"):
        with strategy.accumulate(every=2):
            pass
    static = OptimizedDDPStrategy(static_graph=True)
    static._lightning_module = ManualStackModel(every=2)
    with pytest.raises(ValueError, match=r"accumulate\(every=2\) cannot run with static_graph=True"):
        with static.accumulate(every=2):
            pass
