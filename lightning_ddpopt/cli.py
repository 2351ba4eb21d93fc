"""The ``ddpopt`` command: ``plan`` (cost model), ``report`` (a run's findings and plot), ``names``, ``lighthouse``."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_ddpopt._registration import strategy_names
from lightning_ddpopt.costmodel import (
    CODEC_BYTES_PER_S,
    DEFAULT_PLAN_HOOKS,
    DEVICES,
    GPU_CODEC_BYTES_PER_S,
    GPU_COPY_PASSES,
    GPU_MEMORY_BYTES_PER_S,
    INTRA_NODE_GBPS,
    LINKS,
    PLAN_HOOKS,
    POWERSGD_SETTLED_RANK,
    POWERSGD_START_RANK,
    Link,
    codec_rate,
    estimate_hooks,
    parse_count,
    recommend,
    resolve_link,
)
from lightning_ddpopt.units import byte_unit, format_bytes

__all__ = ["main"]

#: ``lightning_ddpopt.diagnosis.REPORT_NAME``, which imports torch: help and ``plan`` run without it.
REPORT_NAME = "ddpopt_report.json"


class CLIError(Exception):
    """Bad input: printed as one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ddpopt``; returns the exit status."""
    parser = _parser()
    if not (sys.argv[1:] if argv is None else list(argv)):
        parser.print_help()  # a bare `ddpopt`: what it can do, not a usage error
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except CLIError as error:
        print(f"ddpopt {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpopt", description="Plan and inspect data-parallel training.")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser(
        "plan",
        help="per-rank bytes, compression and allreduce time, scaling efficiency per comm hook, and a recommendation",
        description=(
            "Ring-allreduce lower bound t = 2(n-1)/n x S/B + 2(n-1) x latency for each comm hook, every rank on a "
            "link of bandwidth B; each rank sends 2(n-1)/n x the hook's payload S per step. Ends with a "
            "recommendation: the comm hook, flat or in two tiers, or DiLoCo and its H, and why."
        ),
        # The required arguments first, in the order they are checked; --link or --gbps is required too.
        usage=(
            "ddpopt plan --params COUNT (--world-size N | --nodes N --gpus-per-node M)\n"
            "                   (--link PRESET | --gbps GBIT) [options]"
        ),
    )
    # Required, but checked in _plan so that errors come in the order of the usage line.
    plan.add_argument("--params", help="parameter count, e.g. 100M, 1.3B (required)")
    plan.add_argument(
        "--world-size", type=int, metavar="N", help="number of data-parallel processes (or --nodes and --gpus-per-node)"
    )
    plan.add_argument(
        "--nodes", type=int, metavar="N", help="number of nodes; the world size is N x M (with --gpus-per-node M)"
    )
    plan.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="M",
        help="processes (GPUs) per node: --nodes 2 --gpus-per-node 8 is --world-size 16",
    )
    plan.add_argument("--link", choices=sorted(LINKS), type=str.lower, help="link preset (or --gbps)")
    plan.add_argument("--gbps", type=float, help="link bandwidth in Gbit/s (or --link)")
    plan.add_argument("--latency-us", type=float, help="per-message latency in microseconds (default: the preset's)")
    plan.add_argument(
        "--intra-gbps",
        type=float,
        help=f"with --nodes and --gpus-per-node: the link inside a node in Gbit/s (default {INTRA_NODE_GBPS:g}, "
        "PCIe 4.0 x16), for the two-tier sync's time",
    )
    plan.add_argument(
        "--hook", choices=PLAN_HOOKS, action="append", help=f"repeatable (default: {', '.join(DEFAULT_PLAN_HOOKS)})"
    )
    plan.add_argument(
        "--rank",
        type=int,
        help="a fixed PowerSGD rank, PowerSGDConfig(rank=R, max_error=None) (default: the default PowerSGD, whose rank "
        f"rises under its error bound, priced at rank {POWERSGD_START_RANK}, where it starts, and "
        f"{POWERSGD_SETTLED_RANK}, where it settled with AdamW)",
    )
    plan.add_argument("--width", type=int, default=4096, help="typical weight-matrix width for PowerSGD (4096)")
    plan.add_argument(
        "--step-compute-ms",
        type=float,
        help="forward+backward time of one step (needed for the efficiency and to weigh DiLoCo)",
    )
    plan.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        type=str.lower,
        help="what runs the backward pass and the compression: cpu (default: this project's 1-thread CPU rates, "
        f"{_codec_defaults()} GB/s) or gpu (estimated, not measured: memory-bound at an H100-class "
        f"{GPU_MEMORY_BYTES_PER_S / 1e12:g} TB/s, {_codec_defaults(rates=GPU_CODEC_BYTES_PER_S)} GB/s)",
    )
    plan.add_argument(
        "--codec-gb-per-s",
        type=float,
        metavar="GB_PER_S",
        help="GB (10^9 bytes) of fp32 gradient a hook's compression processes per second, for every hook that "
        "compresses: your device's measured rate, instead of --device's",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(run=_plan)

    names = commands.add_parser(
        "names",
        help="the strategy names this package registers with Lightning, or the closest to a misspelt one",
        description=(
            "Lists the names Trainer(strategy=...) and Fabric(strategy=...) take once lightning_ddpopt is imported. "
            "Given NAME, says whether it is one of them, or which it is closest to (Lightning's error for an unknown "
            "name lists none of these)."
        ),
    )
    names.add_argument("name", nargs="?", help="a strategy name to check, e.g. ddp_optimised_fp16")
    names.set_defaults(run=_names)

    report = commands.add_parser(
        "report",
        help="findings table and a PNG plot of a run",
        description=f"Reads {REPORT_NAME} (written by CommProfiler), prints its findings and plots it.",
    )
    report.add_argument("source", help=f"a {REPORT_NAME} file or a run directory holding one")
    report.add_argument("--out", help="PNG path (default: next to the report)")
    report.set_defaults(run=_report)

    lighthouse = commands.add_parser(
        "lighthouse",
        help="run torchft's Lighthouse, the quorum server of fault-tolerant islands (needs the [ft] extra)",
        description=(
            "Serves the quorum of a run with OptimizedDDPStrategy(fault_tolerance=FaultTolerance(...)) until Ctrl-C "
            "or SIGTERM. Every island's first rank must reach it: pass http://THIS_HOST:PORT as the islands' "
            "FaultTolerance(lighthouse=...) or TORCHFT_LIGHTHOUSE."
        ),
    )
    lighthouse.add_argument("--port", type=int, default=29510, help="port to listen on, all interfaces (29510)")
    lighthouse.add_argument(
        "--min-replicas", type=int, required=True, metavar="N", help="islands the first quorum waits for"
    )
    lighthouse.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long a quorum waits for live islands that have not asked yet (60000, torchft's default)",
    )
    lighthouse.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="an island silent this long is left out of the next quorum (5000)",
    )
    lighthouse.set_defaults(run=_lighthouse)
    return parser


def _codec_defaults(rates: dict[str, float] = CODEC_BYTES_PER_S) -> str:
    """Each compressing hook's rate in GB/s of fp32 gradient, as the plan prints them."""
    return ", ".join(f"{hook} {rates[hook] / 1e9:.3g}" for hook in PLAN_HOOKS if hook in rates)


