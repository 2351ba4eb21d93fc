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


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (this one has imported everything already); its stdout."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_importing_the_package_is_light_and_registers_the_names_once_lightning_loads():
    out = _fresh_python(
        "import sys, lightning_ddpopt\n"
        "print('torch' in sys.modules, 'lightning' in sys.modules)\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print('ddp_optimized_spawn_fp16' in StrategyRegistry, 'ddp_optimized_spawn_fp16' in STRATEGY_REGISTRY)\n"
        "trainer_class, fabric_class = StrategyRegistry['ddp_optimized'], STRATEGY_REGISTRY['ddp_optimized']\n"
        "print(trainer_class['strategy'].__module__, fabric_class['strategy'].__module__)\n"
    )
    assert out.split("\n")[:3] == [
        "False False",
        "True True",
        "lightning_ddpopt.strategy lightning_ddpopt.fabric.strategy",
    ]


def test_the_names_are_registered_when_the_strategys_import_brings_lightning_in():
    # The strategy module imports Lightning, whose import registers the names, which imports the strategy module:
    # the module half-way through its import registers its own names at its end.
    out = _fresh_python(
        "from lightning_ddpopt import OptimizedDDPStrategy\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print('ddp_optimized' in StrategyRegistry and 'ddp_optimized' in STRATEGY_REGISTRY)\n"
    )
    assert out.strip() == "True"


def test_the_command_line_plans_without_torch():
    out = _fresh_python(
        "import sys\nfrom lightning_ddpopt.cli import main\n"
        "main(['plan', '--params', '100M', '--world-size', '8', '--link', '10gbe'])\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.strip().endswith("False")


def test_the_command_lines_report_name_is_the_diagnosis_one():
    from lightning_ddpopt import cli, diagnosis

    assert cli.REPORT_NAME == diagnosis.REPORT_NAME
