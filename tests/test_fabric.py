"""Lightning Fabric: real 2-process CPU runs of the Fabric strategy and its Monitor, in a hand-written loop."""

from __future__ import annotations

import json
import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from lightning_ddpopt import AMPMonitor, CommProfiler, LocalSGDConfig, StragglerDetector
from lightning_ddpopt.checkpoint import read_saved_run
from lightning_ddpopt.costmodel import choose_sync_every
from lightning_ddpopt.fabric import Monitor, OptimizedDDPStrategy, fp16_mixed_precision
from lightning_ddpopt.hooks import PowerSGDConfig
from lightning_ddpopt.localsgd.config import OUTER_DEFAULTS

WIDTH = 64
BATCH = 16


@dataclass
class Run:
    """One Fabric run's settings; each rank writes what it saw to ``out/rank{r}.pt``."""

    out: str
    hook: Any = "allreduce"
    steps: int = 8
    accumulate: int = 2
    no_sync: bool = True  # fabric.no_backward_sync on all micro-batches but the last
    local_sgd: LocalSGDConfig | None = None
    fp16: bool = False
    overflow_step: int | None = None  # rank 1's loss is infinite at this (1-based) step
    save_at: int | None = None  # fabric.save after this many steps
    resume_from: str | None = None
    load_before_setup: bool = False
    weights_file: bool = (
        False  # at the end fabric.save(path, model.state_dict()), then twice fabric.load_raw(path, model)
    )
    slow: tuple[int, str, float] | None = None  # (rank, "data" | "compute" | "validation", seconds) per batch
    validate: bool = False  # a validation forward (eval mode, no gradients) after every step
    bucket_cap_mb: Any = "auto"
    start_method: str = "fork"
    width: int = WIDTH
    callbacks: list[str] = field(default_factory=lambda: ["comm", "straggler", "amp"])


def _model(width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, 4 * width), nn.Tanh(),
                         nn.Linear(4 * width, width))  # fmt: skip


def _batch(rank: int, step: int, micro: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's micro-batch of every step, from its indices alone: a resumed run sees the same data."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(BATCH, width, generator=generator)
    return x, torch.sin(x.roll(1, dims=1))


def _callbacks(names: list[str]) -> list[Any]:
    made = {"comm": CommProfiler(every_n_steps=4), "straggler": StragglerDetector(every_n_steps=4), "amp": AMPMonitor()}
    return [made[name] for name in names]


def _work(fabric: Fabric, run: Run) -> None:
    rank = fabric.global_rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _model(run.width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        if run.resume_from and run.load_before_setup:
            fabric.load(run.resume_from, state)
        model, optimizer = fabric.setup(model, optimizer)
        state.update(model=model, optimizer=optimizer)
        if run.resume_from and not run.load_before_setup:
            fabric.load(run.resume_from, state)
        if run.resume_from:
            # Read whole, without a state to restore into: the package's entry is not handed out, nor applied.
            assert "ddpopt" not in fabric.load(run.resume_from)

        strategy = fabric.strategy
        assert isinstance(strategy, OptimizedDDPStrategy)
        monitor = Monitor(fabric, _callbacks(run.callbacks)) if run.callbacks else None
        for step in range(state["step"] + 1, run.steps + 1):
            for micro in range(run.accumulate):
                if run.slow is not None and run.slow[:2] == (rank, "data"):
                    time.sleep(run.slow[2])  # between batches: where a loop loads its data
                last = micro == run.accumulate - 1
                with monitor.batch() if monitor is not None else nullcontext():
                    with fabric.no_backward_sync(model, enabled=run.no_sync and not last):
                        x, y = _batch(rank, step, micro, run.width)
                        loss = nn.functional.mse_loss(model(x), y) / run.accumulate
                        if run.overflow_step == step and rank == 1:
                            loss = loss * math.inf
                        if run.slow is not None and run.slow[:2] == (rank, "compute"):
                            time.sleep(run.slow[2])
                        fabric.backward(loss)
                    if last:
                        optimizer.step()
                        optimizer.zero_grad()
            if run.validate:
                model.eval()
                with torch.no_grad():
                    model(_batch(rank, step, 99, run.width)[0])
                model.train()
                if run.slow is not None and run.slow[:2] == (rank, "validation"):
                    time.sleep(run.slow[2])  # rank 0's own work after validation, e.g. writing a sample
            if run.save_at == step:
                fabric.save(Path(run.out) / "checkpoint.ckpt", {**state, "step": step})
        if run.weights_file:  # checkpoints of the weights alone, loaded back into the disturbed model
            weights, earlier = Path(run.out) / "weights.ckpt", Path(run.out) / "earlier.ckpt"
            fabric.save(weights, model.state_dict())  # nothing of ours in it
            if rank == 0:  # as an earlier release saved it: with our entry
                torch.save({**torch.load(weights), "ddpopt": {"world_size": 2}}, earlier)
            fabric.barrier()
            for path in (weights, earlier, earlier):
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                fabric.load_raw(path, model)
        report = monitor.finish() if monitor is not None else None
        if monitor is None:
            strategy.finish()
    ledger = strategy.ledger
    assert ledger is not None
    scaler = getattr(strategy.precision, "scaler", None)
    loop = strategy.local_sgd
    choice = loop.sync_every_choice if loop is not None else None
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "steps": [
                {
                    "sync_rounds": s.sync_rounds,
                    "micro_batches": s.micro_batches,
                    "wire": s.wire_bytes,
                    "logical": s.logical_bytes,
                }
                for s in ledger.steps
            ],  # fmt: skip
            "warnings": [str(w.message) for w in caught],
            "metrics": dict(monitor.metrics) if monitor is not None else {},
            "report": str(report) if report is not None else None,
            "hook": strategy.comm_hook_name,
            "scale": scaler.get_scale() if scaler is not None else None,
            "forward_module_is_ddp": model._forward_module is strategy.model,
            "optimizer_steps": strategy.optimizer_steps,
            "state": type(strategy.comm_state).__name__,
            "intra": [s.intra_node_bytes for s in ledger.steps],
            "rank": (fabric.global_rank, fabric.node_rank, fabric.local_rank, fabric.world_size),
            "local_sgd": None
            if loop is None
            else {"config": asdict(loop.config), "choice": None if choice is None else asdict(choice)},
        },
        Path(run.out) / f"rank{rank}.pt",
    )


