"""Emulated-cluster benchmark: N hosts on a shaped link, stock DDPStrategy against OptimizedDDPStrategy side by side.

Each emulated host is a Linux network namespace with ``--ranks-per-host`` training processes (``num_nodes=N,
devices=M``, each rank started with its ``LOCAL_RANK`` as a cluster launcher starts it; the ranks of a host talk over
its loopback, unshaped); hosts are
joined by a veth pair (N = 2) or through a bridge namespace (N > 2), and every host's link is shaped with
``tc ... tbf rate RATE burst 256kb latency 50ms`` (plus ``netem delay`` with ``--delay-ms``). Traffic only flows
between addresses inside namespaces this script creates, and it deletes them on exit, whatever happens. Without
root or iproute2 it falls back to plain loopback and says so.

Run:  .venv/bin/python benchmarks/cluster.py [--hosts 2] [--ranks-per-host 1] [--rate 1gbit] [--variants ...]
      .venv/bin/python benchmarks/cluster.py --task digits --name convergence    # accuracy against wall time

Writes ``benchmarks/results/cluster.{md,json,png}`` (``--name`` changes the stem). ``--task digits`` trains the
example's digits classifier for ``--epochs`` on every host and plots held-out accuracy against wall time.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "cluster_worker.py"
DEFAULT_VARIANTS = (
    "compute",
    "stock",
    "ours",
    "fp16",
    "bf16",
    "int8",
    "powersgd_r1",
    "powersgd_r4",
    "powersgd",
    "accum4",
    "auto_hook",
    "diloco16",
)
BUCKET_SWEEP = ("cap1", "cap5", "cap25", "cap100", "cap200")
DEFAULTS_CHECK = ("ours_builtin", "ours_no_view")
LOCAL_SGD = ("diloco16_int8", "diloco32", "diloco16_overlap", "diloco16_overlap12", "diloco16_int8_overlap")
#: Local SGD islands (a replica per host, the default at --ranks-per-host above 1) against a replica per rank, and
#: the islands' own limit: each host training alone, DDP over its ranks.
ISLANDS = ("islands_alone", "diloco16_ranks", "diloco16_overlap_ranks")
#: What a CPU mechanism buys: the same hook with its worker threads off (each bucket's work in the hook call).
MECHANISMS = ("fp16_hier_inline", "powersgd_r4_inline")
#: Variants that run one independent job per host (compute: one per rank), whose every host's step times count.
ALONE = ("compute", "islands_alone")
#: Two tiers against flat, for --ranks-per-host above 1 ("ours" is the default: hierarchical there).
HIERARCHICAL = (
    "ours_flat",
    "allreduce_hier",
    "fp16_hier",
    "bf16_hier",
    "int8_hier",
    "powersgd_r4_hier",
    "powersgd_hier",
)
DIGITS_VARIANTS = ("stock", "fp16", "powersgd_r4", "diloco16")
#: A variant with this suffix runs with CommProfiler, StragglerDetector and AMPMonitor attached.
CALLBACKS_SUFFIX = "+callbacks"
PREFIX = "ddpopt-"
SUBNET = "10.77.0"
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(text: str) -> float:
    """A tc rate such as ``1gbit`` or ``500mbit`` as bytes per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit)\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r} is not a tc rate; write e.g. 1gbit, 500mbit, 10gbit")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)] / 8


