"""The quality measurements: each lossy hook's compression error, PowerSGD's error bound, local SGD's drift.

The hooks run here on a 1-rank gloo group with a stand-in bucket, so every figure can be checked against the same
arithmetic done independently; the 2-process runs check that the figures reach the log, the report and a finding.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_ddpopt import CommProfiler, LocalSGDConfig, OptimizedDDPStrategy
from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks.auto import _ProbeBucket
from lightning_ddpopt.hooks.base import CommHookState
from lightning_ddpopt.hooks.compression import bf16_allreduce_hook, fp16_allreduce_hook
from lightning_ddpopt.hooks.int8 import Int8Config, Int8State, int8_hook
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig, PowerSGDState, powersgd_hook
from lightning_ddpopt.hooks.powersgd_rank import ERROR_BOUNDS, EXACT_PATIENCE, RANK_WINDOW, is_adaptive
from lightning_ddpopt.ledger import CommLedger, local_drift
from tests.helpers import StackModel, fit_ddp


def _norm(tensor: torch.Tensor) -> float:
    return float(tensor.double().norm())


def _sync(hook, state, ledger: CommLedger, bucket: _ProbeBucket, values: torch.Tensor):
    """One sync round of ``bucket`` holding ``values``; the step's ledger record."""
    bucket.buffer().copy_(values)
    ledger.record_hook(hook)(state, bucket).wait()
    (record,) = ledger.close_step()
    return record


@pytest.mark.quick
@pytest.mark.parametrize(
    ("hook", "dtype"), [(fp16_allreduce_hook, torch.float16), (bf16_allreduce_hook, torch.bfloat16)]
)
def test_a_cast_hooks_error_is_what_the_cast_dropped(gloo_group, hook, dtype):
    torch.manual_seed(0)
    bucket = _ProbeBucket([(4096,)], torch.device("cpu"))
    ledger = CommLedger(error_every=1)
    values = torch.randn(4096) * torch.logspace(-9, 0, 4096)  # down to fp16's subnormals: a visible error
    record = _sync(hook, CommHookState(ledger=ledger), ledger, bucket, values)
    expected = _norm(values - values.to(dtype).float()) / _norm(values)
    assert record.compression_error == pytest.approx(expected, rel=1e-6)
    assert 0 < record.compression_error < 0.01
    assert record.error_feedback == 0.0


@pytest.mark.quick
@pytest.mark.parametrize("loops", [True, False], ids=["numba", "torch"])
def test_int8s_error_and_error_fed_back_are_exact(gloo_group, monkeypatch, loops):
    if loops and not _kernels.available():
        pytest.skip("numba is not installed")
    if not loops:
        monkeypatch.setattr(_kernels, "available", lambda: False)
    torch.manual_seed(0)
    bucket = _ProbeBucket([(300, 7), (1000,)], torch.device("cpu"))
    ledger = CommLedger(error_every=1)
    state = Int8State(config=Int8Config(), ledger=ledger)
    state.bind_module(bucket.module)
    first, second = torch.randn(3100), torch.randn(3100)
    record = _sync(int8_hook, state, ledger, bucket, first)
    state.state_dict()  # commits the round's errors
    kept = torch.cat([state.errors[name].reshape(-1) for name in ("probe0", "probe1")])
    assert record.compression_error == pytest.approx(_norm(kept) / _norm(first), rel=1e-6)
    assert record.error_feedback == 0.0
    record = _sync(int8_hook, state, ledger, bucket, second)
    state.state_dict()
    now = torch.cat([state.errors[name].reshape(-1) for name in ("probe0", "probe1")])
    given = second + kept
    assert record.compression_error == pytest.approx(_norm(now) / _norm(given), rel=1e-6)
    assert record.error_feedback == pytest.approx(_norm(kept) / _norm(given), rel=1e-6)
    assert 0.001 < record.compression_error < 0.05
    # What the compression finding compares PowerSGD with: int8's own bytes (on one rank nothing is rounded up).
    assert record.wire_bytes == state.config.wire_bytes([300 * 7, 1000]) == 4 * (1024 + 4)  # 3 blocks and 1


