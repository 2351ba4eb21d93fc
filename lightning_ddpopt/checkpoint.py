"""Comm-hook state and setup decisions in Lightning checkpoints: gathered to the writing rank, restored per rank.

What ``checkpoint["ddpopt"]`` holds:

* ``hook_states``: every rank's comm-hook state (PowerSGD's error feedback differs per rank), gathered to rank 0,
  which writes the checkpoint; no other rank ever holds more than its own. The states travel on the CPU, never
  through a GPU: moved to the CPU first, then sent to rank 0 one rank after another over a gloo group (the default
  group if it serves CPU tensors, else one of our own), so rank 0 holds one rank's pickled state at a time besides
  the states it writes.
* ``hook_choice``, ``bucket_cap_mb`` and ``bucket_latency_s``: what ``comm_hook="auto"``, ``bucket_cap_mb="autotune"``
  and ``bucket_cap_mb="auto"`` (from 8 ranks) measured and
  chose, so that a resume on the same world size reuses them instead of re-measuring (which could switch hooks
  and drop their state).

The contract: every rank calls ``save_checkpoint`` (Lightning's ``ModelCheckpoint`` and ``Trainer.save_checkpoint``
do; Lightning's own barrier after saving needs it too). A stateful hook's gather first waits at most
``timeout_s`` for every rank to arrive, rank 0 deciding for all; a call on fewer ranks raises a ``RuntimeError`` on
every rank that called, naming the missing ranks, instead of hanging until the process-group timeout. Stateless
hooks add no collective at all. While local SGD trains apart the ranks drift, by up to a window's steps: each rank
then tells the store that it still trains (:meth:`RankStates.beat`, at each batch and optimizer step, at most once a
second), and a save waits on for as long as every rank it waits for shows progress within each ``timeout_s``; a rank
that neither arrives nor progresses (gone, hung, or in a step or validation longer than ``timeout_s``) fails the save
after ``timeout_s`` without progress.

A resume restores what still applies and says what it could not: another hook or PowerSGD config starts the hook
afresh; another world size keeps what is the same on every rank (PowerSGD's step count and Q memories) and
restarts the per-rank rest, and re-measures the ``"auto"`` / ``"autotune"`` decisions.

The terms used here (round, verdict, meeting, travel, island, ...) are defined in the design page's glossary.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt._compat import default_store
from lightning_ddpopt._groups import destroy_owned_group
from lightning_ddpopt.hooks.auto import HookChoice
from lightning_ddpopt.hooks.base import CommHookState

__all__ = ["CHECKPOINT_KEY", "RankStates", "SavedRun", "gather_hook_states", "restore_hook_state"]

CHECKPOINT_KEY = "ddpopt"
#: Seconds between two beats of a rank that trains apart (see :meth:`RankStates.beat`).
HEARTBEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """The ``checkpoint["ddpopt"]`` entry.

    Attributes:
        world_size: the number of ranks that saved it.
        comm_hook: the registry name (or qualified name) of the hook that ran, ``None`` for DDP's built-in one.
        hook_states: every rank's hook state, by global rank; empty for stateless hooks.
        hook_choice: what ``comm_hook="auto"`` chose, ``None`` when it was not used.
        bucket_cap_mb: the cap ``bucket_cap_mb="autotune"`` chose, ``None`` when it was not used or not finished.
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
    bucket_cap_mb: float | None = None
    bucket_latency_s: float | None = None
    local_sgd: dict[str, Any] | None = None
    local_sgd_ranks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    grad_scaler: dict[str, Any] | None = None
    optimizer_steps: int | None = None

    def to_checkpoint(self) -> dict[str, Any]:
        """Plain types only, so that ``torch.load(weights_only=True)`` reads it; the states' tensors as they are.

        Not ``dataclasses.asdict``: it deep-copies every tensor of every rank's state, on rank 0, which would then
        hold them twice while the checkpoint is written.
        """
        entry = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        if self.hook_choice is not None:
            entry["hook_choice"] = dataclasses.asdict(self.hook_choice)  # a few numbers and words
        return entry

    @classmethod
    def from_checkpoint(cls, entry: dict[str, Any]) -> SavedRun:
        """Read an entry written by :meth:`to_checkpoint` (or by an earlier release, without the decisions)."""
        choice = entry.get("hook_choice")
        return cls(
            world_size=entry["world_size"],
            comm_hook=entry.get("comm_hook"),
            hook_states=list(entry.get("hook_states") or []),
            hook_choice=HookChoice(**choice) if choice else None,
            bucket_cap_mb=entry.get("bucket_cap_mb"),
            bucket_latency_s=entry.get("bucket_latency_s"),
            local_sgd=entry.get("local_sgd"),
            local_sgd_ranks=list(entry.get("local_sgd_ranks") or []),
            grad_scaler=entry.get("grad_scaler"),
            optimizer_steps=entry.get("optimizer_steps"),
        )

    def decision_note(self, world_size: int) -> str | None:
        """Why this run cannot reuse the saved decisions, or ``None`` when it can."""
        if self.world_size != world_size:
            return f"the checkpoint was saved with world size {self.world_size} and this run has {world_size}"
        return None

    def reused(self, name: Literal["hook_choice", "bucket_cap_mb", "bucket_latency_s"], world_size: int) -> Any:
        """The measured decision ``name`` if a run on ``world_size`` ranks may reuse it; says why when it may not."""
        if getattr(self, name) is None:
            return None
        note = self.decision_note(world_size)
        if note is not None:
            what = {
                "hook_choice": "comm_hook='auto'",
                "bucket_cap_mb": "bucket_cap_mb='autotune'",
                "bucket_latency_s": "bucket_cap_mb='auto'",
            }[name]
            rank_zero_info(f"ddpopt: {what} measures again: {note}")
            return None
        return getattr(self, name)


