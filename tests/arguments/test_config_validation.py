"""Every invalid constructor value is refused with a ConfigError naming the parameter."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from helpers import open_step

from cupy_amp import ConfigError, CupyAmpError, GradScaler
from cupy_amp.rule import SMALLEST_SCALE

FLOAT32_MAX = float(np.finfo(np.float32).max)
NOT_NUMBERS: list[Any] = ["1.0", None, [2.0], b"2", 1 + 0j]
NON_FINITE: list[Any] = [math.nan, math.inf, -math.inf, np.float32(np.nan), np.float64(np.inf)]
BOOLS: list[Any] = [True, False, np.bool_(True)]

INVALID: dict[str, list[Any]] = {
    "init_scale": [
        0.0,
        -0.0,
        -1.0,
        -(2.0**20),
        1e39,  # overflows float32
        1e-50,  # rounds to 0 in float32
        1e-46,  # below half the smallest float32 subnormal: rounds to 0
        2.0**-149,  # a float32, but its float32 inverse is inf
        2.0**-128,  # the last float32 whose inverse overflows
        1e-40,
        3.5e38,
        10**400,  # too large even for a float64
        *NON_FINITE,
        *BOOLS,
        *NOT_NUMBERS,
    ],
    "growth_factor": [1.0, 0.5, 0.0, -2.0, 1, 10**400, *NON_FINITE, *BOOLS, *NOT_NUMBERS],
    "backoff_factor": [0.0, -0.0, 1.0, 1, 0, 1.5, -0.5, -(10**400), *NON_FINITE, *BOOLS, *NOT_NUMBERS],
    "growth_interval": [0, -1, -2000, 1.0, 2.5, 2000.0, np.float64(3), "10", None, Fraction(3), 2**64, *BOOLS],
    "hysteresis": [0, -1, 1.0, 2.0, np.float32(2), "1", None, 2**64, 10**30, *BOOLS],
    "min_scale": [0.0, -1.0, 1e39, 1e-50, 2.0**-140, 10**400, *NON_FINITE, *BOOLS, "1", [1.0]],
    "max_scale": [0.0, -1.0, 1e39, 1e-50, 2.0**-140, 10**400, *NON_FINITE, *BOOLS, "1", [1.0]],
    "enabled": [1, 0, 1.0, "True", None, [True]],
}

# Other arguments chosen so that any valid value of the parameter under test is accepted.
PERMISSIVE: dict[str, dict[str, Any]] = {
    "init_scale": {"min_scale": None, "max_scale": None},
    "min_scale": {"init_scale": FLOAT32_MAX, "max_scale": None},
    "max_scale": {"init_scale": SMALLEST_SCALE, "min_scale": None},
}

CASES = [(name, value) for name, values in INVALID.items() for value in values]


def _id(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 30 else text[:27] + "..."


@pytest.mark.parametrize(("name", "value"), CASES, ids=[f"{name}={_id(value)}" for name, value in CASES])
def test_invalid_value_is_refused(name: str, value: Any) -> None:
    kwargs = {**PERMISSIVE.get(name, {}), name: value}
    with pytest.raises(ConfigError) as info:
        GradScaler(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, CupyAmpError)
    message = str(info.value)
    assert f"'{name}'" in message
    assert "expected" in message
    assert "\n" not in message
    if not isinstance(value, int) or abs(value) < 10**20:
        assert repr(value) in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"growth_factor": 1.0 + 2.0**-52},
        {"growth_factor": 1e300},
        {"backoff_factor": 2.0**-1000},
        {"backoff_factor": 1.0 - 2.0**-53},
        {"growth_factor": 3, "backoff_factor": Fraction(1, 3)},
        {"growth_interval": 1},
        {"growth_interval": np.int64(7)},
        {"growth_interval": 2**64 - 1},
        {"hysteresis": 1},
        {"hysteresis": np.int32(4)},
        {"init_scale": 1},
        {"init_scale": np.float16(4.0)},
        {"min_scale": None},
        {"max_scale": None},
        {"min_scale": None, "max_scale": None, "init_scale": SMALLEST_SCALE},
        {"min_scale": 65536.0, "max_scale": 65536.0},
        {"enabled": False},
        {"enabled": np.bool_(False)},
    ],
)
def test_valid_values_are_accepted(kwargs: dict[str, Any]) -> None:
    scaler = GradScaler(**kwargs)
    if "enabled" in kwargs:
        assert scaler.is_enabled() is bool(kwargs["enabled"])
    if "init_scale" in kwargs:
        assert scaler.stats().scale == float(np.float32(kwargs["init_scale"]))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0.5}, "init_scale"),  # below the default min_scale 1.0
        ({"init_scale": 2.0**25}, "init_scale"),  # above the default max_scale 2**24
        ({"init_scale": 10.0, "min_scale": 11.0}, "init_scale"),
        ({"init_scale": 10.0, "max_scale": 9.0}, "init_scale"),
        ({"init_scale": 10.0, "min_scale": 4.0, "max_scale": 2.0}, "min_scale"),
        ({"init_scale": 1.0, "min_scale": 2.0**25}, "min_scale"),  # min above the default max
        ({"init_scale": 1.0, "max_scale": 0.5}, "max_scale"),  # max below the default min
    ],
)
def test_clamp_relations_are_checked(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as info:
        GradScaler(**kwargs)
    message = str(info.value)
    assert name in message  # a min/max conflict is reported as "'min_scale' ... <= max_scale (...)"
    assert "expected" in message


def test_min_scale_above_max_scale_message_names_both_values() -> None:
    with pytest.raises(ConfigError, match=r"'min_scale'.*2\.0.*4\.0"):
        GradScaler(init_scale=3.0, min_scale=4.0, max_scale=2.0)


def test_with_params_validates() -> None:
    with pytest.raises(ConfigError, match="'growth_interval'"):
        GradScaler.with_params(1024.0, 2.0, 0.5, 0)
    with pytest.raises(ConfigError, match="'backoff_factor'"):
        GradScaler.with_params(1024.0, 2.0, 1.5, 10)
    with pytest.raises(ConfigError, match="'growth_factor'"):
        GradScaler.with_params(1024.0, 0.5, 0.5, 10)
    with pytest.raises(ConfigError, match="'init_scale'"):
        GradScaler.with_params(-1.0, 2.0, 0.5, 10)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_set_enabled_requires_a_bool(value: Any) -> None:
    scaler = GradScaler()
    with pytest.raises(ConfigError, match="'enabled'"):
        scaler.set_enabled(value)
    assert scaler.is_enabled() is True


# float32 rounding of the scale and its clamps


@pytest.mark.parametrize("value", [0.1, 1.1, 3.3, 65537.1, 1e-38, SMALLEST_SCALE * 1.0000003, 3.4028235e38])
def test_init_scale_is_rounded_to_float32(value: float) -> None:
    scaler = GradScaler(init_scale=value, min_scale=None, max_scale=None)
    assert scaler.stats().scale == float(np.float32(value))
    assert scaler.scale_factor() == float(np.float32(value))


def test_float32_max_is_accepted_and_just_above_it_is_refused() -> None:
    assert GradScaler(init_scale=FLOAT32_MAX, max_scale=None).stats().scale == FLOAT32_MAX
    assert GradScaler(max_scale=FLOAT32_MAX).checkpoint().max_scale == FLOAT32_MAX
    just_over = FLOAT32_MAX * (1 + 2.0**-23)  # rounds to inf in float32
    for name in ("init_scale", "max_scale", "min_scale"):
        kwargs = {**PERMISSIVE[name], name: just_over}
        with pytest.raises(ConfigError, match=f"'{name}'"):
            GradScaler(**kwargs)


def test_smallest_scale_with_a_finite_inverse_is_accepted_and_the_next_float32_down_is_refused() -> None:
    # Below SMALLEST_SCALE, float32(1 / scale) is inf: unscaling would turn finite gradients into inf/nan.
    assert np.isfinite(np.float32(1.0 / SMALLEST_SCALE))
    below = float(np.nextafter(np.float32(SMALLEST_SCALE), np.float32(0)))
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(1.0 / below))
    assert GradScaler(init_scale=SMALLEST_SCALE, min_scale=None).stats().scale == SMALLEST_SCALE
    assert GradScaler(init_scale=SMALLEST_SCALE, min_scale=SMALLEST_SCALE).checkpoint().min_scale == SMALLEST_SCALE
    for name in ("init_scale", "min_scale", "max_scale"):
        kwargs = {**PERMISSIVE[name], name: below}
        with pytest.raises(ConfigError, match=f"'{name}'.*2\\*\\*-128"):
            GradScaler(**kwargs)


def test_clamps_are_held_in_float32() -> None:
    scaler = GradScaler(init_scale=1.0, min_scale=0.1, max_scale=1.1, growth_interval=1)
    ckpt = scaler.checkpoint()
    assert ckpt.min_scale == float(np.float32(0.1))
    assert ckpt.max_scale == float(np.float32(1.1))
    open_step(scaler)
    scaler.unscale_and_check([np.ones(1, np.float32)])
    scaler.update()
    assert scaler.stats().scale == float(np.float32(1.1))


@pytest.mark.parametrize("value", [0.1, 1.1, 1e-30, 12345.678, SMALLEST_SCALE])
def test_init_scale_equal_to_a_clamp_after_rounding_is_accepted(value: float) -> None:
    assert GradScaler(init_scale=value, min_scale=value, max_scale=None).stats().scale == float(np.float32(value))
    assert GradScaler(init_scale=value, min_scale=None, max_scale=value).stats().scale == float(np.float32(value))


def test_init_scale_rounding_up_onto_max_scale_is_accepted() -> None:
    # 2**24 + 1 is not a float32; it rounds to 2**24, the default max_scale.
    assert GradScaler(init_scale=2.0**24 + 1).stats().scale == 2.0**24
