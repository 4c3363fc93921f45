"""Argument checks shared by every layer: each raises a ``ValueError`` or ``TypeError`` that
names the argument, what was expected and what arrived; and how errors quote a model's
context."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Callable

__all__ = ["is_int", "positive_int", "int_at_least", "int_in_range", "real_number", "context_text"]


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def positive_int(value: Any, name: str) -> int:
    """``value`` as an ``int`` >= 1."""
    if type(value) is int and value >= 1:  # the common case, without the ABC check
        return value
    if not is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def int_at_least(value: Any, name: str, low: int, *, or_none: bool = False) -> int | None:
    """``value`` as an ``int`` >= ``low`` (``None`` passes through with ``or_none``)."""
    if type(value) is int and value >= low:  # the common case, without the ABC check
        return value
    if value is None and or_none:
        return None
    if not is_int(value) or value < low:
        tail = " or None" if or_none else ""
        raise ValueError(f"{name}: expected an integer >= {low}{tail}, got {value!r}")
    return int(value)


def int_in_range(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an ``int`` in ``[low, high]``."""
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name}: expected an integer in [{low}, {high}], got {value!r}")
    return int(value)


def real_number(value: Any, name: str, expected: str = "a finite number",
                valid: Callable[[float], bool] = lambda x: True) -> float:
    """``value`` as a finite ``float`` for which ``valid`` holds; ``expected`` says which."""
    if (isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)
            or not valid(float(value))):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


def context_text(positions: int, cap: str | None = None) -> str:
    """How errors quote a model's context: ``the model's context of N``, and what capped it
    (``cap``) where something did."""
    why = f" ({cap}: attention is exact only within it)" if cap else ""
    return f"the model's context of {positions}{why}"
