"""The ``ddpopt`` command: ``plan`` (cost model) and ``report`` (findings and a plot of a run)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_ddpopt.costmodel import DEFAULT_PLAN_HOOKS, LINKS, PLAN_HOOKS, estimate_hooks, parse_count, resolve_link
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
        help="bytes per step, ring-allreduce time and scaling efficiency per comm hook",
        description="Ring-allreduce lower bound t = 2(n-1)/n x S/B + 2(n-1) x latency for each comm hook.",
        # The required arguments first, in the order they are checked; --link or --gbps is required too.
        usage="ddpopt plan --params COUNT --world-size N (--link PRESET | --gbps GBIT) [options]",
    )
    # Required, but checked in _plan so that errors come in the order of the usage line.
    plan.add_argument("--params", help="parameter count, e.g. 100M, 1.3B (required)")
    plan.add_argument("--world-size", type=int, help="number of data-parallel processes (required)")
    plan.add_argument("--link", choices=sorted(LINKS), type=str.lower, help="link preset (or --gbps)")
    plan.add_argument("--gbps", type=float, help="link bandwidth in Gbit/s (or --link)")
    plan.add_argument("--latency-us", type=float, help="per-message latency in microseconds (default: the preset's)")
    plan.add_argument(
        "--hook", choices=PLAN_HOOKS, action="append", help=f"repeatable (default: {', '.join(DEFAULT_PLAN_HOOKS)})"
    )
    plan.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    plan.add_argument("--width", type=int, default=4096, help="typical weight-matrix width for PowerSGD (4096)")
    plan.add_argument(
        "--step-compute-ms", type=float, help="forward+backward time of one step (needed for the efficiency)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(run=_plan)

    report = commands.add_parser(
        "report",
        help="findings table and a PNG plot of a run",
        description=f"Reads {REPORT_NAME} (written by CommProfiler), prints its findings and plots it.",
    )
    report.add_argument("source", help=f"a {REPORT_NAME} file or a run directory holding one")
    report.add_argument("--out", help="PNG path (default: next to the report)")
    report.set_defaults(run=_report)
    return parser


def _plan(args: argparse.Namespace) -> int:
    try:
        if args.params is None:
            raise ValueError("--params is required: the model's parameter count, e.g. 100M or 1.3B")
        params = parse_count(args.params)
        if args.world_size is None:
            raise ValueError("--world-size is required: the number of data-parallel processes")
        if args.world_size < 1:
            raise ValueError(f"--world-size {args.world_size} must be at least 1")
        if args.world_size == 1:
            raise ValueError("--world-size 1: one process syncs nothing and sends nothing; plan for 2 or more")
        if args.link is not None and args.gbps is not None:
            raise ValueError(f"give --link or --gbps, not both (--link {args.link}, --gbps {args.gbps:g})")
        link = resolve_link(args.link, args.gbps, args.latency_us)
        if args.rank < 1 or args.width < 1:
            raise ValueError("--rank and --width must be at least 1")
        compute_ms = args.step_compute_ms
        estimates = estimate_hooks(
            params,
            args.world_size,
            link,
            None if compute_ms is None else compute_ms / 1e3,
            powersgd_rank=args.rank,
            matrix_width=args.width,
            hooks=tuple(args.hook or DEFAULT_PLAN_HOOKS),
        )
    except ValueError as error:
        raise CLIError(str(error)) from None
    if args.json:
        print(json.dumps([e.__dict__ for e in estimates], indent=1))
        return 0
    compute = "compute unknown" if compute_ms is None else f"compute {compute_ms:g} ms/step"
    print(
        f"{params / 1e6:.1f}M fp32 parameters, {args.world_size} ranks, {link.summary} "
        f"({link.bytes_per_s / 1e9:.3f} GB/s, {link.latency_s * 1e6:g} us), {compute}"
    )
    print(f"{'hook':<10}{'sent/step':>12}{'comm ms':>12}{'eff. no overlap':>18}{'eff. overlap':>15}")
    for e in estimates:
        no_overlap = "-" if e.efficiency_no_overlap is None else f"{e.efficiency_no_overlap:.1%}"
        overlap = "-" if e.efficiency_full_overlap is None else f"{e.efficiency_full_overlap:.1%}"
        sent = format_bytes(e.bytes_per_step)
        print(f"{e.hook:<10}{sent:>12}{e.comm_s * 1e3:>12.1f}{no_overlap:>18}{overlap:>15}")
    if compute_ms is None:
        print("efficiency needs --step-compute-ms: one step's forward+backward time without communication")
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
    panels = [("step_time_ms", "step time (ms)"), ("sync_time_ms", "sync time (ms)"), ("bytes_sent", f"{unit} sent")]
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
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("optimizer step")
    what = "step time, sync time, bytes" + (" and compression error" if measured else "")
    figure.suptitle(f"ddpopt: per-rank {what} per optimizer step")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