class RankStates:
    """Gathers a per-rank state to rank 0 at a save; each gather's meeting has a name of its own on the store.

    Args:
        timeout_s: how long a gather waits for every rank before it raises.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._run = ""
        self._gathers = 0
        self._beats = 0
        self._last_beat = -math.inf
        self._cpu_group: dist.ProcessGroup | None = None  # ours, when the default group serves no CPU tensors

    def name_run(self, nonce: str) -> None:
        """Name this run's meetings (the same ``nonce`` on every rank): the store outlives a Trainer."""
        self._run = nonce

    def beat(self, rank: int) -> None:
        """Tell the store that this rank still trains (while local SGD trains apart), at most once per interval.

        A save waits for a rank as long as its beats go on (see the module doc); a quarter of ``timeout_s`` apart at
        most, so that a rank that trains on shows progress within every timeout.
        """
        now = time.monotonic()
        if now - self._last_beat < min(HEARTBEAT_S, self.timeout_s / 4):
            return
        self._last_beat = now
        self._beats += 1
        default_store().set(_progress_key(self._run, rank), str(self._beats))

    def agree(self, *, rank: int, world_size: int) -> None:
        """Meet every rank as a gather does (see :meth:`gather`), for a collective of someone else's to follow."""
        if world_size > 1:
            self._gathers += 1
            _agree_to_gather(rank, world_size, self.timeout_s, self._run, f"{self._run}/{self._gathers}")

    def gather(self, state: dict[str, Any], *, rank: int, world_size: int) -> list[dict[str, Any]]:
        """Every rank's ``state`` on rank 0, an empty list on the others; every rank must call it."""
        self._gathers += 1
        tag = f"{self._run}/{self._gathers}"
        gathered = gather_hook_states(
            state,
            rank=rank,
            world_size=world_size,
            timeout_s=self.timeout_s,
            tag=tag,
            group=self._group_for_cpu,
            run=self._run,
        )
        return gathered or []

    def close(self) -> None:
        """Destroy the CPU group of our own, if one was made (at teardown)."""
        destroy_owned_group(self, "_cpu_group")

    def _group_for_cpu(self) -> dist.ProcessGroup | None:
        """A group whose collectives take CPU tensors: ``None`` for the default one when it does.

        It does with gloo or a ``"cpu:gloo,cuda:nccl"`` pair; otherwise a gloo group of our own over every rank is
        made at the first save (every rank saves at the same point).
        """
        if "gloo" in str(dist.get_backend()):
            return None
        if self._cpu_group is None:
            self._cpu_group = dist.new_group(backend="gloo")
        return self._cpu_group


def gather_hook_states(
    state: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    tag: str,
    group: Callable[[], dist.ProcessGroup | None] = lambda: None,
    run: str = "",
) -> list[dict[str, Any]] | None:
    """Every rank's ``state``, on rank 0 (``None`` on the others), its tensors on the CPU.

    Every rank must call it, with the same ``tag``, unique to this save in this process group's life. ``group()``
    gives a group of all ranks (``None``: the default group) that takes CPU tensors, once every rank has arrived:
    each rank's state, moved to the CPU, travels to rank 0 there, one rank after another, so rank 0 never holds more
    than one pickled state at a time.

    Raises:
        RuntimeError: not every rank arrived within ``timeout_s`` (the message names the missing ranks).
    """
    if world_size == 1:
        return [state]
    _agree_to_gather(rank, world_size, timeout_s, run, tag)
    on = group()
    cpu = torch.device("cpu")
    state = move_data_to_device(state, cpu)
    if rank != 0:
        dist.send_object_list([state], dst=0, group=on, device=cpu)
        return None
    gathered = [state]
    for source in range(1, world_size):
        received: list[Any] = [None]
        dist.recv_object_list(received, src=source, group=on, device=cpu)
        gathered.append(received[0])
    return gathered


