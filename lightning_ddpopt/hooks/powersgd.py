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

**The error bound** (``PowerSGDConfig.max_error``): every ``RANK_WINDOW``-th compressed round measures its relative
compression error, after its last bucket all-reduces the two squared norms (one more small collective on the
hook's group, in the same place of the chain on every rank), and two rounds later every rank reads the sum (on a GPU
through a :class:`~lightning_ddpopt.deferred.DeferredRead`, long arrived unless the host runs two syncs ahead of
the device) and doubles the rank if the error is above the bound. A non-finite round's measurement decides nothing.

Under fp16 AMP two things keep the state sound:

* **Non-finite gradients never enter the state.** A sync round stages its new error feedback and Q memories and
  commits them only if every all-reduced factor of the round was finite. The test is on all-reduced values, the
  same on every rank, so every rank takes the same decision (a non-finite local matrix always makes its P
  non-finite). A bucket whose factors are not finite is handed back as NaN on every rank, so the GradScaler skips
  that step everywhere (without one, AMPMonitor reports it on every rank alike); the next finite step compresses
  from the state before it.
  On CPU the decision is taken at the round's last bucket. On a GPU the verdict never reaches the host: when the
  next round opens, the round is committed on the device, each new error and Q memory replaced in place by
  ``where(finite, new, kept)`` (:meth:`~lightning_ddpopt.hooks.feedback.ErrorFeedbackState._commit_on_device`),
  on the side stream, after the round's own kernels. Until then both rounds' error feedback is held.
* **Error feedback is kept in the units of its loss scale.** Each stored error remembers the loss scale of the
  backward pass that produced it (``CommHookState.loss_scale``) and is rescaled to the current scale before it
  is added, so a GradScaler's growth or backoff does not inject it 2x too large or too small.
