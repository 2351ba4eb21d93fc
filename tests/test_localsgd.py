"""Local SGD / DiLoCo: no gradient syncs after the warm-up, identical parameters after every sync, the outer
step's arithmetic, resume at a sync boundary, fp16 AMP with an overflow on one rank, manual optimization with
accumulation, and the ledger's account of it. Real multi-process CPU DDP (2 and 3 ranks)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_ddpopt import (
    AMPMonitor,
    CommProfiler,
    LocalSGDConfig,
    OptimizedDDPStrategy,
    StragglerDetector,
    fp16_mixed_precision,
)
from lightning_ddpopt.checkpoint import read_saved_run
from lightning_ddpopt.costmodel import SYNC_EVERY_CHOICES, choose_sync_every
from lightning_ddpopt.diagnosis import diagnose, summarize
from lightning_ddpopt.localsgd import LocalSGD
from lightning_ddpopt.localsgd.config import OUTER_DEFAULTS, PROVISIONAL_SYNC_EVERY
from lightning_ddpopt.units import format_bytes
from tests.helpers import (
    ManualStackModel,
    NaNGradientModel,
    NonfiniteReport,
    OverflowModel,
    StackModel,
    fit_ddp,
    regression_data,
    uninterrupted_and_resumed,
)

PARAMETERS = 6 * (256 * 256 + 256)
#: ``diloco()``'s outer step without a strategy to tell it the inner optimizer: the non-adaptive row.
OUTER_LR, OUTER_MOMENTUM = OUTER_DEFAULTS["other"]


class ParamsPerStep(pl.Callback):
    """Saves, per rank, the flat parameters after every optimizer step and the ledger's steps."""

    def __init__(self, out: Path) -> None:
        self.out, self.params, self.anchors = out, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))
        anchor = trainer.strategy.local_sgd.anchor
        self.anchors.append(None if anchor is None else anchor.clone())

    def teardown(self, trainer, pl_module, stage):
        # After the strategy's own on_train_end (its final average), which runs after the callbacks'.
        strategy = trainer.strategy
        record = {
            "params": self.params,
            "anchors": self.anchors,
            "final": torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]),
            "steps": [(s.sync_rounds, s.logical_bytes, s.wire_bytes) for s in strategy.ledger.steps],
            "intra_node": [s.intra_node_bytes for s in strategy.ledger.steps],
            "local": strategy.local_sgd.state_dict(),
            "skipped_inner": strategy.local_sgd.skipped_inner_steps,
            "averaged_at_end": strategy.local_sgd.averaged_at_end,
        }
        torch.save(record, self.out / f"local{trainer.global_rank}.pt")


def _fit(tmp_path: Path, config: LocalSGDConfig, devices: int = 2, model=None, **kwargs) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    probe = ParamsPerStep(tmp_path)
    strategy = OptimizedDDPStrategy(local_sgd=config, start_method="fork", **kwargs.pop("strategy_kwargs", {}))
    callbacks = [probe, *kwargs.pop("callbacks", [])]
    fit_ddp(tmp_path / "run", strategy, model=model, devices=devices, callbacks=callbacks, **kwargs)
    return [torch.load(tmp_path / f"local{rank}.pt") for rank in range(devices)]


def _fit_12_steps(tmp_path: Path, config: LocalSGDConfig, devices: int) -> list[dict]:
    """12 optimizer steps on ``devices`` ranks: 64 samples, batch 8, so 8 / devices steps per epoch."""
    steps_per_epoch = math.ceil(64 / 8 / devices)
    return _fit(tmp_path, config, devices=devices, max_steps=12, max_epochs=12 // steps_per_epoch + 1)


# Bytes one rank sends per sync (the size of an all-reduce with the same traffic): fp16, 2 per parameter; int8, a
# byte per parameter padded to whole 1024-value blocks, as many for each rank (a chunk each), plus an fp32 scale per
# block. The model has no buffers.
SENT = {"fp16": PARAMETERS * 2}


def _sent(compression: str, ranks: int = 2) -> int:
    if compression != "int8":
        return SENT[compression]
    blocks = math.ceil(PARAMETERS / (1024 * ranks)) * ranks
    return blocks * 1024 + blocks * 4


@pytest.mark.quick
@pytest.mark.parametrize("compression", ["fp16", "int8"])
@pytest.mark.parametrize("devices", [2, 3])
def test_ranks_train_alone_and_are_identical_after_every_sync(tmp_path, devices, compression):
    # 64 samples, batch 8: 8 / devices steps per epoch; 12 steps with warm-up 2 and H = 5: syncs at steps 7, 12.
    config = LocalSGDConfig.diloco(sync_every=5, warmup_steps=2, compression=compression)
    ranks = _fit_12_steps(tmp_path, config, devices)
    syncs = {7, 12}
    for step in range(1, 13):
        same = all(torch.equal(ranks[0]["params"][step - 1], other["params"][step - 1]) for other in ranks[1:])
        # Synchronous DDP in the warm-up, and at every sync; on their own (different data) in between.
        assert same == (step <= 2 or step in syncs), f"step {step}: identical={same}"
    for record in ranks:
        rounds = [rounds for rounds, _, _ in record["steps"]]
        assert rounds == [1 if step <= 2 or step in syncs else 0 for step in range(1, 13)]
        for step in syncs:
            assert record["steps"][step - 1][1:] == (PARAMETERS * 4, _sent(compression, devices))
        assert record["local"]["steps"] == 12 and record["local"]["syncs"] == 2
        assert record["local"]["momentum"] is not None


def test_islands_of_two_ranks_on_one_node(tmp_path):
    # 4 ranks, replica=2: islands [0, 1] and [2, 3], which sync gradients inside every step; int8 across them every
    # 3 steps (12 steps: syncs at 3, 6, 9, 12), each rank carrying its half of the model.
    config = LocalSGDConfig.diloco(sync_every=3, compression="int8", replica=2)
    ranks = _fit_12_steps(tmp_path, config, devices=4)
    shard = math.ceil(PARAMETERS / (2 * 2 * 1024)) * 2 * 1024  # whole blocks, a chunk per island
    for step in range(1, 13):
        assert torch.equal(ranks[0]["params"][step - 1], ranks[1]["params"][step - 1]), step
        assert torch.equal(ranks[2]["params"][step - 1], ranks[3]["params"][step - 1]), step
        assert torch.equal(ranks[0]["params"][step - 1], ranks[2]["params"][step - 1]) == (step % 3 == 0), step
    for rank, record in enumerate(ranks):
        own = min(PARAMETERS, (rank % 2 + 1) * shard) - rank % 2 * shard
        assert record["anchors"][-1].numel() == own  # this rank's shard of the anchor
        sent = shard + 4 * shard // 1024  # the packed shard: int8 values and a scale per block
        assert [wire for _, _, wire in record["steps"]] == [sent if step % 3 == 0 else 0 for step in range(1, 13)]
        assert record["intra_node"] == [PARAMETERS * 4] * 12  # every step's gradients, inside the island
        assert record["local"]["anchor"].numel() == PARAMETERS  # saved whole, gathered from the island
        torch.testing.assert_close(record["final"], ranks[0]["final"], rtol=0, atol=0)


@pytest.mark.quick
def test_outer_step_is_nesterov_sgd_on_the_mean_change(gloo_group):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    config = LocalSGDConfig.diloco(sync_every=2, compression="fp32")
    local = LocalSGD(config, module)
    assert local.before_batch() is False  # no warm-up: local from the first batch, anchored now
    anchor = torch.cat([p.detach().flatten() for p in module.parameters()]).clone()
    momentum = torch.zeros_like(anchor)
    # Allocated (and written) when the local phase begins, not by the first sync in mid-window: zero momentum.
    assert local.momentum is not None and torch.equal(local.momentum, momentum)
    for _ in range(3):
        for _ in range(2):
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            params = torch.cat([p.detach().flatten() for p in module.parameters()])
            report = local.after_optimizer_step()
        assert report is not None and report.num_elements == 8 and report.wire_bytes == 32
        delta = anchor - params  # one rank: the mean change is its own
        momentum = OUTER_MOMENTUM * momentum + delta
        anchor = anchor - OUTER_LR * (delta + OUTER_MOMENTUM * momentum)
        torch.testing.assert_close(torch.cat([p.detach().flatten() for p in module.parameters()]), anchor)
    assert local.syncs == 3


@pytest.mark.quick
@pytest.mark.parametrize("settings", [{}, {"nesterov": False}, {"outer_momentum": 0.0, "nesterov": False}])
def test_the_outer_step_into_buffers_is_the_step_in_place_bit_for_bit(gloo_group, settings):
    # An island computes the next anchor and momentum ahead into buffers of their own (the anchor, momentum and mean
    # left for a save), a resumed or GPU run in place: both must give the same bits.
    torch.manual_seed(0)
    local = LocalSGD(LocalSGDConfig.diloco(sync_every=2, **settings), nn.Linear(300, 300))
    local.before_batch()
    assert local.anchor is not None
    local.anchor.copy_(torch.randn_like(local.anchor))
    if local.momentum is not None:
        local.momentum.copy_(torch.randn_like(local.momentum))
    anchor, momentum = local.anchor.clone(), None if local.momentum is None else local.momentum.clone()
    mean = torch.randn_like(anchor) * 1e-3
    next_anchor, next_momentum = torch.empty_like(anchor), None if momentum is None else torch.empty_like(anchor)
    local._outer_step(mean.clone(), outer_step=True, into=(next_anchor, next_momentum))
    assert torch.equal(local.anchor, anchor)  # left as they were
    assert momentum is None or torch.equal(local.momentum, momentum)
    local._outer_step(mean.clone(), outer_step=True)
    assert torch.equal(local.anchor, next_anchor) and not torch.equal(next_anchor, anchor)
    assert momentum is None or torch.equal(local.momentum, next_momentum)


@pytest.mark.quick
def test_post_local_sgd_moves_every_rank_to_the_anchor_plus_the_mean_change(gloo_group):
    module = nn.Linear(2, 1)
    local = LocalSGD(LocalSGDConfig.post_local_sgd(sync_every=1), module)
    local.before_batch()
    with torch.no_grad():
        module.weight.add_(1.0)
    before = module.weight.detach().clone()
    local.after_optimizer_step()
    torch.testing.assert_close(module.weight.detach(), before)  # outer_lr 1, no momentum: the average itself


def test_resume_at_a_sync_boundary_is_bit_exact(tmp_path):
    # 4 steps per epoch, H = 4: the epoch's checkpoint lies on a sync. Adam: the ranks' own inner states matter.
    def make():
        return OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(sync_every=4), start_method="fork")

    uninterrupted, resumed, checkpoint = uninterrupted_and_resumed(tmp_path, make, against_unsaved=True)
    saved = read_saved_run(checkpoint)
    assert saved is not None and saved.local_sgd is not None
    assert saved.local_sgd["steps"] == 4 and saved.local_sgd["syncs"] == 1
    # The ranks' Adam moments differ (local steps on different data): each rank gets its own back, from the shard
    # it wrote itself.
    inner = [saved.inner_states(rank) for rank in range(2)]
    moments = [states[0]["state"][0]["exp_avg"] for states in inner if states is not None]
    assert not torch.equal(moments[0], moments[1])
    for a, b in zip(uninterrupted, resumed, strict=True):
        torch.testing.assert_close(b["params"], a["params"], rtol=0, atol=0)


