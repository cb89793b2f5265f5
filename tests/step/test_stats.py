"""GradScalerStats: a frozen snapshot with a plain-dict view and a one-line str()."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from helpers import open_step

from cupy_amp import GradScaler, GradScalerStats

FIELDS = [
    "scale",
    "consecutive_good_steps",
    "hysteresis_tracker",
    "enabled",
    "steps",
    "skipped_steps",
    "growths",
    "backoffs",
    "remote_skipped_steps",
    "last_overflow",
]


def busy_scaler() -> GradScaler:
    """A scaler whose counters all differ from each other and from their defaults."""
    scaler = GradScaler(init_scale=1024.0, growth_interval=2, hysteresis=3)
    for overflow in [False, False, False, False, True, True, True, True, False]:
        grad = np.array([np.nan if overflow else 1.0], np.float32)
        open_step(scaler)
        scaler.unscale_and_check([grad])
        scaler.update()
    return scaler


def test_to_dict_keys_and_values() -> None:
    stats = busy_scaler().stats()
    assert stats.to_dict() == {
        "scale": 1024.0,
        "consecutive_good_steps": 1,
        "hysteresis_tracker": 0,
        "enabled": True,
        "steps": 9,
        "skipped_steps": 4,
        "growths": 2,
        "backoffs": 2,
        "remote_skipped_steps": 0,
        "last_overflow": "none",
    }
    assert list(stats.to_dict()) == FIELDS
    assert [field.name for field in dataclasses.fields(GradScalerStats)] == FIELDS


def test_to_dict_holds_plain_python_scalars() -> None:
    values = busy_scaler().stats().to_dict()
    assert type(values["scale"]) is float
    assert type(values["enabled"]) is bool
    assert type(values["last_overflow"]) is str
    for name in FIELDS[1:]:
        if name not in ("enabled", "last_overflow"):
            assert type(values[name]) is int, name


def test_to_dict_is_a_copy() -> None:
    stats = busy_scaler().stats()
    values = stats.to_dict()
    values["scale"] = 1.0
    assert stats.scale == 1024.0


def test_stats_is_frozen() -> None:
    stats = GradScaler().stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.scale = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 3  # type: ignore[misc]
    assert stats.scale == 65536.0


def test_stats_is_a_snapshot() -> None:
    scaler = GradScaler(init_scale=8.0, growth_interval=1)
    before = scaler.stats()
    open_step(scaler)
    scaler.unscale_and_check([np.ones(1, np.float32)])
    scaler.update()
    assert before.scale == 8.0
    assert before.steps == 0
    assert scaler.stats().scale == 16.0
    assert scaler.stats() != before
    assert scaler.stats() == scaler.stats()


def test_stats_reports_the_stored_scale_while_disabled() -> None:
    scaler = GradScaler(init_scale=512.0, enabled=False)
    stats = scaler.stats()
    assert stats.scale == 512.0
    assert stats.enabled is False
    assert scaler.scale_factor() == 1.0
    assert "enabled=False" in str(stats)


@pytest.mark.parametrize(
    "scale",
    [
        65536.0,
        2.0**24,
        float(np.float32(0.1)),
        float(np.float32(123456.789)),
        float.fromhex("0x1.000008p-128"),
        float(np.finfo(np.float32).max),
        3.0 * 2.0**126,
    ],
)
def test_str_is_one_line_naming_the_exact_scale(scale: float) -> None:
    stats = GradScalerStats(
        scale=scale,
        consecutive_good_steps=17,
        hysteresis_tracker=2,
        enabled=True,
        steps=40,
        skipped_steps=3,
        growths=5,
        backoffs=1,
        remote_skipped_steps=2,
        last_overflow="remote",
    )
    text = str(stats)
    assert "\n" not in text
    assert "\r" not in text
    match = re.search(r"scale=(\S+)", text)
    assert match is not None
    assert np.float32(float(match.group(1))) == np.float32(scale)
    for number in ("17", "40", "3", "5", "1", "2"):
        assert re.search(rf"\b{number}\b", text), number
    assert "enabled=True" in text
    assert "remote_skipped_steps=2" in text
    assert "last_overflow=remote" in text


def test_str_of_a_live_scaler() -> None:
    text = str(busy_scaler().stats())
    assert "\n" not in text
    assert "1024" in text
    assert "steps=9" in text
    assert "skipped_steps=4" in text
    assert "remote_skipped_steps=0" in text
    assert "last_overflow=none" in text


@pytest.mark.parametrize(("overflow", "shown"), [(False, "none"), (True, "local")])
def test_last_overflow_of_a_single_process_is_none_or_local(overflow: bool, shown: str) -> None:
    scaler = GradScaler()
    assert scaler.stats().last_overflow == "none"
    open_step(scaler)
    scaler.unscale_and_check([np.array([np.inf if overflow else 1.0], np.float32)])
    assert scaler.stats().last_overflow == shown
    scaler.update()
    assert scaler.stats().last_overflow == shown
    assert scaler.stats().remote_skipped_steps == 0
