"""AMPMonitor with real fp16 autocast and a GradScaler on CPU, single process and 2-process DDP."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader

from lightning_ddpopt import AMPMonitor, OptimizedDDPStrategy, fp16_mixed_precision, precision
from lightning_ddpopt.callbacks import amp as amp_module
from lightning_ddpopt.hooks import PowerSGDConfig
from lightning_ddpopt.precision import bf16_supported
from tests.helpers import NaNGradientModel, NonfiniteReport, OverflowModel, StackModel, fit_ddp, regression_data

INIT_SCALE = 2.0**16
LR = 0.05


def fit_single(tmp_path: Path, model, monitor, max_steps=10, ckpt_path=None, **kwargs) -> pl.Trainer:
    plugin = kwargs.pop("plugin", fp16_mixed_precision("cpu", init_scale=INIT_SCALE))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[plugin] if plugin is not None else None,
        callbacks=[monitor],
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(model, DataLoader(regression_data(80), batch_size=4), ckpt_path=ckpt_path)
    return trainer


def metric_columns(tmp_path: Path) -> dict[str, list[float]]:
    (metrics,) = tmp_path.glob("logs/version_*/metrics.csv")
    with metrics.open() as handle:
        rows = list(csv.DictReader(handle))
    return {key: [float(row[key]) for row in rows if row[key]] for key in rows[0]}


@pytest.mark.parametrize("skip_scheduler", [True, False])
def test_injected_overflows_are_counted_exactly_and_logged(tmp_path, skip_scheduler):
    monitor = AMPMonitor(skip_scheduler_on_overflow=skip_scheduler)
    model = OverflowModel(overflow_at=(3, 7), scheduler=True)
    fit_single(tmp_path, model, monitor)

    assert monitor.skipped_step_indices == [3, 7]
    assert (monitor.skipped_steps, monitor.backoff_events, monitor.growth_events) == (2, 2, 0)
    columns = metric_columns(tmp_path)
    # The scale a step ran with halves after each skipped step.
    expected_scales = [INIT_SCALE * 0.5 ** sum(s < step for s in (3, 7)) for step in range(1, 11)]
    assert columns["ddpopt/amp/scale"] == expected_scales
    assert columns["ddpopt/amp/skipped_steps"] == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert columns["ddpopt/amp/backoff_events"] == columns["ddpopt/amp/skipped_steps"]
    assert columns["ddpopt/amp/skip_rate"][-1] == pytest.approx(2 / 10)
    assert "ddpopt/amp/nonfinite_steps" not in columns  # overflows are AMP's business, not failures
    # The scheduler halves the LR per step; with the option it does not step on the two skipped steps.
    scheduler_steps = 10 - 2 if skip_scheduler else 10
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(LR * 0.5**scheduler_steps)


def test_underflow_and_skip_rate_warn_once_with_bf16_advice(tmp_path):
    monitor = AMPMonitor(window=4, skip_rate_threshold=0.25)
    plugin = fp16_mixed_precision("cpu", init_scale=4.0)
    with pytest.warns(UserWarning) as caught:
        fit_single(tmp_path, OverflowModel(overflow_at=(1, 2, 3, 4, 5)), monitor, max_steps=8, plugin=plugin)
    ours = [str(w.message) for w in caught if str(w.message).startswith("ddpopt:")]
    underflow = [m for m in ours if "loss scale fell to" in m]
    skip_rate = [m for m in ours if "skipped" in m and "of the last 4 optimizer steps" in m]
    assert underflow == [
        "ddpopt: the AMP loss scale fell to 0.5, below 1, at optimizer step 4: gradients are underflowing fp16 or "
        f"are non-finite every step. {bf16_supported(torch.device('cpu'))[1]}."
    ]
    assert len(skip_rate) == 1 and skip_rate[0].startswith("ddpopt: the GradScaler skipped 100% of the last 4")


def test_counters_survive_resume(tmp_path):
    first = AMPMonitor()
    trainer = fit_single(tmp_path / "a", OverflowModel(overflow_at=(3, 7)), first, max_steps=5)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = AMPMonitor()
    fit_single(tmp_path / "b", OverflowModel(overflow_at=(3, 7)), resumed, ckpt_path=str(tmp_path / "mid.ckpt"))
    assert first.skipped_step_indices == [3]
    assert resumed.steps == 10
    assert resumed.skipped_step_indices == [3, 7] and resumed.skipped_steps == 2


def test_bf16_has_no_scaler_keys_and_fp32_checks_quietly(tmp_path):
    monitor = AMPMonitor()
    fit_single(tmp_path, StackModel(), monitor, max_steps=4, plugin=None, precision="bf16-mixed")
    columns = metric_columns(tmp_path)
    assert not [key for key in columns if key.startswith("ddpopt/amp/") and key != "ddpopt/amp/nonfinite_steps"]
    assert columns["ddpopt/amp/nonfinite_steps"] == [0, 0, 0, 0]
    assert monitor.nonfinite_reports == []


FIRST_FIVE = [name for name, _ in StackModel().named_parameters()][:5]


@pytest.mark.parametrize(
    ("every", "found", "message"),
    [
        # All-reduced by DDP, rank 1's NaN of step 2 reaches net.4.weight on both ranks; both stop after that step.
        (
            1,
            {"step": 2, "steps": [2], "names": {0: ["net.4.weight"], 1: ["net.4.weight"]}},
            "ddpopt: non-finite gradients at optimizer step 2 (rank 0 reporting), first offending parameters - "
            "rank 0: net.4.weight; rank 1: net.4.weight",
        ),
        # Checked every 4 steps (gradients and parameters together): found at step 4, reporting steps 1-4 and, by
        # then, every parameter, the NaN having spread from net.4.weight.
        (
            4,
            {"step": 4, "steps": [1, 2, 3, 4], "names": {0: FIRST_FIVE, 1: FIRST_FIVE}},
            "ddpopt: non-finite values in optimizer steps 1-4 (checked every 4 steps) (rank 0 reporting), first "
            f"offending parameters - rank 0: {', '.join(FIRST_FIVE)}; rank 1: {', '.join(FIRST_FIVE)}",
        ),
    ],
    ids=["every_step", "every_4_steps"],
)
def test_nan_on_one_rank_is_reported_on_every_rank_and_stops_all(tmp_path, every, found, message):
    monitor = AMPMonitor(on_nonfinite="stop", nonfinite_every=every)
    strategy = OptimizedDDPStrategy(start_method="fork")
    fit_ddp(
        tmp_path,
        strategy,
        model=NaNGradientModel(rank=1, step=2),
        precision="bf16-mixed",
        callbacks=[monitor, NonfiniteReport(tmp_path)],
        max_steps=8,
    )
    for rank in (0, 1):
        record = torch.load(tmp_path / f"amp{rank}.pt")
        assert record["reports"] == [found]
        assert record["global_step"] == found["step"]
        # The message names every rank's parameters: rank 0 prints it, once.
        assert record["warned"] == ([message] if rank == 0 else [])


class _GradientPasses(pl.Callback):
    """Saves, per rank, the optimizer steps at which AMPMonitor made its own pass over the gradients."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        original = amp_module._sum

        def counted(parameter, with_values):
            if not self.steps or self.steps[-1] != trainer.global_step + 1:
                self.steps.append(trainer.global_step + 1)
            return original(parameter, with_values)

        amp_module._sum = counted
        self.original = original

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        amp_module._sum = self.original
        torch.save(self.steps, self.out / f"passes{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    ("hook", "step", "names", "passes"),
    [
        # int8: the NaN makes its blocks' scales NaN, so those blocks of net.4.weight come back NaN on every rank.
        ("int8", 2, ["net.4.weight"], [2]),
        # PowerSGD: its first 2 steps are exact (start_iter), checked by the monitor's own pass. At step 4 the NaN
        # makes the P of the batch of same-shaped matrices holding net.4.weight non-finite on every rank, and that
        # batch comes back NaN.
        (PowerSGDConfig(start_iter=2), 4, [f"net.{i}.weight" for i in (2, 4, 6, 8, 10)], [1, 2, 4]),
        # fp16: no verdict of the hook's, a pass every step.
        ("fp16", 2, ["net.4.weight"], [1, 2]),
    ],
    ids=["int8", "powersgd", "fp16"],
)
def test_a_lossy_hooks_verdict_is_the_check_and_a_nan_is_reported_at_its_step(tmp_path, hook, step, names, passes):
    # The lossy hooks test their reduced values anyway: where they found them finite, the monitor makes no pass of
    # its own over the gradients; where not, it makes one to name the parameters, at the step of the NaN.
    strategy = OptimizedDDPStrategy(comm_hook=hook, start_method="fork")
    fit_ddp(
        tmp_path,
        strategy,
        model=NaNGradientModel(rank=1, step=step),
        precision="bf16-mixed",
        callbacks=[AMPMonitor(on_nonfinite="stop"), NonfiniteReport(tmp_path), _GradientPasses(tmp_path)],
        max_steps=8,
    )
    for rank in (0, 1):
        record = torch.load(tmp_path / f"amp{rank}.pt")
        assert record["reports"] == [{"step": step, "steps": [step], "names": {0: names, 1: names}}]
        assert record["global_step"] == step
        assert torch.load(tmp_path / f"passes{rank}.pt") == passes


