"""An island's gather through the host's shared memory: shared where every rank maps the buffer, gloo otherwise,
and no file left behind either way (two real processes on a gloo group)."""

from __future__ import annotations

import errno
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ddpopt._groups import destroy_all_groups
from lightning_ddpopt.localsgd import host_memory
from lightning_ddpopt.localsgd.shard import Shard

PARAMETERS = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(3, 3))]  # 19 values: 10 + 9
RESERVED: list[int] = []


class _OtherHost:
    """``os`` as a rank on another host sees it: the same path names a file in another ``/dev/shm``."""

    def __init__(self, here: str, there: str) -> None:
        self.here, self.there = here, there

    def __getattr__(self, name: str):
        return getattr(os, name)

    def open(self, path: str, flags: int, *args):
        return os.open(path.replace(self.here, self.there), flags, *args)


class _Reserving:
    """``os`` whose ``posix_fallocate`` records what it reserves, or finds the file system full."""

    def __init__(self, full: bool) -> None:
        self.full = full

    def __getattr__(self, name: str):
        return getattr(os, name)

    def posix_fallocate(self, fd: int, offset: int, nbytes: int) -> None:
        RESERVED.append(nbytes)
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate(fd, offset, nbytes)


def _worker(rank: int, port: int, cases: dict[str, tuple[str, str, str]]) -> None:
    """Every case in turn in the same two processes (one spawn for all), on one island group.

    One group for all: torch 2.4's gloo hangs destroying several groups that gathered objects at the process's end.
    """
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    island = dist.new_group([0, 1])
    for case, (directory, other, out) in cases.items():
        host_memory.os = os  # type: ignore[attr-defined]
        RESERVED.clear()
        _gather(island, rank, case, directory, other, out)
    destroy_all_groups()


def _gather(island: dist.ProcessGroup, rank: int, case: str, directory: str, other: str, out: str) -> None:
    host_memory.SHARED_DIR = directory
    if case == "other_host" and rank == 1:
        host_memory.os = _OtherHost(directory, other)  # type: ignore[attr-defined]
    if rank == 0:
        host_memory.os = _Reserving(full=case == "full")  # type: ignore[attr-defined]
    shard = Shard(PARAMETERS, island, 2, rank, 1)
    stage, _ = shard.buffers(torch.device("cpu"))
    record: dict = {"shared": shard.shared, "reason": shard.unshared_reason, "reserved": RESERVED}
    for value in (1.0, 2.0):  # two gathers in a row, each rank's slice its rank + value
        start, stop = shard.bounds
        record[value] = shard.gathered_copy(torch.full((stop - start,), rank + value))
    # In place: the outer step writes the stage itself, and the gather reads it where it is.
    stage[: shard.bounds[1] - shard.bounds[0]].fill_(10.0 * (rank + 1))
    record["in_place"] = shard.gather(stage).clone()
    shard.release()
    torch.save(record, f"{out}_{rank}.pt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_island_gathers_through_shared_memory_or_gloo(tmp_path):
    directory, other = tmp_path / "shm", tmp_path / "other_shm"
    directory.mkdir()
    other.mkdir()
    expected = {value: torch.cat([torch.full((10,), value), torch.full((9,), 1 + value)]) for value in (1.0, 2.0)}
    in_place = torch.cat([torch.full((10,), 10.0), torch.full((9,), 20.0)])
    cases = {
        case: (str(tmp_path / "missing" if case == "no_dir" else directory), str(other), str(tmp_path / case))
        for case in ("shared", "other_host", "no_dir", "full")
    }
    mp.start_processes(_worker, args=(_free_port(), cases), nprocs=2, start_method="spawn")
    for case, (where, _, out) in cases.items():
        records = [torch.load(f"{out}_{rank}.pt") for rank in range(2)]
        for record in records:
            assert record["shared"] is (case == "shared"), (case, record["reason"])
            for value in (1.0, 2.0):
                assert torch.equal(record[value], expected[value]), (case, value)
            assert torch.equal(record["in_place"], in_place), case
        reason = records[0]["reason"]
        # The whole buffer is reserved at once: 2 slices of 10 fp32 values, 80 bytes.
        assert records[0]["reserved"] == ([] if case == "no_dir" else [80]), case
        if case == "shared":
            assert reason == ""
        elif case == "other_host":  # rank 1's reason, which the island's first rank says
            assert reason.startswith(f"rank 1 finds no file of 80 bytes at {directory}/ddpopt-island-"), reason
            assert "([Errno 2] No such file or directory" in reason, reason
        elif case == "no_dir":
            assert reason.startswith(f"cannot create a file in {where} ("), reason
        else:
            assert reason == f"{directory} has no room for 80 bytes ([Errno 28] No space left on device)", reason
        # The file is gone once every rank has mapped it or given up, and the rank on the other host made none.
        assert os.listdir(directory) == [] and os.listdir(other) == [], case
