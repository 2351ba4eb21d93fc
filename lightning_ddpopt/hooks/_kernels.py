"""Fused CPU loops for the lossy hooks' passes over the gradients (PowerSGD, int8), compiled by numba if installed.

On one CPU thread BLAS runs PowerSGD's thin products well below memory speed, and error feedback adds passes of its
own over the gradients: adding the stored error, then ``M Q``; ``M^T P``; the new error ``M - P local_Q^T`` and
``P Q^T``. ``benchmarks/cpu_kernels.py`` times these loops against torch's kernels (the docs' performance page has
its results).

Each loop takes a row of ``M`` (four rows for ``M^T P``) once, while it is in the L1 cache, and does all of its pass's
arithmetic on it. They are used for row-major fp32 CPU matrices when every rank has numba (the strategy agrees it
across ranks: the decompressed gradient must be the same bits everywhere), whatever torch's thread count: a loop runs
on the thread that calls it, and each row's arithmetic, so its bits, does not depend on how many threads there are.
Without numba torch's kernels run. Their sums run in another order than BLAS's, so results agree with torch's to
fp32 rounding.

Install numba with the ``cpu-kernels`` extra: ``pip install 'lightning-ddpopt[cpu-kernels]'``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy
import torch

__all__ = [
    "add_and_project",
    "available",
    "decompress",
    "dequantize_parameter",
    "error_and_decompress",
    "fits",
    "orthogonalize",
    "quantize_parameter",
    "reduce_and_requantize",
    "transposed_product",
]


@functools.cache
def available() -> bool:
    """Whether numba can be imported (once per process)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the loops can take these tensors: fp32, on the CPU, 2-D and row-major (written in place)."""
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous() for t in tensors
    )


def add_and_project(
    m: torch.Tensor, q: torch.Tensor, feedback: tuple[torch.Tensor, torch.Tensor | None] | None
) -> torch.Tensor:
    """``M += ratio x error`` (``feedback``: the error and its ratio, ``None`` for none), then ``M Q`` (rows x r)."""
    assert fits(m)
    out = torch.empty(m.shape[0], q.shape[1], dtype=torch.float32)
    error, ratio = feedback if feedback is not None else (m, None)
    factor = numpy.float32(1.0 if ratio is None else float(ratio))
    _compiled()[0](m.numpy(), _input(q.t()), out.numpy(), _input(error), factor, feedback is not None)
    return out


def transposed_product(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``M^T P`` (cols x r), as a transposed view of a row-major (r x cols) result (as ``(P^T M)^T`` gives it)."""
    out = torch.empty(p.shape[1], m.shape[1], dtype=torch.float32)
    _compiled()[1](_input(m), _input(p), out.numpy())
    return out.t()


def error_and_decompress(
    m: torch.Tensor, p: torch.Tensor, local_q: torch.Tensor, q: torch.Tensor, error: torch.Tensor
) -> None:
    """``error = M - P local_Q^T``, then ``M = P Q^T``, one row of ``M`` at a time (``M``, ``error``: see fits)."""
    assert fits(m, error)
    _compiled()[2](m.numpy(), _input(p), _input(q.t()), _input(local_q.t()), error.numpy(), True)


def decompress(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``M = P Q^T``, the same bits as :func:`error_and_decompress`'s (another rank's copy of a matrix it owns)."""
    assert fits(m)
    qt = _input(q.t())
    _compiled()[2](m.numpy(), _input(p), qt, qt, m.numpy(), False)


def orthogonalize(p: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of ``p`` (rows x r, see fits), in place, with ``epsilon`` added to each norm.

    Each dot product sums in row order in float64 on the calling thread: the same bits on every rank whatever its
    torch thread count (torch's norms and QR split their sums by thread). With ``epsilon`` 0 the columns are
    orthonormal to rounding, as QR's are up to their signs (which PowerSGD's ``P Q^T`` does not see); a zero column
    stays zero.
    """
    assert fits(p)
    _compiled()[3](p.numpy(), numpy.float64(epsilon))


def _input(tensor: torch.Tensor) -> Any:
    """A row-major numpy array of ``tensor`` (its memory, or a row-major copy when it is not laid out so)."""
    return tensor.detach().contiguous().numpy()