def _run_script(tmp_path: Path, text: str, args: list[str], outputs: list[Path]) -> tuple[int | None, str]:
    """Run ``text`` as a user's training script (``python fit.py tmp_path *args``), its ranks started as Lightning
    starts them; wait for ``outputs`` (rank 1 may write after rank 0 has exited). Returns the exit code and stderr.
    """
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "fit.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(tmp_path), *args]
    # A session of its own: rank 1 is rank 0's child, and nothing may outlive the test.
    process = subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=240)
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in outputs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr


_SECOND_FIT_SCRIPT = """
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy
from tests.helpers import StackModel, regression_data

out = Path(sys.argv[1])


def trainer(**kwargs):
    strategy = OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(sync_every=4))
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )


def loader():
    return DataLoader(regression_data(64), batch_size=8)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


straight = trainer(max_epochs=2, enable_checkpointing=False)
model = StackModel(optimizer="adam")
straight.fit(model, loader())
rank = straight.global_rank
torch.save(params(model), out / f"straight{rank}.pt")
# One Trainer fits an epoch, then fits again from its checkpoint: the second fit's checkpoint is loaded before its
# setup, while the strategy still holds the first fit's local SGD loop.
again = trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0)])
model = StackModel(optimizer="adam")
again.fit(model, loader())
again.fit_loop.max_epochs = 2
again.fit(model, loader(), ckpt_path=str(out / "ckpt" / "last.ckpt"))
torch.save(params(model), out / f"again{rank}.pt")
torch.save(again.strategy.local_sgd.syncs, out / f"syncs{rank}.pt")
"""


@pytest.mark.slow
def test_a_second_fit_of_one_trainer_resumes_its_outer_loop(tmp_path):
    # 4 steps per epoch, H = 4: the first fit's checkpoint lies on a sync, so the second fit from it must end as an
    # uninterrupted run does, bit for bit. Ranks started as a script starts them (one Trainer fitting twice).
    outputs = [tmp_path / f"{name}{rank}.pt" for name in ("again", "syncs") for rank in range(2)]
    returncode, stderr = _run_script(tmp_path, _SECOND_FIT_SCRIPT, [], outputs)
    assert returncode == 0, stderr[-3000:]
    for rank in range(2):
        straight, again = (torch.load(tmp_path / f"{name}{rank}.pt") for name in ("straight", "again"))
        torch.testing.assert_close(again, straight, rtol=0, atol=0)
        assert torch.load(tmp_path / f"syncs{rank}.pt") == 2  # the first fit's sync, restored, and the second's


@pytest.mark.quick
@pytest.mark.parametrize("overflowing", [0, 1])
def test_an_overflow_on_one_rank_skips_its_step_and_the_ranks_still_sync_together(tmp_path, overflowing):
    # fp16 AMP, local from the start, H = 4; one rank (rank 0 as well as another) overflows at the second step of
    # each epoch: only its scaler backs off and skips, yet both ranks reach the syncs at steps 4 and 8 together
    # (the schedule counts calls).
    monitor = AMPMonitor()
    ranks = _fit(
        tmp_path,
        LocalSGDConfig.diloco(sync_every=4),
        model=OverflowModel(overflow_at=(2,), ranks=(overflowing,)),
        max_epochs=2,
        plugins=[fp16_mixed_precision("cpu")],
        callbacks=[monitor],
    )
    assert [record["skipped_inner"] for record in ranks] == [2 if rank == overflowing else 0 for rank in range(2)]
    for step in (4, 8):
        assert torch.equal(ranks[0]["params"][step - 1], ranks[1]["params"][step - 1])
    assert all(bool(record["params"][-1].isfinite().all()) for record in ranks)
    assert all(record["local"]["syncs"] == 2 for record in ranks)


