"""Argument checks shared by the constructors: one wording for every "must be an int >= N" error."""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_real_number", "require_int", "require_number"]


def is_real_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float, and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def require_int(name: str, value: object, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{hint}")
    return value


def require_number(name: str, value: object, minimum: float = 0.0, *, strict: bool = True) -> float:
    """Return ``value`` if it is a real number above ``minimum`` (or at least it, with ``strict=False``)."""
    if not is_real_number(value) or (value <= minimum if strict else value < minimum):
        relation = "a positive number" if strict and minimum == 0 else f"a number {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}={value!r} must be {relation}")
    return float(value)
