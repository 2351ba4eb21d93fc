"""Local SGD's outer loop: each replica's parameter change averaged every ``H`` steps, the outer step, its state.

See :mod:`lightning_ddpopt.localsgd` for the method; :class:`LocalSGD` is driven by
:class:`~lightning_ddpopt.localsgd.driver.LocalSGDDriver`. Terms (meeting, in flight, island): the design page's
glossary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpopt._validate import is_real_number
from lightning_ddpopt.costmodel import SYNC_EVERY_CHOICES, SYNC_SHARE, choose_sync_every
from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.base import config_mismatch, squared_norm
from lightning_ddpopt.hooks.powersgd_rank import is_adaptive
from lightning_ddpopt.hooks.streams import SideStreams
from lightning_ddpopt.localsgd.config import INT8_BLOCK, WIRE_DTYPES, LocalSGDConfig
from lightning_ddpopt.localsgd.int8_mean import Int8Mean
from lightning_ddpopt.localsgd.shard import Shard
from lightning_ddpopt.units import format_seconds

__all__ = ["InFlight", "LocalSGD", "ParameterSync", "SyncEveryChoice"]

#: A fault-tolerant replica's ``sync_mean``: a change (fp32) averaged over the quorum in place, sent in the wire
#: buffer given (``None``: as it is); whether the sync commits.
QuorumMean = Callable[[torch.Tensor, torch.Tensor | None], bool]


@dataclass(frozen=True)
class ParameterSync:
    """One parameter sync: what it sent and when (host seconds), for the ledger.

    ``overlapped``: it was in flight while the ranks trained on; ``start_s`` to ``end_s`` is its arrival only.
    ``drift``: squared norms (0-dim tensors) of this rank's parameter change and of the mean change it carried
    (``None`` for a sync restored from a checkpoint in flight).
    """

    num_elements: int
    logical_bytes: int
    wire_bytes: int
    start_s: float
    end_s: float
    overlapped: bool = False
    drift: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class SyncEveryChoice:
    """What ``sync_every="auto"`` chose, and from what: the same on every rank, saved in checkpoints.

    Attributes:
        sync_every: H from then on: :func:`~lightning_ddpopt.costmodel.choose_sync_every` of the three figures
            below, raised to the smallest of its choices above ``overlap_steps`` if it was not.
        sync_s: the measured sync's seconds, the least over the ranks (the others also waited for the last to
            arrive): a blocking sync's own; an overlapped one's from its start to its application ``overlap_steps``
            steps later.
        compute_s: the slowest rank's median seconds per local optimizer step in the window before that sync.
        exposed_share: the share of ``sync_s`` the ranks wait for: 1 for a blocking sync; for an overlapped one,
            what is left of it beyond the ``overlap_steps`` steps of compute it runs beside (0 if they hide it).
        since: the optimizer step count at that sync's start, from which the windows of H steps count.
    """

    sync_every: int
    sync_s: float
    compute_s: float
    exposed_share: float
    since: int

    def describe(self, overlap_steps: int) -> str:
        """The choice in words, for the log (``overlap_steps``: the config's)."""
        exposed_s = self.sync_s * self.exposed_share
        took = f"it took {format_seconds(self.sync_s)} (the least over the ranks)"
        if overlap_steps:
            later = f"{overlap_steps} steps later"
            took += f" from its start to its application {later}, {format_seconds(exposed_s)} beyond their compute"
        above = f" above overlap_steps={overlap_steps}" if overlap_steps else ""
        share = exposed_s / (self.sync_every * self.compute_s)
        return (
            f"ddpopt: local SGD's sync_every='auto' chose H = {self.sync_every} at the sync after step {self.since}: "
            f"{took}, and a local optimizer step {format_seconds(self.compute_s)} (the slowest rank's); at H = "
            f"{self.sync_every} the sync adds {share:.1%} to a window's compute (the rule: the smallest H of "
            f"{', '.join(map(str, SYNC_EVERY_CHOICES))}{above} at which it adds at most {SYNC_SHARE:.0%}, else the "
            "largest)"
        )


@dataclass
class InFlight:
    """A sync started and not applied yet: what carries the mean change, and when to apply it.

    ``wire``: the mean change (all-reduced, or restored from a checkpoint), or with int8 the gathered packed rows.
    ``own_sq``: the squared norm of this rank's change (``None`` when restored from a checkpoint).
    ``ahead``: a job beside the training thread carries the sync on as soon as it arrives (the mean into the work
    buffer; in an island also the drift, the outer step and the gather of the next anchor): wait for it before
    reading any of them.
    ``drift``: the squared norms of this replica's change and of the mean, measured over the island ahead.
    ``gathered``: in an island, the next anchor, the whole model, gathered ahead into the shard's gather buffer
    (``None``: not yet, or a save's gather took the buffer since).
    """

    wire: torch.Tensor
    work: dist.Work | None
    apply_at: int
    wire_bytes: int
    own_sq: torch.Tensor | None = None
    ahead: bool = False
    drift: tuple[torch.Tensor, torch.Tensor] | None = None
    gathered: torch.Tensor | None = None


class LocalSGD:
    """The outer loop of local SGD / DiLoCo over ``module``'s parameters; the strategy drives it.

    Call :meth:`before_batch` before each training batch's forward (it says whether gradients sync) and
    :meth:`after_optimizer_step` after each optimizer step call.

    Args:
        config: the local SGD config.
        module: the module whose trainable parameters the replicas sync.
        process_group: the group across the replicas (``None``: the world), one rank of each replica: the outer
            sync's exchange runs on it.
        island: the group of this rank's replica when a replica has several ranks (an island, which keeps its
            parameters identical by syncing gradients every step); ``None`` when each rank is a replica.
        place: this rank's island rank (default: its rank in ``island``): the shard it owns, which must also be its
            place in the island's gather and the ranks of ``process_group`` the same place in every island.

    With an island of ``M`` ranks, island rank ``i`` owns shard ``i`` of the flattened parameters (1/M of them, in
    parameter order): :attr:`anchor` and :attr:`momentum` hold that shard only (the same on the ranks of the same
    island rank, one per replica), its change is all that it sends across the replicas, and an all-gather inside the
    island rebuilds the model after each outer step. Without an island the shard is the whole model.

    A sync is one sequence: the shard's change ``anchor - params``, its mean over the replicas, the outer step on the
    anchor, the island's gather of the new anchor into the parameters, the buffers' sync. Only the mean differs by
    mode (:meth:`_average`: :meth:`_send` and :meth:`_receive`, chosen once, or :attr:`across_islands`):

    * fp32, fp16, bf16: one all-reduce of ``change / replicas``, fp32 in place, else in the wire buffer (half
      precision, or fp32 when overlapped);
    * int8: :class:`~lightning_ddpopt.localsgd.int8_mean.Int8Mean`'s all-to-all of int8 chunks, reduced, gathered;
    * fault-tolerant islands (:attr:`across_islands` set): the replica's ``sync_mean`` over the quorum, which may
      drop the sync (the anchor stays); never overlapped.

    An overlapped sync (``overlap_steps``) is started at the sync point and carried on beside the training thread as
    soon as it arrives: on a worker thread on a CPU, on a side stream on CUDA, int8's second stage; on a CPU in an
    island also the outer step and the island's gather of the next anchor, into a second momentum buffer (1/M of the
    model) and the gather's buffers, so that the step that applies it only commits them and mixes the parameters.
    Until then the anchor, the momentum and the mean stay as they were (a checkpoint saved meanwhile holds them).

    ``sync_every="auto"``: the windows are :data:`~lightning_ddpopt.localsgd.config.PROVISIONAL_SYNC_EVERY` steps long
    until the driver, right after a sync (overlapped: its application), hands this rank's measurements to
    :meth:`agree_sync_every`, which agrees on them with every rank and sets :attr:`sync_every` from that sync on
    (:attr:`sync_every_choice`). ``outer_lr`` or ``outer_momentum`` ``"auto"`` are resolved for no adaptive optimizer
    at construction, and again by :meth:`fit_outer_to` once the strategy knows the inner optimizers; :attr:`config`
    holds the values in use.
    """

    def __init__(
        self,
        config: LocalSGDConfig,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        island: dist.ProcessGroup | None = None,
        place: int | None = None,
    ) -> None:
        #: The config in use: the one given, with ``outer_lr`` and ``outer_momentum`` ``"auto"`` resolved.
        self.config = config.fit_outer(adaptive=False)
        self._asked = config
        #: Whether the outer settings ``"auto"`` resolved to came from a checkpoint or, for a returning fault-tolerant
        #: island, from the live islands (then the optimizers do not change them).
        self.outer_from_checkpoint = False
        #: What ``sync_every="auto"`` chose (``None``: a number was given, or the ranks have not chosen yet).
        self.sync_every_choice: SyncEveryChoice | None = None
        self.module = module
        self.process_group = process_group
        self.island = island
        #: The replicas whose changes a sync averages (the size of :attr:`process_group`).
        self.replicas = dist.get_world_size(process_group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        # int8 shards split into whole blocks, one chunk per replica (the reduce-scatter shape).
        self._unit = self.replicas * INT8_BLOCK if self.config.compression == "int8" else 1
        #: This rank's shard of the parameters (without an island: the whole model).
        self.layout = Shard(self.params, None, 1, 0, self._unit)
        if island is not None:
            place = dist.get_rank(island) if place is None else place
            self.layout = Shard(self.params, island, dist.get_world_size(island), place, self._unit)
        self.steps = 0
        self.syncs = 0
        self.skipped_inner_steps = 0
        #: The shard's parameters at the last sync (the same on every replica), one flat fp32 tensor.
        self.anchor: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.averaged_at_end = False
        #: Whether the current batch synchronises gradients over every rank (the warm-up), the same on every rank.
        self.gradients_sync = True
        #: Whether the ranks met in the current batch so far: its gradients synced, or an optimizer step of it took
        #: part in a parameter sync (see :attr:`next_step_meets`).
        self.met_in_batch = True
        self._work: torch.Tensor | None = None
        self._in_flight: InFlight | None = None
        self._wire: torch.Tensor | None = None
        self._int8 = Int8Mean(self.process_group, self.replicas) if self.config.compression == "int8" else None
        # The mean over the replicas, by mode (see the class doc): sent, then received into the work buffer.
        self._send = self._send_all_reduce if self._int8 is None else self._send_int8
        self._receive = self._receive_all_reduce if self._int8 is None else self._receive_int8
        # fp32 all-reduced in place, unless overlapped (then in the wire buffer, as half precision always is).
        self._in_place = self.config.compression == "fp32" and not self.config.overlap_steps
        #: Fault-tolerant islands (:mod:`lightning_ddpopt.fault_tolerance`): the replica's ``sync_mean``, which
        #: averages a change sent as it is, in place, over the islands of the quorum and returns whether the sync
        #: commits; ``None``: the replicas are :attr:`process_group`'s. It chooses the sync's mean.
        self.across_islands: QuorumMean | None = None
        # Where an overlapped sync is carried on beside the training thread (see the class doc).
        self._worker: Worker | None = None
        self._side = SideStreams()
        # The outer momentum of the next anchor, computed ahead in an island (the current one stays until the apply).
        self._next_momentum: torch.Tensor | None = None
        #: Local optimizer steps whose progress the anchor does not hold: 0 right after a sync without overlap and
        #: in the warm-up; with ``overlap_steps`` and ``overlap_mixing > 0`` the window the last sync carried plus the
        #: steps since it started (part of their progress is mixed in).
        self.local_steps_since_sync = 0
        #: Sync after the next local optimizer step, whatever the schedule (every rank alike), then as scheduled.
        self.sync_next = False

    @property
    def sharded(self) -> bool:
        """Whether the outer state is sharded over an island (saving it takes every rank: each saves its slice)."""
        return self.island is not None

    @property
    def local(self) -> bool:
        """Whether the warm-up is over: gradients are no longer synchronised over every rank."""
        return self.steps >= self.config.warmup_steps

    @property
    def sync_every(self) -> int:
        """H in use: ``config.sync_every``; with ``"auto"`` the chosen one, until then the provisional one."""
        if self.sync_every_choice is not None:
            return self.sync_every_choice.sync_every
        return self.config.first_sync_every

    @property
    def choosing(self) -> bool:
        """Whether ``sync_every="auto"`` has not chosen H yet: the next sync is measured (the same on every rank)."""
        return self.config.sync_every == "auto" and self.sync_every_choice is None

    def _into_window(self, steps: int) -> int:
        """Optimizer step calls into the current sync window after ``steps`` of them (0: a sync is due at it)."""
        since = self.config.warmup_steps if self.sync_every_choice is None else self.sync_every_choice.since
        return (steps - since) % self.sync_every

    @property
    def window_starts(self) -> bool:
        """Whether the next batch is in the warm-up or in a sync window's first optimizer step (every rank alike).

        With gradient accumulation: each micro-batch of that step.
        """
        return not self.local or self._into_window(self.steps) == 0

    @property
    def next_step_meets(self) -> bool:
        """Whether the next optimizer step call meets the other ranks, the same on every rank.

        It does when it syncs gradients (the warm-up) or takes part in a parameter sync: the sync itself, or the start
        of an overlapped one while the ranks train on (applying it later waits for the slower rank's start anyway).
        """
        return not self.local or self._into_window(self.steps + 1) == 0

    @property
    def meets_in_passing(self) -> bool:
        """Whether the ranks' meetings are in passing (see :mod:`lightning_ddpopt.meetings`), the same on every rank.

        In the local phase with ``overlap_steps``: a sync starts and the ranks train on without waiting for each other.
        """
        return self.local and bool(self.config.overlap_steps)

    # The schedule: which batches sync gradients, which steps sync parameters.

    def before_batch(self) -> bool:
        """Anchor the parameters when the local phase begins; return whether this batch's gradients sync everywhere."""
        self.gradients_sync = self.met_in_batch = not self.local
        if not self.local:
            return True
        if self.anchor is None:  # identical on every rank: DDP synced them until now (or broadcast them at start)
            self.anchor = self.layout.values()
            self._allocate()
        return False

    def _allocate(self) -> None:
        """Allocate, and write once, the shard-sized buffers the syncs reuse, when the local phase begins.

        A fresh buffer's pages are mapped at its first write: 0.1-0.3 s for the buffers of 25M parameters on a CPU
        (measured on the emulated cluster), which the first sync would pay in the middle of a window (and an
        out-of-memory error would come H steps late).
        """
        assert self.anchor is not None
        self._work_buffer()
        if self._int8 is None and not self._in_place:
            self._wire_buffer()
        self._allocate_momentum()
        if self.island is not None:
            self.layout.buffers(self.anchor.device)
        if self._int8 is not None:
            assert self._work is not None
            self._int8.prepare(self._work)
        ahead = self._int8 is not None or self.island is not None
        if self.config.overlap_steps and ahead and self._worker is None and self.anchor.device.type == "cpu":
            self._worker = Worker("ddpopt-local-sgd")

    def _allocate_momentum(self) -> None:
        """The outer momentum, if the config has one (and with an overlapped island's sync the next one's buffer)."""
        assert self.anchor is not None
        if self.config.outer_momentum and self.momentum is None:
            # The same first outer step as no momentum yet: 0.9 x 0 + change is the change, bit for bit.
            self.momentum = torch.zeros_like(self.anchor)
        if self.config.overlap_steps and self.island is not None and self.momentum is not None:
            self._next_momentum = torch.zeros_like(self.momentum)

    def after_optimizer_step(self, skipped: bool = False) -> ParameterSync | None:
        """Count one optimizer step call (``skipped``: the GradScaler skipped it); sync if one is due."""
        was_local = self.local and self.anchor is not None
        self.steps += 1
        if not was_local:
            return None
        self.skipped_inner_steps += int(skipped)
        self.local_steps_since_sync += 1
        if self._in_flight is not None and self.steps == self._in_flight.apply_at:
            return self._apply_in_flight()
        if self.sync_next:  # a sync asked for out of schedule (a fault-tolerant island joining)
            self.sync_next, self.met_in_batch = False, True
            return self.sync()
        if self._into_window(self.steps):
            return None
        self.met_in_batch = True
        if self.config.overlap_steps:
            self._start_sync()
            return None
        return self.sync()

    @property
    def sync_started(self) -> bool:
        """Whether the last optimizer step call started an overlapped sync (applied ``overlap_steps`` calls later)."""
        in_flight = self._in_flight
        return in_flight is not None and in_flight.apply_at - self.config.overlap_steps == self.steps

    def agree_sync_every(self, sync_s: float, compute_s: float) -> SyncEveryChoice | None:
        """``sync_every="auto"``: agree on the ranks' measurements of a sync and choose H from that sync on.

        Every rank calls it right after the same sync (an overlapped one: at its application, before the next
        starts) while :attr:`choosing`. The ranks agree, in one all-reduce of two numbers on the groups the sync used,
        on the slowest rank's step time (it paces every window) and the least sync time over the ranks: a rank that
        reached the sync earlier also waited there for the others, which the slowest rank's steps already count. The
        sync's exposed share is what is left of it beyond the ``overlap_steps`` steps of compute it runs beside.
        Returns the choice, also :attr:`sync_every_choice`; or ``None`` when a rank did not see the sync start or no
        rank measured a step (a resume just before, or with, that sync): the next sync is measured instead.

        Args:
            sync_s: this rank's seconds of the sync (see :class:`SyncEveryChoice`); 0 when not measured.
            compute_s: this rank's seconds per local optimizer step in the window before it; 0 when not measured.
        """
        assert self.choosing, "sync_every is a number, or H was chosen already"
        # The least sync time is the most of the step time, negated: both in one all-reduce (max).
        measured = torch.tensor([-sync_s, compute_s], dtype=torch.float64, device=self.params[0].device)
        for group in [self.process_group] if self.island is None else [self.island, self.process_group]:
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
        least_sync_s, compute_s = measured.tolist()
        sync_s = -least_sync_s
        if not (sync_s > 0 and compute_s > 0):
            return None
        overlap = self.config.overlap_steps
        exposed_share = max(0.0, sync_s - overlap * compute_s) / sync_s
        every = choose_sync_every(sync_s, compute_s, exposed_share)
        if every <= overlap:  # a sync is applied before the next one starts
            every = min(choice for choice in SYNC_EVERY_CHOICES if choice > overlap)
        self.sync_every_choice = SyncEveryChoice(every, sync_s, compute_s, exposed_share, self.steps - overlap)
        return self.sync_every_choice

    def fit_outer_to(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Resolve ``outer_lr`` and ``outer_momentum`` ``"auto"`` for the inner optimizers; whether either was.

        :data:`~lightning_ddpopt.localsgd.config.OUTER_DEFAULTS`' adaptive row if any optimizer is adaptive, else its
        other. A checkpoint's values, once loaded, stay: a resumed run keeps the outer step it saved.

        Args:
            optimizers: the run's inner optimizers.
        """
        if not self._asked.outer_auto:
            return False
        if not self.outer_from_checkpoint:
            self._set_outer(self._asked.fit_outer(any(map(is_adaptive, optimizers))))
        return True

    def _set_outer(self, config: LocalSGDConfig) -> None:
        """Use ``config`` (the outer settings resolved otherwise), its momentum buffers allocated if training began."""
        assert not config.outer_auto
        self.config = config
        if self.anchor is None:
            return
        if not config.outer_momentum:
            self.momentum = self._next_momentum = None
        else:
            self._allocate_momentum()

    def sync(self) -> ParameterSync:
        """Average the parameter change over the replicas, take the outer step, and load the new anchor."""
        report = self._exchange(outer_step=True)
        self.syncs += 1
        return report

    def finish(self) -> ParameterSync | None:
        """At the end of training: average the replicas' parameters if they trained alone since the last sync.

        A plain average (no outer step: a partial window is not an outer gradient), which becomes the anchor, so the
        model that is tested, saved or exported afterwards is the same on every rank. Like a sync it sends the
        parameter *change* since the last sync, compressed as configured (the parameters themselves would lose
        more in fp16 or int8); it is not counted in :attr:`syncs`.
        """
        if self._in_flight is not None:  # a sync still in flight: apply it first
            self._apply_in_flight()
        if self.anchor is None or not self.local or self.local_steps_since_sync == 0:
            return None
        report = self._exchange(outer_step=False)
        self.averaged_at_end = True
        return report

    # A sync that waits: change, mean, outer step, gather, buffers.

    def _exchange(self, outer_step: bool) -> ParameterSync:
        """Average ``anchor - params`` over the replicas and move the anchor by it; load it, sync the buffers.

        ``outer_step``: through the outer optimizer (a sync); otherwise plainly (the final average).
        """
        assert self.anchor is not None
        start = time.perf_counter()
        delta = self.layout.change(self.anchor, self._work_buffer())
        own_sq = squared_norm(delta)
        wire_bytes, committed = self._average(delta)
        drift = self._drift(own_sq, delta)
        if committed:  # a dropped sync (an island lost meanwhile) leaves the anchor: every island goes back to it
            self._outer_step(delta, outer_step)
        report = self._load(self.layout.gather(self.anchor), 1.0, start, wire_bytes, drift)
        self.local_steps_since_sync = 0
        return report

    # The mean, by mode (see the class doc): each leaves the mean change in the work buffer, ``delta``.

    def _average(self, delta: torch.Tensor) -> tuple[int, bool]:
        """The mean of ``delta`` (the work buffer) into it; the bytes sent, whether the sync commits.

        Over :attr:`process_group` by mode (always committed), or over the fault-tolerant quorum.
        """
        if self.across_islands is None:
            handle, wire, sent = self._send(delta)
            self._receive(handle, wire)
            return sent, True
        half = None if self.config.compression == "fp32" else self._wire_buffer()
        committed = self.across_islands(delta, half)  # fp16/bf16: divided by the islands, then cast
        return delta.numel() * (half if half is not None else delta).element_size(), committed

    def _send_all_reduce(self, delta: torch.Tensor) -> tuple[dist.Work, torch.Tensor, int]:
        """Start all-reducing ``delta`` / replicas; the work, the tensor it arrives in, the bytes sent."""
        # Divided by the replicas before a half-precision cast: no overflow of the sum where the mean would not.
        delta.div_(self.replicas)
        wire = delta if self._in_place else self._wire_buffer().copy_(delta)
        handle = dist.all_reduce(wire, group=self.process_group, async_op=True)
        assert handle is not None
        return handle, wire, wire.numel() * wire.element_size()

    def _receive_all_reduce(self, handle: dist.Work, wire: torch.Tensor) -> None:
        """Wait for the all-reduce; its sum (of changes already divided) into the work buffer."""
        handle.wait()
        if not self._in_place:
            self._work_buffer().copy_(wire)

    def _send_int8(self, delta: torch.Tensor) -> tuple[dist.Work, torch.Tensor, int]:
        """Start int8's first stage on the work buffer (``delta`` zero-padded to whole chunks)."""
        assert self._int8 is not None and self._work is not None and delta.data_ptr() == self._work.data_ptr()
        return self._int8.start(self._work)

    def _receive_int8(self, handle: dist.Work, wire: torch.Tensor) -> None:
        """int8's second stage: the reduced chunks gathered (into ``wire``) and dequantised into the work buffer."""
        assert self._int8 is not None and self._work is not None and self.anchor is not None
        self._int8.finish(handle, self._work, self.anchor.numel())

    # An overlapped sync (``overlap_steps``): started, carried on beside training, applied.

    def _start_sync(self) -> None:
        """Start sending the parameter change (``overlap_steps``); :meth:`_apply_in_flight` applies its mean.

        What follows its arrival runs beside the training thread where it can (see the class doc).
        """
        assert self.anchor is not None
        delta = self.layout.change(self.anchor, self._work_buffer())
        own_sq = squared_norm(delta)
        handle, wire, sent = self._send(delta)
        in_flight = self._in_flight = InFlight(wire, handle, self.steps + self.config.overlap_steps, sent, own_sq)
        worker = self._worker
        if worker is not None:

            def job() -> None:
                if worker.failed is None:  # else this rank's collectives would be out of step with the others'
                    self._receive(handle, wire)
                    if self.island is not None:
                        self._next_anchor(in_flight)

            in_flight.work, in_flight.ahead = None, True
            worker.submit(job)
        elif self._int8 is not None:  # on CUDA, on a side stream whose waits hold back nothing training queues
            in_flight.work, in_flight.ahead = None, True
            self._side.run(self._work_buffer(), lambda: self._receive(handle, wire))

    def _arrive(self, in_flight: InFlight) -> torch.Tensor:
        """Wait for a sync (and what was carried on beside it); the mean change it carried, in the work buffer."""
        if in_flight.work is not None:
            in_flight.work.wait()
            in_flight.work = None
        if in_flight.ahead:
            worker = self._worker
            if worker is not None:
                worker.drain()
                if worker.failed is not None:
                    raise RuntimeError("ddpopt: local SGD's sync failed on its worker thread") from worker.failed
            self._side.join()
            return self._work_buffer()
        return self._work_buffer().copy_(in_flight.wire)

    def _next_anchor(self, in_flight: InFlight) -> None:
        """In an island: the drift, and the outer step into the gather's stage and the next momentum, gathered.

        The anchor, the momentum and the mean (the work buffer) stay as they are; :meth:`_apply_in_flight` commits.
        """
        assert self.anchor is not None
        mean = self._work_buffer()
        if in_flight.own_sq is not None:
            in_flight.drift = self._drift(in_flight.own_sq, mean)
        stage, _ = self.layout.buffers(mean.device)
        self._outer_step(mean, outer_step=True, into=(stage[: mean.numel()], self._next_momentum))
        in_flight.gathered = self.layout.gather(stage)

    def _apply_in_flight(self) -> ParameterSync:
        """Wait for the mean change, take the outer step, and mix every rank's parameters with the new anchor.

        ``params = overlap_mixing x params + (1 - overlap_mixing) x new anchor``. The step counts as a sync.
        """
        assert self.anchor is not None and self._in_flight is not None
        start = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, None
        mean = self._arrive(in_flight)
        if self.island is None:
            drift = None if in_flight.own_sq is None else self._drift(in_flight.own_sq, mean)
            self._outer_step(mean, outer_step=True)
            model = self.anchor
        else:  # the same pass whether carried on ahead or not (restored, on CUDA, or a save took its buffer since)
            if in_flight.gathered is None:
                self._next_anchor(in_flight)
            assert in_flight.gathered is not None
            drift, model = in_flight.drift, in_flight.gathered
            self.anchor.copy_(model[self.layout.bounds[0] : self.layout.bounds[1]])
            if self._next_momentum is not None:
                self.momentum, self._next_momentum = self._next_momentum, self.momentum
        mixing = self.config.overlap_mixing
        # In place, one pass: params + (1 - alpha) (anchor - params); exactly the anchor with alpha 0.
        report = self._load(model, 1 - mixing, start, in_flight.wire_bytes, drift, overlapped=True)
        self.syncs += 1
        # The parameters hold part of the window the sync carried and the steps since it started; only with
        # mixing 0 are they the anchor itself.
        started = in_flight.apply_at - self.config.overlap_steps
        self.local_steps_since_sync = self.sync_every + self.steps - started if mixing else 0
        return report

    # The steps every sync shares.

    def _drift(self, own_sq: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared norms of this replica's change and of the mean change (over the island's shards)."""
        norms = torch.stack([own_sq, squared_norm(mean)])
        if self.island is not None:
            dist.all_reduce(norms, group=self.island)
        return norms[0], norms[1]

    def _outer_step(
        self,
        mean_delta: torch.Tensor,
        outer_step: bool,
        into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        """Move the anchor by the mean change (``mean_delta``, fp32): by the outer optimizer or plainly.

        ``into``: buffers for the new anchor and momentum, leaving the anchor, the momentum and ``mean_delta`` as they
        are; ``None``: in place, ``mean_delta`` overwritten. The same values, bit for bit, either way.

        Each update is one pass over the parameters, in fp32 only: on a CPU the passes cost the time, and torch's
        kernels that mix dtypes run about six times slower than one pass (measured on 25M values, one thread).
        """
        anchor, config, step, lr = self.anchor, self.config, mean_delta, 1.0
        assert anchor is not None
        anchor_out, momentum_out = into if into is not None else (anchor, self.momentum)
        if outer_step:
            outer_lr, momentum = config.outer_lr, config.outer_momentum
            assert outer_lr != "auto" and momentum != "auto"  # resolved at construction
            lr = outer_lr
            if momentum:
                assert self.momentum is not None and momentum_out is not None  # allocated with the anchor
                torch.add(mean_delta, self.momentum, alpha=momentum, out=momentum_out)
                step = momentum_out
                if config.nesterov:
                    out = anchor_out if into is not None else mean_delta
                    step = torch.add(mean_delta, momentum_out, alpha=momentum, out=out)
        torch.sub(anchor, step, alpha=lr, out=anchor_out)

    def _wire_buffer(self) -> torch.Tensor:
        """The shard-sized buffer a sync is sent in (half precision, or fp32 overlapped), kept between syncs."""
        assert self.anchor is not None
        dtype = WIRE_DTYPES[self.config.compression]
        if self._wire is None or self._wire.device != self.anchor.device:
            self._wire = torch.zeros(self.anchor.numel(), dtype=dtype, device=self.anchor.device)
        return self._wire

    def _work_buffer(self) -> torch.Tensor:
        """The unpadded part of the shard-sized fp32 buffer kept between syncs (int8: zero-padded to whole chunks).

        Kept, because a fresh model-sized allocation costs more than the arithmetic on a CPU.
        """
        assert self.anchor is not None
        if self._work is None or self._work.device != self.anchor.device:
            self._work = torch.zeros(self.layout.size, device=self.anchor.device)
        return self._work[: self.anchor.numel()]

    def _load(
        self,
        model: torch.Tensor,
        weight: float,
        start: float,
        wire_bytes: int,
        drift: tuple[torch.Tensor, torch.Tensor] | None,
        overlapped: bool = False,
    ) -> ParameterSync:
        """End a sync: move the parameters ``weight`` of the way to ``model`` (the whole new anchor), sync the buffers.

        Floating-point buffers are averaged (or broadcast) over every rank, the others broadcast; in an island summed
        (or taken from its first rank) inside it, then across the replicas. Returns the sync's report.
        """
        assert self.anchor is not None
        self.layout.load(model, weight=weight)
        self.layout.release()
        sent = 0
        groups = [self.process_group] if self.island is None else [self.island, self.process_group]
        for buffer in self.module.buffers():
            if buffer.is_floating_point() and self.config.buffers == "average":
                buffer.div_(self.replicas * self.layout.island_size)
                for group in groups:
                    dist.all_reduce(buffer, group=group)
            else:
                for group in groups:
                    dist.broadcast(buffer, src=dist.get_global_rank(group, 0) if group is not None else 0)
            sent += buffer.numel() * buffer.element_size()
        numel = self.anchor.numel()
        return ParameterSync(numel, numel * 4 + sent, wire_bytes + sent, start, time.perf_counter(), overlapped, drift)

    # The end of training, and teardown.

    def unshard(self) -> None:
        """Hold the whole anchor and outer momentum on every rank and leave the island (at the end of training).

        A collective on the island, once training is over: a checkpoint saved afterwards, when the island's groups
        are gone, holds the whole outer state. Nothing syncs afterwards.
        """
        if self.island is None:
            return
        assert self._in_flight is None, "finish() applies a sync in flight first"
        anchor = None if self.anchor is None else self.layout.gathered_copy(self.anchor)
        momentum = None if self.momentum is None else self.layout.gathered_copy(self.momentum)
        self.island = None
        self.layout = Shard(self.params, None, 1, 0, self._unit)
        self.anchor, self.momentum = anchor, momentum
        self._work = self._wire = self._next_momentum = None
        if self._int8 is not None:
            self._int8.release()

    def close(self) -> bool:
        """At teardown: stop the worker thread of overlapped syncs; False if it is still busy.

        Only after a failure is there a sync still in flight (fit's end applies it) or a sharded outer state (fit's
        end gathers it): both are forgotten; nothing waits for the sync any more, and a checkpoint saved afterwards
        holds no anchor (a resume anchors afresh at the weights), not a shard covering 1/M of the model.
        """
        self._in_flight = None
        if self.island is not None:
            self.anchor = self.momentum = None
        worker, self._worker = self._worker, None
        return worker is None or worker.stop()

    # Saved state: checkpoints (whole, or as this rank's slices) and a returning fault-tolerant island's heal.

    def state_dict(self) -> dict[str, Any]:
        """The counters, the whole anchor and outer momentum (the same on every replica), plus the config.

        A sync still in flight is waited for and its mean change saved, to be applied after a resume. With an
        island the shards are gathered: every rank of every island must call it (see :attr:`sharded`).
        """
        state, values = self.shard_state()
        del state["sharded"], state["slices"]
        for name, value in values.items():  # in the same order on every rank
            whole = self._whole(value).to(value.dtype)
            if name == "mean":
                state["in_flight"]["mean"] = whole
            else:
                state[name] = whole
        return state

    def shard_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """With an island: the counters and config, and this rank's slices of the outer state, not copied.

        For shards that each rank writes (:mod:`lightning_ddpopt.checkpoint_shards`): the first are the same on
        every rank, with every island rank's ``slices`` (``[start, stop)``); the second hold this rank's values of
        ``anchor``, ``momentum`` and (a sync still in flight) ``mean`` over its :attr:`layout`'s ``bounds``.
        """
        values: dict[str, torch.Tensor] = {}
        saved_in_flight, in_flight = None, self._in_flight
        if in_flight is not None:  # with int8, the reduced chunks: saved as their mean, in fp32
            if in_flight.work is not None:
                in_flight.work.wait()
                in_flight.work = None
            arrived = in_flight.wire.dtype == torch.int8 or in_flight.ahead
            mean = self._arrive(in_flight) if arrived else in_flight.wire
            values["mean"] = mean[: self.layout.bounds[1] - self.layout.bounds[0]]
            saved_in_flight = {"mean": None, "apply_at": in_flight.apply_at, "wire_bytes": in_flight.wire_bytes}
        if self.anchor is not None:
            values["anchor"] = self.anchor
        if self.momentum is not None:
            values["momentum"] = self.momentum
        choice = self.sync_every_choice
        state = {
            "config": asdict(self.config),
            "steps": self.steps,
            "syncs": self.syncs,
            "sync_every_choice": None if choice is None else asdict(choice),
            "anchor": None,
            "momentum": None,
            "in_flight": saved_in_flight,
            "sharded": sorted(values),
            "slices": self.layout.slices(),
        }
        return state, values

    def _whole(self, shard: torch.Tensor) -> torch.Tensor:
        """A copy of the whole model's values of ``shard`` on the CPU (in an island: gathered from its ranks).

        The island's gather reuses the buffers an overlapped sync's next anchor was gathered into ahead: the apply
        then computes it again, from the anchor, momentum and mean that are left as they were until then.
        """
        if self.island is None:
            return shard.detach().cpu().clone()
        if self._in_flight is not None and self._in_flight.gathered is not None:
            self._in_flight.gathered = None
            self.layout.release()  # every rank of the island gathered it ahead, and none will read it
        return self.layout.gathered_copy(shard.detach().float()).cpu()

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore :meth:`state_dict` output; return why it could not be, in words, or ``None``.

        The saved state covers the whole model: each rank takes its shard, whatever the layout it was saved on.
        """
        expected = _saved_config(self._asked, state.get("config"))
        reason = config_mismatch("local SGD", state, expected)
        if reason is not None:
            return f"{reason}; the outer loop starts afresh from the weights"
        anchor, momentum = state["anchor"], state["momentum"]
        if anchor is not None and anchor.numel() != self.layout.numel:
            numel = self.layout.numel
            return f"the saved anchor has {anchor.numel()} values and the model {numel}; the outer loop starts afresh"
        if self._asked.outer_auto:  # what "auto" resolved to when saved
            outer = {name: expected[name] for name in ("outer_lr", "outer_momentum", "nesterov")}
            self._set_outer(dataclasses.replace(self._asked, **outer))
            self.outer_from_checkpoint = True
        choice = state.get("sync_every_choice")
        self.sync_every_choice = None if choice is None else SyncEveryChoice(**choice)
        device = self.params[0].device
        start, stop = self.layout.bounds
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.anchor = None if anchor is None else anchor[start:stop].to(device, torch.float32).clone()
        self.momentum = None if momentum is None else momentum[start:stop].to(device, torch.float32).clone()
        if self.anchor is not None:
            self._allocate()
        saved = state.get("in_flight")
        self._in_flight = None
        if saved is not None:
            wire = saved["mean"][start:stop].to(device).clone()
            self._in_flight = InFlight(wire, None, int(saved["apply_at"]), int(saved["wire_bytes"]))
        # Every rank resumes from the saved weights (rank 0's): off the anchor by rank 0's steps since the sync.
        since = self._into_window(self.steps) if self.local and self.anchor is not None else 0
        self.local_steps_since_sync = since + (self.sync_every if self._in_flight is not None else 0)
        return None

    def heal_state(self) -> dict[str, Any]:
        """This rank's outer loop, for the same rank of a returning fault-tolerant island (tensors by reference).

        ``outer``: the outer step in use, which a returning island takes where it asked ``"auto"`` (the live islands'
        may come from a checkpoint the returning one never read).
        """
        return {
            "steps": self.steps,
            "syncs": self.syncs,
            "steps_off_anchor": self.local_steps_since_sync,
            "anchor": self.anchor,
            "momentum": self.momentum,
            "outer": {name: getattr(self.config, name) for name in ("outer_lr", "outer_momentum", "nesterov")},
        }

    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Take a live island's :meth:`heal_state` (in a sync, as it was taken: the sync then goes on as theirs)."""
        self.steps, self.syncs, self.local_steps_since_sync = state["steps"], state["syncs"], state["steps_off_anchor"]
        outer = state.get("outer")  # absent from a live island of an earlier release
        if self._asked.outer_auto and outer is not None:  # the fields asked "auto" take theirs, as from a checkpoint
            taken = _saved_config(self._asked, outer)
            self._set_outer(dataclasses.replace(self._asked, **{name: taken[name] for name in outer}))
            self.outer_from_checkpoint = True
        for name in ("anchor", "momentum"):
            mine, theirs = getattr(self, name), state[name]
            if theirs is None or mine is None or mine.shape != theirs.shape:
                setattr(self, name, None if theirs is None else theirs.to(self.params[0].device).clone())
            else:
                mine.copy_(theirs)


def _saved_config(asked: LocalSGDConfig, saved: object) -> dict[str, Any]:
    """The config fields a saved outer loop must match, for the config ``asked`` and the ``saved`` one.

    The replica layout may change (the state is the model's). ``outer_lr`` and ``outer_momentum`` ``"auto"`` match
    what they resolved to when saved (its ``nesterov`` then on only with a momentum above 0).
    """
    fields = asdict(asked)
    fields.pop("replica")
    if not isinstance(saved, dict):
        return fields
    lr, momentum = saved.get("outer_lr"), saved.get("outer_momentum")
    if asked.outer_lr == "auto" and is_real_number(lr):
        fields["outer_lr"] = lr
    if asked.outer_momentum == "auto" and is_real_number(momentum):
        fields["outer_momentum"] = momentum
        fields["nesterov"] = asked.nesterov and momentum > 0
    return fields
