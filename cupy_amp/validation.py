"""Small field validators shared by the scaler's config and the checkpoint.

Each validator takes the field name, the value and the exception class to
raise, and returns the value normalised to a plain Python type. Messages
follow one shape: ``Invalid 'name': expected <what>, got <value>.``
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = [
    "expect_bool",
    "expect_float",
    "expect_float32",
    "expect_int",
    "invalid",
]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def invalid(error: type[Exception], name: str, expected: str, got: object) -> Exception:
    """Build the standard "Invalid 'name': expected X, got Y." exception."""
    return error(f"Invalid {name!r}: expected {expected}, got {got!r}.")


def expect_bool(error: type[Exception], name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (``np.bool_`` included); ints are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise invalid(error, name, "a bool", value)


def expect_int(error: type[Exception], name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        as_int = int(value)
        if as_int >= minimum:
            return as_int
    raise invalid(error, name, f"an int >= {minimum}", value)


def expect_float(
    error: type[Exception],
    name: str,
    value: object,
    *,
    above: float | None = None,
    below: float | None = None,
    at_least: float | None = None,
) -> float:
    """Return ``value`` as a finite float inside the given open/closed bounds.

    Args:
        error: Exception class to raise.
        name: Field name, quoted in the message.
        value: The value to check; ints and NumPy reals are accepted, bools are not.
        above: Exclusive lower bound.
        below: Exclusive upper bound.
        at_least: Inclusive lower bound.
    """
    expected = _describe_bounds(above, below, at_least)
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise invalid(error, name, expected, value)
    as_float = _as_float(value)
    if not math.isfinite(as_float):
        raise invalid(error, name, expected, value)
    if above is not None and not as_float > above:
        raise invalid(error, name, expected, value)
    if below is not None and not as_float < below:
        raise invalid(error, name, expected, value)
    if at_least is not None and not as_float >= at_least:
        raise invalid(error, name, expected, value)
    return as_float


def expect_float32(error: type[Exception], name: str, value: object, *, allow_zero: bool = False) -> float:
    """Return ``value`` rounded to float32, requiring a finite result > 0 (or >= 0).

    The scale and its clamps live in float32, as PyTorch keeps its scale; a
    value that rounds to 0 or overflows float32 is refused rather than
    silently changed into something else.
    """
    bound = ">= 0" if allow_zero else "> 0"
    expected = f"a finite float {bound} that float32 can hold (at most {_FLOAT32_MAX:.6g})"
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise invalid(error, name, expected, value)
    as_float = _as_float(value)
    negative = math.copysign(1.0, as_float) < 0  # -0.0 too: its inverse would be -inf
    if not math.isfinite(as_float) or negative or (as_float == 0 and not allow_zero):
        raise invalid(error, name, expected, value)
    with np.errstate(over="ignore", under="ignore"):
        rounded = float(np.float32(as_float))
    if not math.isfinite(rounded) or (rounded == 0 and as_float != 0):
        raise invalid(error, name, expected, value)
    return rounded


def _as_float(value: numbers.Real) -> float:
    # An int (or Fraction) too large for a float64 is out of every range: treat it as inf.
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def _describe_bounds(above: float | None, below: float | None, at_least: float | None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if at_least is not None:
        parts.append(f">= {at_least:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    return "a finite float" + (" " + " and ".join(parts) if parts else "")
