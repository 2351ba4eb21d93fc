"""Local SGD's outer loop: each rank's parameter change averaged every ``H`` steps, the outer step, the anchor.

See :mod:`lightning_ddpopt.localsgd` for the method; :class:`LocalSGD` is driven by
:class:`~lightning_ddpopt.localsgd.driver.LocalSGDDriver`. Terms (meeting, travel, island): the design page's glossary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.base import squared_norm
from lightning_ddpopt.localsgd.config import INT8_BLOCK, WIRE_DTYPES, LocalSGDConfig
from lightning_ddpopt.localsgd.int8_mean import Int8Mean
from lightning_ddpopt.localsgd.outer_state import InFlight, OuterState
from lightning_ddpopt.localsgd.shard import Shard

__all__ = ["LocalSGD", "ParameterSync"]


@dataclass(frozen=True)
class ParameterSync:
    """One parameter sync: what it sent and when (host seconds), for the ledger.

    ``overlapped``: it travelled while the ranks trained on; ``start_s`` to ``end_s`` is its arrival only.
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


class LocalSGD(OuterState):
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
    """

    def __init__(
        self,
        config: LocalSGDConfig,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        island: dist.ProcessGroup | None = None,
        place: int | None = None,
    ) -> None:
        self.config = config
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
        # Local steps whose progress the parameters hold apart from the anchor (see local_steps_since_sync).
        self._steps_off_anchor = 0

    def unshard(self) -> None:
        """Hold the whole anchor and outer momentum on every rank and leave the island (at the end of training).

        A collective on the island, once training is over: a checkpoint saved afterwards, when the island's groups
        are gone, holds the whole outer state. Nothing syncs afterwards.
        """
        if self.island is None:
            return
        assert self._in_flight is None, "finish() applies a travelling sync first"
        anchor = None if self.anchor is None else self.layout.gather(self.anchor).clone()
        momentum = None if self.momentum is None else self.layout.gather(self.momentum).clone()
        self.island = None
        self.layout = Shard(self.params, None, 1, 0, self._unit)
        self.anchor, self.momentum = anchor, momentum
        self._work = self._wire = None
        if self._int8 is not None:
            self._int8.release()

    @property
    def sharded(self) -> bool:
        """Whether the outer state is sharded over an island (saving it takes every rank: each saves its slice)."""
        return self.island is not None

    @property
    def local(self) -> bool:
        """Whether the warm-up is over: gradients are no longer synchronised over every rank."""
        return self.steps >= self.config.warmup_steps

    @property
    def window_starts(self) -> bool:
        """Whether the next batch is in the warm-up or in a sync window's first optimizer step (every rank alike).

        With gradient accumulation: each micro-batch of that step.
        """
        return not self.local or (self.steps - self.config.warmup_steps) % self.config.sync_every == 0

    @property
    def next_step_meets(self) -> bool:
        """Whether the next optimizer step call meets the other ranks, the same on every rank.

        It does when it syncs gradients (the warm-up) or takes part in a parameter sync: the sync itself, or the start
        of one that travels while the ranks train on (applying it later waits for the slower rank's start anyway).
        """
        return not self.local or (self.steps + 1 - self.config.warmup_steps) % self.config.sync_every == 0

    @property
    def meets_in_passing(self) -> bool:
        """Whether the ranks' meetings are in passing (see :mod:`lightning_ddpopt.meetings`), the same on every rank.

        In the local phase with ``overlap_steps``: a sync starts and the ranks train on without waiting for each other.
        """
        return self.local and bool(self.config.overlap_steps)

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
        if self.config.compression in ("fp16", "bf16") or (
            self.config.compression == "fp32" and self.config.overlap_steps
        ):
            self._wire_buffer()
        if self.config.outer_momentum and self.momentum is None:
            # The same first outer step as no momentum yet: 0.9 x 0 + change is the change, bit for bit.
            self.momentum = torch.zeros_like(self.anchor)
        if self.island is not None:
            self.layout.buffers(self.anchor.device)
        if self._int8 is not None:
            assert self._work is not None
            self._int8.prepare(self._work, overlapped=bool(self.config.overlap_steps))

    def after_optimizer_step(self, skipped: bool = False) -> ParameterSync | None:
        """Count one optimizer step call (``skipped``: the GradScaler skipped it); sync if one is due."""
        was_local = self.local and self.anchor is not None
        self.steps += 1
        if not was_local:
            return None
        self.skipped_inner_steps += int(skipped)
        self._steps_off_anchor += 1
        if self._in_flight is not None and self.steps == self._in_flight.apply_at:
            return self._apply_in_flight()
        if (self.steps - self.config.warmup_steps) % self.config.sync_every:
            return None
        self.met_in_batch = True
        if self.config.overlap_steps:
            self._start_sync()
            return None
        return self.sync()

    def sync(self) -> ParameterSync:
        """Average the parameter change over the replicas, take the outer step, and load the new anchor."""
        report = self._exchange(outer_step=True)
        self.syncs += 1
        return report

    def _start_sync(self) -> None:
        """Start sending the parameter change (``overlap_steps``); :meth:`_apply_in_flight` applies its mean."""
        assert self.anchor is not None
        delta = self.layout.change(self.anchor, self._work_buffer())
        own_sq = squared_norm(delta)
        work: dist.Work | None
        if self._int8 is not None:
            assert self._work is not None
            started, wire, sent = self._int8.start(self._work)
            self._int8.finish_beside(started, self._work, delta.numel())
            work = None
        else:
            wire = self._wire_buffer()
            wire.copy_(delta.div_(self.replicas))  # divided before a half-precision cast
            work = dist.all_reduce(wire, group=self.process_group, async_op=True)
            sent = wire.numel() * wire.element_size()
        self._in_flight = InFlight(wire, work, self.steps + self.config.overlap_steps, sent, own_sq)

    def _arrive(self, in_flight: InFlight) -> torch.Tensor:
        """Wait for a sync; the mean change it carried, in the work buffer (fp32)."""
        if in_flight.work is not None:
            in_flight.work.wait()
            in_flight.work = None
        if self._int8 is not None and in_flight.wire.dtype == torch.int8:
            self._int8.wait()
            return self._work_buffer()
        return self._work_buffer().copy_(in_flight.wire)

    def abandon_in_flight(self) -> None:
        """Forget a sync still travelling (training failed before applying it); nothing waits for it any more."""
        self._in_flight = None

    def close(self) -> bool:
        """Stop the worker thread of int8's overlapped syncs (at teardown); False if it is still busy."""
        return self._int8 is None or self._int8.close()

    def drop_shards(self) -> None:
        """Forget a sharded outer state that training ended without gathering (a failure): it covers 1/M of the model.

        A checkpoint saved afterwards holds no anchor (a resume anchors afresh at the weights), not a shard.
        """
        if self.island is not None:
            self.anchor = self.momentum = None
            self._in_flight = None

    def _apply_in_flight(self) -> ParameterSync:
        """Wait for the mean change, take the outer step, and mix every rank's parameters with the new anchor.

        ``params = overlap_mixing x params + (1 - overlap_mixing) x new anchor``. The step counts as a sync.
        """
        assert self.anchor is not None and self._in_flight is not None
        start = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, None
        mean = self._arrive(in_flight)
        drift = None if in_flight.own_sq is None else self._drift(in_flight.own_sq, mean)
        self._outer_step(mean, outer_step=True)
        # In place, one pass: params + (1 - alpha) (anchor - params); exactly the anchor with alpha 0.
        self.layout.load(self.layout.gather(self.anchor), weight=1 - self.config.overlap_mixing)
        buffer_bytes = self._sync_buffers()
        self.syncs += 1
        # The parameters hold part of the window the sync carried and the steps since it started; only with
        # mixing 0 are they the anchor itself.
        started = in_flight.apply_at - self.config.overlap_steps
        mixing = self.config.overlap_mixing
        self._steps_off_anchor = self.config.sync_every + self.steps - started if mixing else 0
        return ParameterSync(
            num_elements=self.anchor.numel(),
            logical_bytes=self.anchor.numel() * 4 + buffer_bytes,
            wire_bytes=in_flight.wire_bytes + buffer_bytes,
            start_s=start,
            end_s=time.perf_counter(),
            overlapped=True,
            drift=drift,
        )

    def finish(self) -> ParameterSync | None:
        """At the end of training: average the replicas' parameters if they trained alone since the last sync.

        A plain average (no outer step: a partial window is not an outer gradient), which becomes the anchor, so the
        model that is tested, saved or exported afterwards is the same on every rank. Like a sync it sends the
        parameter *change* since the last sync, compressed as configured (the parameters themselves would lose
        more in fp16 or int8); it is not counted in :attr:`syncs`.
        """
        if self._in_flight is not None:  # a sync still travelling: apply it first
            self._apply_in_flight()
        if self.anchor is None or not self.local or self._steps_off_anchor == 0:
            return None
        report = self._exchange(outer_step=False)
        self.averaged_at_end = True
        return report

    def _exchange(self, outer_step: bool) -> ParameterSync:
        """Average ``anchor - params`` over the replicas and move the anchor by it; load it, sync the buffers.

        ``outer_step``: through the outer optimizer (a sync); otherwise plainly (the final average).
        """
        assert self.anchor is not None
        anchor = self.anchor
        start = time.perf_counter()
        delta = self.layout.change(self.anchor, self._work_buffer())
        own_sq = squared_norm(delta)
        wire_bytes = self._mean_inplace(delta)
        drift = self._drift(own_sq, delta)
        self._outer_step(delta, outer_step)
        self.layout.load(self.layout.gather(self.anchor))
        buffer_bytes = self._sync_buffers()
        self._steps_off_anchor = 0
        return ParameterSync(
            num_elements=anchor.numel(),
            logical_bytes=anchor.numel() * 4 + buffer_bytes,
            wire_bytes=wire_bytes + buffer_bytes,
            start_s=start,
            end_s=time.perf_counter(),
            drift=drift,
        )

    def _drift(self, own_sq: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The squared norms of this replica's change and of the mean change (over the island's shards)."""
        norms = torch.stack([own_sq, squared_norm(mean)])
        if self.island is not None:
            dist.all_reduce(norms, group=self.island)
        return norms[0], norms[1]

    def _outer_step(self, mean_delta: torch.Tensor, outer_step: bool) -> None:
        """Move the anchor by the mean change (``mean_delta``, fp32, overwritten): by the outer optimizer or plainly.

        Each update is one pass over the parameters, in fp32 only: on a CPU the passes cost the time, and torch's
        kernels that mix dtypes run about six times slower than one pass (measured on 25M values, one thread).
        """
        assert self.anchor is not None
        config, step, lr = self.config, mean_delta, 1.0
        if outer_step:
            lr = config.outer_lr
            if config.outer_momentum:
                momentum = self.momentum
                assert momentum is not None  # allocated with the anchor
                torch.add(mean_delta, momentum, alpha=config.outer_momentum, out=momentum)
                if config.nesterov:
                    step = torch.add(mean_delta, momentum, alpha=config.outer_momentum, out=mean_delta)
                else:
                    step = momentum
        self.anchor.sub_(step, alpha=lr)

    def _wire_buffer(self) -> torch.Tensor:
        """The shard-sized buffer a sync travels in (half precision, or fp32 overlapped), kept between syncs."""
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

    @property
    def local_steps_since_sync(self) -> int:
        """Local optimizer steps whose progress the anchor does not hold.

        0 right after a sync without overlap and in the warm-up; with ``overlap_steps`` and ``overlap_mixing > 0``
        the window the last sync carried plus the steps since it started (part of their progress is mixed in).
        """
        return self._steps_off_anchor

    def _mean_inplace(self, delta: torch.Tensor) -> int:
        """The mean of ``delta`` over the replicas, sent as the config says, into ``delta``; the bytes sent."""
        if self._int8 is not None:
            assert self._work is not None and delta.data_ptr() == self._work.data_ptr()
            work, _, sent = self._int8.start(self._work)
            self._int8.finish(work, self._work, delta.numel())
            return sent
        # Divided by the replicas before a half-precision cast: no overflow of the sum where the mean would not.
        delta.div_(self.replicas)
        wire = delta if self.config.compression == "fp32" else self._wire_buffer().copy_(delta)
        dist.all_reduce(wire, group=self.process_group)
        if wire is not delta:
            delta.copy_(wire)
        return wire.numel() * wire.element_size()

    def _sync_buffers(self) -> int:
        """Average floating-point buffers (or broadcast them) over every rank, broadcast the others; the bytes sent.

        In an island: summed (or taken from its first rank) inside it, then across the replicas.
        """
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
        return sent