@pytest.mark.quick
def test_manual_optimization_with_accumulation(tmp_path):
    # 4 micro-batches per rank and epoch, accumulate(every=2): 2 optimizer steps per epoch, H = 2.
    ranks = _fit(tmp_path, LocalSGDConfig.post_local_sgd(sync_every=2), model=ManualStackModel(every=2), max_epochs=2)
    for record in ranks:
        assert [rounds for rounds, _, _ in record["steps"]] == [0, 1, 0, 1]
        assert record["local"]["steps"] == 4
    assert torch.equal(ranks[0]["params"][-1], ranks[1]["params"][-1])
    assert not torch.equal(ranks[0]["params"][-2], ranks[1]["params"][-2])  # between syncs: their own


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, r"LocalSGDConfig sync_every=0 must be"),
        ({"outer_lr": 0.0}, r"LocalSGDConfig outer_lr=0.0 must be a positive, finite number"),
        ({"outer_momentum": 1.0}, r"LocalSGDConfig outer_momentum=1.0 must be in \[0, 1\)"),
        ({"nesterov": True}, r"nesterov=True needs outer_momentum > 0"),
        ({"compression": "int4"}, r"compression='int4' is not valid; choose one of \['fp32', 'fp16', 'bf16', 'int8'"),
        ({"buffers": "sum"}, r"buffers='sum' is not valid"),
        ({"warmup_steps": -1}, r"LocalSGDConfig warmup_steps=-1 must be"),
        ({"outer_momentum": 0.9, "nesterov": "yes"}, r"LocalSGDConfig nesterov='yes' must be True or False"),
        (
            {"sync_every": "fast"},
            r"LocalSGDConfig sync_every='fast' must be an int >= 1 \(optimizer steps between parameter syncs\) or "
            r"'auto' \(chosen from the first window's step and sync\)",
        ),
        ({"sync_every": 4.0}, r"LocalSGDConfig sync_every=4.0 must be an int >= 1 .* or 'auto'"),
        ({"outer_lr": "fast"}, r"LocalSGDConfig outer_lr='fast' must be a positive, finite number or 'auto'"),
        ({"outer_momentum": "high"}, r"LocalSGDConfig outer_momentum='high' must be in \[0, 1\) or 'auto'"),
        (
            {"sync_every": "auto", "overlap_steps": 16},
            r"LocalSGDConfig overlap_steps=16 must be below sync_every='auto' \(its first window of 16 steps\)",
        ),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalSGDConfig(**kwargs)


@pytest.mark.quick
def test_combinations_that_cannot_apply_are_refused():
    with pytest.raises(ValueError, match=r"comm_hook='fp16' would never run: with local_sgd and warmup_steps=0"):
        OptimizedDDPStrategy(comm_hook="fp16", local_sgd=LocalSGDConfig())
    with pytest.raises(ValueError, match=r"comm_hook='auto' with local_sgd"):
        OptimizedDDPStrategy(comm_hook="auto", local_sgd=LocalSGDConfig(warmup_steps=10))
    with pytest.raises(ValueError, match=r"local_sgd and model_averaging_period=4 both given"):
        OptimizedDDPStrategy(model_averaging_period=4, local_sgd=LocalSGDConfig())
    with pytest.raises(TypeError, match=r"local_sgd=16 must be a LocalSGDConfig"):
        OptimizedDDPStrategy(local_sgd=16)
    # A hook for the warm-up is fine.
    OptimizedDDPStrategy(comm_hook="fp16", local_sgd=LocalSGDConfig(warmup_steps=10))


@pytest.mark.quick
def test_presets():
    assert LocalSGDConfig.diloco(32) == LocalSGDConfig(
        sync_every=32, outer_lr="auto", outer_momentum="auto", nesterov=True, compression="fp16"
    )
    lr, momentum = OUTER_DEFAULTS["adaptive"]
    assert LocalSGDConfig.diloco(32).fit_outer(adaptive=True) == LocalSGDConfig(
        sync_every=32, outer_lr=lr, outer_momentum=momentum, nesterov=True, compression="fp16"
    )
    assert LocalSGDConfig.diloco("auto").sync_every == "auto"
    assert LocalSGDConfig.post_local_sgd(8, warmup_steps=100) == LocalSGDConfig(sync_every=8, warmup_steps=100)


@pytest.mark.quick
def test_stack_model_has_no_buffers():
    assert not list(StackModel().buffers())  # the byte counts above rely on it


@pytest.mark.quick
def test_int8_mean_is_within_half_a_quantisation_step(gloo_group):
    torch.manual_seed(0)
    module = nn.Linear(100, 30)  # 3030 parameters: 3 blocks, the last one padded
    local = LocalSGD(LocalSGDConfig(sync_every=1, compression="int8"), module)
    delta = torch.randn(3030) * torch.linspace(0.01, 10, 3030)
    local.before_batch()  # anchored: the kept buffers are allocated
    mean = local._work_buffer().copy_(delta)
    sent, committed = local._average(mean)
    assert committed
    assert sent == 3 * 1024 + 3 * 4
    for block in range(3):
        part = slice(block * 1024, min((block + 1) * 1024, 3030))
        step = delta[part].abs().max() / 127
        assert (mean[part] - delta[part]).abs().max() <= step / 2 + 1e-6


@pytest.mark.parametrize(("compression", "atol"), [("fp32", 1e-7), ("fp16", 1e-6), ("int8", 1e-4)])
def test_a_run_ending_between_syncs_ends_with_the_ranks_average(tmp_path, compression, atol):
    # 6 steps, H = 4: a sync at step 4, then 2 steps alone; the model after fit is the ranks' plain average, sent
    # as the change since the sync (compressed like the syncs: the change is small, so the error is too).
    config = LocalSGDConfig.diloco(sync_every=4, compression=compression)
    ranks = _fit(tmp_path, config, max_steps=6, max_epochs=2)
    last = [record["params"][-1] for record in ranks]
    assert not torch.equal(last[0], last[1])
    torch.testing.assert_close(ranks[0]["final"], (last[0] + last[1]) / 2, rtol=0, atol=atol)
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
    assert all(record["local"]["syncs"] == 1 for record in ranks)  # the final average is not an outer step
    assert all(record["averaged_at_end"] for record in ranks)


def test_resume_between_syncs_continues_from_rank_0_and_syncs_on_schedule(tmp_path):
    # H = 3, 4 steps per epoch: the epoch-1 checkpoint lies one step after the sync at step 3. The resume loads
    # rank 0's weights on every rank (one copy in the checkpoint), restores the anchor, the outer momentum, the step
    # count and each rank's own optimizer state, syncs at step 6 as scheduled and averages at the end (step 8).
    def make():
        return OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(sync_every=3), start_method="fork")

    fit_ddp(tmp_path / "first", make(), model=StackModel(optimizer="adam"), max_epochs=1, save_last_to=tmp_path)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["ddpopt"]
    assert saved["local_sgd"]["steps"] == 4 and saved["local_sgd"]["syncs"] == 1
    probe = ParamsPerStep(tmp_path)
    fit_ddp(
        tmp_path / "resumed",
        make(),
        model=StackModel(optimizer="adam"),
        max_epochs=2,
        ckpt_path=str(tmp_path / "last.ckpt"),
        callbacks=[probe],
    )
    ranks = [torch.load(tmp_path / f"local{rank}.pt") for rank in range(2)]
    for record in ranks:
        assert record["local"]["steps"] == 8 and record["local"]["syncs"] == 2 and record["averaged_at_end"]
    # Steps 5-8 of the resumed run: alone at 5, synced at 6, alone at 7 and 8, averaged after fit.
    params = [record["params"] for record in ranks]
    assert [torch.equal(params[0][i], params[1][i]) for i in range(4)] == [False, True, False, False]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


