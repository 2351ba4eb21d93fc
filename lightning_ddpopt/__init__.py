"""lightning_ddpopt: a Lightning DDP strategy and callbacks that make data-parallel training scale.

The public names load on first use, so ``import lightning_ddpopt`` (and the ``ddpopt`` command) imports neither
torch nor Lightning; the strategies' names are registered with Lightning as soon as it is imported
(:mod:`lightning_ddpopt._registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ddpopt.__about__ import __version__
from lightning_ddpopt._registration import register_with_lightning

if TYPE_CHECKING:
    from lightning_ddpopt import fabric
    from lightning_ddpopt.callbacks import AMPMonitor, CommProfiler, StragglerDetector
    from lightning_ddpopt.fault_tolerance import FaultTolerance
    from lightning_ddpopt.hooks import COMM_HOOKS, register_comm_hook
    from lightning_ddpopt.ledger import CommLedger, StepRecord
    from lightning_ddpopt.localsgd import LocalSGDConfig
    from lightning_ddpopt.precision import fp16_mixed_precision
    from lightning_ddpopt.strategy import OptimizedDDPStrategy

#: Each public name and the module it comes from.
_PUBLIC = {
    "AMPMonitor": "lightning_ddpopt.callbacks",
    "COMM_HOOKS": "lightning_ddpopt.hooks",
    "CommLedger": "lightning_ddpopt.ledger",
    "CommProfiler": "lightning_ddpopt.callbacks",
    "FaultTolerance": "lightning_ddpopt.fault_tolerance",
    "LocalSGDConfig": "lightning_ddpopt.localsgd",
    "OptimizedDDPStrategy": "lightning_ddpopt.strategy",
    "StepRecord": "lightning_ddpopt.ledger",
    "StragglerDetector": "lightning_ddpopt.callbacks",
    "fp16_mixed_precision": "lightning_ddpopt.precision",
    "register_comm_hook": "lightning_ddpopt.hooks",
}

__all__ = [
    "COMM_HOOKS",
    "AMPMonitor",
    "CommLedger",
    "CommProfiler",
    "FaultTolerance",
    "LocalSGDConfig",
    "OptimizedDDPStrategy",
    "StepRecord",
    "StragglerDetector",
    "__version__",
    "fabric",
    "fp16_mixed_precision",
    "register_comm_hook",
]


if not TYPE_CHECKING:  # type checkers see the imports above: a misspelt name stays an error for them

    def __getattr__(name: str) -> Any:
        if name == "fabric":
            return importlib.import_module("lightning_ddpopt.fabric")
        if name in _PUBLIC:
            value = getattr(importlib.import_module(_PUBLIC[name]), name)
            globals()[name] = value
            return value
        raise AttributeError(f"module 'lightning_ddpopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


register_with_lightning()
