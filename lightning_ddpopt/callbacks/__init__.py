"""Callbacks that measure what data-parallel training spends its time and steps on."""

from lightning_ddpopt.callbacks.amp import AMPMonitor
from lightning_ddpopt.callbacks.comm import CommProfiler
from lightning_ddpopt.callbacks.straggler import StragglerDetector

__all__ = ["AMPMonitor", "CommProfiler", "StragglerDetector"]
