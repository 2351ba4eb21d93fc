"""Every private Lightning and torch API the package touches (``lightning_ddpopt._compat``): one test each that it
still works in the installed releases, and that its absence fails loudly, naming it. CI runs these on the oldest and
newest supported releases too."""

from __future__ import annotations

import re
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_ddpopt import OptimizedDDPStrategy, _compat
from lightning_ddpopt.hooks.compression import fp16_allreduce_hook
from tests.helpers import StackModel, regression_data

pytestmark = pytest.mark.quick


def _ddp(bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    return DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), bucket_cap_mb=bucket_cap_mb)


def test_the_strategy_finds_every_ddp_strategy_internal_it_overrides():
    strategy = OptimizedDDPStrategy()
    for name in _compat.DDP_STRATEGY_INTERNALS:
        assert callable(getattr(DDPStrategy, name))
    # What it overrides is there to override: Lightning calls these on its DDPStrategy during setup.
    assert {"_setup_model", "_register_ddp_hooks"} <= set(vars(OptimizedDDPStrategy)) & set(vars(DDPStrategy))
    for name in _compat.DDP_STRATEGY_ATTRIBUTES:
        assert hasattr(strategy, name)


def test_a_missing_ddp_strategy_internal_fails_at_construction(monkeypatch):
    monkeypatch.delattr(DDPStrategy, "_get_process_group_backend")
    with pytest.raises(RuntimeError, match=r"lightning's private DDPStrategy\._get_process_group_backend"):
        OptimizedDDPStrategy()


