"""Every private Lightning and torch API the package touches, in one place, each failing loudly when it changes.

A release of Lightning or torch may rename or drop any of these; each accessor below then raises a
``RuntimeError`` that names the API and the installed version (or, where the package can go on without it, warns
once and says what is lost), instead of failing somewhere downstream or doing nothing. ``tests/test_compat.py``
exercises each against the installed releases; CI runs it on the oldest and newest supported ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry as StrategyRegistryType
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.types import _PATH as PathType
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.imports import compare_version
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "BackwardSyncControl",
    "DDP_STRATEGY_ATTRIBUTES",
    "DDP_STRATEGY_INTERNALS",
    "FABRIC_DDP_STRATEGY_ATTRIBUTES",
    "FABRIC_DDP_STRATEGY_INTERNALS",
    "LIGHTNING_TESTED_RANGE",
    "PathType",
    "StrategyRegistryType",
    "attached_comm_hook",
    "bucket_assignment",
    "check_ddp_strategy_internals",
    "check_versions",
    "cpu_has_native_bf16",
    "data_fetcher",
    "dcp_load_alone",
    "found_inf_per_device",
    "unscale_once",
    "group_backends",
    "last_batch_of_epoch",
    "move_training_data",
    "quiet_access_log",
    "say_during_training",
    "scaler_scale",
    "replace_sigterm_hooks",
    "set_ddp_sync",
    "sigterm_hooks",
    "time_fetches",
]

#: The Lightning releases whose private ``DDPStrategy`` methods the strategy overrides and that CI tests.
LIGHTNING_TESTED_RANGE = ("2.6.0", "2.7.0")

#: What :class:`~lightning_ddpopt.OptimizedDDPStrategy` overrides or reads of Lightning's ``DDPStrategy``.
DDP_STRATEGY_INTERNALS = (
    "_setup_model",
    "_register_ddp_hooks",
    "_get_process_group_backend",
)
#: What :class:`lightning_ddpopt.fabric.OptimizedDDPStrategy` calls of Fabric's ``DDPStrategy``.
FABRIC_DDP_STRATEGY_INTERNALS = ("_get_process_group_backend",)
#: Instance attributes of either ``DDPStrategy`` the strategies read or write.
DDP_STRATEGY_ATTRIBUTES = ("_ddp_kwargs", "_timeout")
#: Fabric's: those, and the backward-sync control ``fabric.no_backward_sync`` asks (the strategy sets its own).
FABRIC_DDP_STRATEGY_ATTRIBUTES = (*DDP_STRATEGY_ATTRIBUTES, "_backward_sync_control")

_TORCH_GREATER_EQUAL_2_4 = compare_version("torch", operator.ge, "2.4.0")


def _changed(package: str, api: str, what: str) -> RuntimeError:
    version = lightning.__version__ if package == "lightning" else torch.__version__
    return RuntimeError(
        f"lightning_ddpopt uses {package}'s private {api} ({what}), which {package} {version} lacks or changed; "
        f"install a {package} release that CI tests (see 'What is tested: launchers and versions' in "
        "docs/guides/cluster.md)"
    )


def check_versions() -> None:
    """At construction, first: warn (on rank 0) outside the tested Lightning range and below torch 2.4."""
    low, high = LIGHTNING_TESTED_RANGE
    if not compare_version("lightning", operator.ge, low) or compare_version("lightning", operator.ge, high):
        rank_zero_warn(
            f"lightning_ddpopt is tested with lightning>={low},<{high}; lightning {lightning.__version__} is "
            "installed. OptimizedDDPStrategy overrides private DDPStrategy methods that may have changed.",
            category=RuntimeWarning,
            stacklevel=7,
        )
    if not _TORCH_GREATER_EQUAL_2_4:
        rank_zero_warn(
            f"lightning_ddpopt needs torch>=2.4; torch {torch.__version__} is installed.",
            category=RuntimeWarning,
            stacklevel=7,
        )


def check_ddp_strategy_internals(
    strategy: object,
    base: type = DDPStrategy,
    methods: tuple[str, ...] = DDP_STRATEGY_INTERNALS,
    attributes: tuple[str, ...] = DDP_STRATEGY_ATTRIBUTES,
) -> None:
    """Once ``base.__init__`` ran: raise if a ``DDPStrategy`` internal the strategy relies on is gone.

    ``base``: the Trainer's ``DDPStrategy`` (whose ``methods`` are :data:`DDP_STRATEGY_INTERNALS` and instance
    ``attributes`` :data:`DDP_STRATEGY_ATTRIBUTES`) or Fabric's (:data:`FABRIC_DDP_STRATEGY_INTERNALS`,
    :data:`FABRIC_DDP_STRATEGY_ATTRIBUTES`).
    """
    for name in methods:
        if not callable(getattr(base, name, None)):
            raise _changed("lightning", f"{base.__qualname__}.{name}", "the strategy overrides or calls it")
    for name in attributes:
        if not hasattr(strategy, name):
            raise _changed("lightning", f"{base.__qualname__}.{name}", "set by its __init__, read by the strategy")


def attached_comm_hook(model: DistributedDataParallel) -> str | None:
    """The qualified name of the comm hook DDP reports attached (``None`` for its built-in allreduce)."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        raise _changed("torch", "DistributedDataParallel._get_ddp_logging_data", "to check the hook is attached")
    return logging_data().get("comm_hook")