@functools.cache
def _compiled() -> tuple[Callable[..., None], ...]:
    """The loops compiled on first use (about a second; cached on disk for later processes), releasing the GIL.

    Only the projection's dot products may be reassociated (so that they vectorise); it makes a rank-local P that
    is all-reduced next. The decompression keeps IEEE order: its result must be the same bits on every rank.
    """
    return (
        _compile(_add_and_project_loop, fastmath={"reassoc"}),
        _compile(_transposed_product_loop),
        _compile(_decompress_loop),
        _compile(_orthogonalize_loop),
    )


def _compile(loop: Callable[..., None], **options: Any) -> Callable[..., None]:
    """``loop`` compiled by numba, releasing the GIL, cached on disk where a cache directory can be written."""
    import numba

    try:
        return numba.njit(nogil=True, cache=True, **options)(loop)
    except RuntimeError:  # no writable cache directory: compile in every process instead
        return numba.njit(nogil=True, **options)(loop)


def _add_and_project_loop(m: Any, qt: Any, out: Any, error: Any, ratio: float, add: bool) -> None:
    """Per row i of M: ``M[i] += ratio x error[i]`` if ``add``, then ``out[i] = M[i] Q``."""
    rank = qt.shape[0]
    for i in range(m.shape[0]):
        row = m[i]
        if add:
            err = error[i]
            for j in range(row.shape[0]):
                row[j] += err[j] * ratio
        for k in range(rank):
            basis = qt[k]
            acc = row[0] * basis[0]
            for j in range(1, row.shape[0]):
                acc += row[j] * basis[j]
            out[i, k] = acc


def _transposed_product_loop(m: Any, p: Any, out: Any) -> None:
    """``out`` (r x cols) = P^T M: each row of M read once and added into the r rows of ``out``.

    Four rows at a time: a quarter of the loads and stores of ``out``.
    """
    rank = p.shape[1]
    rows, cols = m.shape
    out[:, :] = 0.0
    i = 0
    while i + 4 <= rows:
        r0, r1, r2, r3 = m[i], m[i + 1], m[i + 2], m[i + 3]
        for k in range(rank):
            a, b, c, d = p[i, k], p[i + 1, k], p[i + 2, k], p[i + 3, k]
            acc = out[k]
            for j in range(cols):
                acc[j] += r0[j] * a + r1[j] * b + r2[j] * c + r3[j] * d
        i += 4
    while i < rows:
        row = m[i]
        for k in range(rank):
            pk, acc = p[i, k], out[k]
            for j in range(cols):
                acc[j] += row[j] * pk
        i += 1


def _decompress_loop(m: Any, p: Any, qt: Any, local_qt: Any, error: Any, keep_error: bool) -> None:
    """Per row i of M: ``error[i] = M[i] - P[i] local_Q^T`` if ``keep_error``, then ``M[i] = P[i] Q^T``."""
    rank = p.shape[1]
    for i in range(m.shape[0]):
        row = m[i]
        if keep_error:
            err = error[i]
            for j in range(row.shape[0]):
                err[j] = row[j]
            for k in range(rank):
                pk, basis = p[i, k], local_qt[k]
                for j in range(row.shape[0]):
                    err[j] -= pk * basis[j]
        pk, basis = p[i, 0], qt[0]
        for j in range(row.shape[0]):
            row[j] = pk * basis[j]
        for k in range(1, rank):
            pk, basis = p[i, k], qt[k]
            for j in range(row.shape[0]):
                row[j] += pk * basis[j]


def _orthogonalize_loop(p: Any, epsilon: float) -> None:
    """Gram-Schmidt on the columns of P, each column's projections removed twice, sums in float64 in row order.

    The second pass keeps the columns orthogonal to rounding when P has lower rank than its columns (a gradient of
    lower rank than PowerSGD's), as a QR decomposition does; one pass leaves errors of about 1e-3 there.
    """
    rows, rank = p.shape
    for i in range(rank):
        for _ in range(2):
            for j in range(i):
                dot = 0.0
                for row in range(rows):
                    dot += numpy.float64(p[row, j]) * numpy.float64(p[row, i])
                for row in range(rows):
                    p[row, i] = numpy.float64(p[row, i]) - dot * numpy.float64(p[row, j])
        total = 0.0
        for row in range(rows):
            value = numpy.float64(p[row, i])
            total += value * value
        norm = numpy.sqrt(total) + epsilon
        scale = 1.0 / norm if norm > 0.0 else 0.0
        for row in range(rows):
            p[row, i] = numpy.float64(p[row, i]) * scale


# The int8 hook's loops (the block layout is :mod:`lightning_ddpopt.hooks.int8`'s: block ``g`` of a bucket is block
# ``g % blocks_per_rank`` of rank ``g // blocks_per_rank``'s chunk). They do its torch path's arithmetic in the same
# order, so they send the same bytes for every finite block, in one pass over the gradients instead of about ten.

