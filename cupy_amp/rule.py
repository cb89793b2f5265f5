"""The pure update rule: the scaler's configuration, its state, and the state after one step.

Nothing here touches arrays or devices. :class:`ScalerConfig` and
:class:`ScalerState` are frozen; :func:`next_state` is a pure function of the
config, the previous state and whether the step overflowed. The field
validators shared with the checkpoint live here too, so that every value the
scaler can hold is checked by the same code, with messages of one shape:
``Invalid 'name': expected <what>, got <value>.`` :func:`power_of_two` writes
a scale for people (the CLI's and the demo's output).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np

from cupy_amp.errors import ConfigError

__all__ = [
    "FLOAT32_MAX",
    "INT_MAX",
    "SMALLEST_SCALE",
    "GradScalerStats",
    "ScalerConfig",
    "ScalerState",
    "expect_bool",
    "expect_float",
    "expect_int",
    "expect_scale",
    "initial_state",
    "inverse_scale",
    "next_state",
    "power_of_two",
    "to_float32",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest float32 whose float32 inverse is finite (2**-128 + 2**-149): below it the
# inverse is inf and unscaling would turn finite gradients into inf/nan.
SMALLEST_SCALE = float.fromhex("0x1.000008p-128")
# The largest integer a checkpoint can store (msgpack's uint64): every integer field is at most this.
INT_MAX = 2**64 - 1
# The smallest magnitude that rounds to infinity in float32 (halfway past the largest finite value).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, returned as a Python float."""
    # Overflow is decided here rather than under np.errstate, which costs microseconds per call.
    if abs(value) >= _FLOAT32_OVERFLOW:
        return math.copysign(math.inf, value)
    return float(np.float32(value))


def inverse_scale(scale: float) -> np.float32:
    """Return ``float32(1 / float64(scale))``, finite for every scale the scaler can hold (>= SMALLEST_SCALE)."""
    # np.float32(...) is typed as returning Any by NumPy's stubs.
    return cast(np.float32, np.float32(1.0 / scale))


def _invalid(error: type[Exception], name: str, expected: str, got: object) -> Exception:
    return error(f"Invalid {name!r}: expected {expected}, got {got!r}.")


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _as_float(value: numbers.Real) -> float:
    # An int (or Fraction) too large for a float64 is out of every range: treat it as inf.
    try:
        return float(value)
    except OverflowError:
        return -math.inf if value < 0 else math.inf


def expect_bool(error: type[Exception], name: str, value: object) -> bool:
    """Return ``value`` if it is a bool (``np.bool_`` included); ints are refused."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise _invalid(error, name, "a bool", value)


def expect_int(error: type[Exception], name: str, value: object, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer (not a bool) in ``[minimum, INT_MAX]``."""
    expected = f"an int >= {minimum}"
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        as_int = int(value)
        if minimum <= as_int <= INT_MAX:
            return as_int
        if as_int > INT_MAX:
            expected += " that a checkpoint can store (< 2**64)"
    raise _invalid(error, name, expected, value)


def expect_float(
    error: type[Exception], name: str, value: object, *, above: float, below: float | None = None
) -> float:
    """Return ``value`` as a finite float strictly between ``above`` and ``below``."""
    expected = f"a finite float > {above:g}" + ("" if below is None else f" and < {below:g}")
    as_float = _as_float(value) if _is_real(value) else math.nan  # type: ignore[arg-type]
    if not (math.isfinite(as_float) and as_float > above and (below is None or as_float < below)):
        raise _invalid(error, name, expected, value)
    return as_float


def expect_scale(error: type[Exception], name: str, value: object) -> float:
    """Return ``value`` rounded to float32, refusing what the scaler cannot use as a scale.

    The scale and its clamps live in float32, as PyTorch keeps its scale, and a
    scale must have a finite float32 inverse: below :data:`SMALLEST_SCALE`,
    unscaling would turn finite gradients into inf/nan.
    """
    expected = f"a float32 value from 2**-128 + 2**-149 (about {SMALLEST_SCALE:.4g}) to {FLOAT32_MAX:.6g}"
    as_float = _as_float(value) if _is_real(value) else math.nan  # type: ignore[arg-type]
    rounded = to_float32(as_float) if math.isfinite(as_float) else math.nan
    if not SMALLEST_SCALE <= rounded <= FLOAT32_MAX:
        raise _invalid(error, name, expected, value)
    return rounded


