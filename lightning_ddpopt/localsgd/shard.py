"""This rank's shard of the flattened parameters for local SGD's outer state, and the island's gather of the shards.

Used by :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.int8_codec import all_gather_async
from lightning_ddpopt.localsgd.host_memory import map_shared

__all__ = ["Shard"]


class Shard:
    """Island rank ``i`` of ``M``'s part of the parameters, flattened in parameter order: ``[i x size, (i+1) x size)``.

    ``size`` is the parameters' count over ``M``, rounded up to a whole ``unit`` (int8: whole blocks, a chunk per
    replica); the last shard is shorter. Without an island (``M`` = 1) the shard is the whole model. Buffers: the
    shard's stage (O(P / M)) and the whole model gathered from the island (O(P)), kept between syncs on a CPU (a GPU
    allocates the gathered model for each sync only: its memory is the activations'). On a CPU whose island shares
    the host's memory, both are views of one buffer the island's ranks share
    (:mod:`~lightning_ddpopt.localsgd.host_memory`): each rank's stage is its slice, and a gather is a barrier.

    Whoever reads a gather's result calls :meth:`release` once done with it, before the next gather on any rank.

    Args:
        params: the trained parameters, in order.
        island: the island's group (``None``: no island).
        island_size: ``M``.
        island_rank: ``i``.
        unit: what ``size`` is a multiple of.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        island: dist.ProcessGroup | None,
        island_size: int,
        island_rank: int,
        unit: int,
    ) -> None:
        self.params, self.island, self.island_size = params, island, island_size
        #: Values of the parameters, end to end.
        self.numel = sum(p.numel() for p in params)
        #: Values of every island rank's shard, zero-padded.
        self.size = -(-self.numel // (island_size * unit)) * unit
        start = min(self.numel, island_rank * self.size)
        #: This rank's part of the flattened parameters, ``[start, stop)``.
        self.bounds = (start, min(self.numel, start + self.size))
        self._pieces = _pieces(params, *self.bounds)
        self._place = island_rank
        self._stage: torch.Tensor | None = None
        self._full: torch.Tensor | None = None
        #: Whether the island's gather goes through the host's shared memory (decided when the buffers are made).
        self.shared = False
        self._tried_sharing = False
        #: Why it does not, where it was tried (for the setup log line).
        self.unshared_reason = ""

    def slices(self) -> list[list[int]]:
        """Every island rank's ``[start, stop)``, in island-rank order."""
        return [
            [min(self.numel, place * self.size), min(self.numel, (place + 1) * self.size)]
            for place in range(self.island_size)
        ]

    def values(self) -> torch.Tensor:
        """The shard's parameter values, end to end, in fp32 (a new tensor)."""
        start, stop = self.bounds
        values = torch.empty(stop - start, device=self.params[0].device)
        for p, p_start, p_stop, offset in self._pieces:
            values[offset : offset + p_stop - p_start].copy_(p.detach().reshape(-1)[p_start:p_stop])
        return values

    def change(self, anchor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``anchor - parameters`` over the shard into ``out``, straight from the parameters (one pass)."""
        for p, p_start, p_stop, offset in self._pieces:
            end = offset + p_stop - p_start
            torch.sub(anchor[offset:end], p.detach().reshape(-1)[p_start:p_stop], out=out[offset:end])
        return out

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every island rank's ``shard`` end to end (the whole model's values, fp32); a collective on the island.

        Without an island: ``shard`` itself.
        """
        if self.island is None:
            return shard
        stage, full = self.buffers(shard.device)
        if shard.data_ptr() != stage.data_ptr():
            stage[: shard.numel()].copy_(shard)
        if self.shared:
            dist.barrier(group=self.island)  # every rank's slice written
        else:
            all_gather_async(full, stage, self.island).wait()
        return full[: self.numel]

    def gathered_copy(self, shard: torch.Tensor) -> torch.Tensor:
        """A copy of :meth:`gather`'s result (released: the next gather may follow at once)."""
        whole = self.gather(shard).clone()
        self.release()
        return whole

    def release(self) -> None:
        """Done reading the last gather: with a shared buffer, a barrier before any rank writes its slice again."""
        if self.shared:
            dist.barrier(group=self.island)

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage a shard is sent in (fp32, padded) and the whole model it is gathered into (see the class doc).

        Their first call on a CPU is a collective on the island (the shared buffer is mapped by all its ranks).
        """
        if not self._tried_sharing and device.type == "cpu" and self.island is not None:
            self._tried_sharing = True
            full, self.unshared_reason = map_shared(self.island, self._place, self.size, self.island_size)
            if full is not None:
                self.shared, self._full = True, full
                self._stage = full[self._place * self.size : (self._place + 1) * self.size]
        assert not self.shared or device.type == "cpu", "the shared buffer is the island's on the CPU"
        if self._stage is None or self._stage.device != device:
            self._stage = torch.zeros(self.size, device=device)
        full = self._full
        if full is None or full.device != device:
            keep = device.type == "cpu"
            full = (torch.zeros if keep else torch.empty)(self.island_size * self.size, device=device)
            self._full = full if keep else None
        return self._stage, full

    def load(self, flat: torch.Tensor, weight: float = 1.0) -> None:
        """Copy ``flat`` (the whole model) into the parameters, or move them ``weight`` of the way to it (``lerp``)."""
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


def _pieces(params: Sequence[torch.Tensor], start: int, stop: int) -> list[tuple[torch.Tensor, int, int, int]]:
    """The parameters' parts in ``[start, stop)`` of their flattening: ``(param, from, to, offset in the shard)``."""
    pieces, offset = [], 0
    for p in params:
        low, high = max(start, offset), min(stop, offset + p.numel())
        if low < high:
            pieces.append((p, low - offset, high - offset, low - start))
        offset += p.numel()
    return pieces