class _ValidatedStackModel(StackModel):
    """Validates every epoch, with a loss synced across ranks, while the ranks train alone."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(regression_data(32, seed=1), batch_size=8)


class _Findings(pl.Callback):
    """Saves rank 0's findings and the CommProfiler's last figures at the end of fit."""

    def __init__(self, out: Path, profiler: CommProfiler) -> None:
        self.out, self.profiler = out, profiler

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            findings = {f.area: f.evidence for f in diagnose(summarize(trainer))}
            torch.save((findings, self.profiler.summary()), self.out / "findings.pt")


@pytest.mark.parametrize("overlap", [0, 2])
def test_the_profiler_and_the_findings_report_local_sgd_as_it_is(tmp_path, overlap):
    # H = 4, 12 steps, the profiler's interval 4 steps: one parameter sync per interval, none of the per-step gradient
    # syncs a network or accumulation finding would otherwise miss. With overlap the step waits for no transfer: no
    # bandwidth can be measured from it, and none is made up.
    profiler = CommProfiler(every_n_steps=4, probe_link=True)
    config = LocalSGDConfig.diloco(sync_every=4, overlap_steps=overlap)
    _fit(tmp_path, config, max_epochs=3, callbacks=[profiler, _Findings(tmp_path, profiler)])
    findings, comm = torch.load(tmp_path / "findings.pt")
    assert "nan" not in " ".join(findings.values())
    # Syncs at steps 4, 8 and 12; overlapped, applied at 6 and 10, and step 12's after the last step.
    per_step = "0.17" if overlap else "0.25"
    assert findings["accumulation"] == (
        f"local SGD: {per_step} syncs per optimizer step over 1.00 micro-batches (parameters every 4 steps after 0 "
        "synchronous ones, 3 parameter syncs)"
    )
    assert comm["bytes_sent"] == pytest.approx(SENT["fp16"] / 4)  # one fp16 change per 4 steps
    assert f"{format_bytes(SENT['fp16'] / 4)} sent per step" in findings["network"]
    if overlap:
        assert "busbw_gbps" not in comm and "bus bandwidth" not in findings["network"]
    else:
        assert comm["busbw_gbps"] > 0 and "bus bandwidth" in findings["network"]


def test_validation_between_syncs_runs_and_the_ranks_still_meet(tmp_path):
    # Validation at each epoch end falls between syncs (H = 3, 4 steps per epoch): its forward passes and synced
    # logging run on every rank without a gradient sync, and the schedule goes on.
    ranks = _fit(tmp_path, LocalSGDConfig.diloco(sync_every=3), model=_ValidatedStackModel(), max_epochs=3)
    for record in ranks:
        assert record["local"]["steps"] == 12 and record["local"]["syncs"] == 4
    assert torch.equal(ranks[0]["params"][-1], ranks[1]["params"][-1])  # step 12 is a sync


@pytest.mark.quick
def test_saved_state_of_another_config_is_refused_with_the_reason(gloo_group):
    local = LocalSGD(LocalSGDConfig.diloco(16), nn.Linear(2, 2))
    saved = LocalSGD(LocalSGDConfig.diloco(8), nn.Linear(2, 2)).state_dict()
    assert local.load_state_dict(saved) == (
        "the local SGD config changed (sync_every 8 -> 16); the outer loop starts afresh from the weights"
    )
    assert local.steps == 0 and local.anchor is None
    assert local.load_state_dict({}) == (
        "the saved local SGD state has no config; the outer loop starts afresh from the weights"
    )


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def _local_step(module: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return _flat(module)


def _int8_round_trip(delta: torch.Tensor) -> torch.Tensor:
    """One rank's change as an int8 sync carries it: quantised in 1024-value blocks, then dequantised."""
    from lightning_ddpopt.hooks.int8_codec import average_packed, quantize_packed

    blocks = torch.zeros(math.ceil(delta.numel() / 1024), 1024)
    blocks.view(-1)[: delta.numel()] = delta
    average_packed(quantize_packed(blocks), blocks)
    return blocks.view(-1)[: delta.numel()].clone()


@pytest.mark.quick
@pytest.mark.parametrize("compression", ["fp32", "int8"])
def test_an_overlapped_sync_is_applied_tau_steps_later_keeping_what_the_rank_learned(gloo_group, compression):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    local = LocalSGD(LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, compression=compression), module)
    carried = _int8_round_trip if compression == "int8" else (lambda delta: delta)
    sent = 32 if compression == "fp32" else 1024 + 4  # one block and its scale
    local.before_batch()
    anchor, momentum = _flat(module), torch.zeros(8)
    params = {}
    for step in range(1, 11):
        params[step] = _local_step(module)
        report = local.after_optimizer_step()
        # Started at steps 4 and 8 (nothing moves), applied at 6 and 10: a sync each.
        assert (report is not None) == (step in (6, 10)), step
        if step in (6, 10):
            started = params[step - 2]
            delta = carried(anchor - started)  # one rank: the mean change is its own
            momentum = OUTER_MOMENTUM * momentum + delta
            anchor = anchor - OUTER_LR * (delta + OUTER_MOMENTUM * momentum)
            torch.testing.assert_close(local.anchor, anchor)
            # Half the rank's own parameters (with what it learned while the change travelled), half the anchor.
            torch.testing.assert_close(_flat(module), 0.5 * params[step] + 0.5 * anchor)
            params[step] = _flat(module)
            assert report.wire_bytes == sent and local.local_steps_since_sync == 4 + 2
        else:
            torch.testing.assert_close(_flat(module), params[step], rtol=0, atol=0)
    assert local.syncs == 2
    # Started at step 12; training ends at step 13: the travelling sync is applied, then the ranks averaged.
    params[11], _ = _local_step(module), local.after_optimizer_step()
    params[12], _ = _local_step(module), local.after_optimizer_step()
    params[13], _ = _local_step(module), local.after_optimizer_step()
    assert local.finish() is not None and local.syncs == 3 and local.averaged_at_end
    delta = carried(anchor - params[12])
    momentum = OUTER_MOMENTUM * momentum + delta
    anchor = anchor - OUTER_LR * (delta + OUTER_MOMENTUM * momentum)
    # Step 12's sync applied (mixed with step 13's parameters), then the average: the rank's own parameters as the
    # final average carries them (for int8, quantised relative to the anchor).
    mixed = 0.5 * params[13] + 0.5 * anchor
    torch.testing.assert_close(_flat(module), anchor - carried(anchor - mixed))
    torch.testing.assert_close(local.anchor, _flat(module))


@pytest.mark.quick
def test_overlap_needs_fewer_steps_than_a_window():
    with pytest.raises(ValueError, match=r"overlap_steps=4 must be below sync_every=4"):
        LocalSGDConfig.diloco(sync_every=4, overlap_steps=4)
    with pytest.raises(ValueError, match=r"LocalSGDConfig overlap_steps=-1 must be an int >= 0"):
        LocalSGDConfig(overlap_steps=-1)
    with pytest.raises(ValueError, match=r"LocalSGDConfig overlap_mixing=1.5 must be in \[0, 1\]"):
        LocalSGDConfig(sync_every=4, overlap_steps=2, overlap_mixing=1.5)


@pytest.mark.parametrize("compression", ["fp16", "int8"])
@pytest.mark.parametrize("devices", [2, 3])
def test_overlapped_syncs_in_a_lightning_run(tmp_path, devices, compression):
    # H = 4, tau = 2, no warm-up, 12 steps: started at 4, 8, 12; applied at 6 and 10 and, at the end, 12's.
    config = LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, compression=compression)
    ranks = _fit_12_steps(tmp_path, config, devices)
    for record in ranks:
        rounds = [rounds for rounds, _, _ in record["steps"]]
        assert rounds == [1 if step in (6, 10) else 0 for step in range(1, 13)]
        for step in (6, 10):
            assert record["steps"][step - 1][1:] == (PARAMETERS * 4, _sent(compression, devices))
        # Step 12's sync, travelling when training ended, is applied at the end, then the ranks are averaged.
        assert record["local"]["syncs"] == 3 and record["averaged_at_end"]
        assert record["local"]["in_flight"] is None
        torch.testing.assert_close(record["local"]["anchor"], ranks[0]["local"]["anchor"], rtol=0, atol=0)
        torch.testing.assert_close(record["final"], ranks[0]["final"], rtol=0, atol=0)
    for step in range(1, 13):  # the anchor is shared; the parameters keep each rank's last tau steps
        assert not torch.equal(ranks[0]["params"][step - 1], ranks[1]["params"][step - 1]), step


class _SlowRank(StackModel):
    def __init__(self, slow_rank: int, seconds: float) -> None:
        super().__init__()
        self.slow_rank, self.seconds = slow_rank, seconds

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)


