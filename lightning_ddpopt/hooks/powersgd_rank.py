"""PowerSGD's rank under an error bound (``PowerSGDConfig.max_error``): measured, summed over the ranks, applied later.

Every ``RANK_WINDOW``-th compressed round measures its relative compression error: the hook adds each bucket's two
squared norms (what the compression was given, what it dropped) with :meth:`RankController.add`, and after the
round's last bucket the state all-reduces the sums on its group (one more small collective, in the same place of the
chain on every rank). ``RANK_DECISION_LAG`` rounds later every rank reads the sum (on a GPU through a
:class:`~lightning_ddpopt.deferred.DeferredRead`, long arrived unless the host runs two syncs ahead of the device)
and doubles the rank if the error is above the bound. A non-finite round's measurement decides nothing. Every
decision is taken from all-reduced values, so the rank is the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt.deferred import DeferredRead
from lightning_ddpopt.hooks.powersgd_config import ERROR_BOUNDS, PowerSGDConfig, is_adaptive

__all__ = ["RANK_DECISION_LAG", "RANK_WINDOW", "RankController"]

#: Syncs between two measurements of the compression error that may raise the rank (``PowerSGDConfig.max_error``).
RANK_WINDOW = 5
#: A measurement's verdict is applied this many syncs later: on a GPU its value has reached the host by then.
RANK_DECISION_LAG = 2


@dataclass(kw_only=True)
class RankController:
    """The rank PowerSGD compresses at: ``config.rank``, doubled while the measured error is above the bound.

    Args:
        config: the rank, the bound (``max_error``) and the highest rank (``max_rank``).
    """

    config: PowerSGDConfig
    #: The rank in use; the same on every rank.
    rank: int = field(default=0, init=False)
    #: The error bound in use: ``config.max_error``, ``"auto"`` resolved (see :meth:`fit_bound_to`).
    bound: float | None = field(default=None, init=False)
    #: ``(step, error, old rank, new rank)`` for each rise of the rank, in order.
    changes: list[tuple[int, float, int, int]] = field(default_factory=list, init=False)
    #: This round's squared norms (given, dropped) while it measures; ``None`` otherwise.
    _sums: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    #: A measurement on its way: the norms summed over the ranks, and the sync round that applies its verdict.
    _pending: tuple[DeferredRead, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.rank = self.config.rank
        bound = self.config.max_error
        self.bound = ERROR_BOUNDS["adaptive"] if bound == "auto" else bound

    def fit_bound_to(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve ``max_error="auto"``: the adaptive bound if any optimizer is adaptive, else the other."""
        if self.config.max_error == "auto":
            self.bound = ERROR_BOUNDS["adaptive" if any(map(is_adaptive, optimizers)) else "other"]

    @property
    def measuring(self) -> bool:
        """Whether the open round measures its compression error (set at its first bucket)."""
        return self._sums is not None

    def _due(self, iteration: int) -> bool:
        config = self.config
        if self.bound is None or self.rank >= config.max_rank or iteration < config.start_iter:
            return False
        return (iteration - config.start_iter) % RANK_WINDOW == RANK_WINDOW - 1

    def add(self, given_sq: torch.Tensor, dropped_sq: torch.Tensor) -> None:
        """Add a bucket's squared norms (what its compression was given, what it dropped) to the measurement."""
        pair = torch.stack([given_sq, dropped_sq])
        self._sums = [pair] if not self._sums else [self._sums[0] + pair]

    def take(self) -> list[torch.Tensor] | None:
        """At the round's last bucket: its sums to all-reduce; ``None`` when it did not measure.

        Empty when it measured and compressed nothing (the same on every rank).
        """
        sums, self._sums = self._sums, None
        return sums

    def expect(self, read: DeferredRead, iteration: int) -> None:
        """The sums of round ``iteration``, all-reduced over the ranks: decided ``RANK_DECISION_LAG`` rounds later."""
        self._pending = (read, iteration + RANK_DECISION_LAG)

    def adapt(self, iteration: int) -> None:
        """At round ``iteration``'s first bucket: start a measurement if one is due, apply one whose round came."""
        if self._due(iteration):
            self._sums = []
        if self._pending is None or iteration < self._pending[1]:
            return
        read, _ = self._pending
        self._pending = None
        given, dropped = read.read().tolist()
        error = math.sqrt(dropped / given) if given > 0 else math.nan
        assert self.bound is not None
        new_rank = min(2 * self.rank, self.config.max_rank)
        if math.isfinite(error) and error > self.bound and new_rank > self.rank:
            self.changes.append((iteration, error, self.rank, new_rank))
            rank_zero_info(
                f"ddpopt: PowerSGD's compression error {error:.2f} is above max_error {self.bound:g} at "
                f"rank {self.rank}: rank {new_rank} from sync {iteration}"
            )
            self.rank = new_rank

    def state_dict(self) -> dict[str, object]:
        """The rank in use, its rises, and a measurement on its way (read now: a save may wait for the device)."""
        probe = None
        if self._pending is not None:
            read, decide_at = self._pending
            probe = {"norms": read.read().tolist(), "decide_at": decide_at}
        return {"rank": self.rank, "rank_changes": list(self.changes), "rank_probe": probe}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`: the rank reached, within this config's bound, and a measurement on its way.

        Without ``max_error`` the rank is the config's; with it, the saved one (a state saved before the rank could
        change: the config's), at least ``rank`` and at most ``max_rank``.
        """
        config = self.config
        saved, changes = state.get("rank", config.rank), state.get("rank_changes", [])
        probe = state.get("rank_probe")
        assert isinstance(saved, int) and isinstance(changes, list)
        self.changes, self._sums, self._pending = [tuple(change) for change in changes], None, None
        if config.max_error is None:
            self.rank = config.rank
            return
        self.rank = min(max(saved, config.rank), config.max_rank)
        if isinstance(probe, dict) and self.rank == saved:  # a measurement at another rank decides nothing here
            self._pending = (DeferredRead(torch.tensor(probe["norms"], dtype=torch.float64)), int(probe["decide_at"]))
