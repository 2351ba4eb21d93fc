"""Strategy names in Lightning's registry, the hook registry, and LightningCLI configuration."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddpopt import COMM_HOOKS, OptimizedDDPStrategy
from lightning_ddpopt.hooks import get_hook_spec
from tests.helpers import StackModel


@pytest.mark.parametrize(
    ("name", "start_method", "hook"),
    [
        ("ddp_optimized", "popen", "allreduce"),
        ("ddp_optimized_spawn", "spawn", "allreduce"),
        ("ddp_optimized_fork", "fork", "allreduce"),
        ("ddp_optimized_notebook", "fork", "allreduce"),
        ("ddp_optimized_fp16", "popen", "fp16"),
        ("ddp_optimized_spawn_fp16", "spawn", "fp16"),
        ("ddp_optimized_bf16", "popen", "bf16"),
    ],
)
def test_registered_names_resolve(name, start_method, hook):
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, OptimizedDDPStrategy)
    assert strategy._start_method == start_method
    assert strategy._core.hooks.spec is get_hook_spec(hook)


def test_trainer_accepts_the_name():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_optimized_spawn_fp16", logger=False)
    assert isinstance(trainer.strategy, OptimizedDDPStrategy)
    assert trainer.strategy._core.hooks.spec is COMM_HOOKS["fp16"]


def test_hook_registry_names():
    assert {"allreduce", "fp16", "bf16"} <= set(COMM_HOOKS)
    for name, spec in COMM_HOOKS.items():
        assert spec.name == name
        assert spec.unsupported_reason("gloo") is None


def test_lightning_cli_yaml_configures_the_strategy(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: lightning_ddpopt.OptimizedDDPStrategy
    init_args:
      comm_hook: bf16
      bucket_cap_mb: 4.5
      cpu_affinity: true
      find_unused_parameters: true
      start_method: spawn
"""
    )
    cli = LightningCLI(StackModel, run=False, args=["--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OptimizedDDPStrategy)
    assert strategy._core.hooks.spec is COMM_HOOKS["bf16"]
    assert strategy._core.buckets.requested == 4.5
    assert strategy._core.cpu_affinity is True
    assert strategy._start_method == "spawn"
    assert strategy._ddp_kwargs["find_unused_parameters"] is True


def test_lightning_cli_rejects_a_bad_value():
    with pytest.raises(ValueError, match=r"bucket_cap_mb=-3.0 must be a positive, finite number of MiB"):
        LightningCLI(
            StackModel,
            run=False,
            args=[
                "--trainer.strategy=lightning_ddpopt.OptimizedDDPStrategy",
                "--trainer.strategy.bucket_cap_mb=-3",
            ],
            save_config_callback=None,
        )
