"""When the ranks meet: the one rule a callback follows before a collective of its own during training.

A collective makes every rank wait for the slowest. Where the ranks meet anyway (a gradient sync, a local SGD
parameter sync) a small collective after it costs a round trip; anywhere else it is a barrier the training did not
have. Between local SGD's syncs the ranks train apart on purpose, so there the measuring callbacks keep their
figures local and exchange them where the ranks meet next. The strategy's local SGD loop knows the schedule
(:class:`~lightning_ddpopt.localsgd.LocalSGD`); this module is what callbacks ask. Every answer is the same on every
rank, so every rank enters a callback's collective or none does.
"""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["gradients_synchronised", "next_step_meets", "ranks_meet"]


def ranks_meet(trainer: pl.Trainer) -> bool:
    """Whether the ranks have met in the current training batch: ask in ``on_train_batch_end``.

    ``True`` in every batch that synchronises gradients (any strategy, and the warm-up of local SGD); in the local
    phase of :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s local SGD, only in a batch one of whose optimizer
    steps took part in a parameter sync (see :func:`next_step_meets`).
    """
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    return getattr(local_sgd, "met_in_batch", True) is not False


def next_step_meets(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step about to be taken meets the other ranks: ask in ``on_before_optimizer_step``.

    ``True`` when it synchronises gradients; in local SGD's local phase, when it takes part in a parameter sync (the
    sync, or the start of one that travels while the ranks train on).
    """
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    return getattr(local_sgd, "next_step_meets", True) is not False


def gradients_synchronised(trainer: pl.Trainer) -> bool:
    """Whether the current training batch synchronises gradients through DDP.

    ``False`` only in the local phase of :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s local SGD (under
    Lightning's own post-local SGD, ``model_averaging_period``, it is ``True``: the strategy cannot tell).
    """
    local_sgd = getattr(trainer.strategy, "local_sgd", None)
    return getattr(local_sgd, "gradients_sync", True) is not False
