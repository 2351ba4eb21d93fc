"""Version checks for torch and Lightning, in one place; warned on rank 0 only."""

import lightning
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.imports import compare_version

__all__ = ["LIGHTNING_TESTED_RANGE", "check_lightning_version"]

#: The Lightning releases whose private ``DDPStrategy`` methods the strategy overrides and that CI tests.
LIGHTNING_TESTED_RANGE = ("2.6.0", "2.7.0")

_TORCH_GREATER_EQUAL_2_4 = compare_version("torch", lambda a, b: a >= b, "2.4.0")


def check_lightning_version() -> None:
    """Warn once when the installed Lightning is outside the range whose private methods we override."""
    low, high = LIGHTNING_TESTED_RANGE
    installed = lightning.__version__
    in_range = compare_version("lightning", lambda a, b: a >= b, low) and not compare_version(
        "lightning", lambda a, b: a >= b, high
    )
    if not in_range:
        rank_zero_warn(
            f"lightning_ddpopt is tested with lightning>={low},<{high}; lightning {installed} is installed. "
            "OptimizedDDPStrategy overrides private DDPStrategy methods that may have changed.",
            category=RuntimeWarning,
            stacklevel=6,
        )
    if not _TORCH_GREATER_EQUAL_2_4:
        rank_zero_warn(
            f"lightning_ddpopt needs torch>=2.4; torch {torch.__version__} is installed.",
            category=RuntimeWarning,
            stacklevel=6,
        )
