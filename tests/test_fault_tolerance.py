"""Fault-tolerant islands on torchft: a Lighthouse, islands as separate jobs, one killed with SIGKILL and healed back.

Each island is a Lightning job of its own (``tests/ft_worker.py``, one rank), as on a cluster where islands are
independent jobs. Needs the ``[ft]`` extra (torchft, torch >= 2.7): those tests skip without it; the argument checks
run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_ddpopt import LocalSGDConfig, OptimizedDDPStrategy
from lightning_ddpopt.cli import main as ddpopt
from lightning_ddpopt.fabric import OptimizedDDPStrategy as FabricStrategy
from lightning_ddpopt.fault_tolerance import FaultTolerance, config
from lightning_ddpopt.fault_tolerance.replica import Replica, ReplicaStats
from lightning_ddpopt.units import format_bytes
from tests import ft_fabric_worker, ft_worker
from tests.helpers import needs_torchft

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _island(index: int, lighthouse: str, out: Path, max_steps: int, log: Path, *options: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.ft_worker", str(index), lighthouse, str(_free_port()), str(out)]
    with log.open("a") as sink:
        return subprocess.Popen(
            [*command, "--max-steps", str(max_steps), *options], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT
        )


def _step(out: Path, index: int) -> int:
    text = (out / f"island{index}.step").read_text() if (out / f"island{index}.step").exists() else ""
    return int(text) if text else 0


def _kill_with_its_processes(island: subprocess.Popen) -> None:
    """SIGKILL a process and every process under it at once, as a lost machine goes (torchrun's ranks run in sessions
    of their own: a signal to the agent's group does not reach them)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    doomed, grown = {island.pid}, True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in doomed} - doomed
        doomed |= more
        grown = bool(more)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lose_one_and_heal_it(
    out: Path,
    lost: int,
    start: Callable[[int, str, Path], subprocess.Popen],
    kill: Callable[[subprocess.Popen], None],
    inside_collective: bool = False,
) -> list[int]:
    """A Lighthouse and three islands (``start(index, lighthouse, log)``); island ``lost`` is killed at step 8, the
    others go on and wait at step 20 until it is restarted under its name; every island must end with exit code 0.
    Returns the islands that stayed.

    ``inside_collective``: killed inside step 9's cross-island average rather than between steps: one other island
    holds before the average while ``lost`` and the third are inside it (waiting for the one held), and is let go
    once ``lost`` is dead (``tests/ft_worker.py``'s ``hold_collective``).
    """
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000)
    logs = [out / f"log{i}.txt" for i in range(3)]

    def tails() -> str:
        return "\n".join(f"--- island {i}:\n{log.read_text()[-3000:]}" for i, log in enumerate(logs) if log.exists())

    try:
        # Every island waits at its start until all three are up, so that the first quorum holds all three (a slow
        # start would otherwise join later, healing, and the quorum would be 2 before the loss as well).
        (out / "hold_start").write_text("")
        islands = [start(i, lighthouse.address(), logs[i]) for i in range(3)]
        deadline = time.monotonic() + 120
        while not all((out / f"island{i}.started").exists() for i in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in islands), tails()
            time.sleep(0.05)
        others = [i for i in range(3) if i != lost]
        if inside_collective:
            (out / "hold_collective").write_text(f"8 {others[1]}")
        (out / "hold_start").unlink()
        if inside_collective:
            inside = [out / f"island{i}.averaging" for i in (lost, others[0])]
            while not all(path.exists() for path in inside):
                assert time.monotonic() < deadline and all(p.poll() is None for p in islands), tails()
                time.sleep(0.01)
            time.sleep(0.5)  # both are in the all-reduce now, waiting for the held island
        while _step(out, lost) < 8:
            assert time.monotonic() < deadline and islands[lost].poll() is None, tails()
            time.sleep(0.02)
        kill(islands[lost])
        islands[lost].wait()
        (out / "hold_collective").unlink(missing_ok=True)
        killed_at = _step(out, lost)
        # The others train on without it (the Lighthouse drops it after a second without heartbeats), then wait at
        # step 20 until it is back: both modes then have live islands to heal from, however long the start takes.
        (out / "hold").write_text("20")
        while min(_step(out, i) for i in others) < killed_at + 8:
            assert time.monotonic() < deadline and all(islands[i].poll() is None for i in others), tails()
            time.sleep(0.02)
        (out / f"island{lost}.started").unlink()
        islands[lost] = start(lost, lighthouse.address(), logs[lost])
        while not (out / f"island{lost}.started").exists():
            assert time.monotonic() < deadline and islands[lost].poll() is None, tails()
            time.sleep(0.05)
        (out / "hold").unlink()
        codes = [island.wait(timeout=180) for island in islands]
        assert codes == [0, 0, 0], tails()
    finally:
        lighthouse.shutdown()
    return others