@pytest.mark.quick
def test_ledger_samples_rounds_every_error_every(gloo_group):
    torch.manual_seed(0)
    bucket = _ProbeBucket([(1024,)], torch.device("cpu"))
    ledger = CommLedger(error_every=3)
    state = CommHookState(ledger=ledger)
    records = [_sync(fp16_allreduce_hook, state, ledger, bucket, torch.randn(1024)) for _ in range(7)]
    assert [r.compression_error is not None for r in records] == [True, False, False, True, False, False, True]
    off = CommLedger()  # the default: nothing measured, nothing computed
    assert (
        _sync(fp16_allreduce_hook, CommHookState(ledger=off), off, bucket, torch.randn(1024)).compression_error is None
    )
    with pytest.raises(ValueError, match="error_every must be an int >= 0, got -1"):
        CommLedger(error_every=-1)


def _powersgd(config: PowerSGDConfig, ledger: CommLedger, bucket: _ProbeBucket) -> PowerSGDState:
    state = PowerSGDState(config=config, ledger=ledger, cpu_kernels="blocked")
    state.bind_module(bucket.module)
    state.iteration = config.start_iter  # compressing from the first round
    return state


def _matrix(
    config: PowerSGDConfig, shape: tuple[int, int] = (96, 64), error_every: int = 0
) -> tuple[_ProbeBucket, CommLedger, PowerSGDState]:
    """A stand-in bucket holding one matrix, a ledger and a PowerSGD state compressing from the first round."""
    torch.manual_seed(0)
    bucket = _ProbeBucket([shape], torch.device("cpu"))
    ledger = CommLedger(error_every=error_every)
    return bucket, ledger, _powersgd(config, ledger, bucket)


def _random_rounds(state: PowerSGDState, ledger: CommLedger, bucket: _ProbeBucket, count: int) -> list:
    """``count`` sync rounds of random gradients; their ledger records."""
    size = bucket.buffer().numel()
    return [_sync(powersgd_hook, state, ledger, bucket, torch.randn(size)) for _ in range(count)]


def _restored(
    config: PowerSGDConfig, saved: dict, bucket: _ProbeBucket, ledger: CommLedger | None = None
) -> PowerSGDState:
    """A fresh state of ``config`` that loaded ``saved``."""
    state = PowerSGDState(config=config, ledger=ledger, cpu_kernels="blocked")
    state.bind_module(bucket.module)
    state.load_state_dict(saved)
    return state


@pytest.mark.quick
def test_powersgds_error_is_the_kept_error_and_the_same_without_error_feedback(gloo_group):
    torch.manual_seed(0)
    bucket = _ProbeBucket([(64, 48)], torch.device("cpu"))
    matrix = torch.randn(64 * 48)
    ledger = CommLedger(error_every=1)
    state = _powersgd(PowerSGDConfig(rank=2, max_error=None, start_iter=2), ledger, bucket)
    record = _sync(powersgd_hook, state, ledger, bucket, matrix)
    kept = state.errors["probe0"]
    assert record.compression_error == pytest.approx(_norm(kept) / _norm(matrix), rel=1e-6)
    assert 0.5 < record.compression_error < 1  # rank 2 of a random 64 x 48 matrix keeps little
    # Without error feedback no error is formed: the figure comes from P's orthogonality, and agrees.
    plain = CommLedger(error_every=1)
    config = PowerSGDConfig(rank=2, max_error=None, error_feedback=False, warm_start=False, start_iter=2)
    bare = _sync(powersgd_hook, _powersgd(config, plain, bucket), plain, bucket, matrix)
    assert bare.compression_error == pytest.approx(record.compression_error, rel=1e-4)