def bucket_assignment(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """The bucket layout DDP gives ``tensors`` (in the order DDP passes them) at ``cap_bytes``: DDP's own function."""
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if assign is None:
        raise _changed("torch", "torch.distributed._compute_bucket_assignment_by_size", "to predict DDP's buckets")
    assignment, _ = assign(tensors, [cap_bytes], [False] * len(tensors))
    return [list(bucket) for bucket in assignment]


def dcp_load_alone(state_dict: dict[str, Any], reader: Any) -> None:
    """``torch.distributed.checkpoint.load`` on this rank alone (no collective), while a process group exists.

    ``load`` takes ``no_dist`` from torch 2.5 on; torch 2.4's ``load`` is a collective whenever a group exists, and
    its deprecated ``load_state_dict`` (which warns from torch 2.5 on) is the one that loads alone.
    """
    import inspect
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Alone on purpose: not the warning that a process without a group loads alone.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(state_dict, storage_reader=reader, no_dist=True)
            return
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load_state_dict(state_dict, storage_reader=reader, no_dist=True)


def group_backends(group: dist.ProcessGroup) -> list[object]:
    """The backend objects of ``group`` (CPU and CUDA), to hold their Python references while it is destroyed."""
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        raise _changed("torch", "ProcessGroup._get_backend", "to destroy a group without a deadlock on torch 2.4")
    found: list[object] = []
    for device in ("cpu", "cuda"):
        try:
            found.append(get_backend(torch.device(device)))
        except RuntimeError:  # no backend for this device type in this group
            pass
    return found


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
    """What ``GradScaler.step`` reads to decide whether to skip: filled by ``unscale_`` (empty if not unscaled)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _changed("torch", "GradScaler._per_optimizer_states", "to tell skipped steps")
    return states[id(optimizer)].get("found_inf_per_device", {})


def unscale_once(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Unscale ``optimizer``'s gradients unless done since the last ``update()`` (a user's gradient clipping does).

    Optimizers that unscale inside ``step()`` (fused ones) are left to it, as ``GradScaler.step`` leaves them.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise _changed("torch", "GradScaler._per_optimizer_states", "to unscale the gradients once")
    from torch.amp.grad_scaler import OptState

    if states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's own scale tensor, on the device (``get_scale()`` would sync the host); ``None`` before use."""
    if not hasattr(scaler, "_scale"):
        raise _changed("torch", "GradScaler._scale", "the loss scale without a host sync")
    return scaler._scale


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16, AMX, Arm's BF16); ``None`` where nothing tells.

    Elsewhere torch emulates bf16, slowly. Reads the flags Linux lists in ``/proc/cpuinfo`` first, then torch's
    own (private) checks where this torch has them: a hint for a warning's advice, so a missing source is
    "unknown", never an error.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = {
                flag
                for line in cpuinfo
                if line.lower().startswith(("flags", "features"))
                for flag in line.split(":", 1)[-1].split()
            }
    except OSError:
        flags = set()
    if flags:
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is None for check in checks):
        return None
    return any(bool(check()) for check in checks if check is not None)