MODES = {
    # Each step's gradients averaged across the islands in bf16, each step a commit point; islands of one rank.
    "every_step": ("1", "0", "allreduce", "bf16"),
    # The same with islands of two ranks syncing through PowerSGD: rank r of each island meets rank r of the others
    # (torchft's first quorum gives each rank another island's state, the island's first rank realigns them after
    # the first step).
    "every_step_2ranks": ("2", "0", "powersgd", "fp32"),
    # DiLoCo every 4 steps across the islands, each sync the commit point; islands of two ranks (each rank carries
    # its half of the change across, with the same rank of the other islands).
    "diloco": ("2", "4", "allreduce", "fp32"),
    # Islands of three ranks started by Lightning's spawn launcher, PowerSGD inside, fp16 AMP with a GradScaler whose
    # loss overflows on island 0 at its 5th batch: the average is inf on every island, and every GradScaler skips.
    "every_step_3ranks_spawn_fp16": ("3", "0", "powersgd", "fp32"),
}
EXTRA = {"every_step_3ranks_spawn_fp16": ("--start-method", "spawn", "--fp16", "--overflow-at", "5")}


def _shard(rank: int, ranks: int, epoch: int, samples: int = ft_worker.SAMPLES) -> list[int]:
    """The samples of a worker's data that rank ``rank`` of a run of ``ranks`` draws in ``epoch``."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(samples), num_replicas=ranks, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@needs_torchft
@pytest.mark.parametrize(
    ("mode", "lost", "inside_collective"),
    [
        pytest.param("every_step", 2, True, id="every_step-island2-inside_collective"),
        pytest.param("every_step_2ranks", 0, False, id="every_step_2ranks-island0", marks=pytest.mark.slow),
        pytest.param("diloco", 1, False, id="diloco-island1", marks=pytest.mark.slow),
        pytest.param("every_step_3ranks_spawn_fp16", 1, False, id="3ranks-spawn-fp16-island1", marks=pytest.mark.slow),
    ],
)
def test_a_killed_island_heals_back_and_every_island_ends_equal(tmp_path, mode, lost, inside_collective):
    # Three islands, each the same script, seed and dataset (shuffled), its index in REPLICA_GROUP_ID; one is killed
    # with SIGKILL at step 8 (between two steps, or inside step 9's cross-island average), the other two go on
    # without it, it is started again under its name and heals from a live island: every island ends at step 30
    # with the same parameters, and the two that stayed dropped nothing but the step the kill broke. Every island
    # trained on its own shard of the data, and the returning one went on at the others' epoch and position. The
    # first island (which torchft's first quorum made the others' source) is lost as well as another.
    max_steps = 30
    devices, sync_every, hook, across = MODES[mode]
    options = ("--devices", devices, "--local-sgd", sync_every, "--comm-hook", hook, "--ft-compression", across)
    options += EXTRA.get(mode, ())

    def start(index: int, lighthouse: str, log: Path) -> subprocess.Popen:
        return _island(index, lighthouse, tmp_path, max_steps, log, *options)

    kill = lambda island: island.send_signal(signal.SIGKILL)  # noqa: E731
    others = _lose_one_and_heal_it(tmp_path, lost, start, kill, inside_collective=inside_collective)
    ranks = range(int(devices))
    results = [[torch.load(tmp_path / f"island{i}_rank{r}.pt") for r in ranks] for i in range(3)]
    assert [r["global_step"] for island in results for r in island] == [max_steps] * 3 * len(ranks)
    reference = results[others[0]][0]["parameters"]
    for result in (r for island in results for r in island):
        assert all(torch.equal(reference[name], value) for name, value in result["parameters"].items())
    # Each rank of each island trained on its shard of the run's data (3 x devices shards): the batch of each step
    # is the shard's at that epoch and position, also on the returning island after its heal (its first batch, the
    # heal's step, counts as zeros). The islands that stayed drew disjoint samples in their first epoch.
    per_epoch = ft_worker.SAMPLES // (3 * len(ranks) * 8)
    for index, island in enumerate(results):
        for rank, result in enumerate(island):
            samples = result["samples"][1:] if index == lost else result["samples"]
            assert samples and samples[-1][0] == max_steps - 1
            for step, epoch, batch, indices in samples:
                assert (epoch, batch) == divmod(step, per_epoch), (index, rank, step)
                shard = _shard(index * len(ranks) + rank, 3 * len(ranks), epoch)
                assert indices == shard[8 * batch : 8 * batch + 8], (index, rank, step)
    early = min(8, per_epoch)  # steps of the first epoch, before the kill
    first = [i for index in others for r in results[index] for s, _, _, b in r["samples"] if s < early for i in b]
    assert len(first) == len(set(first)) == 2 * len(ranks) * early * 8
    # Both LR schedules came over with the heal: every island ends at the same LR, 0.05 x 0.9^(30 // 3) per step and
    # x 0.5 per epoch ended.
    # Under fp16 one overflow in the run (island 0's): every GradScaler skipped that step and halved its scale, the
    # healed island's too (its scaler came from a peer).
    scales = [r["scale"] for island in results for r in island]
    assert scales == ([2.0**9] * 3 * len(ranks) if "fp16" in mode else [None] * 3 * len(ranks))
    lrs = [r["lr"] for island in results for r in island]
    assert len(set(lrs)) == 1 and lrs[0] == pytest.approx(0.05 * 0.9**10 * 0.5 ** (max_steps // per_epoch))
    # The run's commits (torchft's count): every step but one the kill inside it broke, or every sync (DiLoCo: the
    # islands' join after the first step, a sync every 4 steps up to step 28, and the end of fit's average of the
    # last 2 steps).
    dropped = 1 if inside_collective else 0
    commits = max_steps - dropped if mode.startswith("every_step") else 1 + max_steps // int(sync_every) + 1
    assert [r["stats"]["step"] for island in results for r in island] == [commits] * 3 * len(ranks)
    for index in others:
        stats = results[index][0]["stats"]
        # Nothing dropped but the broken step, and no heal but the first quorum's (an island that joined it late
        # heals into it).
        assert stats["dropped"] == dropped and stats["heals"] <= 1
        # 3 islands, then 2 while the lost one was away, then 3 again.
        assert [n for _, n in stats["history"]][-3:] == [3, 2, 3]
    healed = results[lost][0]["stats"]
    assert healed["heals"] >= 1 and healed["participants"] == 3
    # What a user reads during the fault: one line for the dropped step, naming the island, the step and the error;
    # none of torchft's tracebacks and CPU notes, the checkpoint server's access log or torch's buffer warning (the
    # lost island's log from its restart: its other ranks' crash when it was killed is the kill's).
    for index in range(3):
        log = (tmp_path / f"log{index}.txt").read_text()
        if index == lost:
            log = log[log.rindex("GPU available:") :]
        for chatter in ("Traceback", "flight recorder", '"GET /checkpoint', "buffer is not writable"):
            assert chatter not in log, (index, chatter, log[-3000:])
    # Per step each rank of an island sent its 1/M of the gradients across (P values leave an island, not M x P).
    numel = sum(value.numel() for value in reference.values())
    if mode.startswith("every_step"):
        width = 2 if across in ("bf16", "fp16") else 4
        for index in others:
            for result in results[index]:
                stats = result["stats"]
                # One chunk (the model is under CHUNK_VALUES), each rank's shard padded to ceil(numel / M).
                assert stats["average_bytes"] == stats["averages"] * -(-numel // len(ranks)) * width
    for index in others:
        log_lines = (tmp_path / f"log{index}.txt").read_text().splitlines()
        dropped_lines = [line for line in log_lines if "dropped its commit" in line]
        assert len(dropped_lines) == dropped, dropped_lines
        if dropped:
            assert (
                f"ddpopt: island island{index} dropped its commit after commit 8: a collective failed"
                in (dropped_lines[0])
            )
    # Each island's report has the islands finding: the run's commits, and the restarted island's heal; an island
    # of one rank's network finding is what crossed the islands.
    for index in range(3):
        report = json.loads((tmp_path / f"island{index}" / "ddpopt_report.json").read_text())
        if len(ranks) == 1 and mode.startswith("every_step"):
            (network,) = [f for f in report["findings"] if f["area"] == "network"]
            wire = format_bytes(numel * (2 if across in ("bf16", "fp16") else 4))
            assert network["evidence"].startswith(f"across the islands: {wire} sent per average by each rank")
        (islands,) = [f for f in report["findings"] if f["area"] == "islands"]
        assert islands["evidence"].startswith(f"island island{index}: {commits} commits in the run")
        assert islands["status"] == "ok"
        if index == lost:
            assert f", healed {healed['heals']} time(s) (" in islands["evidence"]


@needs_torchft
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["every_step", "diloco"])
def test_fabric_islands_started_by_torchrun_lose_one_and_heal_it(tmp_path, mode):
    # Three Fabric loops of two ranks each, every one started by torchrun (the island a torchrun job, as on a
    # cluster), fp16 with a GradScaler and gradient clipping, the int8 hook inside each island, a Monitor attached;
    # per step, or DiLoCo every 4 steps. Per step, island 0's loss overflows at its 5th batch: the islands vote at the
    # clip, before it unscales, so the average is inf on every island and every GradScaler skips that step and halves
    # its scale. Island 1 is killed with its whole process tree (the torchrun agent and both ranks) at step 8,
    # restarted, and heals: the model, Adam's state, the GradScaler, the step count, local SGD's state and the LR
    # schedule (through the strategy's heal_state) come from a live island.
    max_steps, every_step = 30, mode == "every_step"

    def start(index: int, lighthouse: str, log: Path) -> subprocess.Popen:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        worker = ["-m", "tests.ft_fabric_worker", str(index), lighthouse, str(tmp_path), "--max-steps", str(max_steps)]
        options = (["--overflow-at", "5"] if index == 0 else []) if every_step else ["--local-sgd", "4"]
        with log.open("a") as sink:
            return subprocess.Popen(
                [*torchrun, *worker, *options], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )

    others = _lose_one_and_heal_it(tmp_path, 1, start, _kill_with_its_processes)
    results = [[torch.load(tmp_path / f"island{i}_rank{r}.pt") for r in range(2)] for i in range(3)]
    every = [r for island in results for r in island]
    assert [r["global_step"] for r in every] == [max_steps] * 6
    reference = results[0][0]["parameters"]
    for result in every:
        assert all(torch.equal(reference[name], value) for name, value in result["parameters"].items())
    # The schedule stepped once a batch everywhere. Per step, one overflow in the run: one backoff on every island
    # (the healed one's GradScaler came from a peer); with DiLoCo none.
    assert len({r["lr"] for r in every}) == 1 and every[0]["lr"] == pytest.approx(0.05 * 0.9**10)
    assert [r["scale"] for r in every] == [2.0**9 if every_step else 2.0**10] * 6
    # The run's commits: every step (the overflowed one committed, then skipped), or the join, 7 syncs and the end.
    commits = max_steps if every_step else 1 + max_steps // 4 + 1
    assert [r["stats"]["step"] for r in every] == [commits] * 6
    for index in others:
        stats, metrics = results[index][0]["stats"], results[index][0]["metrics"]
        assert stats["dropped"] == 0 and [n for _, n in stats["history"]][-3:] == [3, 2, 3]
        # The islands that stayed saw the skipped step in their AMPMonitor; the Monitor logged the quorum.
        assert metrics["ddpopt/amp/skipped_steps"] == (1.0 if every_step else 0.0)
        assert metrics["ddpopt/ft/participants"] == 3.0 and metrics["ddpopt/ft/dropped_steps"] == 0.0
    # Each rank's loader (through fabric.setup_dataloaders) drew its shard of the run's data (3 islands x 2 ranks):
    # in its first epoch (before the kill; the loop's own, whatever a heal at the first quorum did to the step
    # count), every island's rank its own batches, in its shard's order.
    for index in others:
        for rank, result in enumerate(results[index]):
            early = [batch for _, epoch, batch in result["samples"] if epoch == 0]
            shard = _shard(index * 2 + rank, 6, 0, samples=ft_fabric_worker.SAMPLES)
            assert early == [shard[8 * i : 8 * i + 8] for i in range(6)], (index, rank)
    healed = results[1][0]
    assert healed["stats"]["heals"] >= 1 and healed["metrics"]["ddpopt/ft/heals"] >= 1.0
    for index in range(3):
        report = json.loads((tmp_path / f"island{index}" / "ddpopt_report.json").read_text())
        (islands,) = [f for f in report["findings"] if f["area"] == "islands"]
        assert islands["evidence"].startswith(f"island island{index}: {commits} commits in the run")


@needs_torchft
@pytest.mark.slow
def test_a_run_whose_islands_all_die_restarts_from_their_checkpoints_and_goes_on_counting(tmp_path):
    # Two islands, a checkpoint every 5 steps each; both are killed at step 12 (the last checkpoints at step 10) and
    # started again, each resuming its own last checkpoint: torchft's manager state came back with it (the run's
    # commits go on from 10, not from 0), and both end at step 20 with equal parameters and the same LR.
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000)
    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    options = ("--islands", "2", "--checkpoint-every", "5", "--step-seconds", "0.05")
    try:
        (tmp_path / "hold").write_text("12")
        islands = [_island(i, lighthouse.address(), tmp_path, 20, logs[i], *options) for i in range(2)]
        deadline = time.monotonic() + 120
        while min(_step(tmp_path, i) for i in range(2)) < 12:
            assert time.monotonic() < deadline and all(p.poll() is None for p in islands), logs[0].read_text()[-3000:]
            time.sleep(0.05)
        for island in islands:
            island.send_signal(signal.SIGKILL)
            island.wait()
        (tmp_path / "hold").unlink()
        assert all((tmp_path / f"checkpoints{i}" / "last.ckpt").exists() for i in range(2))
        islands = [_island(i, lighthouse.address(), tmp_path, 20, logs[i], *options) for i in range(2)]
        codes = [island.wait(timeout=180) for island in islands]
    finally:
        lighthouse.shutdown()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    results = [torch.load(tmp_path / f"island{i}_rank0.pt") for i in range(2)]
    assert [r["global_step"] for r in results] == [20, 20]
    assert [r["stats"]["step"] for r in results] == [20, 20]  # 10 restored from the checkpoints, 10 after
    assert all(torch.equal(results[0]["parameters"][k], v) for k, v in results[1]["parameters"].items())
    assert results[0]["lr"] == results[1]["lr"]
    saved = torch.load(tmp_path / "checkpoints0" / "last.ckpt", weights_only=False)
    assert saved["ddpopt_fault_tolerance"]["step"] == 20


@needs_torchft
@pytest.mark.slow
def test_min_replicas_above_the_lighthouses_is_refused_at_the_first_quorum_naming_both_counts(tmp_path):
    # The Lighthouse forms quorums of 2, the islands ask for 3: every step would be dropped. Both islands stop at
    # their first quorum with the error, before any optimizer step.
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000)
    try:
        logs = [tmp_path / f"log{i}.txt" for i in range(2)]
        options = ("--min-replicas", "3", "--step-seconds", "0")
        islands = [_island(i, lighthouse.address(), tmp_path, 4, logs[i], *options) for i in range(2)]
        codes = [island.wait(timeout=180) for island in islands]
    finally:
        lighthouse.shutdown()
    for index, code in enumerate(codes):
        log = logs[index].read_text()
        assert code != 0, log[-3000:]
        assert (
            f"ValueError: FaultTolerance(min_replicas=3) is above the quorum the Lighthouse at {lighthouse.address()} "
            "formed, of 2 island(s): its --min-replicas is lower, and every step would be dropped. Start the "
            "Lighthouse with --min-replicas 3, or give min_replicas at most the Lighthouse's"
        ) in log
        assert not (tmp_path / f"island{index}.step").exists()  # no batch ended: refused before the first step


@pytest.mark.quick
def test_an_unreachable_lighthouse_is_named_with_what_to_start():
    # The check the island's first rank makes at setup (the slow run checks it end to end, in a job): a refused
    # connection is a ConnectionError naming the address and the command, within the connect timeout.
    from lightning_ddpopt.fault_tolerance.lighthouse import check_reachable

    address = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionError) as refused:
        check_reachable(address, 5.0)
    assert str(refused.value).startswith(f"no Lighthouse answers at {address} (")
    assert str(refused.value).endswith(
        "start one on that host with `ddpopt lighthouse --port PORT --min-replicas N`, or pass its address in "
        "FaultTolerance(lighthouse=...)"
    )


@needs_torchft
@pytest.mark.slow
def test_a_lighthouse_that_is_not_there_fails_setup_naming_its_address(tmp_path):
    address = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    island = _island(0, address, tmp_path, 4, tmp_path / "log.txt")
    assert island.wait(timeout=120) != 0
    log = (tmp_path / "log.txt").read_text()
    assert f"ConnectionError: no Lighthouse answers at {address} (" in log
    assert "start one on that host with `ddpopt lighthouse --port PORT --min-replicas N`" in log
    assert time.monotonic() - started < 60  # the connect timeout is 5 s: no minute-long hang


@pytest.mark.quick
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lighthouse": "lighthouse"}, "FaultTolerance lighthouse='lighthouse' is not a Lighthouse address"),
        ({"lighthouse": "https://h:1"}, "FaultTolerance lighthouse='https://h:1' is not a Lighthouse address"),
        ({"lighthouse": "h:70000"}, "FaultTolerance lighthouse='h:70000' is not a Lighthouse address"),
        ({"min_replicas": 0}, "FaultTolerance min_replicas=0 must be an int >= 1"),
        ({"replica_id": ""}, "FaultTolerance replica_id='' must be a non-empty string or None"),
        ({"timeout_s": 0}, "FaultTolerance timeout_s=0 must be a positive number"),
        ({"compression": "int8"}, "FaultTolerance compression='int8' must be one of 'fp32', 'fp16', 'bf16'"),
        ({"islands": 0}, "FaultTolerance islands=0 must be an int >= 1"),
        ({"islands": 2, "island": 2}, "FaultTolerance island=2 must be from 0 to islands - 1 = 1"),
        ({"island": -1}, "FaultTolerance island=-1 must be an int >= 0"),
        ({"islands": 2, "min_replicas": 3}, "FaultTolerance min_replicas=3 is above islands=2: no step could commit"),
        ({"quorum_timeout_s": -1.0}, "FaultTolerance quorum_timeout_s=-1.0 must be a positive number"),
    ],
)
def test_bad_fault_tolerance_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FaultTolerance(**kwargs)


@pytest.mark.quick
def test_the_lighthouse_address_comes_from_the_argument_or_the_environment(monkeypatch):
    assert FaultTolerance(lighthouse="host:29510").address() == "http://host:29510"
    assert FaultTolerance(lighthouse="http://[::1]:29510/").address() == "http://[::1]:29510"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://other:1234")
    assert FaultTolerance().address() == "http://other:1234"
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="FaultTolerance\\(lighthouse=None\\) needs the TORCHFT_LIGHTHOUSE"):
        FaultTolerance().address()


@pytest.mark.quick
def test_the_islands_index_comes_from_the_argument_the_environment_or_the_name(monkeypatch):
    # Each rank of island K of N draws shard K x M + rank of N x M (M ranks an island), as one DDP job of all the
    # islands' ranks would: the index from island=, else REPLICA_GROUP_ID (torchft's launchers), else a numeric name.
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    assert FaultTolerance(islands=3, island=2).sampler_kwargs(4, 1) == {"num_replicas": 12, "rank": 9}
    assert FaultTolerance(islands=3, island=2).name() == "island2"
    assert FaultTolerance(islands=3, replica_id="1").index() == 1
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    assert FaultTolerance(islands=2).sampler_kwargs(1, 0) == {"num_replicas": 2, "rank": 1}
    assert FaultTolerance(islands=2, island=0).index() == 0  # the argument outranks the environment
    assert FaultTolerance(islands=2, replica_id="trainer").name() == "trainer"
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    with pytest.raises(ValueError, match="^REPLICA_GROUP_ID=2 must be from 0 to islands - 1 = 1$"):
        FaultTolerance(islands=2).index()
    monkeypatch.setenv("REPLICA_GROUP_ID", "a")
    with pytest.raises(ValueError, match="^REPLICA_GROUP_ID='a' is not an island index: set it to this island's"):
        FaultTolerance(islands=2).index()
    monkeypatch.delenv("REPLICA_GROUP_ID")
    with pytest.raises(ValueError, match=r"^FaultTolerance\(islands=2\) needs this island's index: give island=K"):
        FaultTolerance(islands=2, replica_id="trainer").index()
    # The quorum's wait covers a local SGD window by default.
    assert FaultTolerance(islands=2).quorum_timeout(1) == 60.0
    assert FaultTolerance(islands=2).quorum_timeout(50) == 560.0
    assert FaultTolerance(islands=2, quorum_timeout_s=5.0).quorum_timeout(50) == 5.0


@pytest.mark.quick
def test_a_loopback_store_with_the_lighthouse_on_another_host_is_refused_saying_what_to_set():
    from lightning_ddpopt.fault_tolerance.replica import check_store_address

    here = socket.gethostname()
    for lighthouse in ("http://127.0.0.1:29510", "http://localhost:1", f"http://{here}:1", "http://[::1]:1"):
        check_store_address("127.0.0.1", lighthouse)  # all islands may be on this host
    check_store_address("10.9.8.7", "http://192.0.2.1:1")  # an address other hosts may reach
    with pytest.raises(ValueError) as refused:
        check_store_address("127.0.0.1", "http://192.0.2.1:29510")  # TEST-NET-1: never this machine's
    assert str(refused.value) == (
        "MASTER_ADDR=127.0.0.1 is this host's loopback address, and torchft gives the islands of a quorum this "
        "island's store address to meet at; the Lighthouse at http://192.0.2.1:29510 is on another host, so islands "
        "there would reach their own loopback. Set MASTER_ADDR to an address of this host that the other islands "
        "reach (and MASTER_PORT to a free port)"
    )


@pytest.mark.quick
@pytest.mark.parametrize("strategy", [OptimizedDDPStrategy, FabricStrategy], ids=["trainer", "fabric"])
def test_the_strategies_refuse_what_fault_tolerance_cannot_do_and_say_what_to_install(monkeypatch, strategy):
    with pytest.raises(TypeError, match="fault_tolerance='host:1' must be a FaultTolerance"):
        strategy(fault_tolerance="host:1")
    with pytest.raises(ValueError, match=r"FaultTolerance\(islands=None\): declare how many islands the run has"):
        strategy(fault_tolerance=FaultTolerance(lighthouse="h:1"))
    ft = FaultTolerance(lighthouse="h:1", islands=2, island=0)
    with pytest.raises(ValueError, match="local_sgd overlap_steps=4 is not supported with fault_tolerance yet"):
        strategy(fault_tolerance=ft, local_sgd=LocalSGDConfig.diloco(8, overlap_steps=4))
    with pytest.raises(ValueError, match="local_sgd replica='node' is not supported with fault_tolerance yet"):
        strategy(fault_tolerance=ft, local_sgd=LocalSGDConfig.diloco(8, replica="node"))
    with pytest.raises(ValueError, match="local_sgd sync_every='auto' is not supported with fault_tolerance yet"):
        strategy(fault_tolerance=ft, local_sgd=LocalSGDConfig.diloco("auto"))
    with pytest.raises(ValueError, match="FaultTolerance compression='bf16' is for the per-step average across"):
        strategy(
            fault_tolerance=FaultTolerance(lighthouse="h:1", islands=2, island=0, compression="bf16"),
            local_sgd=LocalSGDConfig.diloco(8),
        )
    with pytest.raises(
        ValueError,
        match="local_sgd compression='int8' is not supported with fault_tolerance: torchft's fault-tolerant "
        "collective is an all-reduce",
    ):
        strategy(fault_tolerance=ft, local_sgd=LocalSGDConfig.diloco(8, compression="int8"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= config.TORCHFT_TORCH_FLOOR:
        expected = r"torchft, which is not installed: pip install 'lightning-ddpopt\[ft\]'"
    else:
        expected = r"torchft, which needs torch >= 2.7 \(this is torch .*\): upgrade torch, then pip install"
    with pytest.raises(ImportError, match=expected):
        strategy(fault_tolerance=ft)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-replicas", "0"], "--min-replicas 0 must be >= 1"),
        (["--min-replicas", "2", "--port", "70000"], "--port 70000 must be >= 0 and <= 65535"),
    ],
)
def test_the_lighthouse_command_checks_its_arguments(capsys, argv, message):
    assert ddpopt(["lighthouse", *argv]) == 2
    assert f"ddpopt lighthouse: error: {message}" in capsys.readouterr().err


@needs_torchft
@pytest.mark.slow
def test_the_lighthouse_command_serves_until_stopped(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lightning_ddpopt.cli", "lighthouse", "--port", str(port), "--min-replicas", "2"]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "ddpopt: Lighthouse at http://" in line and f":{port} (min_replicas=2)" in line
        config.lighthouse_host_port(f"127.0.0.1:{port}", "lighthouse")
        from lightning_ddpopt.fault_tolerance.lighthouse import check_reachable

        check_reachable(f"http://127.0.0.1:{port}", 5.0)
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=30)
    assert server.returncode == 0 and "ddpopt: Lighthouse stopped" in out


def _islands_summary(history, heals=0, dropped=0):
    return {
        "fault_tolerance": {
            "replica_id": "island1",
            "step": 30,
            "committed": 30 - dropped,
            "dropped": dropped,
            "heals": heals,
            "heal_seconds": 0.012,
            "quorum_changes": max(len(history) - 1, 0),
            "participants": history[-1][1] if history else 0,
            "history": history,
        }
    }


@needs_torchft
@pytest.mark.quick
@pytest.mark.parametrize(("host", "shown"), [("10.1.2.3", "10.1.2.3"), ("fd00::5", "[fd00::5]")])
def test_the_checkpoint_server_is_advertised_at_the_islands_address_not_the_machines_name(host, shown):
    # A healing island fetches a peer's state from the peer's checkpoint server: at the address the islands reach
    # each other at (torchft's own names the machine, which shaped namespaces, containers or hosts with several
    # interfaces resolve to another address).
    from datetime import timedelta

    from lightning_ddpopt.fault_tolerance.replica import _checkpoint_server

    server = _checkpoint_server(host, timedelta(seconds=5))
    try:
        address = server.metadata()
        port = int(address.split(":")[-1].split("/")[0])
        assert address == f"http://{shown}:{port}/checkpoint/"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it listens on every interface
    finally:
        server.shutdown(wait=False)


class _Quorum:
    """What the replica asks of torchft's manager at a quorum and a vote: so many islands taking part, at a step."""

    def __init__(self, participants: int, step: int) -> None:
        self.participants, self.step = participants, step

    def num_participants(self) -> int:
        return self.participants

    def current_step(self) -> int:
        return self.step

    def errored(self) -> None:
        return None

    def should_commit(self) -> bool:
        return False  # torchft's own rule: fewer than min_replica_size taking part

    def allreduce(self, tensor: torch.Tensor, reduce_op: object = "avg") -> _Quorum:
        self.sent = (tensor.dtype, reduce_op, tensor.clone())  # the other islands sent zeros (they heal)
        self.sends = [*getattr(self, "sends", []), self.sent]
        return self

    def wait(self) -> None:
        return None