@pytest.mark.quick
def test_powersgd_raises_its_rank_while_the_error_is_above_max_error_and_resumes_exactly(gloo_group):
    torch.manual_seed(0)
    bucket = _ProbeBucket([(96, 64)], torch.device("cpu"))
    gradients = [torch.randn(96 * 64) for _ in range(4 * RANK_WINDOW)]
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=4, start_iter=2)

    def run(rounds: range, state: PowerSGDState, ledger: CommLedger) -> list[int]:
        return [_sync(powersgd_hook, state, ledger, bucket, gradients[i]).wire_bytes for i in rounds]

    ledger = CommLedger()
    state = _powersgd(config, ledger, bucket)
    sent = run(range(len(gradients)), state, ledger)
    # Measured at the window's last round, applied two rounds later: 1 -> 2 -> 4 (max_rank), then no more probes.
    first = config.start_iter + RANK_WINDOW - 1 + 2
    assert [(step, old, new) for step, _, old, new, _ in state.rank_changes] == [
        (first, 1, 2),
        (first + RANK_WINDOW, 2, 4),
    ]
    assert all(error > 0.3 for _, error, _, _, _ in state.rank_changes)
    rank_bytes = (96 + 64) * 4  # P and Q of rank 1, fp32
    start = config.start_iter
    assert sent[first - start - 1] == rank_bytes and sent[first - start] == 2 * rank_bytes
    assert sent[-1] == 4 * rank_bytes and state.rank == 4

    # Saved between a measurement and its verdict (the probe travels in the checkpoint): the same rises, the same state.
    ledger = CommLedger()
    before = _powersgd(config, ledger, bucket)
    cut = first - start - 1  # the round before the verdict is applied
    run(range(cut), before, ledger)
    saved = before.state_dict()
    assert saved["rank_probe"] is not None and saved["rank"] == 1
    after = _restored(config, saved, bucket, ledger)
    run(range(cut, len(gradients)), after, ledger)
    assert after.rank_changes == state.rank_changes and after.rank == 4
    assert torch.equal(after.errors["probe0"], state.errors["probe0"])


@pytest.mark.quick
def test_a_fixed_rank_never_changes_and_bad_bounds_fail_at_construction(gloo_group):
    bucket, ledger, state = _matrix(PowerSGDConfig(rank=1, max_error=None, start_iter=2))
    _random_rounds(state, ledger, bucket, 3 * RANK_WINDOW)
    assert state.rank == 1 and state.rank_changes == []
    with pytest.raises(ValueError, match=r"max_error=1\.5 must be a number between 0 and 1"):
        PowerSGDConfig(max_error=1.5)


@pytest.mark.quick
def test_local_drift_is_the_spread_of_the_changes_around_their_mean():
    torch.manual_seed(0)
    changes = [torch.randn(100, dtype=torch.float64) + 1 for _ in range(3)]
    mean = torch.stack(changes).mean(0)
    expected = math.sqrt(sum(_norm(c - mean) ** 2 for c in changes) / 3) / _norm(mean)
    ratios = [_norm(c) ** 2 / _norm(mean) ** 2 for c in changes]
    assert local_drift(ratios) == pytest.approx(expected, rel=1e-9)
    assert local_drift([1.0, 1.0]) == 0.0 and local_drift([]) is None


def _report(tmp_path):
    (path,) = tmp_path.glob("logs/version_*/ddpopt_report.json")
    report = json.loads(path.read_text())
    return report, {f["area"]: f for f in report["findings"]}