@dataclass(frozen=True)
class ScalerConfig:
    """How the loss scale adapts; validated on construction.

    Attributes:
        growth_factor: Multiplier applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: Multiplier applied on overflow (strictly between 0 and 1).
        growth_interval: Clean steps in a row before the scale grows (int >= 1).
        min_scale: Floor of the scale after a backoff, or None for none but
            :data:`SMALLEST_SCALE`. Held in float32.
        max_scale: Ceiling of the scale after a growth, or None for none (growth
            still never makes the scale infinite). Held in float32.
        hysteresis: Overflowing steps needed before the scale backs off (int >= 1);
            the count refills whenever the scale grows.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    hysteresis: int = 1

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        set_field(self, "growth_factor", expect_float(ConfigError, "growth_factor", self.growth_factor, above=1.0))
        set_field(
            self, "backoff_factor", expect_float(ConfigError, "backoff_factor", self.backoff_factor, above=0, below=1)
        )
        set_field(self, "growth_interval", expect_int(ConfigError, "growth_interval", self.growth_interval, 1))
        set_field(self, "hysteresis", expect_int(ConfigError, "hysteresis", self.hysteresis, 1))
        if self.min_scale is not None:
            set_field(self, "min_scale", expect_scale(ConfigError, "min_scale", self.min_scale))
        if self.max_scale is not None:
            set_field(self, "max_scale", expect_scale(ConfigError, "max_scale", self.max_scale))
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ConfigError(
                f"Invalid 'min_scale': expected a value <= max_scale ({self.max_scale!r}), got {self.min_scale!r}."
            )

    @property
    def floor(self) -> float:
        """The smallest scale a backoff can reach: ``min_scale``, or :data:`SMALLEST_SCALE` without one."""
        return SMALLEST_SCALE if self.min_scale is None else self.min_scale

    def refuse_out_of_range(
        self, scale: float, name: str, error: type[Exception] = ConfigError, *, remedy: bool = False
    ) -> None:
        """Raise ``error`` if ``scale`` lies outside ``[min_scale, max_scale]`` (with ``remedy``: say which
        constructor argument lets it in)."""
        if self.min_scale is not None and scale < self.min_scale:
            advice = " Pass a lower min_scale, or min_scale=None for no floor." if remedy else ""
            raise error(f"Invalid {name!r}: expected a value >= min_scale ({self.min_scale!r}), got {scale!r}.{advice}")
        if self.max_scale is not None and scale > self.max_scale:
            advice = " Pass a higher max_scale, or max_scale=None for no ceiling (as PyTorch's)." if remedy else ""
            raise error(f"Invalid {name!r}: expected a value <= max_scale ({self.max_scale!r}), got {scale!r}.{advice}")


@dataclass(frozen=True, slots=True)
class ScalerState:
    """Everything that changes from step to step (one is built per step, hence slots).

    Attributes:
        scale: The loss scale; always a float32 value in ``[SMALLEST_SCALE, FLOAT32_MAX]``.
        consecutive_good_steps: Clean steps in a row since the last growth or overflow.
        hysteresis_tracker: Overflows still tolerated before the next backoff.
        steps: ``update()`` calls made while enabled.
        skipped_steps: Of those, the steps that overflowed.
        growths: Times the scale grew.
        backoffs: Times the scale shrank.
        remote_skipped_steps: Of the skipped steps, those where this process's own
            gradients were finite and only another rank's overflowed.
    """

    scale: float
    consecutive_good_steps: int
    hysteresis_tracker: int
    steps: int = 0
    skipped_steps: int = 0
    growths: int = 0
    backoffs: int = 0
    remote_skipped_steps: int = 0


@dataclass(frozen=True)
class GradScalerStats:
    """A scaler's state at the moment its ``stats()`` was called (either scaler).

    Attributes:
        scale: The stored loss scale (also while the scaler is disabled).
        consecutive_good_steps: Clean steps in a row since the last growth or overflow.
        hysteresis_tracker: Overflows still tolerated before the next backoff.
        enabled: Whether scaling is on.
        steps: ``update()`` calls made while enabled, skipped or not.
        skipped_steps: Of those, the steps whose gradients overflowed.
        growths: Times the scale grew.
        backoffs: Times the scale shrank.
        remote_skipped_steps: Skipped steps whose overflow was on another rank only
            (this process's gradients were finite); always 0 without a communicator.
        last_overflow: Where the current (or last) step's overflow was: "none",
            "local" (this process's gradients) or "remote" (another rank's only).
    """

    scale: float
    consecutive_good_steps: int
    hysteresis_tracker: int
    enabled: bool
    steps: int
    skipped_steps: int
    growths: int
    backoffs: int
    remote_skipped_steps: int
    last_overflow: str

    @classmethod
    def of(cls, state: ScalerState, enabled: bool, overflow: bool, local: bool) -> GradScalerStats:
        """Build the snapshot of ``state``, whose last step did (or did not) overflow, here or elsewhere."""
        return cls(
            scale=state.scale,
            consecutive_good_steps=state.consecutive_good_steps,
            hysteresis_tracker=state.hysteresis_tracker,
            enabled=enabled,
            steps=state.steps,
            skipped_steps=state.skipped_steps,
            growths=state.growths,
            backoffs=state.backoffs,
            remote_skipped_steps=state.remote_skipped_steps,
            last_overflow=("local" if local else "remote") if overflow else "none",
        )

    def to_dict(self) -> dict[str, float | int | bool | str]:
        """Return the fields as a plain dict (for loggers such as TensorBoard or W&B)."""
        return asdict(self)

    def __str__(self) -> str:
        # One line, field=value with the field names; nine significant digits name every float32 exactly.
        fields = " ".join(f"{name}={value}" for name, value in asdict(self).items() if name != "scale")
        return f"scale={self.scale:.9g} {fields}"


def initial_state(config: ScalerConfig, init_scale: object) -> ScalerState:
    """Return the state a new scaler starts from.

    Raises:
        ConfigError: ``init_scale`` is no valid scale, or lies outside the clamps.
    """
    scale = expect_scale(ConfigError, "init_scale", init_scale)
    config.refuse_out_of_range(scale, "init_scale", remedy=True)
    return ScalerState(scale=scale, consecutive_good_steps=0, hysteresis_tracker=config.hysteresis)


def next_state(
    config: ScalerConfig, state: ScalerState, found_overflow: bool, found_overflow_local: bool | None = None
) -> ScalerState:
    """Return the state after a step that did or did not overflow.

    ``found_overflow`` is the verdict all ranks agreed on;
    ``found_overflow_local`` whether this process's own gradients overflowed
    (defaults to the verdict, as in a single process). It only feeds the
    ``remote_skipped_steps`` counter.

    The rule, with products taken in float64 and rounded to float32::

        if found_overflow:
            consecutive_good_steps = 0
            hysteresis_tracker = max(hysteresis_tracker - 1, 0)
            if hysteresis_tracker == 0:
                scale = max(float32(scale * backoff_factor), min_scale or SMALLEST_SCALE)
        else:
            consecutive_good_steps += 1
            if consecutive_good_steps >= growth_interval:
                grown = float32(scale * growth_factor)
                if isfinite(grown):
                    scale = min(grown, max_scale)
                consecutive_good_steps = 0
                hysteresis_tracker = hysteresis
    """
    scale = state.scale
    if found_overflow:
        hysteresis_tracker = max(state.hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:
            scale = max(to_float32(scale * config.backoff_factor), config.floor)
        return ScalerState(
            scale=scale,
            consecutive_good_steps=0,
            hysteresis_tracker=hysteresis_tracker,
            steps=state.steps + 1,
            skipped_steps=state.skipped_steps + 1,
            growths=state.growths,
            backoffs=state.backoffs + (scale != state.scale),
            remote_skipped_steps=state.remote_skipped_steps + (found_overflow_local is False),
        )
    good_steps = state.consecutive_good_steps + 1
    hysteresis_tracker = state.hysteresis_tracker
    if good_steps >= config.growth_interval:
        grown = to_float32(scale * config.growth_factor)
        if math.isfinite(grown):
            scale = grown if config.max_scale is None else min(grown, config.max_scale)
        good_steps = 0
        hysteresis_tracker = config.hysteresis
    return ScalerState(
        scale=scale,
        consecutive_good_steps=good_steps,
        hysteresis_tracker=hysteresis_tracker,
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps,
        growths=state.growths + (scale != state.scale),
        backoffs=state.backoffs,
        remote_skipped_steps=state.remote_skipped_steps,
    )


def power_of_two(value: float) -> str | None:
    """Write ``value`` as ``2**N``, or ``m * 2**N`` with a mantissa of at most 10 bits, else return None.

    Loss scales are usually powers of two, and ``2**36`` reads better than
    68719476736 (the CLI writes scales so, and the demo its log's numbers).
    """
    if not (value > 0 and math.isfinite(value)):
        return None
    mantissa, exponent = math.frexp(value)  # value == mantissa * 2**exponent, 0.5 <= mantissa < 1
    mantissa, exponent = mantissa * 2, exponent - 1
    if mantissa == 1:
        return f"2**{exponent}"
    if (mantissa * 2**10).is_integer():  # e.g. 98304 is 1.5 * 2**16; long mantissas would not help
        return f"{mantissa!r} * 2**{exponent}"
    return None
