"""An island's gather through one buffer in the host's shared memory, where all its ranks run on one host (CPU).

Used by :class:`~lightning_ddpopt.localsgd.shard.Shard`. Gloo's all-gather inside a host copies every shard
through the loopback's sockets. In one shared buffer each rank writes its shard in place, and a gather is a
barrier: every rank then reads the whole model where the others wrote it. The buffer is a file in
:data:`SHARED_DIR` that the island's first rank creates and reserves whole (``posix_fallocate``, so that a full file
system is an error now, not a bus error at the first write); every other rank opens that file as it is (never
creating one: a rank on another host finds none, or another file), maps it and marks its slice; each checks every
mark, and the first rank unlinks the file once all have mapped it or given up, so nothing is left behind when the
ranks end. Where any rank cannot map it, every rank of the island keeps gloo's gather, with the reason.

Memory: the model once per island on its host (O(P)), instead of once per rank.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import torch
import torch.distributed as dist

__all__ = ["SHARED_DIR", "map_shared"]

#: Where the buffer's file is made (a RAM-backed file system on Linux).
SHARED_DIR = "/dev/shm"
# Bytes of the file's path broadcast from the island's first rank (Linux's PATH_MAX).
_NAME_BYTES = 4096
_VALUE_BYTES = 4  # fp32


def map_shared(island: dist.ProcessGroup, place: int, size: int, count: int) -> tuple[torch.Tensor | None, str]:
    """A buffer of ``count`` slices of ``size`` fp32 values shared by the island's ranks, or ``None`` and why not.

    A collective on ``island`` (every rank of it, at the same point); ``place`` is this rank's island rank.
    """
    nbytes = size * count * _VALUE_BYTES
    path, reason = _create(nbytes) if place == 0 else ("", "")
    try:
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        encoded = path.encode()
        name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(island, 0), group=island)
        path = bytes(name[name > 0].tolist()).decode()
        shared: torch.Tensor | None = None
        if path:
            found = _existing_size(path)
            if found == nbytes:
                try:
                    shared = torch.from_file(path, shared=True, size=size * count, dtype=torch.float32)
                    shared[place * size] = float(place + 1)  # a mark in this rank's slice, for the others to see
                except (OSError, RuntimeError) as error:
                    reason = f"rank {dist.get_rank()} cannot map {path} ({error})"
            else:
                reason = f"rank {dist.get_rank()} finds no file of {nbytes} bytes at {path} ({found})"
        dist.barrier(group=island)
    finally:
        if place == 0 and path:
            with contextlib.suppress(OSError):  # gone already (a cleaner of /dev/shm): the mappings stay valid
                os.unlink(path)  # every rank has mapped it or given up (or failed): a mapping keeps its pages
    seen = shared is not None and all(shared[i * size].item() == i + 1 for i in range(count))
    agreed = torch.tensor([1 if seen else 0], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=island)
    if agreed.item():
        return shared, ""
    # Every rank knows they did not agree: the first reason any rank has, for the island's first rank to say.
    reasons: list[str] = [""] * dist.get_world_size(island)
    dist.all_gather_object(reasons, reason, group=island)
    return None, next((r for r in reasons if r), "the island's ranks do not share a host's memory")


def _create(nbytes: int) -> tuple[str, str]:
    """Make and reserve the buffer's file; its path, or ``""`` and why not."""
    path = os.path.join(SHARED_DIR, f"ddpopt-island-{uuid.uuid4().hex}")
    if len(path.encode()) >= _NAME_BYTES:
        return "", f"the path {path!r} is too long"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as error:
        return "", f"cannot create a file in {SHARED_DIR} ({error})"
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        os.unlink(path)
        return "", f"{SHARED_DIR} has no room for {nbytes} bytes ({error})"
    finally:
        os.close(fd)
    return path, ""


def _existing_size(path: str) -> int | str:
    """The size of the file at ``path``, opened as it is (never created), or why it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as error:
        return str(error)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