class _SaveAt(pl.Callback):
    """Saves a checkpoint on every rank after optimizer step ``step``, as a user's callback would."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("slow_rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_save_waits_for_a_rank_that_trains_on_apart(tmp_path, slow_rank):
    # H = 8: the ranks train apart for the whole run. The slow rank sleeps 0.4 s a step, so it reaches the save at
    # step 6 about 2.4 s after the other: the save waits for it under the process group's timeout, as Lightning's own
    # barrier would, instead of ending a healthy run. (ModelCheckpoint broadcasts whether its file exists first,
    # which already waits for every rank.)
    ranks = _fit(
        tmp_path,
        LocalSGDConfig(sync_every=8),
        model=_SlowRank(slow_rank, 0.4),
        max_steps=8,
        max_epochs=2,
        callbacks=[_SaveAt(tmp_path / "step6.ckpt", 6)],
    )
    saved = read_saved_run(tmp_path / "step6.ckpt")
    assert saved is not None and saved.local_sgd is not None
    assert [saved.inner_states(rank) is not None for rank in range(2)] == [True, True]
    assert saved.local_sgd["steps"] == 6
    assert all(record["local"]["steps"] == 8 and record["local"]["syncs"] == 1 for record in ranks)


class _LoneSaveAt(pl.Callback):
    """Rank 0 alone saves after optimizer step ``step``; records the error and how long it took."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step = out, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        start = time.perf_counter()
        try:
            trainer.save_checkpoint(self.out / "lone.ckpt")
            message = None
        except RuntimeError as error:
            message = str(error)
        torch.save({"message": message, "seconds": time.perf_counter() - start}, self.out / "lone.pt")


def test_a_save_fails_once_the_rank_it_waits_for_stops_training(tmp_path):
    # Rank 0 alone saves at step 2 of a window of 8 while rank 1 trains on: the save fails after checkpoint_timeout,
    # naming rank 1, and rank 0 goes on to meet it at the sync of step 8 (the saves' group is not training's).
    ranks = _fit(
        tmp_path,
        LocalSGDConfig(sync_every=8),
        model=_SlowRank(1, 0.3),
        max_steps=8,
        max_epochs=2,
        callbacks=[_LoneSaveAt(tmp_path, 2)],
        strategy_kwargs={"checkpoint_timeout": 1.0},
    )
    result = torch.load(tmp_path / "lone.pt")
    # Ours around torch's own line naming the missing rank (its wording is torch's: matched loosely).
    assert re.fullmatch(
        r"ddpopt: saving a checkpoint needs every rank \(each saves its own comm-hook or local SGD state\), but not "
        r"every rank called save_checkpoint within 1 s \(.*Rank 1 .*monitoredBarrier.*\)\. Call "
        r"trainer\.save_checkpoint on every rank, as Lightning's DDP strategies require \(ModelCheckpoint does\)\.",
        result["message"],
    ), result["message"]
    assert 1 <= result["seconds"] < 8, result
    assert all(record["local"]["syncs"] == 1 for record in ranks)


@pytest.mark.parametrize("compression", ["fp16", "int8"])
def test_resume_with_a_sync_in_flight_applies_it(tmp_path, compression):
    from lightning.pytorch.callbacks import ModelCheckpoint

    # H = 4, tau = 2, 4 steps per epoch: the checkpoint at step 5 holds step 4's sync, travelling until step 6 (its
    # mean: int8's packed rows are saved averaged, in fp32).
    config = LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, compression=compression)
    # The uninterrupted run saves the same checkpoint and trains on: saving must leave the travelling sync as it was.
    also_saves = ModelCheckpoint(dirpath=tmp_path / "full_ckpt", every_n_train_steps=5, save_top_k=-1)
    uninterrupted = _fit(
        tmp_path / "full", config, max_steps=12, max_epochs=3, callbacks=[also_saves], enable_checkpointing=True
    )
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    _fit(tmp_path / "first", config, max_steps=5, max_epochs=3, callbacks=[saver], enable_checkpointing=True)
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=5.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["ddpopt"]["local_sgd"]
    assert saved["steps"] == 5 and saved["syncs"] == 0
    dtype = torch.float16 if compression == "fp16" else torch.float32
    assert saved["in_flight"]["apply_at"] == 6 and saved["in_flight"]["mean"].dtype == dtype
    resumed = _fit(tmp_path / "resumed", config, max_steps=12, max_epochs=3, ckpt_path=str(checkpoint))
    # Applied at step 6: the same mean, the same outer step, so the same anchor as without the interruption.
    for full, again in zip(uninterrupted, resumed, strict=True):
        torch.testing.assert_close(again["anchors"][0], full["anchors"][5], rtol=0, atol=0)
        assert again["local"]["syncs"] == full["local"]["syncs"] == 3
        torch.testing.assert_close(again["final"], resumed[0]["final"], rtol=0, atol=0)


@pytest.mark.parametrize("compression", ["fp16", "int8"])
def test_overlapped_syncs_under_fp16_amp_with_an_overflow_on_rank_0(tmp_path, compression):
    # H = 4, tau = 2, two epochs of 4 steps; rank 0 overflows at the second step of each epoch: only its scaler
    # skips; both ranks start syncs at 4 and 8 and apply them at 6 and at the end, with the same anchor.
    monitor = AMPMonitor()
    ranks = _fit(
        tmp_path,
        LocalSGDConfig.diloco(sync_every=4, overlap_steps=2, compression=compression),
        model=OverflowModel(overflow_at=(2,), ranks=(0,)),
        max_epochs=2,
        plugins=[fp16_mixed_precision("cpu")],
        callbacks=[monitor],
    )
    assert [record["skipped_inner"] for record in ranks] == [2, 0]
    for step in (6, 7, 8):  # after the first arrival, until the end: one anchor
        torch.testing.assert_close(ranks[0]["anchors"][step - 1], ranks[1]["anchors"][step - 1], rtol=0, atol=0)
    assert all(record["local"]["syncs"] == 2 and record["averaged_at_end"] for record in ranks)
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"], rtol=0, atol=0)
    assert all(bool(record["final"].isfinite().all()) for record in ranks)


_MEETINGS: list[int] = []