_SMALLEST_PEAK = numpy.float32(127.0 / float(numpy.finfo(numpy.float32).max))  # below it, 127 / peak overflows


def quantize_parameter(
    gradient: torch.Tensor,
    feedback: tuple[torch.Tensor, torch.Tensor | None] | None,
    world_size: int,
    first_block: int,
    errors: torch.Tensor | None,
    packed: torch.Tensor,
    scales: torch.Tensor,
    block: int,
) -> None:
    """Quantise one parameter's ``(gradient + ratio x error) / world_size`` into its int8 blocks.

    ``feedback``: the stored error and its ratio (``None``: none). The parameter's blocks start at bucket block
    ``first_block``; ``packed`` (ranks x bytes, row-major int8: each rank's blocks' payloads first) and ``scales``
    (ranks x blocks per rank, fp32) are the bucket's. ``errors`` (the parameter's blocks, padding included), if
    given, receives ``world_size x`` (value - dequantised value).
    """
    flat = gradient.reshape(-1)
    error, ratio = feedback if feedback is not None else (flat, None)
    _compiled_int8()[0](
        _input(flat),
        _input(error.reshape(-1)),
        numpy.float32(1.0 if ratio is None else float(ratio)),
        feedback is not None,
        numpy.float32(world_size),
        first_block,
        errors.numpy() if errors is not None else numpy.empty(0, dtype=numpy.float32),
        errors is not None,
        packed.numpy(),
        scales.numpy(),
        block,
    )


def reduce_and_requantize(
    packed: torch.Tensor, scales: torch.Tensor, own_packed: torch.Tensor, own_scales: torch.Tensor, block: int
) -> None:
    """Sum the ranks' dequantised blocks in fp32, in rank order, and quantise the sum.

    ``packed``: ranks x bytes (row-major int8, the blocks' payloads first), ``scales``: ranks x blocks; the sum's
    payloads go to the start of ``own_packed`` (row-major int8) and its scales to ``own_scales`` (blocks).
    """
    _compiled_int8()[1](packed.numpy(), scales.numpy(), own_packed.numpy(), own_scales.numpy(), block)


def dequantize_parameter(
    packed: torch.Tensor, scales: torch.Tensor, first_block: int, gradient: torch.Tensor, block: int
) -> None:
    """Write one parameter's blocks of the gathered mean into ``gradient`` (a row-major view into the bucket).

    ``packed``: ranks x bytes (row-major int8, the blocks' payloads first), ``scales``: ranks x blocks per rank.
    """
    assert gradient.is_contiguous() and packed.is_contiguous()
    _compiled_int8()[2](packed.numpy(), scales.numpy(), first_block, gradient.view(-1).numpy(), block)


