"""The pure update rule: the scaler's configuration, its state, and the state after one step.

Nothing here touches arrays or devices. :class:`ScalerConfig` and
:class:`ScalerState` are frozen; :func:`next_state` is a pure function of the
config, the previous state and whether the step overflowed. The field
validators shared with the checkpoint live here too, so that every value the
scaler can hold is checked by the same code (over :mod:`cupy_amp.validation`). :func:`power_of_two` writes
a scale for people (the CLI's and the demo's output).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np

from cupy_amp.errors import ConfigError
from cupy_amp.validation import INT_MAX, as_real_float, expect_float, expect_int, invalid, is_real

__all__ = [
    "FLOAT32_MAX",
    "HEADROOM",
    "PYTORCH",
    "RULES",
    "SMALLEST_SCALE",
    "GradScalerStats",
    "ScalerConfig",
    "ScalerState",
    "expect_scale",
    "headroom_state",
    "initial_state",
    "inverse_scale",
    "next_state",
    "power_of_two",
    "to_float32",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)
# The scale rules a scaler can follow (ScalerConfig.rule): PyTorch's, and the headroom rule (headroom_state).
PYTORCH, HEADROOM = "pytorch", "headroom"
RULES = (PYTORCH, HEADROOM)
# The smallest float32 whose float32 inverse is finite (2**-128 + 2**-149): below it the
# inverse is inf and unscaling would turn finite gradients into inf/nan.
SMALLEST_SCALE = float.fromhex("0x1.000008p-128")
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


def expect_scale(error: type[Exception], name: str, value: object) -> float:
    """Return ``value`` rounded to float32, refusing what the scaler cannot use as a scale.

    The scale and its clamps live in float32, as PyTorch keeps its scale, and a
    scale must have a finite float32 inverse: below :data:`SMALLEST_SCALE`,
    unscaling would turn finite gradients into inf/nan.
    """
    expected = f"a float32 value from 2**-128 + 2**-149 (about {SMALLEST_SCALE:.4g}) to {FLOAT32_MAX:.6g}"
    as_float = as_real_float(value) if is_real(value) else math.nan  # type: ignore[arg-type]
    rounded = to_float32(as_float) if math.isfinite(as_float) else math.nan
    if not SMALLEST_SCALE <= rounded <= FLOAT32_MAX:
        raise invalid(error, name, expected, value)
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
        rule: How the scale moves: ``"pytorch"`` (PyTorch's rule, the default) or
            ``"headroom"`` (:func:`next_state` gives both; the latter needs ``hysteresis=1``).
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    hysteresis: int = 1
    rule: str = PYTORCH

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
        if self.rule not in RULES:
            raise ConfigError(f"Invalid 'rule': expected one of {', '.join(map(repr, RULES))}, got {self.rule!r}.")
        if self.rule == HEADROOM and self.hysteresis != 1:
            raise ConfigError(
                f"Invalid 'hysteresis': expected 1 with rule='headroom' (it backs off at every overflow), "
                f"got {self.hysteresis!r}. Pass hysteresis=1, or rule='pytorch'."
            )
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ConfigError(
                f"Invalid 'min_scale': expected a value <= max_scale ({self.max_scale!r}), got {self.min_scale!r}."
            )

    @property
    def ceiling(self) -> float:
        """The largest scale a growth can reach: ``max_scale``, or :data:`FLOAT32_MAX` without one."""
        return FLOAT32_MAX if self.max_scale is None else self.max_scale

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
        overflow_scale: ``rule="headroom"``: the scale of the latest overflow (0: none yet).
        overflow_norm: The norm of the last clean step (with ``check()``) before that overflow (0: none).
        clean_scale: The highest scale seen clean below ``overflow_scale`` (0: none).
        clean_norm: The norm of the last clean step with ``check()`` (0: none).
        overflows_in_row: Overflowing steps in a row (with ``rule="headroom"``; else 0).

    The last five are the headroom rule's memory; PyTorch's rule leaves them 0.
    """

    scale: float
    consecutive_good_steps: int
    hysteresis_tracker: int
    steps: int = 0
    skipped_steps: int = 0
    growths: int = 0
    backoffs: int = 0
    remote_skipped_steps: int = 0
    overflow_scale: float = 0.0
    overflow_norm: float = 0.0
    clean_scale: float = 0.0
    clean_norm: float = 0.0
    overflows_in_row: int = 0


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
    config: ScalerConfig,
    state: ScalerState,
    found_overflow: bool,
    found_overflow_local: bool | None = None,
    norm: float = math.nan,
) -> ScalerState:
    """Return the state after a step that did or did not overflow.

    ``found_overflow`` is the verdict all ranks agreed on;
    ``found_overflow_local`` whether this process's own gradients overflowed
    (defaults to the verdict, as in a single process). It only feeds the
    ``remote_skipped_steps`` counter. ``norm`` is the step's ``check()`` norm
    (NaN without one); only ``rule="headroom"`` reads it (:func:`headroom_state`).

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
    if config.rule == HEADROOM:
        return headroom_state(config, state, found_overflow, found_overflow_local, norm)
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


# How far the headroom rule climbs after each clean step until its first overflow: growth_factor**4.
CLIMB = 4
# The most growth factors the headroom rule counts between two scales (more would never be probed anyway).
MAX_FACTORS = 64
# From the 6th overflow in a row on, a descent with no clean scale known below is backoff_factor**32 a step.
MAX_DESCENT = 6


def _times(value: float, factor: float, count: int) -> float:
    """``value`` multiplied ``count`` times by ``factor``, each product in float64 rounded to float32."""
    for _ in range(count):
        value = to_float32(value * factor)
    return value


def _factors_between(low: float, high: float, factor: float) -> int:
    """The fewest products by ``factor`` that take ``low`` to ``high`` or above (1 to :data:`MAX_FACTORS`)."""
    count, value = 0, low
    while count < MAX_FACTORS:
        value, count = to_float32(value * factor), count + 1
        if value >= high:
            break
    return count


def headroom_state(
    config: ScalerConfig, state: ScalerState, found_overflow: bool, found_overflow_local: bool | None, norm: float
) -> ScalerState:
    """The headroom rule: the state after one step, from where overflows happened and how the norm moved.

    With s the step's scale, g the growth factor, b the backoff factor, every product in float64 rounded
    to float32, every result clamped to ``[min_scale, max_scale]`` (a growth that would reach inf keeps s),
    and gap(L, H) the fewest products by g that take L to H or above (at most 64)::

        overflow (at s), r = overflows in a row, this one included:
            L = clean_scale if clean_scale < s else 0     (a clean scale known below)
            overflow_scale, overflow_norm, clean_scale = s, clean_norm, L
            L == 0:          scale = s * b**(2**(min(r, 6) - 1))      (2x, 4x, 16x... from a start too high)
            gap(L, s) >= 2:  scale = min(L * g**(gap // 2), s * b)   (halfway, in exponents; at least min_scale)
            else:            scale = s * b
        clean (at s), norm n (NaN without check()):
            clean_norm = n if n is finite and > 0
            clean_scale = max(clean_scale, s) if overflow_scale == 0 or s < overflow_scale
            overflow_scale == 0:  scale = s * g**4      (no overflow yet: climb from a start too low)
            else:
                gap(clean_scale, overflow_scale) >= 2:  scale = max(clean_scale * g**(gap // 2), s)
                else: PyTorch's growth (after growth_interval clean steps, * g), then, if overflow_norm > 0
                      and n > 0: with E = overflow_scale * overflow_norm / n (float64: where the last
                      overflow's ceiling has moved as the norm fell), j the most products by g that keep
                      scale at or below E, scale = scale * g**(j - 1) if j >= 2 (one factor of margin)

    Every change of the scale but PyTorch's growth restarts the count of clean steps. A growth counts
    in ``growths`` and a lowering in ``backoffs``, as with PyTorch's rule.
    """
    scale = old = state.scale
    steps = state.steps + 1
    if found_overflow:
        in_row = min(state.overflows_in_row + 1, INT_MAX)
        below = state.clean_scale if state.clean_scale < old else 0.0
        backed = max(to_float32(old * config.backoff_factor), config.floor)
        if below == 0.0:
            factor = config.backoff_factor
            for _ in range(min(in_row, MAX_DESCENT) - 1):
                factor *= factor
            scale = max(to_float32(old * factor), config.floor)
        elif (gap := _factors_between(below, old, config.growth_factor)) >= 2:
            scale = max(min(_times(below, config.growth_factor, gap // 2), backed), config.floor)
        else:
            scale = backed
        return dataclasses.replace(
            state,
            scale=scale,
            consecutive_good_steps=0,
            steps=steps,
            skipped_steps=state.skipped_steps + 1,
            backoffs=state.backoffs + (scale != old),
            remote_skipped_steps=state.remote_skipped_steps + (found_overflow_local is False),
            overflow_scale=old,
            overflow_norm=state.clean_norm,
            clean_scale=below,
            overflows_in_row=in_row,
        )
    clean_norm = norm if math.isfinite(norm) and norm > 0 else state.clean_norm
    clean_scale, good = state.clean_scale, 0
    if state.overflow_scale == 0.0:
        clean_scale = max(clean_scale, old)  # below whatever overflows first
        grown = _times(old, config.growth_factor, CLIMB)
        scale = min(grown, config.ceiling) if math.isfinite(grown) else old
    else:
        if old < state.overflow_scale:
            clean_scale = max(clean_scale, old)
        gap = _factors_between(clean_scale, state.overflow_scale, config.growth_factor) if clean_scale else 1
        if gap >= 2:  # never below the clean step's own scale
            scale = min(max(_times(clean_scale, config.growth_factor, gap // 2), old), config.ceiling)
        else:
            good = state.consecutive_good_steps + 1
            if good >= config.growth_interval:
                grown = to_float32(old * config.growth_factor)
                if math.isfinite(grown):
                    scale = min(grown, config.ceiling)
                good = 0
            if state.overflow_norm > 0 and math.isfinite(norm) and norm > 0:
                estimate = state.overflow_scale * state.overflow_norm / norm
                products, value = 0, scale
                while products < MAX_FACTORS and (grown := to_float32(value * config.growth_factor)) <= estimate:
                    value, products = grown, products + 1
                if products >= 2:
                    scale, good = min(_times(scale, config.growth_factor, products - 1), config.ceiling), 0
    return dataclasses.replace(
        state,
        scale=scale,
        consecutive_good_steps=good,
        steps=steps,
        growths=state.growths + (scale != old),
        clean_scale=clean_scale,
        clean_norm=clean_norm,
        overflows_in_row=0,
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