@pytest.mark.quick
def test_the_steps_a_periodic_check_has_not_covered_survive_a_resume():
    # Saved at step 6 with a check every 4: steps 5 and 6 are unchecked, and the resumed run's check at step 8
    # covers them (a state saved before the counter existed resumes as checked through its last step).
    monitor = AMPMonitor(nonfinite_every=4)
    monitor.steps, monitor._checked_through = 6, 4
    resumed = AMPMonitor(nonfinite_every=4)
    resumed.load_state_dict(monitor.state_dict())
    assert (resumed.steps, resumed._checked_through) == (6, 4)
    older = monitor.state_dict()
    del older["checked_through"]
    resumed.load_state_dict(older)
    assert resumed._checked_through == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window=0 must be an int >= 1"),
        ({"nonfinite_every": 0}, "nonfinite_every=0 must be an int >= 1"),
        ({"skip_rate_threshold": 1.5}, "skip_rate_threshold=1.5 must be between 0 and 1"),
        ({"underflow_threshold": 0}, "underflow_threshold=0 must be a positive number"),
        ({"on_nonfinite": "ignore"}, r"on_nonfinite='ignore' is not valid; choose one of \['warn', 'stop', 'raise'\]"),
        ({"max_names": 0}, "max_names=0 must be an int >= 1"),
    ],
)
def test_bad_monitor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AMPMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "device='tpu' is not valid; choose 'cuda' or 'cpu'"),
        ({"init_scale": 0}, "init_scale=0 must be a positive, finite number"),
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0 must be between 0 and 1"),
        ({"growth_interval": 0}, "growth_interval=0 must be an int >= 1"),
    ],
)
def test_bad_scaler_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fp16_mixed_precision(**kwargs)


