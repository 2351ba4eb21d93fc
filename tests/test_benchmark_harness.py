"""The emulated-cluster harness's parsing, summary and report writing, on recorded results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

_path = Path(__file__).parents[1] / "benchmarks" / "cluster.py"
_spec = importlib.util.spec_from_file_location("bench_cluster", _path)
cluster = importlib.util.module_from_spec(_spec)
sys.modules["bench_cluster"] = cluster
_spec.loader.exec_module(cluster)

GRAD = 100_712_448  # 6 x Linear(2048, 2048) in fp32


def recorded(variant, step_s, samples=32, sync=None, sent=None):
    return {
        "variant": variant,
        "world_size": 2,
        "samples_per_step": samples,
        "step_times_s": [step_s * f for f in (0.9, 1.0, 1.1)],
        "gradient_bytes": GRAD,
        "sync_time_s": sync,
        "bytes_sent": sent,
        "sync_rounds": 1.0 if sync else None,
    }


@pytest.mark.parametrize(
    ("text", "bytes_per_s"), [("1gbit", 125e6), ("500mbit", 62.5e6), ("10Gbit", 1.25e9), ("800kbit", 1e5)]
)
def test_parse_rate(text, bytes_per_s):
    assert cluster.parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["fast", "1 gigabit", "0gbit", "-1gbit", ""])
def test_parse_rate_refuses_what_tc_would(text):
    with pytest.raises(ValueError, match="is not a tc rate"):
        cluster.parse_rate(text)


def test_parse_result_takes_the_last_result_line():
    output = 'noise\nRESULT {"variant": "a"}\nmore noise\nRESULT {"variant": "b", "x": 1}\n'
    assert cluster.parse_result(output) == {"variant": "b", "x": 1}
    with pytest.raises(ValueError, match="no RESULT line"):
        cluster.parse_result("Traceback ...")


def test_summary_ratios():
    results = {
        "compute": recorded("compute", 0.2, samples=16),
        "stock": recorded("stock", 1.0),
        "fp16": recorded("fp16", 0.5, sync=0.4, sent=GRAD / 2),
    }
    rows = {row["variant"]: row for row in cluster.summarize(results, hosts=2, link_bytes_per_s=125e6)}
    assert rows["compute"]["samples_per_s"] == pytest.approx(16 / 0.2 * 2)  # every host computing, no sync
    assert rows["stock"]["samples_per_s"] == pytest.approx(32.0)
    assert rows["stock"]["bytes_per_step"] == GRAD
    assert rows["fp16"]["speedup_vs_stock"] == pytest.approx(2.0)
    assert rows["fp16"]["fraction_of_compute_limit"] == pytest.approx(64 / 160)
    # busbw = bytes / sync x 2(n-1)/n, over the link's bytes/s.
    assert rows["fp16"]["link_fraction"] == pytest.approx(GRAD / 2 / 0.4 / 125e6)
    assert rows["fp16"]["step_p95_ms"] == pytest.approx(0.5 * (1.0 + 0.9 * 0.1) * 1e3)


def test_periodic_variants_are_compared_with_the_mean_compute_and_stock_step():
    compute = recorded("compute", 0.2, samples=16)
    compute["step_times_s"] = [0.2, 0.2, 0.2, 0.6]  # median 0.2 s, mean 0.3 s
    stock = recorded("stock", 1.0)
    stock["step_times_s"] = [1.0, 1.0, 1.0, 2.0]  # median 1.0 s, mean 1.25 s
    local = recorded("diloco16", 0.1, sync=0.5, sent=GRAD / 16)
    local["step_times_s"], local["sync_rounds"] = [0.2, 0.2, 0.2, 1.0], 1 / 16  # mean 0.4 s
    fp16 = recorded("fp16", 0.4, sync=0.3, sent=GRAD / 2)
    fp16["step_times_s"] = [0.4, 0.4, 0.4, 2.0]  # median 0.4 s
    results = {"compute": compute, "stock": stock, "diloco16": local, "fp16": fp16}
    rows = {row["variant"]: row for row in cluster.summarize(results, 2, None)}
    assert rows["diloco16"]["samples_per_s"] == pytest.approx(32 / 0.4)
    assert rows["diloco16"]["fraction_of_compute_limit"] == pytest.approx(0.3 / 0.4)  # mean against mean
    assert rows["diloco16"]["speedup_vs_stock"] == pytest.approx(1.25 / 0.4)
    assert rows["fp16"]["fraction_of_compute_limit"] == pytest.approx(0.2 / 0.4)  # median against median
    assert rows["fp16"]["speedup_vs_stock"] == pytest.approx(1.0 / 0.4)


def test_islands_are_periodic_and_rated_against_each_host_alone():
    # Islands sync gradients inside every step (a sync round or more each step), and their parameters every H
    # steps: rated by the mean step, as local SGD is, and against every host training alone (summed).
    alone = recorded("islands_alone", 0.4, samples=32)
    alone["host_step_times_s"] = [[0.4, 0.4, 0.4, 0.4], [0.4, 0.4, 0.4, 0.8]]  # means 0.4 and 0.5 s
    islands = recorded("diloco16", 0.4, sync=0.3, sent=GRAD / 32)
    islands["step_times_s"], islands["sync_rounds"] = [0.4, 0.4, 0.4, 1.2], 3.0  # mean 0.6 s
    islands["comm_hook"], islands["samples_per_step"] = "local SGD H=16", 64
    rows = {row["variant"]: row for row in cluster.summarize({"islands_alone": alone, "diloco16": islands}, 2, None)}
    assert rows["islands_alone"]["samples_per_s"] == pytest.approx(32 / 0.4 + 32 / 0.5)
    assert rows["diloco16"]["samples_per_s"] == pytest.approx(64 / 0.6)
    assert rows["diloco16"]["fraction_of_islands_limit"] == pytest.approx((64 / 0.6) / 144)


def test_the_compute_limit_sums_every_hosts_rate():
    # Host 1 computes more slowly than host 0: the limit is their rates summed, not host 0's twice.
    compute = recorded("compute", 0.2, samples=16)
    compute["host_step_times_s"] = [[0.2, 0.2, 0.2, 0.2], [0.4, 0.4, 0.4, 0.4]]
    local = recorded("diloco16", 0.1, sync=0.5, sent=GRAD / 16)
    local["step_times_s"], local["sync_rounds"] = [0.3, 0.3, 0.3, 0.3], 1 / 16
    rows = {row["variant"]: row for row in cluster.summarize({"compute": compute, "diloco16": local}, 2, None)}
    assert rows["compute"]["samples_per_s"] == pytest.approx(16 / 0.2 + 16 / 0.4)
    assert rows["compute"]["step_p50_ms"] == pytest.approx(300)  # over both hosts' steps
    assert rows["diloco16"]["fraction_of_compute_limit"] == pytest.approx((32 / 0.3) / 120)


def test_rounds_combine_into_medians_of_ratios_taken_within_each_round(tmp_path):
    # Three rounds; the machine slows down in the second: each round's local SGD row is rated against its own
    # round's compute reference, and the report gives the medians and every round's fraction.
    rounds = []
    for compute_step, local_step in ((0.2, 0.25), (0.4, 0.45), (0.2, 0.3)):
        compute = recorded("compute", compute_step, samples=16)
        local = recorded("diloco16", local_step, sync=0.5, sent=GRAD / 16)
        local["sync_rounds"] = 1 / 16
        rounds.append(cluster.summarize({"compute": compute, "diloco16": local}, 2, None))
    rows = {row["variant"]: row for row in cluster.combine_rounds(rounds)}
    fractions = [0.2 / 0.25, 0.4 / 0.45, 0.2 / 0.3]
    assert rows["diloco16"]["rounds_of_compute_limit"] == pytest.approx(fractions)
    assert rows["diloco16"]["fraction_of_compute_limit"] == pytest.approx(0.8)  # the median of the three
    assert rows["diloco16"]["samples_per_s"] == pytest.approx(32 / 0.3)
    assert rows["compute"]["samples_per_s"] == pytest.approx(160)
    meta = {"hosts": 2, "link": "1gbit", "model": "m", "batch_size": 16, "timed_steps": 8, "machine": "x", "rounds": 3}
    meta |= {"command": "benchmarks/cluster.py --repeat 3", "date": "2026-12-02"}
    cluster.write_reports(list(rows.values()), meta, tmp_path)
    table = (tmp_path / "cluster.md").read_text().splitlines()
    assert "median of 3 rounds" in table[0]
    assert table[-1] == "- diloco16: 0.80, 0.89, 0.67"
    assert cluster.combine_rounds(rounds[:1]) is rounds[0]


def test_the_callbacks_cost_is_the_median_of_each_rounds_pair(tmp_path):
    # Without and then with the callbacks in each of three rounds. The machine is slow in the second round's run with
    # them and in all of the third round: the ratio of the medians (80 / 128 = 0.625) would count one disturbed run
    # as the callbacks' cost; each round's own pair gives 1.0, 0.625 and 0.976, whose median is 0.976.
    rounds = []
    for without, with_them in ((0.20, 0.20), (0.25, 0.40), (0.40, 0.41)):
        plain, measured = recorded("int8", without, sync=0.1, sent=GRAD / 4), recorded("int8", with_them)
        rounds.append(cluster.summarize({"int8": plain, "int8+callbacks": measured}, 2, None))
    rows = cluster.combine_rounds(rounds)
    by_name = {row["variant"]: row for row in rows}
    assert cluster.callbacks_kept(by_name["int8"], by_name["int8+callbacks"]) == pytest.approx(
        [1.0, 0.625, 0.40 / 0.41]
    )
    meta = {"hosts": 2, "link": "1gbit", "model": "m", "batch_size": 16, "timed_steps": 8, "machine": "x", "rounds": 3}
    meta |= {"command": "benchmarks/cluster.py --callbacks both --repeat 3", "date": "2026-12-06"}
    cluster.write_reports(rows, meta, tmp_path)
    table = (tmp_path / "cluster.md").read_text().splitlines()
    assert table[-1] == "| int8 | 128.0 | 80.0 | 0.976 | 1.000, 0.625, 0.976 |"


def test_reports_are_written(tmp_path):
    results = {"stock": recorded("stock", 1.0), "ours": recorded("ours", 0.9, sync=0.8, sent=GRAD)}
    rows = cluster.summarize(results, hosts=2, link_bytes_per_s=125e6)
    meta = {"hosts": 2, "link": "1gbit", "model": "m", "batch_size": 16, "timed_steps": 8, "machine": "x"}
    meta |= {"command": "benchmarks/cluster.py", "date": "2026-12-02"}
    paths = cluster.write_reports(rows, meta, tmp_path)
    assert [p.name for p in paths] == ["cluster.md", "cluster.json", "cluster.png"]
    table = (tmp_path / "cluster.md").read_text().splitlines()
    assert table[0].startswith("Emulated cluster: 2 hosts x 1 rank, link 1gbit, model m, batch 16/rank")
    assert table[1] == "Command: `benchmarks/cluster.py`, 2026-12-02"  # what reproduces it, and when it ran
    assert table[6] == "| ours | - | - | 35.6 | 900 | 981 | 800 | 100.71 | 1.11x | - | 1.01 |"
    assert json.loads((tmp_path / "cluster.json").read_text())["rows"][1]["variant"] == "ours"
    assert (tmp_path / "cluster.png").read_bytes()[:4] == b"\x89PNG"
    assert "Inside the hooks" not in "\n".join(table)  # no hook that waits: no breakdown table


def test_hook_breakdown_table(tmp_path):
    result = recorded("powersgd_r4", 0.5, sync=0.45, sent=440_000)
    result["hook_breakdown"] = {"hook_s": 0.42, "hook_wait_s": 0.35, "hook_work_s": 0.07}
    rows = cluster.summarize({"stock": recorded("stock", 1.0), "powersgd_r4": result}, hosts=2, link_bytes_per_s=None)
    meta = {"hosts": 2, "link": "1gbit", "model": "m", "batch_size": 16, "timed_steps": 8, "machine": "x"}
    meta |= {"command": "benchmarks/cluster.py", "date": "2026-12-02"}
    cluster.write_reports(rows, meta, tmp_path)
    table = (tmp_path / "cluster.md").read_text().splitlines()
    assert table[-3:] == [
        "| variant | in hook ms | waiting for collectives ms | own work ms |",
        "|---|---|---|---|",
        "| powersgd_r4 | 420 | 350 | 70 |",
    ]


def test_bad_arguments_exit_with_a_message(capsys):
    with pytest.raises(SystemExit):
        cluster.main(["--hosts", "1"])
    assert "--hosts 1 must be at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cluster.main(["--variants", "stock,turbo"])
    assert "unknown variants ['turbo']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cluster.main(["--rate", "fast"])
    assert "rate 'fast' is not a tc rate" in capsys.readouterr().err


def test_periodic_syncs_are_counted_over_the_whole_window():
    # Local SGD: one slow sync step in four. The rate is over all steps (mean), not the median step.
    result = recorded("diloco16", 0.1, sync=0.0, sent=GRAD / 4)
    result["step_times_s"] = [0.1, 0.1, 0.1, 0.5]
    result["sync_rounds"] = 0.25
    rows = {row["variant"]: row for row in cluster.summarize({"diloco16": result}, hosts=2, link_bytes_per_s=None)}
    assert rows["diloco16"]["samples_per_s"] == pytest.approx(32 / 0.2)


def test_digits_report(tmp_path):
    results = {
        "stock": {"variant": "stock", "curve": [[5.0, 0.8], [10.0, 0.95]]},
        "diloco16": {"variant": "diloco16", "curve": [[1.0, 0.7], [2.5, 0.96]]},
    }
    meta = {
        "hosts": 2,
        "link": "1gbit",
        "epochs": 2,
        "batch_size": 32,
        "machine": "x",
        "command": "c",
        "date": "2026-12-02",
    }
    paths = cluster.write_digits_reports(results, meta, tmp_path, "convergence")
    assert [p.name for p in paths] == ["convergence.md", "convergence.json", "convergence.png"]
    table = (tmp_path / "convergence.md").read_text().splitlines()
    assert table[-1] == "| diloco16 | 0.9600 | 0.9600 | 2.5 | 4.00x |"
    assert table[-2] == "| stock | 0.9500 | 0.9500 | 10.0 | 1.00x |"


def test_a_host_links_bus_bandwidth_flat_and_in_two_tiers():
    # 2 hosts x 2 ranks, each rank at 100 MB/s of sync: a flat ring over 4 ranks puts 2(4-1)/4 of a rank's payload
    # on the link between the hosts; two tiers run 2 rings over the hosts (2(2-1)/2 each), sharing each host's link.
    flat = {"world_size": 4, "bytes_sent_intra_node": 0}
    tiered = {"world_size": 4, "bytes_sent_intra_node": 5e7}
    assert cluster.link_bus_bandwidth(flat, 100e6, hosts=2) == pytest.approx(150e6)
    assert cluster.link_bus_bandwidth(tiered, 100e6, hosts=2) == pytest.approx(200e6)
    assert cluster.link_bus_bandwidth({}, 100e6, hosts=2) == pytest.approx(100e6)  # results from before: 1 per host


def test_local_sgds_time_is_told_by_kind_of_step(tmp_path):
    worker_path = Path(__file__).parents[1] / "benchmarks" / "cluster_worker.py"
    spec = importlib.util.spec_from_file_location("bench_cluster_worker", worker_path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    # H = 4, travelling 2 steps: started at 4, applied at 6, ...; nothing travels in the first window.
    phases = [worker.sync_phase(step, 4, 2, 0) for step in range(1, 11)]
    assert phases == ["alone"] * 3 + ["start", "travelling", "apply", "alone", "start", "travelling", "apply"]
    assert [worker.sync_phase(step, 4, 0, 2) for step in range(1, 8)] == ["warmup"] * 2 + ["alone"] * 3 + [
        "sync"
    ] * 1 + ["alone"]
    # Compute steps of 100 ms; local SGD's: 100 alone, 110 travelling, 140 starting, 130 applying.
    local = recorded("diloco4_overlap", 0.1)
    local["comm_hook"] = "local SGD H=4 tau=2"
    by_phase = {"alone": 0.1, "travelling": 0.11, "start": 0.14, "apply": 0.13}
    local["sync_phases"] = phases
    local["step_times_s"] = [by_phase[phase] for phase in phases]
    compute = recorded("compute", 0.1)
    compute["step_times_s"] = [0.1] * 3
    rows = cluster.summarize({"compute": compute, "diloco4_overlap": local}, hosts=2, link_bytes_per_s=None)
    extra = cluster.window_breakdown(rows[1], 4, 2)
    assert extra == pytest.approx({"alone": 0.0, "travelling": 10.0, "start": 40.0, "apply": 30.0})
    meta = {"hosts": 2, "link": "1gbit", "model": "m", "batch_size": 16, "timed_steps": 8, "machine": "x"}
    meta |= {"command": "benchmarks/cluster.py", "date": "2026-12-04"}
    cluster.write_reports(rows, meta, tmp_path)
    table = (tmp_path / "cluster.md").read_text().splitlines()
    assert table[-1] == "| diloco4_overlap | 100 | +0 | +10 | +40 | +30 | - | +80 | 0.20 |"
