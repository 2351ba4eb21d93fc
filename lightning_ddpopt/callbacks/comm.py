"""CommProfiler: sync time (its span and the part the step waits for), bytes, bandwidth and jitter, across ranks.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ddpopt._validate import require_int, require_number
from lightning_ddpopt.callbacks._cursor import LedgerCursor
from lightning_ddpopt.callbacks._report import report_if_last
from lightning_ddpopt.callbacks._tensorboard import charts, write_layout_if_first
from lightning_ddpopt.costmodel import bus_bandwidth
from lightning_ddpopt.deferred import to_device
from lightning_ddpopt.ledger import QUALITY_FIELDS, CommLedger, StepRecord, local_drift, run_quality
from lightning_ddpopt.measuring import CoreViews, MeasuringCallback
from lightning_ddpopt.meetings import Exchange, meets_in_passing, ranks_meet
from lightning_ddpopt.timing import median_seconds
from lightning_ddpopt.units import MIB, format_bytes

__all__ = ["CommProfiler"]

#: The interval's per-step figures taken from the strategy's ledger, each from its :class:`StepRecord` attribute.
_RECORD_FIELDS = {
    "sync_time": "sync_time_s",
    "exposed_time": "exposed_time_s",
    "busy_time": "busy_time_s",
    "bytes_sent": "wire_bytes",  # None from a hook that does not report them: left out
    "bytes_sent_intra_node": "intra_node_bytes",
    "intra_node_time": "intra_node_s",
    "cross_node_time": "cross_node_s",
    "bytes_uncompressed": "logical_bytes",
    "sync_rounds": "sync_rounds",
    "transfer_hidden": "transfer_hidden",
}
_INTERVAL_FIELDS = ("step_time", *_RECORD_FIELDS, *QUALITY_FIELDS)
#: The per-step series each rank keeps for the report's plot.
_SERIES = ("step", "step_time_ms", "sync_time_ms", "exposed_time_ms", "bytes_sent", "compression_error")


class CommProfiler(MeasuringCallback):
    """Measures, per optimizer step, what gradient synchronisation costs; logs it aggregated over all ranks.

    Reads the :class:`~lightning_ddpopt.ledger.CommLedger` of :class:`~lightning_ddpopt.OptimizedDDPStrategy`
    (with Lightning's stock ``DDPStrategy`` only step times and jitter are available; on one device it warns
    once and steps aside). Every ``every_n_steps`` optimizer steps the ranks' figures are aggregated (one small
    all-gather) and logged (under local SGD at the next parameter sync, where the ranks meet anyway: see
    :func:`lightning_ddpopt.meetings.ranks_meet`; with ``overlap_steps`` the ranks do not wait for each other at a
    sync's start, so the gather stays in flight and its figures are logged at the next sync); nothing else communicates
    during training.

    ====================================  ==========================================================================
    key                                   meaning (over the last ``every_n_steps`` steps, all ranks)
    ====================================  ==========================================================================
    ``ddpopt/comm/step_time_ms``          mean time of an optimizer step, from one step's end to the next's
    ``ddpopt/comm/sync_time_ms``          mean sync span: first bucket handed to the hook to last bucket done; it
                                          overlaps the backward pass, which computes the later buckets meanwhile
    ``ddpopt/comm/sync_time_max_ms``      the largest sync span of any rank and step
    ``ddpopt/comm/comm_share``            sync span / step time
    ``ddpopt/comm/exposed_time_ms``       mean exposed sync time: from the last bucket handed to the hook (every
                                          gradient computed) to the last bucket done: what the step waits for
    ``ddpopt/comm/exposed_time_min_rank_ms``  the lowest rank mean: the last rank to finish its backward pass waits
                                          least, so this is the network's own cost and the rest of
                                          ``exposed_time_ms`` is waiting for that rank
    ``ddpopt/comm/exposed_share``         exposed_time_min_rank / step time: what the network costs the step
    ``ddpopt/comm/link_busy_ms``          time with at least one bucket in the hook's hands (compressed, in transfer
                                          or queued for it), per step; the lowest rank mean, as above
    ``ddpopt/comm/link_busy_share``       link_busy / step time: how much of the step the link is in use
    ``ddpopt/comm/bytes_sent``            bytes a rank sent per step, after compression, mean over ranks; with a
                                          hierarchical sync, those that crossed nodes
    ``ddpopt/comm/bytes_sent_intra_node`` with a hierarchical sync, the bytes a rank sent inside its node per step
    ``ddpopt/comm/intra_node_ms``         with a hierarchical sync on CPUs, host time of its stages inside the node
                                          per step, summed over the buckets (they overlap each other and the
                                          backward pass: work, not a span), mean over ranks
    ``ddpopt/comm/cross_node_ms``         likewise, of its stage between the nodes
    ``ddpopt/comm/bytes_uncompressed``    gradient bytes per step before compression
    ``ddpopt/comm/compression_ratio``     uncompressed / sent
    ``ddpopt/comm/algbw_gbps``            bytes sent / busy time (``link_busy``), GB/s: the bandwidth the sync
                                          achieved while it ran; not logged for an interval with a transfer that ran
                                          while the ranks trained on (local SGD's overlapped sync: the step waited
                                          for its arrival only)
    ``ddpopt/comm/busbw_gbps``            algbw x 2 (n - 1) / n: comparable with the link's rate (n: the ranks;
                                          with a hierarchical sync, the nodes, times the M ranks of a node, whose
                                          rings share its link)
    ``ddpopt/comm/sync_rounds``           gradient syncs per optimizer step (1 with accumulation done right)
    ``ddpopt/comm/compression_error``     a lossy hook's relative compression error, mean over ranks: the norm of
                                          what the compression dropped over the norm of what it was given (gradient
                                          plus the error fed back); measured every ``error_every`` syncs
    ``ddpopt/comm/compression_error_max`` the largest rank's
    ``ddpopt/comm/error_feedback``        the norm of the error fed back over the norm of what was given
    ``ddpopt/comm/local_drift``           local SGD: the spread of the ranks' parameter changes around their mean
                                          at a sync (root mean square distance), relative to the mean change
    ``ddpopt/comm/step_time_cv``          coefficient of variation of the step time over the last ``window``
    ``ddpopt/comm/step_time_p{50,95,99}_ms``  step-time percentiles over the last ``window`` steps
    ``ddpopt/comm/sync_time_cv``          coefficient of variation of the sync time
    ``ddpopt/comm/sync_time_p{50,95,99}_ms``  sync-time percentiles
    ====================================  ==========================================================================

    Times are host clocks on CPU and CUDA events on a GPU (the ledger's, or without it a step-timing ledger of this
    callback's own), read back a step or so later without a host sync, so a log point covers the steps
    each rank's device had finished. The first step of an epoch is not timed across the epoch boundary. The jitter
    figures (``*_cv``, ``*_p{50,95,99}_ms``) leave out each fit's first ``jitter_skip_steps`` steps: one-time work
    (DDP's bucket rebuild, kernels compiled at their first call) would otherwise read as jitter.

    The quality figures (``compression_error``, ``error_feedback``, ``local_drift``) are logged when they were
    measured in the interval: a lossy hook (fp16, bf16, int8, PowerSGD) measures every ``error_every``-th sync (a
    pass or two over the gradients; the ledger's :attr:`~lightning_ddpopt.ledger.CommLedger.error_every`), local
    SGD at each parameter sync. The error is each rank's own compression of its gradient (int8's re-quantisation of
    the summed chunks and the rounding of a half-precision sum are not counted), and a round with non-finite values
    is left out (``AMPMonitor`` reports those). The report keeps the run's means, and a finding says when they are
    high.

    At the end of fit, rank 0 prints the findings of :mod:`lightning_ddpopt.diagnosis` (network, AMP from an
    :class:`AMPMonitor`, accumulation, stragglers from a :class:`StragglerDetector`) and writes them, with every
    rank's per-step series, to ``ddpopt_report.json`` in the Trainer's log directory; ``ddpopt report`` plots it.

    Args:
        every_n_steps: optimizer steps between two aggregations (and log points).
        window: steps over which jitter (CV and percentiles) is computed.
        jitter_skip_steps: each fit's first steps, left out of the jitter figures (not of the means).
        probe_link: at fit start, time ``probe_repeats`` allreduces of ``probe_mb`` MiB to measure the link, so
            findings can say which fraction of it the training achieved.
        probe_mb: size of a probe allreduce.
        probe_repeats: timed probe allreduces (after one warm-up).
        report: print findings and write the JSON report at the end of fit.
        max_series_points: per-step points kept per rank for the report's plot; beyond twice this, every other
            point is dropped, so a long run keeps a bounded, evenly thinned series.
        error_every: lossy hooks measure their compression error every this many syncs; 0 turns it off.
    """

    def __init__(
        self,
        every_n_steps: int = 20,
        window: int = 200,
        jitter_skip_steps: int = 5,
        probe_link: bool = False,
        probe_mb: float = 16.0,
        probe_repeats: int = 3,
        report: bool = True,
        max_series_points: int = 5000,
        error_every: int = 10,
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("window", window), ("probe_repeats", probe_repeats)):
            require_int(name, value, 1)
        require_int("max_series_points", max_series_points, 1)
        require_int("jitter_skip_steps", jitter_skip_steps, 0)
        require_int("error_every", error_every, 0)
        require_number("probe_mb", probe_mb)
        self.every_n_steps = every_n_steps
        self.window = window
        self.jitter_skip_steps = jitter_skip_steps
        self.probe_link = probe_link
        self.probe_mb = probe_mb
        self.probe_repeats = probe_repeats
        self.report = report
        self.max_series_points = max_series_points
        self.error_every = error_every

        self.link_busbw_gbps: float | None = None
        self.last_metrics: dict[str, float] = {}
        self.report_path: Path | None = None
        self.report_series: dict[str, Any] | None = None
        self._cursor = LedgerCursor()
        self._active = False
        self._step_clock: CommLedger | None = None  # without the strategy's ledger: one of our own, for step times
        self._since_log = 0
        self._step_times: deque[float] = deque(maxlen=window)
        self._sync_times: deque[float] = deque(maxlen=window)
        self._series: dict[str, list[float]] = {name: [] for name in _SERIES}
        # The run's quality figures (sum, count), for the report: the logged ones cover an interval only.
        self._quality: dict[str, list[float]] = {name: [0.0, 0] for name in QUALITY_FIELDS}
        #: The quality figures over the whole run and every rank (set at the end of fit; see
        #: :func:`~lightning_ddpopt.ledger.run_quality`).
        self.run_quality: dict[str, float] = {}
        self._interval: dict[str, list[float]] = {name: [] for name in _INTERVAL_FIELDS}
        self._exchange = Exchange()  # every rank's figures, in flight from a meeting in passing to the next one
        self._fit_steps = 0  # steps taken in this fit (the first jitter_skip_steps are not jitter)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._active = trainer.world_size > 1
        if not self._active:
            rank_zero_warn("ddpopt: CommProfiler needs more than one process to measure communication; it is off.")
            return
        self._exchange = Exchange()
        self._fit_steps = 0
        self._ring_ranks, self._rings_per_link = trainer.world_size, 1
        self._quality = {name: [0.0, 0] for name in QUALITY_FIELDS}
        self.run_quality = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active and self.probe_link:
            self.link_busbw_gbps = self._probe(pl_module.device, trainer.world_size)
            rank_zero_info(
                f"ddpopt: link probe, {self.probe_repeats} allreduces of {format_bytes(self.probe_mb * MIB)}: "
                f"bus bandwidth {self.link_busbw_gbps:.3f} GB/s"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        write_layout_if_first(trainer, self)
        if not self._active:
            return
        self._cursor.start(trainer)  # the strategy has registered its hook by now
        # A two-tier sync's bytes_sent cross the nodes in rings of one rank per node, M of which share each node's
        # link: the link's bus bandwidth is M times one ring's.
        tiers = trainer.strategy.comm_tiers if isinstance(trainer.strategy, CoreViews) else None
        if tiers is not None:
            topology = tiers.topology
            self._ring_ranks, self._rings_per_link = topology.num_nodes, topology.ranks_per_node
        else:
            self._ring_ranks, self._rings_per_link = trainer.world_size, 1
        if self._cursor.ledger is not None:
            self._cursor.ledger.error_every = self.error_every
        else:
            self._step_clock = CommLedger(timeline=self._cursor.timeline)
            rank_zero_warn(
                "ddpopt: CommProfiler sees no gradient syncs (use OptimizedDDPStrategy with a comm_hook other than "
                "None for sync time and bytes); it logs step times and jitter only."
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_clock is not None:
            self._step_clock.add_micro_batch(None, first_of_epoch=batch_idx == 0)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        steps = self._cursor.new_steps(trainer)
        self._take_records(trainer, self._cursor.ledger, self._cursor.new_records())
        clock = self._step_clock
        if clock is not None:
            resolved = [record for _ in range(steps) for record in clock.close_step()] if steps else clock.poll()
            self._take_records(trainer, clock, resolved)
        # The host's step count decides when to aggregate: the same step on every rank, whatever each device's lag.
        self._since_log += steps
        if self._since_log >= self.every_n_steps and ranks_meet(trainer):
            self._since_log = 0
            self._aggregate(trainer, pl_module, in_passing=meets_in_passing(trainer), log=True)

    def _take_records(self, trainer: pl.Trainer, ledger: CommLedger | None, records: list[StepRecord]) -> None:
        """Add resolved records; the sync figures count only from the strategy's ledger, not our step clock."""
        for record in records:
            assert ledger is not None
            synced = ledger is self._cursor.ledger
            self._fit_steps += 1
            jitter = self._fit_steps > self.jitter_skip_steps  # one-time work in a fit's first steps is not jitter
            # On a GPU a record resolves a step or so after the host took it: place it at its own step.
            self._series["step"].append(float(trainer.global_step - (ledger.closed_steps - record.step)))
            step_time = record.step_time_s
            self._series["step_time_ms"].append(step_time * 1e3 if step_time is not None else math.nan)
            error = record.compression_error if synced else None
            self._series["compression_error"].append(error if error is not None else math.nan)
            if step_time is not None:
                if jitter:
                    self._step_times.append(step_time)
                self._interval["step_time"].append(step_time)
            if synced:
                if jitter:
                    self._sync_times.append(record.sync_time_s)
                for name, attribute in _RECORD_FIELDS.items():
                    value = getattr(record, attribute)
                    if value is not None:
                        self._interval[name].append(float(value))
                for name in QUALITY_FIELDS:
                    value = getattr(record, name)
                    if value is not None and math.isfinite(value):  # an overflowing step's error is not a figure
                        self._interval[name].append(value)
                        self._quality[name][0] += value
                        self._quality[name][1] += 1
                self._series["sync_time_ms"].append(record.sync_time_s * 1e3)
                self._series["exposed_time_ms"].append(record.exposed_time_s * 1e3)
                self._series["bytes_sent"].append(float(record.wire_bytes or 0))
            _thin(self._series, self.max_series_points)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            self.report_path = report_if_last(trainer, self)
            return
        self._take_records(trainer, self._cursor.ledger, self._cursor.new_records(wait=True))
        if self._step_clock is not None:
            self._take_records(trainer, self._step_clock, self._step_clock.flush())
        self._use(self._exchange.arrived(), pl_module, log=False)  # the end of fit is a meeting
        # Steps since the last log point, or records that resolved after it on some rank: one more aggregation, if
        # they synced (local SGD's steps after its last sync would stand for its whole run with nothing sent) or
        # nothing was aggregated yet.
        unlogged = bool(self._interval["step_time"] or self._interval["sync_time"])
        synced = self._cursor.ledger is None or any(self._interval["sync_rounds"]) or not self.last_metrics
        if trainer.strategy.reduce_boolean_decision((self._since_log > 0 or unlogged) and synced, all=False):
            self._since_log = 0
            self._aggregate(trainer, pl_module, in_passing=False, log=False)
        gathered: list[Any] = [(self._series, self._quality)]
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * trainer.world_size
            dist.all_gather_object(gathered, (self._series, self._quality))
        self.report_series = {str(rank): series for rank, (series, _) in enumerate(gathered)}
        self.run_quality = run_quality([quality for _, quality in gathered])
        self.report_path = report_if_last(trainer, self)

    summary_key = "comm"
    tensorboard_charts = charts(
        "ddpopt network",
        "ddpopt/comm",
        {
            "step and sync time (ms)": [
                "step_time_ms",
                "sync_time_ms",
                "sync_time_max_ms",
                "exposed_time_ms",
                "exposed_time_min_rank_ms",
                "link_busy_ms",
            ],
            "step time percentiles (ms)": ["step_time_p50_ms", "step_time_p95_ms", "step_time_p99_ms"],
            "sync time percentiles (ms)": ["sync_time_p50_ms", "sync_time_p95_ms", "sync_time_p99_ms"],
            "share of the step": ["comm_share", "exposed_share", "link_busy_share"],
            "bytes per step": ["bytes_sent", "bytes_sent_intra_node", "bytes_uncompressed"],
            "two tiers' host time per step (ms)": ["intra_node_ms", "cross_node_ms"],
            "compression ratio": ["compression_ratio"],
            "bandwidth (GB/s)": ["algbw_gbps", "busbw_gbps"],
            "jitter (coefficient of variation)": ["step_time_cv", "sync_time_cv"],
            "gradient syncs per optimizer step": ["sync_rounds"],
            "compression error (relative)": ["compression_error", "compression_error_max", "error_feedback"],
            "local SGD drift (relative)": ["local_drift"],
            "samples per optimizer step, all ranks": ["/ddpopt/effective_batch_size"],
        },
    )

    def summary(self) -> dict[str, Any]:
        """The latest aggregated figures, for the diagnosis."""
        return {
            **self.last_metrics,
            "link_busbw_gbps": self.link_busbw_gbps,
            "interval_steps": self.every_n_steps,
            "quality": self.run_quality,
        }

    def _aggregate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, in_passing: bool, log: bool) -> None:
        """Gather every rank's figures since the last aggregation and derive the logged ones (in passing: later)."""
        self._use(self._exchange.arrived(), pl_module, log)
        local = self._local_figures(pl_module.device)
        self._use(self._exchange.gather(local, trainer.world_size, in_passing, final=not log), pl_module, log)

    def _use(self, gathered: torch.Tensor | None, pl_module: pl.LightningModule, log: bool) -> None:
        """Derive (and log) the figures from every rank's rows, if they have arrived."""
        if gathered is None:
            return
        self.last_metrics = self._figures(gathered.double().cpu())
        if log:
            for key, value in self.last_metrics.items():
                pl_module.log(f"ddpopt/comm/{key}", value, on_step=True, on_epoch=False)

    def _local_figures(self, device: torch.device) -> torch.Tensor:
        """This rank's interval means, its largest sync time and its jitter windows, in one fixed-size row.

        NaN marks what a rank does not have (no ledger, no resolved step yet, a window not full).
        """
        local = [statistics.fmean(v) if v else math.nan for v in self._interval.values()]
        local.append(max(self._interval["sync_time"], default=math.nan))
        for values in self._interval.values():
            values.clear()
        for recent in (self._step_times, self._sync_times):
            local.extend([*recent, *[math.nan] * (self.window - len(recent))])
        return to_device(torch.tensor(local, dtype=torch.float64), device)

    def _figures(self, gathered: torch.Tensor) -> dict[str, float]:
        """The logged figures from every rank's row of :meth:`_local_figures`."""
        width = len(_INTERVAL_FIELDS) + 1
        per_rank = gathered[:, :width]
        windows = {
            "step_time": gathered[:, width : width + self.window],
            "sync_time": gathered[:, width + self.window :],
        }
        fields = dict(zip((*_INTERVAL_FIELDS, "sync_max"), per_rank.t(), strict=True))

        def mean(name: str) -> float:
            return float(fields[name].nanmean())

        out: dict[str, float] = {}
        step, sync = mean("step_time"), mean("sync_time")
        if not math.isnan(step):
            out["step_time_ms"] = step * 1e3
        if not math.isnan(sync):
            out["sync_time_ms"] = sync * 1e3
            out["sync_time_max_ms"] = float(fields["sync_max"].nan_to_num(-math.inf).max()) * 1e3
            # The last rank to finish its backward pass waits least: its exposed time is the network's own cost, the
            # rest of the others' is waiting for that rank (and so is their longer busy time).
            exposed = float(fields["exposed_time"].nan_to_num(math.inf).min())
            busy = float(fields["busy_time"].nan_to_num(math.inf).min())
            out["exposed_time_ms"] = mean("exposed_time") * 1e3
            out["exposed_time_min_rank_ms"] = exposed * 1e3
            out["link_busy_ms"] = busy * 1e3
            out["sync_rounds"] = mean("sync_rounds")
            out["bytes_uncompressed"] = mean("bytes_uncompressed")
            if "step_time_ms" in out:
                out["comm_share"] = sync / step
                out["exposed_share"] = exposed / step
                out["link_busy_share"] = busy / step
            if mean("bytes_sent_intra_node") > 0:
                out["bytes_sent_intra_node"] = mean("bytes_sent_intra_node")
            if mean("intra_node_time") > 0 or mean("cross_node_time") > 0:
                out["intra_node_ms"] = mean("intra_node_time") * 1e3
                out["cross_node_ms"] = mean("cross_node_time") * 1e3
            sent = mean("bytes_sent")
            if not math.isnan(sent):
                out["bytes_sent"] = sent
                out["compression_ratio"] = out["bytes_uncompressed"] / sent if sent else math.nan
                # A transfer that ran while the ranks trained (local SGD's overlap) left only its arrival in the
                # sync time: no bandwidth follows from that.
                if sent and busy and not mean("transfer_hidden"):
                    out["algbw_gbps"] = sent / busy / 1e9
                    out["busbw_gbps"] = bus_bandwidth(out["algbw_gbps"], self._ring_ranks) * self._rings_per_link
        for name in ("compression_error", "error_feedback"):
            if not math.isnan(mean(name)):
                out[name] = mean(name)
        if "compression_error" in out:
            out["compression_error_max"] = float(fields["compression_error"].nan_to_num(-math.inf).max())
        drift = local_drift([v for v in fields["drift_ratio"].tolist() if not math.isnan(v)])
        if drift is not None:
            out["local_drift"] = drift
        for name, window in windows.items():
            gathered_values = [v for v in window.flatten().tolist() if not math.isnan(v)]
            if len(gathered_values) >= 2:
                average = statistics.fmean(gathered_values)
                out[f"{name}_cv"] = statistics.pstdev(gathered_values) / average if average else math.nan
                for q in (50, 95, 99):
                    out[f"{name}_p{q}_ms"] = _percentile(gathered_values, q) * 1e3
        return out

    def _probe(self, device: torch.device, world_size: int) -> float:
        tensor = torch.ones(int(self.probe_mb * 1024 * 1024 / 4), dtype=torch.float32, device=device)
        seconds = median_seconds(lambda: dist.all_reduce(tensor), device, self.probe_repeats)
        algbw = tensor.numel() * 4 / seconds / 1e9
        return bus_bandwidth(algbw, world_size)


def _thin(series: dict[str, list[float]], limit: int) -> None:
    """Drop every other point of each series, in place, once the step series holds twice ``limit`` points."""
    if len(series["step"]) >= 2 * limit:
        for values in series.values():
            del values[1::2]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