def test_the_fabric_strategy_finds_fabrics_ddp_strategy_internals(monkeypatch):
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    from lightning_ddpopt.fabric import OptimizedDDPStrategy as FabricStrategy

    strategy = FabricStrategy()
    for name in _compat.FABRIC_DDP_STRATEGY_ATTRIBUTES:
        assert hasattr(strategy, name)
    # fabric.no_backward_sync asks the strategy's backward-sync control: a Fabric without one fails at construction.
    assert FabricDDPStrategy().__dict__["_backward_sync_control"] is not None
    original_init = FabricDDPStrategy.__init__

    def without_control(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        del self._backward_sync_control

    with monkeypatch.context() as patch:
        patch.setattr(FabricDDPStrategy, "__init__", without_control)
        with pytest.raises(RuntimeError, match=r"lightning's private DDPStrategy\._backward_sync_control"):
            FabricStrategy()
    monkeypatch.delattr(FabricDDPStrategy, "_get_process_group_backend")
    with pytest.raises(RuntimeError, match=r"lightning's private DDPStrategy\._get_process_group_backend"):
        FabricStrategy()


def test_ddps_sync_switches_are_what_no_sync_sets(gloo_group):
    model = _ddp()
    with model.no_sync():
        assert model.require_backward_grad_sync is False
    assert model.require_backward_grad_sync is True and model.require_forward_param_sync is True
    _compat.set_ddp_sync(model, gradients=False, buffers=False)
    assert (model.require_backward_grad_sync, model.require_forward_param_sync) == (False, False)
    _compat.set_ddp_sync(model, gradients=True)
    assert (model.require_backward_grad_sync, model.require_forward_param_sync) == (True, False)
    with pytest.raises(RuntimeError, match="private DistributedDataParallel.require_backward_grad_sync"):
        _compat.set_ddp_sync(SimpleNamespace(), gradients=True)  # type: ignore[arg-type]


def test_attached_comm_hook_names_the_registered_hook(gloo_group):
    model = _ddp()
    assert _compat.attached_comm_hook(model) in (None, "")  # DDP's built-in allreduce
    model.register_comm_hook(None, fp16_allreduce_hook)
    assert _compat.attached_comm_hook(model) == fp16_allreduce_hook.__qualname__


def test_bucket_assignment_is_ddps_layout(gloo_group):
    tensors = [torch.empty(1000), torch.empty(1000), torch.empty(3000)]  # 4 kB, 4 kB, 12 kB
    assert _compat.bucket_assignment(tensors, cap_bytes=8000) == [[0, 1], [2]]
    assert _compat.bucket_assignment(tensors, cap_bytes=100_000) == [[0, 1, 2]]


def test_group_backends_finds_the_cpu_backend(gloo_group):
    backends = _compat.group_backends(dist.group.WORLD)
    # gloo serves both device types of the group: the same backend, found once per device type.
    assert backends and all("gloo" in type(backend).__name__.lower() for backend in backends)


def test_the_scaler_internals_tell_the_scale_and_a_skipped_step():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    parameter = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    assert _compat.scaler_scale(scaler) is None  # before the first scale()
    scaler.scale(parameter.sum()).backward()
    assert float(_compat.scaler_scale(scaler)) == 1024.0
    parameter.grad[0] = float("inf")
    scaler.unscale_(optimizer)
    found = _compat.found_inf_per_device(scaler, optimizer)
    assert [float(flag) for flag in found.values()] == [1.0]


def test_unscale_once_unscales_a_ready_optimizer_and_leaves_an_unscaled_one():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    parameter = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scaler.scale(parameter.sum()).backward()
    _compat.unscale_once(scaler, optimizer)
    assert parameter.grad.tolist() == [1.0, 1.0, 1.0]
    _compat.unscale_once(scaler, optimizer)  # a second unscale_ would raise, or divide again
    assert parameter.grad.tolist() == [1.0, 1.0, 1.0]
    scaler.step(optimizer)  # the step does not unscale again either
    torch.testing.assert_close(parameter.detach(), torch.full((3,), 0.9))


def test_fabrics_backward_sync_control_is_what_the_fabric_strategy_replaces():
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    from lightning_ddpopt.fabric import OptimizedDDPStrategy as FabricStrategy

    assert isinstance(FabricDDPStrategy()._backward_sync_control, _BackwardSyncControl)
    assert isinstance(FabricStrategy()._backward_sync_control, _BackwardSyncControl)
    assert type(FabricStrategy()._backward_sync_control) is not type(FabricDDPStrategy()._backward_sync_control)


class _LoopInternals(pl.Callback):
    """Reads, during a real fit, what the package reads of Lightning's loop."""

    def __init__(self) -> None:
        self.last_batch: list[bool] = []
        self.fetchers: list[object] = []
        self.sigterm: list[tuple[object, object] | None] = []

        self.fetches, self.checks, self.received = 0, [], []
        self._wrapped = None

    def on_train_start(self, trainer, pl_module):
        # Our replacements, as local SGD and StragglerDetector install them: Lightning calls them in a fit.
        self.patch = _compat.replace_sigterm_hooks(trainer, self._check, lambda signum, frame: None)

    def _check(self):
        """Lightning calls it before each batch on more than one rank."""

    def _fetched(self):
        self.fetches += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.last_batch.append(_compat.last_batch_of_epoch(trainer))
        self.fetchers.append(_compat.data_fetcher(trainer))
        self.sigterm.append(_compat.sigterm_hooks(trainer))
        self.checks.append(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor == self._check)
        wrapped = _compat.time_fetches(trainer, lambda: None, self._fetched, self._wrapped)
        assert wrapped is not None and (self._wrapped is None or wrapped is self._wrapped)
        self._wrapped = wrapped

    def on_train_end(self, trainer, pl_module):
        self.received.append(self.patch.received_sigterm)
        self.patch.record_sigterm()
        self.received.append(self.patch.received_sigterm)
        self.patch.remove()
        trainer._signal_connector.received_sigterm = False


def test_lightnings_loop_internals_are_there_during_a_fit(tmp_path):
    probe = _LoopInternals()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        default_root_dir=tmp_path,
    )
    trainer.fit(StackModel(), DataLoader(regression_data(24), batch_size=8))
    assert probe.last_batch == [False, False, True]
    # Wrapped at the first batch, after its fetch: the next two batches' fetches are timed.
    assert probe.fetches == 2 and probe.checks == [True, True, True] and probe.received == [False, True]
    for fetcher in probe.fetchers:
        assert callable(fetcher._start_profiler) and callable(fetcher._stop_profiler)
    for hooks in probe.sigterm:
        assert hooks is not None
        loop, connector = hooks
        assert callable(loop._broadcast_sigterm_tensor) and callable(connector._sigterm_notifier_fn)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)  # removed: Lightning's own again