def test_scaler_settings_reach_the_grad_scaler():
    plugin = fp16_mixed_precision("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    scaler = plugin.scaler
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor()) == (1024.0, 4.0, 0.25)
    assert scaler.get_growth_interval() == 7 and plugin.device == "cpu" and plugin.precision == "16-mixed"


class FusedAdamModel(StackModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)


def test_optimizer_that_unscales_itself_is_reported_not_misclassified(tmp_path):
    monitor = AMPMonitor()
    with pytest.warns(UserWarning, match="AMPMonitor cannot tell skipped steps for Adam, which unscales"):
        fit_single(tmp_path, FusedAdamModel(), monitor, max_steps=2)
    assert monitor.skipped_steps == 0


class _CollectivesInCheck(pl.Callback):
    """Counts, per rank, the collectives started inside AMPMonitor's per-step check."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast")

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        (monitor,) = [c for c in trainer.callbacks if isinstance(c, AMPMonitor)]
        self.count, inside = 0, [False]
        self.originals = {name: getattr(dist, name) for name in self.NAMES}

        def counting(original):
            def call(*args, **kwargs):
                self.count += inside[0]
                return original(*args, **kwargs)

            return call

        for name, original in self.originals.items():
            setattr(dist, name, counting(original))
        check = monitor.on_before_optimizer_step

        def checked(*args, **kwargs):
            inside[0] = True
            try:
                check(*args, **kwargs)
            finally:
                inside[0] = False

        monitor.on_before_optimizer_step = checked

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        torch.save(self.count, self.out / f"collectives{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    ("strategy", "collectives"),
    [
        (lambda: OptimizedDDPStrategy(start_method="fork"), 0),
        (lambda: OptimizedDDPStrategy(comm_hook="int8", start_method="fork"), 0),
        (lambda: OptimizedDDPStrategy(comm_hook=default_hooks.allreduce_hook, start_method="fork"), 4),
        (lambda: DDPStrategy(start_method="fork"), 4),
    ],
    ids=["ours", "ours-int8", "user-hook", "stock"],
)
def test_the_check_needs_no_collective_where_every_rank_holds_the_same_gradients(tmp_path, strategy, collectives):
    # With the strategy's own hooks every rank receives the same synchronised gradients, so each rank's check decides
    # alike on its own; a user's hook or the stock strategy gives no such promise: one flag exchanged per step (4).
    fit_ddp(
        tmp_path,
        strategy(),
        precision="bf16-mixed",
        callbacks=[AMPMonitor(), _CollectivesInCheck(tmp_path)],
        max_steps=4,
    )
    assert [torch.load(tmp_path / f"collectives{rank}.pt") for rank in (0, 1)] == [collectives] * 2


@pytest.mark.parametrize("native", [True, False, None])
def test_fp16_on_a_cpu_warns_once_with_its_cost_and_what_is_faster(monkeypatch, native):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    with pytest.warns(UserWarning) as caught:
        fp16_mixed_precision("cpu")
        fp16_mixed_precision("cpu", init_scale=8.0)
    (message,) = [str(w.message) for w in caught if str(w.message).startswith("ddpopt: fp16 autocast")]
    assert message.startswith(
        "ddpopt: fp16 autocast on a CPU runs torch's float16 CPU kernels, several times slower than fp32 (the AMP "
        "guide has the measured cost): use it to test AMP behaviour without a GPU; "
    )
    if native:
        assert message.endswith("use precision='bf16-mixed', which this CPU computes natively and needs no GradScaler.")
        assert bf16_supported(torch.device("cpu")) == (
            True,
            "this CPU computes bf16 natively: use precision='bf16-mixed'",
        )
    elif native is None:
        assert message.endswith("where the CPU has AVX512-BF16 or AMX (this one's flags could not be read), else fp32.")
        assert bf16_supported(torch.device("cpu")) == (
            False,
            "this CPU's flags could not be read to tell native bf16 (AVX512-BF16 or AMX): try precision='bf16-mixed' "
            "and compare its step time with fp32's",
        )
    else:
        assert message.endswith("where bf16 autocast is as slow: train in fp32 for speed.")
        assert bf16_supported(torch.device("cpu"))[0] is False


@pytest.mark.quick
def test_a_skipped_step_is_told_by_the_optimizers_step_count_without_reading_the_scale():
    # The GradScaler does not call optimizer.step() when it found inf/NaN: counting the calls tells a skipped step
    # with no read of the device (comparing the scale before and after would make a GPU host wait).
    from lightning_ddpopt.precision import OptimizerSteps

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    steps = OptimizerSteps()
    taken = []
    for gradient in (1.0, float("inf"), 2.0):
        before = steps.count(optimizer)
        scaler.scale((weight * gradient).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        taken.append(not steps.skipped(optimizer, before))
    assert taken == [True, False, True] and scaler.get_scale() == 2.0
    assert steps.count(optimizer) == 2 and steps.count(object()) is None and not steps.skipped(object(), None)
    steps.close()
    optimizer.step()  # no longer counted: the hook is gone
    assert steps.count(optimizer) == 0
