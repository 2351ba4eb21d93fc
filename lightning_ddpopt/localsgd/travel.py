"""Local SGD's syncs that travel (``overlap_steps``): started at the sync point, carried on beside training, applied.

Mixed into :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`, which holds the state these methods use; see its
class doc for where a travelling sync's work runs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.base import squared_norm
from lightning_ddpopt.hooks.streams import SideStreams
from lightning_ddpopt.localsgd.config import LocalSGDConfig
from lightning_ddpopt.localsgd.int8_mean import Int8Mean
from lightning_ddpopt.localsgd.outer_state import InFlight, ParameterSync
from lightning_ddpopt.localsgd.shard import Shard

__all__ = ["TravellingSync"]


class TravellingSync:
    """Start, carry on and apply a travelling sync (see :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`)."""

    config: LocalSGDConfig
    process_group: dist.ProcessGroup | None
    island: dist.ProcessGroup | None
    replicas: int
    layout: Shard
    steps: int
    syncs: int
    anchor: torch.Tensor | None
    momentum: torch.Tensor | None
    _in_flight: InFlight | None
    _work: torch.Tensor | None
    _int8: Int8Mean | None
    _worker: Worker | None
    _side: SideStreams
    _next_momentum: torch.Tensor | None
    _steps_off_anchor: int

    # The loop's own, which a travelling sync uses.
    def _work_buffer(self) -> torch.Tensor:
        raise NotImplementedError

    def _wire_buffer(self) -> torch.Tensor:
        raise NotImplementedError

    def _drift(self, own_sq: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _outer_step(
        self,
        mean_delta: torch.Tensor,
        outer_step: bool,
        into: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> None:
        raise NotImplementedError

    def _sync_buffers(self) -> int:
        raise NotImplementedError

    def _start_sync(self) -> None:
        """Start sending the parameter change (``overlap_steps``); :meth:`_apply_in_flight` applies its mean.

        What follows its arrival runs beside the training thread where it can (see the class doc).
        """
        assert self.anchor is not None
        delta = self.layout.change(self.anchor, self._work_buffer())
        own_sq = squared_norm(delta)
        handle: dist.Work | None
        if self._int8 is not None:
            assert self._work is not None
            handle, wire, sent = self._int8.start(self._work)
        else:
            wire = self._wire_buffer()
            wire.copy_(delta.div_(self.replicas))  # divided before a half-precision cast
            handle = dist.all_reduce(wire, group=self.process_group, async_op=True)
            sent = wire.numel() * wire.element_size()
        assert handle is not None
        in_flight = self._in_flight = InFlight(wire, handle, self.steps + self.config.overlap_steps, sent, own_sq)
        worker = self._worker
        if worker is not None:

            def job() -> None:
                if worker.failed is None:  # else this rank's collectives would be out of step with the others'
                    self._receive(in_flight, handle)
                    if self.island is not None:
                        self._next_anchor(in_flight)

            in_flight.work, in_flight.ahead = None, True
            worker.submit(job)
        elif self._int8 is not None:  # on CUDA, on a side stream whose waits hold back nothing training queues
            in_flight.work, in_flight.ahead = None, True
            self._side.run(self._work_buffer(), lambda: self._receive(in_flight, handle))

    def _receive(self, in_flight: InFlight, handle: dist.Work) -> None:
        """The mean change into the work buffer once it arrives: int8's second stage, or the wait and a copy."""
        if self._int8 is not None:
            assert self._work is not None and self.anchor is not None
            self._int8.finish(handle, self._work, self.anchor.numel())
        else:
            handle.wait()
            self._work_buffer().copy_(in_flight.wire)

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
        # In place, one pass: params + (1 - alpha) (anchor - params); exactly the anchor with alpha 0.
        self.layout.load(model, weight=1 - self.config.overlap_mixing)
        self.layout.release()
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
