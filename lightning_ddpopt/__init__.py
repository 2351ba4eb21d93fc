"""lightning_ddpopt: a Lightning DDP strategy and callbacks that make data-parallel training scale."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddpopt import fabric  # registers the Fabric strategy's names in Fabric's registry
from lightning_ddpopt.__about__ import __version__
from lightning_ddpopt.callbacks import AMPMonitor, CommProfiler, StragglerDetector
from lightning_ddpopt.hooks import COMM_HOOKS
from lightning_ddpopt.ledger import CommLedger, StepRecord
from lightning_ddpopt.localsgd import LocalSGDConfig
from lightning_ddpopt.precision import fp16_mixed_precision
from lightning_ddpopt.strategy import OptimizedDDPStrategy

__all__ = [
    "COMM_HOOKS",
    "AMPMonitor",
    "CommLedger",
    "CommProfiler",
    "LocalSGDConfig",
    "OptimizedDDPStrategy",
    "StepRecord",
    "StragglerDetector",
    "__version__",
    "fabric",
    "fp16_mixed_precision",
]

if OptimizedDDPStrategy.strategy_name not in StrategyRegistry:
    OptimizedDDPStrategy.register_strategies(StrategyRegistry)