class _Meetings(pl.Callback):
    """Saves, per rank, the global steps at which the ranks met for the SIGTERM check before a batch."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(list(_MEETINGS), self.out / f"meetings{trainer.global_rank}.pt")


@pytest.mark.parametrize("overlap", [0, 2])
def test_ranks_meet_only_at_syncs_not_before_every_batch(tmp_path, monkeypatch, overlap):
    # Lightning broadcasts rank 0's SIGTERM flag before every training batch (a barrier each step); local SGD's
    # ranks meet in the warm-up and at the first batch of each sync window only, on every rank alike.
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_ddpopt.localsgd.sigterm import SigtermAtSyncs

    lightning_broadcast = _TrainingEpochLoop._broadcast_sigterm_tensor
    meet, meet_in_passing = SigtermAtSyncs._meet, SigtermAtSyncs._meet_in_passing

    def broadcast_counted(loop: _TrainingEpochLoop) -> None:
        _MEETINGS.append(loop.trainer.global_step)
        lightning_broadcast(loop)

    def meet_counted(sigterm: SigtermAtSyncs) -> None:
        _MEETINGS.append(sigterm.trainer.global_step)
        meet(sigterm)

    def meet_in_passing_counted(sigterm: SigtermAtSyncs) -> None:
        _MEETINGS.append(-sigterm.trainer.global_step)  # negative: not waiting for the others
        meet_in_passing(sigterm)

    # The forked ranks inherit them.
    monkeypatch.setattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", broadcast_counted)
    monkeypatch.setattr(SigtermAtSyncs, "_meet", meet_counted)
    monkeypatch.setattr(SigtermAtSyncs, "_meet_in_passing", meet_in_passing_counted)
    config = LocalSGDConfig(sync_every=4, warmup_steps=2, overlap_steps=overlap)
    # 12 steps, accumulating 2 batches: in the warm-up every batch meets, in the local phase a window's first only.
    ranks = _fit(tmp_path, config, max_epochs=6, accumulate_grad_batches=2, callbacks=[_Meetings(tmp_path)])
    for rank in range(2):
        assert torch.load(tmp_path / f"meetings{rank}.pt") == [0, 0, 1, 1, -2, -6, -10]
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"], rtol=0, atol=0)
    # Without local SGD: Lightning's broadcast before every batch.
    stock = OptimizedDDPStrategy(start_method="fork")
    fit_ddp(tmp_path / "stock", stock, max_epochs=2, callbacks=[_Meetings(tmp_path)])
    for rank in range(2):
        assert torch.load(tmp_path / f"meetings{rank}.pt") == list(range(8))


class _LateAfterLaunch(pl.Callback):
    """One rank sleeps once it has launched an overlapped sync; every rank notes when it ended which step."""

    def __init__(self, out: Path, late_rank: int, sleep_after_step: int, seconds: float) -> None:
        self.out, self.late_rank, self.sleep_after_step, self.seconds = out, late_rank, sleep_after_step, seconds
        self.ended: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == self.late_rank and trainer.global_step == self.sleep_after_step:
            time.sleep(self.seconds)
        self.ended[trainer.global_step] = time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(self.ended, self.out / f"ended{trainer.global_rank}.pt")


@pytest.mark.parametrize("late_rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_window_meeting_does_not_wait_for_a_late_rank(tmp_path, late_rank):
    # H = 4, warm-up 2, tau = 2: a sync launched at the end of step 6 arrives at the end of step 8, and a window's
    # meeting opens step 7. The late rank sleeps 3 s after launching; the other passes the meeting (a barrier in
    # Lightning's check and in this package's before it met in passing) and ends step 7 while the late one sleeps
    # (its part of the sync travels meanwhile). The ranks still end as one model.
    config = LocalSGDConfig(sync_every=4, warmup_steps=2, overlap_steps=2)
    late = _LateAfterLaunch(tmp_path, late_rank, sleep_after_step=6, seconds=3.0)
    ranks = _fit(tmp_path, config, max_epochs=3, callbacks=[late])  # 12 steps
    ended = [torch.load(tmp_path / f"ended{rank}.pt") for rank in range(2)]
    other = 1 - late_rank
    assert ended[other][7] < ended[late_rank][6], f"rank {other} waited for the late rank at the window's meeting"
    torch.testing.assert_close(ranks[0]["final"], ranks[1]["final"], rtol=0, atol=0)


_SIGTERM_SCRIPT = """
import os, signal, sys
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy
from tests.helpers import StackModel, regression_data

out, signalled, overlap = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


class Stop(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_rank == signalled and trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception):
        (out / f"stop{trainer.global_rank}").write_text(f"{type(exception).__name__} {trainer.global_step}")

    def on_train_end(self, trainer, pl_module):
        (out / f"stop{trainer.global_rank}").write_text(f"end {trainer.global_step}")


config = LocalSGDConfig(sync_every=4, warmup_steps=2, overlap_steps=overlap)
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy=OptimizedDDPStrategy(local_sgd=config), max_epochs=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Stop()],
)
trainer.fit(StackModel(), DataLoader(regression_data(64), batch_size=8))
"""


@pytest.mark.parametrize(
    ("signalled", "overlap"), [pytest.param(0, 0, id="0-0"), pytest.param(1, 2, id="1-2", marks=pytest.mark.slow)]
)
def test_a_sigterm_on_any_rank_stops_every_rank_within_two_sync_windows(tmp_path, signalled, overlap):
    # Lightning's handler broadcasts from inside the handler, to be matched by the others' next per-batch check;
    # with checks at sync windows only, the others would be waiting in a sync meanwhile: a deadlock. With local SGD
    # the handler records the signal, the next window's meeting carries it (without waiting) and every rank stops
    # after the first batch of the window after, whichever rank received it (Lightning's own check hears rank 0
    # only). Ranks started as a user's script starts them.
    stops = [tmp_path / f"stop{rank}" for rank in range(2)]
    _, stderr = _run_script(tmp_path, _SIGTERM_SCRIPT, [str(signalled), str(overlap)], stops)
    # SIGTERM at the end of step 3; windows open at steps 2, 6 and 10: the meeting started at step 6 carries it, and
    # every rank reads it at step 10 and stops after that batch (of 12).
    stopped = [stop.read_text() if stop.exists() else None for stop in stops]
    assert stopped == ["SIGTERMException 11"] * 2, stderr[-3000:]


class _LateRank(_LateAfterLaunch):
    """``late_rank`` sleeps at the end of one local step; every rank notes when it ended each step, and what the
    measuring callbacks concluded."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        found = {type(c).__name__: c for c in trainer.callbacks}
        record = {
            "ended": self.ended,
            "comm": found["CommProfiler"].last_metrics,
            "straggler_windows": found["StragglerDetector"].windows,
            "amp_steps": found["AMPMonitor"].steps,
            "nonfinite_steps": found["AMPMonitor"].nonfinite_steps,
        }
        torch.save(record, self.out / f"late{trainer.global_rank}.pt")


@pytest.mark.parametrize(
    ("late_rank", "overlap", "devices"),
    [pytest.param(0, 0, 2, id="0-0-2"), pytest.param(1, 2, 3, id="1-2-3", marks=pytest.mark.slow)],
)
def test_with_every_measuring_callback_the_ranks_meet_only_at_syncs(tmp_path, late_rank, overlap, devices):
    # H = 4 after a warm-up of 2: parameter syncs start at steps 6 and 10 (overlapped: applied 2 steps later). The
    # callbacks want to meet every step (every_n_steps=1; AMPMonitor's check of every step); between syncs they keep
    # their figures and exchange them at the next sync's start. The late rank sleeps 3 s after step 3: the other
    # ranks end steps 4 and 5 meanwhile, and wait at step 6. Before, AMPMonitor's per-step all-reduce made them
    # wait at step 4.
    # Overlapped, the sync's start is a meeting in passing: the callbacks' gathers travel with it, and the other ranks
    # wait only where the sync is applied (step 8), for the late rank's start of it.
    late = _LateRank(tmp_path, late_rank, sleep_after_step=3, seconds=3.0)
    measuring = [CommProfiler(every_n_steps=1, probe_link=False), StragglerDetector(every_n_steps=1), AMPMonitor()]
    config = LocalSGDConfig(sync_every=4, warmup_steps=2, overlap_steps=overlap)
    # 12 steps: 64 samples in batches of 8 make 4 steps an epoch on 2 ranks, 3 on 3.
    ranks = _fit(tmp_path, config, devices=devices, max_epochs=3 if devices == 2 else 4, callbacks=[late, *measuring])
    records = [torch.load(tmp_path / f"late{rank}.pt") for rank in range(devices)]
    late_ended = records[late_rank]["ended"]
    waits_at = 6 + overlap
    for other in (rank for rank in range(devices) if rank != late_rank):
        assert records[other]["ended"][waits_at - 1] < late_ended[3], f"a callback made rank {other} wait"
        assert records[other]["ended"][waits_at] > late_ended[3]  # the sync waits for the late rank
    for record in ranks[1:]:
        torch.testing.assert_close(ranks[0]["final"], record["final"], rtol=0, atol=0)
    for record in records:  # the figures still arrive: every warm-up step, the syncs at 6 and 10, the end of fit
        assert record["amp_steps"] == 12 and record["nonfinite_steps"] == 0
        assert record["straggler_windows"] == 5
        assert record["comm"]["step_time_ms"] > 0