def parse_result(output: str) -> dict[str, Any]:
    """The ``RESULT {json}`` line a worker printed."""
    for line in reversed(output.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise ValueError("the worker printed no RESULT line")


@dataclass
class Host:
    """One emulated host: its namespace (``None`` on loopback), address and interface."""

    index: int
    namespace: str | None
    address: str
    interface: str


@dataclass
class Cluster:
    """Creates the namespaces and links on entry, deletes them on exit (and at interpreter exit or a signal).

    Workers still running then are killed first: deleting a namespace does not end the processes inside it.
    """

    hosts_count: int
    rate: str
    delay_ms: float = 0.0
    loopback: bool = False
    hosts: list[Host] = field(default_factory=list)
    running: list[subprocess.Popen] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    def __enter__(self) -> Cluster:
        atexit.register(self.teardown)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        if self.loopback:
            self.hosts = [Host(i, None, "127.0.0.1", "lo") for i in range(self.hosts_count)]
            return self
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Kill the workers still running; delete every namespace this cluster created (their veths go with them)."""
        while self.running:
            worker = self.running.pop()
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], check=False, capture_output=True)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.teardown()
        raise SystemExit(128 + signum)

    def _build(self) -> None:
        namespaces = [self._netns(f"{PREFIX}h{i}") for i in range(self.hosts_count)]
        self.hosts = [Host(i, ns, f"{SUBNET}.{i + 1}", f"dd{i}") for i, ns in enumerate(namespaces)]
        if self.hosts_count == 2:
            _ip("link", "add", "dd0", "type", "veth", "peer", "name", "dd1")
        else:
            bridge = self._netns(f"{PREFIX}br")
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for host in self.hosts:
                port = f"ddb{host.index}"
                _ip("link", "add", host.interface, "type", "veth", "peer", "name", port)
                _ip("link", "set", port, "netns", bridge)
                _ip("-n", bridge, "link", "set", port, "master", "br0")
                _ip("-n", bridge, "link", "set", port, "up")
                self._shape(bridge, port)  # traffic towards the host: its downlink
        for host in self.hosts:
            namespace = host.namespace or ""
            _ip("link", "set", host.interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", namespace, "link", "set", host.interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            self._shape(namespace, host.interface)

    def _netns(self, name: str) -> str:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)  # a leftover of a killed run
        _ip("netns", "add", name)
        self._created.append(name)
        return name

    def _shape(self, namespace: str, interface: str) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        if self.delay_ms > 0:
            _tc(
                namespace,
                "qdisc",
                "add",
                "dev",
                interface,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{self.delay_ms}ms",
            )
            _tc(namespace, "qdisc", "add", "dev", interface, "parent", "1:", "handle", "2:", *tbf)
        else:
            _tc(namespace, "qdisc", "add", "dev", interface, "root", *tbf)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["tc", "-n", namespace, *args], check=True, capture_output=True, text=True)


def can_emulate() -> str | None:
    """Why namespaces cannot be used here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "not running as root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    return None


def run_variant(
    cluster: Cluster,
    variant: str,
    port: int,
    worker_args: Sequence[str],
    timeout: float,
    ranks_per_host: int = 1,
    worker: Path = WORKER,
) -> dict:
    """Start ``ranks_per_host`` workers per host (as a cluster launcher does: ``LOCAL_RANK`` each) and return rank 0's
    result.

    A variant named ``NAME+callbacks`` is ``NAME`` with the three measuring callbacks attached. ``worker`` is the
    script each rank runs (``benchmarks/time_to_loss.py`` runs its own).

    The compute reference runs one independent process per rank at the same time (no process group, no sync):
    what the ranks compute when nothing waits, sharing the machine's memory bandwidth as the other variants do. Its
    result holds every process's step times (``host_step_times_s``): they need not compute at the same pace.
    ``islands_alone`` runs one job per host (DDP over the host's ranks, nothing between hosts), its result every
    host's step times.
    """
    hosts = cluster.hosts
    processes = []
    for host, local_rank in [(host, local) for host in hosts for local in range(ranks_per_host)]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        alone = variant == "islands_alone"
        if alone:  # a job of its own per host: its master on the host, its ranks over the host's loopback
            env.update(
                MASTER_ADDR=host.address,
                MASTER_PORT=str(port + 100 * host.index),
                NODE_RANK="0",
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(ranks_per_host),
                GLOO_SOCKET_IFNAME=host.interface,
            )
        elif variant != "compute":
            # The ranks of a host share its namespace; gloo inside the host goes over its loopback, unshaped.
            env.update(
                MASTER_ADDR=cluster.hosts[0].address,
                MASTER_PORT=str(port),
                NODE_RANK=str(host.index),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(len(hosts) * ranks_per_host),
                GLOO_SOCKET_IFNAME=host.interface,
            )
        name = variant.removesuffix(CALLBACKS_SUFFIX)
        flags = ["--callbacks"] if name != variant else []
        sizes = ["--num-nodes", "1" if alone else str(len(hosts)), "--devices", str(ranks_per_host)]
        command = [sys.executable, str(worker), "--variant", name, *sizes, *flags, *worker_args]
        if host.namespace is not None:
            command = ["ip", "netns", "exec", host.namespace, *command]
        processes.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    cluster.running[:] = processes  # killed at a signal or exit if still running
    outputs = []
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise RuntimeError(f"variant {variant} ran past {timeout:.0f} s") from None
        outputs.append(out)
    if any(p.returncode for p in processes):
        tail = "\n".join(o[-2000:] for o in outputs)
        raise RuntimeError(f"variant {variant} failed:\n{tail}")
    result = parse_result(outputs[0])
    if variant == "compute":
        result["host_step_times_s"] = [parse_result(output)["step_times_s"] for output in outputs]
    if variant == "islands_alone":  # each host's local rank 0 reports its job
        starts = range(0, len(outputs), ranks_per_host)
        result["host_step_times_s"] = [parse_result(outputs[start])["step_times_s"] for start in starts]
    return result


def link_bus_bandwidth(result: dict[str, Any], algbw: float, hosts: int) -> float:
    """A host link's bus bandwidth from one rank's bytes per second of sync: a flat ring over every rank puts
    ``2 (n-1)/n`` of a rank's payload on the link between two hosts; a two-tier sync (it sent bytes inside the host)
    runs M rings over the hosts, one per local rank, which share each host's link."""
    world = result.get("world_size") or hosts
    if result.get("bytes_sent_intra_node"):
        return algbw * 2 * (hosts - 1) / hosts * (world // hosts)
    return algbw * 2 * (world - 1) / world


def summarize(results: dict[str, dict], hosts: int, link_bytes_per_s: float | None) -> list[dict[str, Any]]:
    """Per-variant figures: samples/s, step percentiles, sync, bytes, speed-up, compute and link fractions."""
    rows = []
    compute = results.get("compute")
    # The compute limit and stock's rate in the statistic each variant is rated by: the median step for variants
    # that sync every step, the mean step for periodic ones (local SGD), whose rate is over whole sync windows.
    # The limit is every host's rate, summed: when one host computes more slowly than another (the machine's other
    # load does not fall evenly), host 0's rate times the hosts would overstate it.
    compute_limit: dict[bool, float] = {}
    if compute:
        host_times = compute.get("host_step_times_s") or [compute["step_times_s"]] * hosts
        for periodic, statistic in ((False, statistics.median), (True, statistics.fmean)):
            compute_limit[periodic] = sum(compute["samples_per_step"] / statistic(times) for times in host_times)
    alone = results.get("islands_alone")
    islands_limit = (
        sum(alone["samples_per_step"] / statistics.fmean(times) for times in alone["host_step_times_s"])
        if alone
        else None
    )
    stock = results.get("stock") or results.get("stock" + CALLBACKS_SUFFIX)  # --callbacks on: the reference has them
    stock_rate: dict[bool, float] = {}
    if stock:
        for periodic, statistic in ((False, statistics.median), (True, statistics.fmean)):
            stock_rate[periodic] = stock["samples_per_step"] / statistic(stock["step_times_s"])
    for variant, result in results.items():
        times = sorted(result["step_times_s"])
        if variant in ALONE:
            times = sorted(t for host in result.get("host_step_times_s") or [times] for t in host)
        p50, p95 = _percentile(times, 50), _percentile(times, 95)
        # Local SGD syncs once every H steps: its rate is over the whole window, syncs included, not the median step.
        # (Local SGD islands sync gradients inside the island every step, and are periodic all the same.)
        periodic = (
            variant == "islands_alone"
            or str(result.get("comm_hook") or "").startswith("local SGD")
            or ((result.get("sync_rounds") or 0) < 1 and variant != "compute" and result.get("sync_rounds") is not None)
        )
        rate = result["samples_per_step"] / (statistics.fmean(times) if periodic else p50)
        row: dict[str, Any] = {
            "variant": variant,
            "samples_per_s": rate,
            "step_p50_ms": p50 * 1e3,
            "step_p95_ms": p95 * 1e3,
            "sync_ms": result["sync_time_s"] * 1e3 if result.get("sync_time_s") is not None else None,
            "bytes_per_step": result.get("bytes_sent")
            if result.get("bytes_sent") is not None
            else (result["gradient_bytes"] if variant.removesuffix(CALLBACKS_SUFFIX) == "stock" else None),
            "speedup_vs_stock": rate / stock_rate[periodic] if stock_rate and variant != "compute" else None,
            "fraction_of_compute_limit": rate / compute_limit[periodic]
            if compute_limit and variant != "compute"
            else None,
            "link_fraction": None,
            # Local SGD against every host training alone with DDP inside (its mean step: over whole windows).
            "fraction_of_islands_limit": rate / islands_limit
            if islands_limit and periodic and variant != "islands_alone"
            else None,
            "bucket_cap_mb": result.get("bucket_cap_mb"),
            "comm_hook": result.get("comm_hook"),
            "hook_breakdown": result.get("hook_breakdown"),
        }
        if compute and result.get("sync_phases"):
            # Where local SGD's time goes: each kind of step's mean against the compute-only step's (with islands,
            # against a host training alone with DDP inside: the islands' own limit).
            reference = alone["step_times_s"] if alone else compute["step_times_s"]
            row["compute_step_ms"] = statistics.fmean(reference) * 1e3
            for phase in PHASES:
                ms = [t * 1e3 for t, p in zip(result["step_times_s"], result["sync_phases"], strict=True) if p == phase]
                row[f"{phase}_step_ms"] = statistics.fmean(ms) if ms else None
        if variant == "compute":
            row["samples_per_s"] = compute_limit[False]  # the physical limit: every host computing without syncing
        if variant == "islands_alone":
            row["samples_per_s"] = islands_limit  # every host's own DDP, summed
        sync, sent = result.get("sync_time_s"), result.get("bytes_sent")
        if link_bytes_per_s and sync and sent and hosts > 1:
            row["link_fraction"] = link_bus_bandwidth(result, sent / sync, hosts) / link_bytes_per_s
        rows.append(row)
    return rows


#: Local SGD's kinds of steps (``cluster_worker.sync_phase``), in the report's order.
PHASES = ("alone", "travelling", "start", "apply", "sync")


def window_breakdown(row: dict[str, Any], sync_every: int, overlap_steps: int) -> dict[str, float] | None:
    """ms over the compute-only steps per sync window of ``sync_every`` steps, by kind of step (see :data:`PHASES`)."""
    reference = row.get("compute_step_ms")
    if reference is None:
        return None
    counts = (
        {"alone": sync_every - overlap_steps - 1, "travelling": overlap_steps - 1, "start": 1, "apply": 1}
        if overlap_steps
        else {"alone": sync_every - 1, "sync": 1}
    )
    return {
        phase: count * (row[f"{phase}_step_ms"] - reference)
        for phase, count in counts.items()
        if row.get(f"{phase}_step_ms") is not None
    }


def combine_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per variant from several rounds' rows: each figure's median over the rounds.

    Ratios (speed-up, fraction of the compute limit) are taken within each round, against that round's reference,
    then their median: the machine's load drifts between rounds, and each round measures the variants close in
    time. Each row keeps every round's fraction of the compute limit in ``rounds_of_compute_limit``.
    """
    if len(rounds) == 1:
        return rounds[0]
    combined = []
    for row in rounds[0]:
        variant = row["variant"]
        same = [next(r for r in round_rows if r["variant"] == variant) for round_rows in rounds]
        merged = dict(row)
        for key, value in row.items():
            values = [r[key] for r in same if r[key] is not None]
            if isinstance(value, int | float) and not isinstance(value, bool) and values:
                merged[key] = statistics.median(values)
        merged["rounds_of_compute_limit"] = [r["fraction_of_compute_limit"] for r in same]
        merged["rounds_samples_per_s"] = [r["samples_per_s"] for r in same]
        merged["rounds_of_islands_limit"] = [r.get("fraction_of_islands_limit") for r in same]
        combined.append(merged)
    return combined


def callbacks_kept(plain: dict[str, Any], measured: dict[str, Any]) -> list[float]:
    """Each round's throughput with the measuring callbacks over the same round's without them."""
    without = plain.get("rounds_samples_per_s") or [plain["samples_per_s"]]
    with_them = measured.get("rounds_samples_per_s") or [measured["samples_per_s"]]
    return [after / before for before, after in zip(without, with_them, strict=True)]


def write_reports(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    out_dir: Path,
    name: str = "cluster",
    raw: list[dict[str, dict]] | None = None,
) -> list[Path]:
    """Markdown table, JSON (with ``raw``, each round's worker results, to summarise again) and a PNG of samples/s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{name}.md"
    rounds = meta.get("rounds", 1)
    ranks_per_host = meta.get("ranks_per_host", 1)  # results written before --ranks-per-host lack it
    lines = [
        f"Emulated cluster: {meta['hosts']} hosts x {ranks_per_host} rank{'s' if ranks_per_host > 1 else ''}, "
        f"link {meta['link']}, "
        f"model {meta['model']}, batch {meta['batch_size']}/rank, {meta['timed_steps']} timed steps "
        "(compute and local SGD: 64)" + (f", median of {rounds} rounds" if rounds > 1 else "") + f"; {meta['machine']}",
        f"Command: `{meta['command']}`, {meta['date']}",
        "",
        "| variant | hook | cap MiB | samples/s | step p50 ms | step p95 ms | sync ms | MB/step sent | vs stock "
        "| of compute limit | of link |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['comm_hook'] or '-'} | {_fmt(r['bucket_cap_mb'], 'g')} | "
            f"{r['samples_per_s']:.1f} | "
            f"{r['step_p50_ms']:.0f} | {r['step_p95_ms']:.0f} | "
            f"{_fmt(r['sync_ms'], '.0f')} | {_fmt(r['bytes_per_step'] and r['bytes_per_step'] / 1e6, '.2f')} | "
            f"{_fmt(r['speedup_vs_stock'], '.2f', 'x')} | {_fmt(r['fraction_of_compute_limit'], '.2f')} | "
            f"{_fmt(r['link_fraction'], '.2f')} |"
        )
    per_round = [r for r in rows if r.get("rounds_of_compute_limit") and r["fraction_of_compute_limit"] is not None]
    if per_round:
        lines += ["", "Of the compute limit, round by round (each against its own round's compute reference):", ""]
        lines += [
            f"- {r['variant']}: {', '.join(_fmt(f, '.2f') for f in r['rounds_of_compute_limit'])}" for r in per_round
        ]
    islands = [r for r in rows if r.get("fraction_of_islands_limit") is not None]
    if islands:
        lines += [
            "",
            "Of the islands' limit (`islands_alone`: each host training alone, DDP over its own ranks), the median "
            "and each round against its own round's reference:",
            "",
        ]
        lines += [
            f"- {r['variant']}: {_fmt(r['fraction_of_islands_limit'], '.2f')}"
            + (
                f" ({', '.join(_fmt(f, '.2f') for f in r['rounds_of_islands_limit'])})"
                if r.get("rounds_of_islands_limit")
                else ""
            )
            for r in islands
        ]
    by_name = {r["variant"]: r for r in rows}
    pairs = [
        (by_name[plain], measured)
        for name, measured in by_name.items()
        if (plain := name.removesuffix(CALLBACKS_SUFFIX)) != name and plain in by_name
    ]
    if pairs:
        checked = meta.get("nonfinite_check", "on") == "on"  # results written before the option lack it
        amp = "AMPMonitor()" if checked else "AMPMonitor(check_nonfinite=False)"
        lines += [
            "",
            f"The measuring callbacks' cost (`CommProfiler() + StragglerDetector() + {amp}`), each variant run "
            "without and with them, back to back (the order reversed every other round): the throughput kept is each "
            "round's ratio of the two (the pair ran close in time), the median of the rounds:",
            "",
            "| variant | samples/s without | samples/s with | throughput kept | rounds |",
            "|---|---|---|---|---|",
        ]
        for plain, measured in pairs:
            kept = callbacks_kept(plain, measured)
            lines.append(
                f"| {plain['variant']} | {plain['samples_per_s']:.1f} | {measured['samples_per_s']:.1f} | "
                f"{statistics.median(kept):.3f} | {', '.join(f'{k:.3f}' for k in kept)} |"
            )
    windows = [
        (r, window_breakdown(r, int(m[1]), int(m[2] or 0)))
        for r in rows
        if (m := re.match(r"local SGD H=(\d+)(?: tau=(\d+))?", r.get("comm_hook") or "")) and r.get("compute_step_ms")
    ]
    if windows:
        lines += [
            "",
            "Where local SGD's time goes: ms over the reference step per sync window, by kind of step (each kind's "
            "mean step against the reference's mean step in its round, the compute-only one or, where it ran, "
            "`islands_alone`'s; the median of the rounds): the steps while "
            "nothing travels, the steps while a sync travels, the step that starts it and the step that applies it "
            "(the step of a sync that does not travel):",
            "",
            "| variant | reference ms | alone | travelling | start | apply | sync | window total | of the window |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r, extra in windows:
            assert extra is not None
            steps = int(re.match(r"local SGD H=(\d+)", r["comm_hook"])[1])
            total = sum(extra.values())
            cells = " | ".join("-" if phase not in extra else f"{round(extra[phase]):+d}" for phase in PHASES)
            lines.append(
                f"| {r['variant']} | {r['compute_step_ms']:.0f} | {cells} | {round(total):+d} | "
                f"{total / (steps * r['compute_step_ms']):.2f} |"
            )
    breakdowns = [r for r in rows if r.get("hook_breakdown")]
    if breakdowns:
        lines += [
            "",
            "Inside the hooks that wait for collectives (PowerSGD on its worker thread; int8 on the backward thread "
            "and its two workers, summed over the threads, whose waits overlap; host ms per timed step):",
            "",
            "| variant | in hook ms | waiting for collectives ms | own work ms |",
            "|---|---|---|---|",
        ]
        for r in breakdowns:
            ms = {key: f"{seconds * 1e3:.0f}" for key, seconds in r["hook_breakdown"].items()}
            lines.append(f"| {r['variant']} | {ms['hook_s']} | {ms['hook_wait_s']} | {ms['hook_work_s']} |")
    md.write_text("\n".join(lines) + "\n")
    js = out_dir / f"{name}.json"
    js.write_text(json.dumps({"meta": meta, "rows": rows, **({"rounds": raw} if raw else {})}, indent=1))
    written = [md, js]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    figure, axis = plt.subplots(figsize=(9, 4))
    names = [r["variant"] for r in rows]
    axis.bar(names, [r["samples_per_s"] for r in rows], color=["grey" if n == "compute" else "C0" for n in names])
    axis.set_ylabel("samples/s (all hosts)")
    axis.set_title(f"{meta['hosts']} emulated hosts on {meta['link']}: throughput by strategy and hook")
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    png = out_dir / f"{name}.png"
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return [*written, png]


def write_digits_reports(results: dict[str, dict], meta: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """Accuracy against wall time per variant: a markdown table, JSON, and a PNG of the curves."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stock_time = results["stock"]["curve"][-1][0] if "stock" in results else None
    lines = [
        f"Emulated cluster, digits: {meta['hosts']} hosts, link {meta['link']}, {meta['epochs']} epochs, batch "
        f"{meta['batch_size']}/host; {meta['machine']}",
        f"Command: `{meta['command']}`, {meta['date']}",
        "",
        "| variant | final accuracy | best accuracy | training s | vs stock (time) |",
        "|---|---|---|---|---|",
    ]
    for variant, result in results.items():
        seconds, accuracy = result["curve"][-1]
        best = max(a for _, a in result["curve"])
        speed = f"{stock_time / seconds:.2f}x" if stock_time else "-"
        lines.append(f"| {variant} | {accuracy:.4f} | {best:.4f} | {seconds:.1f} | {speed} |")
    md = out_dir / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    js = out_dir / f"{name}.json"
    js.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [md, js]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for variant, result in results.items():
        seconds, accuracy = zip(*result["curve"], strict=True)
        axis.plot(seconds, accuracy, marker="o", markersize=3, label=variant)
    axis.set_xlabel("training wall time, s")
    axis.set_ylabel("held-out accuracy")
    axis.set_title(f"digits on {meta['hosts']} emulated hosts, {meta['link']}: accuracy against wall time")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    png = out_dir / f"{name}.png"
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return [md, js, png]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def _percentile(ordered: list[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def transformer_parameters(width: int, layers: int) -> int:
    """The worker's GPT: embeddings (256 bytes, 64 positions), blocks (attention, 4x MLP, 2 norms), norm, head."""
    block = 4 * width * width + 4 * width + 8 * width * width + 5 * width + 4 * width
    return 256 * width + 64 * width + layers * block + 2 * width + width * 256 + 256


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=1, help="training processes per host (default 1)")
    parser.add_argument("--rate", default="1gbit", help="tc rate of every host's link (default 1gbit)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay per link (netem)")
    parser.add_argument("--loopback", action="store_true", help="no namespaces: all hosts on 127.0.0.1, unshaped")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated; default {','.join(DEFAULT_VARIANTS)}; bucket sweep: {','.join(BUCKET_SWEEP)}; "
        f"defaults check: {','.join(DEFAULTS_CHECK)}",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--model",
        choices=("mlp", "transformer"),
        default="mlp",
        help="--task throughput: mlp (default; --layers x Linear(--width, --width), SGD) or transformer (a byte-level "
        "GPT of --layers blocks of width --width over random tokens, context 64, AdamW)",
    )
    parser.add_argument("--width", type=int, default=None, help="default 2048 (mlp), 512 (transformer)")
    parser.add_argument("--layers", type=int, default=None, help="default 6 (mlp), 4 (transformer)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    parser.add_argument(
        "--task",
        choices=("throughput", "digits"),
        default="throughput",
        help="throughput (default): step times on the MLP; digits: accuracy against wall time",
    )
    parser.add_argument("--epochs", type=int, default=10, help="--task digits: epochs per variant (default 10)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the variants this many times, in turn; each figure is the median over the rounds, every ratio "
        "taken within its round (default 1)",
    )
    parser.add_argument(
        "--callbacks",
        choices=("off", "on", "both"),
        default="off",
        help="attach CommProfiler, StragglerDetector and AMPMonitor: off (default), on, or both: each variant "
        "without and with them, back to back (the order reversed every other round), and their cost as a throughput "
        "ratio",
    )
    parser.add_argument(
        "--nonfinite-check",
        choices=("on", "off"),
        default="on",
        help="with --callbacks: AMPMonitor's non-finite gradient check (on by default, as in AMPMonitor())",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="cluster", help="report file stem (default cluster)")
    args = parser.parse_args(argv)
    transformer = args.model == "transformer"
    args.width = args.width if args.width is not None else 512 if transformer else 2048
    args.layers = args.layers if args.layers is not None else 4 if transformer else 6
    if transformer and args.task == "digits":
        parser.error("--model transformer measures throughput; use it without --task digits")
    if args.hosts < 2:
        parser.error(f"--hosts {args.hosts} must be at least 2")
    if args.ranks_per_host < 1:
        parser.error(f"--ranks-per-host {args.ranks_per_host} must be at least 1")
    if args.repeat < 1 or (args.repeat > 1 and args.task == "digits"):
        parser.error(f"--repeat {args.repeat} must be at least 1 (and 1 with --task digits)")
    try:
        link_bytes = parse_rate(args.rate)
    except ValueError as error:
        parser.error(str(error))
    if args.task == "digits" and args.variants == ",".join(DEFAULT_VARIANTS):
        args.variants = ",".join(DIGITS_VARIANTS)
    if args.task == "digits" and args.batch_size == 16:
        args.batch_size = 32  # the example's
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = DEFAULT_VARIANTS + BUCKET_SWEEP + DEFAULTS_CHECK + LOCAL_SGD + HIERARCHICAL + ISLANDS + MECHANISMS
    unknown = sorted(set(variants) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(known)}")
    if args.callbacks != "off" and args.task == "digits":
        parser.error("--callbacks measures throughput; use it without --task digits")
    if args.callbacks == "on":
        variants = [v if v in ALONE else v + CALLBACKS_SUFFIX for v in variants]
    elif args.callbacks == "both":
        variants = [name for v in variants for name in ((v,) if v in ALONE else (v, v + CALLBACKS_SUFFIX))]
    loopback = args.loopback
    reason = None if loopback else can_emulate()
    if reason:
        print(f"cluster: cannot emulate hosts ({reason}); falling back to loopback, unshaped", flush=True)
        loopback = True
    worker_args = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("steps", "warmup", "batch-size", "width", "layers", "task", "epochs", "model", "nonfinite-check")
    ]
    rounds: list[dict[str, dict]] = []
    with Cluster(args.hosts, args.rate, args.delay_ms, loopback) as cluster:
        link = (
            "loopback (unshaped)"
            if loopback
            else f"{args.rate}" + (f", {args.delay_ms:g} ms delay" if args.delay_ms else "")
        )
        layout = f"{args.hosts} hosts x {args.ranks_per_host} ranks"
        print(f"cluster: {layout} on {link}; {len(variants)} variants x {args.repeat}", flush=True)
        for round_index in range(args.repeat):
            results: dict[str, dict] = {}
            # Every other round runs the variants in reverse order: no variant always runs first in a round (or
            # before its +callbacks twin), so a drift of the machine's speed within a round biases no ratio.
            ordered = variants if round_index % 2 == 0 else variants[::-1]
            for index, variant in enumerate(ordered):
                started = time.monotonic()
                port = 29700 + round_index * len(variants) + index
                results[variant] = run_variant(
                    cluster, variant, port, worker_args, args.timeout, ranks_per_host=args.ranks_per_host
                )
                if args.task == "digits":
                    seconds, accuracy = results[variant]["curve"][-1]
                    figure = f"accuracy {accuracy:.4f} after {seconds:6.1f} s of training"
                else:
                    figure = f"step p50 {statistics.median(results[variant]['step_times_s']) * 1e3:7.0f} ms"
                print(
                    f"  [{index + 1}/{len(variants)}] {variant:12s} {figure} ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
            rounds.append(results)
    machine = f"{os.cpu_count()} CPU cores, torch threads per host {os.environ.get('DDPOPT_BENCH_THREADS', '1')}"
    command = "benchmarks/cluster.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    meta: dict[str, Any] = {
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host,
        "link": link,
        "batch_size": args.batch_size,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
    if args.task == "digits":
        meta["epochs"] = args.epochs
        written = write_digits_reports(rounds[0], {**meta, "machine": machine, "command": command}, out, args.name)
    else:
        meta["model"] = (
            f"byte-level GPT, {args.layers} blocks of width {args.width}, context 64, AdamW, "
            f"{transformer_parameters(args.width, args.layers) / 1e6:.1f}M parameters"
            if transformer
            else f"{args.layers} x Linear({args.width}, {args.width}), "
            f"{args.layers * (args.width**2 + args.width) / 1e6:.1f}M parameters"
        )
        meta["timed_steps"] = args.steps - args.warmup
        meta["rounds"] = args.repeat
        meta["nonfinite_check"] = args.nonfinite_check
        link_bytes_per_s = None if loopback else link_bytes
        rows = combine_rounds([summarize(results, args.hosts, link_bytes_per_s) for results in rounds])
        written = write_reports(rows, {**meta, "machine": machine, "command": command}, out, args.name, rounds)
    for path in written:
        print(f"wrote {path}")
    print((out / f"{args.name}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