def _plan(args: argparse.Namespace) -> int:
    try:
        if args.params is None:
            raise ValueError("--params is required: the model's parameter count, e.g. 100M or 1.3B")
        params = parse_count(args.params)
        if params < 1000:  # almost surely a missing suffix
            cleaned = args.params.strip()
            guess = f"did you mean {cleaned}M? " if cleaned.replace(".", "", 1).isdigit() else "too few for a model; "
            raise ValueError(
                f"--params {cleaned} reads as {params} parameters: {guess}give the count with its suffix, e.g. 350M "
                "or 1.3B"
            )
        world_size, ranks = _world_size(args)
        if args.link is not None and args.gbps is not None:
            raise ValueError(f"give --link or --gbps, not both (--link {args.link}, --gbps {args.gbps:g})")
        link = resolve_link(args.link, args.gbps, args.latency_us)
        if (args.rank is not None and args.rank < 1) or args.width < 1:
            raise ValueError(f"--rank {args.rank} and --width {args.width} must be at least 1")
        codec_gb_per_s = args.codec_gb_per_s
        if codec_gb_per_s is not None and not codec_gb_per_s > 0:
            raise ValueError(
                f"--codec-gb-per-s {codec_gb_per_s:g} must be positive: GB of fp32 gradient the compression "
                "processes per second"
            )
        compute_ms = args.step_compute_ms
        compute_s = None if compute_ms is None else compute_ms / 1e3
        codec_bytes_per_s = None if codec_gb_per_s is None else codec_gb_per_s * 1e9
        hooks = tuple(args.hook or DEFAULT_PLAN_HOOKS)
        tiers = _tiers(args)
        estimates = estimate_hooks(
            params,
            world_size,
            link,
            compute_s,
            powersgd_rank=args.rank,
            matrix_width=args.width,
            device=args.device,
            codec_bytes_per_s=codec_bytes_per_s,
            hooks=hooks,
            nodes=tiers,
        )
        advice = recommend(
            params, world_size, link, compute_s, nodes=tiers, device=args.device, codec_bytes_per_s=codec_bytes_per_s
        )
    except ValueError as error:
        raise CLIError(str(error)) from None
    codec_source = _codec_source(args.device, codec_gb_per_s)
    if args.json:
        payload = {
            "device": args.device,
            "codec_source": codec_source,
            "estimates": [dataclasses.asdict(e) for e in estimates],
            "recommendation": dataclasses.asdict(advice),
        }
        print(json.dumps(payload, indent=1))
        return 0
    compute = "compute unknown" if compute_ms is None else f"compute {compute_ms:g} ms/step"
    print(
        f"{params / 1e6:.1f}M fp32 parameters, {ranks}, {link.summary} "
        f"({link.bytes_per_s / 1e9:.3f} GB/s, {link.latency_s * 1e6:g} us), {compute}, on {args.device.upper()}s"
    )
    tiered = any(e.hierarchical_comm_s is not None for e in estimates)
    print(
        f"{'hook':<13}{'payload':>10}{'sent/rank/step':>16}{'codec ms':>10}{'comm ms':>10}"
        f"{'eff. no overlap':>17}{'eff. overlap':>14}" + (f"{'2-tier comm ms':>16}" if tiered else "")
    )
    for e in estimates:
        no_overlap = "-" if e.efficiency_no_overlap is None else f"{e.efficiency_no_overlap:.1%}"
        overlap = "-" if e.efficiency_full_overlap is None else f"{e.efficiency_full_overlap:.1%}"
        codec = "-" if e.codec_bytes_per_s is None else f"{e.codec_s * 1e3:.1f}"
        two_tier = "-" if e.hierarchical_comm_s is None else f"{e.hierarchical_comm_s * 1e3:.1f}"
        label = e.hook if e.powersgd_rank is None else f"{e.hook} r{e.powersgd_rank}"
        print(
            f"{label:<13}{format_bytes(e.payload_bytes):>10}{format_bytes(e.sent_bytes_per_rank):>16}"
            f"{codec:>10}{e.comm_s * 1e3:>10.1f}{no_overlap:>17}{overlap:>14}" + (f"{two_tier:>16}" if tiered else "")
        )
    notes = ["sent/rank/step: what each rank sends per step, 2(n-1)/n x the payload (the hook's compressed gradient)"]
    if tiered:
        notes.append(
            f"2-tier comm ms: hierarchical=True: fp32 inside each node at {args.intra_gbps:g} Gbit/s (--intra-gbps), "
            "the payload between nodes, 1/M of it per rank (PowerSGD: of the parameters), the node's M ranks sharing "
            "its link"
        )
    compressing = [hook for hook in hooks if hook in CODEC_BYTES_PER_S]
    if compressing:
        notes.append(_codec_note(compressing, args.device, codec_gb_per_s, args.rank))
    if "powersgd" in hooks:
        notes.append(_powersgd_note(args.rank))
    if compute_ms is None:
        notes.append("efficiency needs --step-compute-ms: one step's forward+backward time without communication")
    for note in notes:
        print("\n".join(textwrap.wrap(note, width=_WIDTH, subsequent_indent="  ", break_on_hyphens=False)))
    print(f"recommended: {advice.strategy}")
    why = textwrap.wrap(advice.reason, width=_WIDTH, initial_indent="  why: ", subsequent_indent="    ")
    print("\n".join(why + ([] if advice.needs is None else [f"  needs {advice.needs}"])))
    return 0


