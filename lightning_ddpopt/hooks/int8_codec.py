"""int8's wire format, shared by the int8 comm hook and local SGD's int8 syncs: quantise, pack, average, all-gather.

A row of ``block`` fp32 values is sent as ``block`` int8 values and one fp32 scale (``max |x| / 127``, rounded to
nearest); a packed row holds every block's payload, then every scale as 4 bytes. Every function gives the same
bytes through numba's loops (:mod:`lightning_ddpopt.hooks._kernels`, on the CPU where numba is installed) as
through torch's kernels, and sums the ranks' rows in rank order, so every rank computes the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks import _kernels

__all__ = [
    "SMALLEST_PEAK",
    "all_gather_async",
    "average_packed",
    "dequantize_blocks",
    "packed_size",
    "quantize_blocks",
    "quantize_into",
    "quantize_packed",
    "reduce_and_requantize",
    "unpack",
]

SMALLEST_PEAK = 127 / torch.finfo(torch.float32).max  # below it, 127 / peak overflows to inf


def reduce_and_requantize(received: torch.Tensor, chunk: int, block: int, loops: bool) -> torch.Tensor:
    """Sum the ranks' contributions to this rank's chunk in fp32, in rank order, and quantise the sum.

    ``received``: one packed row per rank; returns one packed row (1 x bytes). Through numba's loop or torch.
    """
    per_rank = (received.shape[1] - chunk) // 4
    own = torch.empty(1, received.shape[1], dtype=torch.int8, device=received.device)
    contributions, scales = unpack(received, chunk)
    if loops:
        own_scales = torch.empty(per_rank, dtype=torch.float32)
        _kernels.reduce_and_requantize(received, scales, own[0], own_scales, block)
        own[0, chunk:].copy_(own_scales.view(torch.int8))
        return own
    parts = dequantize_blocks(contributions.reshape(-1, block), scales.reshape(-1)).view(-1, per_rank, block)
    reduced = parts[0].clone()
    for part in parts[1:]:  # in rank order, as the loop: torch's sum(dim=0) reorders from 18 ranks on
        reduced.add_(part)
    quantize_into(reduced, own, chunk)
    return own


def packed_size(numel: int, block: int) -> int:
    """Bytes of :func:`quantize_packed`'s row for ``numel`` values in blocks of ``block``: payloads and scales."""
    return numel + 4 * (numel // block)


def quantize_packed(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks`` (fp32 rows of one block each) as one packed row: the int8 payloads, then the fp32 scales as bytes.

    Through numba's loop where numba is installed, else torch's kernels: the same bytes. ``out``: a (1, packed size)
    int8 row to write into (see :func:`packed_size`), else a new one.
    """
    rows, block = blocks.shape
    size = packed_size(blocks.numel(), block)
    if out is not None and (out.shape != (1, size) or out.dtype != torch.int8 or not out.is_contiguous()):
        raise ValueError(f"quantize_packed: out must be a contiguous (1, {size}) int8 row, got {tuple(out.shape)}")
    packed = torch.empty(1, size, dtype=torch.int8, device=blocks.device) if out is None else out
    if _loops_fit(blocks):
        scales = torch.empty(1, rows, dtype=torch.float32)
        _kernels.quantize_parameter(blocks, None, 1, 0, None, packed, scales, block)
        packed[:, blocks.numel() :].copy_(scales.view(torch.int8))
    else:
        quantize_into(blocks, packed, blocks.numel())
    return packed


def average_packed(gathered: torch.Tensor, out: torch.Tensor) -> None:
    """The mean of the ranks' packed rows (:func:`quantize_packed`'s) into ``out`` (fp32 rows of one block each).

    Dequantised and summed in fp32 in rank order, then divided by the number of rows: the same bits on every rank,
    through numba's loop or torch's kernels.
    """
    rows, block = out.shape
    payloads, scales = unpack(gathered, out.numel())
    if _loops_fit(out):
        _kernels.average_blocks(gathered, scales, out, block)
        return
    out.copy_(payloads[0].view(rows, block)).mul_(scales[0].unsqueeze(-1))
    for payload, scale in zip(payloads[1:], scales[1:], strict=True):
        out.add_(dequantize_blocks(payload.view(rows, block), scale))
    out.div_(gathered.shape[0])


def _loops_fit(blocks: torch.Tensor) -> bool:
    return _kernels.available() and _kernels.fits(blocks)


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``blocks`` as int8 with its scale ``max |row| / 127``; a non-finite row gets a non-finite scale."""
    packed = torch.empty(1, blocks.numel() + 4 * blocks.shape[0], dtype=torch.int8, device=blocks.device)
    quantize_into(blocks, packed, blocks.numel())
    payload, scales = unpack(packed, blocks.numel())
    return payload.view(blocks.shape), scales.view(-1)


def quantize_into(rows: torch.Tensor, packed: torch.Tensor, chunk: int) -> torch.Tensor:
    """Quantise ``rows`` (blocks) into ``packed``: per rank ``chunk`` payload bytes, then the fp32 scales as bytes.

    Returns the dequantised blocks (for the error), computed in the buffer that held the rounded values.
    """
    # max |x| without materialising |x|: two reductions cost a tenth of abs() plus one (measured on a 12 MB bucket:
    # 0.33 against 2.3 ms on one thread). NaN and inf propagate as with abs().amax().
    peak = torch.maximum(rows.amax(dim=-1), rows.amin(dim=-1).neg_()).add_(0.0)  # + 0: a -0.0 peak becomes 0.0
    scales = peak / 127
    # An all-zero block quantises to zeros, and so does a block too small for 127 / peak to be finite (its values
    # stay in the error feedback). A block with an inf or NaN keeps it in its scale, which makes the block
    # non-finite wherever it is dequantised; its payload bytes are then meaningless (and the same on every rank).
    inverse = torch.where(peak > SMALLEST_PEAK, 127 / peak, torch.zeros_like(peak))
    rounded = torch.mul(rows, inverse.unsqueeze(-1)).round_()
    ranks = packed.shape[0]
    block = rows.shape[-1]
    # Exact: the values are integers in [-127, 127].
    packed[:, :chunk].view(ranks, -1, block).copy_(rounded.view(ranks, -1, block))
    packed[:, chunk:].copy_(scales.view(ranks, -1).view(torch.int8))
    return rounded.mul_(scales.unsqueeze(-1))


def dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each int8 row of ``payload`` times its scale, in fp32."""
    return payload.to(torch.float32).mul_(scales.unsqueeze(-1))


def unpack(packed: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``packed``'s rows split into their payload and their fp32 scales."""
    return packed[:, :chunk], packed[:, chunk:].contiguous().view(torch.float32)


def all_gather_async(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    """Every rank's ``tensor`` into ``output`` (end to end, in rank order), issued asynchronously."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the first is torch >= 2.13's
    work = gather(output, tensor, group=group, async_op=True)
    assert work is not None
    return work
