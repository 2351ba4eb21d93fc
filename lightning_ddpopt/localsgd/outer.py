"""Local SGD's outer loop: each rank's parameter change averaged every ``H`` steps, the outer step, the anchor.

See :mod:`lightning_ddpopt.localsgd` for the method; :class:`LocalSGD` is driven by
:class:`~lightning_ddpopt.localsgd.driver.LocalSGDDriver`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.base import squared_norm
from lightning_ddpopt.hooks.feedback import config_mismatch
from lightning_ddpopt.hooks.int8_codec import all_gather_async, average_packed, packed_size, quantize_packed
from lightning_ddpopt.localsgd.config import INT8_BLOCK, WIRE_DTYPES, LocalSGDConfig

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


@dataclass
class _InFlight:
    """A sync started and not applied yet: what carries the mean change, and when to apply it.

    ``wire``: the mean change (all-reduced, or restored from a checkpoint), or with int8 every rank's packed row.
    ``own_sq``: the squared norm of this rank's change (``None`` when restored from a checkpoint).
    """

    wire: torch.Tensor
    work: dist.Work | None
    apply_at: int
    wire_bytes: int
    own_sq: torch.Tensor | None = None


class LocalSGD:
    """The outer loop of local SGD / DiLoCo over ``module``'s parameters; the strategy drives it.

    Call :meth:`before_batch` before each training batch's forward (it says whether gradients sync) and
    :meth:`after_optimizer_step` after each optimizer step call. ``anchor`` (the parameters of the last sync, one
    flat fp32 tensor) and ``momentum`` are the same on every rank.
    """

    def __init__(
        self, config: LocalSGDConfig, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> None:
        self.config = config
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.steps = 0
        self.syncs = 0
        self.skipped_inner_steps = 0
        self.anchor: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None
        self.averaged_at_end = False
        #: Whether the current batch synchronises gradients (the warm-up), the same on every rank.
        self.gradients_sync = True
        #: Whether the ranks met in the current batch so far: its gradients synced, or an optimizer step of it took
        #: part in a parameter sync (see :attr:`next_step_meets`).
        self.met_in_batch = True
        self._work: torch.Tensor | None = None
        self._in_flight: _InFlight | None = None
        self._wire: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None
        # Local steps whose progress the parameters hold apart from the anchor (see local_steps_since_sync).
        self._steps_off_anchor = 0

    @property
    def local(self) -> bool:
        """Whether the warm-up is over: gradients are no longer synchronised."""
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
        """Anchor the parameters when the local phase begins; return whether this batch's gradients sync."""
        self.gradients_sync = self.met_in_batch = not self.local
        if not self.local:
            return True
        if self.anchor is None:  # identical on every rank: DDP synced them until now (or broadcast them at start)
            self.anchor = self._flat_parameters()
            self._allocate()
        return False

    def _allocate(self) -> None:
        """Allocate, and write once, the model-sized buffers the syncs reuse, when the local phase begins.

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
        if self.config.compression == "int8":
            self._int8_buffers()
            # With numba, its loops compile at their first call (about half a second): here, not in the first sync.
            block = torch.zeros(1, INT8_BLOCK, device=self.anchor.device)
            average_packed(quantize_packed(block).repeat(self.world_size, 1), block)

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
        """All-reduce the mean parameter change, take the outer step, and load the new anchor into the model."""
        report = self._exchange(outer_step=True)
        self.syncs += 1
        return report

    def _start_sync(self) -> None:
        """Start sending the parameter change (``overlap_steps``); :meth:`_apply_in_flight` applies its mean."""
        delta = self._local_change()
        own_sq = squared_norm(delta)
        work: dist.Work | None
        if self.config.compression == "int8":
            packed, wire = self._int8_buffers()
            quantize_packed(self._int8_blocks(), out=packed)
            work, sent = all_gather_async(wire, packed.view(-1), self.process_group), packed.numel()
        else:
            wire = self._wire_buffer()
            wire.copy_(delta.div_(self.world_size))  # divided before a half-precision cast
            work = dist.all_reduce(wire, group=self.process_group, async_op=True)
            sent = wire.numel() * wire.element_size()
        self._in_flight = _InFlight(wire, work, self.steps + self.config.overlap_steps, sent, own_sq)

    def _arrived_mean(self, in_flight: _InFlight) -> torch.Tensor:
        """The mean change a sync carried, in the work buffer (fp32); the sync must have arrived."""
        if in_flight.wire.dtype == torch.int8:
            return self._average_packed(in_flight.wire)
        return self._work_buffer().copy_(in_flight.wire)

    def abandon_in_flight(self) -> None:
        """Forget a sync still travelling (training failed before applying it); nothing waits for it any more."""
        self._in_flight = None

    def _apply_in_flight(self) -> ParameterSync:
        """Wait for the mean change, take the outer step, and mix every rank's parameters with the new anchor.

        ``params = overlap_mixing x params + (1 - overlap_mixing) x new anchor``. The step counts as a sync.
        """
        assert self.anchor is not None and self._in_flight is not None
        start = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, None
        if in_flight.work is not None:
            in_flight.work.wait()
        mean = self._arrived_mean(in_flight)
        drift = None if in_flight.own_sq is None else (in_flight.own_sq, squared_norm(mean))
        self._outer_step(mean, outer_step=True)
        # In place, one pass: params + (1 - alpha) (anchor - params); exactly the anchor with alpha 0.
        self._load_parameters(self.anchor, weight=1 - self.config.overlap_mixing)
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
        """At the end of training: average the ranks' parameters if they trained alone since the last sync.

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
        """Average ``anchor - params`` over the ranks and move the anchor by it; load it, sync the buffers.

        ``outer_step``: through the outer optimizer (a sync); otherwise plainly (the final average).
        """
        assert self.anchor is not None
        anchor = self.anchor
        start = time.perf_counter()
        delta = self._local_change()
        own_sq = squared_norm(delta)
        wire_bytes = self._mean_inplace(delta)
        drift = (own_sq, squared_norm(delta))
        self._outer_step(delta, outer_step)
        self._load_parameters(anchor)
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
        """The parameter-sized buffer a sync travels in (half precision, or fp32 overlapped), kept between syncs."""
        assert self.anchor is not None
        dtype = WIRE_DTYPES[self.config.compression]
        if self._wire is None or self._wire.device != self.anchor.device:
            self._wire = torch.zeros(self.anchor.numel(), dtype=dtype, device=self.anchor.device)
        return self._wire

    def _int8_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's packed int8 row and the gathered rows of every rank.

        Kept between syncs on a CPU and with ``overlap_steps`` (the rows travel through the window anyway); on a GPU
        without overlap the gathered rows (a byte per parameter and rank) are allocated for each sync only, not held
        through the steps, whose activations need the memory.
        """
        assert self._work is not None
        device = self._work.device
        size = packed_size(self._work.numel(), INT8_BLOCK)
        if self._packed is None or self._packed.device != device:
            self._packed = torch.zeros(1, size, dtype=torch.int8, device=device)
        gathered = self._gathered
        if gathered is None or gathered.device != device:
            keep = device.type == "cpu" or bool(self.config.overlap_steps)
            # Written once when kept, so its pages are mapped before the first sync (see _allocate).
            gathered = (torch.zeros if keep else torch.empty)(self.world_size * size, dtype=torch.int8, device=device)
            self._gathered = gathered if keep else None
        return self._packed, gathered

    def _work_buffer(self) -> torch.Tensor:
        """The unpadded part of a parameter-sized fp32 buffer kept between syncs, zero-padded to whole int8 blocks.

        Kept, because a fresh model-sized allocation costs more than the arithmetic on a CPU.
        """
        assert self.anchor is not None
        if self._work is None or self._work.device != self.anchor.device:
            padded = self.anchor.numel() + -self.anchor.numel() % INT8_BLOCK
            self._work = torch.zeros(padded, device=self.anchor.device)
        return self._work[: self.anchor.numel()]

    @property
    def local_steps_since_sync(self) -> int:
        """Local optimizer steps whose progress the anchor does not hold.

        0 right after a sync without overlap and in the warm-up; with ``overlap_steps`` and ``overlap_mixing > 0``
        the window the last sync carried plus the steps since it started (part of their progress is mixed in).
        """
        return self._steps_off_anchor

    def state_dict(self) -> dict[str, Any]:
        """The counters, the anchor and the outer momentum (the same on every rank), plus the config.

        A sync still travelling is waited for and its mean change saved, to be applied after a resume.
        """
        in_flight = self._in_flight
        if in_flight is not None and in_flight.work is not None:
            in_flight.work.wait()
            in_flight.work = None
        saved = None
        if in_flight is not None:  # with int8, the ranks' packed rows: saved as their mean
            mean = self._arrived_mean(in_flight) if in_flight.wire.dtype == torch.int8 else in_flight.wire
            saved = {
                "mean": mean.detach().cpu().clone(),
                "apply_at": in_flight.apply_at,
                "wire_bytes": in_flight.wire_bytes,
            }
        return {
            "config": asdict(self.config),
            "steps": self.steps,
            "syncs": self.syncs,
            "anchor": None if self.anchor is None else self.anchor.detach().cpu().clone(),
            "momentum": None if self.momentum is None else self.momentum.detach().cpu().clone(),
            "in_flight": saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Restore :meth:`state_dict` output; return why it could not be, in words, or ``None``."""
        reason = config_mismatch("local SGD", state, asdict(self.config))
        if reason is not None:
            return f"{reason}; the outer loop starts afresh from the weights"
        anchor, momentum = state["anchor"], state["momentum"]
        numel = sum(p.numel() for p in self.params)
        if anchor is not None and anchor.numel() != numel:
            return f"the saved anchor has {anchor.numel()} values and the model {numel}; the outer loop starts afresh"
        device = self.params[0].device
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.anchor = None if anchor is None else anchor.to(device, torch.float32)
        self.momentum = None if momentum is None else momentum.to(device, torch.float32)
        if self.anchor is not None:
            self._allocate()
        saved = state.get("in_flight")
        self._in_flight = None
        if saved is not None:
            wire = saved["mean"].to(device)
            self._in_flight = _InFlight(wire, None, int(saved["apply_at"]), int(saved["wire_bytes"]))
        # Every rank resumes from the saved weights (rank 0's): off the anchor by rank 0's steps since the sync.
        window = self.config.sync_every
        since = (self.steps - self.config.warmup_steps) % window if self.local and self.anchor is not None else 0
        self._steps_off_anchor = since + (window if self._in_flight is not None else 0)
        return None

    def _mean_inplace(self, delta: torch.Tensor) -> int:
        """The mean of ``delta`` over the ranks, sent as the config says, into ``delta``; the bytes this rank sent."""
        if self.config.compression == "int8":
            return self._int8_mean_inplace(delta)
        # Divided by the world size before a half-precision cast: no overflow of the sum where the mean would not.
        delta.div_(self.world_size)
        wire = delta if self.config.compression == "fp32" else self._wire_buffer().copy_(delta)
        dist.all_reduce(wire, group=self.process_group)
        if wire is not delta:
            delta.copy_(wire)
        return wire.numel() * wire.element_size()

    def _int8_mean_inplace(self, delta: torch.Tensor) -> int:
        assert self._work is not None and delta.data_ptr() == self._work.data_ptr()
        packed, gathered = self._int8_buffers()
        quantize_packed(self._int8_blocks(), out=packed)
        all_gather_async(gathered, packed.view(-1), self.process_group).wait()
        self._average_packed(gathered)
        return packed.numel()

    def _int8_blocks(self) -> torch.Tensor:
        """The work buffer as rows of one int8 block each: the change and its zero padding."""
        assert self._work is not None
        return self._work.view(-1, INT8_BLOCK)

    def _average_packed(self, gathered: torch.Tensor) -> torch.Tensor:
        """The mean of every rank's packed row into the work buffer (returned, unpadded), the same bits everywhere.

        Every rank sums the ranks' dequantised blocks in rank order.
        """
        assert self._work is not None
        average_packed(gathered.view(self.world_size, -1), self._int8_blocks())
        mean = self._work_buffer()
        self._work[mean.numel() :].zero_()  # 0 x a non-finite scale is not 0: the padding must stay zero
        return mean

    def _flat_parameters(self) -> torch.Tensor:
        """The parameters end to end in fp32."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _local_change(self) -> torch.Tensor:
        """``anchor - params`` in the kept work buffer, straight from the parameters (one pass)."""
        assert self.anchor is not None
        delta, offset = self._work_buffer(), 0
        for p in self.params:
            end = offset + p.numel()
            torch.sub(self.anchor[offset:end], p.detach().reshape(-1), out=delta[offset:end])
            offset = end
        return delta

    def _load_parameters(self, flat: torch.Tensor, weight: float = 1.0) -> None:
        """Copy ``flat`` into the parameters, or move them ``weight`` of the way towards it (``lerp``)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                values = flat[offset : offset + p.numel()].view_as(p)
                if weight == 1.0:
                    p.copy_(values)
                elif p.dtype == values.dtype:
                    p.lerp_(values, weight)
                else:  # mixed in fp32, rounded to the parameter's dtype once
                    p.copy_(p.float().lerp_(values, weight))
                offset += p.numel()

    def _sync_buffers(self) -> int:
        """Average floating-point buffers (or broadcast them) and broadcast the others; return the bytes sent."""
        sent = 0
        for buffer in self.module.buffers():
            if buffer.is_floating_point() and self.config.buffers == "average":
                buffer.div_(self.world_size)
                dist.all_reduce(buffer, group=self.process_group)
            else:
                dist.broadcast(buffer, src=dist.get_global_rank(self.process_group, 0) if self.process_group else 0)
            sent += buffer.numel() * buffer.element_size()
        return sent
