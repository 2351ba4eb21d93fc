"""comm_hook="auto": the decision on recorded measurements, and a real 2-process run that measures and chooses."""

from __future__ import annotations

import pytest
import torch

from lightning_ddpopt import OptimizedDDPStrategy
from lightning_ddpopt.hooks import AUTO_HOOK, choose_hook
from tests.helpers import fit_ddp


def test_fast_link_keeps_plain_allreduce():
    choice = choose_hook({"allreduce": 0.004, "fp16": 0.0085, "powersgd": 0.006})
    assert choice.name == "allreduce"
    assert choice.reason.endswith("compression does not pay on this link")


def test_slow_link_picks_the_cheapest_compression():
    choice = choose_hook({"allreduce": 0.87, "fp16": 0.46, "powersgd": 0.55})
    assert choice.name == "fp16"
    assert "fp16 is 1.9x faster" in choice.reason


def test_gain_under_ten_percent_is_not_worth_compressing():
    assert choose_hook({"allreduce": 0.100, "fp16": 0.095}).name == "allreduce"
    assert choose_hook({"allreduce": 0.100, "fp16": 0.2, "powersgd": 0.05}).name == "powersgd"


def test_auto_measures_chooses_the_same_hook_on_every_rank_and_trains(tmp_path):
    ranks = fit_ddp(tmp_path, OptimizedDDPStrategy(comm_hook=AUTO_HOOK, start_method="fork"), max_steps=3)
    names = {record["comm_hook_name"] for record in ranks}
    assert len(names) == 1 and names <= {"allreduce", "fp16", "int8", "powersgd"}
    assert {record["ddp_comm_hook"] for record in ranks} <= {
        "allreduce_mean_hook",
        "fp16_allreduce_hook",
        "int8_hook",
        "powersgd_hook",
    }
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


def test_auto_cannot_be_combined_with_a_lightning_hook():
    with pytest.raises(ValueError, match="comm_hook='auto' and ddp_comm_hook=.* both given"):
        OptimizedDDPStrategy(comm_hook="auto", ddp_comm_hook=lambda state, bucket: None)
