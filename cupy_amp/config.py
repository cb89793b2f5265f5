"""The scaler's immutable configuration and its validation."""

from __future__ import annotations

from dataclasses import dataclass

from cupy_amp.errors import ConfigError
from cupy_amp.validation import expect_float, expect_float32, expect_int

__all__ = ["DEFAULT_INIT_SCALE", "ScalerConfig", "validate_scale_in_clamps"]

DEFAULT_INIT_SCALE = 65536.0


@dataclass(frozen=True)
class ScalerConfig:
    """How the loss scale adapts; validated on construction.

    Attributes:
        growth_factor: Multiplier applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: Multiplier applied on overflow (strictly between 0 and 1).
        growth_interval: Clean steps in a row before the scale grows (int >= 1).
        min_scale: Floor of the scale after a backoff, or None for no floor
            (the scale may then underflow to 0, as PyTorch's does). Held in float32.
        max_scale: Ceiling of the scale after a growth, or None for no ceiling
            (growth still never makes the scale infinite). Held in float32.
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
            self,
            "backoff_factor",
            expect_float(ConfigError, "backoff_factor", self.backoff_factor, above=0.0, below=1.0),
        )
        set_field(self, "growth_interval", expect_int(ConfigError, "growth_interval", self.growth_interval, 1))
        set_field(self, "hysteresis", expect_int(ConfigError, "hysteresis", self.hysteresis, 1))
        if self.min_scale is not None:
            set_field(self, "min_scale", expect_float32(ConfigError, "min_scale", self.min_scale))
        if self.max_scale is not None:
            set_field(self, "max_scale", expect_float32(ConfigError, "max_scale", self.max_scale))
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ConfigError(
                f"Invalid 'min_scale': expected a value <= max_scale ({self.max_scale!r}), got {self.min_scale!r}."
            )


def validate_scale_in_clamps(
    config: ScalerConfig, scale: float, name: str, error: type[Exception] = ConfigError
) -> None:
    """Raise ``error`` if ``scale`` lies outside ``[min_scale, max_scale]``."""
    if config.min_scale is not None and scale < config.min_scale:
        raise error(f"Invalid {name!r}: expected a value >= min_scale ({config.min_scale!r}), got {scale!r}.")
    if config.max_scale is not None and scale > config.max_scale:
        raise error(f"Invalid {name!r}: expected a value <= max_scale ({config.max_scale!r}), got {scale!r}.")
