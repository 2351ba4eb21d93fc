"""Local SGD's int8 mean over the replicas, in the reduce-scatter shape: chunks exchanged, reduced, gathered.

Used by :class:`~lightning_ddpopt.localsgd.outer.LocalSGD` with ``LocalSGDConfig(compression="int8")``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._kernels import available as loops_available
from lightning_ddpopt.hooks.int8_codec import all_gather_async, packed_size, quantize_packed, reduce_and_requantize
from lightning_ddpopt.localsgd.config import INT8_BLOCK

__all__ = ["Int8Mean"]


class Int8Mean:
    """The mean of a shard's change over the replicas, sent in int8 blocks.

    The change, divided by the replicas, is quantised in one chunk of whole blocks per replica; one all-to-all sends
    chunk i to replica i, which sums the replicas' chunks in fp32 in rank order and quantises the sum again; an
    all-gather gives every replica every reduced chunk, which every rank dequantises alike: the same mean everywhere.
    Memory per rank: three buffers of a byte per value of the shard, with their scales (O(P / island size)), at any
    number of replicas. When a sync overlaps (``overlap_steps``), :class:`~lightning_ddpopt.localsgd.outer.LocalSGD`
    runs the second stage (:meth:`finish`) beside the training thread.

    Args:
        group: the group over the replicas (one rank of each).
        replicas: its size.
    """

    def __init__(self, group: dist.ProcessGroup | None, replicas: int) -> None:
        self.group, self.replicas = group, replicas
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _buffers(self, work: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed rows sent, received and gathered, kept between syncs, for a work buffer like ``work``.

        This rank's chunks for each replica, theirs of this rank's chunk, and every replica's reduced chunk.
        """
        row = packed_size(work.numel() // self.replicas, INT8_BLOCK)
        if self._rows is None or self._rows[0].device != work.device or self._rows[0].shape[1] != row:
            self._rows = tuple(  # type: ignore[assignment]
                torch.zeros(self.replicas, row, dtype=torch.int8, device=work.device) for _ in range(3)
            )
        assert self._rows is not None
        return self._rows

    def prepare(self, work: torch.Tensor) -> None:
        """Allocate the buffers and run the loops once, when the local phase begins.

        With numba the loops compile at their first call (about half a second): here, not in the first sync.
        """
        send, received, _ = self._buffers(work)
        chunk = work.numel() // self.replicas
        quantize_packed(work.view(-1, INT8_BLOCK)[: chunk // INT8_BLOCK], out=send[:1])
        reduce_and_requantize(received, chunk, INT8_BLOCK, loops=self._loops(work))

    def start(self, work: torch.Tensor) -> tuple[dist.Work, torch.Tensor, int]:
        """Quantise ``work`` (the change, zero-padded to whole chunks) / replicas in chunks and start sending them.

        Returns the all-to-all, the gathered rows the result arrives in (the in-flight marker) and the bytes sent.
        """
        send, received, gathered = self._buffers(work)
        blocks = work.view(-1, INT8_BLOCK).div_(self.replicas)  # the padding stays zero
        rows = blocks.shape[0] // self.replicas
        for replica in range(self.replicas):
            quantize_packed(blocks[replica * rows : (replica + 1) * rows], out=send[replica : replica + 1])
        handle = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        assert handle is not None
        return handle, gathered, send.numel()

    def finish(self, handle: dist.Work, work: torch.Tensor, valid: int) -> None:
        """Sum the replicas' chunks of this rank's chunk, quantise the sum, gather all chunks, dequantise into ``work``.

        ``valid``: the values of ``work`` before its padding, which stays zero.
        """
        _, received, gathered = self._buffers(work)
        handle.wait()
        chunk = work.numel() // self.replicas
        own = reduce_and_requantize(received, chunk, INT8_BLOCK, loops=self._loops(work))
        all_gather_async(gathered.view(-1), own.view(-1), self.group).wait()
        payloads, scales = gathered[:, :chunk], gathered[:, chunk:].contiguous().view(torch.float32)
        rows = work.view(self.replicas, -1, INT8_BLOCK)
        rows.copy_(payloads.view(rows.shape)).mul_(scales.unsqueeze(-1))
        work[valid:].zero_()  # 0 x a non-finite scale is not 0

    def release(self) -> None:
        """Drop the buffers (the shard changed)."""
        self._rows = None

    @staticmethod
    def _loops(work: torch.Tensor) -> bool:
        return loops_available() and work.device.type == "cpu"
