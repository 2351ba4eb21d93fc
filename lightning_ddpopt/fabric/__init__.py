"""Lightning Fabric: the strategy, the measuring callbacks' monitor and fp16 precision for hand-written loops.

Importing this module (or :mod:`lightning_ddpopt`) registers the strategy's names in Fabric's registry, so
``Fabric(strategy="ddp_optimized")`` works as ``Trainer(strategy="ddp_optimized")`` does.
"""

from lightning.fabric.plugins.precision import MixedPrecision

from lightning_ddpopt.fabric.monitor import Monitor
from lightning_ddpopt.fabric.strategy import OptimizedDDPStrategy
from lightning_ddpopt.precision import fp16_grad_scaler

__all__ = ["Monitor", "OptimizedDDPStrategy", "fp16_mixed_precision"]


def fp16_mixed_precision(
    device: str = "cuda",
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> MixedPrecision:
    """Fabric's ``MixedPrecision("16-mixed")`` plugin with the given GradScaler settings.

    Pass it as ``Fabric(plugins=[fp16_mixed_precision(...)])``. On ``device="cpu"`` it runs real fp16 autocast with
    a GradScaler (Fabric turns a plain ``precision="16-mixed"`` into bf16 on CPU).

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        init_scale: the first loss scale.
        growth_factor: multiplies the scale after ``growth_interval`` steps without overflow (> 1).
        backoff_factor: multiplies the scale at every overflow, whose optimizer step is skipped (in (0, 1)).
        growth_interval: overflow-free steps between two growths (>= 1).
    """
    scaler = fp16_grad_scaler(device, init_scale, growth_factor, backoff_factor, growth_interval)
    return MixedPrecision("16-mixed", device, scaler=scaler)