def average_blocks(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """The mean of the ranks' dequantised blocks, summed in fp32 in rank order, then divided by the ranks.

    ``packed``: ranks x bytes (row-major int8, the blocks' payloads first), ``scales``: ranks x blocks, ``out``: the
    blocks' values (row-major fp32).
    """
    assert out.is_contiguous() and packed.is_contiguous()
    _compiled_int8()[3](packed.numpy(), scales.numpy(), out.view(-1).numpy(), block)


@functools.cache
def _compiled_int8() -> tuple[Callable[..., None], ...]:
    """The int8 loops, compiled on first use; the block quantisation they share first."""
    global _quantize_block, _sum_ranks
    _quantize_block = _compile(_quantize_block_loop)
    _sum_ranks = _compile(_sum_ranks_loop)
    return (
        _compile(_quantize_parameter_loop),
        _compile(_reduce_and_requantize_loop),
        _compile(_dequantize_loop),
        _compile(_average_loop),
    )


def _quantize_block_loop(
    values: Any, payload: Any, errors: Any, world_size: Any, keep_errors: bool, scratch: Any
) -> Any:
    """Quantise one block of fp32 ``values`` into int8 ``payload``; return its scale.

    The scale is ``max |x| / 127``, non-finite when a value is (NaN for a NaN); a block whose peak is too small for
    ``127 / peak`` to be finite quantises to zeros, as in the torch path. ``keep_errors``: ``errors`` receives
    ``world_size x`` (value - dequantised value). ``scratch``: one uint32, to read the peak's bits as a float.
    """
    # max |x| as the largest bit pattern with the sign cleared: an integer maximum, which vectorises, and NaN's
    # patterns lie above inf's, so a NaN anywhere makes the peak NaN (as torch's amax does).
    bits = values.view(numpy.uint32)
    peak_bits = numpy.uint32(0)
    for j in range(bits.shape[0]):
        peak_bits = max(peak_bits, numpy.uint32(bits[j] & numpy.uint32(0x7FFFFFFF)))
    scratch[0] = peak_bits
    peak = scratch.view(numpy.float32)[0]
    scale = peak / numpy.float32(127.0)
    inverse = numpy.float32(127.0) / peak if peak > _SMALLEST_PEAK else numpy.float32(0.0)
    for j in range(values.shape[0]):
        rounded = numpy.rint(values[j] * inverse)
        payload[j] = numpy.int8(rounded) if rounded == rounded else numpy.int8(0)  # a NaN block's bytes: any
        if keep_errors:
            errors[j] = (values[j] - rounded * scale) * world_size
    return scale


_quantize_block: Callable[..., Any] = _quantize_block_loop  # the compiled one once _compiled_int8 has run

# In the loops below every inner loop runs over slices of row-major 1-D arrays, indexed by the loop variable alone:
# numba vectorises those (an index such as ``start + j`` of unknown sign gets a wraparound check that stops it).


def _quantize_parameter_loop(
    gradient: Any,
    error: Any,
    ratio: Any,
    add_error: bool,
    world_size: Any,
    first_block: int,
    errors: Any,
    keep_errors: bool,
    packed: Any,
    scales: Any,
    block: int,
) -> None:
    per_rank = scales.shape[1]
    values, scratch = numpy.empty(block, dtype=numpy.float32), numpy.empty(1, dtype=numpy.uint32)
    size = gradient.shape[0]
    for b in range((size + block - 1) // block):
        start = b * block
        count = min(block, size - start)
        source = gradient[start : start + count]
        if add_error:
            stored = error[start : start + count]
            for j in range(count):
                values[j] = (source[j] + stored[j] * ratio) / world_size
        else:
            for j in range(count):
                values[j] = source[j] / world_size
        values[count:] = numpy.float32(0.0)  # the padding of the parameter's last block
        rank, index = divmod(first_block + b, per_rank)
        payload = packed[rank][index * block : (index + 1) * block]
        kept = errors[start : start + block] if keep_errors else values
        scales[rank, index] = _quantize_block(values, payload, kept, world_size, keep_errors, scratch)


def _sum_ranks_loop(packed: Any, scales: Any, b: int, block: int, values: Any) -> None:
    """Block ``b`` of every rank's row, dequantised and summed in fp32 in rank order, into ``values``."""
    source, scale = packed[0][b * block : (b + 1) * block], scales[0, b]
    for j in range(block):
        values[j] = numpy.float32(source[j]) * scale
    for r in range(1, scales.shape[0]):
        source, scale = packed[r][b * block : (b + 1) * block], scales[r, b]
        for j in range(block):
            values[j] += numpy.float32(source[j]) * scale


_sum_ranks: Callable[..., Any] = _sum_ranks_loop  # the compiled one once _compiled_int8 has run


def _reduce_and_requantize_loop(packed: Any, scales: Any, own_packed: Any, own_scales: Any, block: int) -> None:
    values, scratch = numpy.empty(block, dtype=numpy.float32), numpy.empty(1, dtype=numpy.uint32)
    for b in range(scales.shape[1]):
        _sum_ranks(packed, scales, b, block, values)
        payload = own_packed[b * block : (b + 1) * block]
        own_scales[b] = _quantize_block(values, payload, values, numpy.float32(1.0), False, scratch)


def _dequantize_loop(packed: Any, scales: Any, first_block: int, gradient: Any, block: int) -> None:
    per_rank = scales.shape[1]
    size = gradient.shape[0]
    for b in range((size + block - 1) // block):
        rank, index = divmod(first_block + b, per_rank)
        start = b * block
        count = min(block, size - start)
        source, scale = packed[rank][index * block : index * block + count], scales[rank, index]
        target = gradient[start : start + count]
        for j in range(count):
            target[j] = numpy.float32(source[j]) * scale


def _average_loop(packed: Any, scales: Any, out: Any, block: int) -> None:
    divisor = numpy.float32(scales.shape[0])
    for b in range(scales.shape[1]):
        target = out[b * block : (b + 1) * block]
        _sum_ranks(packed, scales, b, block, target)
        for j in range(block):
            target[j] = target[j] / divisor
