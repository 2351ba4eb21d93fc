"""lightning_ddpopt: a Lightning DDP strategy and callbacks that make data-parallel training scale."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddpopt.__about__ import __version__
from lightning_ddpopt.hooks import COMM_HOOKS
from lightning_ddpopt.ledger import CommLedger, StepRecord
from lightning_ddpopt.strategy import OptimizedDDPStrategy

__all__ = ["COMM_HOOKS", "CommLedger", "OptimizedDDPStrategy", "StepRecord", "__version__"]

if OptimizedDDPStrategy.strategy_name not in StrategyRegistry:
    OptimizedDDPStrategy.register_strategies(StrategyRegistry)