@pytest.mark.quick
def test_too_few_islands_stop_the_run_at_its_first_quorum_and_drop_a_later_step_with_a_warning():
    # At the run's first quorum every island is at step 0 and takes part: fewer than min_replicas there means the
    # Lighthouse's --min-replicas is lower, refused at the vote. Later, an island that heals at a quorum does not
    # take part in it (torchft counts the islands at the run's step), so two taking part of min_replicas=3 is a drop,
    # warned.
    replica = Replica.__new__(Replica)
    replica._island_rank, replica._address, replica._min_replicas, replica._quorum_timeout_s = 0, "http://h:1", 3, 60.0
    replica.stats, replica.replica_id, replica._open = ReplicaStats(), "island0", True
    replica.manager = _Quorum(participants=2, step=0)  # type: ignore[assignment]
    replica._note_participants()
    with pytest.raises(ValueError, match=r"FaultTolerance\(min_replicas=3\) is above the quorum the Lighthouse at "):
        replica.commit()
    replica.manager = _Quorum(participants=2, step=12)  # type: ignore[assignment]
    replica._open = True
    replica._note_participants()
    with pytest.warns(RuntimeWarning) as warned:
        assert replica.commit() is False
    assert str(warned[0].message) == (
        "ddpopt: island island0 dropped its commit after commit 12: the quorum has 2 island(s) taking part (the "
        "others heal first), fewer than FaultTolerance(min_replicas=3)"
    )
    assert (replica.stats.dropped, replica.stats.participants, replica.step_open) == (2, 2, False)