def test_a_low_rank_with_adam_is_reported_with_its_error_and_the_advice(tmp_path):
    # PowerSGD at a fixed rank 1 of 256 x 256 layers, Adam: the error is far above the bound for an adaptive
    # optimizer; the log, the report and the finding say so, with the rank to try.
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook=PowerSGDConfig(rank=1, max_error=None, start_iter=2), start_method="fork"),
        model=StackModel(optimizer="adam", lr=1e-3),
        callbacks=[CommProfiler(every_n_steps=4, error_every=2)],
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        samples=128,
    )
    report, findings = _report(tmp_path)
    quality = report["summary"]["comm"]["quality"]
    assert quality["compression_error_measured_syncs"] == 2 * 3  # 2 ranks x steps 3, 5, 7 (compressed from step 3)
    assert 0.6 < quality["compression_error"] <= quality["compression_error_max"] < 1
    assert report["summary"]["optimizers"] == ["Adam"]
    compression, last = findings["compression"], report["summary"]["comm"]
    assert compression["status"] == "problem"
    assert compression["evidence"].startswith(
        f"hook powersgd: relative compression error {last['compression_error']:.3f} (worst rank "
        f"{last['compression_error_max']:.3f}) over the last 4 steps; over the run {quality['compression_error']:.3f} "
        "(6 measured syncs); rank 1; above 0.6 with Adam"
    )
    assert compression["recommendation"].startswith("raise PowerSGD's rank (PowerSGDConfig(rank=2)) or let it rise")
    (metrics,) = tmp_path.glob("logs/version_*/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"ddpopt/comm/compression_error", "ddpopt/comm/compression_error_max", "ddpopt/comm/error_feedback"} <= set(
        header
    )


@pytest.mark.quick
def test_powersgd_sending_more_than_int8_would_is_reported_with_int8_as_the_advice(tmp_path):
    # Rank 64 of 256 x 256 layers: (256 + 256) x 64 fp32 values per matrix, twice int8's byte per value.
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook=PowerSGDConfig(rank=64, max_error=None, start_iter=2), start_method="fork"),
        model=StackModel(),
        callbacks=[CommProfiler(every_n_steps=4, error_every=2)],
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        samples=128,
    )
    report, findings = _report(tmp_path)
    comm, int8 = report["summary"]["comm"], report["summary"]["powersgd"]["int8_bytes"]
    assert int8 == Int8Config().wire_bytes([256 * 256, 256] * 6) and comm["bytes_sent"] > 1.5 * int8
    compression = findings["compression"]
    assert compression["status"] == "problem", compression
    assert "more than int8's" in compression["evidence"]
    assert compression["recommendation"].startswith("use comm_hook='int8': fewer bytes than PowerSGD")


@pytest.mark.quick
def test_local_sgds_drift_is_logged_and_reported(tmp_path):
    fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(local_sgd=LocalSGDConfig.diloco(4), start_method="fork"),
        callbacks=[CommProfiler(every_n_steps=4)],
        logger=CSVLogger(tmp_path, name="logs"),
        log_every_n_steps=1,
        samples=128,
    )
    report, findings = _report(tmp_path)
    comm = report["summary"]["comm"]
    assert comm["quality"]["local_drift_syncs"] == 2  # steps 4 and 8
    assert 0 < comm["quality"]["local_drift"] < 1 and 0 < comm["local_drift"] < 1  # the run's and the last interval's
    assert findings["compression"]["status"] == "ok"
    assert findings["compression"]["evidence"] == (
        f"local SGD: the ranks' parameter changes spread {comm['local_drift']:.2f} x the mean change around it at a "
        "sync (every 4 steps)"
    )


@pytest.mark.quick
def test_a_non_finite_probe_round_raises_nothing(gloo_group):
    # The probe round's gradients overflow: its measurement is NaN on every rank, so no verdict; the next probe's is.
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=2, start_iter=2)
    bucket, ledger, state = _matrix(config, error_every=1)
    probe_round = RANK_WINDOW - 1  # iteration start_iter + RANK_WINDOW - 1
    records = []
    for index in range(3 * RANK_WINDOW):
        values = torch.randn(96 * 64)
        if index == probe_round:
            values[7] = math.inf
        records.append(_sync(powersgd_hook, state, ledger, bucket, values))
    assert not math.isfinite(records[probe_round].compression_error)  # CommProfiler leaves it out
    assert state.skipped_rounds == 1
    next_verdict = config.start_iter + 2 * RANK_WINDOW - 1 + 2
    assert [(step, old, new) for step, _, old, new, _ in state.rank_changes] == [(next_verdict, 1, 2)]


