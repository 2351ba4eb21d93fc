"""An island's gather through the host's shared memory: shared where every rank maps the buffer, gloo otherwise,
and no file left behind either way (two real processes on a gloo group)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ddpopt._groups import destroy_all_groups
from lightning_ddpopt.localsgd import host_memory
from lightning_ddpopt.localsgd.shard import Shard

PARAMETERS = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(3, 3))]  # 19 values


def _worker(rank: int, port: int, case: str, directory: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    host_memory.SHARED_DIR = directory
    if case == "other_host" and rank == 1:  # as a rank on another host: the path names no file it can map
        host_memory.torch = _NoFile()  # type: ignore[attr-defined]
    island = dist.new_group([0, 1])
    shard = Shard(PARAMETERS, island, 2, rank, 1)
    stage, _ = shard.buffers(torch.device("cpu"))
    record: dict = {"shared": shard.shared, "reason": shard.unshared_reason, "sizes": []}
    for value in (1.0, 2.0):  # two gathers in a row, each rank's slice its rank + value
        start, stop = shard.bounds
        whole = shard.gathered_copy(torch.full((stop - start,), rank + value))
        record["sizes"].append(whole.numel())
        record[value] = whole
    # In place: the outer step writes the stage itself, and the gather reads it where it is.
    stage[: shard.bounds[1] - shard.bounds[0]].fill_(10.0 * (rank + 1))
    record["in_place"] = shard.gather(stage).clone()
    shard.release()
    torch.save(record, f"{out}_{rank}.pt")
    destroy_all_groups()


class _NoFile:
    """``torch`` as a rank on another host sees it: ``from_file`` finds no such file."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def from_file(path, **_):
        raise RuntimeError(f"No such file or directory: {path}")


def _run(tmp_path: Path, case: str, directory: Path, port: int) -> list[dict]:
    out = str(tmp_path / case)
    mp.start_processes(_worker, args=(port, case, str(directory), out), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}_{rank}.pt") for rank in range(2)]


def test_the_island_gathers_through_shared_memory_or_gloo(tmp_path):
    directory = tmp_path / "shm"
    directory.mkdir()
    # 19 values over 2 ranks: 10 and 9.
    expected = {value: torch.cat([torch.full((10,), value), torch.full((9,), 1 + value)]) for value in (1.0, 2.0)}
    in_place = torch.cat([torch.full((10,), 10.0), torch.full((9,), 20.0)])
    for case, port, shared in (("shared", 29591, True), ("other_host", 29592, False), ("no_dir", 29593, False)):
        records = _run(tmp_path, case, directory if case != "no_dir" else tmp_path / "missing", port)
        for record in records:
            assert record["shared"] is shared, (case, record["reason"])
            for value in (1.0, 2.0):
                assert torch.equal(record[value], expected[value]), (case, value)
            assert torch.equal(record["in_place"], in_place), case
            assert record["sizes"] == [19, 19]
        reason = records[0]["reason"]
        if case == "shared":
            assert reason == ""
        elif case == "other_host":
            assert reason == "the island's ranks do not share a host's memory"
        else:
            assert reason.startswith(f"cannot create a file in {tmp_path / 'missing'} ("), reason
        # The file is gone once every rank has mapped it (or given up): nothing is left behind.
        assert os.listdir(directory) == [], case
