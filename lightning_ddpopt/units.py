"""How the package writes sizes and durations: bytes in decimal units, bucket caps in MiB, times in ms or s.

Every size the package prints (gradients, bytes sent, report plots, ``ddpopt plan``, the benchmarks) is in decimal
units, B, kB, MB and GB of 10^3, 10^6 and 10^9 bytes, as Lightning's model summary and bandwidths in GB/s count them.
The one exception is arguments named ``*_mb`` (``bucket_cap_mb``, ``probe_mb``): they count MiB (2^20 bytes), as DDP's
``bucket_cap_mb`` does, and are written "MiB". Durations in sentences (the plan's, local SGD's choice of H) are
in ms below a second, else seconds to the hundredth.
"""

from __future__ import annotations

__all__ = ["MIB", "byte_unit", "format_bytes", "format_seconds"]

#: One MiB, the unit of DDP's ``bucket_cap_mb``.
MIB = 1024 * 1024

_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def byte_unit(nbytes: float) -> tuple[float, str]:
    """The largest decimal unit that keeps ``nbytes`` at 1 or more, as (bytes per unit, name): ``(1e6, 'MB')``."""
    for scale, unit in _UNITS:
        if abs(nbytes) >= scale:
            return scale, unit
    return 1.0, "B"


def format_bytes(nbytes: float) -> str:
    """Bytes in :func:`byte_unit`'s unit to 3 significant digits.

    ``format_bytes(4_506_000) == '4.51 MB'``, ``format_bytes(2_100) == '2.1 kB'``, ``format_bytes(12) == '12 B'``.
    """
    scale, unit = byte_unit(nbytes)
    text = _three_digits(nbytes / scale)
    if float(text) >= 1000 and scale < _UNITS[0][0]:  # rounded up to the next unit: 999,999 bytes is 1 MB
        scale, unit = next((s, u) for s, u in reversed(_UNITS) if s > scale)
        text = _three_digits(nbytes / scale)
    return f"{text} {unit}" if scale > 1 else f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """A duration in words, 3 significant digits below 10 ms, whole ms below a second, else seconds to the hundredth.

    ``format_seconds(0.00042) == '0.42 ms'``, ``format_seconds(0.0204) == '20 ms'``, ``format_seconds(1.234) ==
    '1.23 s'``.
    """
    if seconds < 0.01:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e3:.0f} ms" if seconds < 0.9995 else f"{seconds:.2f} s"


def _three_digits(value: float) -> str:
    decimals = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{value:.0f}"
