"""PowerSGD's settings: :class:`PowerSGDConfig`, the wire dtypes of its factors, its error bounds and CPU kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_ddpopt._validate import require_int
from lightning_ddpopt.hooks import _kernels

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "ERROR_BOUNDS",
    "MATRIX_DTYPES",
    "CPUKernels",
    "MatrixDtype",
    "PowerSGDConfig",
    "is_adaptive",
    "local_cpu_kernels",
]


#: Optimizers that scale each coordinate by its own history (Adam and its kin): a compression error costs them more.
#: Matched in a class name or any base's, case-insensitively (AdamW, FusedAdam, AdamW8bit, a subclass of Adam, ...).
ADAPTIVE_OPTIMIZERS = ("adam", "adagrad", "adadelta", "adafactor", "rmsprop", "lamb")
#: ``max_error="auto"``'s bound: with an adaptive optimizer, and with others. Chosen from the errors and held-out
#: losses of ``benchmarks/transformer_quality.py`` (the docs' comm hooks guide has them).
ERROR_BOUNDS = {"adaptive": 0.6, "other": 0.9}


MatrixDtype = Literal["fp32", "fp16", "bf16"]
#: How the CPU computes the passes over M: numba's fused loops or BLAS in row blocks (one thread), whole-matrix BLAS.
CPUKernels = Literal["numba", "blocked", "blas"]

#: The dtype each ``matrix_dtype`` sends P and Q in.
MATRIX_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class PowerSGDConfig:
    """How PowerSGD compresses.

    Args:
        rank: the rank of the low-rank approximation; an m x n gradient sends (m + n) x rank elements. With
            ``max_error`` it is where the rank starts.
        max_error: the bound on the relative compression error (the norm of what the compression dropped over the
            norm of what it was given, summed over the ranks): every ``RANK_WINDOW`` syncs the error is measured,
            and while it is above the bound the rank doubles, up to ``max_rank``. ``None`` keeps ``rank`` fixed.
            ``"auto"`` (the default): 0.6 when an optimizer is adaptive (Adam and its kin, :data:`ADAPTIVE_OPTIMIZERS`),
            else 0.9 (:data:`ERROR_BOUNDS`), as ``OptimizedDDPStrategy`` finds them at setup; a state used without
            the strategy takes 0.6 unless :meth:`PowerSGDState.fit_bound_to` is called. The bounds come from
            ``benchmarks/transformer_quality.py``; the docs' comm-hook guide gives its results.
        max_rank: the largest rank ``max_error`` may raise the rank to.
        start_iter: synchronised optimizer steps of plain allreduce before compression starts. It counts sync
            rounds, i.e. optimizer steps, not micro-batches (accumulation skips the syncs in between). With error
            feedback or warm start it must be at least 2: DDP rebuilds its buckets after the first step.
        min_compression_rate: compress a matrix only if ``m * n >= (m + n) * rank * min_compression_rate``;
            others are all-reduced uncompressed, together with biases and other 1-D tensors.
        error_feedback: keep each rank's compression error and add it to the next step's gradient.
        warm_start: start each step's power iteration from the last step's Q instead of a fresh random one.
        batched: treat each whole bucket as one square matrix (fewer, larger matmuls; usually less accurate).
        matrix_dtype: the dtype in which P and Q are sent: "fp32", or "fp16"/"bf16" for half the bytes.
        orthogonalization_epsilon: added to column norms when orthogonalising (with 0 and without numba, a QR
            decomposition; with numba, Gram-Schmidt with a second pass: the same bits on every rank whatever its
            thread count).
        seed: seeds the random projections, identically on every rank.
    """

    rank: int = 4
    max_error: float | Literal["auto"] | None = "auto"
    max_rank: int = 64
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    batched: bool = False
    matrix_dtype: MatrixDtype = "fp32"
    orthogonalization_epsilon: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("PowerSGDConfig rank", self.rank, 1)
        require_int("PowerSGDConfig max_rank", self.max_rank, 1)
        if self.max_error is not None and self.max_rank < self.rank:
            raise ValueError(
                f"PowerSGDConfig max_rank={self.max_rank} must be at least rank={self.rank} (max_error bounds the "
                "error by raising the rank from rank up to max_rank; max_error=None keeps rank fixed)"
            )
        if (
            self.max_error is not None
            and self.max_error != "auto"
            and (
                isinstance(self.max_error, bool)
                or not isinstance(self.max_error, int | float)
                or not 0 < self.max_error < 1
            )
        ):
            raise ValueError(
                f"PowerSGDConfig max_error={self.max_error!r} must be a number between 0 and 1 (exclusive), 'auto' "
                "(by the optimizer) or None for a fixed rank"
            )
        require_int("PowerSGDConfig start_iter", self.start_iter, 0)
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(
                f"PowerSGDConfig start_iter={self.start_iter} must be at least 2 with error_feedback or warm_start: "
                "DDP rebuilds its buckets after the first step, which would invalidate the per-bucket state"
            )
        if not isinstance(self.min_compression_rate, int | float) or self.min_compression_rate < 1:
            raise ValueError(f"PowerSGDConfig min_compression_rate={self.min_compression_rate!r} must be >= 1")
        if self.matrix_dtype not in MATRIX_DTYPES:
            raise ValueError(
                f"PowerSGDConfig matrix_dtype={self.matrix_dtype!r} is not valid; choose one of {sorted(MATRIX_DTYPES)}"
            )
        if not isinstance(self.orthogonalization_epsilon, int | float) or self.orthogonalization_epsilon < 0:
            raise ValueError(
                f"PowerSGDConfig orthogonalization_epsilon={self.orthogonalization_epsilon!r} must be >= 0"
            )

    def compresses(self, rows: int, cols: int, rank: int | None = None) -> bool:
        """Whether a ``rows`` x ``cols`` gradient is compressed (else it is all-reduced as it is).

        It is when ``(rows + cols) x rank`` values are at least ``min_compression_rate`` times fewer than
        ``rows x cols``.

        Args:
            rows: the gradient's rows.
            cols: its columns.
            rank: the rank in use (``max_error`` may have raised it), or ``None`` for the config's.
        """
        rank = min(rows, cols, self.rank if rank is None else rank)
        return rows * cols >= (rows + cols) * rank * self.min_compression_rate


def is_adaptive(optimizer: object) -> bool:
    """Whether ``optimizer`` (or the optimizer it wraps, e.g. ``ZeroRedundancyOptimizer``'s) is Adam-like.

    Its class's or a base class's name contains one of :data:`ADAPTIVE_OPTIMIZERS` (a class name alone works too).
    """
    if isinstance(optimizer, str):
        names = [optimizer]
    else:
        inner = getattr(optimizer, "optim", None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return is_adaptive(inner)
        names = [cls.__name__ for cls in type(optimizer).__mro__]
    return any(kind in name.lower() for name in names for kind in ADAPTIVE_OPTIMIZERS)


def local_cpu_kernels() -> CPUKernels:
    """This process's choice for :meth:`PowerSGDState.kernels`, before agreeing it with the other ranks.

    numba's loops whatever torch's thread count: each row's arithmetic is the same on any number of threads.
    Without numba, row blocks on one thread and whole-matrix BLAS (which splits its sums by thread) on more.
    """
    if _kernels.available():
        return "numba"
    return "blas" if torch.get_num_threads() > 1 else "blocked"
