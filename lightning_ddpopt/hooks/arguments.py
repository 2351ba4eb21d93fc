"""The strategy's comm-hook arguments checked at construction, and which registry hooks have a two-tier form."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from lightning_ddpopt.hooks.auto import AUTO_HOOK, AutoConfig
from lightning_ddpopt.hooks.int8 import Int8Config
from lightning_ddpopt.hooks.powersgd_config import PowerSGDConfig
from lightning_ddpopt.hooks.registry import HookSpec, get_hook_spec, int8_spec, powersgd_spec, validate_hook_callable

__all__ = ["DEFAULT_COMM_HOOK", "HIERARCHICAL_HOOKS", "validate_comm_hook", "validate_hierarchical"]

DEFAULT_COMM_HOOK = "allreduce"
#: The registry hooks with a two-tier form: :mod:`lightning_ddpopt.hooks.hierarchical`'s (the dtype each casts to
#: between nodes: ``_CAST`` in :mod:`lightning_ddpopt.hooks.install`), :mod:`lightning_ddpopt.hooks.hierarchical_int8`'s
#: and :mod:`lightning_ddpopt.hooks.hierarchical_powersgd`'s.
HIERARCHICAL_HOOKS = ("allreduce", "fp16", "bf16", "int8", "powersgd", "powersgd_fp16", "powersgd_bf16")


def validate_hierarchical(
    hierarchical: object, comm_hook: object, spec: HookSpec | None, ddp_comm_hook: Callable | None = None
) -> bool | Literal["auto"]:
    """Check ``hierarchical`` at construction: ``True``, ``False`` or ``"auto"``.

    ``True`` needs a registry hook with a two-tier form (batched PowerSGD has none), or ``"auto"``.
    """
    if hierarchical is not True and hierarchical is not False and hierarchical != "auto":
        raise ValueError(f"hierarchical={hierarchical!r} must be True, False or 'auto'")
    if hierarchical is not True:
        return "auto" if hierarchical == "auto" else False
    forms = ", ".join(map(repr, HIERARCHICAL_HOOKS))
    if ddp_comm_hook is not None:
        raise ValueError(
            f"hierarchical=True applies to the registry hooks with a two-tier form ({forms}), not to "
            f"ddp_comm_hook={ddp_comm_hook!r}, which syncs as it is written"
        )
    if isinstance(comm_hook, AutoConfig) or (isinstance(comm_hook, str) and comm_hook == AUTO_HOOK):
        return True  # every hook "auto" may choose has a two-tier form
    if spec is None or spec.name not in HIERARCHICAL_HOOKS:
        raise ValueError(
            f"hierarchical=True needs a comm_hook with a hierarchical form ({forms}, or 'auto'), "
            f"not comm_hook={comm_hook!r}"
        )
    if isinstance(comm_hook, PowerSGDConfig) and comm_hook.batched:
        raise ValueError(
            f"hierarchical=True with comm_hook={comm_hook!r}: batched PowerSGD makes one matrix of a whole bucket, "
            "which has no two-tier form; pass batched=False or hierarchical='auto'"
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