def restore_hook_state(
    state: CommHookState, saved: SavedRun, *, hook_name: str | None, world_size: int, rank: int
) -> str | None:
    """Load this rank's part of ``saved`` into ``state``; return what could not be restored, in words, or ``None``."""
    if not saved.hook_states:
        return None
    if saved.comm_hook != hook_name:
        return (
            f"the checkpoint holds state of comm hook {saved.comm_hook!r}, this run uses {hook_name!r}, which starts "
            "with fresh state"
        )
    if saved.world_size != world_size:
        reason = state.mismatch(saved.hook_states[0])
        if reason is not None:
            return f"{reason}; comm hook {hook_name!r} starts with fresh state"
        kept = state.load_shared_state_dict(saved.hook_states[0])
        return (
            f"the checkpoint was saved with world size {saved.world_size} and this run has {world_size}: "
            f"{kept}; per-rank hook state (error feedback) cannot be mapped to the new ranks and starts afresh"
        )
    reason = state.mismatch(saved.hook_states[rank])
    if reason is not None:
        return f"{reason}; comm hook {hook_name!r} starts with fresh state"
    state.load_state_dict(saved.hook_states[rank])
    return None


def _agree_to_gather(rank: int, world_size: int, timeout_s: float, run: str, tag: str) -> None:
    """Meet the other ranks on the process group's store (not in a collective, so a no-show cannot hang it).

    Every rank marks its arrival; rank 0 waits for all of them and publishes one verdict that every rank follows, so
    a rank arriving late cannot enter the gather alone. Each wait lasts ``timeout_s`` and goes on while the ranks it
    waits for show progress (:meth:`RankStates.beat`): rank 0 waits for the missing ranks, the others for rank 0's
    verdict, and for rank 0's own progress or its going on waiting.
    """
    store = default_store()
    arrived = [f"ddpopt/checkpoint/{tag}/arrived/{other}" for other in range(world_size)]
    verdict_key, waiting_key = f"ddpopt/checkpoint/{tag}/verdict", f"ddpopt/checkpoint/{tag}/waiting"
    store.set(arrived[rank], "1")
    if rank == 0:
        missing = list(range(1, world_size))
        seen = _progress(store, run, missing)
        rounds = 0
        while True:
            try:
                store.wait(arrived, timedelta(seconds=timeout_s))
                verdict = "ok"
                break
            except RuntimeError:
                missing = [other for other, key in enumerate(arrived) if not store.check([key])]
                now = _progress(store, run, missing)
                if any(now[other] in (None, seen.get(other)) for other in missing):
                    verdict = ",".join(str(other) for other in missing)
                    break
                seen, rounds = now, rounds + 1
                store.set(waiting_key, str(rounds))  # the ranks that arrived wait on with rank 0
        store.set(verdict_key, verdict)
    else:
        seen = {0: _progress(store, run, [0])[0], -1: _read(store, waiting_key)}
        while True:
            try:
                store.wait([verdict_key], timedelta(seconds=2 * timeout_s))
                verdict = store.get(verdict_key).decode()
                break
            except RuntimeError:
                now = {0: _progress(store, run, [0])[0], -1: _read(store, waiting_key)}
                if all(now[key] is None or now[key] == seen[key] for key in now):
                    verdict = "0"
                    break
                seen = now
    if verdict != "ok":
        missing = [int(other) for other in verdict.split(",")]
        raise RuntimeError(
            f"ddpopt: saving a checkpoint gathers every rank's comm-hook state to rank 0, but rank(s) {missing} did "
            f"not call save_checkpoint within {timeout_s:g} s. Call trainer.save_checkpoint on every rank, as "
            "Lightning's DDP strategies require (ModelCheckpoint does)."
        )


def _progress_key(run: str, rank: int) -> str:
    return f"ddpopt/progress/{run}/{rank}"


def _progress(store: dist.Store, run: str, ranks: list[int]) -> dict[int, str | None]:
    """Each rank's last beat in this run (``None``: it never beat)."""
    return {rank: _read(store, _progress_key(run, rank)) for rank in ranks}


def _read(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None
