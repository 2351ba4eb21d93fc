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
  ``where(finite, new, kept)`` (:meth:`~lightning_ddpopt.hooks.feedback.ErrorFeedbackState._commit`),
  on the side stream, after the round's own kernels. Until then both rounds' error feedback is held.
* **Error feedback is kept in the units of its loss scale.** Each stored error remembers the loss scale of the
  backward pass that produced it (``CommHookState.loss_scale``) and is rescaled to the current scale before it
  is added, so a GradScaler's growth or backoff does not inject it 2x too large or too small.

The terms used here (round, verdict, meeting, travel, island, ...) are defined in the design page's glossary.
"""

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks._worker import Worker
from lightning_ddpopt.hooks.feedback import SyncRound
from lightning_ddpopt.hooks.lowrank import low_rank_allreduce
from lightning_ddpopt.hooks.powersgd_state import PowerSGDState

__all__ = ["allreduce_mean_inplace", "completed", "compress_listed", "dispatch", "powersgd_hook", "write_back"]


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
            state.ranks.adapt(state.iteration)
        future = _compress_and_allreduce(state, bucket, buffer)
    if bucket.is_last():
        state.send_measurement()
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
    """One bucket of the first round after a resume: see :class:`~lightning_ddpopt.hooks.powersgd_state._Regroup`."""
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
    if not state.config.compresses(side, side, state.rank_of("|".join(names))):
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
