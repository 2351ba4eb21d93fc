"""PowerSGD (Vogels et al., 2019) for gloo and NCCL with any number of buckets, with state to save.

Tested on gloo (CPUs); the CUDA path below is written to torch's stream semantics and has not run on a GPU yet.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

torch's ``powerSGD_hook`` chains each bucket's P and Q allreduces through future callbacks, which on gloo run on
whichever thread completes first, so different ranks issue the collectives of different buckets in different
orders and gloo aborts ("Received data size doesn't match expected size"). Here each bucket's whole chain
(compress, all-reduce P, orthogonalise, all-reduce Q, decompress) runs in one place, bucket after bucket in DDP's
bucket order, so all ranks issue the same collectives in the same order:

* **On a CPU with** ``PowerSGDState(pipelined=True)`` (what ``OptimizedDDPStrategy`` sets, with a process group of
  the hook's own) the hook hands the bucket to one worker thread per hook state and returns at once; the worker runs
  the buckets first in, first out, and completes each bucket's future. The backward pass goes on computing the next
  buckets' gradients while a bucket's collectives are on the wire: the same results, bit for bit. The group must be
  one that nothing else uses during the backward pass (DDP's unused-parameter all-reduce, a loss's collectives run
  on the backward thread meanwhile, and gloo needs every rank to issue a group's collectives in one order).
  Without ``pipelined`` (the default) the chain runs inside the hook, on the backward thread.
* **On a GPU** the chain runs inside the hook call, on a CUDA side stream of the state's own, ordered after the
  bucket's gradients (:mod:`lightning_ddpopt.hooks.streams`): its waits for P's and Q's all-reduces order that side
  stream only, so the backward pass's stream computes the next buckets' gradients meanwhile and waits for the side
  stream only at DDP's end-of-backward wait for the bucket's future (a CUDA-aware future: an event, no host wait).
  The random projections are drawn on the CPU (the same bits on every rank) and copied through pinned memory.

The random projections are drawn from generators seeded by ``(seed, step, parameter name)``, the same on every
rank and reproducible after a resume without saving any RNG state.

**The error bound** (``PowerSGDConfig.max_error``): :mod:`~lightning_ddpopt.hooks.powersgd_rank` measures the
compression error every few rounds and raises the rank while it is above the bound.

Under fp16 AMP two things keep the state sound:

* **Non-finite gradients never enter the state.** A sync round stages its new error feedback and Q memories and
  commits them only if every all-reduced factor of the round was finite. The test is on all-reduced values, the
  same on every rank, so every rank takes the same decision (a non-finite local matrix always makes its P
  non-finite). A bucket whose factors are not finite is handed back as NaN on every rank, so the GradScaler skips
  that step everywhere (without one, AMPMonitor reports it on every rank alike); the next finite step compresses
  from the state before it.
  On CPU the decision is taken at the round's last bucket. On a GPU the verdict never reaches the host: when the
  next round opens, the round is committed on the device, each new error and Q memory replaced in place by
  ``where(finite, new, kept)`` (:meth:`~lightning_ddpopt.hooks.base.ErrorFeedbackState._commit`),
  on the side stream, after the round's own kernels. Until then both rounds' error feedback is held.
* **Error feedback is kept in the units of its loss scale.** Each stored error remembers the loss scale of the
  backward pass that produced it (``CommHookState.loss_scale``) and is rescaled to the current scale before it
  is added, so a GradScaler's growth or backoff does not inject it 2x too large or too small.

**What is where, in this module.** :class:`PowerSGDConfig`: the settings, the wire dtypes of the factors, the CPU
kernels a rank can run. :func:`random_q` and :func:`orthogonalize`: orthonormal columns, the seeded start of the power
iteration and the orthogonalisation of P; both give the same bits on every rank: the start is drawn by the CPU
generator from ``(seed, iteration, key)``, and with numba the orthogonalisation runs as a loop whose arithmetic does
not depend on the thread count. :class:`PowerSGDState`: the per-rank state, what lives between steps and what a
checkpoint keeps (error feedback, warm-start Q memories, the rank in use); how a round's state is committed, on the
host and on a GPU alike, is :class:`~lightning_ddpopt.hooks.base.ErrorFeedbackState`'s rule, and the Q memories
follow it. :func:`low_rank_allreduce`: the low-rank step for a bucket's matrices (P = M Q, all-reduce, orthogonalise,
Q = M^T P, all-reduce), one after another on the thread that runs the bucket's chain; it adds the stored error
feedback, keeps this rank's compression error and the new Q memories in the sync round, and hands back NaN on every
rank when a reduced factor is not finite; on the CPU with numba the passes over M are fused loops
(:mod:`lightning_ddpopt.hooks._kernels`) that give the same bits whatever torch's thread count. :func:`powersgd_hook`
and :func:`dispatch`: the hook, which runs each bucket's chain where the state runs its chains.

The terms used here (sync round, verdict, meeting, island, wire bytes) are defined in the design page's glossary.
"""

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from lightning_ddpopt._validate import is_real_number, require_int
from lightning_ddpopt.deferred import DeferredRead, to_device
from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.base import ErrorFeedbackState, SyncRound, config_mismatch, fed_back_sq, squared_norm
from lightning_ddpopt.hooks.powersgd_rank import RankChange, RankController, square_side

