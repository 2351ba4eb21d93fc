"""Comm-hook state, local SGD's state and setup decisions in Lightning checkpoints: saved per rank, restored per rank.

What ``checkpoint["ddpopt"]`` (a :class:`SavedRun`) holds, written by rank 0 with the rest of the file:

* ``world_size`` and ``comm_hook``; ``shards``: where what differs per rank went (see below), ``None`` without any;
* ``local_sgd``: the outer loop's counters and config, and, with a replica per rank, its anchor, outer momentum and
  a sync still in flight (the same on every rank); an island's are in the shards, as slices;
* ``hook_choice`` and ``bucket_latency_s``: what ``comm_hook="auto"`` and ``bucket_cap_mb="auto"`` (from 8 ranks)
  measured and chose, so that a resume on the same world size reuses them instead of re-measuring (which could
  switch hooks and drop their state);
* ``grad_scaler`` and ``optimizer_steps`` for front ends that save neither (Fabric).

What differs per rank (each rank's hook state, each replica's inner optimizer states, an island's outer slices) is
written by each rank to the shards beside the file (:mod:`lightning_ddpopt.checkpoint_shards`), never through rank
0 (:func:`write_rank_states`), and each rank reads its own back. Where the file cannot have shards (a URL), and with
one rank, it is gathered to rank 0 into ``hook_states`` and ``local_sgd_ranks`` instead
(:class:`~lightning_ddpopt.checkpoint_meeting.RankStates`: on the CPU, one rank's state at a time); checkpoints of
earlier releases hold them there too.

The contract: every rank calls ``save_checkpoint`` (Lightning's ``ModelCheckpoint`` and ``Trainer.save_checkpoint``
do; Lightning's own barrier after saving needs it too). A save with per-rank state first meets every rank in a
monitored barrier, under the process group's timeout (or ``checkpoint_timeout``): a call on fewer ranks raises a
``RuntimeError``, on rank 0 naming the first missing rank, instead of hanging in the gather. Stateless hooks without
local SGD add no collective at all. While local SGD trains apart the ranks drift by up to a window's steps; a
``checkpoint_timeout`` shorter than a window's time fails such a save.

A resume restores what still applies and says what it could not: another hook or PowerSGD config starts the hook
afresh; another world size keeps what is the same on every rank (PowerSGD's step count and Q memories) and
restarts the per-rank rest, and re-measures the ``"auto"`` decisions; an island's outer state is
re-sliced for the new layout.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt._compat import PathType
from lightning_ddpopt.checkpoint_meeting import RankStates
from lightning_ddpopt.checkpoint_shards import (
    SHARDS_SUFFIX,
    ShardReader,
    SlicedValues,
    clear_partial,
    find_shards,
    shard_directory,
    write_shards,
)
from lightning_ddpopt.hooks.auto import HookChoice
from lightning_ddpopt.hooks.base import CommHookState

if TYPE_CHECKING:
    from lightning_ddpopt.localsgd import LocalSGDDriver

__all__ = ["CHECKPOINT_KEY", "SavedRun", "read_saved_run", "restore_hook_state", "write_rank_states"]

CHECKPOINT_KEY = "ddpopt"


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """The ``checkpoint["ddpopt"]`` entry.

    Attributes:
        world_size: the number of ranks that saved it.
        comm_hook: the registry name (or qualified name) of the hook that ran, ``None`` for DDP's built-in one.
        hook_states: every rank's hook state, by global rank; empty for stateless hooks.
        hook_choice: what ``comm_hook="auto"`` chose, ``None`` when it was not used.
        bucket_latency_s: the all-reduce latency ``bucket_cap_mb="auto"`` measured (from
            :data:`~lightning_ddpopt.buckets.AUTO_MEASURED_FROM_RANKS` ranks), ``None`` when it measured none.
        local_sgd: the local SGD outer loop (counters, anchor, outer momentum; the same on every rank), ``None``
            without local SGD.
        local_sgd_ranks: with local SGD, every rank's inner optimizer states (``{"optimizer_states": [...]}``),
            by global rank.
        grad_scaler: the GradScaler's state, saved by front ends that save none of their own (Fabric); ``None`` for
            the Trainer's, which saves it itself.
        optimizer_steps: optimizer steps taken, for front ends that keep no step count of their own (Fabric).
    """

    world_size: int
    comm_hook: str | None
    hook_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    hook_choice: HookChoice | None = None
    bucket_latency_s: float | None = None
    local_sgd: dict[str, Any] | None = None
    local_sgd_ranks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    grad_scaler: dict[str, Any] | None = None
    optimizer_steps: int | None = None
    shards: dict[str, Any] | None = None
    reader: ShardReader | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_checkpoint(self) -> dict[str, Any]:
        """Plain types only, so that ``torch.load(weights_only=True)`` reads it; the states' tensors as they are.

        Not ``dataclasses.asdict``: it deep-copies every tensor of every rank's state, on rank 0, which would then
        hold them twice while the checkpoint is written.
        """
        entry = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "reader"}
        if self.hook_choice is not None:
            entry["hook_choice"] = dataclasses.asdict(self.hook_choice)  # a few numbers and words
        return entry

    @property
    def has_hook_states(self) -> bool:
        """Whether the checkpoint holds every rank's hook state (a stateful hook ran)."""
        return bool(self.hook_states) or bool(self.shards and self.shards["hook"])

    def hook_state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s saved hook state (read from the shards, if there are any)."""
        if self.shards is not None and self.reader is not None:
            return self.reader.state(f"hook/{rank}")
        return self.hook_states[rank]

    def inner_states(self, rank: int) -> list[dict[str, Any]] | None:
        """Local SGD's inner optimizer states saved for rank ``rank`` (its replica's); ``None``: none were saved."""
        if self.shards is not None and self.reader is not None:
            owners = self.shards["inner_owners"]
            return self.reader.state(f"inner/{owners[rank]}") if owners else None
        if len(self.local_sgd_ranks) != self.world_size:
            return None
        entry = self.local_sgd_ranks[rank]
        if entry["optimizer_states"] is None:
            entry = self.local_sgd_ranks[entry["same_as"]]
        return entry["optimizer_states"]

    @classmethod
    def from_checkpoint(cls, entry: dict[str, Any], path: PathType | None = None) -> SavedRun:
        """Read an entry written by :meth:`to_checkpoint` (or by an earlier release, without the decisions).

        ``path``: the checkpoint file, whose shards (if it has any) are read from the directory beside it.
        """
        choice = entry.get("hook_choice")
        shards, reader, local_sgd = entry.get("shards"), None, entry.get("local_sgd")
        if shards is not None:
            sliced = shards.get("outer_slices")
            problem = f"the file was read as a stream, not from a path beside which *{SHARDS_SUFFIX} could be"
            if path is not None:
                reader, problem = find_shards(path, shards["directory"], shards["save_id"])
            if reader is None:
                kept = "; local SGD's outer loop keeps its counters and anchors at the weights" if sliced else ""
                # Every rank says it: one that cannot read its shards must not go on silently apart from the others.
                warnings.warn(
                    f"ddpopt: rank {dist.get_rank() if dist.is_initialized() else 0}: the checkpoint's per-rank state "
                    f"(comm-hook state, local SGD's inner optimizer states and island outer state) is not to be read: "
                    f"{problem}. The hook starts afresh and every rank takes rank 0's optimizer state{kept}",
                    stacklevel=2,
                )
                if local_sgd is not None and sliced:
                    local_sgd = {**local_sgd, "in_flight": None, "sharded": []}
                shards = None
            elif local_sgd is not None and sliced:
                local_sgd = _sliced_outer(local_sgd, reader, sliced)
        return cls(
            world_size=entry["world_size"],
            comm_hook=entry.get("comm_hook"),
            hook_states=list(entry.get("hook_states") or []),
            hook_choice=HookChoice(**choice) if choice else None,
            bucket_latency_s=entry.get("bucket_latency_s"),
            local_sgd=local_sgd,
            local_sgd_ranks=list(entry.get("local_sgd_ranks") or []),
            grad_scaler=entry.get("grad_scaler"),
            optimizer_steps=entry.get("optimizer_steps"),
            shards=shards,
            reader=reader,
        )

    def decision_note(self, world_size: int) -> str | None:
        """Why this run cannot reuse the saved decisions, or ``None`` when it can."""
        if self.world_size != world_size:
            return f"the checkpoint was saved with world size {self.world_size} and this run has {world_size}"
        return None

    def reused(self, name: Literal["hook_choice", "bucket_latency_s"], world_size: int) -> Any:
        """The measured decision ``name`` if a run on ``world_size`` ranks may reuse it; says why when it may not."""
        if getattr(self, name) is None:
            return None
        note = self.decision_note(world_size)
        if note is not None:
            what = "comm_hook='auto'" if name == "hook_choice" else "bucket_cap_mb='auto'"
            rank_zero_info(f"ddpopt: {what} measures again: {note}")
            return None
        return getattr(self, name)


def restore_hook_state(
    state: CommHookState, saved: SavedRun, *, hook_name: str | None, world_size: int, rank: int
) -> str | None:
    """Load this rank's part of ``saved`` into ``state``; return what could not be restored, in words, or ``None``."""
    if not saved.has_hook_states:
        return None
    if saved.comm_hook != hook_name:
        return (
            f"the checkpoint holds state of comm hook {saved.comm_hook!r}, this run uses {hook_name!r}, which starts "
            "with fresh state"
        )
    # Another world size: only what is the same on every rank applies, taken from rank 0's.
    same_world = saved.world_size == world_size
    own = saved.hook_state(rank if same_world else 0)
    reason = state.mismatch(own)
    if reason is not None:
        return f"{reason}; comm hook {hook_name!r} starts with fresh state"
    if same_world:
        state.load_state_dict(own)
        return None
    kept = state.load_shared_state_dict(own)
    return (
        f"the checkpoint was saved with world size {saved.world_size} and this run has {world_size}: "
        f"{kept}; per-rank hook state (error feedback) cannot be mapped to the new ranks and starts afresh"
    )