"""

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ddpopt._validate import require_int
from lightning_ddpopt.deferred import DeferredRead, to_device
from lightning_ddpopt.hooks import _kernels
from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.feedback import ErrorFeedbackState, SyncRound, config_mismatch
from lightning_ddpopt.hooks.lowrank import MATRIX_DTYPES, low_rank_allreduce, random_q

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "ERROR_BOUNDS",
    "RANK_WINDOW",
    "PowerSGDConfig",
    "PowerSGDState",
    "is_adaptive",
    "powersgd_hook",
]

#: Optimizers that scale each coordinate by its own history (Adam and its kin): a compression error costs them more.
#: Matched in a class name or any base's, case-insensitively (AdamW, FusedAdam, AdamW8bit, a subclass of Adam, ...).
ADAPTIVE_OPTIMIZERS = ("adam", "adagrad", "adadelta", "adafactor", "rmsprop", "lamb")
#: ``max_error="auto"``'s bound: with an adaptive optimizer, and with others. Chosen from the errors and held-out
#: losses of ``benchmarks/transformer_quality.py`` (the docs' comm hooks guide has them).
ERROR_BOUNDS = {"adaptive": 0.6, "other": 0.9}

#: Syncs between two measurements of the compression error that may raise the rank (``PowerSGDConfig.max_error``).
RANK_WINDOW = 5
#: A measurement's verdict is applied this many syncs later: on a GPU its value has reached the host by then.
RANK_DECISION_LAG = 2

MatrixDtype = Literal["fp32", "fp16", "bf16"]
#: How the CPU computes the passes over M: numba's fused loops or BLAS in row blocks (one thread), whole-matrix BLAS.
CPUKernels = Literal["numba", "blocked", "blas"]


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


class _Regroup:
    """Batched PowerSGD's first round after a resume: compress the groups the saved state was made with.

    DDP starts a fresh module with its initial bucket layout and rebuilds it after the first step, so the first
    resumed round would see buckets that the saved Q memories (keyed by a bucket's parameter names) never saw.
    This round collects the gradients instead and compresses each saved group once all of it has arrived, in
    DDP's bucket order, the same on every rank; a bucket's future completes when all of its gradients are done.
    """

    def __init__(self, groups: list[tuple[str, ...]]) -> None:
        self.groups = groups
        self.group_of = {name: index for index, group in enumerate(groups) for name in group}
        self.arrived: dict[str, torch.Tensor] = {}
        self.done: set[int] = set()
        self.waiting: list[tuple[set[str], torch.futures.Future[torch.Tensor], torch.Tensor]] = []


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
        rank: the rank in use; 0 starts at ``config.rank``.
        rank_changes: ``(step, error, old rank, new rank)`` for each rise of the rank, in order.
    """

    label: ClassVar[str] = "PowerSGD"

    config: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    q_memories: dict[str, torch.Tensor] = field(default_factory=dict)
    pipelined: bool = False
    cpu_kernels: CPUKernels | None = None
    #: The rank in use: ``config.rank``, raised by ``config.max_error``; the same on every rank.
    rank: int = 0
    #: The error bound in use: ``config.max_error``, ``"auto"`` resolved (see :meth:`fit_bound_to`).
    error_bound: float | None = field(default=None, init=False)
    #: ``(step, error, old rank, new rank)`` for each rise of the rank, in order.
    rank_changes: list[tuple[int, float, int, int]] = field(default_factory=list)
    _regroup: _Regroup | None = field(default=None, repr=False)
    _worker: Worker | None = field(default=None, repr=False)
    #: This round's squared norms (given, dropped) while it measures for ``max_error``; ``None`` otherwise.
    _probe_sums: list[torch.Tensor] | None = field(default=None, repr=False)
    #: A measurement on its way: the norms summed over the ranks, and the sync round that applies its verdict.
    _probe: tuple[DeferredRead, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rank:
            self.rank = self.config.rank
        bound = self.config.max_error
        self.error_bound = ERROR_BOUNDS["adaptive"] if bound == "auto" else bound

    def fit_bound_to(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Resolve ``max_error="auto"`` for these optimizers: the adaptive bound if any is adaptive, else the other.

        Args:
            optimizers: the run's optimizers.
        """
        if self.config.max_error == "auto":
            self.error_bound = ERROR_BOUNDS["adaptive" if any(map(is_adaptive, optimizers)) else "other"]

    @property
    def probing(self) -> bool:
        """Whether this round measures its compression error for ``max_error`` (set at its first bucket)."""
        return self._probe_sums is not None

    @property
    def _probe_due(self) -> bool:
        """Whether this round is one to measure for ``max_error`` (every ``RANK_WINDOW``-th compressed round)."""
        config = self.config
        if self.error_bound is None or self.rank >= config.max_rank or self.iteration < config.start_iter:
            return False
        return (self.iteration - config.start_iter) % RANK_WINDOW == RANK_WINDOW - 1

    def add_probe(self, given_sq: torch.Tensor, dropped_sq: torch.Tensor) -> None:
        """Add a bucket's squared norms to this round's measurement.

        Args:
            given_sq: the squared norm of what the bucket's compression was given.
            dropped_sq: the squared norm of what it dropped.
        """
        pair = torch.stack([given_sq, dropped_sq])
        self._probe_sums = [pair] if not self._probe_sums else [self._probe_sums[0] + pair]

    def send_probe(self) -> None:
        """At the round's last bucket: sum the round's measurement over the ranks, to be read two rounds later."""
        sums, self._probe_sums = self._probe_sums, None
        if not sums:  # not measured, or nothing compressed this round (the same on every rank)
            return
        total = sums[0].clone()
        work = dist.all_reduce(total, group=self.process_group, async_op=True)
        self._probe = (DeferredRead(total, work), self.iteration + RANK_DECISION_LAG)

    def adapt_rank(self) -> None:
        """At a round's first bucket: apply a measurement's verdict when its round has come (the same on every rank).

        The rank doubles (up to ``max_rank``) when the error summed over the ranks is above the bound.
        """
        if self._probe_due:
            self._probe_sums = []
        if self._probe is None or self.iteration < self._probe[1]:
            return
        read, _ = self._probe
        self._probe = None
        given, dropped = read.read().tolist()
        error = math.sqrt(dropped / given) if given > 0 else math.nan
        bound = self.error_bound
        assert bound is not None
        new_rank = min(2 * self.rank, self.config.max_rank)
        if math.isfinite(error) and error > bound and new_rank > self.rank:
            self.rank_changes.append((self.iteration, error, self.rank, new_rank))
            rank_zero_info(
                f"ddpopt: PowerSGD's compression error {error:.2f} is above max_error {bound:g} at "
                f"rank {self.rank}: rank {new_rank} from sync {self.iteration}"
            )
            self.rank = new_rank

    def kernels(self) -> CPUKernels:
        """How this rank computes the passes over M on the CPU (the strategy agrees it across ranks).

        A state built by hand with ``cpu_kernels=None`` decides per rank: give its ranks the same thread count and
        packages. The decompression's result must be the same bits on every rank, so every rank must compute it the
        same way:
        ``"numba"`` (:mod:`~lightning_ddpopt.hooks._kernels`) where every rank has numba, else ``"blocked"`` where
        every rank runs one torch thread, else ``"blas"`` (whole-matrix kernels).
        """
        return self.cpu_kernels if self.cpu_kernels is not None else local_cpu_kernels()

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
        if self._regroup is not None:
            self._plan_regroup(list(self._regroup.groups))

    def config_dict(self) -> dict[str, object]:
        """The PowerSGDConfig as saved, and ``tiers: None`` (a flat sync: a two-tier one's state does not apply)."""
        return {**asdict(self.config), "tiers": None}

    def mismatch(self, state: dict[str, object]) -> str | None:
        """Name the config fields in which ``state`` differs, leaving out the error bound (``max_error``, ``max_rank``).

        The bound may change on a resume (and a state saved before it existed has none): the rank reached is kept,
        within the new bound (see :meth:`_load_rank`).

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
        self._streams.call(self._settle)  # commit the last round (on a GPU it waits for the next) before copying
        self._streams.join()
        q_memories = {key: q.detach().cpu().clone() for key, q in self.q_memories.items()}
        return {**super().state_dict(), "q_memories": q_memories, **self._rank_state()}

    def _rank_state(self) -> dict[str, object]:
        """The rank in use, its rises, and a measurement on its way (read now: a save may wait for the device)."""
        probe = None
        if self._probe is not None:
            read, decide_at = self._probe
            probe = {"norms": read.read().tolist(), "decide_at": decide_at}
        return {"rank": self.rank, "rank_changes": list(self.rank_changes), "rank_probe": probe}

    def _load_rank(self, state: dict[str, object]) -> None:
        """Restore :meth:`_rank_state`: the rank reached, within this config's bound, and a measurement on its way.

        Without ``max_error`` the rank is the config's; with it, the saved one (a state saved before the rank could
        change: the config's), at least ``rank`` and at most ``max_rank``.
        """
        config = self.config
        saved, changes = state.get("rank", config.rank), state.get("rank_changes", [])
        probe = state.get("rank_probe")
        assert isinstance(saved, int) and isinstance(changes, list)
        self.rank_changes, self._probe_sums, self._probe = [tuple(change) for change in changes], None, None
        if config.max_error is None:
            self.rank = config.rank
            return
        self.rank = min(max(saved, config.rank), config.max_rank)
        if isinstance(probe, dict) and self.rank == saved:  # a measurement at another rank decides nothing here
            self._probe = (DeferredRead(torch.tensor(probe["norms"], dtype=torch.float64)), int(probe["decide_at"]))

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
        self._load_rank(state)
        if self.config.batched:
            self._plan_regroup([tuple(key.split("|")) for key in self.q_memories])
        return f"the step count ({iteration}), the rank ({self.rank}) and the warm-start Q memories are kept"

    def _plan_regroup(self, groups: list[tuple[str, ...]]) -> None:
        known = set(self._names.values())
        usable = [group for group in groups if not known or set(group) <= known]
        self._regroup = _Regroup(usable) if usable else None

    def _close_round(self, seal_now: bool = True) -> None:
        self._regroup = None
        super()._close_round(seal_now)

    def _select_shared(self, round_: SyncRound, finite: torch.Tensor) -> None:
        """Each new Q memory becomes ``where(finite, new, kept)``, selected on the device.

        ``kept`` is the committed memory, else the fresh projection the next round would draw: all-reduced values
        and one verdict, so the same on every rank.
        """
        for key, new in round_.q_memories.items():
            kept = self.q_memories.get(key)
            if kept is None or kept.shape != new.shape or kept.device != new.device:
                shape = (new.shape[0], new.shape[1])
                kept = to_device(random_q(self.config, self.iteration, key, shape), new.device).to(new.dtype)
            torch.where(finite, new, kept, out=new)

    def _commit(self, round_: SyncRound, scales: dict[str, torch.Tensor] | None = None) -> None:
        super()._commit(round_, scales)
        if self.config.batched:
            # A parameter belongs to one batched matrix: drop keys of groups it was in before (another layout).
            regrouped = {name for key in round_.q_memories for name in key.split("|")}
            for key in [k for k in self.q_memories if k not in round_.q_memories]:
                if regrouped.intersection(key.split("|")):
                    del self.q_memories[key]
        self.q_memories.update(round_.q_memories)


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

    Args:
        state: the hook's state.
        bucket: the gradient bucket DDP hands the hook.
        sync: the bucket's whole chain (returns its future).
    """
    if not state.pipelined or bucket.buffer().device.type != "cpu":
        # On CUDA on the state's side stream (lightning_ddpopt.hooks.streams); on a CPU here, on the backward thread.
        return state._streams.run(bucket.buffer(), lambda: sync(state, bucket))
    if state._worker is None or not state._worker.alive():
        if state._worker is not None and state._worker.failed is not None:
            raise RuntimeError(f"PowerSGD stopped after an earlier bucket failed: {state._worker.failed!r}")
        state._worker = Worker("ddpopt-powersgd")
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state._worker.submit(lambda: _forward(sync, state, bucket, future))
    return future


def _forward(
    sync: Callable[[PowerSGDState, dist.GradBucket], torch.futures.Future[torch.Tensor]],
    state: PowerSGDState,
    bucket: dist.GradBucket,
    future: torch.futures.Future[torch.Tensor],
) -> None:
    """Run ``sync`` for the bucket and complete ``future`` with its result (or its error) once that is done.

    After a failure the worker runs nothing more: each later bucket fails at once, without a collective (this rank
    would issue them out of step with the others), and buckets waiting for a regrouped round fail too.
    """
    worker = state._worker
    if worker is not None and worker.failed is not None:
        future.set_exception(RuntimeError(f"PowerSGD stopped after an earlier bucket failed: {worker.failed!r}"))  # type: ignore[arg-type]
        return

    def complete(done: torch.futures.Future[torch.Tensor]) -> None:
        try:
            future.set_result(done.value())
        except Exception as error:  # DDP waits on the future: never leave it pending
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result

    try:
        inner = sync(state, bucket)
    except Exception as error:
        if worker is not None:
            worker.failed = error
        future.set_exception(error)  # type: ignore[arg-type]
        regroup, state._regroup = state._regroup, None
        for _, pending, _ in regroup.waiting if regroup is not None else ():
            if not pending.done():
                pending.set_exception(error)  # type: ignore[arg-type]
        return
    # Not waited for here: a regrouped bucket completes when later buckets (behind it in this queue) have run.
    inner.add_done_callback(complete)


def _sync_bucket(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's whole chain, here and now; the returned future is complete (or completes with later buckets)."""
    start = time.perf_counter()
    buffer = bucket.buffer()
    if state.iteration < state.config.start_iter:
        allreduce_mean_inplace(state, bucket, buffer)
        future = completed(buffer)
    else:
        if bucket.index() == 0:
            state.adapt_rank()
        future = _compress_and_allreduce(state, bucket, buffer)
    if bucket.is_last():
        state.send_probe()
        state._close_round()
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


def _compress_and_allreduce(
    state: PowerSGDState, bucket: dist.GradBucket, buffer: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    config = state.config
    round_ = state._open_round()
    names = state.names_in(bucket)
    gradients = bucket.gradients()
    if config.batched:
        fed_back = None
        if config.error_feedback:  # per parameter, before the bucket becomes one matrix
            fed_back = state.add_error_feedback(round_, names, gradients)
        if state._regroup is not None:
            return _regrouped_batched(state, round_, bucket, buffer, names, gradients)
        # The gradients are views into the bucket's buffer: compress it as it lies.
        _compress_as_square(state, round_, bucket, buffer, names, gradients, in_place=True, fed_back=fed_back)
        return completed(buffer)
    compress_listed(state, round_, bucket, names, gradients)
    return completed(buffer)


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
        if matrix is not None and config.compresses(matrix.shape[0], matrix.shape[1], state.rank):
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
    state: PowerSGDState, round_: SyncRound, bucket: dist.GradBucket, names: list[str], tensors: list[torch.Tensor]
) -> None:
    """Mean-allreduce ``tensors`` uncompressed (one flat collective) and note whether the result is finite."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    allreduce_mean_inplace(state, bucket, flat)
    round_.check([flat])
    round_.sent_exactly.update(names)
    write_back(flat, tensors)


def write_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive slices into ``tensors`` (the tensors it was concatenated from).

    Args:
        flat: the values, end to end.
        tensors: where they go, in order.
    """
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


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
    loose = [(name, gradient) for name, gradient in zip(names, gradients, strict=True) if name not in regroup.group_of]
    if loose:  # in buckets that were sent uncompressed before the checkpoint: exact, whatever the grouping
        _allreduce_exact(state, round_, bucket, [name for name, _ in loose], [gradient for _, gradient in loose])
    grouped = {name for name in names if name in regroup.group_of}
    regroup.arrived.update((name, g) for name, g in zip(names, gradients, strict=True) if name in grouped)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=_devices(buffer))
    regroup.waiting.append((grouped, future, buffer))
    last = bucket.is_last()
    for index, group in enumerate(regroup.groups):
        arrived = [name for name in group if name in regroup.arrived]
        if index in regroup.done or not (len(arrived) == len(group) or (last and arrived)):
            continue
        regroup.done.add(index)
        group_gradients = [regroup.arrived.pop(name) for name in arrived]
        flat = torch.cat([g.reshape(-1) for g in group_gradients])
        _compress_as_square(state, round_, bucket, flat, arrived, group_gradients, in_place=False)
    finished = {name for index in regroup.done for name in regroup.groups[index]}
    still_waiting = []
    for pending_names, pending, pending_buffer in regroup.waiting:
        if pending_names <= finished:
            pending.set_result(pending_buffer)
        else:
            still_waiting.append((pending_names, pending, pending_buffer))
    regroup.waiting = still_waiting
    assert not (last and still_waiting), "every gradient has arrived by the last bucket"
    return future


def _compress_as_square(
    state: PowerSGDState,
    round_: SyncRound,
    bucket: dist.GradBucket,
    flat: torch.Tensor,
    names: list[str],
    gradients: list[torch.Tensor],
    in_place: bool,
    fed_back: torch.Tensor | None = None,
) -> None:
    """Compress ``flat`` (the ``gradients`` of ``names`` end to end) as one zero-padded square matrix.

    Small ones are all-reduced exactly. ``in_place``: the gradients are views into ``flat`` (the bucket's buffer);
    otherwise ``flat`` is a copy and the result is written back into them. ``fed_back``: the squared norm of the
    error feedback added to the gradients, for the ledger.
    """
    numel = flat.numel()
    side = _square_side(numel)
    if not state.config.compresses(side, side, state.rank):
        allreduce_mean_inplace(state, bucket, flat)
        round_.check([flat])
        round_.sent_exactly.update(names)
    else:
        square = flat if side * side == numel else torch.cat([flat, flat.new_zeros(side * side - numel)])
        matrix, key = square.view(side, side), "|".join(names)
        if fed_back is None and state.config.error_feedback:  # added elsewhere (a regrouped round): not known here
            fed_back = torch.full((), math.nan, dtype=torch.float64, device=matrix.device)
        (error,) = low_rank_allreduce(state, round_, bucket, [matrix], [key], add_feedback=False, fed_back=fed_back)
        if square is not flat:
            flat.copy_(square[:numel])
        _stage_batched_errors(state, round_, error, names, [g.shape for g in gradients])
    if not in_place:
        write_back(flat, gradients)


def _stage_batched_errors(
    state: PowerSGDState, round_: SyncRound, error: torch.Tensor, names: list[str], shapes: list[torch.Size]
) -> None:
    """Split a batched matrix's error into per-parameter views (the parameters lie in it in ``names`` order)."""
    if not state.config.error_feedback:
        return
    flat_error, offset = error.reshape(-1), 0
    for name, shape in zip(names, shapes, strict=True):
        size = math.prod(shape)
        round_.errors[name] = flat_error[offset : offset + size].view(shape)
        offset += size


def _square_side(numel: int) -> int:
    return math.isqrt(numel - 1) + 1 if numel > 1 else 1
