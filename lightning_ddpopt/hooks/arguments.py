"""The strategy's comm-hook arguments checked at construction, alone and against local SGD."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from lightning_ddpopt.hooks.auto import AUTO_HOOK, AutoConfig
from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig
from lightning_ddpopt.hooks.registry import (
    HookSpec,
    get_hook_spec,
    hierarchical_hooks,
    int8_spec,
    powersgd_spec,
    validate_hook_callable,
)
from lightning_ddpopt.localsgd.config import LocalSGDConfig

__all__ = ["DEFAULT_COMM_HOOK", "validate_comm_hook", "validate_hierarchical", "validate_local_sgd"]

DEFAULT_COMM_HOOK = "allreduce"


def validate_hierarchical(
    hierarchical: object, comm_hook: object, spec: HookSpec | None, ddp_comm_hook: Callable | None = None
) -> bool | Literal["auto"]:
    """Check ``hierarchical`` at construction: ``True``, ``False`` or ``"auto"``.

    ``True`` needs a registry hook with a two-tier form (``HookSpec.two_tier``; batched PowerSGD has none), or
    ``"auto"``.
    """
    if hierarchical is not True and hierarchical is not False and hierarchical != "auto":
        raise ValueError(f"hierarchical={hierarchical!r} must be True, False or 'auto'")
    if hierarchical is not True:
        return "auto" if hierarchical == "auto" else False
    forms = ", ".join(map(repr, hierarchical_hooks()))
    if ddp_comm_hook is not None:
        raise ValueError(
            f"hierarchical=True applies to the registry hooks with a two-tier form ({forms}), not to "
            f"ddp_comm_hook={ddp_comm_hook!r}, which syncs as it is written"
        )
    if isinstance(comm_hook, AutoConfig) or (isinstance(comm_hook, str) and comm_hook == AUTO_HOOK):
        return True  # every hook "auto" may choose has a two-tier form
    if isinstance(comm_hook, PowerSGDConfig) and comm_hook.batched:
        raise ValueError(
            f"hierarchical=True with comm_hook={comm_hook!r}: batched PowerSGD makes one matrix of a whole bucket, "
            "which has no two-tier form; pass batched=False or hierarchical='auto'"
        )
    if spec is None or spec.two_tier is None:
        raise ValueError(
            f"hierarchical=True needs a comm_hook with a hierarchical form ({forms}, or 'auto'), "
            f"not comm_hook={comm_hook!r}"
        )
    return True


def validate_comm_hook(
    comm_hook: object, comm_state: object, ddp_comm_hook: Callable | None
) -> tuple[HookSpec | None, Callable | None]:
    """Check ``comm_hook`` at construction; return its registry entry or the callable."""
    if ddp_comm_hook is not None and comm_hook not in (None, DEFAULT_COMM_HOOK):
        raise ValueError(
            f"comm_hook={comm_hook!r} and ddp_comm_hook={ddp_comm_hook!r} both given; pass one of them "
            "(comm_hook takes a registry name or a callable)"
        )
    if isinstance(comm_hook, AutoConfig):
        if comm_state is not None:
            raise ValueError(f"comm_state={comm_state!r} is only used with a callable comm_hook, not with AutoConfig")
        return None, None
    if isinstance(comm_hook, PowerSGDConfig):
        return powersgd_spec(comm_hook), None
    if isinstance(comm_hook, Int8Config):
        return int8_spec(comm_hook), None
    if isinstance(comm_hook, str):
        if comm_state is not None:
            raise ValueError(
                f"comm_state={comm_state!r} is only used with a callable comm_hook; registry hooks such as "
                f"{comm_hook!r} build their own state"
            )
        if ddp_comm_hook is not None or comm_hook == AUTO_HOOK:
            return None, None
        return get_hook_spec(comm_hook), None
    if comm_hook is None:
        if comm_state is not None:
            raise ValueError(f"comm_state={comm_state!r} given without a callable comm_hook to receive it")
        return None, None
    if not callable(comm_hook):
        raise TypeError(
            f"comm_hook={comm_hook!r} must be a registry name (str), a PowerSGDConfig, an Int8Config, an AutoConfig, "
            "a callable hook(state, bucket), or None"
        )
    validate_hook_callable(comm_hook)
    return None, comm_hook


def validate_local_sgd(
    local_sgd: object,
    *,
    comm_hook: object,
    default_hook: str,
    ddp_comm_hook: Callable | None,
    model_averaging_period: int | None,
) -> None:
    """Refuse local SGD settings that cannot apply together with the strategy's other arguments, at construction."""
    if local_sgd is None:
        return
    if not isinstance(local_sgd, LocalSGDConfig):
        raise TypeError(f"local_sgd={local_sgd!r} must be a LocalSGDConfig (e.g. LocalSGDConfig.diloco(16)) or None")
    if model_averaging_period is not None:
        raise ValueError(
            f"local_sgd and model_averaging_period={model_averaging_period} both given: they are two local SGD "
            "schemes; use local_sgd=LocalSGDConfig.post_local_sgd(...) for Lightning's post-local SGD"
        )
    if comm_hook == AUTO_HOOK or isinstance(comm_hook, AutoConfig):
        raise ValueError(
            "comm_hook='auto' with local_sgd: auto picks a gradient hook for every step, but with local SGD gradients "
            "sync only during the warm-up; name the warm-up's hook (e.g. comm_hook='fp16') or leave the default"
        )
    custom_hook = ddp_comm_hook is not None or comm_hook not in (None, default_hook)
    if custom_hook and local_sgd.warmup_steps == 0:
        hook = ddp_comm_hook if ddp_comm_hook is not None else comm_hook
        raise ValueError(
            f"comm_hook={hook!r} would never run: with local_sgd and warmup_steps=0 no gradient is ever "
            "synchronised. Set LocalSGDConfig(warmup_steps=N) to run it for the first N steps, or drop it; "
            f"the parameter syncs are compressed by LocalSGDConfig(compression=...) ({local_sgd.compression!r} now)"
        )
