"""PowerSGD (Vogels et al., 2019) that is correct on gloo and NCCL with any number of buckets, with state to save.

No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real types.

torch's ``powerSGD_hook`` chains each bucket's P and Q allreduces through future callbacks, which on gloo run on
whichever thread completes first, so different ranks issue the collectives of different buckets in different
orders and gloo aborts ("Received data size doesn't match expected size"). Here every collective of a bucket is
issued and waited for inside the hook, so all ranks issue them in DDP's bucket order. On NCCL a wait only orders
the CUDA stream, so the host does not block; on gloo the hook blocks the backward thread while it communicates.

The random projections are drawn from generators seeded by ``(seed, step, parameter name)``, the same on every
rank and reproducible after a resume without saving any RNG state.
"""

import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from lightning_ddpopt._validate import require_int
from lightning_ddpopt.hooks.base import CommHookState

__all__ = ["PowerSGDConfig", "PowerSGDState", "powersgd_hook"]

MatrixDtype = Literal["fp32", "fp16", "bf16"]
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class PowerSGDConfig:
    """How PowerSGD compresses.

    Args:
        rank: the rank of the low-rank approximation; an m x n gradient sends (m + n) x rank elements.
        start_iter: synchronised optimizer steps of plain allreduce before compression starts. It counts sync
            rounds, i.e. optimizer steps, not micro-batches (accumulation skips the syncs in between). With error
            feedback or warm start it must be at least 2: DDP rebuilds its buckets after the first step.
        min_compression_rate: compress a matrix only if ``m * n >= (m + n) * rank * min_compression_rate``;
            others are all-reduced uncompressed, together with biases and other 1-D tensors.
        error_feedback: keep each rank's compression error and add it to the next step's gradient.
        warm_start: start each step's power iteration from the last step's Q instead of a fresh random one.
        batched: treat each whole bucket as one square matrix (fewer, larger matmuls; usually less accurate).
        matrix_dtype: the dtype in which P and Q are sent: "fp32", or "fp16"/"bf16" for half the bytes.
        orthogonalization_epsilon: added to column norms when orthogonalising (0 uses a QR decomposition).
        seed: seeds the random projections, identically on every rank.
    """

    rank: int = 4
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
        require_int("PowerSGDConfig start_iter", self.start_iter, 0)
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(
                f"PowerSGDConfig start_iter={self.start_iter} must be at least 2 with error_feedback or warm_start: "
                "DDP rebuilds its buckets after the first step, which would invalidate the per-bucket state"
            )
        if not isinstance(self.min_compression_rate, int | float) or self.min_compression_rate < 1:
            raise ValueError(f"PowerSGDConfig min_compression_rate={self.min_compression_rate!r} must be >= 1")
        if self.matrix_dtype not in _DTYPES:
            raise ValueError(
                f"PowerSGDConfig matrix_dtype={self.matrix_dtype!r} is not valid; choose one of {sorted(_DTYPES)}"
            )
        if not isinstance(self.orthogonalization_epsilon, int | float) or self.orthogonalization_epsilon < 0:
            raise ValueError(
                f"PowerSGDConfig orthogonalization_epsilon={self.orthogonalization_epsilon!r} must be >= 0"
            )


