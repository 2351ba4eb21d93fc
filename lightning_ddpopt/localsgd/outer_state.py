"""Local SGD's outer loop in checkpoints: its counters and outer state, whole or as this rank's slices, and restored.

Mixed into :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`; the shards that hold an island's slices are
:mod:`lightning_ddpopt.checkpoint_shards`'.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.feedback import config_mismatch
from lightning_ddpopt.localsgd.config import LocalSGDConfig
from lightning_ddpopt.localsgd.shard import Shard

__all__ = ["InFlight", "OuterState", "ParameterSync"]


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


class OuterState:
    """Saving and restoring the outer loop (see :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`)."""

    config: LocalSGDConfig
    params: list[torch.nn.Parameter]
    layout: Shard
    island: dist.ProcessGroup | None
    steps: int
    syncs: int
    anchor: torch.Tensor | None
    momentum: torch.Tensor | None
    _in_flight: InFlight | None
    _steps_off_anchor: int

    # The loop's own, which a restore needs.
    @property
    def local(self) -> bool:
        """Whether the warm-up is over (the loop's)."""
        raise NotImplementedError

    def _arrive(self, in_flight: InFlight) -> torch.Tensor:
        raise NotImplementedError

    def _allocate(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The counters, the whole anchor and outer momentum (the same on every replica), plus the config.

        A sync still travelling is waited for and its mean change saved, to be applied after a resume. With an
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
        ``anchor``, ``momentum`` and (a sync still travelling) ``mean`` over its :attr:`layout`'s ``bounds``.
        """
        values: dict[str, torch.Tensor] = {}
        in_flight, travelling = None, self._in_flight
        if travelling is not None:  # with int8, the reduced chunks: saved as their mean, in fp32
            if travelling.work is not None:
                travelling.work.wait()
                travelling.work = None
            arrived = travelling.wire.dtype == torch.int8 or travelling.ahead
            mean = self._arrive(travelling) if arrived else travelling.wire
            values["mean"] = mean[: self.layout.bounds[1] - self.layout.bounds[0]]
            in_flight = {"mean": None, "apply_at": travelling.apply_at, "wire_bytes": travelling.wire_bytes}
        if self.anchor is not None:
            values["anchor"] = self.anchor
        if self.momentum is not None:
            values["momentum"] = self.momentum
        state = {
            "config": asdict(self.config),
            "steps": self.steps,
            "syncs": self.syncs,
            "anchor": None,
            "momentum": None,
            "in_flight": in_flight,
            "sharded": sorted(values),
            "slices": self.layout.slices(),
        }
        return state, values

    def _whole(self, shard: torch.Tensor) -> torch.Tensor:
        """A copy of the whole model's values of ``shard`` on the CPU (in an island: gathered from its ranks).

        The island's gather reuses the buffers a travelling sync's next anchor was gathered into ahead: the apply
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
        reason = config_mismatch("local SGD", state, _saved_config(self.config))
        if reason is not None:
            return f"{reason}; the outer loop starts afresh from the weights"
        anchor, momentum = state["anchor"], state["momentum"]
        if anchor is not None and anchor.numel() != self.layout.numel:
            numel = self.layout.numel
            return f"the saved anchor has {anchor.numel()} values and the model {numel}; the outer loop starts afresh"
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
        window = self.config.sync_every
        since = (self.steps - self.config.warmup_steps) % window if self.local and self.anchor is not None else 0
        self._steps_off_anchor = since + (window if self._in_flight is not None else 0)
        return None


def _saved_config(config: LocalSGDConfig) -> dict[str, Any]:
    """The config fields a saved outer loop must match: the replica layout may change (the state is the model's)."""
    fields = asdict(config)
    fields.pop("replica")
    return fields
