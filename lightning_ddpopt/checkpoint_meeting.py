"""Every rank's meeting at a checkpoint save, with a timeout that waits on for ranks still training, and the gather.

A save that needs every rank (per-rank state to write or gather) first meets them on the process group's store,
not in a collective, so that a rank that never comes fails the save on every rank, naming it, instead of hanging
until the process-group timeout; see :mod:`lightning_ddpopt.checkpoint` for the contract. Used by
:class:`~lightning_ddpopt.core.StrategyCore`.

The terms used here (round, verdict, meeting, travel, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_ddpopt._compat import default_store
from lightning_ddpopt._groups import destroy_owned_group

__all__ = ["HEARTBEAT_S", "RankStates", "gather_hook_states"]

#: Seconds between two beats of a rank that trains apart (see :meth:`RankStates.beat`).
HEARTBEAT_S = 1.0


class RankStates:
    """Gathers a per-rank state to rank 0 at a save; each gather's meeting has a name of its own on the store.

    Args:
        timeout_s: how long a gather waits for every rank before it raises.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._run = ""
        self._gathers = 0
        self._beats = 0
        self._last_beat = -math.inf
        self._cpu_group: dist.ProcessGroup | None = None  # ours, when the default group serves no CPU tensors

    def name_run(self, nonce: str) -> None:
        """Name this run's meetings (the same ``nonce`` on every rank): the store outlives a Trainer."""
        self._run = nonce

    def beat(self, rank: int) -> None:
        """Tell the store that this rank still trains (while local SGD trains apart), at most once per interval.

        A save waits for a rank as long as its beats go on (see the module doc); a quarter of ``timeout_s`` apart at
        most, so that a rank that trains on shows progress within every timeout.
        """
        now = time.monotonic()
        if now - self._last_beat < min(HEARTBEAT_S, self.timeout_s / 4):
            return
        self._last_beat = now
        self._beats += 1
        default_store().set(_progress_key(self._run, rank), str(self._beats))

    def agree(self, *, rank: int, world_size: int) -> str:
        """Meet every rank as a gather does (see :meth:`gather`), for a collective of someone else's to follow.

        Returns the meeting's name, the same on every rank and unique to this run's save.
        """
        self._gathers += 1
        tag = f"{self._run}/{self._gathers}"
        if world_size > 1:
            _agree_to_gather(rank, world_size, self.timeout_s, self._run, tag)
        return tag

    def gather(self, state: dict[str, Any], *, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every rank's ``state`` on rank 0, an empty list on the others; every rank must call it."""
        self._gathers += 1
        tag = f"{self._run}/{self._gathers}"
        gathered = gather_hook_states(
            state,
            rank=rank,
            world_size=world_size,
            timeout_s=self.timeout_s,
            tag=tag,
            group=self.cpu_group,
            run=self._run,
        )
        return gathered or []

    def close(self) -> None:
        """Destroy the CPU group of our own, if one was made (at teardown)."""
        destroy_owned_group(self, "_cpu_group")

    def cpu_group(self) -> dist.ProcessGroup | None:
        """A group whose collectives take CPU tensors: ``None`` for the default one when it does.

        It does with gloo or a ``"cpu:gloo,cuda:nccl"`` pair; otherwise a gloo group of our own over every rank is
        made at the first save (every rank saves at the same point).
        """
        if "gloo" in str(dist.get_backend()):
            return None
        if self._cpu_group is None:
            self._cpu_group = dist.new_group(backend="gloo")
        return self._cpu_group


def gather_hook_states(
    state: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    tag: str,
    group: Callable[[], dist.ProcessGroup | None] = lambda: None,
    run: str = "",
) -> list[dict[str, Any]] | None:
    """Every rank's ``state``, on rank 0 (``None`` on the others), its tensors on the CPU.

    Every rank must call it, with the same ``tag``, unique to this save in this process group's life. ``group()``
    gives a group of all ranks (``None``: the default group) that takes CPU tensors, once every rank has arrived:
    each rank's state, moved to the CPU, travels to rank 0 there, one rank after another, so rank 0 never holds more
    than one pickled state at a time.

    Raises:
        RuntimeError: not every rank arrived within ``timeout_s`` (the message names the missing ranks).
    """
    if world_size == 1:
        return [state]
    _agree_to_gather(rank, world_size, timeout_s, run, tag)
    on = group()
    cpu = torch.device("cpu")
    state = move_data_to_device(state, cpu)
    if rank != 0:
        dist.send_object_list([state], dst=0, group=on, device=cpu)
        return None
    gathered = [state]
    for source in range(1, world_size):
        received: list[Any] = [None]
        dist.recv_object_list(received, src=source, group=on, device=cpu)
        gathered.append(received[0])
    return gathered


def _agree_to_gather(rank: int, world_size: int, timeout_s: float, run: str, tag: str) -> None:
    """Meet the other ranks on the process group's store (not in a collective, so a no-show cannot hang it).

    Every rank marks its arrival; rank 0 waits for all of them and publishes one verdict that every rank follows, so
    a rank arriving late cannot enter the gather alone. Each wait lasts ``timeout_s`` and goes on while the ranks it
    waits for show progress (:meth:`RankStates.beat`): rank 0 waits for the missing ranks, the others for rank 0's
    verdict, and for rank 0's own progress or its going on waiting.
    """
    store = default_store()
    arrived = [f"ddpopt/checkpoint/{tag}/arrived/{other}" for other in range(world_size)]
    verdict_key, waiting_key = f"ddpopt/checkpoint/{tag}/verdict", f"ddpopt/checkpoint/{tag}/waiting"
    store.set(arrived[rank], "1")
    if rank == 0:
        missing = list(range(1, world_size))
        seen = _progress(store, run, missing)
        rounds = 0
        while True:
            try:
                store.wait(arrived, timedelta(seconds=timeout_s))
                verdict = "ok"
                break
            except RuntimeError:
                missing = [other for other, key in enumerate(arrived) if not store.check([key])]
                now = _progress(store, run, missing)
                if any(now[other] in (None, seen.get(other)) for other in missing):
                    verdict = ",".join(str(other) for other in missing)
                    break
                seen, rounds = now, rounds + 1
                store.set(waiting_key, str(rounds))  # the ranks that arrived wait on with rank 0
        store.set(verdict_key, verdict)
    else:
        seen = {0: _progress(store, run, [0])[0], -1: _read(store, waiting_key)}
        while True:
            try:
                store.wait([verdict_key], timedelta(seconds=2 * timeout_s))
                verdict = store.get(verdict_key).decode()
                break
            except RuntimeError:
                now = {0: _progress(store, run, [0])[0], -1: _read(store, waiting_key)}
                if all(now[key] is None or now[key] == seen[key] for key in now):
                    verdict = "0"
                    break
                seen = now
    if verdict != "ok":
        missing = [int(other) for other in verdict.split(",")]
        raise RuntimeError(
            "ddpopt: saving a checkpoint needs every rank (each saves its own comm-hook or local SGD state), but "
            f"rank(s) {missing} did not call save_checkpoint within {timeout_s:g} s. Call trainer.save_checkpoint on "
            "every rank, as Lightning's DDP strategies require (ModelCheckpoint does)."
        )


def _progress_key(run: str, rank: int) -> str:
    return f"ddpopt/progress/{run}/{rank}"


def _progress(store: dist.Store, run: str, ranks: list[int]) -> dict[int, str | None]:
    """Each rank's last beat in this run (``None``: it never beat)."""
    return {rank: _read(store, _progress_key(run, rank)) for rank in ranks}


def _read(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None
