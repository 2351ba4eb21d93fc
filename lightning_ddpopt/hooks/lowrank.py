"""PowerSGD's low-rank step for a list of matrices: P = M Q, all-reduce, orthogonalise, Q = M^T P, all-reduce.

Called by :mod:`lightning_ddpopt.hooks.powersgd` for each bucket's matrices (one after another, on the thread that
runs the bucket's chain). Adds the stored error feedback, keeps this rank's compression error and the new Q
memories in the sync round, and hands back NaN on every rank when a reduced factor is not finite. On the CPU with
numba the passes over M are fused loops (:mod:`lightning_ddpopt.hooks._kernels`) that give the same bits whatever
torch's thread count.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_ddpopt.deferred import to_device
from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks.base import squared_norm
from lightning_ddpopt.hooks.feedback import SyncRound, fed_back_sq
from lightning_ddpopt.hooks.orthogonal import orthogonalize, random_q
from lightning_ddpopt.hooks.powersgd_config import MATRIX_DTYPES
from lightning_ddpopt.hooks.powersgd_state import PowerSGDState

__all__ = ["decompress", "low_rank_allreduce", "strongest_columns"]
# Values of M per row block of the one-thread error-and-decompression pass: 32768 fp32 values, 128 KiB.
_CACHE_BLOCK_ELEMENTS = 32768


def low_rank_allreduce(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    matrices: list[torch.Tensor],
    keys: list[str],
    add_feedback: bool,
    fed_back: torch.Tensor | None = None,
    factors: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """Replace each matrix M with the rank-r approximation P Q^T of its mean over ranks.

    ``add_feedback``: M's stored error is added first (with numba, in the pass that computes M Q). Returns this
    rank's compression errors ``M - P P^T M`` (Vogels et al., Algorithm 2: the local matrix minus its projection
    with the local Q), empty when error feedback is off. New Q memories go to ``round_``; when a
    reduced P is not finite, the matrices come back as NaN on every rank. On a measured round
    (:attr:`~lightning_ddpopt.hooks.base.CommHookState.measuring`) the compression error goes to the ledger;
    ``fed_back``: the squared norm of error feedback the caller added to the matrices already. ``factors``: receives
    each matrix's reduced ``(P, Q)`` (P orthogonalised, NaN where the round's P was not finite), in order.
    """
    config = state.config
    wire_dtype = MATRIX_DTYPES[config.matrix_dtype]
    fused = state.kernels() == "numba" and _kernels.fits(*matrices)
    qs = []
    for matrix, key in zip(matrices, keys, strict=True):
        shape = (matrix.shape[1], min(*matrix.shape, state.rank_of(key)))
        q = state.q_memories.get(key) if config.warm_start else None
        if q is not None and q.shape[0] == shape[0] and q.shape[1] > shape[1]:
            q = strongest_columns(q, shape[1])  # the matrix's rank fell: start from what it kept
        if q is None or q.shape != shape:
            # Drawn on the CPU (the same bits on every rank, whatever its GPU) and copied without a host wait.
            q = to_device(random_q(config, state.iteration, key, shape, fused), matrix.device)
        elif q.device != matrix.device:  # restored on the CPU: copied without a host wait
            q = to_device(q, matrix.device)
        qs.append(q.to(matrix))

    # P = M Q averaged over ranks (the scale is irrelevant: P is orthogonalised next).
    # (Q^T M^T)^T rather than M Q, and (P^T M)^T rather than M^T P below: BLAS streams the large matrix about 3x
    # faster in these forms (measured: 10 ms against 31 ms for 6 x 2048 x 2048 at rank 4 on one CPU thread).
    feedback = [
        state.stored_error(round_, key, m) if add_feedback else None for m, key in zip(matrices, keys, strict=True)
    ]
    if fused:
        local_ps = [_kernels.add_and_project(m, q, f) for m, q, f in zip(matrices, qs, feedback, strict=True)]
    else:
        for m, found in zip(matrices, feedback, strict=True):
            if found is not None:
                error, ratio = found
                m.add_(error) if ratio is None else m.addcmul_(error, ratio)
        local_ps = [(q.t() @ m.t()).t() for m, q in zip(matrices, qs, strict=True)]
    # The matrices hold the error fed back now: what the compression is given.
    measuring_error = state.ranks.measuring
    # Each matrix's squared norm, summed in order: the same bits as squared_norm(*matrices).
    given_each = [squared_norm(m) for m in matrices] if state.measuring or measuring_error else None
    given_sq = sum(given_each, torch.zeros_like(given_each[0])) if given_each else None
    ps = _allreduce_matrices(state, bucket, local_ps, wire_dtype)
    finite = round_.check(ps)
    for p in ps:
        orthogonalize(p, config.orthogonalization_epsilon, fused)
        # A non-finite local M makes the reduced P non-finite on every rank: hand back NaN everywhere, so the
        # overflow is seen (and the step skipped) on every rank alike.
        p.masked_fill_(~finite, math.nan)
    # Q = M^T P averaged over ranks, so that M ~ P Q^T.
    fused = fused and _kernels.fits(*ps)
    local_qs = [
        _kernels.transposed_product(m, p) if fused else (p.t() @ m).t() for m, p in zip(matrices, ps, strict=True)
    ]
    qs = _allreduce_matrices(state, bucket, local_qs, wire_dtype)
    round_.check(qs)
    if factors is not None:
        factors.extend(zip(ps, qs, strict=True))
    errors = []
    for m, p, q, local_q, key in zip(matrices, ps, qs, local_qs, keys, strict=True):
        if config.error_feedback:
            errors.append(state.error_buffer(round_, key, tuple(m.shape), m.dtype, m.device))
            if fused and _kernels.fits(errors[-1]):
                _kernels.error_and_decompress(m, p, local_q, q, errors[-1])
            else:
                _error_and_decompress(m, p, local_q, q, errors[-1], blocked=state.kernels() != "blas")
        else:
            torch.matmul(p, q.t(), out=m)
    if given_sq is not None:
        assert given_each is not None
        # Without error feedback no error is formed: M - P P^T M is orthogonal to P P^T M, whose norm is local Q's.
        dropped_each = [squared_norm(e) for e in errors]  # summed in order: the bits of squared_norm(*errors)
        if errors:
            dropped_sq = sum(dropped_each, torch.zeros_like(given_sq))
        else:
            dropped_sq = (given_sq - squared_norm(*local_qs)).clamp_(min=0)
        if measuring_error:
            _measure_ranks(state, matrices, keys, qs, local_qs, dropped_each, given_each)
        if state.measuring:
            fed_back = fed_back if fed_back is not None else fed_back_sq(feedback)
            state.record_compression(bucket, given_sq, dropped_sq, fed_back)
    if config.warm_start:
        round_.q_memories.update(zip(keys, qs, strict=True))
    return errors


def strongest_columns(q: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` columns of ``q`` with the largest norms, in their order (the same on every rank: Q is reduced)."""
    return q[:, torch.sort(_strongest_first(q)[:keep]).values]


