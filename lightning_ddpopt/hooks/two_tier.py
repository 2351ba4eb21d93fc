"""A registry hook's two-tier (hierarchical) form, declared on its :class:`~.registry.HookSpec`, and the built-in ones.

The strategy syncs in two tiers (inside each node, then between the nodes) with a hook whose registry entry declares a
:class:`TwoTierForm`; ``hierarchical=True`` is refused for any other, and ``hierarchical="auto"`` keeps it flat.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.base import CommHookState
from lightning_ddpopt.hooks.hierarchical import HierarchicalState, hierarchical_hook
from lightning_ddpopt.hooks.hierarchical_int8 import HierarchicalInt8State, hierarchical_int8_hook
from lightning_ddpopt.hooks.hierarchical_powersgd import HierarchicalPowerSGDState, hierarchical_powersgd_hook
from lightning_ddpopt.hooks.int8 import Int8State
from lightning_ddpopt.hooks.powersgd import CPUKernels, PowerSGDState, local_cpu_kernels
from lightning_ddpopt.ledger import CommHook, CommLedger
from lightning_ddpopt.topology import TierGroups

__all__ = ["MakeTwoTierState", "TwoTierForm", "agreed_cpu_kernels", "cast_form", "int8_form", "powersgd_form"]


class MakeTwoTierState(Protocol):
    """What builds a two-tier hook's state, from the flat hook's state (its config) and the tiers' groups."""

    def __call__(
        self,
        *,
        flat: CommHookState,
        tiers: TierGroups,
        process_group: dist.ProcessGroup,
        ledger: CommLedger,
        device: torch.device,
    ) -> CommHookState:
        """The two-tier state; the strategy then sets its ``loss_scale`` and calls its ``bind_module``.

        Args:
            flat: the state the registry entry's ``make_state`` built (its config applies to both forms).
            tiers: the intra- and cross-node groups.
            process_group: DDP's group (every rank).
            ledger: where the hook reports its bytes.
            device: the gradients' device.
        """
        ...


@dataclass(frozen=True)
class TwoTierForm:
    """A registry hook's two-tier form: the hook and state that replace the flat ones on several nodes.

    Attributes:
        hook: the two-tier hook, torch's ``(state, bucket) -> Future[Tensor]`` signature.
        make_state: builds its state (see :class:`MakeTwoTierState`).
        crossing: what crosses the nodes, in words, for the setup log line ("int8 blocks").
        flat_when_auto: why ``hierarchical="auto"`` keeps the flat sync with this hook (``hierarchical=True`` uses
            the form anyway); ``None``: ``"auto"`` uses it.
    """

    hook: CommHook
    make_state: MakeTwoTierState
    crossing: str
    flat_when_auto: str | None = None


def _cast_state(
    dtype: torch.dtype | None,
    *,
    tiers: TierGroups,
    process_group: dist.ProcessGroup,
    ledger: CommLedger,
    **_: object,
) -> CommHookState:
    return HierarchicalState(tiers=tiers, dtype=dtype, process_group=process_group, ledger=ledger)


def cast_form(dtype: torch.dtype | None) -> TwoTierForm:
    """The casts' two-tier form (:mod:`~lightning_ddpopt.hooks.hierarchical`): the shard crosses nodes in ``dtype``.

    Args:
        dtype: what crosses the nodes (``None``: the bucket's own dtype).
    """
    crossing = "the bucket's precision" if dtype is None else {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return TwoTierForm(hierarchical_hook, functools.partial(_cast_state, dtype), crossing)


def _int8_state(
    *, flat: CommHookState, tiers: TierGroups, process_group: dist.ProcessGroup, ledger: CommLedger, **_: object
) -> CommHookState:
    assert isinstance(flat, Int8State)
    return HierarchicalInt8State(config=flat.config, tiers=tiers, process_group=process_group, ledger=ledger)


def int8_form() -> TwoTierForm:
    """int8's two-tier form (:mod:`~lightning_ddpopt.hooks.hierarchical_int8`), with the flat state's config."""
    return TwoTierForm(hierarchical_int8_hook, _int8_state, "int8 blocks")


def _powersgd_state(
    *,
    flat: CommHookState,
    tiers: TierGroups,
    process_group: dist.ProcessGroup,
    ledger: CommLedger,
    device: torch.device,
) -> CommHookState:
    assert isinstance(flat, PowerSGDState)
    on_cpu = device.type == "cpu"
    return HierarchicalPowerSGDState(
        config=flat.config,
        tiers=tiers,
        ledger=ledger,
        pipelined=on_cpu,  # its chains on a worker thread: the tiers' groups serve no other thread
        cpu_kernels=agreed_cpu_kernels(process_group) if on_cpu else None,
    )


def powersgd_form(matrix_dtype: str) -> TwoTierForm:
    """PowerSGD's two-tier form (:mod:`~lightning_ddpopt.hooks.hierarchical_powersgd`), with the flat state's config.

    Args:
        matrix_dtype: the dtype P and Q are sent in, for the setup log line.
    """
    return TwoTierForm(
        hierarchical_powersgd_hook,
        _powersgd_state,
        f"PowerSGD's {matrix_dtype} factors",
        flat_when_auto=(
            "PowerSGD sends only its factors between the ranks; its two-tier form moves each node's fp32 gradients "
            "inside the node to split the compression work, which over gloo costs more than it saves "
            "(hierarchical=True uses it)"
        ),
    )


def agreed_cpu_kernels(process_group: dist.ProcessGroup) -> CPUKernels:
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