__all__ = [
    "MATRIX_DTYPES",
    "CPUKernels",
    "MatrixDtype",
    "PowerSGDConfig",
    "PowerSGDState",
    "allreduce_mean_inplace",
    "completed",
    "compress_listed",
    "decompress",
    "dispatch",
    "local_cpu_kernels",
    "low_rank_allreduce",
    "orthogonalize",
    "powersgd_hook",
    "random_q",
    "strongest_columns",
    "write_back",
]


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
            ``"auto"`` (the default): 0.6 when an optimizer is adaptive (Adam and its kin,
            :data:`~lightning_ddpopt.hooks.powersgd_rank.ADAPTIVE_OPTIMIZERS`), else 0.9
            (:data:`~lightning_ddpopt.hooks.powersgd_rank.ERROR_BOUNDS`), as ``OptimizedDDPStrategy`` finds them at
            setup; a state used without the strategy takes 0.6 unless :meth:`PowerSGDState.fit_bound_to` is called.
            The bounds come from ``benchmarks/transformer_quality.py``; the docs' comm-hook guide gives its results.
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
        bound = self.max_error
        if bound is not None and bound != "auto" and not (is_real_number(bound) and 0 < bound < 1):
            raise ValueError(
                f"PowerSGDConfig max_error={bound!r} must be a number between 0 and 1 (exclusive), 'auto' "
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
        epsilon = self.orthogonalization_epsilon
        if not isinstance(epsilon, int | float) or epsilon < 0:
            raise ValueError(f"PowerSGDConfig orthogonalization_epsilon={epsilon!r} must be >= 0")

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


def local_cpu_kernels() -> CPUKernels:
    """This process's choice for :meth:`PowerSGDState.kernels`, before agreeing it with the other ranks.

    numba's loops whatever torch's thread count: each row's arithmetic is the same on any number of threads.
    Without numba, row blocks on one thread and whole-matrix BLAS (which splits its sums by thread) on more.
    """
    if _kernels.available():
        return "numba"
    return "blas" if torch.get_num_threads() > 1 else "blocked"


def agreed_cpu_kernels(process_group: dist.ProcessGroup | None) -> CPUKernels:
    """PowerSGD's CPU kernels that every rank can run (every rank calls it, on ``process_group``).

    The decompression must give the same bits on every rank: computed the same way everywhere, the way the least
    able rank can ("blas" with more threads somewhere, else "blocked" without numba).

    Args:
        process_group: DDP's group (every rank).
    """
    order: tuple[CPUKernels, ...] = ("numba", "blocked", "blas")
    kernels = torch.tensor([order.index(local_cpu_kernels())])
    dist.all_reduce(kernels, op=dist.ReduceOp.MAX, group=process_group)
    return order[int(kernels)]


def random_q(
    config: PowerSGDConfig, iteration: int, key: str, shape: tuple[int, int], loops: bool = False
) -> torch.Tensor:
    """The orthonormal start of the power iteration, seeded by (seed, iteration, key): the same on every rank.

    Drawn by the CPU generator: a GPU's generator spreads its draws over the device's multiprocessors, so GPUs of
    different models could draw different values.
    """
    # The CPU generator keeps only a seed's low 32 bits, so all three go through one 32-bit hash.
    seed = zlib.crc32(f"{config.seed}/{iteration}/{key}".encode())
    q = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    orthogonalize(q, config.orthogonalization_epsilon, loops)
    return q


def orthogonalize(matrix: torch.Tensor, epsilon: float, loops: bool = False) -> None:
    """Make the columns of ``matrix`` orthonormal, in place, computing in fp32.

    ``loops``: through numba's loop, the same bits whatever the thread count.
    """
    if loops and _kernels.fits(matrix):
        _kernels.orthogonalize(matrix, epsilon)
        return
    work = matrix.float()
    if epsilon == 0:
        work = torch.linalg.qr(work, mode="reduced").Q
    else:
        for i in range(work.shape[1]):
            column = work[:, i : i + 1]
            column.div_(column.norm() + epsilon)
            if i + 1 < work.shape[1]:
                rest = work[:, i + 1 :]
                rest.sub_(column @ (column.t() @ rest))
    matrix.copy_(work)


@dataclass
class _Regroup:
    """Batched PowerSGD's first round after a resume: compress the groups the saved state was made with.

    DDP starts a fresh module with its initial bucket layout and rebuilds it after the first step, so the first
    resumed round would see buckets that the saved Q memories (keyed by a bucket's parameter names) never saw.
    This round collects the gradients instead and compresses each saved group once all of it has arrived, in
    DDP's bucket order, the same on every rank; a bucket's future completes when all of its gradients are done.
    """

    groups: list[tuple[str, ...]]
    arrived: dict[str, torch.Tensor] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    waiting: list[tuple[set[str], torch.futures.Future[torch.Tensor], torch.Tensor]] = field(default_factory=list)


@dataclass(kw_only=True)
class PowerSGDState(ErrorFeedbackState):
    """PowerSGD's per-rank state: the step counter, error feedback and warm-start memories.

    ``iteration`` advances once per sync round, on the last bucket. Error feedback (kept for compressed matrices
    only: uncompressed tensors are exact) and Q memories are keyed by parameter name (batched: by the bucket's
    joined names), not by bucket index, so they survive DDP's bucket rebuild after the first step and a resume.
    Error feedback differs per rank and is stored with the loss scale it is in (``error_scales``, 1 without a
    GradScaler); Q memories are the same on every rank (they are all-reduced). ``skipped_rounds`` counts rounds
    whose reduced factors were not finite and left the state untouched. Call :meth:`bind_module` with the wrapped
    module before the first step.

    The strategy builds it from ``comm_hook="powersgd"`` or a :class:`PowerSGDConfig`; build one yourself only to
    register :func:`powersgd_hook` on a DDP model of your own.

    Args:
        config: rank, error bound, warm-up and the rest of PowerSGD's settings.
        process_group: the group to all-reduce over; ``None`` for the default (world) group.
        ledger: where the hook reports the bytes it sends; ``None`` records nothing.
        loss_scale: returns the current loss scale (the strategy sets it under fp16 AMP); see
            :class:`CommHookState`.
        iteration: sync rounds so far (restored from a checkpoint; leave it 0).
        skipped_rounds: rounds whose reduced values were not finite and left the state untouched.
        errors: each rank's error feedback per parameter name (its own; saved in checkpoints).
        error_scales: the loss scale each error was computed at (1 without a GradScaler).
        q_memories: the warm-start Q of each compressed matrix (the same on every rank).
        pipelined: hand each bucket's chain to a worker thread and return at once (CPU only); it needs a
            ``process_group`` that nothing else uses during the backward pass. The strategy sets it on CPUs.
        cpu_kernels: numba's fused loops, agreed on by every rank (the strategy sets them); ``None``: torch's.
    """

    label: ClassVar[str] = "PowerSGD"

    config: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    q_memories: dict[str, torch.Tensor] = field(default_factory=dict)
    pipelined: bool = False
    cpu_kernels: CPUKernels | None = None
    #: Each matrix's rank and the error bound (:mod:`~lightning_ddpopt.hooks.powersgd_rank`); the same on every rank.
    ranks: RankController = field(init=False)
    #: The element count of each parameter that gets a gradient, in the module's order (set by :meth:`bind_module`).
    gradient_sizes: list[int] = field(default_factory=list, init=False, repr=False)
    _regroup: _Regroup | None = field(default=None, repr=False)
    _worker: Worker | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ranks = RankController(config=self.config)

    @property
    def rank(self) -> int:
        """The highest rank in use (``config.rank``, moved per matrix by ``config.max_error``); alike on every rank."""
        return self.ranks.highest

    def rank_of(self, key: str) -> int:
        """The rank a matrix compresses at this round.

        Args:
            key: the matrix's key: its parameter's name (batched: the bucket's names joined by ``|``).
        """
        return self.ranks.rank_of(key)

    @property
    def rank_changes(self) -> list[RankChange]:
        """``(step, error, old rank, new rank, matrix key)`` for each change of a matrix's rank, in order."""
        return self.ranks.changes

    @property
    def error_bound(self) -> float | None:
        """The error bound in use: ``config.max_error``, ``"auto"`` resolved (see :meth:`fit_bound_to`)."""
        return self.ranks.bound

    def fit_bound_to(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve ``max_error="auto"`` for these optimizers: the adaptive bound if any is adaptive, else the other.

        Args:
            optimizers: the run's optimizers.
        """
        self.ranks.fit_bound_to(optimizers)

    def send_measurement(self) -> None:
        """At the round's last bucket: sum the round's error measurement over the ranks, to be read two rounds later."""
        total = self.ranks.take()
        if total is None:  # not measured, or nothing compressed this round (the same on every rank)
            return
        work = dist.all_reduce(total, group=self.process_group, async_op=True)
        self.ranks.expect(DeferredRead(total, work), self.iteration)

    def kernels(self) -> CPUKernels:
        """How this rank computes the passes over M on the CPU (the strategy agrees it across ranks).

        A state built by hand with ``cpu_kernels=None`` decides per rank: give its ranks the same thread count and
        packages. The decompression's result must be the same bits on every rank, so every rank must compute it the
        same way:
        ``"numba"`` (:mod:`~lightning_ddpopt.hooks._kernels`) where every rank has numba, else ``"blocked"`` where
        every rank runs one torch thread, else ``"blas"`` (whole-matrix kernels).
        """
        return self.cpu_kernels if self.cpu_kernels is not None else local_cpu_kernels()

    def run_beside_backward(
        self, make_group: Callable[[], dist.ProcessGroup], model_group: dist.ProcessGroup | None
    ) -> dist.ProcessGroup:
        """On a CPU, run the buckets' chains on the worker thread, on a group of its own (see the base's).

        Args:
            make_group: makes a group over the model's ranks (every rank calls it in one order).
            model_group: DDP's group, on which the ranks agree the CPU kernels (:func:`agreed_cpu_kernels`).
        """
        self.process_group = make_group()
        self.pipelined = True
        self.cpu_kernels = agreed_cpu_kernels(model_group)
        return self.process_group

    def close(self) -> bool:
        """Stop the CPU worker thread (after the buckets it holds); a later step starts a new one.

        Returns False if the thread is still running a bucket after a minute (its group must then stay as it is).
        """
        worker = self._worker
        if worker is not None and not worker.stop():
            return False
        self._worker = None
        return True

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names that key the per-parameter state (``module`` is the one DDP wraps).

        Args:
            module: the module DDP wraps.
        """
        super().bind_module(module)
        trained = [param for param in module.parameters() if param.requires_grad]
        self.ranks.bind(list(self._names.values()), [_matrix_shape(param) for param in trained])
        self.gradient_sizes = [param.numel() for param in trained]
        if self._regroup is not None:
            self._plan_regroup(list(self._regroup.groups))

    def config_dict(self) -> dict[str, object]:
        """The PowerSGDConfig as saved, and ``tiers: None`` (a flat sync: a two-tier one's state does not apply)."""
        return {**asdict(self.config), "tiers": None}

    def mismatch(self, state: dict[str, object]) -> str | None:
        """Name the config fields in which ``state`` differs, leaving out the error bound (``max_error``, ``max_rank``).

        The bound may change on a resume (and a state saved before it existed has none): the rank reached is kept,
        within the new bound (see :meth:`~lightning_ddpopt.hooks.powersgd_rank.RankController.load_state_dict`).

        Args:
            state: what :meth:`state_dict` returned.
        """
        bound = {"max_error", "max_rank"}
        config = {key: value for key, value in self.config_dict().items() if key not in bound}
        return config_mismatch(self.label, state, config)

    def state_dict(self) -> dict[str, object]:
        """Iteration, error feedback with its loss scales, and Q memories (tensors on the CPU), plus the config."""
        if self._worker is not None:
            self._worker.drain()
        self._streams.join()  # the Q memories were written on the hook's side stream
        saved = super().state_dict()  # commits the last round (on a GPU it waits for the next) and resolves it
        q_memories = {key: q.detach().cpu().clone() for key, q in self.q_memories.items()}
        return {**saved, "q_memories": q_memories, **self.ranks.state_dict()}

    def load_shared_state_dict(self, state: dict[str, object]) -> str:
        """Restore the step counter and the Q memories (the same on every rank); error feedback starts afresh.

        Args:
            state: what :meth:`state_dict` returned on a rank of the other world size.
        """
        iteration, q_memories = state["iteration"], state["q_memories"]
        assert isinstance(iteration, int) and isinstance(q_memories, dict)
        self._drop_errors()
        self.iteration = iteration
        self.q_memories = dict(q_memories)
        self.ranks.load_state_dict(state)
        if self.config.batched:
            self._plan_regroup([tuple(key.split("|")) for key in self.q_memories])
        lowest = self.ranks.lowest
        ranks = f"the rank ({self.rank})" if lowest == self.rank else f"the ranks per matrix ({lowest}-{self.rank})"
        return f"the step count ({iteration}), {ranks} and the warm-start Q memories are kept"

    def _plan_regroup(self, groups: list[tuple[str, ...]]) -> None:
        known = set(self._names.values())
        usable = [group for group in groups if not known or set(group) <= known]
        self._regroup = _Regroup(usable) if usable else None

    def close_round(self, seal_now: bool = True) -> None:
        """End the round (as the base class does); the first round after a resume's regrouping ends with it.

        Args:
            seal_now: every bucket's checks are in (see the base's).
        """
        self._regroup = None
        super().close_round(seal_now)

    def _tables(self) -> dict[str, dict[str, torch.Tensor]]:
        return {**super()._tables(), "q": self.q_memories}

    def _commit_shared(self, round_: SyncRound, finite: torch.Tensor | None) -> None:
        """The round's Q memories, by the commit rule; batched, keys of groups a parameter was in before are dropped.

        On the device a key with no memory keeps the fresh projection the next round would draw where the round was
        not finite: all-reduced values and one verdict, so the same on every rank.
        """
        if self.config.batched:
            # A parameter belongs to one batched matrix: drop keys of groups it was in before (another layout).
            regrouped = {name for key in round_.q_memories for name in key.split("|")}
            for key in [k for k in self.q_memories if k not in round_.q_memories]:
                if regrouped.intersection(key.split("|")):
                    self._drop("q", key, finite)
        for key, new in round_.q_memories.items():

            def fresh(like: torch.Tensor, key: str = key) -> torch.Tensor:
                q = random_q(self.config, self.iteration, key, (like.shape[0], like.shape[1]))
                return to_device(q, like.device).to(like.dtype)

            self._put("q", key, new, finite, fresh)


def _matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """The matrix PowerSGD compresses a parameter's gradient as: its first dimension by the rest (1-D: by 1)."""
    rows = param.shape[0] if param.dim() else 1
    return rows, param.numel() // max(rows, 1)


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
            q = random_q(config, state.iteration, key, shape, fused)
        # Drawn (the same bits on every rank, whatever its GPU) or restored on the CPU: copied without a host wait.
        qs.append(to_device(q, matrix.device).to(matrix))

    # P = M Q averaged over ranks (the scale is irrelevant: P is orthogonalised next).
    # (Q^T M^T)^T rather than M Q, and (P^T M)^T rather than M^T P below: BLAS streams the large matrix about 3x
    # faster in these forms (measured: 10 ms against 31 ms for 6 x 2048 x 2048 at rank 4 on one CPU thread).
    if fused:
        feedback = [
            state.stored_error(round_, key, m) if add_feedback else None for m, key in zip(matrices, keys, strict=True)
        ]
        local_ps = [_kernels.add_and_project(m, q, f) for m, q, f in zip(matrices, qs, feedback, strict=True)]
        added = fed_back_sq(feedback) if state.measuring else None
    else:
        added = state.add_error_feedback(round_, keys, matrices) if add_feedback else None
        local_ps = [(q.t() @ m.t()).t() for m, q in zip(matrices, qs, strict=True)]
    # The matrices hold the error fed back now: what the compression is given.
    measuring_error = state.ranks.measuring
    # Each matrix's squared norm, summed in order: the same bits as squared_norm(*matrices).
    given_each = [squared_norm(m) for m in matrices] if state.measuring or measuring_error else []
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
        if not config.error_feedback:
            torch.matmul(p, q.t(), out=m)
            continue
        errors.append(state.error_buffer(round_, key, tuple(m.shape), m.dtype, m.device))
        if fused and _kernels.fits(errors[-1]):
            _kernels.error_and_decompress(m, p, local_q, q, errors[-1])
        else:
            _decompress(m, p, q, state.kernels() != "blas", local_q, errors[-1])
    if given_each:
        given_sq = sum(given_each, torch.zeros_like(given_each[0]))
        # Without error feedback no error is formed: M - P P^T M is orthogonal to P P^T M, whose norm is local Q's.
        dropped_each = [squared_norm(e) for e in errors]  # summed in order: the bits of squared_norm(*errors)
        if errors:
            dropped_sq = sum(dropped_each, torch.zeros_like(given_sq))
        else:
            dropped_sq = (given_sq - squared_norm(*local_qs)).clamp_(min=0)
        if measuring_error:
            # Each matrix's squared norms for its rank: given, dropped, and dropped were its rank halved. Halving
            # keeps the columns of P whose reduced Q columns are strongest (as the next round's warm start would);
            # what this rank's approximation loses with the others is its M^T P columns' energy (P is orthonormal).
            for index, (m, key, q, local_q) in enumerate(zip(matrices, keys, qs, local_qs, strict=True)):
                given = given_each[index]
                dropped = dropped_each[index] if errors else (given - squared_norm(local_q)).clamp_(min=0)
                weakest = _strongest_first(q)[state.ranks.halved(key, m.shape[0], m.shape[1]) :]
                lost = local_q.index_select(1, weakest).double().square().sum()
                state.ranks.add(key, given, dropped, dropped + lost)
        if state.measuring:
            state.record_compression(bucket, given_sq, dropped_sq, fed_back if fed_back is not None else added)
    if config.warm_start:
        round_.q_memories.update(zip(keys, qs, strict=True))
    return errors


def strongest_columns(q: torch.Tensor, keep: int) -> torch.Tensor:
    """The ``keep`` columns of ``q`` with the largest norms, in their order (the same on every rank: Q is reduced)."""
    return q[:, torch.sort(_strongest_first(q)[:keep]).values]


def _strongest_first(q: torch.Tensor) -> torch.Tensor:
    """``q``'s column indices by falling norm, ties in column order: the same on every rank (Q is reduced)."""
    return torch.sort(q.norm(dim=0), descending=True, stable=True).indices


def decompress(state: PowerSGDState, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``M = P Q^T`` as :func:`low_rank_allreduce` computes it with ``state``'s settings: the same bits.

    For a rank that holds the reduced factors of a matrix another rank compressed (two-tier PowerSGD's owners).

    Args:
        state: the hook's state (error feedback and CPU kernels decide how the owner decompressed).
        m: the matrix to write (rows x cols).
        p: its reduced, orthogonalised P (rows x r).
        q: its reduced Q (cols x r).
    """
    error_feedback, kernels = state.config.error_feedback, state.kernels()
    if error_feedback and kernels == "numba" and _kernels.fits(m, p):
        _kernels.decompress(m, p, q)
    else:
        _decompress(m, p, q, blocked=error_feedback and kernels != "blas")


def _decompress(
    m: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    blocked: bool,
    local_q: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
) -> None:
    """``M = P Q^T`` through torch, after ``error = M - P local_Q^T`` (this rank's compression error) if given.

    ``blocked`` (one CPU thread): both are done a block of rows at a time, small enough to stay in the cache between
    the two: M is read from memory once instead of twice. With more threads the whole-matrix kernels run instead:
    small blocks would cost an OpenMP fork and join each.
    """
    rows = max(1, _CACHE_BLOCK_ELEMENTS // max(1, m.shape[1]) if blocked and not m.is_cuda else m.shape[0])
    for start in range(0, m.shape[0], rows):
        block = slice(start, start + rows)
        if error is not None and local_q is not None:
            error[block].copy_(m[block]).addmm_(p[block], local_q.t(), alpha=-1)
        torch.mm(p[block], q.t(), out=m[block])


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
    parts = flat.to(matrices[0].dtype).split([m.numel() for m in matrices])
    return [part.view_as(m) for part, m in zip(parts, matrices, strict=True)]


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the bucket to rank-``r`` factors P and Q, all-reduce them, and decompress; see the module doc.

    Before ``start_iter`` it is a plain mean allreduce, bit-for-bit equal to the ``allreduce`` hook.

    Args:
        state: a :class:`PowerSGDState` (the strategy's ``comm_state``).
        bucket: the gradient bucket DDP hands the hook.
    """
    return dispatch(state, bucket, _sync_bucket)


def dispatch(
    state: PowerSGDState,
    bucket: dist.GradBucket,
    sync: Callable[[PowerSGDState, dist.GradBucket], torch.futures.Future[torch.Tensor]],
) -> torch.futures.Future[torch.Tensor]:
    """Run ``sync`` for the bucket where the state runs its chains: its worker thread, its side stream or here.

    On the worker thread the returned future completes with the chain's result (or its error). After a failure the
    worker runs nothing more: each later bucket fails at once, without a collective (this rank would issue them out
    of step with the others), and buckets waiting for a regrouped round fail too.

    Args:
        state: the hook's state.
        bucket: the gradient bucket DDP hands the hook.
        sync: the bucket's whole chain (returns its future).
    """
    if not state.pipelined or bucket.buffer().device.type != "cpu":
        # On CUDA on the state's side stream (lightning_ddpopt.hooks.streams); on a CPU here, on the backward thread.
        return state._streams.run(bucket.buffer(), lambda: sync(state, bucket))
    worker = state._worker
    if worker is None or not worker.alive():
        if worker is not None and worker.failed is not None:
            raise RuntimeError(f"PowerSGD stopped after an earlier bucket failed: {worker.failed!r}")
        worker = state._worker = Worker("ddpopt-powersgd")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def complete(done: torch.futures.Future[torch.Tensor]) -> None:
        try:
            future.set_result(done.value())
        except Exception as error:  # DDP waits on the future: never leave it pending
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result

    def run() -> None:
        if worker.failed is not None:
            future.set_exception(RuntimeError(f"PowerSGD stopped after an earlier bucket failed: {worker.failed!r}"))  # type: ignore[arg-type]
            return
        try:
            inner = sync(state, bucket)
        except Exception as error:
            worker.failed = error
            future.set_exception(error)  # type: ignore[arg-type]
            regroup, state._regroup = state._regroup, None
            for _, pending, _ in regroup.waiting if regroup is not None else ():
                if not pending.done():
                    pending.set_exception(error)  # type: ignore[arg-type]
            return
        # Not waited for here: a regrouped bucket completes when later buckets (behind it in this queue) have run.
        inner.add_done_callback(complete)

    worker.submit(run)
    return future


def _sync_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's whole chain, here and now; the returned future is complete (or completes with later buckets)."""
    start = time.perf_counter()
    buffer, config = bucket.buffer(), state.config
    regrouped = None
    if state.iteration < config.start_iter:
        allreduce_mean_inplace(state, bucket, buffer)
    else:
        if bucket.index() == 0:
            state.ranks.adapt(state.iteration)
        round_, names, gradients = state.open_round(), state.names_in(bucket), bucket.gradients()
        fed_back = None
        if config.batched and config.error_feedback:  # per parameter, before the bucket becomes one matrix
            fed_back = state.add_error_feedback(round_, names, gradients)
        if not config.batched:
            compress_listed(state, round_, bucket, names, gradients)
        elif state._regroup is not None:
            regrouped = _regrouped_batched(state, round_, bucket, buffer, names, gradients)
        else:  # the gradients are views into the bucket's buffer: compress it as it lies
            _compress_as_square(state, round_, bucket, names, gradients, buffer, fed_back)
    future = completed(buffer) if regrouped is None else regrouped
    if bucket.is_last():
        state.send_measurement()
        state.close_round()
    state.add_seconds(time.perf_counter() - start)
    return future


def completed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``buffer``, as a hook returns it once the bucket's chain has run.

    On CUDA the future knows its device: it then records an event on the current stream, and whoever waits on it
    (DDP, the ledger's timing callback) is ordered after the kernels above, not merely after their launch.

    Args:
        buffer: the bucket's synced buffer.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=_devices(buffer))
    future.set_result(buffer)
    return future


def _devices(tensor: torch.Tensor) -> list[int | str | torch.device] | None:
    return [tensor.device] if tensor.is_cuda else None


def allreduce_mean_inplace(state: PowerSGDState, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
    """Replace ``tensor`` with its mean over the state's group, exactly (fp32 on the wire), recording its bytes.

    Args:
        state: the hook's state (its ``process_group`` and ``world_size``).
        bucket: the bucket it belongs to (for the ledger).
        tensor: what to average, in place.
    """
    tensor.div_(state.world_size)
    state.record_wire_bytes(bucket, tensor.numel() * tensor.element_size())
    state.wait(dist.all_reduce(tensor, group=state.process_group, async_op=True))


def compress_listed(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    names: list[str],
    gradients: list[torch.Tensor],
    factors: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Sync ``gradients`` (of ``names``), in place: matrices worth compressing as rank-r factors, the rest exactly.

    Args:
        state: the hook's state (its ``process_group`` is the group they are averaged over).
        round_: the sync round open.
        bucket: the bucket they are in (for the ledger).
        names: their parameter names.
        gradients: the gradients, views into the bucket's buffer.
        factors: receives the reduced ``(P, Q)`` of each compressed matrix, in ``names`` order.
    """
    config = state.config
    matrices, keys, others, other_names = [], [], [], []
    for name, gradient in zip(names, gradients, strict=True):
        matrix = gradient.view(gradient.shape[0], -1) if gradient.dim() > 1 else None
        if matrix is not None and config.compresses(matrix.shape[0], matrix.shape[1], state.rank_of(name)):
            matrices.append(matrix)
            keys.append(name)
        else:
            others.append(gradient)
            other_names.append(name)
    if others:
        if config.error_feedback:
            # A matrix a raised rank no longer compresses sends its stored error with it (then the error is dropped);
            # the others have none stored.
            state.add_error_feedback(round_, other_names, others)
        _allreduce_exact(state, round_, bucket, other_names, others)
    if matrices:
        errors = low_rank_allreduce(
            state, round_, bucket, matrices, keys, add_feedback=config.error_feedback, factors=factors
        )
        if config.error_feedback:
            round_.errors.update(zip(keys, errors, strict=True))


def _allreduce_exact(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    names: list[str],
    tensors: list[torch.Tensor],
    flat: torch.Tensor | None = None,
) -> None:
    """Mean-allreduce ``tensors`` uncompressed (one flat collective) and note whether the result is finite.

    ``flat``: the buffer the tensors are views into, all-reduced in place; ``None``: a copy, written back.
    """
    work = torch.cat([t.reshape(-1) for t in tensors]) if flat is None else flat
    allreduce_mean_inplace(state, bucket, work)
    round_.check([work])
    round_.sent_exactly.update(names)
    if flat is None:
        write_back(work, tensors)


def write_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive slices into ``tensors`` (the tensors it was concatenated from).

    Args:
        flat: the values, end to end.
        tensors: where they go, in order.
    """
    for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        tensor.copy_(part.view_as(tensor))


def _regrouped_batched(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    buffer: torch.Tensor,
    names: list[str],
    gradients: list[torch.Tensor],
) -> torch.futures.Future[torch.Tensor]:
    """One bucket of the first round after a resume: see :class:`_Regroup`."""
    regroup = state._regroup
    assert regroup is not None
    grouped = {name for group in regroup.groups for name in group}.intersection(names)
    loose = [(name, gradient) for name, gradient in zip(names, gradients, strict=True) if name not in grouped]
    if loose:  # in buckets that were sent uncompressed before the checkpoint: exact, whatever the grouping
        _allreduce_exact(state, round_, bucket, [name for name, _ in loose], [gradient for _, gradient in loose])
    regroup.arrived.update((name, g) for name, g in zip(names, gradients, strict=True) if name in grouped)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=_devices(buffer))
    regroup.waiting.append((grouped, future, buffer))
    last = bucket.is_last()
    for index, group in enumerate(regroup.groups):
        arrived = [name for name in group if name in regroup.arrived]
        if index in regroup.done or not (len(arrived) == len(group) or (last and arrived)):
            continue
        regroup.done.add(index)
        _compress_as_square(state, round_, bucket, arrived, [regroup.arrived.pop(name) for name in arrived])
    finished = {name for index in regroup.done for name in regroup.groups[index]}
    ready = [entry for entry in regroup.waiting if entry[0] <= finished]
    regroup.waiting = [entry for entry in regroup.waiting if not entry[0] <= finished]
    for _, pending, pending_buffer in ready:
        pending.set_result(pending_buffer)
    assert not (last and regroup.waiting), "every gradient has arrived by the last bucket"
    return future


def _compress_as_square(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    names: list[str],
    gradients: list[torch.Tensor],
    flat: torch.Tensor | None = None,
    fed_back: torch.Tensor | None = None,
) -> None:
    """Compress the ``gradients`` of ``names``, end to end, as one zero-padded square matrix; small ones exactly.

    ``flat``: the buffer the gradients are views into, compressed as it lies; ``None``: a copy is compressed and the
    result written back into them. ``fed_back``: the squared norm of the error feedback added to the gradients,
    for the ledger. The matrix's error is kept per parameter, as views into it.
    """
    key, numel = "|".join(names), sum(g.numel() for g in gradients)
    side = square_side(numel)
    if not state.config.compresses(side, side, state.rank_of(key)):
        _allreduce_exact(state, round_, bucket, names, gradients, flat)
        return
    work = torch.cat([g.reshape(-1) for g in gradients]) if flat is None else flat
    square = work if side * side == numel else torch.cat([work, work.new_zeros(side * side - numel)])
    if fed_back is None and state.config.error_feedback:  # added elsewhere (a regrouped round): not known here
        fed_back = torch.full((), math.nan, dtype=torch.float64, device=square.device)
    matrix = square.view(side, side)
    errors = low_rank_allreduce(state, round_, bucket, [matrix], [key], add_feedback=False, fed_back=fed_back)
    if square is not work:
        work.copy_(square[:numel])
    if flat is None:
        write_back(work, gradients)
    for error in errors:  # none without error feedback
        parts = error.reshape(-1)[:numel].split([g.numel() for g in gradients])
        round_.errors.update((name, part.view_as(g)) for name, part, g in zip(names, parts, gradients, strict=True))
