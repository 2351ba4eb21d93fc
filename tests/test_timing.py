"""Timelines and the ledger's deferred resolution: steps become records once their marks resolve, never blocking."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_ddpopt.hooks import COMM_HOOKS
from lightning_ddpopt.ledger import CommLedger
from lightning_ddpopt.timing import CudaTimeline, HostTimeline, timeline_for
from tests.helpers import LaggingTimeline

pytestmark = pytest.mark.quick


def test_host_timeline_resolves_at_once():
    timeline = timeline_for(torch.device("cpu"))
    assert isinstance(timeline, HostTimeline) and not timeline.device_clock
    first, second = timeline.mark(), timeline.mark()
    assert timeline.seconds(first) == timeline.wait(first) == first <= second


def test_cuda_timeline_refuses_another_device():
    with pytest.raises(ValueError, match=r"device=device\(type='cpu'\): CudaTimeline marks CUDA streams"):
        CudaTimeline(torch.device("cpu"))


def _ddp(ledger: CommLedger) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01)
    spec = COMM_HOOKS["fp16"]
    model.register_comm_hook(spec.build(None, ledger), ledger.record_hook(spec.hook))
    return model


def _step(model: DistributedDataParallel, ledger: CommLedger, first_of_epoch: bool = False) -> list:
    ledger.add_micro_batch(4, first_of_epoch=first_of_epoch)
    model(torch.randn(4, 64)).sum().backward()
    return ledger.close_step()


def test_ledger_defers_steps_until_their_marks_resolve(gloo_group):
    # 2 buckets x (start, end) + step start + step end = 6 marks a step; a lag of 6 holds a step back one step.
    timeline = LaggingTimeline(lag=6)
    ledger = CommLedger(timeline=timeline)
    model = _ddp(ledger)
    assert _step(model, ledger, first_of_epoch=True) == []
    assert ledger.closed_steps == 1 and ledger.pending_steps == 1 and ledger.total_steps == 0
    resolved = _step(model, ledger)
    assert [r.step for r in resolved] == [1] and ledger.pending_steps == 1
    assert [r.step for r in _step(model, ledger)] == [2]
    assert ledger.poll() == []  # step 3's marks are still "on the device"
    assert timeline.waits == 0
    flushed = ledger.flush()
    assert [r.step for r in flushed] == [3] and ledger.pending_steps == 0 and timeline.waits == 6
    records = list(ledger.steps)
    assert [r.wire_bytes for r in records] == [2 * (64 * 64 + 64) * 2] * 3
    assert all(r.sync_rounds == 1 and r.micro_batches == 1 and r.samples == 4 for r in records)
    for r in records:
        assert r.start_s is not None and r.end_s is not None and r.sync_start_s is not None
        assert r.start_s <= r.sync_start_s <= r.end_s and 0 < r.sync_time_s <= r.end_s - r.start_s
    # The first step is timed from its first batch, later ones from the previous step's end.
    assert records[0].step_time_s == pytest.approx(records[0].end_s - records[0].start_s)
    assert records[1].step_time_s == pytest.approx(records[1].end_s - records[0].end_s)
    assert records[2].step_time_s == pytest.approx(records[2].end_s - records[1].end_s)


def test_an_epoch_boundary_is_not_counted_in_a_step(gloo_group):
    ledger = CommLedger()
    model = _ddp(ledger)
    _step(model, ledger, first_of_epoch=True)
    [record] = _step(model, ledger, first_of_epoch=True)
    assert record.step_time_s == pytest.approx(record.end_s - record.start_s)
    [record] = _step(model, ledger)
    assert record.step_time_s == pytest.approx(record.end_s - ledger.steps[-2].end_s)


class _FakeEvent:
    """A CUDA event on a device clock that the test moves by hand (milliseconds, as CUDA reports them)."""

    device_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at_ms: float | None = None
        self.reached = False

    def record(self, stream: object = None) -> None:
        self.at_ms = _FakeEvent.device_ms

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.reached = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.reached and end.reached, "cudaErrorNotReady"
        assert self.at_ms is not None and end.at_ms is not None
        return torch.tensor(end.at_ms - self.at_ms, dtype=torch.float32).item()  # CUDA answers in float32 ms


def test_cuda_timeline_reads_events_only_once_reached(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    _FakeEvent.device_ms = 1000.0
    timeline = CudaTimeline(torch.device("cuda", 0))  # its reference event is waited for once, here
    assert timeline.device_clock
    _FakeEvent.device_ms = 1250.0
    first = timeline.mark()
    _FakeEvent.device_ms = 1400.0
    second = timeline.mark()
    assert timeline.seconds(first) is None and timeline.seconds(second) is None  # the device has not got there
    first[0].reached = True
    assert timeline.seconds(first) - timeline._reference_s == pytest.approx(0.250)
    assert timeline.wait(second) - timeline.seconds(first) == pytest.approx(0.150)  # waiting is explicit


def test_cuda_timeline_keeps_sub_microsecond_durations_after_a_day(monkeypatch):
    import lightning_ddpopt.timing as timing

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    host = {"s": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: host["s"])

    def advance(seconds: float) -> None:  # host and device move together
        host["s"] += seconds
        _FakeEvent.device_ms += seconds * 1e3

    _FakeEvent.device_ms = 0.0
    timeline = CudaTimeline(torch.device("cuda", 0))
    marks = []
    for _ in range(24 * 60):  # a mark a minute for 24 hours, each resolved later
        advance(60.0)
        marks.append(timeline.mark())
    begin = timeline.mark()
    advance(0.00005)  # 50 microseconds of device work
    end = timeline.mark()
    for event, anchor in [*marks, begin, end]:
        event.reached = anchor.event.reached = True
    # A float32 millisecond count from the first event has a resolution of 8 ms after a day.
    assert timeline.seconds(end) - timeline.seconds(begin) == pytest.approx(50e-6, abs=1e-6)
    assert timeline.seconds(begin) - timeline._reference_s == pytest.approx(24 * 3600, abs=1e-3)