#: The plan's notes and recommendation are wrapped to this many columns, as its table is about as wide.
_WIDTH = 118


def _codec_source(device: str, codec_gb_per_s: float | None) -> str:
    """Where the codec rates come from, in words (the JSON's ``codec_source``)."""
    if codec_gb_per_s is not None:
        return f"given: {codec_gb_per_s:g} GB/s of fp32 gradient for every hook that compresses (--codec-gb-per-s)"
    if device == "gpu":
        return (
            f"estimated for an H100-class GPU, not measured: memory-bound, copy passes over the gradient at "
            f"{GPU_MEMORY_BYTES_PER_S / 1e12:g} TB/s"
        )
    return (
        "this project's 1-thread CPU rates: int8's and PowerSGD's measured (PowerSGD at rank 4, its products scaled "
        "to other ranks), fp16's and bf16's memory-bound from a measured copy"
    )


def _codec_note(hooks: Sequence[str], device: str, codec_gb_per_s: float | None, rank: int | None) -> str:
    if codec_gb_per_s is not None:
        return f"codec ms: the compression's own compute at {codec_gb_per_s:g} GB/s of fp32 gradient (--codec-gb-per-s)"
    if device == "gpu":
        passes = ", ".join(
            f"{hook} {GPU_COPY_PASSES[hook]:g} passes: {GPU_CODEC_BYTES_PER_S[hook] / 1e9:.3g}" for hook in hooks
        )
        return (
            "codec ms: the compression's own compute, estimated for a GPU, not measured: memory-bound, each hook's "
            f"copy passes over the fp32 gradient at an H100-class {GPU_MEMORY_BYTES_PER_S / 1e12:g} TB/s, in GB/s of "
            f"fp32 gradient ({passes}); give a measured rate with --codec-gb-per-s"
        )
    rates = [f"{hook} {CODEC_BYTES_PER_S[hook] / 1e9:.3g}" for hook in hooks if hook != "powersgd"]
    scaled = ""
    if "powersgd" in hooks:
        ranks = (POWERSGD_START_RANK, POWERSGD_SETTLED_RANK) if rank is None else (rank,)
        rates.append("powersgd " + ", ".join(f"{_gb(codec_rate('powersgd', 'cpu', r))} at rank {r}" for r in ranks))
        if ranks != (POWERSGD_START_RANK,):
            scaled = f"; PowerSGD measured at rank {POWERSGD_START_RANK}, its products scaled with the rank"
    return (
        "codec ms: the compression's own compute at this project's 1-thread CPU rates, in GB/s of fp32 gradient "
        f"({', '.join(rates)}{scaled}); give your device's with --codec-gb-per-s"
    )


