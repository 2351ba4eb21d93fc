"""Process-group lifetime: groups of our own, and destroying groups without deadlocking gloo's worker threads."""

from __future__ import annotations

import atexit
import gc
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["destroy_group", "destroy_process_group_at_exit", "group_like"]

_EXIT_HANDLER_REGISTERED = False


def group_like(group: dist.ProcessGroup | None, backend: str, timeout: timedelta | None) -> dist.ProcessGroup:
    """A new process group over ``group``'s ranks, for traffic that must not interleave with ``group``'s."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend=backend, timeout=timeout)


def destroy_group(group: dist.ProcessGroup | None = None) -> None:
    """Destroy ``group`` (``None``: the default group and every other), if the default group still exists.

    gloo's backend joins its worker threads when it is destroyed. A worker may be finishing a future's Python
    callback (a comm hook's chain, an overlapped sync), which needs the GIL. torch 2.4 destroys the backend with the
    GIL held, from the process group's destructor: a deadlock. Here the backends' last references are held in
    Python and released after torch has forgotten the group; torch releases the GIL while it destroys a backend
    that way, so the callback runs and the join returns. Later torch releases are unaffected either way.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    target = group if group is not None else dist.group.WORLD
    backends = []
    for device in ("cpu", "cuda"):
        try:
            backends.append(target._get_backend(torch.device(device)))  # type: ignore[union-attr]
        except RuntimeError:  # no backend for this device type in this group
            pass
    dist.destroy_process_group(group)
    del target
    backends.clear()


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group at exit, while the interpreter still runs (registered once per process).

    Lightning does this for NCCL only. A gloo group left to interpreter shutdown is destroyed there, and its worker
    threads may still have Python callbacks of our comm hooks' futures to run or release; a thread that asks for the
    GIL during shutdown is ended by Python mid-way and the process aborts ("terminate called without an active
    exception", about 1 in 80 loaded runs). Destroyed from ``atexit``, the group's threads finish and are joined
    first, provided nothing else still holds the group (the strategy's own references are gone after teardown; a
    user's ``comm_state`` with an explicit group, or a DDP module kept alive, would keep it to shutdown).
    """
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_at_exit)
        _EXIT_HANDLER_REGISTERED = True


def _destroy_at_exit() -> None:
    # Collect reference cycles first: the group's threads are joined only when its last reference goes.
    gc.collect()
    destroy_group()
