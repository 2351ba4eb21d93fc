"""When the ranks meet: the one rule a callback follows before a collective of its own during training.

A collective makes every rank wait for the slowest. Where the ranks meet anyway (a gradient sync, a local SGD
parameter sync) a small collective after it costs a round trip; anywhere else it is a barrier the training did not
have. Between local SGD's syncs the ranks train apart on purpose, so there the measuring callbacks keep their
figures local and exchange them at the next batch in which the ranks meet. The strategy owns the schedule (its
local SGD loop knows the training mode); this module is what callbacks ask.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["gradients_synchronised", "ranks_meet"]


def ranks_meet(trainer: pl.Trainer) -> bool:
    """Whether the ranks meet in the current training batch anyway: the same answer on every rank.

    ``True`` in every batch that synchronises gradients (any strategy, and the warm-up of local SGD); in the local
    phase of :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s local SGD, only in a batch whose optimizer step
    takes part in a parameter sync (from ``on_train_batch_end`` on, once the step is taken): the sync itself, or
    the start of one that travels while the ranks train on (applying it later waits for the slower rank's start
    anyway). Outside training batches (a fit's start or end) the ranks meet.
    """
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    return getattr(local_sgd, "met_in_batch", True) is not False


def gradients_synchronised(trainer: pl.Trainer) -> bool:
    """Whether the current training batch synchronises gradients (``False`` in local SGD's local phase)."""
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    return getattr(local_sgd, "gradients_sync", True) is not False
