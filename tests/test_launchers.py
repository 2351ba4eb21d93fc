"""Every way users start the ranks: a script (Lightning's subprocess launcher), spawn, fork, torchrun, and a
cluster launcher that starts each "node" itself. The same training script (tests/launcher_worker.py) runs the full
callback set with a slow rank, the int8 and PowerSGD hooks, a save and resume, and DiLoCo choosing its H
(``sync_every="auto"``) under each (spawn, whose every fit starts fresh interpreters, leaves int8 out)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ddpopt import AMPMonitor, CommProfiler, LocalSGDConfig, OptimizedDDPStrategy, StragglerDetector
from lightning_ddpopt.affinity import available_cores, cpu_layout, plan_core_sets
from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.fault_tolerance import FaultTolerance
from lightning_ddpopt.hooks import Int8Config, PowerSGDConfig
from lightning_ddpopt.ledger import _OpenBucket
from tests.helpers import needs_torchft, user_environment
from tests.launcher_worker import SLOW_MS, shared_tensors

ROOT = Path(__file__).resolve().parents[1]
FITS = ("callbacks", "int8", "powersgd", "powersgd_resumed", "localsgd")
#: The fits tests/launcher_worker.py leaves out under spawn, whose every fit starts fresh interpreters.
SPAWN_SKIPS = ("int8",)
#: launcher -> the rank made slow (rank 0 as well as another) and the cluster environment Lightning should detect.
LAUNCHERS = {
    "script": (0, "LightningEnvironment"),
    "spawn": (1, "LightningEnvironment"),
    "fork": (0, "LightningEnvironment"),
    "torchrun": (1, "TorchElasticEnvironment"),
    "nodes": (0, "LightningEnvironment"),
    "slurm": (1, "SLURMEnvironment"),
}
#: The core srun binds each rank to under the ``slurm`` launcher: two of this process's cores, reversed, so that a
#: plan that split the cores anew (rank 0 the first) would differ from keeping them.
SLURM_CORES = tuple(available_cores()[:2][::-1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(launcher: str, out: Path, slow_rank: int) -> list[subprocess.Popen]:
    """Start the worker as ``launcher`` starts it; each process in a session of its own, killed after the test."""
    env = user_environment(ROOT)  # each launcher sets what it sets
    worker = ["-m", "tests.launcher_worker", launcher, str(out), str(slow_rank)]
    if launcher == "torchrun":
        commands = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *worker]]
        envs = [env]
    elif launcher == "nodes":
        port = str(_free_port())
        commands = [[sys.executable, *worker] for _ in range(2)]
        envs = [
            {
                **env,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "NODE_RANK": str(node),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
            }
            for node in range(2)
        ]
    elif launcher == "slurm":
        port = str(_free_port())
        commands = [[sys.executable, *worker] for _ in range(2)]
        slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
        slurm.update(SLURM_JOB_NAME="train", SLURM_JOB_ID="4242", SLURM_NODELIST="localhost")
        envs = [
            {**env, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1"}
            | {"MASTER_PORT": port}
            for rank in range(2)
        ]
    else:
        commands = [[sys.executable, *worker]]
        envs = [env]
    cores = SLURM_CORES if launcher == "slurm" else (None,) * len(commands)
    processes = []
    for index, (command, process_env, core) in enumerate(zip(commands, envs, cores, strict=True)):
        # Into files, not pipes: a process blocked on a full pipe would stall the other ranks in their collectives.
        with open(out / f"output{index}.txt", "w") as output:
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=process_env,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=None if core is None else functools.partial(os.sched_setaffinity, 0, {core}),
                )
            )
    return processes


def _run(launcher: str, out: Path, slow_rank: int, timeout: float = 240) -> str:
    out.mkdir(parents=True, exist_ok=True)
    processes = _start(launcher, out, slow_rank)
    # A rank started by Lightning's script launcher may still be writing after rank 0 has exited.
    done = [out / f"done_rank{rank}" for rank in (range(1) if launcher in ("spawn", "fork") else range(2))]
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            failed = any(code not in (None, 0) for code in codes)  # its peers may wait for it in a collective
            if failed or (codes == [0] * len(codes) and all(path.exists() for path in done)):
                break
            time.sleep(0.2)
        output = "".join((out / f"output{index}.txt").read_text() for index in range(len(processes)))
        assert codes == [0] * len(processes), f"{launcher}: exit codes {codes} (None: still running)\n{output[-4000:]}"
        assert all(path.exists() for path in done), output[-4000:]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    return output


def _records(out: Path, fit: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{fit}_rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.skipif(len(SLURM_CORES) < 2, reason="the cpu_affinity checks need two cores")
@pytest.mark.parametrize(
    "launcher",
    # The script launcher (``python train.py``, as the README runs it) in the default run; every other one is slow.
    [pytest.param(name, marks=() if name == "script" else pytest.mark.slow) for name in LAUNCHERS],
)
def test_every_launcher(tmp_path, launcher):
    slow_rank, environment = LAUNCHERS[launcher]
    output = _run(launcher, tmp_path, slow_rank)
    records = {fit: _records(tmp_path, fit) for fit in FITS if launcher != "spawn" or fit not in SPAWN_SKIPS}

    for fit, ranks in records.items():
        # Two distinct processes, ranks 0 and 1 of a world of 2, as the launcher set them up.
        assert [r["global_rank"] for r in ranks] == [0, 1], fit
        assert len({r["pid"] for r in ranks}) == 2, fit
        assert {r["world_size"] for r in ranks} == {2}, fit
        assert {r["environment"] for r in ranks} == {environment}, fit
        if launcher == "nodes":
            assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (1, 0)]
        else:
            assert [(r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1)]
        # Nothing a rank writes is shared with the other rank (spawn pickles CPU tensors into shared memory).
        assert ranks[0]["shared"] == [] and ranks[1]["shared"] == [], (fit, ranks[0]["shared"], ranks[1]["shared"])
        # Data parallel: the ranks end with the same parameters.
        torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0, msg=fit)

    # The slow rank is named, in the phase where it is slow, from its own figures (not a mean of the ranks').
    stragglers = [r["StragglerDetector"] for r in records["callbacks"]]
    assert stragglers[0] == stragglers[1]
    last = stragglers[0]["last"]
    assert last is not None, stragglers[0]
    assert last["slowest_rank"] == slow_rank and last["is_straggler"] and last["phase"] == "compute", last
    compute = [last["per_rank_ms"][str(rank)]["compute"] for rank in range(2)]
    assert compute[slow_rank] > compute[1 - slow_rank] + 0.7 * SLOW_MS, last
    assert f"rank {slow_rank} is a straggler" in output
    # cpu_affinity=True: ranks given the same cores split them, ranks srun bound keep their own core.
    if launcher in ("script", "slurm"):
        given = available_cores()
        expected = (
            plan_core_sets(given, 2, cpu_layout(given)) if launcher == "script" else [[core] for core in SLURM_CORES]
        )
        assert [r["cores"] for r in records["callbacks"]] == expected
        assert [r["threads"] for r in records["callbacks"]] == [len(cores) for cores in expected]
        how = f"the same cores {given}: split" if launcher == "script" else "cores of its own: kept"
        assert how in output, output[-3000:]
    comm = records["callbacks"][0]["comm_metrics"]
    assert comm["bytes_sent"] > 0 and comm["step_time_ms"] > 0, comm
    assert records["callbacks"][0]["AMPMonitor"]["steps"] == 12

    assert launcher == "spawn" or {r["comm_hook_name"] for r in records["int8"]} == {"int8"}
    # PowerSGD resumed from the first epoch's checkpoint ends where the uninterrupted run ends, bit for bit, its
    # state (error feedback, Q memories, iteration) restored on each rank.
    for straight, resumed in zip(records["powersgd"], records["powersgd_resumed"], strict=True):
        assert resumed["hook_iteration"] == straight["hook_iteration"] == 8
        torch.testing.assert_close(resumed["params"], straight["params"], rtol=0, atol=0)
    if launcher == "spawn":
        assert not (tmp_path / "int8_rank0.pt").exists()
    # DiLoCo with sync_every="auto": 20 steps; after the first sync (step 16) every rank took the same H, and the
    # ranks share the anchor they averaged last.
    localsgd = records["localsgd"]
    assert [r["sync_every_chosen"] for r in localsgd] == [True, True]
    every = localsgd[0]["sync_every"]
    assert localsgd[1]["sync_every"] == every and every >= 1
    assert [r["local_sgd_syncs"] for r in localsgd] == [1 + (20 - 16) // every] * 2
    torch.testing.assert_close(localsgd[0]["anchor"], localsgd[1]["anchor"], rtol=0, atol=0)


@pytest.mark.quick
@pytest.mark.parametrize(
    "options",
    [
        {"comm_hook": "allreduce"},
        {"comm_hook": PowerSGDConfig(rank=2)},
        {"comm_hook": Int8Config()},
        {"comm_hook": "auto"},
        {"local_sgd": LocalSGDConfig.diloco(8, overlap_steps=2, compression="int8"), "cpu_affinity": True},
        {"local_sgd": LocalSGDConfig.diloco("auto", overlap_steps=4, replica="node")},
        pytest.param(
            {
                "comm_hook": Int8Config(),
                "fault_tolerance": FaultTolerance(islands=2, island=0, lighthouse="host:29510"),
            },
            marks=needs_torchft,
        ),
        pytest.param(
            {
                "local_sgd": LocalSGDConfig.diloco(8),
                "fault_tolerance": FaultTolerance(islands=2, island=1, lighthouse="host:29510"),
            },
            marks=needs_torchft,
        ),
    ],
    ids=["allreduce", "powersgd", "int8", "auto", "localsgd", "localsgd_auto", "fault_tolerance", "ft_diloco"],
)
def test_no_tensor_exists_before_the_ranks_start(options):
    """What a launcher pickles into the ranks holds no tensor of ours: per-rank state is born in the ranks."""
    objects = {
        "strategy": OptimizedDDPStrategy(**options),
        "CommProfiler": CommProfiler(probe_link=True),
        "StragglerDetector": StragglerDetector(),
        "AMPMonitor": AMPMonitor(),
    }
    for name, value in objects.items():
        assert shared_tensors(value, name, shared_only=False) == []


@pytest.mark.quick
def test_the_tensor_search_reaches_slotted_objects():
    # The search the test above relies on finds a tensor held in a slot (the ledger keeps its open buckets so).
    bucket = _OpenBucket(index=0, num_elements=1, logical_bytes=4, start=0.0, drift=DeferredRead(torch.zeros(())))
    assert not hasattr(bucket, "__dict__")
    assert shared_tensors({"open": [bucket]}, "ledger", shared_only=False) == ["ledger['open'][0].drift._tensor"]
