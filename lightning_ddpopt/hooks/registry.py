"""The comm-hook registry (name -> hook and state, the one list of valid names) and the checks of the hook arguments.

The strategy's ``comm_hook``, ``comm_state``, ``ddp_comm_hook`` and ``hierarchical`` are checked here at
construction, alone and against ``local_sgd``; every message lists the registry's names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from lightning_ddpopt.hooks.auto import AUTO_HOOK, AutoConfig
from lightning_ddpopt.hooks.base import CommHookState, TwoTierForm
from lightning_ddpopt.hooks.compression import allreduce_mean_hook, bf16_allreduce_hook, fp16_allreduce_hook
from lightning_ddpopt.hooks.hierarchical import cast_form
from lightning_ddpopt.hooks.hierarchical_int8 import int8_form
from lightning_ddpopt.hooks.hierarchical_powersgd import powersgd_form
from lightning_ddpopt.hooks.int8 import Int8Config, Int8State, int8_hook
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig, PowerSGDState, powersgd_hook
from lightning_ddpopt.hooks.powersgd_rank import ERROR_BOUNDS
from lightning_ddpopt.ledger import CommHook, CommLedger
from lightning_ddpopt.localsgd.config import LocalSGDConfig
from lightning_ddpopt.precision import native_bf16

__all__ = [
    "COMM_HOOKS",
    "DEFAULT_COMM_HOOK",
    "TESTED_BACKENDS",
    "WRITTEN_FOR_BACKENDS",
    "get_hook_spec",
    "hierarchical_hooks",
    "HookSpec",
    "int8_spec",
    "MakeState",
    "powersgd_spec",
    "register_comm_hook",
    "validate_comm_hook",
    "validate_hierarchical",
    "validate_hook_callable",
    "validate_local_sgd",
]

#: Backends on which every hook here has been run in tests (CI: gloo on CPUs, 2 and 3 processes).
TESTED_BACKENDS = ("gloo",)
#: Backends the hooks are written for but have not run on yet, with what that means.
WRITTEN_FOR_BACKENDS = {
    "nccl": (
        "the GPU paths are written to torch's CUDA stream semantics and covered by GPU tests (scripts/gpu_check.sh) "
        "that have not run on GPU hardware yet"
    )
}


def _any_backend(backend: str) -> str | None:
    return None


class MakeState(Protocol):
    """What builds a hook's state: called with the keywords ``process_group`` and ``ledger``.

    A state class of :class:`CommHookState`'s keywords is one (``functools.partial(MyState, config=...)`` too).
    """

    def __call__(self, *, process_group: dist.ProcessGroup | None, ledger: CommLedger | None) -> CommHookState:
        """The state a hook runs with.

        Args:
            process_group: the group the hook communicates on; ``None`` for the default group.
            ledger: where the hook reports its bytes; ``None`` records nothing.
        """
        ...


def _bf16_backend(backend: str) -> str | None:
    if backend == "nccl":
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else (0, 0, 0)
        if tuple(version) < (2, 10):
            return f"bf16 all-reduce needs NCCL >= 2.10, this build has NCCL {'.'.join(map(str, version))}"
        if not native_bf16(torch.device("cuda", torch.cuda.current_device())):
            return "this GPU has no native bfloat16 (it needs compute capability 8.0, A100 or later)"
    return None


@dataclass(frozen=True)
class HookSpec:
    """A registered comm hook.

    Attributes:
        name: the registry name users pass as ``comm_hook``.
        summary: one line for error messages and docs.
        hook: the hook function, torch's ``(state, bucket) -> Future[Tensor]`` signature.
        make_state: creates the state the hook runs with, called with the keywords ``process_group`` and
            ``ledger`` (a :class:`CommHookState` subclass itself, or a ``functools.partial`` of one, will do); one
            that takes other names is called with the two positionally, as before.
        unsupported_reason: given a process-group backend name, why the hook cannot run there, or ``None``.
        two_tier: the hook's two-tier form, which ``hierarchical=`` uses on several nodes; ``None``: it has none
            (the sync stays flat).
    """

    name: str
    summary: str
    hook: CommHook
    make_state: MakeState = CommHookState
    unsupported_reason: Callable[[str], str | None] = _any_backend
    two_tier: TwoTierForm | None = None

    def build(self, process_group: dist.ProcessGroup | None, ledger: CommLedger | None) -> CommHookState:
        """Create the state this hook runs with.

        Args:
            process_group: the group the hook communicates on; ``None`` for the default group.
            ledger: where the hook reports its bytes; ``None`` records nothing.
        """
        try:
            inspect.signature(self.make_state).bind(process_group=process_group, ledger=ledger)
        except TypeError:  # an earlier release's positional make_state(group, ledger)
            return self.make_state(process_group, ledger)  # type: ignore[call-arg]
        except ValueError:  # no signature to read
            pass
        return self.make_state(process_group=process_group, ledger=ledger)


def powersgd_spec(config: PowerSGDConfig, name: str = "powersgd") -> HookSpec:
    """A registry entry for PowerSGD with ``config``; pass a ``PowerSGDConfig`` as ``comm_hook`` to get one.

    Args:
        config: the PowerSGD settings.
        name: the entry's name in messages and the ledger.
    """
    dtype = "" if config.matrix_dtype == "fp32" else f", P/Q sent in {config.matrix_dtype}"
    rank = f"rank {config.rank}"
    if config.max_error == "auto":
        bounds = f"{ERROR_BOUNDS['adaptive']:g} with Adam-like optimizers, {ERROR_BOUNDS['other']:g} with others"
        rank += f" (raised up to {config.max_rank} while the error is above {bounds})"
    elif config.max_error is not None:
        rank += f" (raised up to {config.max_rank} while the error is above {config.max_error:g})"
    summary = f"{'batched ' if config.batched else ''}PowerSGD {rank} from step {config.start_iter}{dtype}"
    reason = _bf16_backend if config.matrix_dtype == "bf16" else _any_backend
    form = None if config.batched else powersgd_form(config.matrix_dtype)  # one matrix per bucket: no two tiers
    return HookSpec(name, summary, powersgd_hook, functools.partial(PowerSGDState, config=config), reason, form)


def int8_spec(config: Int8Config, name: str = "int8") -> HookSpec:
    """A registry entry for the int8 hook with ``config``; pass an ``Int8Config`` as ``comm_hook`` to get one.

    Args:
        config: the int8 settings.
        name: the entry's name in messages and the ledger.
    """
    feedback = "with" if config.error_feedback else "without"
    summary = f"block-wise int8 (blocks of {config.block_size}), {feedback} error feedback: a quarter of the bytes"
    return HookSpec(name, summary, int8_hook, functools.partial(Int8State, config=config), two_tier=int8_form())


_POWERSGD_DEFAULT = PowerSGDConfig()

COMM_HOOKS: dict[str, HookSpec] = {
    spec.name: spec
    for spec in (
        HookSpec(
            "allreduce",
            "fp32 mean all-reduce (DDP's behaviour), bytes recorded",
            allreduce_mean_hook,
            two_tier=cast_form(None),
        ),
        HookSpec(
            "fp16",
            "float16-compressed all-reduce: half the bytes",
            fp16_allreduce_hook,
            two_tier=cast_form(torch.float16),
        ),
        HookSpec(
            "bf16",
            "bfloat16-compressed all-reduce: half the bytes, fp32 range",
            bf16_allreduce_hook,
            unsupported_reason=_bf16_backend,
            two_tier=cast_form(torch.bfloat16),
        ),
        int8_spec(Int8Config()),
        powersgd_spec(_POWERSGD_DEFAULT),
        powersgd_spec(replace(_POWERSGD_DEFAULT, matrix_dtype="fp16"), "powersgd_fp16"),
        powersgd_spec(replace(_POWERSGD_DEFAULT, matrix_dtype="bf16"), "powersgd_bf16"),
        powersgd_spec(replace(_POWERSGD_DEFAULT, batched=True, rank=16, max_error=None), "batched_powersgd"),
    )
}
"""The registry: every ``comm_hook`` name, with its summary, hook and state (also ``lightning_ddpopt.COMM_HOOKS``)."""


def get_hook_spec(name: str) -> HookSpec:
    """Look up ``name``, or raise a ``ValueError`` that lists the valid names.

    Args:
        name: a key of :data:`COMM_HOOKS`.
    """
    try:
        return COMM_HOOKS[name]
    except KeyError:
        raise ValueError(
            f"comm_hook={name!r} is not a known hook; choose one of {sorted(COMM_HOOKS)}, 'auto' (measured), "
            "a PowerSGDConfig, a callable hook(state, bucket) -> Future, or None"
        ) from None


def hierarchical_hooks() -> list[str]:
    """The registry names whose entry has a two-tier form (:attr:`HookSpec.two_tier`), in registry order."""
    return [name for name, spec in COMM_HOOKS.items() if spec.two_tier is not None]


#: Names ``comm_hook=`` gives a meaning of its own, which no entry may take (``"auto"``: :mod:`..auto`'s choice).
_RESERVED_NAMES = ("auto",)


def register_comm_hook(spec: HookSpec) -> HookSpec:
    """Add ``spec`` to :data:`COMM_HOOKS`, so that ``comm_hook=spec.name`` selects it; return it.

    The hook then runs as the registry's own do: its bytes and timings in the ledger, its state saved in checkpoints
    and restored on resume, with the Trainer's and Fabric's strategy alike. Register it in every process before the
    strategy is built (at import of the module that defines it, for example); see the guide "Writing a comm hook".

    Args:
        spec: the entry: its name, summary, hook and the state it runs with.

    Raises:
        TypeError: ``spec`` is not a :class:`HookSpec`, or its hook cannot be called as ``hook(state, bucket)``.
        ValueError: its name is empty, reserved, or already registered.
    """
    if not isinstance(spec, HookSpec):
        raise TypeError(f"register_comm_hook(spec={spec!r}): spec must be a HookSpec(name, summary, hook, make_state)")
    if not isinstance(spec.name, str) or not spec.name or spec.name in _RESERVED_NAMES:
        raise ValueError(
            f"register_comm_hook(spec): spec.name={spec.name!r} must be a non-empty string other than "
            f"{', '.join(map(repr, _RESERVED_NAMES))}"
        )
    if spec.name in COMM_HOOKS:
        raise ValueError(
            f"register_comm_hook(spec): spec.name={spec.name!r} is registered already "
            f"({COMM_HOOKS[spec.name].summary}); choose another name"
        )
    validate_hook_callable(spec.hook, "spec.hook")
    COMM_HOOKS[spec.name] = spec
    return spec


def validate_hook_callable(hook: Callable, argument: str = "comm_hook") -> None:
    """Raise ``TypeError`` unless ``hook`` can be called as ``hook(state, bucket)``."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # builtins without a signature: DDP checks them when registering
    try:
        signature.bind(object(), object())
        if "bucket" not in signature.parameters:
            raise TypeError
    except TypeError:
        raise TypeError(
            f"{argument}={getattr(hook, '__qualname__', hook)!r} must take two positional arguments "
            f"named (state, bucket), as DDP requires, and return a torch.futures.Future; "
            f"its signature is {signature}"
        ) from None


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
