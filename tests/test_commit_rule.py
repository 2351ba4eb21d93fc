"""One commit rule for a sync round, on the host and on the device: the same values, the same saved state, bit for bit.

A round's verdict is read on the host for CPU flags; for CUDA flags it stays on the device and the round is committed
by selection (``ErrorFeedbackState._commit``) when the next round opens or the state is saved. Here both paths run on
the CPU (``_verdict_on_device``: the device's selection and its delayed commit) through the rounds where they once
differed: an overflow right after a rank rise, an overflow on the first round after a resume,
and batched PowerSGD's regrouped Q memories.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict

import pytest
import torch

from lightning_ddpopt.hooks import Int8Config, Int8State, PowerSGDConfig, PowerSGDState
from lightning_ddpopt.hooks.base import ErrorFeedbackState, SyncRound

pytestmark = [pytest.mark.quick, pytest.mark.usefixtures("gloo_group")]

SHAPE = (4, 3)


def _round(
    state: ErrorFeedbackState,
    finite: bool,
    errors: dict[str, float] = {},  # noqa: B006  # read only
    exact: tuple[str, ...] = (),
    q_memories: dict[str, float] | None = None,
) -> None:
    """One sync round: errors and Q memories of constant values under their keys, ``exact``: sent uncompressed."""
    round_ = state.open_round()
    for name, value in errors.items():
        round_.errors[name] = state.error_buffer(round_, name, SHAPE, torch.float32, torch.device("cpu")).fill_(value)
    for key, value in (q_memories or {}).items():
        round_.q_memories[key] = torch.full((3, 2), value)
    round_.sent_exactly.update(exact)
    round_.check([torch.tensor(1.0 if finite else math.inf)])
    state.close_round()


def _fed_back(state: ErrorFeedbackState, names: list[str], scale: float) -> list[torch.Tensor]:
    """What each name's stored error adds to a gradient of ones at loss scale ``scale``, in the next round.

    The device path commits a round when the next one opens (the host's at once): that commit comes first here.
    """
    state._apply_completed()
    gradients = [torch.ones(SHAPE) for _ in names]
    state.add_error_feedback(SyncRound(torch.tensor(scale)), names, gradients)
    return gradients


def _both_paths(
    make: Callable[[], ErrorFeedbackState], script: Callable[[ErrorFeedbackState], list[torch.Tensor]]
) -> tuple[dict[str, object], dict[str, object], list[torch.Tensor], list[torch.Tensor]]:
    results = []
    for on_device in (False, True):
        state = make()
        state._verdict_on_device = on_device
        added = script(state)
        results.append((state.state_dict(), added))
    (host, host_added), (device, device_added) = results
    return host, device, host_added, device_added


def _assert_same(host: dict[str, object], device: dict[str, object]) -> None:
    assert host.keys() == device.keys()
    for key in host:
        if isinstance(host[key], dict):
            assert host[key].keys() == device[key].keys(), key  # type: ignore[union-attr]
            for name, value in host[key].items():  # type: ignore[union-attr]
                other = device[key][name]  # type: ignore[index]
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other), (key, name)
                else:
                    assert value == other, (key, name)
        else:
            assert host[key] == device[key], key


def _powersgd(**config: object) -> Callable[[], PowerSGDState]:
    def make() -> PowerSGDState:
        state = PowerSGDState(config=PowerSGDConfig(**config))  # type: ignore[arg-type]
        state.loss_scale = lambda: torch.tensor(1024.0)
        return state

    return make


def test_an_overflow_right_after_a_rank_rise_keeps_the_error_on_both_paths():
    # After a rise of the rank a matrix may be sent exactly: its stored error goes with it and is dropped, but only
    # if the round was finite. A non-finite round keeps it, and the next finite round adds it.
    def script(state: ErrorFeedbackState) -> list[torch.Tensor]:
        _round(state, True, {"w": 0.5, "v": 0.25})
        _round(state, False, {"v": 7.0}, exact=("w",))  # the overflow, right after the rise
        kept = _fed_back(state, ["w", "v"], 1024.0)
        _round(state, True, {"v": 0.125}, exact=("w",))  # sent exactly and finite: w's error is gone
        return kept + _fed_back(state, ["w", "v"], 1024.0)

    host, device, host_added, device_added = _both_paths(_powersgd(), script)
    _assert_same(host, device)
    for mine, theirs in zip(host_added, device_added, strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(host_added[0], torch.full(SHAPE, 1.5))  # w's error survived the overflow
    assert torch.equal(host_added[2], torch.ones(SHAPE))  # and was dropped by the finite exact round
    assert sorted(host["errors"]) == ["v"] and host["skipped_rounds"] == 1  # type: ignore[arg-type]


def test_an_overflow_on_the_first_round_after_a_resume_keeps_the_restored_state_on_both_paths():
    saved = {
        "config": asdict(PowerSGDConfig()),
        "iteration": 12,
        "skipped_rounds": 0,
        "errors": {"w": torch.full(SHAPE, 0.5)},
        "error_scales": {"w": 512.0},
        "q_memories": {"w": torch.full((3, 2), 0.75)},
    }

    def make() -> PowerSGDState:
        state = _powersgd()()
        state.load_state_dict({**saved, "errors": {"w": torch.full(SHAPE, 0.5)}})
        return state

    def script(state: ErrorFeedbackState) -> list[torch.Tensor]:
        _round(state, False, {"w": 9.0, "u": 3.0}, q_memories={"w": 9.0, "u": 3.0})
        return _fed_back(state, ["w", "u"], 1024.0)

    host, device, host_added, device_added = _both_paths(make, script)
    _assert_same(host, device)
    for mine, theirs in zip(host_added, device_added, strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(host["q_memories"]["w"], torch.full((3, 2), 0.75))  # type: ignore[index]
    assert sorted(host["q_memories"]) == ["w"] and sorted(host["errors"]) == ["w"]  # type: ignore[arg-type]
    assert torch.equal(host_added[0], torch.full(SHAPE, 2.0))  # 0.5 saved at scale 512, added at 1024
    assert torch.equal(host_added[1], torch.ones(SHAPE))  # u was never committed


def test_batched_q_memories_of_an_old_layout_survive_an_overflow_on_both_paths():
    def make() -> PowerSGDState:
        state = _powersgd(batched=True)()
        state.q_memories = {"a|b": torch.ones(3, 2), "c": torch.ones(3, 2), "d|e": torch.ones(3, 2)}
        return state

    def overflow_then_finite(state: ErrorFeedbackState) -> list[torch.Tensor]:
        _round(state, False, q_memories={"b|c": 2.0})
        assert isinstance(state, PowerSGDState)
        seen = [state.q_memories[key].clone() for key in ("a|b", "c")]
        _round(state, True, q_memories={"b|c": 3.0, "x": 4.0})
        return seen

    host, device, host_seen, device_seen = _both_paths(make, overflow_then_finite)
    _assert_same(host, device)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(host_seen, device_seen, strict=True))
    assert sorted(host["q_memories"]) == ["b|c", "d|e", "x"]  # type: ignore[arg-type]

    def overflow_only(state: ErrorFeedbackState) -> list[torch.Tensor]:
        _round(state, False, q_memories={"b|c": 2.0})
        return []

    host, device, _, _ = _both_paths(make, overflow_only)
    _assert_same(host, device)
    assert sorted(host["q_memories"]) == ["a|b", "c", "d|e"]  # type: ignore[arg-type]


def test_int8_error_feedback_follows_the_same_rule():
    def make() -> Int8State:
        state = Int8State(config=Int8Config())
        state.loss_scale = lambda: torch.tensor(256.0)
        return state

    def script(state: ErrorFeedbackState) -> list[torch.Tensor]:
        _round(state, True, {"w": 1.0})
        _round(state, False, {"w": 5.0, "v": 5.0}, exact=("w",))
        _round(state, False, {"v": 6.0})
        return _fed_back(state, ["w", "v"], 128.0)

    host, device, host_added, device_added = _both_paths(make, script)
    _assert_same(host, device)
    for mine, theirs in zip(host_added, device_added, strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(host_added[0], torch.full(SHAPE, 1.5)) and torch.equal(host_added[1], torch.ones(SHAPE))
    assert host["skipped_rounds"] == 2


def test_errors_saved_without_a_loss_scale_take_the_first_rounds_scale_on_both_paths():
    # A release that did not save loss scales: each error is added as it is in the first round that adds it, and
    # kept in that round's units from then on, whatever the round's verdict.
    def make() -> PowerSGDState:
        state = _powersgd()()
        state.load_state_dict(
            {
                "config": asdict(PowerSGDConfig()),
                "iteration": 3,
                "errors": {"w": torch.full(SHAPE, 0.5)},
                "q_memories": {},
            }
        )
        return state

    def script(state: ErrorFeedbackState) -> list[torch.Tensor]:
        first = _fed_back(state, ["w"], 1024.0)
        _round(state, False, {})
        return first + _fed_back(state, ["w"], 512.0)

    host, device, host_added, device_added = _both_paths(make, script)
    _assert_same(host, device)
    assert torch.equal(host_added[0], torch.full(SHAPE, 1.5)) and torch.equal(device_added[0], host_added[0])
    assert torch.equal(host_added[1], torch.full(SHAPE, 1.25)) and torch.equal(device_added[1], host_added[1])
    assert host["error_scales"] == {"w": 1024.0}


def test_the_device_path_commits_a_round_when_the_next_opens_as_on_a_gpu():
    for on_device in (False, True):
        state = _powersgd()()
        state._verdict_on_device = on_device
        _round(state, True, {"w": 0.5})
        # The host commits at once; the device leaves the round completed, not committed (a GPU's host never waits).
        assert (state._completed is not None, "w" in state.errors) == (on_device, not on_device)
        state.open_round()
        assert state._completed is None and torch.equal(state.errors["w"], torch.full(SHAPE, 0.5))