@dataclass(kw_only=True)
class PowerSGDState(CommHookState):
    """PowerSGD's per-rank state: the step counter, error feedback and warm-start memories.

    ``iteration`` advances once per sync round, on the last bucket. Error feedback (kept for compressed matrices
    only: uncompressed tensors are exact) and Q memories are keyed by
    parameter name, not by bucket, so they survive DDP's bucket rebuild after the first step and a resume (where
    DDP starts again from its initial layout). Error feedback differs per rank; Q memories are the same on every
    rank (they are all-reduced). Call :meth:`bind_module` with the wrapped module before the first step.
    """

    config: PowerSGDConfig = field(default_factory=PowerSGDConfig)
    iteration: int = 0
    errors: dict[str, torch.Tensor] = field(default_factory=dict)
    q_memories: dict[str, torch.Tensor] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict, repr=False)

    def bind_module(self, module: torch.nn.Module) -> None:
        """Learn the parameter names that key the per-parameter state (``module`` is the one DDP wraps)."""
        self._names = {id(param): name for name, param in module.named_parameters()}

    def names_in(self, bucket: dist.GradBucket) -> list[str]:
        """The names of the bucket's parameters, in the order of ``bucket.gradients()``."""
        if not self._names:
            raise RuntimeError("PowerSGDState.bind_module(module) must be called before the first step")
        return [self._names[id(param)] for param in bucket.parameters()]

    def state_dict(self) -> dict[str, object]:
        """Iteration, error feedback and Q memories (tensors on the CPU) plus the config they belong to."""
        return {
            "config": asdict(self.config),
            "iteration": self.iteration,
            "errors": {name: error.detach().cpu().clone() for name, error in self.errors.items()},
            "q_memories": {key: q.detach().cpu().clone() for key, q in self.q_memories.items()},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output; tensors move to the gradients' device on first use."""
        saved_config = state.get("config")
        if saved_config != asdict(self.config):
            raise ValueError(f"saved PowerSGD state has config {saved_config}, this run uses {asdict(self.config)}")
        iteration, errors, q_memories = state["iteration"], state["errors"], state["q_memories"]
        assert isinstance(iteration, int) and isinstance(errors, dict) and isinstance(q_memories, dict)
        self.iteration = iteration
        self.errors = dict(errors)
        self.q_memories = dict(q_memories)


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the bucket to rank-``r`` factors P and Q, all-reduce them, and decompress; see the module doc.

    Before ``start_iter`` it is a plain mean allreduce, bit-for-bit equal to the ``allreduce`` hook.
    """
    buffer = bucket.buffer()
    if state.iteration < state.config.start_iter:
        _allreduce_mean_inplace(state, bucket, buffer)
    else:
        _compress_and_allreduce(state, bucket, buffer)
    if bucket.is_last():
        state.iteration += 1
    # On CUDA the future must know its device: it then records an event on the current stream, and whoever waits
    # on it (DDP, the ledger's timing callback) is ordered after the kernels above, not merely after their launch.
    devices: list[int | str | torch.device] | None = [buffer.device] if buffer.is_cuda else None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    future.set_result(buffer)
    return future


def _allreduce_mean_inplace(state: PowerSGDState, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
    tensor.div_(state.world_size)
    state.record_wire_bytes(bucket, tensor.numel() * tensor.element_size())
    _wait(dist.all_reduce(tensor, group=state.process_group, async_op=True))


def _compress_and_allreduce(state: PowerSGDState, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
    config = state.config
    names = state.names_in(bucket)
    gradients = bucket.gradients()
    if config.error_feedback:
        for name, gradient in zip(names, gradients, strict=True):
            error = state.errors.get(name)
            if error is not None and error.shape == gradient.shape:
                gradient.add_(error.to(gradient.device))

    if config.batched:
        _batched_allreduce(state, bucket, buffer, names, gradients)
        return
    matrices, keys, others = [], [], []
    for name, gradient in zip(names, gradients, strict=True):
        matrix = gradient.view(gradient.shape[0], -1) if gradient.dim() > 1 else None
        if matrix is not None and _worth_compressing(matrix.shape[0], matrix.shape[1], config):
            matrices.append(matrix)
            keys.append(name)
        else:
            others.append(gradient)
    if others:
        flat = torch.cat([t.reshape(-1) for t in others])
        _allreduce_mean_inplace(state, bucket, flat)
        offset = 0
        for tensor in others:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    if matrices:
        errors = _low_rank_allreduce(state, bucket, matrices, keys)
        if config.error_feedback:
            state.errors.update(zip(keys, errors, strict=True))


def _batched_allreduce(
    state: PowerSGDState,
    bucket: dist.GradBucket,
    buffer: torch.Tensor,
    names: list[str],
    gradients: list[torch.Tensor],
) -> None:
    """Compress the whole bucket as one square matrix, zero-padded to ``side x side``."""
    numel = buffer.numel()
    side = math.isqrt(numel - 1) + 1 if numel > 1 else 1
    if not _worth_compressing(side, side, state.config):
        _allreduce_mean_inplace(state, bucket, buffer)
        return
    square = buffer if side * side == numel else torch.cat([buffer, buffer.new_zeros(side * side - numel)])
    (error,) = _low_rank_allreduce(state, bucket, [square.view(side, side)], ["|".join(names)])
    if square is not buffer:
        buffer.copy_(square[:numel])
    if state.config.error_feedback:
        flat_error = error.reshape(-1)
        for name, gradient in zip(names, gradients, strict=True):
            offset = (gradient.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            state.errors[name] = flat_error[offset : offset + gradient.numel()].view_as(gradient)


def _worth_compressing(rows: int, cols: int, config: PowerSGDConfig) -> bool:
    rank = min(rows, cols, config.rank)
    return rows * cols >= (rows + cols) * rank * config.min_compression_rate


def _low_rank_allreduce(
    state: PowerSGDState, bucket: dist.GradBucket, matrices: list[torch.Tensor], keys: list[str]
) -> list[torch.Tensor]:
    """Replace each matrix M with the rank-r approximation P Q^T of its mean over ranks.

    Returns this rank's compression errors ``M - P P^T M`` (Vogels et al., Algorithm 2: the local matrix minus its
    projection with the local Q), empty when error feedback is off.
    """
    config = state.config
    wire_dtype = _DTYPES[config.matrix_dtype]
    qs = []
    for matrix, key in zip(matrices, keys, strict=True):
        shape = (matrix.shape[1], min(*matrix.shape, config.rank))
        q = state.q_memories.get(key) if config.warm_start else None
        if q is None or q.shape != shape:
            seed = (config.seed * 1_000_003 + state.iteration) * 2**32 + zlib.crc32(key.encode())
            q = torch.randn(shape, generator=torch.Generator().manual_seed(seed % 2**63))
            _orthogonalize(q, config.orthogonalization_epsilon)
        qs.append(q.to(matrix))

    # P = M Q, all-reduced (the scale is irrelevant: P is orthogonalised next).
    ps = _allreduce_matrices(state, bucket, [m @ q for m, q in zip(matrices, qs, strict=True)], wire_dtype)
    for p in ps:
        _orthogonalize(p, config.orthogonalization_epsilon)
    # Q = M^T P averaged over ranks, so that M ~ P Q^T.
    # (P^T M)^T rather than M^T P: BLAS is several times faster with the large matrix untransposed.
    local_qs = [(p.t() @ m).t() for m, p in zip(matrices, ps, strict=True)]
    errors = []
    if config.error_feedback:
        errors = [torch.addmm(m, p, q.t(), alpha=-1) for m, p, q in zip(matrices, ps, local_qs, strict=True)]
    qs = _allreduce_matrices(state, bucket, [q.div_(state.world_size) for q in local_qs], wire_dtype)
    for m, p, q in zip(matrices, ps, qs, strict=True):
        torch.matmul(p, q.t(), out=m)
    if config.warm_start:
        state.q_memories.update(zip(keys, qs, strict=True))
    return errors


def _allreduce_matrices(
    state: PowerSGDState, bucket: dist.GradBucket, matrices: list[torch.Tensor], wire_dtype: torch.dtype
) -> list[torch.Tensor]:
    flat = torch.cat([m.reshape(-1) for m in matrices]).to(wire_dtype)
    state.record_wire_bytes(bucket, flat.numel() * flat.element_size())
    _wait(dist.all_reduce(flat, group=state.process_group, async_op=True))
    flat = flat.to(matrices[0].dtype)
    out, offset = [], 0
    for m in matrices:
        out.append(flat[offset : offset + m.numel()].view_as(m))
        offset += m.numel()
    return out


def _orthogonalize(matrix: torch.Tensor, epsilon: float) -> None:
    """Make the columns of ``matrix`` orthonormal, in place, computing in fp32."""
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


def _wait(work: dist.Work | None) -> None:
    assert work is not None
    work.wait()
