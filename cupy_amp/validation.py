"""Argument and field validators of one shape: ``Invalid 'name': expected <what>, got <value>.``

The scaler's configuration, its checkpoint and its calls check every value
with these, each raising the error type its caller names (``ConfigError``,
``CheckpointFieldError``...), so a message reads the same wherever a value
is refused. The scale's own check, which knows the float32 range, is
:func:`cupy_amp.rule.expect_scale`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["INT_MAX", "as_real_float", "expect_bool", "expect_float", "expect_int", "invalid", "is_real"]

# The largest integer a checkpoint can store (msgpack's uint64): every integer field is at most this.
INT_MAX = 2**64 - 1


def invalid(error: type[Exception], name: str, expected: str, got: object) -> Exception:
    """Return ``error`` saying that ``name`` expected ``expected`` and got ``got``."""
    return error(f"Invalid {name!r}: expected {expected}, got {got!r}.")


def is_real(value: object) -> bool:
    """Return whether ``value`` is a real number and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def as_real_float(value: numbers.Real) -> float:
    """Return ``value`` as a float, ±inf where it is too large for one."""
    # An int (or Fraction) too large for a float64 is out of every range: treat it as inf.
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def expect_bool(error: type[Exception], name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (``np.bool_`` included); ints are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise invalid(error, name, "a bool", value)


def expect_int(error: type[Exception], name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer (not a bool) in ``[minimum, INT_MAX]``."""
    expected = f"an int >= {minimum}"
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        as_int = int(value)
        if minimum <= as_int <= INT_MAX:
            return as_int
        if as_int > INT_MAX:
            expected += " that a checkpoint can store (< 2**64)"
    raise invalid(error, name, expected, value)


def expect_float(
    error: type[Exception], name: str, value: object, *, above: float, below: float | None = None
) -> float:
    """Return ``value`` as a finite float strictly between ``above`` and ``below``."""
    expected = f"a finite float > {above:g}" + ("" if below is None else f" and < {below:g}")
    as_float = as_real_float(value) if is_real(value) else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(as_float) and as_float > above and (below is None or as_float < below)):
        raise invalid(error, name, expected, value)
    return as_float
