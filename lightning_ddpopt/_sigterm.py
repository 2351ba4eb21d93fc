"""Lightning's SIGTERM handling for ranks that meet only at syncs (local SGD).

Lightning 2.x broadcasts rank 0's SIGTERM flag before every training batch (``_broadcast_sigterm_tensor``), which
makes every batch a barrier: each step lasts as long as the slowest rank's. Its signal handler
(``_sigterm_notifier_fn``) broadcasts too, from inside the handler, to be matched by the other ranks' next per-batch
broadcast. Between local SGD's syncs the ranks need not meet, and they would be waiting in a sync meanwhile (a
deadlock), so with local SGD on more than one rank:

* the signal handler only records the signal (and, as Lightning's, passes it to the processes its launcher started);
* the per-batch check meets the other ranks in the warm-up and at the first batch(es) of each sync window only, the
  same batches on every rank, with an all-reduce of every rank's flag: a SIGTERM that reached *any* rank stops every
  rank after that same batch (Lightning's check hears rank 0 only), at most one sync window later. A signal after
  the last window's check is not acted on: training ends as planned.

Installed on one trainer's loop and signal connector (instance attributes) before Lightning registers its handlers,
removed at teardown; with a Lightning that lacks either method nothing is changed.
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

#: () -> (in the local phase, the next batch opens a sync window or is in the warm-up); the same on every rank.
Phase = Callable[[], tuple[bool, bool]]


class SigtermAtSyncs:
    """Lightning's per-batch SIGTERM check and handler for ranks that meet only at syncs (see the module doc)."""

    def __init__(self, trainer: pl.Trainer, phase: Phase, device: torch.device) -> None:
        self.trainer, self.phase, self.device = trainer, phase, device
        self.loop: Any = trainer.fit_loop.epoch_loop
        self.connector: Any = trainer._signal_connector
        self.pending = False  # this rank received a SIGTERM

    def install(self) -> bool:
        """Replace the check and the handler on this trainer (before Lightning registers its handlers)."""
        loop_check = getattr(type(self.loop), "_broadcast_sigterm_tensor", None)
        notifier = getattr(type(self.connector), "_sigterm_notifier_fn", None)
        if loop_check is None or notifier is None:
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
        if local and not window_starts:
            return
        self._meet()

    def _meet(self) -> None:
        """Every rank's flag, all-reduced: if any rank received a SIGTERM, every rank stops after this batch."""
        flag = torch.tensor([int(self.pending or self.connector.received_sigterm)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            # Every rank at this same batch: Lightning raises its SIGTERMException after the batch, on each of them.
            self.connector.received_sigterm = True

    def _notify(self, signum: int, frame: FrameType | None) -> None:
        log.info(
            rank_prefixed_message(
                f"Received SIGTERM: {signum}; stopping with the other ranks at their next meeting",
                self.trainer.local_rank,
            )
        )
        if not self.pending and not self.connector.received_sigterm:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.pending = True
