"""Plain and cast-compressed allreduce hooks (fp32, fp16, bf16) with torch's comm-hook signature.

No ``from __future__ import annotations`` here: DDP compares the hooks' annotations with the real types.
"""

import math

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.base import CommHookState, squared_norm

__all__ = [
    "FP16_MAX",
    "FP16_WARN_FROM_RANKS",
    "allreduce_mean_hook",
    "bf16_allreduce_hook",
    "flat_fp16_note",
    "fp16_allreduce_hook",
    "fp16_scale",
    "peak",
]

#: fp16's largest finite value.
FP16_MAX = 65504.0
#: fp16's smallest positive (subnormal) value: half of it and less round to zero.
FP16_TINY = 2.0**-24
#: fp16's smallest normal value: below it values keep fewer significant bits.
FP16_SMALLEST_NORMAL = 2.0**-14
#: From this many ranks the flat fp16 hook warns at setup that dividing before the cast loses small gradients.
FP16_WARN_FROM_RANKS = 64


def flat_fp16_note(world_size: int, chosen_by_auto: bool = False) -> str | None:
    """The setup warning of the flat fp16 hook on ``world_size`` ranks (from :data:`FP16_WARN_FROM_RANKS`), else None.

    Args:
        world_size: the ranks the hook averages over.
        chosen_by_auto: ``comm_hook="auto"`` chose fp16 (the message says so).
    """
    if world_size < FP16_WARN_FROM_RANKS:
        return None
    hook = "comm_hook='auto' chose 'fp16', which" if chosen_by_auto else "comm_hook='fp16'"
    return (
        f"ddpopt: {hook} syncs flat over {world_size} ranks and divides each gradient by {world_size} before fp16 "
        f"sums it (torch's hook divides after the cast, alike): gradients under about "
        f"{FP16_SMALLEST_NORMAL * world_size:.0e} lose precision and under about {FP16_TINY / 2 * world_size:.0e} "
        "cross as zero. bf16 keeps fp32's range; on several nodes of several ranks the two-tier fp16 agrees on a "
        "scale instead (hierarchical=True)"
    )


def peak(values: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-dim fp32 tensor, without materialising ``|x|``; NaN and inf propagate."""
    return torch.maximum(values.amax(), values.amin().neg()).float()


def fp16_scale(peak: torch.Tensor, summands: int) -> torch.Tensor:
    """The power of two that lifts ``summands`` values of magnitude up to ``peak`` as far as fp16's sum allows.

    ``peak`` is the largest magnitude over every rank that sums (the same 0-dim fp32 tensor on each): scaled values
    then sum to at most half of :data:`FP16_MAX` (the half: a cast may round a value up), so the fp16 sum cannot
    overflow, and values down to ``2^-25`` of the peak stay normal whatever the world size (dividing by the world
    size around the cast, as the flat hook and torch's do, makes every value under ``6e-5 x world size`` subnormal
    and every value under ``3e-8 x world size`` zero). Powers of two
    scale exactly. The exponent stays within +-100 (a zero peak gives ``2^100``, an infinite one ``2^-100``: the inf
    stays, and the step is skipped as it would be); a NaN peak gives 1. No host sync: everything stays on the device.
    """
    exponent = torch.floor(math.log2(FP16_MAX / summands / 2) - torch.log2(peak))
    return torch.exp2(torch.nan_to_num(exponent, nan=0.0).clamp(-100.0, 100.0))


def allreduce_mean_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group in its own dtype: DDP's built-in behaviour, with bytes recorded.

    Args:
        state: the hook's state: a :class:`CommHookState` (the strategy's ``comm_state``).
        bucket: the gradient bucket DDP hands the hook.
    """
    return _allreduce_mean(state, bucket, dtype=None)


def fp16_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16: half the bytes of fp32.

    The gradients are divided by the world size *before* the cast and the sum, so the sum of ``world_size``
    fp16 values cannot overflow where the mean would not. Gradients beyond fp16's range (65504) still do.

    Args:
        state: the hook's state: a :class:`CommHookState` (the strategy's ``comm_state``).
        bucket: the gradient bucket DDP hands the hook.
    """
    return _allreduce_mean(state, bucket, dtype=torch.float16)


def bf16_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes of fp32 with fp32's range, 8 bits of mantissa.

    Unlike torch's ``bf16_compress_hook``, which DDP refuses by name on CPU-only builds, this runs on gloo too.

    Args:
        state: the hook's state: a :class:`CommHookState` (the strategy's ``comm_state``).
        bucket: the gradient bucket DDP hands the hook.
    """
    return _allreduce_mean(state, bucket, dtype=torch.bfloat16)


def _allreduce_mean(
    state: CommHookState, bucket: dist.GradBucket, dtype: torch.dtype | None
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    # The bucket is overwritten with the result, so dividing it in place costs no copy.
    buffer.div_(state.world_size)
    send = buffer if dtype is None or dtype == buffer.dtype else buffer.to(dtype)
    state.record_wire_bytes(bucket, send.numel() * send.element_size())
    if send is not buffer and state.measuring:
        state.record_compression(bucket, squared_norm(buffer), squared_norm(buffer - send.to(buffer.dtype)))
    work = dist.all_reduce(send, group=state.process_group, async_op=True)
    assert work is not None

    def decompress(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result = future.value()[0]
        if result is not buffer:
            buffer.copy_(result)
        return buffer

    return work.get_future().then(decompress)
