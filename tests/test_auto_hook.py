"""comm_hook="auto": the decision on recorded measurements, and a real 2-process run that measures and chooses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.hooks import AUTO_HOOK, AutoConfig, choose_hook
from tests.helpers import fit_ddp

pytestmark = pytest.mark.quick

LOSSY_ALLOWED = AutoConfig(candidates=("allreduce", "fp16", "int8", "powersgd"))


def test_fast_link_keeps_plain_allreduce():
    choice = choose_hook({"allreduce": 0.004, "fp16": 0.0085, "powersgd": 0.006}, LOSSY_ALLOWED)
    assert choice.name == "allreduce"
    assert choice.reason.endswith("compression does not pay on this link")


def test_slow_link_picks_the_cheapest_compression():
    choice = choose_hook({"allreduce": 0.87, "fp16": 0.46, "powersgd": 0.55}, LOSSY_ALLOWED)
    assert choice.name == "fp16"
    assert "fp16 is 1.9x faster" in choice.reason


def test_gain_under_ten_percent_is_not_worth_compressing():
    assert choose_hook({"allreduce": 0.100, "fp16": 0.095}).name == "allreduce"
    assert choose_hook({"allreduce": 0.100, "fp16": 0.2, "powersgd": 0.05}, LOSSY_ALLOWED).name == "powersgd"


def test_by_default_auto_never_trades_quality_for_powersgds_speed():
    # PowerSGD estimated 10x faster than anything else: by default auto keeps to the near-lossless hooks and says so.
    estimates = {"allreduce": 0.500, "fp16": 0.260, "int8": 0.140, "powersgd": 0.014}
    choice = choose_hook(estimates)
    assert choice.name == "int8"
    assert "powersgd" not in choice.estimates_s
    assert choice.reason == (
        "estimated sync per step: allreduce 500.0 ms, fp16 260.0 ms, int8 140.0 ms; int8 is 3.6x faster; "
        "powersgd not considered (lossy: allow it with AutoConfig)"
    )
    lossy = choose_hook(estimates, LOSSY_ALLOWED)
    assert lossy.name == "powersgd"
    # Allowed, it is the error-bounded PowerSGD, and the reason says its estimate is for the starting rank.
    assert lossy.reason.endswith(
        "powersgd is 35.7x faster (PowerSGD estimated at rank 4; its rank rises while its measured compression error "
        "is above its bound, which costs more)"
    )


@pytest.mark.parametrize(
    ("candidates", "error", "message"),
    [
        (("fp16", "int8"), ValueError, "must list 'allreduce' \\(the baseline\\)"),
        (("allreduce", "topk"), ValueError, "and only hooks from \\['allreduce', 'fp16', 'int8', 'powersgd'\\]"),
        ("allreduce", TypeError, "must be a tuple of hook names"),
    ],
)
def test_bad_auto_candidates_fail_at_construction(candidates, error, message):
    with pytest.raises(error, match=f"AutoConfig candidates=.*{message}"):
        AutoConfig(candidates=candidates)


def test_auto_measures_only_its_candidates(gloo_group):
    from lightning_ddpopt.hooks import auto, registry

    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 16))
    assert set(
        auto.measure_hook_costs(
            model,
            None,
            torch.device("cpu"),
            repeats=1,
            candidates=AutoConfig().candidates,
            lookup=registry.get_hook_spec,
        )
    ) == {
        "allreduce",
        "fp16",
        "int8",
    }


def test_auto_config_with_local_sgd_is_refused_like_auto():
    from lightning_ddpopt import LocalSGDConfig

    with pytest.raises(ValueError, match="comm_hook='auto' with local_sgd"):
        OptimizedDDPStrategy(comm_hook=AutoConfig(), local_sgd=LocalSGDConfig.diloco(16))


def test_auto_measures_chooses_the_same_hook_on_every_rank_and_trains(tmp_path):
    ranks = fit_ddp(tmp_path, OptimizedDDPStrategy(comm_hook=AUTO_HOOK, start_method="fork"), max_steps=3)
    names = {record["comm_hook_name"] for record in ranks}
    assert len(names) == 1 and names <= {"allreduce", "fp16", "int8"}  # by default, never the lossy PowerSGD
    assert {record["ddp_comm_hook"] for record in ranks} <= {"allreduce_mean_hook", "fp16_allreduce_hook", "int8_hook"}
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


def test_auto_cannot_be_combined_with_a_lightning_hook():
    with pytest.raises(ValueError, match="comm_hook='auto' and ddp_comm_hook=.* both given"):
        OptimizedDDPStrategy(comm_hook="auto", ddp_comm_hook=lambda state, bucket: None)


def test_auto_times_the_real_hooks_on_a_bounded_probe(gloo_group, monkeypatch):
    # A model larger than the probe: every candidate's registered hook runs (warm-up + repeats) on at most 4 Mi
    # gradient values, PowerSGD's on the largest weight cut to the rows that fit, in its own width.
    from lightning_ddpopt.hooks import auto, registry

    calls: dict[str, int] = {}
    probes: list[list[tuple[int, ...]]] = []
    real_spec, real_bucket = registry.get_hook_spec, auto._ProbeBucket

    def counting_spec(name):
        spec = real_spec(name)

        def hook(state, bucket):
            calls[name] = calls.get(name, 0) + 1
            return spec.hook(state, bucket)

        return dataclasses.replace(spec, hook=hook)

    def recording_bucket(shapes, device):
        bucket = real_bucket(shapes, device)
        probes.append(list(shapes))
        return bucket

    monkeypatch.setattr(registry, "get_hook_spec", counting_spec)
    monkeypatch.setattr(auto, "_ProbeBucket", recording_bucket)
    model = nn.Sequential(nn.Linear(4096, 2048), nn.Linear(2048, 16))  # 8.4M + 32.8k values
    estimates = auto.measure_hook_costs(model, None, torch.device("cpu"), repeats=2, lookup=registry.get_hook_spec)
    assert calls == {"allreduce": 3, "fp16": 3, "int8": 3, "powersgd": 3}
    assert probes == [[(4 * 1024 * 1024,)]] * 3 + [[(1024, 4096)]]
    assert set(estimates) == {"allreduce", "fp16", "int8", "powersgd"}
    assert all(seconds > 0 for seconds in estimates.values())


def test_auto_probes_as_many_whole_matrices_as_fit():
    from lightning_ddpopt.hooks.auto import _largest_within

    assert _largest_within([(10, 10), (30, 10), (20, 10)], 500, min_rows=8) == [(30, 10), (20, 10)]
    assert _largest_within([(100, 10), (5, 5)], 500, min_rows=8) == [(50, 10)]
    assert _largest_within([(100, 1000)], 500, min_rows=8) == [(8, 1000)]
