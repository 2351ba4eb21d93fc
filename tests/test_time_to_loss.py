"""The time-to-loss benchmark's arithmetic: when a curve reaches the target, the loss at stock's time, the medians
over rounds, the measuring steps of local SGD, and the variant grammar its DiLoCo options share with the quality
benchmark. The benchmark itself (emulated hosts, minutes a run) publishes its figures; these checks keep its
reading of a run honest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_ddpopt import LocalSGDConfig
from lightning_ddpopt.localsgd.outer import SyncEveryChoice
from tests.helpers import load_script

pytestmark = pytest.mark.quick

bench = load_script("benchmarks/time_to_loss.py")
quality = load_script("benchmarks/transformer_quality.py")


def test_time_to_target_is_linear_between_measurements() -> None:
    curve = [[1.0, 8, 3.0], [2.0, 16, 2.0], [4.0, 24, 1.0]]
    assert bench.time_to(curve, 1.5) == pytest.approx(3.0)  # halfway from 2.0 (at 2 s) to 1.0 (at 4 s)
    assert bench.time_to(curve, 3.0) == 1.0  # the first measurement reaches it: its own time
    assert bench.time_to(curve, 0.5) is None
    assert bench.steps_to(curve, 1.5) == 24
    assert bench.loss_at(curve, 2.0) == 2.0
    assert bench.loss_at(curve, 0.5) is None


def test_summary_takes_each_rounds_ratio_to_its_own_stock() -> None:
    def round_(stock_s: float, other_s: float) -> dict:
        return {
            "stock": {"curve": [[stock_s / 2, 40, 2.0], [stock_s, 80, 1.0]]},
            "other": {"curve": [[other_s, 60, 1.0], [stock_s, 90, 0.9]], "bytes_per_step": 100.0},
        }

    rows = {row["variant"]: row for row in bench.summarize([round_(30, 10), round_(40, 10), round_(20, 40)])}
    assert rows["other"]["rounds_sooner"] == [3.0, 4.0, 0.5]
    assert rows["other"]["sooner"] == 3.0  # the median of the rounds' ratios, not of the times
    assert rows["other"]["reached"] == "3/3" and rows["other"]["steps_to_target"] == 60
    assert rows["stock"]["sooner"] == 1.0
    limited = [{**round_(30, 10), "compute": {"curve": [[5.0, 80, 2.5]]}} for _ in range(3)]
    rows = {row["variant"]: row for row in bench.summarize(limited)}
    assert "compute" not in rows  # the limit is a reference, not an option
    assert rows["other"]["of_limit"] == 0.5 and rows["stock"]["of_limit"] == pytest.approx(5 / 30)
    assert rows["other"]["sooner"] == 3.0
    missed = bench.summarize([{"stock": round_(30, 10)["stock"], "other": {"curve": [[30, 80, 1.5]]}}])
    assert missed[1]["sooner"] is None and missed[1]["reached"] == "0/1" and missed[1]["loss_at_budget"] == 1.5


def test_local_sgd_is_measured_right_after_each_applied_sync() -> None:
    def steps(variant: str) -> list[int]:
        schedule = bench._eval_steps(variant, 8)
        return [step for step in range(1, 100) if bench.measuring(None, step, schedule)]

    assert steps("int8") == list(range(8, 100, 8))
    assert steps("diloco16") == list(range(16, 100, 16))
    assert steps("diloco16_overlap8") == list(range(24, 100, 16))  # started at 16, applied at 24
    # Synchronous for 40 steps (measured there too), then the first sync starts at 56 and is applied at 60.
    assert steps("diloco16_overlap4_w40") == [12, 28, 60, 76, 92]
    assert steps("dilocoauto") == list(range(16, 100, 16))  # the provisional H until the choice


@pytest.mark.parametrize("overlap", [0, 4])
def test_sync_every_auto_is_measured_after_each_sync_of_the_h_it_chose(overlap: int) -> None:
    schedule = bench._eval_steps(f"dilocoauto{f'_overlap{overlap}' if overlap else ''}", 8)
    loop = SimpleNamespace(config=SimpleNamespace(overlap_steps=overlap), sync_every_choice=None)
    before = [step for step in range(1, 60) if bench.measuring(loop, step, schedule)]
    assert before == [16 + overlap, 32 + overlap, 48 + overlap]  # the provisional H = 16
    # Chosen at the application of the sync started at 16: windows of 8 from there.
    loop.sync_every_choice = SyncEveryChoice(8, 0.1, 0.05, 1.0, since=16)
    after = [step for step in range(1, 60) if bench.measuring(loop, step, schedule)]
    assert after == list(range(16 + overlap, 60, 8))
    assert bench.measuring(None, 16, schedule) == (overlap == 0)  # stock: no local SGD


def test_diloco_variant_grammar() -> None:
    config = quality.diloco_config("diloco8_overlap2_int8_replica2_lr0.5_m0.7_a0.25_w32")
    expected = LocalSGDConfig.diloco(
        8,
        overlap_steps=2,
        compression="int8",
        replica=2,
        outer_lr=0.5,
        outer_momentum=0.7,
        overlap_mixing=0.25,
        warmup_steps=32,
    )
    assert config == expected
    assert quality.diloco_config("dilocoauto_overlap").overlap_steps == 8
    with pytest.raises(ValueError, match=r"'diloco16_w' is not diloco<H>"):
        quality.diloco_config("diloco16_w")


def test_the_suite_names_only_options_the_benchmark_knows() -> None:
    for layout in bench.SUITE:
        for variant in layout["variants"].split(","):
            bench.make_strategy(variant)  # a typo raises here instead of after half an hour of runs
    assert bench.make_strategy("compute") == "auto"  # every rank alone: Lightning's single-device strategy


def test_the_report_states_the_limit_and_each_options_share_of_it(tmp_path) -> None:
    rounds = [
        {
            "stock": {"curve": [[15.0, 40, 2.0], [stock, 80, 1.0]]},
            "compute": {"curve": [[6.0, 80, 1.5]]},
            "int8": {"curve": [[stock / 2, 96, 1.0]], "bytes_per_step": 490_000.0},
        }
        for stock in (30.0, 32.0, 28.0)
    ]
    meta = {
        "model": "gpt",
        "hosts": 2,
        "ranks_per_host": 1,
        "rate": "50mbit",
        "stock_steps": 80,
        "batch_size": 32,
        "command": "benchmarks/time_to_loss.py",
        "date": "2026-12-07",
        "cpu_cores": 2,
        "emulated": True,
        "rounds": 3,
        "minutes": 5.0,
    }
    bench.write_report(bench.summarize(rounds), rounds, meta, tmp_path, "report")
    text = (tmp_path / "report.md").read_text()
    assert (
        "stock's 80 steps with no sync (every rank alone, all at once; rank 0's clock) took 6.0 s, 6.0 s, 6.0 s" in text
    )
    # int8 took half stock's time in every round: 2x sooner, 6 / 15 = 0.40 of the limit at the median.
    assert (
        "| int8 | **2.00x sooner** | 15.0 s | 0.40 | 96 | 1.0000 | 0.49 MB | 2.00, 2.00, 2.00 (3/3 reached) |" in text
    )
    assert "| stock | 1.00x (the target) | 30.0 s | 0.20 | 80 |" in text
    bench.render(tmp_path / "report")  # written again from its JSON, the same
    assert (tmp_path / "report.md").read_text() == text
