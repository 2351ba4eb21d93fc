"""Comm hooks with torch's ``(state, bucket) -> Future[Tensor]`` signature, and their registry."""

from lightning_ddpopt.hooks.auto import AUTO_HOOK, AutoConfig, HookChoice, choose_hook
from lightning_ddpopt.hooks.base import CommHookState, ErrorFeedbackState, TwoTierForm, squared_norm
from lightning_ddpopt.hooks.compression import allreduce_mean_hook, bf16_allreduce_hook, fp16_allreduce_hook
from lightning_ddpopt.hooks.hierarchical import HierarchicalState, hierarchical_hook
from lightning_ddpopt.hooks.hierarchical_int8 import HierarchicalInt8State, hierarchical_int8_hook
from lightning_ddpopt.hooks.hierarchical_powersgd import HierarchicalPowerSGDState, hierarchical_powersgd_hook
from lightning_ddpopt.hooks.int8 import Int8Config, Int8State, int8_hook
from lightning_ddpopt.hooks.powersgd import PowerSGDConfig, PowerSGDState, powersgd_hook
from lightning_ddpopt.hooks.registry import (
    COMM_HOOKS,
    HookSpec,
    get_hook_spec,
    int8_spec,
    powersgd_spec,
    register_comm_hook,
)

__all__ = [
    "AUTO_HOOK",
    "AutoConfig",
    "COMM_HOOKS",
    "HookChoice",
    "CommHookState",
    "ErrorFeedbackState",
    "HierarchicalInt8State",
    "HierarchicalPowerSGDState",
    "HierarchicalState",
    "HookSpec",
    "Int8Config",
    "Int8State",
    "PowerSGDConfig",
    "PowerSGDState",
    "TwoTierForm",
    "allreduce_mean_hook",
    "bf16_allreduce_hook",
    "choose_hook",
    "fp16_allreduce_hook",
    "get_hook_spec",
    "hierarchical_hook",
    "hierarchical_int8_hook",
    "hierarchical_powersgd_hook",
    "int8_hook",
    "int8_spec",
    "powersgd_hook",
    "powersgd_spec",
    "register_comm_hook",
    "squared_norm",
]
