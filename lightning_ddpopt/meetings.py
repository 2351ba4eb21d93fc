"""When the ranks meet: the one rule a callback follows before a collective of its own during training.

A collective makes every rank wait for the slowest. Where the ranks meet anyway (a gradient sync, a local SGD
parameter sync) a small collective after it costs a round trip; anywhere else it is a barrier the training did not
have. Between local SGD's syncs the ranks train apart on purpose, so there the measuring callbacks keep their
figures local and exchange them where the ranks meet next. The strategy's local SGD loop knows the schedule
(:class:`~lightning_ddpopt.localsgd.LocalSGD`); this module is what callbacks ask. Every answer is the same on every
rank, so every rank enters a callback's collective or none does.

An overlapped sync's start is a meeting *in passing* (:func:`meets_in_passing`): the ranks start the sync there and
train on without waiting for each other, so a blocking collective there would be a barrier the training does not
have. There a callback starts its collective and reads it at its next meeting (:class:`Exchange`), by when every rank
has long sent its part.

Where DDP synchronised the gradients with a hook whose result every rank shares (:func:`gradients_identical`), a
check of the gradients decides alike on every rank without any collective; where that hook tested the reduced
values already (:func:`hook_found_finite`), its verdict is the check.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.hooks.base import ErrorFeedbackState
from lightning_ddpopt.localsgd import LocalSGD
from lightning_ddpopt.measuring import CoreViews

__all__ = [
    "Exchange",
    "gradients_identical",
    "gradients_synchronised",
    "hook_found_finite",
    "meets_in_passing",
    "next_step_meets",
    "ranks_meet",
]


def ranks_meet(trainer: pl.Trainer) -> bool:
    """Whether the ranks have met in the current training batch: ask in ``on_train_batch_end``.

    ``True`` in every batch that synchronises gradients (any strategy, and the warm-up of local SGD); in the local
    phase of :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s local SGD, only in a batch one of whose optimizer
    steps took part in a parameter sync (see :func:`next_step_meets`).
    """
    local_sgd = _outer_loop(trainer)
    return local_sgd is None or local_sgd.met_in_batch


def next_step_meets(trainer: pl.Trainer) -> bool:
    """Whether the optimizer step about to be taken meets the other ranks: ask in ``on_before_optimizer_step``.

    ``True`` when it synchronises gradients; in local SGD's local phase, when it takes part in a parameter sync (the
    sync, or the start of one that is in flight while the ranks train on).
    """
    local_sgd = _outer_loop(trainer)
    return local_sgd is None or local_sgd.next_step_meets


def gradients_synchronised(trainer: pl.Trainer) -> bool:
    """Whether the current training batch synchronises gradients through DDP.

    ``False`` only in the local phase of :class:`~lightning_ddpopt.OptimizedDDPStrategy`'s local SGD (under
    Lightning's own post-local SGD, ``model_averaging_period``, it is ``True``: the strategy cannot tell).
    """
    local_sgd = _outer_loop(trainer)
    return local_sgd is None or local_sgd.gradients_sync


def gradients_identical(trainer: pl.Trainer) -> bool:
    """Whether every rank holds the same gradients before the current optimizer step.

    A check of them then decides alike on every rank without a collective. ``True`` when
    :class:`~lightning_ddpopt.OptimizedDDPStrategy` synchronised the batch's gradients with its own hooks (DDP's
    allreduce or a registry hook: each rank receives the same result) over every parameter; ``False`` for any other
    strategy, a user's hook, parameters DDP ignores, Lightning's post-local SGD and local SGD's local phase.
    """
    strategy = trainer.strategy
    return isinstance(strategy, CoreViews) and strategy.synced_gradients_identical and gradients_synchronised(trainer)


def hook_found_finite(trainer: pl.Trainer) -> bool | None:
    """Whether the hook that synchronised this step's gradients found every value it reduced finite, on a CPU.

    Ask after backward, once a step, where :func:`gradients_identical` holds. The lossy hooks (int8, PowerSGD and
    their two-tier forms) test their all-reduced values anyway, for their error feedback: int8's block scales,
    PowerSGD's factors and the values sent exactly, a small fraction of the gradient. A non-finite value on any rank
    makes what it was reduced into non-finite, so that verdict covers every rank's gradients and is the same on
    every rank. ``None`` where there is none to take (another hook, PowerSGD's exact warm-up, a second call in the
    step), it is on a GPU (read there, it would make the host wait for the device), or the gradients were averaged
    across fault-tolerant islands after the hook (its verdict saw only this island's): check for yourself then.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, CoreViews) or strategy.fault_tolerance_stats is not None:
        return None  # fault-tolerant islands average across the islands after the hook: its verdict saw one island
    state = strategy.comm_state
    verdict = state.take_verdict() if isinstance(state, ErrorFeedbackState) else None
    return None if verdict is None or verdict.is_cuda else bool(verdict)


def meets_in_passing(trainer: pl.Trainer) -> bool:
    """Whether a meeting (:func:`ranks_meet`, :func:`next_step_meets`) is one in passing: ranks do not wait there.

    ``True`` in the local phase of local SGD with ``overlap_steps``, whose syncs are in flight while the ranks train
    on; a callback's collective there must not block (:class:`Exchange`).
    """
    local_sgd = _outer_loop(trainer)
    return local_sgd is not None and local_sgd.meets_in_passing


def _outer_loop(trainer: pl.Trainer) -> LocalSGD | None:
    """The strategy's local SGD loop, which knows the schedule: ``None`` for any other strategy, or without it."""
    strategy = trainer.strategy
    return strategy.local_sgd if isinstance(strategy, CoreViews) else None


class Exchange:
    """A callback's all-gather of one fixed-size tensor at each of its meetings; in passing, it stays in flight.

    Call :meth:`gather` at a meeting, on every rank alike: where the ranks wait for each other it returns every rank's
    tensor at once; in passing it starts the all-gather and returns ``None``, and the gathered result comes out of
    :meth:`arrived` at the next meeting (or the end of fit) - long arrived by then, so no rank waits for another. On a
    GPU every gather but the end of fit's stays in flight: the collective and a copy into pinned host memory are
    queued and read at the next meeting, so the host never waits for the device.
    """

    def __init__(self) -> None:
        self._in_flight: Callable[[], torch.Tensor] | None = None

    def arrived(self) -> torch.Tensor | None:
        """Every rank's tensor (stacked, ``(world, ...)``) from the gather in flight since the last meeting."""
        in_flight, self._in_flight = self._in_flight, None
        return in_flight() if in_flight is not None else None

    def gather(
        self, local: torch.Tensor, world_size: int, in_passing: bool, final: bool = False
    ) -> torch.Tensor | None:
        """Every rank's ``local`` (stacked), or ``None`` while it is in flight (read it with :meth:`arrived`).

        It stays in flight ``in_passing``, and on a GPU unless ``final`` (the end of fit, where the result is needed
        now). A gather still in flight must have been read first: its result would be lost.
        """
        assert self._in_flight is None, "read the gather in flight (arrived) before starting another"
        in_flight = in_passing or (local.is_cuda and not final)
        if local.is_cuda and in_flight:
            # Into one tensor, read on a stream of its own (DeferredRead): the compute stream never waits for it.
            out = torch.empty((world_size, *local.shape), dtype=local.dtype, device=local.device)
            work = dist.all_gather_into_tensor(out, local, async_op=True)
            self._in_flight = DeferredRead(out, work, inputs=(local,)).read
            return None
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        if not in_flight:
            dist.all_gather(gathered, local)
            return torch.stack(gathered)
        work = dist.all_gather(gathered, local, async_op=True)
        assert work is not None
        self._in_flight = lambda: _waited(work, gathered)
        return None

    def drop(self) -> None:
        """Forget a gather in flight (teardown): every rank started it, so it finishes without us."""
        self._in_flight = None


def _waited(work: dist.Work, gathered: list[torch.Tensor]) -> torch.Tensor:
    work.wait()
    return torch.stack(gathered)
