"""PowerSGD's rank per matrix: it rises while a matrix's error is above the bound and falls when half would do.

The hook runs on a 1-rank gloo group with a stand-in bucket (as in ``test_quality``); the controller's hysteresis is
checked on measured tables given to it directly.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.hooks import powersgd
from lightning_ddpopt.hooks.auto import _ProbeBucket
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig, PowerSGDState, powersgd_hook
from lightning_ddpopt.hooks.powersgd_rank import (
    EXACT_PATIENCE,
    FALL_MARGIN,
    FALL_PATIENCE,
    RANK_DECISION_LAG,
    RANK_WINDOW,
    RankController,
)
from lightning_ddpopt.ledger import CommLedger

pytestmark = pytest.mark.quick

ROWS, COLS = 96, 64


def _state(config: PowerSGDConfig, bucket: _ProbeBucket, ledger: CommLedger, saved: dict | None = None):
    state = PowerSGDState(config=config, ledger=ledger, cpu_kernels="blocked")
    state.bind_module(bucket.module)
    if saved is None:
        state.iteration = config.start_iter  # compressing from the first round
    else:
        state.load_state_dict(saved)
    return state


def _sync(state: PowerSGDState, ledger: CommLedger, bucket: _ProbeBucket, values: torch.Tensor) -> int:
    """One sync round of ``bucket`` holding ``values``; the bytes it sent."""
    bucket.buffer().copy_(values)
    ledger.record_hook(powersgd_hook)(state, bucket).wait()
    (record,) = ledger.close_step()
    return record.wire_bytes


def _spike_then_low_rank(rounds_hard: int, rounds_easy: int, matrices: int = 1) -> list[torch.Tensor]:
    """Random (full-rank) gradients, then gradients of rank 1: a warm-up spike the rank must not keep."""
    generator = torch.Generator().manual_seed(0)
    u, v = torch.randn(ROWS, 1, generator=generator), torch.randn(1, COLS, generator=generator)
    hard = [torch.randn(matrices * ROWS * COLS, generator=generator) for _ in range(rounds_hard)]
    easy = [(10 * u @ v).reshape(-1).repeat(matrices) for _ in range(rounds_easy)]
    return hard + easy


def _verdicts(config: PowerSGDConfig, count: int) -> list[int]:
    """The rounds at which measurements are applied, in order."""
    return [config.start_iter + RANK_WINDOW - 1 + RANK_DECISION_LAG + k * RANK_WINDOW for k in range(count)]


def test_a_warm_up_spike_raises_the_rank_and_it_falls_back_when_half_the_rank_would_do(gloo_group, monkeypatch):
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=4, start_iter=2)
    bucket, ledger = _ProbeBucket([(ROWS, COLS)], torch.device("cpu")), CommLedger()
    state = _state(config, bucket, ledger)
    gradients = _spike_then_low_rank(2 * RANK_WINDOW, 8 * RANK_WINDOW)
    drawn = []  # the rounds that drew a fresh projection for Q instead of warm-starting from the last one
    draw = powersgd.random_q
    monkeypatch.setattr(
        powersgd, "random_q", lambda *args, **kwargs: drawn.append(state.iteration) or draw(*args, **kwargs)
    )
    sent = [_sync(state, ledger, bucket, g) for g in gradients]
    verdicts = _verdicts(config, 10)
    changes = [(step, old, new) for step, _, old, new, _ in state.rank_changes]
    # Two rises on the spike's measurements; then each fall waits for FALL_PATIENCE calm measurements in a row (the
    # first low-rank measurement still carries the spike's fed-back error).
    assert changes[:2] == [(verdicts[0], 1, 2), (verdicts[1], 2, 4)]
    falls = changes[2:]
    assert [(old, new) for _, old, new in falls] == [(4, 2), (2, 1)]
    assert falls[1][0] - falls[0][0] == FALL_PATIENCE * RANK_WINDOW
    assert all(FALL_MARGIN * 0.3 > change.error > 0 for change in state.rank_changes[2:])  # predicted, not zero
    assert all(change.key == "probe0" for change in state.rank_changes)
    # The bytes follow the rank: P and Q of rank r are (rows + cols) x r fp32 values.
    start = config.start_iter
    assert sent[falls[1][0] - start - 1] == 2 * (ROWS + COLS) * 4 and sent[-1] == (ROWS + COLS) * 4
    assert state.rank == state.rank_of("probe0") == 1
    # A risen rank draws a fresh projection; a fallen one warm-starts from the strongest columns of its Q.
    assert drawn == [config.start_iter, verdicts[0], verdicts[1]]
    assert state.q_memories["probe0"].shape == (COLS, 1)


def test_each_matrix_keeps_a_rank_of_its_own(gloo_group):
    # One matrix of random gradients, one of rank 1: only the first rises; the bytes are each one's P and Q.
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=4, start_iter=2)
    bucket, ledger = _ProbeBucket([(ROWS, COLS), (ROWS, COLS)], torch.device("cpu")), CommLedger()
    state = _state(config, bucket, ledger)
    generator = torch.Generator().manual_seed(1)
    u, v = torch.randn(ROWS, 1, generator=generator), torch.randn(1, COLS, generator=generator)
    rounds = 3 * RANK_WINDOW
    sent = [
        _sync(state, ledger, bucket, torch.cat([torch.randn(ROWS * COLS, generator=generator), (u @ v).reshape(-1)]))
        for _ in range(rounds)
    ]
    assert (state.rank_of("probe0"), state.rank_of("probe1")) == (4, 1)
    assert {change.key for change in state.rank_changes} == {"probe0"}
    assert (state.rank, state.ranks.lowest) == (4, 1)
    assert sent[-1] == (ROWS + COLS) * (4 + 1) * 4


def test_a_resume_between_calm_measurements_gives_the_same_falls_bit_for_bit(gloo_group):
    config = PowerSGDConfig(rank=1, max_error=0.3, max_rank=4, start_iter=2)
    gradients = _spike_then_low_rank(2 * RANK_WINDOW, 6 * RANK_WINDOW)
    bucket, ledger = _ProbeBucket([(ROWS, COLS)], torch.device("cpu")), CommLedger()
    whole = _state(config, bucket, ledger)
    for g in gradients:
        _sync(whole, ledger, bucket, g)
    first_fall = next(change.step for change in whole.rank_changes if change.new < change.old)
    # Cut after the measurement that makes the first fall (its verdict still on its way) and one calm measurement in.
    cut = first_fall - config.start_iter - 1
    before = _state(config, bucket, ledger)
    for g in gradients[:cut]:
        _sync(before, ledger, bucket, g)
    saved = before.state_dict()
    assert saved["rank_probe"] is not None and saved["rank_calm"] == {"probe0": FALL_PATIENCE - 1}
    after = _state(config, bucket, ledger, saved)
    for g in gradients[cut:]:
        _sync(after, ledger, bucket, g)
    assert after.rank_changes == whole.rank_changes
    assert torch.equal(after.errors["probe0"], whole.errors["probe0"])
    assert torch.equal(after.q_memories["probe0"], whole.q_memories["probe0"])


def _verdict(controller: RankController, iteration: int, error: float, error_halved: float) -> None:
    """Give ``controller`` a measurement of one matrix (relative errors) and apply it."""
    table = torch.tensor([[1.0, error**2, error_halved**2]], dtype=torch.float64)
    controller.expect(DeferredRead(table), iteration - RANK_DECISION_LAG)
    controller.adapt(iteration)


def test_a_matrix_rising_back_to_a_rank_it_fell_from_waits_twice_as_long_to_fall_again():
    controller = RankController(config=PowerSGDConfig(rank=1, max_error=0.5, max_rank=8))
    controller.bind(["w"], [(256, 256)])
    step = iter(range(100, 1000, RANK_WINDOW))
    _verdict(controller, next(step), 0.6, 0.9)  # above the bound: 1 -> 2
    assert controller.rank_of("w") == 2
    for _ in range(FALL_PATIENCE):  # half the rank would stay under 0.8 x 0.5: falls after FALL_PATIENCE in a row
        _verdict(controller, next(step), 0.1, 0.2)
    assert controller.rank_of("w") == 1
    _verdict(controller, next(step), 0.6, 0.9)  # back up to the rank it fell from
    assert controller.rank_of("w") == 2 and controller.patience["w"] == 2 * FALL_PATIENCE
    for _ in range(2 * FALL_PATIENCE - 1):
        _verdict(controller, next(step), 0.1, 0.2)
    _verdict(controller, next(step), 0.1, 0.45)  # half the rank would be too close to the bound: the count restarts
    assert controller.rank_of("w") == 2 and controller.calm["w"] == 0
    for _ in range(2 * FALL_PATIENCE):
        _verdict(controller, next(step), 0.1, 0.2)
    assert controller.rank_of("w") == 1
    assert [(old, new) for _, _, old, new, _ in controller.changes] == [(1, 2), (2, 1), (1, 2), (2, 1)]
    # A fixed rank never moves, whatever it measures.
    fixed = RankController(config=PowerSGDConfig(rank=2, max_error=None))
    fixed.bind(["w"], [(256, 256)])
    assert not fixed._due(fixed.config.start_iter + RANK_WINDOW - 1)


def test_a_rise_that_would_send_a_matrix_exactly_waits_for_the_error_to_stay_above_the_bound():
    # 64 x 64 compresses up to rank 16 (4096 >= 128 x 16 x 2): from 16 a rise sends it exactly, and for good.
    controller = RankController(config=PowerSGDConfig(rank=16, max_error=0.5, max_rank=64))
    controller.bind(["w"], [(64, 64)])
    step = iter(range(100, 1000, RANK_WINDOW))
    for _ in range(EXACT_PATIENCE - 1):  # a spike: above the bound, but not for EXACT_PATIENCE measurements in a row
        _verdict(controller, next(step), 0.9, 0.95)
    _verdict(controller, next(step), 0.3, 0.6)  # back under the bound: the count restarts
    assert controller.rank_of("w") == 16 and "w" not in controller.over
    for _ in range(EXACT_PATIENCE):
        _verdict(controller, next(step), 0.9, 0.95)
    assert controller.rank_of("w") == 32 and not controller.config.compresses(64, 64, 32)
    saved = controller.state_dict()
    assert saved["rank_over"] == {} and saved["matrix_ranks"] == {"w": 32}


def test_batched_matrices_are_the_squares_their_values_fill_even_of_one_parameter():
    # Batched PowerSGD compresses a bucket of one (4096, 16) parameter as a 256 x 256 square, which compresses at
    # rank 16 (65536 >= 512 x 16 x 2): the rise to 16 is no step to an exact sync, and waits for nothing.
    controller = RankController(config=PowerSGDConfig(rank=8, max_error=0.5, max_rank=64, batched=True))
    controller.bind(["w"], [(4096, 16)])
    assert controller._matrix_shape("w") == (256, 256)
    _verdict(controller, 100, 0.9, 0.95)
    assert controller.rank_of("w") == 16 and "w" not in controller.over
