"""OptimizedDDPStrategy as a drop-in for DDPStrategy: the same constructor, only deliberate defaults, and
Lightning's comm-hook features (ddp_comm_hook, ddp_comm_wrapper, post-local SGD) on CPU/gloo."""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd

from lightning_ddpopt import OptimizedDDPStrategy
from tests.helpers import StackModel, fit_ddp, stack_gradient_bytes

pytestmark = pytest.mark.quick

KIND = inspect.Parameter


def test_every_ddpstrategy_parameter_keeps_its_position_and_ours_are_keyword_only():
    stock = list(inspect.signature(DDPStrategy.__init__).parameters.values())
    ours = list(inspect.signature(OptimizedDDPStrategy.__init__).parameters.values())
    positional = [p for p in stock if p.kind is KIND.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in ours[: len(positional)]] == [(p.name, p.default) for p in positional]
    added = ours[len(positional) : -1]
    assert added and all(p.kind is KIND.KEYWORD_ONLY for p in added)
    assert ours[-1].kind is KIND.VAR_KEYWORD


class TestAccelerator(CPUAccelerator):
    """Lightning's test_pluggable_accelerator passes its accelerator positionally."""


def test_positional_arguments_bind_as_in_ddpstrategy():
    accelerator = TestAccelerator()
    assert OptimizedDDPStrategy(accelerator).accelerator is accelerator
    devices = [torch.device("cpu")] * 2
    strategy = OptimizedDDPStrategy(
        None, devices, None, None, None, None, None, None, None, "gloo", timedelta(seconds=42), "fork"
    )
    assert strategy.parallel_devices == devices
    assert strategy._process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=42)
    assert strategy._start_method == "fork"


def test_only_what_differs_from_ddp_defaults_reaches_ddp():
    assert DDPStrategy()._ddp_kwargs == {}
    # One deliberate difference, documented in the comm hooks guide: gradients are views into DDP's buckets.
    assert OptimizedDDPStrategy()._ddp_kwargs == {"gradient_as_bucket_view": True}
    assert OptimizedDDPStrategy(gradient_as_bucket_view=False)._ddp_kwargs == {}
    assert OptimizedDDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=False)._ddp_kwargs == {
        "find_unused_parameters": True
    }
    assert OptimizedDDPStrategy(broadcast_buffers=False)._ddp_kwargs == {
        "gradient_as_bucket_view": True,
        "broadcast_buffers": False,
    }


def test_lightning_cli_lazy_instance(tmp_path):
    # Lightning's docs take lazy_instance from jsonargparse, which LightningCLI is built on.
    from jsonargparse import lazy_instance

    cli = LightningCLI(
        StackModel,
        run=False,
        args=["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false"],
        trainer_defaults={"strategy": lazy_instance(OptimizedDDPStrategy, comm_hook="fp16", start_method="spawn")},
        save_config_callback=None,
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, OptimizedDDPStrategy)
    assert strategy._core.hooks.spec is not None and strategy._core.hooks.spec.name == "fp16"
    assert strategy._start_method == "spawn"


def test_ddp_comm_wrapper_wraps_ddp_comm_hook_on_gloo(tmp_path):
    strategy = OptimizedDDPStrategy(
        ddp_comm_hook=default_hooks.allreduce_hook,
        ddp_comm_wrapper=default_hooks.fp16_compress_wrapper,
        start_method="fork",
    )
    ranks = fit_ddp(tmp_path, strategy, max_steps=2)
    for record in ranks:
        assert record["ddp_comm_hook"] == "fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook"
        assert [s["logical_bytes"] for s in record["steps"]] == [stack_gradient_bytes()] * 2
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"], rtol=0, atol=0)


@pytest.mark.parametrize(("max_steps", "averaged_last"), [(5, True), (6, False)])
def test_post_local_sgd_averages_every_period_on_gloo(tmp_path, max_steps, averaged_last):
    # Two synced warm-up steps, then local steps; the parameters are averaged every second step (steps 3 and 5).
    state = post_local_sgd.PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=2, post_local_gradient_allreduce=False
    )
    strategy = OptimizedDDPStrategy(
        ddp_comm_hook=post_local_sgd.post_localSGD_hook,
        ddp_comm_state=state,
        model_averaging_period=2,
        start_method="fork",
    )
    ranks = fit_ddp(tmp_path, strategy, samples=128, max_steps=max_steps)
    for record in ranks:
        assert record["ddp_comm_hook"] == "post_localSGD_hook"
        # The first two steps all-reduce; afterwards the hook sends nothing.
        assert [s["sync_rounds"] for s in record["steps"]] == [1] * max_steps
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]) is averaged_last


def test_post_local_sgd_with_node_subgroups_is_refused_on_cpu():
    state = post_local_sgd.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=2)
    strategy = OptimizedDDPStrategy(
        ddp_comm_hook=post_local_sgd.post_localSGD_hook, ddp_comm_state=state, model_averaging_period=2
    )
    with pytest.raises(ValueError, match="PostLocalSGDState"):
        strategy._core.hooks._check_post_local_sgd(torch.device("cpu"))