@pytest.mark.quick
@pytest.mark.parametrize("compression", ["fp32", "bf16", "fp16"])
def test_the_gradients_cross_the_islands_in_their_compression_divided_before_the_cast(compression, monkeypatch):
    # Per step the island's gradients travel in FaultTolerance(compression=...): fp32 as torchft's average, fp16 and
    # bf16 divided by the islands taking part first and summed (the fp16 hook's way: no overflow the mean would not
    # have). A missing gradient travels as zeros and comes back as the average. In chunks of consecutive parameters
    # (here at most 5 values: the 3 and the 2 together, then the 4 alone).
    from torch.distributed import ReduceOp

    from lightning_ddpopt.fault_tolerance import replica as replica_module

    monkeypatch.setattr(replica_module, "CHUNK_VALUES", 5)
    replica = Replica.__new__(Replica)
    replica._island_size = 1
    replica._island_rank, replica._address, replica._min_replicas, replica._quorum_timeout_s = 0, "http://h:1", 1, 60.0
    replica.stats, replica.replica_id, replica._open = ReplicaStats(), "island0", True
    replica._wire = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    replica.manager = _Quorum(participants=4, step=3)  # type: ignore[assignment]
    used, unused = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    used.grad = torch.tensor([1.0, -2.0, 1000.0])
    last = torch.nn.Parameter(torch.zeros(4))
    last.grad = torch.full((4,), 8.0)
    replica.average_gradients([used, unused, last], None)
    (dtype, op, sent), (_, _, sent_last) = replica.manager.sends  # type: ignore[attr-defined]
    assert replica.stats.averages == 1 and replica.stats.average_bytes == 9 * sent.element_size()
    if compression == "fp32":
        assert (dtype, op) == (torch.float32, "avg")  # torchft divides by the participants itself
        assert torch.equal(sent, torch.tensor([1.0, -2.0, 1000.0, 0.0, 0.0]))
        assert torch.equal(sent_last, torch.full((4,), 8.0))
    else:
        assert (dtype, op) == (replica._wire, ReduceOp.SUM)
        assert torch.equal(sent, torch.tensor([0.25, -0.5, 250.0, 0.0, 0.0], dtype=replica._wire))
        assert torch.equal(used.grad, torch.tensor([0.25, -0.5, 250.0]))
        assert torch.equal(last.grad, torch.full((4,), 2.0))
    assert unused.grad is not None and torch.equal(unused.grad, torch.zeros(2))