@pytest.mark.quick
@pytest.mark.parametrize("overlap", [0, 2], ids=["plain", "overlapped"])
def test_a_nan_between_syncs_is_reported_at_a_sync_on_every_rank_and_stops_all(tmp_path, overlap):
    # The NaN at step 5 stays on rank 1 (no gradient sync), which then trains on NaN weights. The ranks do not meet
    # before step 6's parameter sync: there every rank learns of the window's steps 3-6, with rank 1's offending
    # parameters, and every rank stops. Before, the check all-reduced a flag at every step.
    # Overlapped, the ranks do not wait for each other at a sync's start: the verdicts of the check at step 6 travel
    # and are read at the next start, step 10, where every rank reports steps 3-6 and stops. The sync started at 6
    # carried rank 1's NaN change to every rank (applied at 8): the check at 10 finds every rank's parameters
    # non-finite, read at the end of fit.
    config = LocalSGDConfig(sync_every=4, warmup_steps=2, overlap_steps=overlap)
    _fit(
        tmp_path,
        config,
        model=NaNGradientModel(rank=1, step=5),
        max_epochs=3,
        callbacks=[AMPMonitor(on_nonfinite="stop"), NonfiniteReport(tmp_path)],
    )
    first_five = [name for name, _ in StackModel().named_parameters()][:5]
    reports = [{"step": 6, "steps": [3, 4, 5, 6], "names": {0: [], 1: first_five}}]
    if overlap:
        reports.append({"step": 10, "steps": [7, 8, 9, 10], "names": {0: first_five, 1: first_five}})
    first_warning = (
        "ddpopt: non-finite values in optimizer steps 3-6 (local SGD: checked at each parameter sync) (rank 0 "
        f"reporting), first offending parameters - rank 0: none; rank 1: {', '.join(first_five)}"
    )
    for rank in (0, 1):
        record = torch.load(tmp_path / f"amp{rank}.pt")
        assert record["reports"] == reports
        assert record["global_step"] == (10 if overlap else 6)
        if rank == 0:
            assert record["warned"][0] == first_warning and len(record["warned"]) == len(reports)
        else:
            assert record["warned"] == []


