"""Argument checks shared by the constructors: one wording for every "must be an int >= N" error."""

from __future__ import annotations

__all__ = ["require_int"]


def require_int(name: str, value: object, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{hint}")
    return value