@pytest.mark.quick
@pytest.mark.parametrize("compression", ["fp32", "bf16", "fp16"])
def test_diloco_changes_cross_the_islands_divided_before_the_cast(compression):
    # A DiLoCo sync's change goes the per-step gradients' way: in fp16 (whose largest value is 65504) a change of
    # 60000 on each of 4 islands sums to 240000 (inf) if cast first; divided first, each sends 15000 and the sum is
    # the mean.
    from torch.distributed import ReduceOp

    replica = Replica.__new__(Replica)
    replica._island_rank, replica._address, replica._min_replicas, replica._quorum_timeout_s = 0, "http://h:1", 1, 60.0
    replica.stats, replica.replica_id, replica._open = ReplicaStats(), "island0", False
    manager = _Quorum(participants=4, step=3)
    manager.start_quorum = lambda: None  # type: ignore[attr-defined]
    manager.should_commit = lambda: True  # type: ignore[method-assign]
    replica.manager = manager  # type: ignore[assignment]
    change = torch.tensor([60000.0, -2.0])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compression]
    wire = None if compression == "fp32" else torch.empty(2, dtype=dtype)
    assert replica.sync_mean(change, wire) is True
    sent_dtype, op, sent = manager.sent  # type: ignore[attr-defined]
    if compression == "fp32":
        assert (sent_dtype, op) == (torch.float32, "avg") and torch.equal(sent, torch.tensor([60000.0, -2.0]))
    else:
        assert (sent_dtype, op) == (dtype, ReduceOp.SUM)
        assert torch.equal(sent, torch.tensor([15000.0, -0.5], dtype=dtype))  # bf16 rounds 15000 to 14976
        assert torch.isfinite(sent.float() * 4).all()  # the other islands' shares summed stay finite
        assert torch.equal(change, sent.float())  # the sum (here the stand-in's own share) back in fp32


