"""Process-group lifetime: groups of our own, and destroying groups without deadlocking gloo's worker threads."""

from __future__ import annotations

import atexit
import functools
import gc
from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from lightning_ddpopt._compat import group_backends

__all__ = ["destroy_all_groups", "destroy_owned_group", "destroy_process_group_at_exit", "group_like"]


def group_like(group: dist.ProcessGroup | None, backend: str, timeout: timedelta | None) -> dist.ProcessGroup:
    """A new process group over ``group``'s ranks, for traffic that must not interleave with ``group``'s."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def destroy_owned_group(owner: object, attribute: str) -> None:
    """Destroy the group that ``owner.attribute`` holds, which must be its last reference, and set it to ``None``.

    gloo's backend joins its worker threads when it is destroyed, and a worker may be finishing a future's Python
    callback (a comm hook's chain, an overlapped sync), which needs the GIL. torch 2.4 destroys a group's backends
    with the GIL held when the group itself goes: a deadlock. Here the backends' references are held in Python while
    the group goes, and released after it; torch releases the GIL while it destroys a backend that way, so the
    callback runs and the join returns. Later torch releases are unaffected either way.
    """
    group = getattr(owner, attribute)
    setattr(owner, attribute, None)
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    backends = group_backends(group)
    dist.destroy_process_group(group)
    del group
    backends.clear()


def destroy_all_groups() -> None:
    """Destroy the default group and with it every other (torch's rule for the default group), as above."""
    if dist.is_available() and dist.is_initialized():
        destroy_owned_group(SimpleNamespace(group=dist.group.WORLD), "group")


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at exit, while the interpreter still runs (registered once per process).

    Lightning does this for NCCL only. A gloo group left to interpreter shutdown is destroyed there, and its worker
    threads may still have Python callbacks of our comm hooks' futures to run or release; a thread that asks for the
    GIL during shutdown is ended by Python mid-way and the process aborts ("terminate called without an active
    exception", about 1 in 80 loaded runs). Destroyed from ``atexit``, the group's threads finish and are joined
    first, provided nothing else still holds the group (the strategy's own references are gone after teardown; a
    user's ``comm_state`` with an explicit group, or a DDP module kept alive, would keep it to shutdown).
    """
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    # Collect reference cycles first: the group's threads are joined only when its last reference goes.
    gc.collect()
    destroy_all_groups()