@pytest.mark.quick
def test_the_error_bound_may_change_on_a_resume_and_older_states_load(gloo_group):
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=4, start_iter=2)
    bucket, ledger, state = _matrix(config)
    _random_rounds(state, ledger, bucket, 2 * RANK_WINDOW + 3)
    saved = state.state_dict()
    assert saved["rank"] == 4

    def loaded(**changes) -> PowerSGDState:
        changed = PowerSGDConfig(**{**asdict(config), **changes})
        assert PowerSGDState(config=changed).mismatch(saved) is None  # the bound is not part of the config compared
        other = _restored(changed, saved, bucket)
        assert other.iteration == saved["iteration"] and torch.equal(other.errors["probe0"], state.errors["probe0"])
        return other

    assert loaded(max_rank=16).rank == 4  # a higher ceiling keeps the rank reached, and may raise it further
    assert loaded(max_error=0.5, max_rank=2).rank == 2  # within the new ceiling
    assert loaded(max_error=None).rank == 1  # a fixed rank is the config's
    # A state saved before the bound existed: no rank, no max_error or max_rank in its config.
    older = {**saved, "config": {k: v for k, v in saved["config"].items() if k not in ("max_error", "max_rank")}}
    for key in [key for key in saved if key.startswith(("rank", "default_rank", "matrix_ranks"))]:
        older.pop(key)
    fresh = PowerSGDState(config=config, cpu_kernels="blocked")
    fresh.load_state_dict(older)
    assert (fresh.rank, fresh.rank_changes, fresh.iteration) == (1, [], saved["iteration"])
    # A state of the release with one rank for every matrix: every matrix takes its rank; its probe decides nothing.
    single = {key: value for key, value in older.items()}
    single.update(
        rank=4, rank_changes=[[8, 0.7, 1, 2], [13, 0.5, 2, 4]], rank_probe={"norms": [1.0, 0.5], "decide_at": 18}
    )
    restored = _restored(config, single, bucket)
    assert (restored.rank, restored.rank_of("probe0"), restored.ranks.lowest) == (4, 4, 4)
    assert [tuple(change) for change in restored.rank_changes] == [(8, 0.7, 1, 2, "*"), (13, 0.5, 2, 4, "*")]
    assert restored.ranks.state_dict()["rank_probe"] is None
    assert PowerSGDConfig(rank=128, max_error=None).rank == 128  # max_rank bounds only a rising rank
    with pytest.raises(ValueError, match="max_rank=2 must be at least rank=4"):
        PowerSGDConfig(rank=4, max_rank=2)


@pytest.mark.quick
@pytest.mark.parametrize(("optimizer", "bound"), [("adam", 0.6), ("sgd", 0.9)])
def test_the_default_bound_follows_the_optimizer(tmp_path, optimizer, bound):
    # max_error="auto": AdamW-like optimizers lose more to the same error (transformer_quality), so they get 0.6.
    ranks = fit_ddp(
        tmp_path,
        OptimizedDDPStrategy(comm_hook="powersgd", start_method="fork"),
        model=StackModel(optimizer=optimizer),
        max_steps=2,
    )
    assert [r["hook_bound"] for r in ranks] == [bound, bound]
    assert ERROR_BOUNDS == {"adaptive": 0.6, "other": 0.9}


@pytest.mark.quick
def test_without_the_strategy_the_default_bound_is_the_adaptive_one(gloo_group):
    state = PowerSGDState(config=PowerSGDConfig())
    assert state.error_bound == 0.6
    state.fit_bound_to([torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)])
    assert state.error_bound == 0.9
    fixed = PowerSGDState(config=PowerSGDConfig(max_error=0.3))
    fixed.fit_bound_to([])
    assert fixed.error_bound == 0.3  # a number is kept whatever the optimizer


