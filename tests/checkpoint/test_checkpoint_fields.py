"""Checkpoint fields: every invalid value is a CheckpointFieldError naming the field; the PyTorch bridge."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpoint_documents import (
    BOOL_FIELDS,
    GOLDEN_FIELDS,
    GOLDEN_PYTORCH_RULE,
    GOLDEN_V1_PAYLOAD,
    INT_FIELDS,
    SMALLEST_SCALE,
    U64_MAX,
    document,
    packb,
    raw_map,
    v1_document,
    with_fields,
)

from cupy_amp import GradScaler
from cupy_amp.checkpoint import (
    GradScalerCheckpoint,
)
from cupy_amp.errors import (
    CheckpointFieldError,
)


def test_remote_overflow_is_a_valid_state() -> None:
    remote = with_fields(found_overflow=True, found_overflow_local=False)
    assert remote.found_overflow_local is False
    assert with_fields(remote_skipped_steps=GOLDEN_FIELDS["skipped_steps"]).remote_skipped_steps == 300
    assert with_fields(remote_skipped_steps=0).remote_skipped_steps == 0


def test_local_overflow_without_an_overflow_is_a_field_error() -> None:
    match = r"^Invalid 'found_overflow_local': expected False when found_overflow is False"
    with pytest.raises(CheckpointFieldError, match=match):
        with_fields(found_overflow=False, found_overflow_local=True)
    with pytest.raises(CheckpointFieldError, match=match):
        GradScalerCheckpoint.from_bytes(
            document(fields={**GOLDEN_FIELDS, "found_overflow": False, "found_overflow_local": True})
        )


@pytest.mark.parametrize("value", [301, 5_000_000_001, U64_MAX])
def test_more_remote_skips_than_skips_is_a_field_error(value: int) -> None:
    match = r"^Invalid 'remote_skipped_steps': expected an int <= skipped_steps \(300\)"
    with pytest.raises(CheckpointFieldError, match=match):
        with_fields(remote_skipped_steps=value)
    with pytest.raises(CheckpointFieldError, match=match):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "remote_skipped_steps": value}))


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("found_overflow_local", 0, "a bool"),
        ("found_overflow_local", "False", "a bool"),
        ("found_overflow_local", None, "a bool"),
        ("remote_skipped_steps", -1, "an int >= 0"),
        ("remote_skipped_steps", True, "an int >= 0"),
        ("remote_skipped_steps", 3.0, "an int >= 0"),
        ("remote_skipped_steps", "3", "an int >= 0"),
        ("remote_skipped_steps", None, "an int >= 0"),
    ],
)
def test_new_fields_of_the_wrong_type_are_field_errors(name: str, value: object, expected: str) -> None:
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected {expected}"):
        with_fields(**{name: value})


def test_new_fields_given_as_numpy_scalars_are_stored_as_python_scalars() -> None:
    checkpoint = with_fields(found_overflow_local=np.bool_(True), remote_skipped_steps=np.int64(3))
    assert type(checkpoint.found_overflow_local) is bool
    assert checkpoint.found_overflow_local is True
    assert type(checkpoint.remote_skipped_steps) is int
    assert checkpoint.remote_skipped_steps == 3
    with pytest.raises(CheckpointFieldError, match="'found_overflow_local'"):
        with_fields(found_overflow=np.bool_(False), found_overflow_local=np.bool_(True))


TORCH_STATE = {
    "scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 17,
}


def test_from_torch_state_dict_fills_every_other_field() -> None:
    checkpoint = GradScalerCheckpoint.from_torch_state_dict(TORCH_STATE)
    assert checkpoint.to_dict() == {
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "consecutive_good_steps": 17,
        "found_overflow": False,
        "found_overflow_local": False,
        "enabled": True,
        "min_scale": None,
        "max_scale": None,
        "hysteresis": 1,
        "hysteresis_tracker": 1,
        "steps": 0,
        "skipped_steps": 0,
        "growths": 0,
        "backoffs": 0,
        "remote_skipped_steps": 0,
        **GOLDEN_PYTORCH_RULE,
        "journal": b"",
        "journal_names": (),
    }
    assert checkpoint.journal_entries().size == 0
    assert checkpoint.to_torch_state_dict() == TORCH_STATE
    assert GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()) == checkpoint


@pytest.mark.parametrize(
    "state_dict",
    [{}, {**TORCH_STATE, "found_overflow_local": False}, {**TORCH_STATE, "remote_skipped_steps": 0}],
    ids=["empty", "local", "remote"],
)
def test_from_torch_state_dict_takes_exactly_the_torch_keys(state_dict: dict[str, Any]) -> None:
    with pytest.raises(CheckpointFieldError, match="PyTorch state dict"):
        GradScalerCheckpoint.from_torch_state_dict(state_dict)


def _bad_values(name: str) -> list[object]:
    if name in BOOL_FIELDS:
        return [1, 0, 1.0, "true", None]
    if name in INT_FIELDS:
        return [True, False, 1.5, float(GOLDEN_FIELDS[name]), "1", None, -1, math.nan]
    if name == "rule":
        return ["torch", "", "Headroom", 1, None, True]
    if name in ("overflow_scale", "overflow_norm", "clean_scale", "clean_norm"):
        return [True, "2.0", math.nan, math.inf, -math.inf, -1.0, 1e300, 0.1, None]  # 0.1: not a float32 value
    values: list[object] = [True, "2.0", math.nan, math.inf, -math.inf, -1.0, 0.0]
    if name in ("scale", "min_scale", "max_scale"):
        values.append(1e300)  # finite, but beyond float32
    if name in ("growth_factor", "backoff_factor"):
        values.append(1.0)
    return values if name in ("min_scale", "max_scale") else [*values, None]


FIELD_CASES = [(name, value) for name in GOLDEN_FIELDS for value in _bad_values(name)]


@pytest.mark.parametrize(("name", "value"), FIELD_CASES, ids=[f"{n}={v!r}" for n, v in FIELD_CASES])
def test_invalid_field_value_is_a_field_error_naming_the_field(tmp_path: Path, name: str, value: object) -> None:
    data = document(fields={**GOLDEN_FIELDS, name: value})
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected "):
        GradScalerCheckpoint.from_bytes(data)
    path = tmp_path / "bad.ckpt"
    path.write_bytes(data)
    with pytest.raises(CheckpointFieldError, match=f"^checkpoint {re.escape(repr(str(path)))}: Invalid '{name}'"):
        GradScalerCheckpoint.load(path)


V1_FIELD_CASES = [(name, value) for name in GOLDEN_V1_PAYLOAD for value in _bad_values(name)]


@pytest.mark.parametrize(("name", "value"), V1_FIELD_CASES, ids=[f"{n}={v!r}" for n, v in V1_FIELD_CASES])
def test_invalid_field_value_in_a_version_1_file_is_a_field_error_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected "):
        GradScalerCheckpoint.from_bytes(v1_document({**GOLDEN_V1_PAYLOAD, name: value}))


def test_field_error_names_exactly_the_bad_field() -> None:
    data = document(fields={**GOLDEN_FIELDS, "growths": True})
    with pytest.raises(CheckpointFieldError, match="Invalid 'growths': expected an int >= 0, got True"):
        GradScalerCheckpoint.from_bytes(data)


@pytest.mark.parametrize("value", [packb([1.0]), packb({"a": 1}), packb(b"\x00")])
def test_container_field_value_is_a_field_error(value: bytes) -> None:
    pairs = [(packb(name), packb(v)) for name, v in GOLDEN_FIELDS.items() if name != "enabled"]
    with pytest.raises(CheckpointFieldError, match="Invalid 'enabled'"):
        GradScalerCheckpoint.from_bytes(document(raw_map([*pairs, (packb("enabled"), value)])))


def test_missing_and_unknown_fields_are_field_errors() -> None:
    missing = {name: value for name, value in GOLDEN_FIELDS.items() if name != "hysteresis"}
    with pytest.raises(CheckpointFieldError, match=r"missing field.*'hysteresis'"):
        GradScalerCheckpoint.from_bytes(document(fields=missing))
    with pytest.raises(CheckpointFieldError, match=r"unknown field.*'loss_scale'"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "loss_scale": 1.0}))


def test_inconsistent_counters_are_field_errors() -> None:
    for changes in (
        {"growths": 10**10},
        {"backoffs": 301},
        {"skipped_steps": 5_000_000_001},
        {"remote_skipped_steps": 301},
        {"skipped_steps": 2, "backoffs": 2},  # remote_skipped_steps 3 > 2
    ):
        with pytest.raises(CheckpointFieldError):
            GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, **changes}))


@pytest.mark.parametrize("scale", [0.0, 2.0**-149, 2.0**-128])
def test_scale_without_a_finite_float32_inverse_is_refused_even_without_a_floor(scale: float) -> None:
    # A PyTorch scale that collapsed below 2**-128 unscales finite gradients to inf/nan: not a state to resume.
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'scale': expected a float32 value from 2\*\*-128"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": scale, "min_scale": None}))
    with pytest.raises(CheckpointFieldError, match="'scale'"):
        GradScalerCheckpoint.from_torch_state_dict({**TORCH_STATE, "scale": scale})
    smallest = GradScalerCheckpoint.from_bytes(
        document(fields={**GOLDEN_FIELDS, "scale": SMALLEST_SCALE, "min_scale": None})
    )
    assert smallest.scale == SMALLEST_SCALE


def test_negative_zero_scale_is_refused() -> None:
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*-0\.0"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": -0.0, "min_scale": None}))


def test_scale_float32_cannot_hold_is_refused() -> None:
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*float32"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": 32768.1}))


@pytest.mark.parametrize("name", ["steps", "growth_interval", "hysteresis"])
def test_an_int_the_format_cannot_store_is_refused_at_construction(name: str) -> None:
    changes = {name: 2**64}
    if name == "steps":
        changes.update(skipped_steps=0, growths=0, backoffs=0, remote_skipped_steps=0)
    with pytest.raises(
        CheckpointFieldError, match=rf"^Invalid '{name}': expected an int >= \d+ that a checkpoint can store"
    ):
        with_fields(**changes)
    assert with_fields(**{**changes, name: 2**64 - 1}).to_bytes()


def test_to_torch_state_dict_warns_about_what_pytorch_runs_without() -> None:
    clamped = GradScaler().checkpoint()  # the default clamps, [1, 2**24]
    with pytest.warns(UserWarning, match=r"drops min_scale=1\.0, max_scale=16777216\.0"):
        state_dict = clamped.to_torch_state_dict()
    assert state_dict["scale"] == 65536.0
    with pytest.warns(UserWarning, match="hysteresis=3"):
        GradScaler(min_scale=None, max_scale=None, hysteresis=3).checkpoint().to_torch_state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler(min_scale=None, max_scale=None).checkpoint().to_torch_state_dict()  # nothing lost: silent