def launch(run: Run, devices: int = 2, num_nodes: int = 1, **strategy_kwargs: Any) -> list[dict[str, Any]]:
    """Run ``run`` on ``devices`` CPU processes (of this node, with ``num_nodes``: the other nodes' ranks are started
    by their own call, with their ``NODE_RANK``); every rank's results (this node's, with several)."""
    Path(run.out).mkdir(parents=True, exist_ok=True)
    strategy = OptimizedDDPStrategy(
        comm_hook=run.hook,
        local_sgd=run.local_sgd,
        bucket_cap_mb=run.bucket_cap_mb,
        start_method=run.start_method,
        **strategy_kwargs,
    )
    plugins = [fp16_mixed_precision("cpu", init_scale=2.0**10)] if run.fp16 else None
    logger = CSVLogger(run.out, name="logs")
    fabric = Fabric(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, plugins=plugins, loggers=logger
    )
    fabric.launch(_work, run)
    first = devices * fabric.node_rank
    return [torch.load(Path(run.out) / f"rank{r}.pt", weights_only=False) for r in range(first, first + devices)]


def reference_params(steps: int, accumulate: int, world_size: int = 2) -> list[torch.Tensor]:
    """What synchronous data parallelism computes, in one process: AdamW on the mean loss over every micro-batch."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, steps + 1):
        losses = [
            nn.functional.mse_loss(model(x), y)
            for rank in range(world_size)
            for x, y in (_batch(rank, step, micro) for micro in range(accumulate))
        ]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


def assert_ranks_identical(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks[1:]:
        for mine, first in zip(rank["params"], ranks[0]["params"], strict=True):
            assert torch.equal(mine, first)


# --- without processes ---------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_the_trainer_names_are_registered_for_fabric():
    for name in ("ddp_optimized", "ddp_optimized_spawn", "ddp_optimized_fork", "ddp_optimized_fp16"):
        assert name in STRATEGY_REGISTRY
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_optimized_spawn_bf16")
    strategy = fabric.strategy
    assert isinstance(strategy, OptimizedDDPStrategy)
    assert strategy._core.hooks.spec is not None and strategy._core.hooks.spec.name == "bf16"
    assert strategy._start_method == "spawn"


@pytest.mark.quick
def test_bad_arguments_fail_at_construction_as_on_the_trainer():
    with pytest.raises(ValueError, match="comm_hook='gzip' is not"):
        OptimizedDDPStrategy(comm_hook="gzip")
    with pytest.raises(ValueError, match="checkpoint_timeout"):
        OptimizedDDPStrategy(checkpoint_timeout=-1)


@pytest.mark.quick
def test_the_monitor_needs_the_strategy_and_a_model():
    with pytest.raises(TypeError, match="this Fabric runs DDPStrategy"):
        Monitor(Fabric(accelerator="cpu", devices=2, strategy="ddp"))
    with pytest.raises(RuntimeError, match=r"comes after fabric.setup\(model, optimizer\)"):
        Monitor(Fabric(accelerator="cpu", devices=2, strategy="ddp_optimized"))


# --- 2 processes ---------------------------------------------------------------------------------------------------


@pytest.mark.quick
@pytest.mark.parametrize(
    ("hook", "devices"), [("allreduce", 2), ("allreduce", 3), ("fp16", 2), ("int8", 3), ("powersgd", 2)]
)
def test_every_hook_family_syncs_once_per_step_with_no_backward_sync(tmp_path, hook, devices):
    # PowerSGD compresses from its 3rd sync on (the default waits 10).
    ranks = launch(Run(str(tmp_path), hook=PowerSGDConfig(start_iter=2) if hook == "powersgd" else hook), devices)
    assert_ranks_identical(ranks)
    for rank in ranks:
        assert rank["hook"] == hook
        assert [s["sync_rounds"] for s in rank["steps"]] == [1] * 8  # the first micro-batch of each step skipped
        assert [s["micro_batches"] for s in rank["steps"]] == [2] * 8
        assert not [w for w in rank["warnings"] if w.startswith("ddpopt: this Fabric loop")]
    steps = ranks[0]["steps"]
    logical = 4 * sum(p.numel() for p in ranks[0]["params"])
    assert {s["logical"] for s in steps} == {logical}
    sent = {s["wire"] for s in steps}
    if hook == "allreduce":
        assert sent == {logical}
        # fp32 sums in another order than one process: rounding only, which AdamW's division by the root of small
        # second moments magnifies, after 8 steps of lr 1e-3.
        for got, want in zip(ranks[0]["params"], reference_params(8, 2, devices), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    elif hook == "fp16":
        assert sent == {logical // 2}
        for got, want in zip(ranks[0]["params"], reference_params(8, 2, devices), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    else:
        assert steps[-1]["wire"] < logical / 3
    # The Monitor's figures, logged through fabric.log_dict and kept: the bytes the ledger counted in the last
    # interval of CommProfiler(every_n_steps=4), the same on both ranks.
    metrics = ranks[0]["metrics"]
    assert metrics["ddpopt/comm/bytes_sent"] == pytest.approx(sum(s["wire"] for s in steps[-4:]) / 4, rel=1e-12)
    assert metrics["ddpopt/comm/sync_rounds"] == 1.0
    (csv_file,) = tmp_path.glob("logs/version_*/metrics.csv")
    assert "ddpopt/comm/bytes_sent" in csv_file.read_text().splitlines()[0]
    report = json.loads(Path(ranks[0]["report"]).read_text())
    assert [f["area"] for f in report["findings"]] == ["network", "compression", "amp", "accumulation", "stragglers"]
    assert report["summary"]["ledger"]["micro_batches_per_step"] == 2.0
    assert all(rank["report"] is None for rank in ranks[1:])  # rank 0 writes it


@pytest.mark.quick
@pytest.mark.parametrize("overlap", [0, 2])
def test_local_sgd_with_the_monitor_meets_only_at_syncs_and_ends_averaged(tmp_path, overlap):
    config = LocalSGDConfig.diloco(4, overlap_steps=overlap)
    ranks = launch(Run(str(tmp_path), local_sgd=config, steps=12, accumulate=1))
    assert_ranks_identical(ranks)  # finish() averaged the ranks, which trained apart since the last sync
    # No gradient sync at all: the ledger's rounds are the parameter syncs (at steps 4, 8 and 12; overlapped, they
    # are applied 2 steps later, step 12's after the last step).
    rounds = [s["sync_rounds"] for s in ranks[0]["steps"]]
    assert rounds == ([0, 0, 0, 1] * 3 if not overlap else [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]), rounds
    report = json.loads(Path(ranks[0]["report"]).read_text())
    assert report["summary"]["local_sgd"]["syncs"] == 3
    accumulation = next(f for f in report["findings"] if f["area"] == "accumulation")
    assert accumulation["evidence"].startswith("local SGD: ")
    assert "ddpopt/comm/local_drift" in ranks[0]["metrics"]
    assert report["summary"]["stragglers"]["last"] is not None


@pytest.mark.quick
def test_sync_every_auto_and_the_outer_auto_settings_in_a_fabric_loop(tmp_path):
    # The first window's 16 steps measured, their sync the chosen H's first; AdamW: the adaptive row.
    ranks = launch(Run(str(tmp_path), local_sgd=LocalSGDConfig.diloco("auto"), steps=20, accumulate=1, callbacks=[]))
    choice = ranks[0]["local_sgd"]["choice"]
    assert choice is not None and choice == ranks[1]["local_sgd"]["choice"] and choice["since"] == 16
    assert choice["sync_every"] == choose_sync_every(choice["sync_s"], choice["compute_s"], choice["exposed_share"])
    assert choice["exposed_share"] == 1.0  # a blocking sync
    config = ranks[0]["local_sgd"]["config"]
    assert (config["outer_lr"], config["outer_momentum"]) == OUTER_DEFAULTS["adaptive"]
    assert_ranks_identical(ranks)


@pytest.mark.quick
def test_a_loop_that_syncs_every_micro_batch_is_warned_once(tmp_path):
    ranks = launch(Run(str(tmp_path), no_sync=False, steps=4, callbacks=[]))
    assert [s["sync_rounds"] for s in ranks[0]["steps"]] == [2] * 4
    warned = [w for w in ranks[0]["warnings"] if w.startswith("ddpopt: this Fabric loop")]
    assert len(warned) == 1
    assert warned[0].startswith(
        "ddpopt: this Fabric loop synchronised gradients 2 times for one optimizer step (2 micro-batches)"
    )
    assert "fabric.no_backward_sync(model)" in warned[0]
    assert not [w for w in ranks[1]["warnings"] if w.startswith("ddpopt: this Fabric loop")]  # rank 0 warns


@pytest.mark.quick
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            {"hook": PowerSGDConfig(), "fp16": True, "overflow_step": 3, "weights_file": True},
            id="powersgd-fp16-overflow",
        ),
        pytest.param({"hook": "int8", "load_before_setup": True}, id="int8-loaded-before-setup"),
        # auto's measured choice comes back with the checkpoint loaded before setup: no measuring again.
        pytest.param({"hook": "auto", "load_before_setup": True}, id="auto-loaded-before-setup"),
        # Saved on a sync (steps 3 and 6), where every rank holds the same weights: Fabric saves rank 0's.
        pytest.param({"local_sgd": LocalSGDConfig.diloco(3), "accumulate": 1, "save_at": 6}, id="diloco-at-a-sync"),
    ],
)
def test_a_resumed_run_is_identical_to_an_uninterrupted_one(tmp_path, case):
    case = {"save_at": 5, **case}
    whole = launch(Run(str(tmp_path / "whole"), steps=10, callbacks=["amp"], **case))
    checkpoint = str(tmp_path / "whole" / "checkpoint.ckpt")
    resumed = launch(Run(str(tmp_path / "resumed"), steps=10, resume_from=checkpoint, callbacks=["amp"], **case))
    assert len(resumed[0]["steps"]) == 10 - case["save_at"]
    assert resumed[0]["optimizer_steps"] == 10  # the step count came back: the logs go on from step 5
    for got, want in zip(resumed, whole, strict=True):
        for a, b in zip(got["params"], want["params"], strict=True):
            assert torch.equal(a, b)
        assert got["scale"] == want["scale"]
        assert not [w for w in got["warnings"] if w.startswith("ddpopt:") and "fresh" in w]
        # A checkpoint of the weights alone holds no entry of ours; one from an earlier release does: load_raw
        # loads the weights (strictly; the parameters above are the uninterrupted run's) and says once, on rank 0,
        # what it does not restore.
        partial = [w for w in got["warnings"] if w.startswith("ddpopt: fabric.load_raw(path, model)")]
        expected = (
            "ddpopt: fabric.load_raw(path, model) restores the weights alone: this checkpoint's comm-hook state, "
            "local SGD's outer loop, GradScaler and step count are restored by fabric.load(path, {'model': model, "
            "'optimizer': optimizer})"
        )
        assert partial == ([expected] if case.get("weights_file") and got is resumed[0] else [])
    assert_ranks_identical(whole)
    if case.get("weights_file"):
        assert "ddpopt" not in torch.load(tmp_path / "resumed" / "weights.ckpt", weights_only=True)
    saved = torch.load(checkpoint, weights_only=True)["ddpopt"]
    assert saved["world_size"] == 2
    if "fp16" in case:
        assert saved["grad_scaler"]["scale"] < 2.0**10  # the overflow at step 3 halved it; Fabric saves no scaler
        assert whole[0]["metrics"]["ddpopt/amp/skipped_steps"] == 1.0
    # What differs per rank is in the shards beside the file, each rank's written by itself.
    assert not saved["hook_states"] and not saved["local_sgd_ranks"]
    shards = read_saved_run(checkpoint)
    assert shards is not None
    if "local_sgd" in case:
        assert saved["local_sgd"] is not None and saved["shards"]["inner_owners"] == [0, 1]
        assert all(shards.inner_states(rank) for rank in range(2))
    elif case["hook"] == "auto":
        assert saved["hook_choice"]["name"] == whole[0]["hook"] == resumed[0]["hook"]
    else:
        assert saved["shards"]["hook"] and all("iteration" in shards.hook_state(rank) for rank in range(2))


@pytest.mark.quick
def test_reading_a_checkpoint_whole_says_once_that_our_state_stays_behind(tmp_path):
    # fabric.load(path) without objects returns the checkpoint for the caller to apply; ours is not in it (the
    # strategy's own key is taken out), and that is said once.
    path = tmp_path / "whole.ckpt"
    torch.save({"model": {"weight": torch.zeros(1)}, "ddpopt": {"world_size": 2}}, path)
    strategy = OptimizedDDPStrategy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sorted(strategy.load_checkpoint(path)) == ["model"]
        assert sorted(strategy.load_checkpoint(path)) == ["model"]
    assert [str(w.message) for w in caught if str(w.message).startswith("ddpopt:")] == [
        "ddpopt: fabric.load(path) without the objects to restore returns the checkpoint alone: this checkpoint's "
        "comm-hook state, local SGD's outer loop, GradScaler and step count are restored by fabric.load(path, "
        "{'model': model, 'optimizer': optimizer})"
    ]


@pytest.mark.quick
def test_no_backward_sync_holds_in_local_sgds_warm_up(tmp_path):
    # Local SGD allows the gradient sync in its warm-up batches; fabric.no_backward_sync still skips it on every
    # micro-batch but a step's last: one round per warm-up step, then the parameter syncs (steps 6 and 10).
    config = LocalSGDConfig.diloco(4, warmup_steps=2)
    ranks = launch(Run(str(tmp_path), local_sgd=config, steps=10, callbacks=["comm"]))
    assert [s["sync_rounds"] for s in ranks[0]["steps"]] == [1, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert [s["micro_batches"] for s in ranks[0]["steps"]] == [2] * 10
    assert_ranks_identical(ranks)


@pytest.mark.quick
def test_a_second_model_and_static_graph_under_no_backward_sync_are_refused():
    # No process group in this process: ranks forked by later tests would inherit its threads. A DDP object that was
    # never initialised is enough, as both checks come first.
    strategy = OptimizedDDPStrategy(static_graph=True)
    model = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    strategy.model = model
    model.__dict__["module"] = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="already holds Linear; Sequential would be a second one"):
        strategy.setup_module(nn.Sequential())
    with pytest.raises(ValueError, match=r"no_backward_sync cannot run with static_graph=True: .*pytorch#143580"):
        with strategy._backward_sync_control.no_backward_sync(model, enabled=True):
            pass


@pytest.mark.parametrize(
    "slow",
    [
        pytest.param((0, "compute", "fork"), id="rank0-compute-fork"),
        pytest.param((1, "data", "spawn"), id="rank1-data-spawn", marks=pytest.mark.slow),
    ],
)
def test_a_slow_rank_is_named_in_the_report(tmp_path, slow):
    rank, phase, start_method = slow
    ranks = launch(Run(str(tmp_path), steps=12, slow=(rank, phase, 0.05), start_method=start_method))
    report = json.loads(Path(ranks[0]["report"]).read_text())
    last = report["summary"]["stragglers"]["last"]
    assert last["slowest_rank"] == rank and last["is_straggler"] and last["phase"] == phase
    # Each rank's own figures: under spawn a tensor made before the ranks start would be shared by both.
    per_rank = last["per_rank_ms"]
    assert per_rank[str(rank)][phase] > per_rank[str(1 - rank)][phase] + 30
    stragglers = next(f for f in report["findings"] if f["area"] == "stragglers")
    assert stragglers["status"] == "problem" and f"rank {rank}" in stragglers["evidence"]


@pytest.mark.quick
def test_validation_between_batches_is_not_data_time(tmp_path):
    # Rank 0 spends 50 ms after each step's validation forward: on the Trainer an epoch boundary, not data time.
    ranks = launch(Run(str(tmp_path), steps=12, slow=(0, "validation", 0.05), validate=True))
    report = json.loads(Path(ranks[0]["report"]).read_text())
    last = report["summary"]["stragglers"]["last"]
    assert not last["is_straggler"], last
    assert max(rank["data"] for rank in last["per_rank_ms"].values()) < 25