@pytest.mark.quick
@pytest.mark.parametrize("steps_per_batch", [1, 2])
def test_the_schedule_says_where_the_ranks_meet_whatever_the_steps_per_batch(gloo_group, steps_per_batch):
    # Warm-up 2, H = 3: syncs at optimizer step calls 5, 8, 11, ... The callbacks ask before a step whether it meets
    # (next_step_meets) and after a batch whether the ranks met in it (met_in_batch), also with several optimizer
    # steps per batch (manual optimization with two optimizers).
    loop = LocalSGD(LocalSGDConfig(sync_every=3, warmup_steps=2), nn.Linear(4, 4))
    meets_before, met_after = [], []
    for _ in range(12 // steps_per_batch):
        synced_gradients = loop.before_batch()
        assert loop.gradients_sync is synced_gradients
        for _ in range(steps_per_batch):
            meets_before.append(loop.next_step_meets)
            loop.after_optimizer_step()
        met_after.append(loop.met_in_batch)
    meeting_steps = [1, 2, 5, 8, 11]
    assert [step for step, meets in enumerate(meets_before, start=1) if meets] == meeting_steps
    batches_meeting = sorted({(step - 1) // steps_per_batch for step in meeting_steps})
    assert [batch for batch, met in enumerate(met_after) if met] == batches_meeting


# --- sync_every="auto" and the outer step's "auto" settings -------------------------------------------------------


def _chosen(sync_s: float, compute_s: float, overlap_steps: int = 0) -> tuple[int, float]:
    """The rule's H and exposed share for agreed figures: an overlap of tau steps hides tau steps' compute."""
    share = max(0.0, sync_s - overlap_steps * compute_s) / sync_s
    every = choose_sync_every(sync_s, compute_s, share)
    return (every if every > overlap_steps else min(c for c in SYNC_EVERY_CHOICES if c > overlap_steps)), share


def _steps(loop: LocalSGD, module: nn.Module, calls: int) -> list[int]:
    """``calls`` local steps of ``loop``; the step counts at which a sync was taken or applied."""
    synced = []
    for _ in range(calls):
        loop.before_batch()
        _local_step(module)
        if loop.after_optimizer_step() is not None:
            synced.append(loop.steps)
    return synced


@pytest.mark.quick
def test_sync_every_auto_trains_a_provisional_window_then_the_agreed_h_and_a_resume_keeps_it(gloo_group):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    config = LocalSGDConfig.diloco("auto", warmup_steps=2, compression="fp32")
    loop = LocalSGD(config, module)
    # The warm-up, then a provisional window: its sync (after step 18) is the one measured.
    assert _steps(loop, module, 18) == [2 + PROVISIONAL_SYNC_EVERY] and loop.choosing
    assert loop.sync_every == PROVISIONAL_SYNC_EVERY
    assert loop.agree_sync_every(0.0, 0.01) is None and loop.choosing  # nothing measured: the next sync is
    choice = loop.agree_sync_every(0.02, 0.001)
    every, share = _chosen(0.02, 0.001)
    assert choice is not None and choice == loop.sync_every_choice and not loop.choosing
    assert (choice.sync_every, choice.exposed_share, choice.since) == (every, share, 18) and loop.sync_every == every
    assert "chose H = " in choice.describe(0) and "it took 20 ms" in choice.describe(0)
    assert _steps(loop, module, 2 * every) == [18 + every, 18 + 2 * every]
    # A resume keeps the choice and its schedule, bit for bit (the checkpoint's entry).
    _steps(loop, module, 1)
    resumed = LocalSGD(config, nn.Linear(3, 2))
    assert resumed.load_state_dict(loop.state_dict()) is None
    assert resumed.sync_every_choice == choice and resumed.local_steps_since_sync == 1
    other = nn.Linear(3, 2)
    for _ in range(every):
        assert resumed.next_step_meets == loop.next_step_meets
        assert _steps(resumed, other, 1) == _steps(loop, module, 1)


@pytest.mark.quick
@pytest.mark.parametrize("sync_s", [0.05, 2.0], ids=["hidden", "exposed"])
def test_sync_every_auto_with_overlap_counts_what_tau_steps_hide_and_stays_above_tau(gloo_group, sync_s):
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    loop = LocalSGD(LocalSGDConfig.diloco("auto", overlap_steps=8, compression="fp32"), module)
    # Started after step 16, applied 8 steps later: chosen there, the windows counted from its start.
    assert _steps(loop, module, 24) == [24] and loop.choosing
    choice = loop.agree_sync_every(sync_s, 0.01)
    every, share = _chosen(sync_s, 0.01, overlap_steps=8)
    assert choice is not None and (choice.sync_every, choice.exposed_share, choice.since) == (every, share, 16)
    assert every > 8 and (share == 0.0) == (sync_s < 8 * 0.01)
    assert _steps(loop, module, every) == [16 + every + 8]  # the next sync started at 16 + H, applied 8 later


@pytest.mark.quick
def test_the_outer_auto_settings_follow_the_inner_optimizer_and_a_checkpoint_keeps_them(gloo_group, monkeypatch):
    # Rows of their own here, whatever the table holds.
    monkeypatch.setitem(OUTER_DEFAULTS, "adaptive", (0.5, 0.8))
    monkeypatch.setitem(OUTER_DEFAULTS, "other", (0.9, 0.0))
    module = nn.Linear(3, 2)
    adamw, sgd = torch.optim.AdamW(module.parameters()), torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    def outer(loop: LocalSGD) -> tuple[object, object, bool]:
        return loop.config.outer_lr, loop.config.outer_momentum, loop.config.nesterov

    loop = LocalSGD(LocalSGDConfig.diloco(4), module)
    assert loop.fit_outer_to([sgd]) and outer(loop) == (0.9, 0.0, False)  # no momentum, so no Nesterov
    assert loop.fit_outer_to([sgd, adamw]) and outer(loop) == (0.5, 0.8, True)  # any adaptive one
    partly = LocalSGD(LocalSGDConfig.diloco(4, outer_lr=0.3), module)
    assert partly.fit_outer_to([adamw]) and outer(partly) == (0.3, 0.8, True)
    plain = LocalSGD(LocalSGDConfig(outer_lr=0.5), module)  # numbers stay numbers
    assert not plain.fit_outer_to([adamw]) and plain.config == LocalSGDConfig(outer_lr=0.5)
    # The checkpoint holds the resolved values; a run resumed with "auto" keeps them, whatever its optimizer.
    loop.before_batch()
    saved = loop.state_dict()
    assert (saved["config"]["outer_lr"], saved["config"]["outer_momentum"]) == (0.5, 0.8)
    resumed = LocalSGD(LocalSGDConfig.diloco(4), nn.Linear(3, 2))
    assert resumed.load_state_dict(saved) is None and resumed.fit_outer_to([sgd])
    assert outer(resumed) == (0.5, 0.8, True) and resumed.outer_from_checkpoint and resumed.momentum is not None
    # So does one of an earlier release, whose diloco() saved DiLoCo's numbers.
    earlier = {**saved, "config": {**saved["config"], "outer_lr": 0.7, "outer_momentum": 0.9}}
    resumed = LocalSGD(LocalSGDConfig.diloco(4), nn.Linear(3, 2))
    assert resumed.load_state_dict(earlier) is None and outer(resumed) == (0.7, 0.9, True)
    # Numbers given now and saved otherwise are a changed config, as before.
    assert "outer_lr 0.5 -> 0.7" in LocalSGD(LocalSGDConfig.diloco(4, outer_lr=0.7), module).load_state_dict(saved)
    # A returning fault-tolerant island takes the live islands' outer step with their anchor and momentum (theirs
    # came from that earlier checkpoint; its own "auto" resolved for SGD), and keeps it.
    live = LocalSGD(LocalSGDConfig.diloco(4), nn.Linear(3, 2))
    assert live.load_state_dict(earlier) is None and live.momentum is not None
    live.momentum.fill_(0.25)  # what the live islands' syncs made of it
    returning = LocalSGD(LocalSGDConfig.diloco(4), nn.Linear(3, 2))
    assert returning.fit_outer_to([sgd]) and outer(returning) == (0.9, 0.0, False)
    returning.before_batch()
    assert returning.momentum is None  # no outer momentum at 0.0
    returning.load_heal_state(live.heal_state())
    assert (
        outer(returning) == (0.7, 0.9, True) and returning.fit_outer_to([sgd]) and outer(returning) == (0.7, 0.9, True)
    )
    assert returning.momentum is not None and torch.equal(returning.momentum, live.momentum)
    assert returning.anchor is not None and torch.equal(returning.anchor, live.anchor)
    heal = live.heal_state()
    del heal["outer"]  # a live island of an earlier release: the returning one keeps its own
    fresh = LocalSGD(LocalSGDConfig.diloco(4), nn.Linear(3, 2))
    fresh.fit_outer_to([sgd])
    fresh.load_heal_state(heal)
    assert outer(fresh) == (0.9, 0.0, False)
    # Only what was asked "auto" follows the live islands: a number given stays.
    given = LocalSGD(LocalSGDConfig.diloco(4, outer_lr=0.3), nn.Linear(3, 2))
    given.fit_outer_to([sgd])
    given.load_heal_state(live.heal_state())
    assert outer(given) == (0.3, 0.9, True)


def test_sync_every_auto_in_a_lightning_run_one_h_on_every_rank_and_a_resume_goes_on_bit_for_bit(tmp_path):
    # 16 steps an epoch: the first epoch's checkpoint lies on the measured sync, after the choice. Adam: the ranks'
    # own inner states and the adaptive row of the outer settings.
    config = LocalSGDConfig.diloco("auto")
    run = {"samples": 256, "max_epochs": 2}
    full = _fit(tmp_path / "full", config, model=StackModel(optimizer="adam"), save_epochs_to=tmp_path, **run)
    choices = [rank["local"]["sync_every_choice"] for rank in full]
    assert choices[0] is not None and choices[0] == choices[1]
    choice = choices[0]
    every, share = _chosen(choice["sync_s"], choice["compute_s"])
    assert (choice["sync_every"], choice["exposed_share"], choice["since"]) == (every, share, 16)
    assert full[0]["local"]["config"]["outer_lr"] == OUTER_DEFAULTS["adaptive"][0]
    # The ranks hold one model after each sync: the measured one and those at the chosen H.
    for step in range(16, 33, every):
        assert torch.equal(full[0]["params"][step - 1], full[1]["params"][step - 1]), step
    saved = read_saved_run(tmp_path / "epoch=0.ckpt")
    assert saved is not None and saved.local_sgd is not None and saved.local_sgd["sync_every_choice"] == choice
    resumed = _fit(
        tmp_path / "resumed",
        config,
        model=StackModel(optimizer="adam"),
        ckpt_path=str(tmp_path / "epoch=0.ckpt"),
        **run,
    )
    for uninterrupted, again in zip(full, resumed, strict=True):
        assert again["local"]["sync_every_choice"] == choice
        for mine, theirs in zip(again["params"], uninterrupted["params"][16:], strict=True):
            assert torch.equal(mine, theirs)
        assert torch.equal(again["final"], uninterrupted["final"])


@pytest.mark.slow
def test_sync_every_auto_on_3_ranks_with_an_overflow_in_the_measured_window_and_the_callbacks_attached(tmp_path):
    # 3 ranks, fp16 AMP; rank 0 overflows at the second step of each 11-step epoch (steps 2 and 13 lie in the
    # provisional window of 16); CommProfiler, StragglerDetector and AMPMonitor gather at the syncs. Every rank takes
    # one H, the rule's for the agreed figures, and the ranks hold one model after each sync.
    ranks = _fit(
        tmp_path,
        LocalSGDConfig.diloco("auto"),
        devices=3,
        model=OverflowModel(overflow_at=(2,), ranks=(0,)),
        samples=264,
        max_epochs=4,
        plugins=[fp16_mixed_precision("cpu")],
        callbacks=[CommProfiler(every_n_steps=4), StragglerDetector(), AMPMonitor()],
    )
    choices = [rank["local"]["sync_every_choice"] for rank in ranks]
    assert choices[0] is not None and choices[1:] == [choices[0]] * 2
    choice = choices[0]
    every, share = _chosen(choice["sync_s"], choice["compute_s"])
    assert (choice["sync_every"], choice["exposed_share"], choice["since"]) == (every, share, 16)
    assert [record["skipped_inner"] for record in ranks] == [4, 0, 0]  # one overflow an epoch, on rank 0 only
    syncs = set(range(16, 45, every))
    for step in range(1, 45):  # one model right after each sync, their own in between
        same = all(torch.equal(ranks[0]["params"][step - 1], other["params"][step - 1]) for other in ranks[1:])
        assert same == (step in syncs), step
    assert all(record["local"]["syncs"] == len(syncs) for record in ranks)
    assert all(bool(record["final"].isfinite().all()) for record in ranks)


def test_sync_every_auto_after_a_warm_up_with_an_overlapped_sync(tmp_path):
    # Warm-up 2, then the provisional window: its sync starts after step 18 and is applied after step 20, where the
    # ranks choose; 12 steps an epoch, 24 in all.
    config = LocalSGDConfig.diloco("auto", warmup_steps=2, overlap_steps=2)
    ranks = _fit(tmp_path, config, samples=192, max_epochs=2)
    choice = ranks[0]["local"]["sync_every_choice"]
    assert choice is not None and choice == ranks[1]["local"]["sync_every_choice"]
    every, share = _chosen(choice["sync_s"], choice["compute_s"], overlap_steps=2)
    assert (choice["sync_every"], choice["exposed_share"], choice["since"]) == (every, share, 18)
    # The anchor the applied sync moved to is the same on both ranks (their parameters mix it with their own).
    anchors = [rank["anchors"][19] for rank in ranks]
    assert anchors[0] is not None and torch.equal(anchors[0], anchors[1])
    assert not torch.equal(anchors[0], ranks[0]["anchors"][18])
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])
