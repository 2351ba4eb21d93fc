"""fp16 mixed precision with GradScaler settings Lightning does not expose, on GPU and CPU alike."""

from __future__ import annotations

import math
import weakref

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ddpopt._compat import cpu_has_native_bf16, scaler_scale
from lightning_ddpopt._validate import require_int

__all__ = [
    "OptimizerSteps",
    "bf16_supported",
    "current_loss_scale",
    "fp16_grad_scaler",
    "fp16_mixed_precision",
    "native_bf16",
]


def fp16_mixed_precision(
    device: str = "cuda",
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> MixedPrecision:
    """A ``MixedPrecision("16-mixed")`` plugin whose GradScaler has the given settings.

    Pass it as ``Trainer(plugins=[fp16_mixed_precision(...)])``. On ``device="cpu"`` it runs real fp16 autocast
    with a GradScaler (Lightning turns a plain ``precision="16-mixed"`` into bf16 on CPU): torch's fp16 CPU kernels
    are much slower than fp32's, so it warns once; it is for testing AMP behaviour without a GPU. For Fabric, see
    :func:`lightning_ddpopt.fabric.fp16_mixed_precision`.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        init_scale: the first loss scale.
        growth_factor: multiplies the scale after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: multiplies the scale at every overflow, whose optimizer step is skipped (in (0, 1)).
        growth_interval: overflow-free steps between two growths (>= 1).
    """
    scaler = fp16_grad_scaler(device, init_scale, growth_factor, backoff_factor, growth_interval)
    return MixedPrecision("16-mixed", device, scaler=scaler)


def fp16_grad_scaler(
    device: str, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> torch.amp.GradScaler:
    """A GradScaler with the given settings, each checked (see :func:`fp16_mixed_precision`)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} is not valid; choose 'cuda' or 'cpu'")
    if not (isinstance(init_scale, int | float) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale={init_scale!r} must be a positive, finite number")
    if not (isinstance(growth_factor, int | float) and growth_factor > 1):
        raise ValueError(f"growth_factor={growth_factor!r} must be > 1")
    if not (isinstance(backoff_factor, int | float) and 0 < backoff_factor < 1):
        raise ValueError(f"backoff_factor={backoff_factor!r} must be between 0 and 1")
    require_int("growth_interval", growth_interval, 1)
    if device == "cpu":
        _warn_cpu_fp16_once()
    return torch.amp.GradScaler(
        device,
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )


_warned_cpu_fp16 = False


def _warn_cpu_fp16_once() -> None:
    global _warned_cpu_fp16
    if _warned_cpu_fp16:
        return
    _warned_cpu_fp16 = True
    native = cpu_has_native_bf16()
    if native:
        instead = "for speed, use precision='bf16-mixed', which this CPU computes natively and needs no GradScaler"
    elif native is None:
        instead = (
            "for speed, use precision='bf16-mixed' where the CPU has AVX512-BF16 or AMX (this one's flags could not "
            "be read), else fp32"
        )
    else:
        instead = (
            "this CPU has no native bf16 either (no AVX512-BF16 or AMX), where bf16 autocast is as slow: train in "
            "fp32 for speed"
        )
    rank_zero_warn(
        "ddpopt: fp16 autocast on a CPU runs torch's float16 CPU kernels, several times slower than fp32 (the AMP "
        "guide has the measured cost): use it to test AMP behaviour without a GPU; " + instead + "."
    )


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively: CPUs with AVX512-BF16 or AMX, GPUs of capability 8.0 or later.

    ``torch.cuda.is_bf16_supported()`` alone also counts emulation, which runs but slowly; this does not.
    """
    if device.type != "cuda":
        return bool(cpu_has_native_bf16())  # unknown flags: not promised
    if torch.version.hip:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device)[0] >= 8


def bf16_supported(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 autocast runs natively on ``device`` (:func:`native_bf16`), with advice in words."""
    if device.type == "cuda":
        if native_bf16(device):
            return True, f"{torch.cuda.get_device_name(device)} supports bf16: use precision='bf16-mixed'"
        return False, (
            f"{torch.cuda.get_device_name(device)} has no native bf16 (it needs compute capability 8.0, A100 or "
            "later): lower the learning rate or check the model for values beyond fp16's range"
        )
    native = cpu_has_native_bf16()
    if native:
        return True, "this CPU computes bf16 natively: use precision='bf16-mixed'"
    if native is None:
        return False, (
            "this CPU's flags could not be read to tell native bf16 (AVX512-BF16 or AMX): try precision='bf16-mixed' "
            "and compare its step time with fp32's"
        )
    return False, (
        "this CPU has no native bf16 (no AVX512-BF16 or AMX), where bf16 autocast is slow too: train in fp32, or lower "
        "the learning rate"
    )


def current_loss_scale(precision_plugin: object | None) -> torch.Tensor | None:
    """The loss scale of ``precision_plugin``'s GradScaler (the Trainer's or Fabric's plugin), or ``None`` without one.

    Read during a backward pass, it is the scale that pass runs with (the scaler updates it after the step). It is
    the scaler's own tensor, on the device: ``GradScaler.get_scale()`` would sync the host on a GPU. Copy it to keep it.
    """
    scaler = getattr(precision_plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    return scaler_scale(scaler)


class OptimizerSteps:
    """Which optimizer steps ran, counted by a step post-hook per optimizer: no read of the device.

    A GradScaler that found inf or NaN gradients skips the step by not calling ``optimizer.step()`` (it read
    ``found_inf`` on the host to decide); a step post-hook (``Optimizer.register_step_post_hook``) counts the calls,
    so a skipped step is one whose count did not move. Comparing the loss scale before and after the step instead
    reads the device, which on a GPU makes the host wait for the optimizer's kernels.
    """

    def __init__(self) -> None:
        # Made at the first count, in the rank's process: a launcher pickles the strategy before (spawn).
        self._counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]] | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def count(self, optimizer: object) -> int | None:
        """The steps ``optimizer`` took so far (from the first call on); ``None`` for an object that is no optimizer."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        if self._counts is None:
            self._counts = weakref.WeakKeyDictionary()
        cell = self._counts.get(optimizer)
        if cell is None:
            cell = self._counts[optimizer] = [0]
            self._handles.append(optimizer.register_step_post_hook(lambda *_: cell.__setitem__(0, cell[0] + 1)))
        return cell[0]

    def skipped(self, optimizer: object, before: int | None) -> bool:
        """Whether the step since ``before`` (:meth:`count` before it) did not run."""
        return before is not None and self.count(optimizer) == before

    def close(self) -> None:
        """Remove the hooks from the optimizers."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._counts = [], None
