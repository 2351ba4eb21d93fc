"""Work lost to a lost island: fault-tolerant islands against a restart of the whole job from its checkpoint.

Three emulated hosts (network namespaces on a shaped link, as ``benchmarks/cluster.py`` makes them), one island
(one rank) per host, ``tests/ft_worker.py``'s model paced to ``--step-seconds`` a step, ``--steps`` steps. Three runs:

- ``no_fault``: the fault-tolerant run with nothing killed (the reference);
- ``fault_tolerant``: island 1 killed with SIGKILL at ``--kill-at`` and started again at once: the other two train
  on, and it heals from them;
- ``job_no_fault``: the same three hosts as one DDP job, ``OptimizedDDPStrategy`` without fault tolerance (its
  reference: no quorum a step);
- ``checkpoint_restart``: that job with a checkpoint every ``--checkpoint-every`` steps; host 1 killed at
  ``--kill-at``, the job dies, and all three are started again from the last checkpoint.

Reported for each: the wall time to the last step, and the work lost: island-steps of samples that never reached a
committed step (a fault-tolerant step counts the islands absent from its quorum; a restart counts the steps done
again after the checkpoint on every host), and island-seconds (the wall time over its kind's run without a fault,
times the islands).

Run:  .venv/bin/python benchmarks/fault_tolerance.py [--steps 120] [--kill-at 70] [--rounds 3]

As root with iproute2 the hosts are shaped network namespaces (``--loopback``: every island on this machine's
loopback instead). ``--rounds N`` repeats the four runs N times, in reverse order every other round, and reports
each figure's median with the rounds' values.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Cluster, can_emulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _start(cluster: Cluster, island: int, out: Path, args: argparse.Namespace, *options: str) -> subprocess.Popen:
    host = cluster.hosts[island]
    command = [sys.executable, "-m", "tests.ft_worker", str(island), f"http://{cluster.hosts[0].address}:29510"]
    # The whole job's nodes all use node 0's port; each island its own (alone in its namespace, any would do).
    port = 29600 if "--whole-job" in options else 29600 + island
    command += [str(port), str(out), "--max-steps", str(args.steps), "--step-seconds", str(args.step_seconds)]
    command += ["--islands", str(args.islands), "--devices", str(args.devices)]
    command += [*options]
    env = dict(os.environ)
    if host.namespace is not None:
        command = ["ip", "netns", "exec", host.namespace, *command]
        env["GLOO_SOCKET_IFNAME"] = host.interface  # gloo's own address lookup would find a loopback one
    log = (out / f"log{island}.txt").open("a")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    cluster.running.append(process)
    return process


def _step(out: Path, island: int) -> int:
    path = out / f"island{island}.step"
    text = path.read_text() if path.exists() else ""
    return int(text) if text else 0


def _kill_at(process: subprocess.Popen, out: Path, island: int, step: int) -> float:
    while _step(out, island) < step:
        if process.poll() is not None:
            raise RuntimeError(f"island {island} ended before step {step}: {(out / f'log{island}.txt').read_text()}")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return time.monotonic()


def run_fault_tolerant(
    cluster: Cluster, out: Path, args: argparse.Namespace, kill: bool, compression: str = "fp32"
) -> dict[str, Any]:
    out.mkdir(parents=True)
    lighthouse_cmd = [sys.executable, "-m", "lightning_ddpopt.cli", "lighthouse", "--port", "29510"]
    lighthouse_cmd += ["--min-replicas", "2", "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "20000"]
    namespace = cluster.hosts[0].namespace
    if namespace is not None:
        lighthouse_cmd = ["ip", "netns", "exec", namespace, *lighthouse_cmd]
    # Into a file: a pipe nobody reads would stop the Lighthouse once full.
    log = out / "lighthouse.txt"
    lighthouse = subprocess.Popen(lighthouse_cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    cluster.running.append(lighthouse)
    while "Lighthouse at" not in log.read_text():  # serving
        time.sleep(0.05)
    started = time.monotonic()
    across = ("--ft-compression", compression)
    islands = [
        _start(cluster, i, out, args, "--address", cluster.hosts[i].address, *across) for i in range(args.islands)
    ]
    downtime = 0.0
    if kill:
        killed = _kill_at(islands[1], out, 1, args.kill_at)
        islands[1] = _start(cluster, 1, out, args, "--address", cluster.hosts[1].address, *across)
        while _step(out, 1) <= args.kill_at and islands[1].poll() is None:
            time.sleep(0.01)
        downtime = time.monotonic() - killed
    for island in islands:
        island.wait()
    wall = time.monotonic() - started
    lighthouse.send_signal(signal.SIGTERM)
    lighthouse.wait()
    results = [torch.load(out / f"island{i}_rank0.pt") for i in range(args.islands)]
    history = results[0]["stats"]["history"]
    # Participants per committed step, from the quorum's size at each change: the absent islands' samples are lost.
    absent = 0
    for (step, participants), following in zip(history, [*history[1:], (args.steps + 1, 0)], strict=True):
        absent += (args.islands - participants) * (following[0] - step)
    equal = all(
        torch.equal(results[0]["parameters"][name], result["parameters"][name])
        for result in results
        for name in result["parameters"]
    )
    return {
        "wall_s": wall,
        "lost_island_steps": absent,
        "island_down_s": downtime,
        "parameters_equal": equal,
        "quorum_sizes": history,
    }


def run_checkpoint_restart(
    cluster: Cluster, out: Path, args: argparse.Namespace, kill: bool, stock: bool = False
) -> dict[str, Any]:
    out.mkdir(parents=True)
    options: tuple[str, ...] = ("--address", cluster.hosts[0].address, "--whole-job", str(args.islands))
    options += ("--stock",) if stock else ()
    options += ("--checkpoint-every", str(args.checkpoint_every))
    started = time.monotonic()
    hosts = [_start(cluster, i, out, args, *options) for i in range(args.islands)]
    if not kill:
        for host in hosts:
            if host.wait() != 0:
                raise RuntimeError(f"the job failed: {(out / 'log0.txt').read_text()[-3000:]}")
        return {"wall_s": time.monotonic() - started, "lost_island_steps": 0}
    killed = _kill_at(hosts[1], out, 0, args.kill_at)  # host 0 writes the job's step
    for host in hosts:
        try:
            host.wait(timeout=120)  # the others fail once their peer is gone
        except subprocess.TimeoutExpired:  # a scheduler would end the job: so does this
            host.kill()
            host.wait()
    died = time.monotonic() - killed
    hosts = [_start(cluster, i, out, args, *options) for i in range(args.islands)]
    for host in hosts:
        if host.wait() != 0:
            raise RuntimeError(f"the restarted job failed: {(out / 'log0.txt').read_text()[-3000:]}")
    wall = time.monotonic() - started
    redone = args.kill_at - (args.kill_at // args.checkpoint_every) * args.checkpoint_every
    return {"wall_s": wall, "lost_island_steps": redone * args.islands, "job_died_after_s": died}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=180)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="each step's pacing: its compute")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--loopback", action="store_true", help="every island on this machine's loopback, unshaped")
    parser.add_argument("--rounds", type=int, default=1, help="the runs this many times, interleaved")
    parser.add_argument(
        "--ft-compression",
        choices=("fp16", "bf16"),
        help="also run no_fault_<this>: the fault-tolerant run without a fault, its gradients across in this",
    )
    parser.add_argument("--islands", type=int, default=3, help="emulated hosts, an island each")
    parser.add_argument("--devices", type=int, default=1, help="ranks per island (and per node of the whole job)")
    parser.add_argument("--runs", help="only these runs, comma-separated (default: all but stock_no_fault)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="fault_tolerance")
    args = parser.parse_args()
    reason = "--loopback" if args.loopback else can_emulate()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"ddpopt-ft-{os.getpid()}"
    runs = {
        "no_fault": lambda cluster, path: run_fault_tolerant(cluster, path, args, kill=False),
        "fault_tolerant": lambda cluster, path: run_fault_tolerant(cluster, path, args, kill=True),
        "job_no_fault": lambda cluster, path: run_checkpoint_restart(cluster, path, args, kill=False),
        "checkpoint_restart": lambda cluster, path: run_checkpoint_restart(cluster, path, args, kill=True),
        "stock_no_fault": lambda cluster, path: run_checkpoint_restart(cluster, path, args, kill=False, stock=True),
    }
    references = {
        "no_fault": "no_fault",
        "fault_tolerant": "no_fault",
        "job_no_fault": "job_no_fault",
        "checkpoint_restart": "job_no_fault",
        "stock_no_fault": "stock_no_fault",
    }
    if args.ft_compression:
        compressed = f"no_fault_{args.ft_compression}"
        runs[compressed] = lambda cluster, path: run_fault_tolerant(cluster, path, args, False, args.ft_compression)
        references[compressed] = "no_fault"
    if args.runs:
        runs = {name: run for name, run in runs.items() if name in args.runs.split(",")}
    else:
        runs.pop("stock_no_fault")
        missing = {references[name] for name in runs} - set(runs)
        if missing:
            parser.error(f"--runs needs {', '.join(sorted(missing))} too: the runs are compared with it")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    with Cluster(args.islands, args.rate, loopback=reason is not None) as cluster:
        link = "loopback (unshaped)" if reason else f"{args.rate} shaped link between namespaces"
        print(
            f"fault tolerance: {args.islands} hosts on {link}; {args.steps} steps, {args.rounds} round(s)", flush=True
        )
        for index in range(args.rounds):
            for name in list(runs) if index % 2 == 0 else list(reversed(runs)):
                rounds[name].append(runs[name](cluster, work / f"round{index}" / name))
                print(f"  round {index} {name} {rounds[name][-1]['wall_s']:.1f} s", flush=True)
    # Each run against its own kind's run without a fault (the whole job has no quorum to ask every step), per round.
    lines = [
        f"Fault tolerance: {args.islands} emulated hosts on {link}, one island ({args.devices} rank(s)) each, "
        f"{args.steps} steps of "
        f"{args.step_seconds * 1e3:g} ms compute"
        + (f", island 1 lost at step {args.kill_at}" if "fault_tolerant" in rounds else "")
        + (
            f"; checkpoints every {args.checkpoint_every} steps for the restart"
            if "checkpoint_restart" in rounds
            else ""
        )
        + f"; medians of {args.rounds} round(s) (each round's values in brackets)",
        f"Command: `benchmarks/fault_tolerance.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}",
        "",
        "| run | wall s | over its run without a fault s | island-seconds lost | island-steps of samples lost |",
        "|---|---|---|---|---|",
    ]
    for name, results in rounds.items():
        walls = [r["wall_s"] for r in results]
        extras = [r["wall_s"] - ref["wall_s"] for r, ref in zip(results, rounds[references[name]], strict=True)]
        lost = [r["lost_island_steps"] for r in results]
        shown = ", ".join(f"{extra:+.1f}" for extra in extras)
        extra = statistics.median(extras)
        lines.append(
            f"| {name} | {statistics.median(walls):.1f} | {extra:+.1f} [{shown}] | "
            f"{max(extra, 0.0) * args.islands:.1f} | {statistics.median(lost):g} [{', '.join(map(str, lost))}] |"
        )
    if "fault_tolerant" in rounds:
        ft = rounds["fault_tolerant"]
        back = statistics.median([r["island_down_s"] for r in ft])
        lines += [
            "",
            f"The killed island was back in the quorum {back:.1f} s after it was "
            f"killed (median); the quorum's sizes (step, islands) in the first round: {ft[0]['quorum_sizes']}; every "
            f"island's parameters equal at the end of every round: {all(r['parameters_equal'] for r in ft)}.",
        ]
    if "job_no_fault" in rounds:
        # The quorum's price: each fault-tolerant run without a fault against the plain job of the same round.
        for name in (name for name in rounds if name.startswith("no_fault")):
            ratios = [r["wall_s"] / job["wall_s"] for r, job in zip(rounds[name], rounds["job_no_fault"], strict=True)]
            shown = ", ".join(f"{ratio:.2f}" for ratio in ratios)
            lines.append(f"\n{name} / job_no_fault wall time: {statistics.median(ratios):.2f}x (rounds: {shown}).")
    if "stock_no_fault" in rounds:  # against Lightning's stock DDPStrategy as one job of the same hosts
        for name in (name for name in rounds if name.endswith("no_fault") and name != "stock_no_fault"):
            ratios = [r["wall_s"] / s["wall_s"] for r, s in zip(rounds[name], rounds["stock_no_fault"], strict=True)]
            shown = ", ".join(f"{ratio:.2f}" for ratio in ratios)
            lines.append(f"\n{name} / stock_no_fault wall time: {statistics.median(ratios):.2f}x (rounds: {shown}).")
    out = Path(args.out)
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
