"""Every rank's meeting at a checkpoint save (a monitored barrier), and the gather of per-rank states to rank 0.

A save that needs every rank (per-rank state to write or gather) first meets them in gloo's monitored barrier, under
the process group's timeout unless ``checkpoint_timeout`` sets a shorter one: a rank that never comes fails the save
on rank 0 with torch's message naming it (the other ranks wait for rank 0 as long as the process group's timeout),
instead of a gather that hangs. The barrier and the gather run on a gloo group of their own, made at setup where
saves will need it: a barrier that timed out closes its group's connections, and training's group must go on (a
later save then says so at once). Nothing is written to the store. See :mod:`lightning_ddpopt.checkpoint` for the
contract. Used by :class:`~lightning_ddpopt.core.StrategyCore`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_ddpopt._groups import destroy_owned_group

__all__ = ["RankStates"]


class RankStates:
    """Meets every rank at a save and gathers a per-rank state to rank 0.

    Args:
        timeout_s: how long a save waits for every rank before it raises; ``None``: the process group's timeout
            (given to :meth:`start`).
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._group_timeout: timedelta | None = None
        self._run = ""
        self._saves = 0
        #: The saves' gloo group over every rank (``None`` with one rank, or before a save needs it).
        self.group: dist.ProcessGroup | None = None
        self._failed: str | None = None

    def name_run(self, nonce: str) -> None:
        """Name this run's saves (the same ``nonce`` on every rank), so that each save's id is unique to it."""
        self._run = nonce

    def start(self, timeout: timedelta | None, needed: bool) -> None:
        """Take the process group's ``timeout``; make the saves' group now if a save will need it (``needed``).

        Every rank calls it at the same point of setup. A run whose saves need no meeting (a stateless hook without
        local SGD) makes no group; a save that needs one later (after teardown, say) makes it then.
        """
        self._group_timeout = timeout
        if needed:
            self._make_group(timeout)

    def agree(self, *, rank: int, world_size: int) -> str:
        """Meet every rank (see the module doc); return the save's id, the same on every rank and unique to it.

        Raises:
            RuntimeError: a rank did not arrive within the timeout (on rank 0, naming the first missing one; the
                others wait for rank 0 as long as the process group's timeout), or an earlier save's meeting failed
                and closed the saves' group.
        """
        self._saves += 1
        if world_size > 1:
            if self._failed is not None:
                raise RuntimeError(
                    "ddpopt: saving a checkpoint needs the ranks' save meeting, which an earlier save on fewer ranks "
                    f"closed ({self._failed}); call save_checkpoint on every rank"
                )
            timeout = self._group_timeout or timedelta(minutes=30)
            if self.timeout_s is not None:
                timeout = timedelta(seconds=self.timeout_s)
            try:
                # Made here where setup made none (a stateless hook, or after teardown): its making is the meeting.
                group = self._make_group(timeout)
                dist.monitored_barrier(group=group, timeout=timeout)
            except RuntimeError as error:
                self._failed = str(error).splitlines()[0]  # torch's line naming the rank; gloo's detail follows
                raise RuntimeError(
                    "ddpopt: saving a checkpoint needs every rank (each saves its own comm-hook or local SGD state), "
                    f"but not every rank called save_checkpoint within {timeout.total_seconds():g} s "
                    f"({self._failed}). Call trainer.save_checkpoint on every rank, as Lightning's DDP strategies "
                    "require (ModelCheckpoint does)."
                ) from None
        return f"{self._run}/{self._saves}"

    def gather(self, state: dict[str, Any], *, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every rank's ``state`` on rank 0 (its tensors on the CPU), an empty list on the others.

        Every rank must call it. After the meeting each rank's state goes to rank 0 one rank after another, so
        rank 0 never holds more than one pickled state at a time.
        """
        if world_size == 1:
            return [state]
        self.agree(rank=rank, world_size=world_size)
        group, cpu = self.group, torch.device("cpu")
        state = move_data_to_device(state, cpu)
        if rank != 0:
            dist.send_object_list([state], dst=0, group=group, device=cpu)
            return []
        gathered = [state]
        for source in range(1, world_size):
            received: list[Any] = [None]
            dist.recv_object_list(received, src=source, group=group, device=cpu)
            gathered.append(received[0])
        return gathered

    def close(self) -> None:
        """Destroy the saves' group (at teardown); a save after it makes another, on every rank alike."""
        destroy_owned_group(self, "group")
        self._failed = None

    def _make_group(self, timeout: timedelta | None) -> dist.ProcessGroup | None:
        """The saves' group, made on first need; ``timeout`` bounds its making and every wait in it but rank 0's.

        At setup it is the process group's (making a group waits for every rank, which may take longer there than a
        save should wait); made by a save, the save's. A group made after teardown is destroyed with the default
        group at exit; it runs no Python callbacks in gloo's threads, so that is safe on every torch.
        """
        if self.group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        return self.group
