"""PowerSGD's per-rank state: error feedback, warm-start Q memories, the rank in use; saved and restored.

The hook (:mod:`lightning_ddpopt.hooks.powersgd`) runs the chains; this state holds what lives between steps and what
a checkpoint keeps. How a round's state is committed, on the host and on a GPU alike, is
:class:`~lightning_ddpopt.hooks.feedback.ErrorFeedbackState`'s rule; the Q memories follow it here.

The terms used here (round, verdict, meeting, travel, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import DeferredRead, to_device
from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.feedback import ErrorFeedbackState, SyncRound, config_mismatch
from lightning_ddpopt.hooks.orthogonal import random_q
from lightning_ddpopt.hooks.powersgd_config import CPUKernels, PowerSGDConfig, local_cpu_kernels
from lightning_ddpopt.hooks.powersgd_rank import RankChange, RankController

__all__ = ["PowerSGDState"]


class _Regroup:
    """Batched PowerSGD's first round after a resume: compress the groups the saved state was made with.

    DDP starts a fresh module with its initial bucket layout and rebuilds it after the first step, so the first
    resumed round would see buckets that the saved Q memories (keyed by a bucket's parameter names) never saw.
    This round collects the gradients instead and compresses each saved group once all of it has arrived, in
    DDP's bucket order, the same on every rank; a bucket's future completes when all of its gradients are done.
    """

    def __init__(self, groups: list[tuple[str, ...]]) -> None:
        self.groups = groups
        self.group_of = {name: index for index, group in enumerate(groups) for name in group}
        self.arrived: dict[str, torch.Tensor] = {}
        self.done: set[int] = set()
        self.waiting: list[tuple[set[str], torch.futures.Future[torch.Tensor], torch.Tensor]] = []


@dataclass(kw_only=True)
class PowerSGDState(ErrorFeedbackState):
    """PowerSGD's per-rank state: the step counter, error feedback and warm-start memories.

    ``iteration`` advances once per sync round, on the last bucket. Error feedback (kept for compressed matrices
    only: uncompressed tensors are exact) and Q memories are keyed by parameter name (batched: by the bucket's
    joined names), not by bucket index, so they survive DDP's bucket rebuild after the first step and a resume.
    Error feedback differs per rank and is stored with the loss scale it is in (``error_scales``, 1 without a
    GradScaler); Q memories are the same on every rank (they are all-reduced). ``skipped_rounds`` counts rounds
    whose reduced factors were not finite and left the state untouched. Call :meth:`bind_module` with the wrapped
    module before the first step.

    The strategy builds it from ``comm_hook="powersgd"`` or a :class:`PowerSGDConfig`; build one yourself only to
    register :func:`powersgd_hook` on a DDP model of your own.

    Args:
        config: rank, error bound, warm-up and the rest of PowerSGD's settings.
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        ledger: where the hook reports the bytes it sends; ``None`` records nothing.
        loss_scale: returns the current loss scale (the strategy sets it under fp16 AMP); see
            :class:`CommHookState`.
        iteration: sync rounds so far (restored from a checkpoint; leave it 0).
        skipped_rounds: rounds whose reduced values were not finite and left the state untouched.
        errors: each rank's error feedback per parameter name (its own; saved in checkpoints).
        error_scales: the loss scale each error was computed at (1 without a GradScaler).
        q_memories: the warm-start Q of each compressed matrix (the same on every rank).
        pipelined: hand each bucket's chain to a worker thread and return at once (CPU only); it needs a
            ``process_group`` that nothing else uses during the backward pass. The strategy sets it on CPUs.
        cpu_kernels: numba's fused loops, agreed on by every rank (the strategy sets them); ``None``: torch's.
    """

    label: ClassVar[str] = "PowerSGD"

    config: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    q_memories: dict[str, torch.Tensor] = field(default_factory=dict)
    pipelined: bool = False
    cpu_kernels: CPUKernels | None = None
    #: Each matrix's rank and the error bound (:mod:`~lightning_ddpopt.hooks.powersgd_rank`); the same on every rank.
    ranks: RankController = field(init=False)
    #: The element count of each parameter that gets a gradient, in the module's order (set by :meth:`bind_module`).
    gradient_sizes: list[int] = field(default_factory=list, init=False, repr=False)
    _regroup: _Regroup | None = field(default=None, repr=False)
    _worker: Worker | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ranks = RankController(config=self.config)

    @property
    def rank(self) -> int:
        """The highest rank in use (``config.rank``, moved per matrix by ``config.max_error``); alike on every rank."""
        return self.ranks.highest

    def rank_of(self, key: str) -> int:
        """The rank a matrix compresses at this round.

        Args:
            key: the matrix's key: its parameter's name (batched: the bucket's names joined by ``|``).
        """
        return self.ranks.rank_of(key)

    @property
    def rank_changes(self) -> list[RankChange]:
        """``(step, error, old rank, new rank, matrix key)`` for each change of a matrix's rank, in order."""
        return self.ranks.changes

    @property
    def error_bound(self) -> float | None:
        """The error bound in use: ``config.max_error``, ``"auto"`` resolved (see :meth:`fit_bound_to`)."""
        return self.ranks.bound

    def fit_bound_to(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve ``max_error="auto"`` for these optimizers: the adaptive bound if any is adaptive, else the other.

        Args:
            optimizers: the run's optimizers.
        """
        self.ranks.fit_bound_to(optimizers)

    def send_measurement(self) -> None:
        """At the round's last bucket: sum the round's error measurement over the ranks, to be read two rounds later."""
        total = self.ranks.take()
        if total is None:  # not measured, or nothing compressed this round (the same on every rank)
            return
        work = dist.all_reduce(total, group=self.process_group, async_op=True)
        self.ranks.expect(DeferredRead(total, work), self.iteration)

    def kernels(self) -> CPUKernels:
        """How this rank computes the passes over M on the CPU (the strategy agrees it across ranks).

        A state built by hand with ``cpu_kernels=None`` decides per rank: give its ranks the same thread count and
        packages. The decompression's result must be the same bits on every rank, so every rank must compute it the
        same way:
        ``"numba"`` (:mod:`~lightning_ddpopt.hooks._kernels`) where every rank has numba, else ``"blocked"`` where
        every rank runs one torch thread, else ``"blas"`` (whole-matrix kernels).
        """
        return self.cpu_kernels if self.cpu_kernels is not None else local_cpu_kernels()

    def close(self) -> bool:
        """Stop the CPU worker thread (after the buckets it holds); a later step starts a new one.

        Returns False if the thread is still running a bucket after a minute (its group must then stay as it is).
        """
        worker = self._worker
        if worker is not None and not worker.stop():
            return False
        self._worker = None
        return True

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names that key the per-parameter state (``module`` is the one DDP wraps).

        Args:
            module: the module DDP wraps.
        """
        super().bind_module(module)
        trained = [param for param in module.parameters() if param.requires_grad]
        self.ranks.bind(list(self._names.values()), [_matrix_shape(param) for param in trained])
        self.gradient_sizes = [param.numel() for param in trained]
        if self._regroup is not None:
            self._plan_regroup(list(self._regroup.groups))

    def config_dict(self) -> dict[str, object]:
        """The PowerSGDConfig as saved, and ``tiers: None`` (a flat sync: a two-tier one's state does not apply)."""
        return {**asdict(self.config), "tiers": None}

    def mismatch(self, state: dict[str, object]) -> str | None:
        """Name the config fields in which ``state`` differs, leaving out the error bound (``max_error``, ``max_rank``).

        The bound may change on a resume (and a state saved before it existed has none): the rank reached is kept,
        within the new bound (see :meth:`~lightning_ddpopt.hooks.powersgd_rank.RankController.load_state_dict`).

        Args:
            state: what :meth:`state_dict` returned.
        """
        bound = {"max_error", "max_rank"}
        config = {key: value for key, value in self.config_dict().items() if key not in bound}
        return config_mismatch(self.label, state, config)

    def state_dict(self) -> dict[str, object]:
        """Iteration, error feedback with its loss scales, and Q memories (tensors on the CPU), plus the config."""
        if self._worker is not None:
            self._worker.drain()
        self._streams.join()  # the Q memories were written on the hook's side stream
        saved = super().state_dict()  # commits the last round (on a GPU it waits for the next) and resolves it
        q_memories = {key: q.detach().cpu().clone() for key, q in self.q_memories.items()}
        return {**saved, "q_memories": q_memories, **self.ranks.state_dict()}

    def load_shared_state_dict(self, state: dict[str, object]) -> str:
        """Restore the step counter and the Q memories (the same on every rank); error feedback starts afresh.

        Args:
            state: what :meth:`state_dict` returned on a rank of the other world size.
        """
        iteration, q_memories = state["iteration"], state["q_memories"]
        assert isinstance(iteration, int) and isinstance(q_memories, dict)
        self._drop_errors()
        self.iteration = iteration
        self.q_memories = dict(q_memories)
        self.ranks.load_state_dict(state)
        if self.config.batched:
            self._plan_regroup([tuple(key.split("|")) for key in self.q_memories])
        lowest = self.ranks.lowest
        ranks = f"the rank ({self.rank})" if lowest == self.rank else f"the ranks per matrix ({lowest}-{self.rank})"
        return f"the step count ({iteration}), {ranks} and the warm-start Q memories are kept"

    def _plan_regroup(self, groups: list[tuple[str, ...]]) -> None:
        known = set(self._names.values())
        usable = [group for group in groups if not known or set(group) <= known]
        self._regroup = _Regroup(usable) if usable else None

    def _close_round(self, seal_now: bool = True) -> None:
        self._regroup = None
        super()._close_round(seal_now)

    def _tables(self) -> dict[str, dict[str, torch.Tensor]]:
        return {**super()._tables(), "q": self.q_memories}

    def _commit_shared(self, round_: SyncRound, finite: torch.Tensor | None) -> None:
        """The round's Q memories, by the commit rule; batched, keys of groups a parameter was in before are dropped.

        On the device a key with no memory keeps the fresh projection the next round would draw where the round was
        not finite: all-reduced values and one verdict, so the same on every rank.
        """
        if self.config.batched:
            # A parameter belongs to one batched matrix: drop keys of groups it was in before (another layout).
            regrouped = {name for key in round_.q_memories for name in key.split("|")}
            for key in [k for k in self.q_memories if k not in round_.q_memories]:
                if regrouped.intersection(key.split("|")):
                    self._drop("q", key, finite)
        for key, new in round_.q_memories.items():

            def fresh(like: torch.Tensor, key: str = key) -> torch.Tensor:
                q = random_q(self.config, self.iteration, key, (like.shape[0], like.shape[1]))
                return to_device(q, like.device).to(like.dtype)

            self._put("q", key, new, finite, fresh)


def _matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """The matrix PowerSGD compresses a parameter's gradient as: its first dimension by the rest (1-D: by 1)."""
    rows = param.shape[0] if param.dim() else 1
    return rows, param.numel() // max(rows, 1)