def write_rank_states(
    run: SavedRun,
    path: PathType,
    meeting: RankStates,
    hook_state: dict[str, Any],
    local_sgd: LocalSGDDriver | None,
    optimizers: list[torch.optim.Optimizer] | None,
    *,
    rank: int,
) -> dict[str, Any] | None:
    """Every rank writes what differs per rank to the shards beside ``path``; rank 0's entry says where it went.

    ``run``: the entry's parts that are the same on every rank. ``hook_state``: this rank's (empty: a stateless
    hook). ``optimizers``: local SGD's inner optimizers whose states are saved (``None``: none are). Every rank
    calls it; the entry on rank 0, ``None`` on the others.
    """
    if rank == 0:
        clear_partial(path)  # before the ranks meet: nobody writes there yet
    save_id = meeting.agree(rank=rank, world_size=run.world_size)
    states: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    if hook_state:
        states[f"hook/{rank}"] = hook_state
    owners, outer = None, None
    if local_sgd is not None and local_sgd.loop is not None:
        islands, loop = local_sgd.islands, local_sgd.loop
        if optimizers is not None:
            owners = list(range(run.world_size)) if islands is None else islands.leaders()
            if owners[rank] == rank:  # an island's ranks step alike: its first rank's state stands for all
                states[f"inner/{rank}"] = local_sgd.rank_state(optimizers)["optimizer_states"]
        if loop.sharded:
            assert islands is not None
            outer, values = loop.shard_state()
            if rank in islands.members[0]:  # every island holds the same slices: the first one writes them
                start = loop.layout.bounds[0]
                tensors.update({f"outer/{start}/{name}": value for name, value in values.items()})
        elif rank == 0:
            outer = loop.state_dict()
    write_shards(path, states, tensors, rank=rank, group=meeting.group, save_id=save_id)
    if rank != 0:
        return None
    index = {
        "directory": os.path.basename(shard_directory(path)),
        "save_id": save_id,
        "hook": bool(hook_state),
        "inner_owners": owners,
        "outer_slices": outer.pop("slices", None) if outer is not None else None,
    }
    return dataclasses.replace(run, local_sgd=outer, shards=index).to_checkpoint()


def read_saved_run(path: PathType) -> SavedRun | None:
    """The ``checkpoint["ddpopt"]`` entry of the checkpoint file ``path``, with its shards (``None``: it has none).

    For looking into a checkpoint: :meth:`SavedRun.hook_state` and :meth:`SavedRun.inner_states` read each rank's
    part from the shards when asked.
    """
    entry = torch.load(path, map_location="cpu", weights_only=True).get(CHECKPOINT_KEY)
    return SavedRun.from_checkpoint(entry, path) if entry else None


def _sliced_outer(outer: dict[str, Any], reader: ShardReader, slices: list[list[int]]) -> dict[str, Any]:
    """A saved island outer loop whose tensors are read from the shards, by the slice each rank owns."""
    outer = dict(outer)
    for name in outer.get("sharded", ()):
        values = SlicedValues(reader, name, slices)
        if name == "mean":
            outer["in_flight"] = {**outer["in_flight"], "mean": values}
        else:
            outer[name] = values
    return outer
