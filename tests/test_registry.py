"""Strategy names in Lightning's registry, the hook registry, and LightningCLI configuration."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddpopt import COMM_HOOKS, OptimizedDDPStrategy
from lightning_ddpopt.hooks import get_hook_spec
from tests.helpers import StackModel


@pytest.mark.quick
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


@pytest.mark.quick
def test_trainer_accepts_the_name():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_optimized_spawn_fp16", logger=False)
    assert isinstance(trainer.strategy, OptimizedDDPStrategy)
    assert trainer.strategy._core.hooks.spec is COMM_HOOKS["fp16"]


@pytest.mark.quick
def test_ddpopt_names_lists_every_registered_name_and_suggests_for_a_misspelt_one(capsys):
    from lightning_ddpopt._registration import strategy_names
    from lightning_ddpopt.cli import main as ddpopt

    ours = {name for name in StrategyRegistry.available_strategies() if name.startswith("ddp_optimized")}
    assert set(strategy_names()) == ours and len(ours) == 8
    assert ddpopt(["names"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(strategy_names())
    assert "ddp_optimized_spawn_fp16    OptimizedDDPStrategy(comm_hook='fp16', start_method='spawn')" in listed
    assert ddpopt(["names", "ddp_optimized_bf16"]) == 0
    assert capsys.readouterr().out == (
        "'ddp_optimized_bf16' is registered: OptimizedDDPStrategy(comm_hook='bf16', start_method='popen')\n"
    )
    # Lightning's own error for the misspelt name lists none of ours; the command names the one meant.
    with pytest.raises(ValueError, match="invalid strategy name"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_optimised_fp16", logger=False)
    assert ddpopt(["names", "ddp_optimised_fp16"]) == 2
    assert capsys.readouterr().err == (
        "ddpopt names: error: 'ddp_optimised_fp16' is not a strategy name of lightning_ddpopt; did you mean "
        "'ddp_optimized_fp16'?\n"
    )
    assert ddpopt(["names", "horovod"]) == 2
    assert "the names are ddp_optimized, ddp_optimized_spawn," in capsys.readouterr().err


@pytest.mark.quick
def test_hook_registry_names():
    assert {"allreduce", "fp16", "bf16"} <= set(COMM_HOOKS)
    for name, spec in COMM_HOOKS.items():
        assert spec.name == name
        assert spec.unsupported_reason("gloo") is None


@pytest.mark.quick
def test_a_make_state_by_keywords_or_by_position_builds_the_state(gloo_group):
    import functools

    from lightning_ddpopt.hooks import CommHookState, HookSpec, allreduce_mean_hook
    from lightning_ddpopt.ledger import CommLedger

    ledger = CommLedger()
    by_keywords = HookSpec("mine", "mine", allreduce_mean_hook, functools.partial(CommHookState))
    assert by_keywords.build(None, ledger).ledger is ledger
    # An earlier release's entry: make_state(group, ledger), positional, with names of its own.
    by_position = HookSpec("old", "old", allreduce_mean_hook, lambda group, books: CommHookState(ledger=books))
    assert by_position.build(None, ledger).ledger is ledger


@pytest.mark.quick
def test_the_registry_module_keeps_its_loader_whole_for_copy_and_pickle():
    import copy
    import pickle

    import lightning.pytorch.strategies as strategies

    loader = strategies.__spec__.loader
    assert copy.copy(loader).is_package("lightning.pytorch.strategies")
    assert pickle.loads(pickle.dumps(loader)).is_package("lightning.pytorch.strategies")
    assert copy.deepcopy(strategies.__spec__).name == "lightning.pytorch.strategies"


@pytest.mark.quick
def test_the_autotuner_is_deprecated_and_none():
    with pytest.deprecated_call(match="autotuner is deprecated"):
        assert OptimizedDDPStrategy().autotuner is None


@pytest.mark.quick
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


@pytest.mark.quick
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
    """Run ``code`` in a new interpreter (this one has imported everything already), runtime warnings as errors."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


#: What a user imports first, before Lightning: the package, a name that brings in the strategy (whose import brings
#: Lightning in, which registers the names), and names from modules that import Lightning before the strategy exists.
FIRST_IMPORTS = [
    "import lightning_ddpopt",
    "from lightning_ddpopt import OptimizedDDPStrategy",
    "from lightning_ddpopt import CommProfiler",
    "from lightning_ddpopt import LocalSGDConfig",
]
_CHECK = """
import sys
{first}
light = "torch" not in sys.modules
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
trainer_side, fabric_side = StrategyRegistry.get("ddp_optimized_fp16"), STRATEGY_REGISTRY.get("ddp_optimized_spawn")
print(light, type(trainer_side).__module__, trainer_side._core.hooks.spec.name, type(fabric_side).__module__)
"""


@pytest.mark.slow
def test_the_names_are_registered_whatever_the_package_gives_first():
    import subprocess
    import sys

    # Fresh interpreters (this one has imported everything), runtime warnings as errors, side by side.
    started = {
        first: subprocess.Popen(
            [sys.executable, "-W", "error::RuntimeWarning", "-c", _CHECK.format(first=first)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for first in FIRST_IMPORTS
    }
    for first, process in started.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{first}: {err[-2000:]}"
        light, trainer_module, hook, fabric_module = out.split()
        assert (trainer_module, hook, fabric_module) == (
            "lightning_ddpopt.strategy",
            "fp16",
            "lightning_ddpopt.fabric.strategy",
        ), first
        assert light == str(first == "import lightning_ddpopt"), f"{first}: torch imported? {light}"


@pytest.mark.quick
def test_the_command_line_plans_without_torch():
    out = _fresh_python(
        "import sys\nfrom lightning_ddpopt.cli import main\n"
        "main(['plan', '--params', '100M', '--world-size', '8', '--link', '10gbe'])\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.strip().endswith("False")


@pytest.mark.quick
def test_the_command_lines_report_name_is_the_diagnosis_one():
    from lightning_ddpopt import cli, diagnosis

    assert cli.REPORT_NAME == diagnosis.REPORT_NAME


@pytest.mark.quick
def test_nccl_keeps_ddps_own_allreduce_only_where_nothing_needs_our_hook():
    from lightning_ddpopt.hooks.install import builtin_allreduce_suffices

    allreduce, fp16 = get_hook_spec("allreduce"), get_hook_spec("fp16")
    alone = {"tiered": False, "island": False, "observed": False}
    assert builtin_allreduce_suffices(allreduce, "nccl", **alone)
    # gloo keeps our hook (the CPU suite runs every path through it), and so does any other hook or a callable.
    assert not builtin_allreduce_suffices(allreduce, "gloo", **alone)
    assert not builtin_allreduce_suffices(fp16, "nccl", **alone)
    assert not builtin_allreduce_suffices(None, "nccl", **alone)
    for needs in ("tiered", "island", "observed"):
        assert not builtin_allreduce_suffices(allreduce, "nccl", **{**alone, needs: True}), needs
