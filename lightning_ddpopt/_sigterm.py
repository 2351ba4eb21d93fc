"""Lightning's SIGTERM handling for ranks that meet only at syncs (local SGD's local phase).

Lightning 2.x broadcasts rank 0's SIGTERM flag before every training batch (``_broadcast_sigterm_tensor``), which
makes every batch a barrier: each step lasts as long as the slowest rank's. Its signal handler
(``_sigterm_notifier_fn``) broadcasts too, from inside the handler, to be matched by the other ranks' next per-batch
broadcast. Between local SGD's syncs the ranks need not meet, so in the local phase:

* the per-batch check runs at the first batch(es) of each sync window only, the same batches on every rank: Lightning's
  broadcast first (it matches a handler's broadcast left from the warm-up), then an all-reduce of every rank's own
  flag, so a SIGTERM that reached *any* rank stops every rank after that same batch;
* the signal handler only records the signal (and, as Lightning's, passes it to the processes its launcher started):
  a handler that communicated would wait for the others' next check, and meanwhile they may be waiting for it in a
  sync, which is a deadlock.

A SIGTERM therefore stops the ranks together at most one sync window later. In the warm-up both keep Lightning's
behaviour. Installed on one trainer's loop and signal connector (instance attributes), removed at teardown; with a
Lightning that lacks either method nothing is changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

__all__ = ["SigtermAtSyncs"]

log = logging.getLogger(__name__)

#: () -> (in the local phase, the next batch opens a sync window); the same on every rank.
Phase = Callable[[], tuple[bool, bool]]


class SigtermAtSyncs:
    """Lightning's per-batch SIGTERM check and handler, for the local phase (see the module doc)."""

    def __init__(self, trainer: pl.Trainer, phase: Phase, device: torch.device) -> None:
        self.trainer, self.phase, self.device = trainer, phase, device
        self.loop: Any = trainer.fit_loop.epoch_loop
        self.connector: Any = trainer._signal_connector
        self.pending = False  # this rank received a SIGTERM in the local phase
        self._lightning_check = getattr(type(self.loop), "_broadcast_sigterm_tensor", None)
        self._lightning_notifier = getattr(type(self.connector), "_sigterm_notifier_fn", None)

    def install(self) -> bool:
        """Replace the check and the handler on this trainer (before Lightning registers its handlers)."""
        if self._lightning_check is None or self._lightning_notifier is None:
            return False
        self.loop._broadcast_sigterm_tensor = self._check
        self.connector._sigterm_notifier_fn = self._notify
        return True

    def remove(self) -> None:
        """Lightning's own again (a registered handler stays registered until Lightning restores the old ones)."""
        self.loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        self.connector.__dict__.pop("_sigterm_notifier_fn", None)

    def _check(self) -> None:
        local, window_starts = self.phase()
        if not local:
            self._lightning_check(self.loop)  # type: ignore[misc]
            return
        if not window_starts:
            return
        self._lightning_check(self.loop)  # type: ignore[misc]  # rank 0's flag, raising on every rank if set
        flag = torch.tensor([int(self.pending)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            # Every rank at this same batch: Lightning raises its SIGTERMException after the batch, on each of them.
            self.connector.received_sigterm = True

    def _notify(self, signum: int, frame: FrameType | None) -> None:
        local, _ = self.phase()
        if not local:
            self._lightning_notifier(self.connector, signum, frame)  # type: ignore[misc]
            return
        log.info(
            rank_prefixed_message(
                f"Received SIGTERM: {signum}; stopping with the other ranks at the next sync window",
                self.trainer.local_rank,
            )
        )
        if not self.pending and not self.connector.received_sigterm:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.pending = True