@pytest.mark.quick
def test_the_islands_finding_reports_the_quorum_and_calls_an_island_that_keeps_leaving_a_problem():
    from lightning_ddpopt.diagnosis import diagnose

    assert [f.area for f in diagnose({})][-1] == "stragglers"  # no fault tolerance: no islands finding
    steady = diagnose(_islands_summary([[1, 3], [9, 2], [21, 3]], heals=1))[-1]
    assert (steady.area, steady.status, steady.recommendation) == ("islands", "ok", "")
    assert steady.evidence == (
        "island island1: 30 commits in the run, 30 of them its own, 0 dropped, healed 1 time(s) (12 ms loading); "
        "islands in the quorum: 3 from step 1, 2 from step 9, 3 from step 21"
    )
    dropped = diagnose(_islands_summary([[1, 3]], dropped=2))[-1]
    assert dropped.status == "ok" and "raise FaultTolerance timeout_s" in dropped.recommendation
    flapping = diagnose(_islands_summary([[1, 3], [5, 2], [9, 3], [14, 2], [20, 3]]))[-1]
    assert flapping.status == "problem"
    assert flapping.evidence.endswith("; the quorum lost an island 2 times")
    assert flapping.recommendation.startswith("an island keeps failing and coming back")


@pytest.mark.quick
def test_the_hook_averages_chunks_in_one_order_as_the_buckets_become_ready():
    # Three parameters a (3 values), b (2), c (4), averaged in the order their gradients are ready (the module's,
    # reversed), in chunks of at most 5 values: [c] and [b, a], the same on every island whatever its buckets. DDP
    # hands a bucket [c, b] first: [c] crosses at once, beside the backward pass, while [b, a] waits for a's bucket;
    # each bucket's future completes with the averaged values in its own tensor once every chunk holding its
    # parameters is averaged. A failed average fails that bucket and every later one of the step at once, and the
    # next step starts clean.
    from lightning_ddpopt.hooks.across_islands import AcrossIslands

    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    across = AcrossIslands(chunk_values=5)
    across.bind([a, b, c], torch.device("cpu"))
    sent: list[list[float]] = []

    def average(flat: torch.Tensor) -> None:
        if flat.numel() == 4 and flat[0] == -1.0:
            raise RuntimeError("the islands' link failed")
        sent.append(flat.tolist())
        flat.mul_(10.0)  # the "average" the islands agree on

    began: list[int] = []
    across.average, across.begin = average, lambda: began.append(len(sent))

    def synced(values: list[float]) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([torch.tensor(values)])
        return future

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        first = across.submit(synced([4.0, 4.0, 4.0, 4.0, 2.0, 2.0]), [c, b])
        until(lambda: sent == [[4.0, 4.0, 4.0, 4.0]])  # [c] crossed before a's bucket came
        assert not first.done() and began == [0]
        later = across.submit(synced([1.0, 1.0, 1.0]), [a])
        assert first.wait().tolist() == [40.0, 40.0, 40.0, 40.0, 20.0, 20.0]
        assert later.wait().tolist() == [10.0, 10.0, 10.0]
        assert sent == [[4.0, 4.0, 4.0, 4.0], [2.0, 2.0, 1.0, 1.0, 1.0]] and across.steps == 1
        across.new_step()
        failed = across.submit(synced([-1.0, 4.0, 4.0, 4.0, 2.0, 2.0]), [c, b])
        after = across.submit(synced([1.0, 1.0, 1.0]), [a])
        for future in (failed, after):
            with pytest.raises(RuntimeError, match="the islands' link failed"):
                future.wait()
        across.new_step()
        again = [across.submit(synced([4.0] * 4 + [2.0] * 2), [c, b]), across.submit(synced([1.0] * 3), [a])]
        assert [future.wait().tolist() for future in again] == [[40.0] * 4 + [20.0] * 2, [10.0] * 3]
        assert across.steps == 2
        # Before the island joins the quorum (no average yet): the island's sync alone.
        across.average = None
        assert across.submit(synced([5.0, 5.0, 5.0]), [a]).wait().tolist() == [5.0, 5.0, 5.0]
    finally:
        across.close()
