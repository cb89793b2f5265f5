"""Review probes of the numerics report that held up (kept as regression tests)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Face, open_step

from cupy_amp import GradientSet, GradScaler
from cupy_amp.dtypes import bfloat16


def test_guard_flags_a_nan_gradient(face: Face) -> None:
    scaler = face.cls.guard()
    scaler.check({"a": np.array([np.nan, 0.0], np.float32), "b": np.ones(2, np.float32)}, report=True)
    rows = {row.label: row for row in scaler.gradient_numerics()}
    assert rows["a"].nonfinite and not rows["b"].nonfinite
    assert (rows["a"].amax, rows["a"].zeros) == (0.0, 1)


def test_edge_values(face: Face) -> None:
    tiny64 = np.finfo(np.float64).tiny
    grads = [
        np.array([-0.0, 0.0], np.float16),
        np.array([np.nan, np.inf, -np.inf], np.float32),
        np.array([tiny64 / 4, -tiny64, 5e-324], np.float64),
        np.zeros(0, np.float32),
        np.array([np.finfo(np.float16).max, -np.inf], np.float16),
    ]
    scaler = open_step(face(init_scale=1.0))
    scaler.check(grads, report=True)
    rows = scaler.gradient_numerics()
    assert [(r.amax, r.zeros, r.subnormals, r.nonfinite) for r in rows] == [
        (0.0, 2, 0, False),
        (0.0, 0, 0, True),
        (tiny64, 0, 2, False),
        (0.0, 0, 0, False),
        (65504.0, 0, 0, True),
    ]
    assert rows[3].zero_fraction == 0.0 and rows[3].subnormal_fraction == 0.0


@pytest.mark.skipif(bfloat16() is None, reason="needs ml_dtypes")
def test_bfloat16_nan_only_and_subnormal(face: Face) -> None:
    bf = bfloat16()
    grads = [np.array([np.nan, np.nan], bf), np.array([1e-39, 0.0, 3.0], bf)]
    scaler = face.cls.guard()
    scaler.check(grads, report=True)
    first, second = scaler.gradient_numerics()
    assert (first.amax, first.nonfinite) == (0.0, True)
    assert (second.subnormals, second.zeros, second.amax) == (1, 1, 3.0)


def test_numpy_bool_report_is_accepted(face: Face) -> None:
    scaler = open_step(face(init_scale=2.0))
    scaler.check([np.ones(2, np.float32)], report=np.bool_(True))
    assert len(scaler.gradient_numerics()) == 1


def test_accumulation_and_gradient_set(face: Face) -> None:
    scaler = face(init_scale=4.0)
    grads = GradientSet({"w": np.array([8.0, 0.0], np.float32), "skip": None})
    for _ in range(3):
        scaler.scale_loss(np.ones((), np.float32))
    scaler.check(grads, report=True)
    (row,) = scaler.gradient_numerics()
    assert (row.label, row.amax, row.zeros) == ("w", 8.0, 1)


def test_empty_and_none_only_calls(face: Face) -> None:
    scaler = open_step(face(init_scale=2.0))
    scaler.check([None, None], report=True)
    assert scaler.gradient_numerics() == []


def test_renamed_dict_entries_are_reported_under_their_new_names() -> None:
    scaler = GradScaler(init_scale=2.0)
    a, b = np.ones(2, np.float32), np.zeros(3, np.float32)
    open_step(scaler).check({"a": a, "b": b}, report=True)
    scaler.update()
    open_step(scaler).check({"x": a, "y": b}, report=True)  # the same arrays: the call cache's labels
    assert [(row.label, row.zeros) for row in scaler.gradient_numerics()] == [("x", 0), ("y", 3)]
