"""The network finding tells the link from the backward pass: exposed sync time, the link's busy time, one advice table.

Real runs: 2 ranks under Lightning's fork launcher with every measuring callback, over this machine's loopback and
over a loopback shaped with ``tc`` in a network namespace of the test's own (skipped where namespaces cannot be made).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lightning_ddpopt.diagnosis import COMM_SHARE_PROBLEM, NETWORK_ADVICE, diagnose, network_advice_key
from lightning_ddpopt.ledger import CommLedger

ROOT = Path(__file__).resolve().parents[1]


class ScriptedTimeline:
    """Host-clock marks taken from a list, in order."""

    device_clock = False

    def __init__(self, marks: list[float]) -> None:
        self.marks = list(marks)

    def mark(self) -> float:
        return self.marks.pop(0)

    def seconds(self, mark: float) -> float:
        return mark

    def wait(self, mark: float) -> float:
        return mark


class FakeBucket:
    def __init__(self, index: int, numel: int = 10) -> None:
        import torch

        self._index, self._buffer = index, torch.zeros(numel)

    def index(self) -> int:
        return self._index

    def buffer(self):
        return self._buffer


def _completed():
    import torch

    future = torch.futures.Future()
    future.set_result(torch.zeros(1))
    return future


@pytest.mark.quick
def test_ledger_times_the_span_the_exposed_part_and_the_busy_time():
    # Three buckets: handed over at 0, 10 and 50 (the backward pass computes in between), done at 4, 30 and 60.
    # Bucket 1's transfer (10-30) and bucket 0's (0-4) leave the link idle 4-10 and 30-50.
    ledger = CommLedger(timeline=ScriptedTimeline([-5.0, 0.0, 4.0, 10.0, 30.0, 50.0, 60.0, 61.0]))
    ledger.add_micro_batch(8)  # the step's start mark: -5
    recorded = ledger.record_hook(lambda state, bucket: _completed())
    for index in range(3):  # each future completes at once: its end mark follows its start mark
        recorded(None, FakeBucket(index))
    (record,) = ledger.close_step()
    assert record.sync_time_s == 60.0  # first hand-over to last result
    assert record.exposed_time_s == 10.0  # the last bucket's hand-over (50) to the last result (60)
    assert record.busy_time_s == 4.0 + 20.0 + 10.0


@pytest.mark.quick
@pytest.mark.parametrize(
    ("intervals", "exposed", "busy"),
    [
        # Queued behind one another: 0-30 and 5-40. The union counts 0-40 once.
        ([(0.0, 30.0), (5.0, 40.0)], 35.0, 40.0),
        # The first bucket outlasts the last one (0-50 and 10-20): the step waits from the last hand-over (10) until
        # the first bucket's result (50), not for the last bucket's own 10.
        ([(0.0, 50.0), (10.0, 20.0)], 40.0, 50.0),
        # Over two sync rounds (accumulation without no_sync): each round's exposed and busy time, added.
        ([(0.0, 5.0), (100.0, 130.0)], None, None),
    ],
)
def test_ledger_exposed_and_busy_time_of_overlapping_buckets(intervals, exposed, busy):
    marks = [mark for interval in intervals for mark in interval]
    ledger = CommLedger(timeline=ScriptedTimeline([0.0, *marks, 200.0]))
    ledger.add_micro_batch(8)
    recorded = ledger.record_hook(lambda state, bucket: _completed())
    two_rounds = exposed is None
    for index in range(len(intervals)):  # each future completes at once: its end mark follows its start mark
        recorded(None, FakeBucket(0 if two_rounds else index))
    (record,) = ledger.close_step()
    if two_rounds:  # bucket 0 twice: two rounds of one bucket each, 5 and 30 long
        assert record.sync_rounds == 2 and record.sync_time_s == record.exposed_time_s == record.busy_time_s == 35.0
    else:
        assert record.sync_rounds == 1
        assert (record.exposed_time_s, record.busy_time_s) == (exposed, busy)


def _summary(hook: str, exposed_share: float, **extra) -> dict:
    step_ms = 100.0
    comm = {
        "step_time_ms": step_ms,
        "sync_time_ms": 90.0,
        "comm_share": 0.9,
        "exposed_time_ms": exposed_share * step_ms,
        "exposed_time_min_rank_ms": exposed_share * step_ms,
        "exposed_share": exposed_share,
        "link_busy_share": 0.95 if exposed_share >= COMM_SHARE_PROBLEM else 0.06,
        "busbw_gbps": 0.11,
        "bytes_sent": 4e6,
        "interval_steps": 20,
    }
    return {"comm_hook": hook, "comm": comm, **extra}


def _network(summary: dict):
    return diagnose(summary)[0]


@pytest.mark.quick
def test_a_busy_backward_over_an_idle_link_is_compute_not_network():
    finding = _network(_summary("allreduce", 0.02))
    assert finding.status == "ok" and finding.recommendation == ""
    assert finding.evidence == (
        "sync 90.0 ms per step, of which 2.0 ms exposed (2% of the step); link busy 6% of the step at 0.110 GB/s bus "
        "bandwidth; 4 MB sent per step (means of the last 20 steps over all ranks), hook allreduce; the backward pass "
        "hides 88.0 ms of the sync: the step is compute-bound, and sending fewer bytes would not make it faster"
    )


@pytest.mark.quick
@pytest.mark.parametrize(
    ("hook", "extra", "key"),
    [
        ("allreduce", {}, "allreduce"),
        ("fp16", {}, "cast"),
        ("bf16", {}, "cast"),
        ("int8", {}, "int8"),
        ("powersgd", {"powersgd": {"rank": 8, "max_rank": 64, "max_error": 0.6}}, "powersgd"),
        ("powersgd_fp16", {"powersgd": {"rank": 8, "max_rank": 64, "max_error": 0.9}}, "powersgd"),
        ("powersgd", {"powersgd": {"rank": 4, "max_rank": 4, "max_error": None}}, "powersgd_fixed_rank"),
        ("batched_powersgd", {"powersgd": {"rank": 16, "max_rank": 16, "max_error": None}}, "powersgd_fixed_rank"),
        ("int8", {"local_sgd": {"sync_every": 16, "warmup_steps": 0, "syncs": 3}}, "local_sgd"),
        ("my_hook", {}, "other"),
        # A PowerSGD hook of torch's, or a hook of the user's so named: no PowerSGD state of ours, no rank to name.
        ("powerSGD_hook", {}, "other"),
    ],
)
def test_each_hook_gets_the_advice_of_the_one_table(hook, extra, key):
    summary = _summary(hook, 0.6, **extra)
    assert network_advice_key(summary) == key
    finding = _network(summary)
    assert finding.status == "problem"
    assert finding.evidence.startswith("sync 90.0 ms per step, of which 60.0 ms exposed (60% of the step); link busy")
    assert finding.recommendation == NETWORK_ADVICE[key].format(**extra.get("powersgd", {}))
    if key == "powersgd_fixed_rank":  # the rank to lower is the one the user fixed
        assert f"fixed rank of {extra['powersgd']['rank']}" in finding.recommendation
    else:  # no rank advice where the error bound sets the rank, or for another hook
        assert "rank" not in finding.recommendation.replace("sets PowerSGD's rank", "")


@pytest.mark.quick
def test_int8_is_the_first_compression_advised():
    assert NETWORK_ADVICE["allreduce"].startswith("use comm_hook='int8'")
    assert NETWORK_ADVICE["cast"].startswith("use comm_hook='int8'")
    assert "powersgd" in NETWORK_ADVICE["int8"] and "LocalSGDConfig" in NETWORK_ADVICE["int8"]


@pytest.mark.quick
def test_an_exposed_sync_that_does_not_fill_the_measured_link_is_not_sent_to_compression():
    summary = _summary("allreduce", 0.5)
    summary["comm"]["link_busbw_gbps"] = 1.0  # the probe's; the run reached 0.11 of it
    finding = _network(summary)
    assert finding.status == "problem" and "(0.11 of the measured link)" in finding.evidence
    assert finding.recommendation.startswith("the exposed sync does not fill the link, so fewer bytes help little")


@pytest.mark.quick
def test_ranks_waiting_for_the_last_one_are_said_apart():
    summary = _summary("allreduce", 0.1)
    # 3 ranks: the last to reach the sync waits 10 ms, the two others 85 each (they wait 75 ms for it); mean 60.
    summary["comm"]["exposed_time_ms"] = 60.0
    summary["world_size"] = 3
    finding = _network(summary)
    assert finding.status == "ok"
    assert (
        "; the other ranks wait 75.0 ms more, for the last rank to reach the sync (see stragglers);" in finding.evidence
    )
    # Their long sync is waiting, not backward compute hiding it: not called compute-bound.
    assert "compute-bound" not in finding.evidence


@pytest.mark.quick
def test_the_troubleshooting_page_shows_the_advice_table():
    page = (ROOT / "docs" / "guides" / "troubleshooting.md").read_text()
    for key, advice in NETWORK_ADVICE.items():
        assert f"| `{key}` | {advice.format(rank='R')} |" in page, key


def _fit(case: str, out_dir: Path, namespace: str | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PL_", "LOCAL_RANK", "NODE_RANK"))}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "tests.network_worker", case, str(out_dir)]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out_dir.rglob("ddpopt_report.json")
    report = json.loads(path.read_text())
    # The findings start on a line of their own, not on the end of the last progress or log line.
    assert re.search(r"(^|\n)ddpopt findings \(network", done.stdout), done.stdout[-2000:]
    return report


@pytest.mark.slow
def test_a_busy_backward_over_loopback_is_not_a_network_problem(tmp_path):
    report = _fit("busy_backward", tmp_path)
    comm = report["summary"]["comm"]
    network = report["findings"][0]
    # 80 ms of backward compute lie between the first bucket's hand-over and the last's: the span holds them, the
    # exposed part does not.
    assert comm["sync_time_ms"] >= 80.0
    assert comm["exposed_time_min_rank_ms"] < 0.25 * comm["sync_time_ms"]
    assert comm["link_busy_ms"] < 0.5 * comm["sync_time_ms"]
    assert network["status"] == "ok", network
    assert "the backward pass hides" in network["evidence"]
    # Compute-bound where the exposed sync is under half the problem share and no rank came late to the sync. On this
    # loaded 2-core machine a rank can come late by a few ms, or the exposed part can reach 15% of the step: then the
    # finding says the others waited, or leaves the verdict out, and never calls the step compute-bound.
    waited = "the other ranks wait" in network["evidence"]
    compute_bound = comm["exposed_share"] < COMM_SHARE_PROBLEM / 2 and not waited
    assert ("the step is compute-bound" in network["evidence"]) is compute_bound, (comm["exposed_share"], network)
    series = report["series"]["0"]
    assert len(series["exposed_time_ms"]) == len(series["sync_time_ms"]) == 8
    assert all(e <= s for e, s in zip(series["exposed_time_ms"], series["sync_time_ms"], strict=True))


@pytest.fixture
def shaped_loopback(request):
    """A network namespace whose loopback is shaped to ``request.param`` with tc's token bucket filter."""
    if os.geteuid() != 0 or subprocess.run(["which", "ip", "tc"], capture_output=True).returncode != 0:
        pytest.skip("needs root and iproute2 (ip, tc) for a network namespace")
    namespace = f"ddpopt_t{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        subprocess.run(["ip", "-n", namespace, "link", "set", "lo", "up"], check=True)
        tbf = ["tbf", "rate", request.param, "burst", "256kb", "latency", "50ms"]
        subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", *tbf], check=True)
        yield namespace
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False)