def test_say_during_training_logs_on_rank_zero_without_a_trainer(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(_compat, "rank_zero_info", said.append)
    _compat.say_during_training(None, True, "ddpopt: a line")
    assert said == ["ddpopt: a line"]


_NOTHING = SimpleNamespace()


@pytest.mark.parametrize(
    ("call", "api"),
    [
        (lambda: _compat.attached_comm_hook(_NOTHING), "DistributedDataParallel._get_ddp_logging_data"),
        (lambda: _compat.group_backends(_NOTHING), "ProcessGroup._get_backend"),
        (lambda: _compat.found_inf_per_device(_NOTHING, None), "GradScaler._per_optimizer_states"),
        (lambda: _compat.unscale_once(_NOTHING, None), "GradScaler._per_optimizer_states"),
        (lambda: _compat.scaler_scale(_NOTHING), "GradScaler._scale"),
        (
            lambda: _compat.last_batch_of_epoch(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=_NOTHING))),
            "_TrainingEpochLoop._num_ready_batches_reached",
        ),
    ],
)
def test_a_changed_private_api_fails_loudly_naming_it(call, api):
    with pytest.raises(RuntimeError, match=f"private {re.escape(api)} .*lacks or changed"):
        call()


def test_a_changed_torch_function_fails_loudly(monkeypatch):
    monkeypatch.delattr(dist, "_compute_bucket_assignment_by_size")
    with pytest.raises(RuntimeError, match="_compute_bucket_assignment_by_size"):
        _compat.bucket_assignment([torch.empty(4)], 16)


def test_cpu_native_bf16_is_read_from_the_cpu_flags_then_torch(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open

    def cpuinfo(text):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(
            builtins, "open", lambda file, *a, **k: real_open(path if file == "/proc/cpuinfo" else file, *a, **k)
        )

    cpuinfo("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert _compat.cpu_has_native_bf16() is False
    cpuinfo("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert _compat.cpu_has_native_bf16() is True
    cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve bf16\n")  # Arm (Graviton 3)
    assert _compat.cpu_has_native_bf16() is True
    # No flags to read (not Linux): torch's own checks, where this torch has them; else unknown, never an error.
    cpuinfo("")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert _compat.cpu_has_native_bf16() is True
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert _compat.cpu_has_native_bf16() is None


def test_lightning_internals_that_can_be_done_without_warn_once(recwarn):
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(_data_fetcher=object(), epoch_loop=object()), _signal_connector=object()
    )
    _compat._warned.clear()
    assert _compat.data_fetcher(trainer) is None
    assert _compat.sigterm_hooks(trainer) is None
    assert _compat.data_fetcher(trainer) is None  # once
    messages = [str(w.message) for w in recwarn if "ddpopt:" in str(w.message)]
    assert len(messages) == 2
    assert "StragglerDetector counts the whole gap as data time" in messages[0]
    assert "ranks meet before every batch" in messages[1]


def test_a_fused_optimizer_is_told_by_the_attribute_torch_sets_and_left_to_unscale_itself():
    parameter = nn.Parameter(torch.ones(4))
    try:
        fused = torch.optim.Adam([parameter], fused=True)
    except RuntimeError as error:  # a torch without fused Adam on this device
        pytest.skip(str(error))
    assert fused._step_supports_amp_scaling is True
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(parameter.sum()).backward()
    _compat.unscale_once(scaler, fused)  # GradScaler.step unscales inside a fused step: left scaled here
    assert torch.equal(parameter.grad, torch.full((4,), 8.0))
    _compat.unscale_once(scaler, torch.optim.SGD([parameter]))
    assert torch.equal(parameter.grad, torch.ones(4))


def test_a_modules_trainer_is_where_the_progress_bar_is_looked_up():
    module, trainer = StackModel(), pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module.trainer = trainer
    assert module._trainer is trainer  # what say_during_training reads (the public property raises without one)
