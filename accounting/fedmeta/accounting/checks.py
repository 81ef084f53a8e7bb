"""The checks accounting's validated values share: an integer, a finite number > 0, a rate.

An integer at least ``minimum``, a finite number above 0, a number in (0, 1].

Each raises one ``ValueError`` line naming the field, ``"<field> must be ...; got <value>"``, and
returns the value narrowed to its type. A bool is refused where a number is wanted: it is an int
subclass, and ``True`` participants or a noise multiplier of ``True`` is a bug, not 1.
"""

from __future__ import annotations

import math

__all__ = ["check_int", "check_positive", "check_rate"]


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` as an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return value


def check_positive(name: str, value: object) -> float:
    """``value`` as a finite number ``> 0``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    return float(value)


def check_rate(name: str, value: object) -> float:
    """``value`` as a number in ``(0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}")
    return float(value)