@pytest.mark.parametrize(
    ("case", "shaped_loopback"),
    [
        pytest.param("saturated", "1gbit", id="saturated-1gbit"),
        pytest.param("busy_backward", "100mbit", id="busy-backward-100mbit", marks=pytest.mark.slow),
    ],
    indirect=["shaped_loopback"],
)
def test_a_slow_link_is_a_network_problem_even_behind_a_busy_backward(tmp_path, case, shaped_loopback):
    report = _fit(case, tmp_path, namespace=shaped_loopback)
    comm = report["summary"]["comm"]
    network = report["findings"][0]
    assert comm["exposed_share"] >= COMM_SHARE_PROBLEM, comm
    assert network["status"] == "problem", network
    assert network["recommendation"] == NETWORK_ADVICE["allreduce"]
    # Through a 1 Gbit (125 MB/s) or 100 Mbit bucket that both ranks' traffic shares, the sync reaches at most that.
    rate = {"1gbit": 125e6, "100mbit": 12.5e6}[{"saturated": "1gbit", "busy_backward": "100mbit"}[case]]
    assert comm["algbw_gbps"] * 1e9 < rate


@pytest.mark.quick
def test_a_report_of_an_earlier_release_is_not_judged_on_its_span():
    summary = {"comm_hook": "allreduce", "comm": {"sync_time_ms": 83.7, "transfer_share": 0.85, "step_time_ms": 98.0}}
    finding = _network(summary)
    assert (finding.status, finding.evidence, finding.recommendation) == (
        "unknown",
        "this report measured the sync's span only (85% of the step), which counts backward compute that overlaps the "
        "sync",
        "re-run with this release's CommProfiler: it measures the exposed sync, what the step waits for",
    )
