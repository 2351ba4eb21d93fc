"""A top-k comm hook with error feedback in one file, as docs/guides/writing-a-comm-hook.md walks through it.

Each rank sends, for every parameter, the ``ratio`` of its gradient's values largest in magnitude, with their
indices, and keeps the rest as error feedback for its next step. ``register_comm_hook(topk_spec())`` makes it
``OptimizedDDPStrategy(comm_hook="topk")``.

No ``from __future__ import annotations`` here: DDP compares a hook's annotations with the real types.
"""

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks import ErrorFeedbackState, HookSpec, squared_norm

__all__ = ["TopKConfig", "TopKState", "topk_hook", "topk_spec"]


@dataclass(frozen=True)
class TopKConfig:
    """How much the top-k hook sends.

    Args:
        ratio: the share of each parameter's gradient values sent per step (at least one value per parameter).
    """

    ratio: float = 0.01

    def k(self, numel: int) -> int:
        """How many of a parameter's ``numel`` gradient values are sent."""
        return min(numel, max(1, math.ceil(numel * self.ratio)))

    def wire_bytes(self, sizes: list[int]) -> int:
        """The bytes a rank sends per step for gradients of these element counts: an fp32 value and an int32 index
        per value sent."""
        return sum(8 * self.k(size) for size in sizes)


@dataclass(kw_only=True)
class TopKState(ErrorFeedbackState):
    """The hook's per-rank state: its config, and the error feedback that the base class keeps, commits and saves."""

    label: ClassVar[str] = "topk"  # the hook's name in messages about its saved state
    config: TopKConfig = field(default_factory=TopKConfig)

    def config_dict(self) -> dict[str, object]:
        """The config as a checkpoint saves it; a resume with another config starts the error feedback afresh."""
        return asdict(self.config)


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group from every rank's largest values; see the module doc.

    Args:
        state: the hook's :class:`TopKState` (the strategy builds it from the registry entry).
        bucket: the gradient bucket DDP hands the hook.
    """
    round_ = state.open_round()  # this step's new errors, committed only if every value sent was finite
    names, gradients = state.names_in(bucket), bucket.gradients()
    fed_back_sq = state.add_error_feedback(round_, names, gradients)  # each gradient += its stored error
    given_sq = squared_norm(*gradients) if state.measuring else None
    values, indices, errors, offset = [], [], [], 0
    for name, gradient in zip(names, gradients, strict=True):
        flat = gradient.reshape(-1)
        # Chosen per parameter, so the result does not depend on how DDP grouped the parameters into buckets. A NaN
        # counts as the largest value: sent, it makes the step non-finite on every rank.
        magnitudes = flat.abs().nan_to_num_(nan=math.inf)
        chosen = magnitudes.topk(state.config.k(flat.numel()), sorted=False).indices
        values.append(flat[chosen])
        indices.append(chosen + offset)
        # What is not sent is this rank's error, added to the next step's gradient.
        error = state.error_buffer(round_, name, tuple(flat.shape), flat.dtype, flat.device)
        error.copy_(flat).index_fill_(0, chosen, 0.0)
        round_.errors[name] = error.view_as(gradient)
        errors.append(error)
        offset += flat.numel()
    if given_sq is not None:  # a measured round: the ledger's compression error
        state.record_compression(bucket, given_sq, squared_norm(*errors), fed_back_sq)
    # The values, then their indices (int32, their bits carried as fp32): one all-gather.
    sent = torch.cat([torch.cat(values).float(), torch.cat(indices).to(torch.int32).view(torch.float32)])
    state.record_wire_bytes(bucket, sent.numel() * sent.element_size())
    gathered = torch.empty(state.world_size * sent.numel(), dtype=sent.dtype, device=sent.device)
    work = dist.all_gather_into_tensor(gathered, sent, group=state.process_group, async_op=True)
    assert work is not None
    if bucket.is_last():
        state.close_round(seal_now=False)  # judged once DDP has every bucket back, before the next round
    buffer = bucket.buffer()

    def average(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        done.wait()
        rows = gathered.view(state.world_size, 2, -1)
        round_.check([rows[:, 0]])  # every rank's values: the same on every rank, and so is the verdict
        buffer.zero_()
        for row in rows:  # in rank order: the same sum, bit for bit, on every rank
            buffer.index_add_(0, row[1].view(torch.int32).long(), row[0].to(buffer.dtype))
        return buffer.div_(state.world_size)

    return work.get_future().then(average)


def topk_spec(config: TopKConfig | None = None, name: str = "topk") -> HookSpec:
    """The hook's registry entry: ``register_comm_hook(topk_spec())`` makes ``comm_hook="topk"``.

    Args:
        config: the hook's settings (``TopKConfig()`` if not given).
        name: the registry name, as ``comm_hook=`` takes it.
    """
    config = config or TopKConfig()
    return HookSpec(
        name=name,
        summary=f"top-k with error feedback: the largest {config.ratio:.0%} of each gradient and their indices",
        hook=topk_hook,
        make_state=functools.partial(TopKState, config=config),
    )
