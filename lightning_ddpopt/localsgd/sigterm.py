"""Lightning's SIGTERM handling for ranks that meet only at syncs (local SGD).

Lightning 2.x broadcasts rank 0's SIGTERM flag before every training batch (``_broadcast_sigterm_tensor``), which
makes every batch a barrier: each step lasts as long as the slowest rank's. Its signal handler
(``_sigterm_notifier_fn``) broadcasts too, from inside the handler, to be matched by the other ranks' next per-batch
broadcast. Between local SGD's syncs the ranks need not meet, and they would be waiting in a sync meanwhile (a
deadlock), so with local SGD on more than one rank:

* the signal handler only records the signal (and, as Lightning's, passes it to the processes its launcher started);
* the per-batch check meets the other ranks in the warm-up (an all-reduce of every rank's flag, before every batch,
  as the gradient syncs make those batches barriers anyway) and at the first batch(es) of each sync window, the same
  batches on every rank. In the local phase that meeting is not a barrier either: it *starts* the all-reduce of
  every rank's flag and reads the one the previous window started, long finished by then, so a rank that lost time
  to its machine is not waited for (with an overlapped sync, the faster rank runs on until the sync's arrival). A
  SIGTERM that reached *any* rank stops every rank after the same batch (Lightning's check hears rank 0 only): at
  the window after the one whose meeting carried it, at most two windows later. A signal after the second-to-last
  window's meeting is not acted on: training ends as planned.

Installed on one trainer's loop and signal connector (instance attributes) before Lightning registers its handlers,
removed at teardown; with a Lightning that lacks either method nothing is changed (and a warning says so).

The terms used here (round, verdict, meeting, in flight, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

from lightning_ddpopt._compat import SigtermPatch, replace_sigterm_hooks
from lightning_ddpopt.deferred import DeferredRead, to_device

__all__ = ["SigtermAtSyncs"]

log = logging.getLogger(__name__)

#: () -> (in the local phase, the next batch opens a sync window or is in the warm-up, optimizer steps so far); the
#: same on every rank.
Phase = Callable[[], tuple[bool, bool, int]]


class SigtermAtSyncs:
    """Lightning's per-batch SIGTERM check and handler for ranks that meet only at syncs (see the module doc)."""

    def __init__(self, trainer: pl.Trainer, phase: Phase, device: torch.device) -> None:
        self.trainer, self.phase, self.device = trainer, phase, device
        self._patch: SigtermPatch | None = None
        self.pending = False  # this rank received a SIGTERM
        # The local phase's meeting still in flight: its work and every rank's flag, all-reduced into it.
        self._in_flight: DeferredRead | None = None
        self._met_at_step = -1  # the optimizer step whose first batch met in passing (once per window)

    def install(self) -> bool:
        """Replace the check and the handler on this trainer (before Lightning registers its handlers)."""
        self._patch = replace_sigterm_hooks(self.trainer, self._check, self._notify)
        return self._patch is not None

    def remove(self) -> None:
        """Lightning's own again (a registered handler stays registered until Lightning restores the old ones).

        A meeting still in flight is dropped: every rank started it at the same batch, so it finishes without us.
        """
        self._in_flight = None
        if self._patch is not None:
            self._patch.remove()

    def _check(self) -> None:
        local, window_starts, step = self.phase()
        if not window_starts:
            return
        if not local:
            self._meet()
        elif step != self._met_at_step:  # with accumulation: the window's first micro-batch only
            self._met_at_step = step
            self._meet_in_passing()

    def _received(self) -> bool:
        return self._patch is not None and self._patch.received_sigterm

    def _flag(self) -> torch.Tensor:
        return to_device(torch.tensor([int(self.pending or self._received())]), self.device)

    def _meet(self) -> None:
        """Every rank's flag, all-reduced: if any rank received a SIGTERM, every rank stops after this batch."""
        flag = self._flag()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._act_on(flag)

    def _meet_in_passing(self) -> None:
        """Read the previous window's meeting, start this window's: every rank alike, none waiting for another."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._act_on(in_flight.read())
        flag = self._flag()
        # On a GPU read on a stream of its own: the compute stream never waits for the others' flags.
        self._in_flight = DeferredRead(flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))

    def _act_on(self, flag: torch.Tensor) -> None:
        if flag.item():
            # Every rank at this same batch: Lightning raises its SIGTERMException after the batch, on each of them.
            assert self._patch is not None
            self._patch.record_sigterm()

    def _notify(self, signum: int, frame: FrameType | None) -> None:
        log.info(
            rank_prefixed_message(
                f"Received SIGTERM: {signum}; stopping with the other ranks within two sync windows",
                self.trainer.local_rank,
            )
        )
        if not self.pending and not self._received():
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.pending = True