def _strongest_first(q: torch.Tensor) -> torch.Tensor:
    """``q``'s column indices by falling norm, ties in column order: the same on every rank (Q is reduced)."""
    return torch.sort(q.norm(dim=0), descending=True, stable=True).indices


def _measure_ranks(
    state: PowerSGDState,
    matrices: list[torch.Tensor],
    keys: list[str],
    qs: list[torch.Tensor],
    local_qs: list[torch.Tensor],
    dropped_each: list[torch.Tensor],
    given_each: list[torch.Tensor],
) -> None:
    """Each matrix's squared norms for its rank: given, dropped, and dropped were its rank halved.

    Halving keeps the columns of P whose reduced Q columns are strongest (as the next round's warm start would); what
    this rank's approximation loses with the others is its ``M^T P`` columns' energy (P is orthonormal).
    """
    for index, (m, key, q, local_q, given) in enumerate(zip(matrices, keys, qs, local_qs, given_each, strict=True)):
        dropped = dropped_each[index] if dropped_each else (given - squared_norm(local_q)).clamp_(min=0)
        keep = state.ranks.halved(key, m.shape[0], m.shape[1])
        weakest = _strongest_first(q)[keep:]
        lost = local_q.index_select(1, weakest).double().square().sum() if weakest.numel() else torch.zeros_like(given)
        state.ranks.add(key, given, dropped, dropped + lost)


def decompress(state: PowerSGDState, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``M = P Q^T`` as :func:`low_rank_allreduce` computes it with ``state``'s settings: the same bits.

    For a rank that holds the reduced factors of a matrix another rank compressed (two-tier PowerSGD's owners).

    Args:
        state: the hook's state (error feedback and CPU kernels decide how the owner decompressed).
        m: the matrix to write (rows x cols).
        p: its reduced, orthogonalised P (rows x r).
        q: its reduced Q (cols x r).
    """
    if not state.config.error_feedback:
        torch.matmul(p, q.t(), out=m)
    elif state.kernels() == "numba" and _kernels.fits(m, p):
        _kernels.decompress(m, p, q)
    elif m.is_cuda or state.kernels() == "blas":
        torch.matmul(p, q.t(), out=m)
    else:
        rows = max(1, _CACHE_BLOCK_ELEMENTS // max(1, m.shape[1]))
        for start in range(0, m.shape[0], rows):
            torch.mm(p[start : start + rows], q.t(), out=m[start : start + rows])


def _error_and_decompress(
    m: torch.Tensor, p: torch.Tensor, local_q: torch.Tensor, q: torch.Tensor, error: torch.Tensor, blocked: bool
) -> None:
    """``error = M - P local_Q^T`` (this rank's compression error), then ``M = P Q^T``, through torch.

    ``blocked`` (one CPU thread): both are done a block of rows at a time, small enough to stay in the cache between
    the two: M is read from memory once instead of twice. With more threads the whole-matrix kernels run instead:
    small blocks would cost an OpenMP fork and join each.
    """
    q_t, local_q_t = q.t(), local_q.t()
    if m.is_cuda or not blocked:
        error.copy_(m).addmm_(p, local_q_t, alpha=-1)
        torch.matmul(p, q_t, out=m)
        return
    rows = max(1, _CACHE_BLOCK_ELEMENTS // max(1, m.shape[1]))
    for start in range(0, m.shape[0], rows):
        m_rows, p_rows = m[start : start + rows], p[start : start + rows]
        error[start : start + rows].copy_(m_rows).addmm_(p_rows, local_q_t, alpha=-1)
        torch.mm(p_rows, q_t, out=m_rows)


def _allreduce_matrices(
    state: PowerSGDState,
    bucket: dist.GradBucket,
    matrices: list[torch.Tensor],
    wire_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Mean-all-reduce ``matrices`` as one flat copy in ``wire_dtype``; return the means, ``matrices`` intact.

    Divided by the world size before the cast, so that a half-precision sum cannot overflow where the mean would not.
    """
    flat = torch.cat([m.reshape(-1) for m in matrices]).div_(state.world_size).to(wire_dtype)
    state.record_wire_bytes(bucket, flat.numel() * flat.element_size())
    state.wait(dist.all_reduce(flat, group=state.process_group, async_op=True))
    flat = flat.to(matrices[0].dtype)
    out, offset = [], 0
    for m in matrices:
        out.append(flat[offset : offset + m.numel()].view_as(m))
        offset += m.numel()
    return out
