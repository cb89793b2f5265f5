"""The pure update rule: the scale's state after one optimizer step.

Nothing here touches arrays or devices; :func:`next_state` is a pure function
of the config, the previous state and whether the step overflowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from cupy_amp.config import ScalerConfig

__all__ = ["ScalerState", "inverse_scale", "next_state", "to_float32"]


@dataclass(frozen=True, slots=True)
class ScalerState:
    """Everything that changes from step to step.

    Attributes:
        scale: The loss scale; always a value float32 can hold exactly.
        growth_tracker: Clean steps in a row since the last growth or overflow.
        hysteresis_tracker: Overflows still tolerated before the next backoff.
        steps: ``update()`` calls made while enabled.
        skipped_steps: Of those, the steps that overflowed.
        growths: Times the scale grew.
        backoffs: Times the scale shrank.
        remote_skipped_steps: Of the skipped steps, those where this process's own
            gradients were finite and only another rank's overflowed.
    """

    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    steps: int = 0
    skipped_steps: int = 0
    growths: int = 0
    backoffs: int = 0
    remote_skipped_steps: int = 0


# The smallest magnitude that rounds to infinity in float32 (halfway past the largest finite value).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, returned as a Python float."""
    # Overflow is decided here rather than under np.errstate, which costs microseconds per call.
    if abs(value) >= _FLOAT32_OVERFLOW:
        return math.copysign(math.inf, value)
    return float(np.float32(value))


def inverse_scale(scale: float) -> np.float32:
    """Return ``float32(1 / float64(scale))``; infinite for a scale of 0."""
    # np.float32(...) is typed as returning Any by NumPy's stubs.
    return cast(np.float32, np.float32(math.inf if scale == 0.0 else to_float32(1.0 / scale)))


def next_state(
    config: ScalerConfig, state: ScalerState, found_overflow: bool, local_overflow: bool | None = None
) -> ScalerState:
    """Return the state after a step that did or did not overflow.

    ``found_overflow`` is the verdict all ranks agreed on; ``local_overflow``
    whether this process's own gradients overflowed (defaults to the verdict,
    as in a single process). It only feeds the ``remote_skipped_steps`` counter.

    The rule, with products taken in float64 and rounded to float32::

        if found_overflow:
            growth_tracker = 0
            hysteresis_tracker = max(hysteresis_tracker - 1, 0)
            if hysteresis_tracker == 0:
                scale = max(float32(scale * backoff_factor), min_scale)
        else:
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                grown = float32(scale * growth_factor)
                if isfinite(grown):
                    scale = min(grown, max_scale)
                growth_tracker = 0
                hysteresis_tracker = hysteresis
    """
    scale = state.scale
    if found_overflow:
        hysteresis_tracker = max(state.hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:
            scale = to_float32(state.scale * config.backoff_factor)
            if config.min_scale is not None:
                scale = max(scale, config.min_scale)
        return ScalerState(
            scale=scale,
            growth_tracker=0,
            hysteresis_tracker=hysteresis_tracker,
            steps=state.steps + 1,
            skipped_steps=state.skipped_steps + 1,
            growths=state.growths,
            backoffs=state.backoffs + (scale != state.scale),
            remote_skipped_steps=state.remote_skipped_steps + (local_overflow is False),
        )

    growth_tracker = state.growth_tracker + 1
    hysteresis_tracker = state.hysteresis_tracker
    if growth_tracker >= config.growth_interval:
        grown = to_float32(state.scale * config.growth_factor)
        if math.isfinite(grown):
            scale = grown if config.max_scale is None else min(grown, config.max_scale)
        growth_tracker = 0
        hysteresis_tracker = config.hysteresis
    return ScalerState(
        scale=scale,
        growth_tracker=growth_tracker,
        hysteresis_tracker=hysteresis_tracker,
        steps=state.steps + 1,
        skipped_steps=state.skipped_steps,
        growths=state.growths + (scale != state.scale),
        backoffs=state.backoffs,
        remote_skipped_steps=state.remote_skipped_steps,
    )
