"""Fused CPU loops for PowerSGD's passes over the gradient matrices, compiled by numba where it is installed.

On one CPU thread BLAS runs PowerSGD's thin products well below memory speed, and error feedback adds passes of its
own. Measured for 6 x 2048 x 2048 fp32 matrices at rank 4 (MKL; a copy of them takes 8.5 ms):

==============================================  =============  ================
pass                                            torch          these loops
==============================================  =============  ================
add the stored error, then ``M Q``              21.5 ms        15.2 ms
``M^T P``                                       13.7 ms        8.3 ms
the new error ``M - P local_Q^T``, ``P Q^T``    28-40 ms       18-21 ms
==============================================  =============  ================

Each loop takes a row of ``M`` (four rows for ``M^T P``) once, while it is in the L1 cache, and does all of its pass's
arithmetic on it. They are used for row-major fp32 CPU matrices when every rank runs one torch thread and has numba
(the strategy agrees it across ranks: the decompressed gradient must be the same bits everywhere); otherwise torch's
kernels run. Their sums run in another order than BLAS's, so results agree with torch's to fp32 rounding.

Install numba with the ``cpu-kernels`` extra: ``pip install 'lightning-ddpopt[cpu-kernels]'``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["add_and_project", "available", "error_and_decompress", "fits", "transposed_product"]


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
    import numpy

    assert fits(m)
    out = torch.empty(m.shape[0], q.shape[1], dtype=torch.float32)
    if feedback is None:
        _compiled()[0](m.numpy(), _input(q.t()), out.numpy(), m.numpy(), numpy.float32(0.0), False)
        return out
    error, ratio = feedback
    factor = numpy.float32(1.0 if ratio is None else float(ratio))
    _compiled()[0](m.numpy(), _input(q.t()), out.numpy(), _input(error), factor, True)
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
    _compiled()[2](m.numpy(), _input(p), _input(local_q.t()), _input(q.t()), error.numpy())


def _input(tensor: torch.Tensor) -> Any:
    """A row-major numpy array of ``tensor`` (its memory, or a row-major copy when it is not laid out so)."""
    return tensor.detach().contiguous().numpy()


@functools.cache
def _compiled() -> tuple[Callable[..., None], ...]:
    """The loops compiled on first use (about a second; cached on disk for later processes), releasing the GIL.

    Only the projection's dot products may be reassociated (so that they vectorise); it makes a rank-local P that
    is all-reduced next. The decompression keeps IEEE order: its result must be the same bits on every rank.
    """
    import numba

    def compile(loop: Callable[..., None], **options: Any) -> Callable[..., None]:
        try:
            return numba.njit(nogil=True, cache=True, **options)(loop)
        except RuntimeError:  # no writable cache directory: compile in every process instead
            return numba.njit(nogil=True, **options)(loop)

    return (
        compile(_add_and_project_loop, fastmath={"reassoc"}),
        compile(_transposed_product_loop),
        compile(_error_and_decompress_loop),
    )


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

    Four rows at a time: a quarter of the loads and stores of ``out`` (8.3 against 10.1 ms for 6 x 2048 x 2048 at
    rank 4).
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


def _error_and_decompress_loop(m: Any, p: Any, local_qt: Any, qt: Any, error: Any) -> None:
    """Per row i of M: ``error[i] = M[i] - P[i] local_Q^T``, then ``M[i] = P[i] Q^T``."""
    rank = p.shape[1]
    for i in range(m.shape[0]):
        row, err = m[i], error[i]
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