def last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the batch running now is the epoch's last (manual accumulation ends its group there)."""
    reached = getattr(trainer.fit_loop.epoch_loop, "_num_ready_batches_reached", None)
    if reached is None:
        raise _changed("lightning", "_TrainingEpochLoop._num_ready_batches_reached", "for manual accumulation")
    return bool(reached())


def batches_that_stepped(trainer: pl.Trainer, value: int | None = None) -> int:
    """The epoch loop's count of batches that stepped (the logging step), set to ``value`` if given (a heal)."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_batches_that_stepped"):
        raise _changed("lightning", "_TrainingEpochLoop._batches_that_stepped", "for a fault-tolerant heal")
    if value is not None:
        loop._batches_that_stepped = value
    return int(loop._batches_that_stepped)


def move_training_data(trainer: pl.Trainer, epoch: int, batches: int) -> int:
    """Point the fit loop's training data at ``epoch``, past its first ``batches`` batches; the batches skipped.

    For a heal. The samplers' epoch is set (their order for that epoch), the fetcher's iterator made anew, and
    ``batches`` batches read and dropped: the loop's next batch is the one after them, as the live islands' is.
    """
    loop = trainer.fit_loop
    fetcher, combined = getattr(loop, "_data_fetcher", None), getattr(loop, "_combined_loader", None)
    if fetcher is None or combined is None or not hasattr(combined, "flattened"):
        raise _changed("lightning", "_FitLoop._data_fetcher/_combined_loader", "to move a healed island's data")
    from lightning.fabric.utilities.data import _set_sampler_epoch

    for dataloader in combined.flattened:
        _set_sampler_epoch(dataloader, epoch)
    iter(fetcher)  # a new iterator at the start of that epoch
    skipped = 0
    for _ in range(batches):
        try:
            next(fetcher)
        except StopIteration:
            break
        skipped += 1
    return skipped


def quiet_access_log(transport: object) -> None:
    """No access-log line on stderr for each request to torchft's checkpoint server (``HTTPTransport._server``).

    Where a torchft release has no such server, one warning says the lines stay.
    """
    server = getattr(transport, "_server", None)
    if server is None or not hasattr(server, "RequestHandlerClass"):
        _lost("torchft HTTPTransport._server", "its checkpoint server logs each heal's fetch on stderr")
        return
    server.RequestHandlerClass.log_request = lambda *args, **kwargs: None


_warned: set[str] = set()


def _lost(api: str, consequence: str) -> None:
    if api not in _warned:
        _warned.add(api)
        rank_zero_warn(f"ddpopt: Lightning {lightning.__version__} has no {api}; {consequence}")


def data_fetcher(trainer: pl.Trainer) -> Any | None:
    """The fit loop's data fetcher, with the ``_start_profiler`` / ``_stop_profiler`` it calls around each fetch.

    ``None`` (and one warning) when this Lightning has none: data time is then the gap between batches.
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None:
        return None  # before the loop's first epoch
    if not all(callable(getattr(fetcher, name, None)) for name in ("_start_profiler", "_stop_profiler")):
        _lost("_DataFetcher._start_profiler/_stop_profiler", "StragglerDetector counts the whole gap as data time")
        return None
    return fetcher


def sigterm_hooks(trainer: pl.Trainer) -> tuple[Any, Any] | None:
    """The epoch loop (``_broadcast_sigterm_tensor``) and signal connector (``_sigterm_notifier_fn``) to replace.

    ``None`` (and one warning) when this Lightning lacks either: its per-batch SIGTERM barrier then stays.
    """
    loop = trainer.fit_loop.epoch_loop
    connector = getattr(trainer, "_signal_connector", None)
    if (
        connector is None
        or getattr(type(loop), "_broadcast_sigterm_tensor", None) is None
        or getattr(type(connector), "_sigterm_notifier_fn", None) is None
    ):
        _lost(
            "_broadcast_sigterm_tensor / _sigterm_notifier_fn",
            "local SGD's ranks meet before every batch (Lightning's SIGTERM check), as without this package",
        )
        return None
    return loop, connector