def _gb(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{bytes_per_s / 1e9:.3g}"


def _powersgd_note(rank: int | None) -> str:
    if rank is not None:
        return f"powersgd r{rank}: a fixed rank (--rank {rank}: PowerSGDConfig(rank={rank}, max_error=None))"
    return (
        f"powersgd r{POWERSGD_START_RANK}, r{POWERSGD_SETTLED_RANK}: the default PowerSGD starts at rank "
        f"{POWERSGD_START_RANK} and doubles a matrix's rank while its error is above its bound, up to "
        f"{POWERSGD_SETTLED_RANK}: priced at both ends (in this project's runs the matrices settled at ranks 32-64 "
        "with AdamW, at 8 with SGD: the comm-hooks guide); --rank R prices a fixed rank"
    )


def _tiers(args: argparse.Namespace) -> tuple[int, int, Link] | None:
    """``(nodes, ranks per node, intra-node link)`` for the two-tier estimate; ``None`` for a flat world."""
    if args.nodes is None or args.gpus_per_node is None:
        if args.intra_gbps is not None:
            raise ValueError(
                f"--intra-gbps {args.intra_gbps:g} needs --nodes and --gpus-per-node: the link inside a node of a "
                "two-tier sync"
            )
        return None
    if args.intra_gbps is None:
        args.intra_gbps = INTRA_NODE_GBPS
    if not args.intra_gbps > 0:
        raise ValueError(f"--intra-gbps {args.intra_gbps:g} must be positive: the link inside a node in Gbit/s")
    intra = Link("intra", args.intra_gbps * 1e9 / 8, 5e-6, f"{args.intra_gbps:g} Gbit/s inside the node")
    return args.nodes, args.gpus_per_node, intra


def _world_size(args: argparse.Namespace) -> tuple[int, str]:
    """The world size from --world-size or --nodes x --gpus-per-node, and how the table's first line says it."""
    nodes, per_node, world_size = args.nodes, args.gpus_per_node, args.world_size
    if nodes is not None and per_node is None:
        raise ValueError(f"--nodes {nodes} needs --gpus-per-node M too (world size {nodes} x M), or --world-size alone")
    if per_node is not None and nodes is None:
        raise ValueError(
            f"--gpus-per-node {per_node} needs --nodes N too (world size N x {per_node}), or --world-size alone"
        )
    if nodes is None:
        if world_size is None:
            raise ValueError(
                "--world-size is required (or --nodes and --gpus-per-node): the number of data-parallel processes"
            )
        given = f"--world-size {world_size}"
    else:
        for name, value in (("--nodes", nodes), ("--gpus-per-node", per_node)):
            if value < 1:
                raise ValueError(f"{name} {value} must be at least 1")
        if world_size is not None and world_size != nodes * per_node:
            raise ValueError(
                f"--world-size {world_size} disagrees with --nodes {nodes} x --gpus-per-node {per_node} = "
                f"{nodes * per_node}: give --world-size {nodes * per_node} or leave it out"
            )
        world_size = nodes * per_node
        given = f"--nodes {nodes} x --gpus-per-node {per_node} = {world_size}"
    if world_size < 1:
        raise ValueError(f"{given} must be at least 1")
    if world_size == 1:
        raise ValueError(f"{given}: one process syncs nothing and sends nothing; plan for 2 or more")
    ranks = f"{world_size} ranks" if nodes is None else f"{world_size} ranks ({nodes} nodes x {per_node} per node)"
    return world_size, ranks


def _names(args: argparse.Namespace) -> int:
    registered = {
        name: ", ".join(f"{key}={value!r}" for key, value in arguments.items())
        for name, arguments in strategy_names().items()
    }
    if args.name is None:
        for name, arguments in registered.items():
            print(f"{name:<28}OptimizedDDPStrategy({arguments})")
        return 0
    if args.name in registered:
        print(f"{args.name!r} is registered: OptimizedDDPStrategy({registered[args.name]})")
        return 0
    close = difflib.get_close_matches(args.name.lower(), registered, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"the names are {', '.join(registered)}"
    raise CLIError(f"{args.name!r} is not a strategy name of lightning_ddpopt; {hint}")


def _lighthouse(args: argparse.Namespace) -> int:
    for flag, value, minimum in (
        ("--port", args.port, 0),
        ("--min-replicas", args.min_replicas, 1),
        ("--join-timeout-ms", args.join_timeout_ms, 0),
        ("--heartbeat-timeout-ms", args.heartbeat_timeout_ms, 1),
    ):
        if value < minimum or (flag == "--port" and value > 65535):
            raise CLIError(f"{flag} {value} must be >= {minimum}" + (" and <= 65535" if flag == "--port" else ""))
    from lightning_ddpopt.fault_tolerance.lighthouse import serve

    try:
        serve(
            args.port,
            args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            say=lambda line: print(line, flush=True),
        )
    except ImportError as error:
        raise CLIError(str(error)) from error
    return 0


def _report(args: argparse.Namespace) -> int:
    from lightning_ddpopt.diagnosis import Finding, format_findings

    path = _find_report(Path(args.source))
    try:
        payload = json.loads(path.read_text())
        findings = [Finding(**finding) for finding in payload["findings"]]
        series = payload["series"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise CLIError(f"{path} is not a ddpopt report ({type(error).__name__}: {error})") from None
    print(format_findings(findings))
    out = Path(args.out) if args.out else path.with_suffix(".png")
    _plot(series, out)
    print(f"plot: {out}")
    return 0


def _find_report(source: Path) -> Path:
    if source.is_file():
        return source
    if source.is_dir():
        found = sorted(source.rglob(REPORT_NAME), key=lambda p: p.stat().st_mtime)
        if len(found) > 1:
            others = ", ".join(str(p) for p in reversed(found[:-1]))
            print(
                f"ddpopt report: {len(found)} reports under {source}; reading the newest, {found[-1]} (the others, "
                f"newest first: {others})",
                file=sys.stderr,
            )
        if found:
            return found[-1]
        raise CLIError(f"no {REPORT_NAME} under {source}")
    raise CLIError(f"{source} does not exist")


def _plot(series: dict[str, dict[str, list[Any]]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("plotting needs matplotlib: pip install 'lightning-ddpopt[plot]'") from None
    sent = [v for data in series.values() for v in data.get("bytes_sent", []) if v is not None]
    scale, unit = byte_unit(max(sent, default=0.0))
    panels = [
        ("step_time_ms", "step time (ms)"),
        ("sync_time_ms", "sync span (ms)"),
        ("exposed_time_ms", "exposed sync (ms)"),
        ("bytes_sent", f"{unit} sent"),
    ]
    measured = any(
        v is not None and math.isfinite(v) for data in series.values() for v in data.get("compression_error", [])
    )
    if measured:  # a lossy hook measured its error on a sample of the steps
        panels.append(("compression_error", "compression error"))
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 2 + 2 * len(panels)), sharex=True)
    for axis, (key, label) in zip(axes, panels, strict=True):
        for rank, data in sorted(series.items(), key=lambda item: int(item[0])):
            values = [math.nan if v is None else v for v in data.get(key, [])]
            if key == "bytes_sent":
                values = [v / scale for v in values]
            steps = data.get("step", [])[: len(values)]
            if key == "compression_error":  # sampled steps only: points joined across the gaps
                points = [(step, v) for step, v in zip(steps, values, strict=False) if math.isfinite(v)]
                axis.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}", linewidth=1, marker=".")
                continue
            axis.plot(steps, values, label=f"rank {rank}", linewidth=1)
        positive = any(v > 0 for data in series.values() for v in data.get(key, []) if v is not None)
        # The first steps' one-time work (kernels compiled, buckets rebuilt) is 10-100x a step: a log axis keeps the
        # rest readable; a panel with nothing above zero (no sync measured) keeps its linear axis.
        if key.endswith("_ms") and positive:
            axis.set_yscale("log")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("optimizer step")
    what = "step time, sync span and its exposed part, bytes" + (" and compression error" if measured else "")
    figure.suptitle(f"ddpopt: per-rank {what} per optimizer step")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
