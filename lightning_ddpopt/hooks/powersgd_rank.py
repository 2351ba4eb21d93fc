"""PowerSGD's rank per matrix under an error bound (``PowerSGDConfig.max_error``): measured, summed, applied later.

Every ``RANK_WINDOW``-th compressed round measures each matrix's relative compression error: the hook adds, per
matrix, three squared norms with :meth:`RankController.add` (what the compression was given, what it dropped, and
what it would drop at half the rank: the dropped part plus the weakest columns of this rank's ``M^T P``, the columns
being chosen by the reduced Q's norms, the same on every rank). After the round's last bucket the state all-reduces
the table (one row per parameter of the model, O(parameters) values whatever the world size; one more small
collective, in the same place of the chain on every rank). ``RANK_DECISION_LAG`` rounds later every rank reads the sum
(on a GPU through a :class:`~lightning_ddpopt.deferred.DeferredRead`, long arrived unless the host runs two syncs
ahead of the device) and decides per matrix:

- **rise**: the error is above the bound: the matrix's rank doubles, up to ``max_rank``;
- **fall**: the error at half the rank would stay under ``FALL_MARGIN`` x the bound in ``patience`` measurements in a
  row (``FALL_PATIENCE`` at first): the rank halves, down to ``config.rank``. A matrix that rises back to a rank it
  fell from doubles its patience (hysteresis: a matrix near the bound does not swing every window), and a warm-up
  spike that raised a rank does not keep it there.

A non-finite round's measurement decides nothing. Every decision is taken from all-reduced values, so every matrix's
rank is the same on every rank. A matrix that a raised rank no longer compresses is sent exactly and measured no more,
so that rise waits for ``EXACT_PATIENCE`` measurements above the bound in a row: a spike of a window or two does not
send a matrix exactly for the rest of the run.

``max_error="auto"`` is resolved here too, by the run's optimizers: :data:`ERROR_BOUNDS` holds the bound for an
adaptive optimizer (:func:`is_adaptive`) and for others.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt.deferred import DeferredRead

if TYPE_CHECKING:
    from lightning_ddpopt.hooks.powersgd import PowerSGDConfig

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "ERROR_BOUNDS",
    "EXACT_PATIENCE",
    "FALL_MARGIN",
    "FALL_PATIENCE",
    "RANK_DECISION_LAG",
    "RANK_WINDOW",
    "RankChange",
    "RankController",
    "is_adaptive",
    "square_side",
]

#: Optimizers that scale each coordinate by its own history (Adam and its kin): a compression error costs them more.
#: Matched in a class name or any base's, case-insensitively (AdamW, FusedAdam, AdamW8bit, a subclass of Adam, ...).
ADAPTIVE_OPTIMIZERS = ("adam", "adagrad", "adadelta", "adafactor", "rmsprop", "lamb")
#: ``max_error="auto"``'s bound: with an adaptive optimizer, and with others. Chosen from the errors and held-out
#: losses of ``benchmarks/transformer_quality.py`` (the docs' comm hooks guide has them).
ERROR_BOUNDS = {"adaptive": 0.6, "other": 0.9}

#: Syncs between two measurements of the compression error that may change a matrix's rank.
RANK_WINDOW = 5
#: A measurement's verdict is applied this many syncs later: on a GPU its value has reached the host by then.
RANK_DECISION_LAG = 2
#: A matrix's rank halves when its error at half the rank would stay under this fraction of the bound ...
FALL_MARGIN = 0.8
#: ... in this many measurements in a row (doubled each time the matrix rises back to a rank it fell from).
FALL_PATIENCE = 2
#: A rise past the ranks at which a matrix compresses (it is then sent exactly, for good) waits for this many
#: measurements above the bound in a row.
EXACT_PATIENCE = 3
#: The most measurements in a row a fall may wait for.
_MAX_PATIENCE = 64


def is_adaptive(optimizer: object) -> bool:
    """Whether ``optimizer`` (or the optimizer it wraps, e.g. ``ZeroRedundancyOptimizer``'s) is Adam-like.

    Its class's or a base class's name contains one of :data:`ADAPTIVE_OPTIMIZERS` (a class name alone works too).
    """
    if isinstance(optimizer, str):
        names = [optimizer]
    else:
        inner = getattr(optimizer, "optim", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return is_adaptive(inner)
        names = [cls.__name__ for cls in type(optimizer).__mro__]
    return any(kind in name.lower() for name in names for kind in ADAPTIVE_OPTIMIZERS)


class RankChange(NamedTuple):
    """One change of a matrix's rank."""

    #: The sync round from which the new rank applies.
    step: int
    #: The measured relative error: at the old rank for a rise, predicted at the new one for a fall.
    error: float
    old: int
    new: int
    #: The matrix's key (its parameter's name; batched: the bucket's names joined by ``|``); ``"*"`` for a change
    #: saved by an earlier release, which had one rank for every matrix.
    key: str


@dataclass(kw_only=True)
class RankController:
    """The rank each matrix compresses at: ``config.rank``, moved per matrix by the measured error (module doc).

    Args:
        config: PowerSGD's settings (a :class:`~lightning_ddpopt.hooks.powersgd.PowerSGDConfig`): the rank, the
            bound (``max_error``) and the highest rank (``max_rank``).
    """

    config: PowerSGDConfig
    #: The rank of a matrix without a rank of its own (``config.rank``; a state of an earlier release: its rank).
    default_rank: int = field(default=0, init=False)
    #: Each measured matrix's rank, by key; the same on every rank.
    matrix_ranks: dict[str, int] = field(default_factory=dict, init=False)
    #: The error bound in use: ``config.max_error``, ``"auto"`` resolved (see :meth:`fit_bound_to`).
    bound: float | None = field(default=None, init=False)
    #: Every change of a matrix's rank, in order.
    changes: list[RankChange] = field(default_factory=list, init=False)
    #: Per key: measurements in a row that would allow a fall, and how many a fall needs.
    calm: dict[str, int] = field(default_factory=dict, init=False)
    patience: dict[str, int] = field(default_factory=dict, init=False)
    #: Per key: the rank it last fell from (rising back to it doubles its patience).
    fell_from: dict[str, int] = field(default_factory=dict, init=False)
    #: Per key: measurements above the bound in a row while its next rise would stop its compression.
    over: dict[str, int] = field(default_factory=dict, init=False)
    #: The parameter names of the model in order: a key's row in the measured table is its (first) name's index.
    _slot_of: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    #: The keys this rank measured, by row.
    _key_at: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _names: list[str] = field(default_factory=list, init=False, repr=False)
    #: Each parameter's gradient as the hook sees it compressed: ``(rows, columns)``, in ``_names`` order.
    _shapes: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)
    #: Whether the open round measures its compression errors (set at its first bucket).
    measuring: bool = field(default=False, init=False, repr=False)
    #: This round's table while it measures (``None`` before its first matrix).
    _table: torch.Tensor | None = field(default=None, init=False, repr=False)
    #: A measurement on its way: the table summed over the ranks, and the sync round that applies its verdict.
    _pending: tuple[DeferredRead, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.default_rank = self.config.rank
        bound = self.config.max_error
        self.bound = ERROR_BOUNDS["adaptive"] if bound == "auto" else bound

    def bind(self, names: list[str], shapes: list[tuple[int, int]]) -> None:
        """Learn the model's parameter names, in order (the rows of the measured table), and their gradients' shapes.

        Args:
            names: the names of the parameters that get gradients, in the module's order.
            shapes: each one's gradient as a matrix: its first dimension by the rest (a 1-D one: by 1).
        """
        self._names, self._shapes = list(names), list(shapes)
        self._slot_of = {name: index for index, name in enumerate(self._names)}

    def fit_bound_to(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve ``max_error="auto"``: the adaptive bound if any optimizer is adaptive, else the other."""
        if self.config.max_error == "auto":
            self.bound = ERROR_BOUNDS["adaptive" if any(map(is_adaptive, optimizers)) else "other"]

    def rank_of(self, key: str) -> int:
        """The rank a matrix compresses at this round.

        Args:
            key: the matrix's key (its parameter's name; batched: the bucket's names joined by ``|``).
        """
        return self.matrix_ranks.get(key, self.default_rank)

    @property
    def highest(self) -> int:
        """The highest rank in use (for reports): of the measured matrices, else the default."""
        return max(self.matrix_ranks.values(), default=self.default_rank)

    @property
    def lowest(self) -> int:
        """The lowest rank in use (for reports)."""
        return min(self.matrix_ranks.values(), default=self.default_rank)

    def halved(self, key: str, rows: int, cols: int) -> int:
        """The columns a matrix would keep if its rank fell now.

        Args:
            key: the matrix's key.
            rows: its rows.
            cols: its columns.
        """
        return min(rows, cols, max(self.config.rank, self.rank_of(key) // 2))

    def _due(self, iteration: int) -> bool:
        config = self.config
        if self.bound is None or config.rank >= config.max_rank or iteration < config.start_iter or not self._slot_of:
            return False
        return (iteration - config.start_iter) % RANK_WINDOW == RANK_WINDOW - 1

    def add(self, key: str, given_sq: torch.Tensor, dropped_sq: torch.Tensor, halved_sq: torch.Tensor) -> None:
        """Add a matrix's squared norms to the measurement's table.

        Args:
            key: the matrix's key.
            given_sq: what its compression was given.
            dropped_sq: what it dropped.
            halved_sq: what it would drop at half the rank.
        """
        slot = self._slot_of[key.split("|", 1)[0]]
        if self._table is None:
            self._table = torch.zeros(len(self._names), 3, dtype=torch.float64, device=given_sq.device)
        self._table[slot] += torch.stack([given_sq, dropped_sq, halved_sq]).to(torch.float64)
        self._key_at[slot] = key

    def take(self, device: torch.device | None = None) -> torch.Tensor | None:
        """At the round's last bucket: its table to all-reduce; ``None`` when it did not measure.

        Args:
            device: where a rank that compressed nothing makes its zeros (a two-tier sync: every rank takes part);
                without it such a round gives ``None`` (a flat sync compresses the same matrices on every rank).
        """
        table, measuring = self._table, self.measuring
        self._table, self.measuring = None, False
        if not measuring:
            return None
        if table is None and device is not None:
            table = torch.zeros(len(self._names), 3, dtype=torch.float64, device=device)
        return table

    def expect(self, read: DeferredRead, iteration: int) -> None:
        """The table of a round, all-reduced over the ranks: decided ``RANK_DECISION_LAG`` rounds later.

        Args:
            read: the all-reduced table, on its way.
            iteration: the round it was measured in.
        """
        self._pending = (read, iteration + RANK_DECISION_LAG)

    def adapt(self, iteration: int) -> None:
        """At a round's first bucket: start a measurement if one is due, apply one whose round came.

        Args:
            iteration: the round.
        """
        self.measuring = self._due(iteration)
        if self._pending is None or iteration < self._pending[1]:
            return
        read, _ = self._pending
        self._pending = None
        rows = read.read().tolist()
        if len(rows) != len(self._names):  # measured on another model (a resume that changed it): decides nothing
            return
        changed = [self._decide(iteration, slot, *row) for slot, row in enumerate(rows) if row[0] > 0]
        made = [change for change in changed if change is not None]
        if made:
            rises = sum(change.new > change.old for change in made)
            rank_zero_info(
                f"ddpopt: PowerSGD at sync {iteration}: {rises} matrices' rank raised (error above max_error "
                f"{self.bound:g}), {len(made) - rises} lowered (error at half the rank under {FALL_MARGIN:g} x it); "
                f"ranks now {self.lowest}-{self.highest}"
            )

    def _decide(self, iteration: int, slot: int, given: float, dropped: float, halved: float) -> RankChange | None:
        assert self.bound is not None
        key = self._key_at.get(slot, self._names[slot])
        error, error_halved = math.sqrt(dropped / given), math.sqrt(halved / given)
        if not (math.isfinite(error) and math.isfinite(error_halved)):
            return None
        rank = self.rank_of(key)
        self.matrix_ranks[key] = rank
        if error > self.bound:
            self.calm[key] = 0
            new = min(2 * rank, self.config.max_rank)
            if new == rank:
                return None
            if not self.config.compresses(*self._matrix_shape(key), new):  # sent exactly for good: not for a spike
                self.over[key] = self.over.get(key, 0) + 1
                if self.over[key] < EXACT_PATIENCE:
                    return None
            self.over.pop(key, None)
            if self.fell_from.pop(key, None) == new:
                self.patience[key] = min(2 * self.patience.get(key, FALL_PATIENCE), _MAX_PATIENCE)
            return self._change(RankChange(iteration, error, rank, new, key))
        self.over.pop(key, None)
        new = max(self.config.rank, rank // 2)
        if new == rank or error_halved >= FALL_MARGIN * self.bound:
            self.calm[key] = 0
            return None
        self.calm[key] = self.calm.get(key, 0) + 1
        if self.calm[key] < self.patience.get(key, FALL_PATIENCE):
            return None
        self.calm[key], self.fell_from[key] = 0, rank
        return self._change(RankChange(iteration, error_halved, rank, new, key))

    def _matrix_shape(self, key: str) -> tuple[int, int]:
        """The matrix ``key`` compresses: a parameter's gradient, or (batched) the square its names' values fill."""
        names = key.split("|")
        if not self.config.batched:
            return self._shapes[self._slot_of[key]]
        side = square_side(sum(math.prod(self._shapes[self._slot_of[name]]) for name in names))
        return side, side

    def _change(self, change: RankChange) -> RankChange:
        self.changes.append(change)
        self.matrix_ranks[change.key] = change.new
        return change

    def state_dict(self) -> dict[str, object]:
        """The ranks in use, their changes, the fall counters, and a measurement on its way (read now)."""
        probe = None
        if self._pending is not None:
            read, decide_at = self._pending
            probe = {"table": read.read().tolist(), "keys": dict(self._key_at), "decide_at": decide_at}
        return {
            "rank": self.highest,
            "default_rank": self.default_rank,
            "matrix_ranks": dict(self.matrix_ranks),
            "rank_changes": [tuple(change) for change in self.changes],
            "rank_calm": dict(self.calm),
            "rank_patience": dict(self.patience),
            "rank_fell_from": dict(self.fell_from),
            "rank_over": dict(self.over),
            "rank_probe": probe,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`: the ranks reached, within this config's bounds, and a measurement on its way.

        Without ``max_error`` every rank is the config's; with it, the saved ones, each at least ``rank`` and at most
        ``max_rank``. A state of an earlier release (one rank for every matrix) gives every matrix its rank.
        """
        config = self.config
        saved = state.get("default_rank", state.get("rank", config.rank))
        changes = state.get("rank_changes", [])
        assert isinstance(saved, int) and isinstance(changes, list)
        self.changes = [_saved_change(change) for change in changes]
        self._table, self.measuring, self._pending = None, False, None
        self.matrix_ranks, self.calm, self.patience, self.fell_from, self.over = {}, {}, {}, {}, {}
        if config.max_error is None:
            self.default_rank = config.rank
            return

        def clamp(rank: int) -> int:
            return min(max(rank, config.rank), config.max_rank)

        self.default_rank = clamp(saved)
        ranks = state.get("matrix_ranks", {})
        assert isinstance(ranks, dict)
        self.matrix_ranks = {key: clamp(rank) for key, rank in ranks.items()}
        tables = (self.calm, self.patience, self.fell_from, self.over)
        for name, table in zip(("rank_calm", "rank_patience", "rank_fell_from", "rank_over"), tables, strict=True):
            found = state.get(name, {})
            assert isinstance(found, dict)
            table.update(found)
        probe = state.get("rank_probe")
        unchanged = self.default_rank == saved and all(ranks[key] == rank for key, rank in self.matrix_ranks.items())
        if isinstance(probe, dict) and "table" in probe and unchanged:  # measured at other ranks: decides nothing here
            self._key_at = {int(slot): key for slot, key in probe["keys"].items()}
            self._pending = (DeferredRead(torch.tensor(probe["table"], dtype=torch.float64)), int(probe["decide_at"]))


def _saved_change(saved: tuple | list) -> RankChange:
    """A saved change; one of an earlier release (one rank for every matrix) has no key: ``"*"``."""
    step, error, old, new, *key = saved
    return RankChange(int(step), float(error), int(old), int(new), str(key[0]) if key else "*")


def square_side(numel: int) -> int:
    """The side of the smallest square matrix that holds ``numel`` values (batched PowerSGD's zero-padded matrix)."""
    return math.isqrt(numel - 1) + 1 if numel > 1 else 1