class SigtermPatch:
    """Lightning's per-batch SIGTERM check and its signal handler, replaced on one trainer until :meth:`remove`."""

    def __init__(self, loop: Any, connector: Any) -> None:
        self._loop, self._connector = loop, connector

    @property
    def received_sigterm(self) -> bool:
        """Lightning's record of a SIGTERM on this rank (its signal connector's)."""
        return bool(self._connector.received_sigterm)

    def record_sigterm(self) -> None:
        """Record a SIGTERM as Lightning's handler would: the fit loop stops after the batch."""
        self._connector.received_sigterm = True

    def remove(self) -> None:
        """Lightning's own check and handler again (the instance attributes set here are dropped)."""
        self._loop.__dict__.pop("_broadcast_sigterm_tensor", None)
        self._connector.__dict__.pop("_sigterm_notifier_fn", None)


def replace_sigterm_hooks(
    trainer: pl.Trainer, check: Callable[[], None], notify: Callable[..., None]
) -> SigtermPatch | None:
    """Replace this trainer's per-batch SIGTERM check by ``check`` and its signal handler by ``notify``.

    ``None`` (and one warning, see :func:`sigterm_hooks`) when this Lightning lacks either: nothing is replaced.
    """
    hooks = sigterm_hooks(trainer)
    if hooks is None:
        return None
    loop, connector = hooks
    loop._broadcast_sigterm_tensor = check
    connector._sigterm_notifier_fn = notify
    return SigtermPatch(loop, connector)


def time_fetches(
    trainer: pl.Trainer,
    on_start: Callable[[], None],
    on_stop: Callable[[], None],
    wrapped: Callable[[], None] | None = None,
) -> Callable[[], None] | None:
    """Call ``on_start`` before and ``on_stop`` after each fetch of the fit loop's training data fetcher.

    Wraps the fetcher's ``_start_profiler`` / ``_stop_profiler``; each epoch's loop sets them anew, so call it at
    each batch with what the last call returned (``wrapped``): a fetcher it already wraps is left alone. Returns the
    wrapper, or ``None`` (and one warning, see :func:`data_fetcher`) when this Lightning has no fetcher to wrap.
    """
    fetcher = data_fetcher(trainer)
    if fetcher is None:
        return None
    start, stop = fetcher._start_profiler, fetcher._stop_profiler
    if wrapped is not None and start is wrapped:
        return wrapped

    def timed_start() -> None:
        on_start()
        start()

    def timed_stop() -> None:
        stop()
        on_stop()

    fetcher._start_profiler, fetcher._stop_profiler = timed_start, timed_stop
    return timed_start


def set_ddp_sync(model: DistributedDataParallel, gradients: bool, buffers: bool | None = None) -> None:
    """Whether DDP's next forward prepares a gradient sync (``gradients``) and broadcasts buffers (``buffers``).

    DDP's own ``no_sync`` sets these two attributes (public, undocumented) for one context; local SGD and
    ``fabric.no_backward_sync`` set them per batch. ``None`` leaves ``buffers`` as it is.
    """
    for name in ("require_backward_grad_sync", "require_forward_param_sync"):
        if not hasattr(model, name):
            raise _changed("torch", f"DistributedDataParallel.{name}", "to switch a batch's sync off")
    model.require_backward_grad_sync = gradients
    if buffers is not None:
        model.require_forward_param_sync = buffers


def say_during_training(module: pl.LightningModule | None, is_global_zero: bool, message: str) -> None:
    """Log ``message`` on rank 0; through the progress bar while one is drawn, so the line does not cut it."""
    trainer = getattr(module, "_trainer", None) if module is not None else None
    bar = trainer.progress_bar_callback if trainer is not None and trainer.training else None
    try:  # Lightning's TQDM bar raises TypeError before its train bar exists; other bars have none
        train_bar = bar.train_progress_bar if bar is not None else None
    except (AttributeError, TypeError):
        train_bar = None
    if bar is not None and train_bar is not None and not getattr(train_bar, "disable", True) and is_global_zero:
        bar.print(message)
    else:
        rank_zero_info(message)
