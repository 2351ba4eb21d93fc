"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from lightning_ddpopt._groups import destroy_all_groups


@pytest.fixture
def gloo_group(tmp_path):
    """A 1-rank gloo process group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    destroy_all_groups()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """An in-process Trainer run leaves Lightning's default group behind; later tests need a clean slate."""
    yield
    destroy_all_groups()


@pytest.fixture(autouse=True)
def _restore_omp_num_threads():
    """An in-process DDP run on CPU makes Lightning set ``OMP_NUM_THREADS`` in this process; ranks forked by a later
    test then keep this process's OpenMP threads instead of one each, and libgomp, which is not fork-safe, hangs in
    a child whose parent used its thread pool (seen: a fork after tests/test_validation.py's in-process fit)."""
    before = os.environ.get("OMP_NUM_THREADS")
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    """A test that failed or timed out may leave ranks running, holding their ports: later tests would fail with
    EADDRINUSE or wait for them. End every process this one started (and theirs), except multiprocessing's helpers."""
    yield
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
            if b"resource_tracker" in command or b"forkserver" in command:
                continue
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], list(children.get(root, []))
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found
