"""Callbacks that measure what data-parallel training spends its time and steps on."""

from lightning_ddpopt.callbacks.amp import AMPMonitor

__all__ = ["AMPMonitor"]