@pytest.mark.quick
def test_a_lower_ceiling_on_resume_drops_a_measurement_made_at_another_rank(gloo_group):
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=8, start_iter=2)
    bucket, ledger, state = _matrix(config)
    # Rises at 8 and 13 (to 4); the probe of iteration 16 is on its way when saved after iteration 16's round.
    _random_rounds(state, ledger, bucket, 15)
    saved = state.state_dict()
    assert saved["rank"] == 4 and saved["rank_probe"]["decide_at"] == 18
    lower = _restored(replace(config, max_rank=2), saved, bucket, ledger)
    _random_rounds(lower, ledger, bucket, 5)
    assert lower.rank == 2 and lower.rank_changes == state.rank_changes  # no rise logged, none recorded


@pytest.mark.quick
def test_a_matrix_a_raised_rank_no_longer_compresses_sends_its_stored_error(gloo_group):
    # 20 x 16 compresses up to rank 4 (320 >= 36 x r x 2); the bound raises the rank from 2 to 4 to 8, where the
    # matrix goes exactly: its kept error must go with it (on one rank the result is the gradient plus that error).
    # That last rise waits for EXACT_PATIENCE measurements above the bound in a row (13, 18, 23): not for a spike.
    bucket, ledger, state = _matrix(PowerSGDConfig(rank=2, max_error=0.01, max_rank=8, start_iter=2), (20, 16))
    _random_rounds(state, ledger, bucket, 21)  # iterations 2 to 22: raised to 4 at 8; to 8 by the verdict at 23
    assert state.rank == 4 and state.ranks.over == {"probe0": EXACT_PATIENCE - 1}
    state.state_dict()  # commits the round
    kept = state.errors["probe0"].reshape(-1).clone()
    assert kept.norm() > 0
    gradient = torch.randn(320)
    record = _sync(powersgd_hook, state, ledger, bucket, gradient)
    assert state.rank == 8 and record.wire_bytes == 320 * 4  # sent exactly
    torch.testing.assert_close(bucket.buffer(), gradient + kept, rtol=0, atol=1e-6)
    state.state_dict()
    assert "probe0" not in state.errors  # nothing left to feed back


@pytest.mark.quick
def test_adaptive_optimizers_are_recognised_by_name_and_base_class():
    parameters = [torch.nn.Parameter(torch.zeros(1))]

    class Custom(torch.optim.Adam):
        pass

    assert is_adaptive(torch.optim.AdamW(parameters)) and is_adaptive(Custom(parameters))
    assert is_adaptive("FusedAdam") and is_adaptive("AdamW8bit") and is_adaptive(torch.optim.RMSprop(parameters))
    assert not is_adaptive(torch.optim.SGD(parameters, lr=0.1)) and not is_adaptive("SGD")


@pytest.mark.quick
def test_batched_powersgd_without_error_feedback_compresses_as_with_it_on_the_first_round(gloo_group):
    # The first compressed round has no stored error to add, so both configurations send and hand back the same.
    torch.manual_seed(0)
    bucket = _ProbeBucket([(64, 48), (300,)], torch.device("cpu"))
    values = [torch.randn(64 * 48 + 300) for _ in range(3)]
    outputs = {}
    for feedback in (True, False):
        config = PowerSGDConfig(rank=2, max_error=None, batched=True, error_feedback=feedback, start_iter=2)
        ledger = CommLedger()
        state = _powersgd(config, ledger, bucket)
        outputs[feedback] = []
        for value in values:
            record = _sync(powersgd_hook, state, ledger, bucket, value)
            outputs[feedback].append((bucket.buffer().clone(), record.wire_bytes))
        assert (state.errors != {}) is feedback
    assert torch.equal(outputs[True][0][0], outputs[False][0][0])
    assert [sent for _, sent in outputs[True]] == [sent for _, sent in outputs[False]]
    assert not torch.equal(outputs[True][1][0], outputs[False][1][0])  # from the second round the errors count
