"""The numerics report of check(report=True): per gradient, the largest finite magnitude, zeros, subnormals.

The expected counts are taken here on the bits (an integer view), independently of the library's NumPy
reference, which works on float64 values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import MASKS, Face, awkward, on_the_bits, open_step

from cupy_amp import ConfigError, GradScaler, ScalerProtocolError
from cupy_amp.optim import SGD


@pytest.mark.parametrize("dtype", sorted(MASKS, key=str), ids=str)
def test_the_report_counts_what_the_bits_say(face: Face, dtype: Any) -> None:
    rng = np.random.default_rng(3)
    grads = {"w1": awkward(rng, dtype, 1000), "b1": awkward(rng, dtype, 7), "empty": np.zeros(0, dtype)}
    grads["w2"] = awkward(rng, dtype, 300).reshape(20, 15)[:, ::2]  # strided
    grads["w1"][17] = np.array(np.inf).astype(dtype)
    scaler = open_step(face(init_scale=8.0))
    stats = scaler.check(grads, report=True)
    assert not bool(stats.finite)
    report = scaler.gradient_numerics()
    assert [row.label for row in report] == list(grads)
    for row in report:
        array = grads[row.label]
        assert (row.amax, row.zeros, row.subnormals) == on_the_bits(array), row.label
        assert (row.dtype, row.size, row.nonfinite) == (array.dtype, array.size, row.label == "w1")


def test_a_float16_gradient_near_its_maximum_and_one_that_underflowed_are_told_apart(face: Face) -> None:
    grads = [np.array([65504.0, -1.0, 0.5], np.float16), np.array([6e-8, 0.0, 0.0, 1e-5], np.float16)]
    scaler = open_step(face(init_scale=1.0))
    scaler.check(grads, report=True)
    near_max, underflowed = scaler.gradient_numerics()
    assert near_max.amax == 65504.0 and near_max.zeros == 0
    assert (underflowed.zeros, underflowed.subnormals) == (2, 2)
    assert underflowed.zero_fraction == 0.5 and underflowed.subnormal_fraction == 0.5


def test_the_report_changes_nothing_else(face: Face) -> None:
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(500).astype(np.float32) for _ in range(3)]
    plain, reported = open_step(face(init_scale=4.0)), open_step(face(init_scale=4.0))
    a, b = plain.check(grads, max_norm=0.5), reported.check(grads, max_norm=0.5, report=True)
    assert np.asarray(a.norm).tobytes() == np.asarray(b.norm).tobytes()
    assert np.asarray(a.clip_coefficient).tobytes() == np.asarray(b.clip_coefficient).tobytes()
    plain.update()
    reported.update()
    # Nothing but the journal's report fields: the state, the rule and every other field of the entry.
    report = ("amax", "zero_fraction", "subnormal_fraction", "amax_call", "amax_position")
    entries = reported.journal()
    assert not np.isnan(entries["amax"]).any() and np.isnan(plain.journal()["amax"]).all()
    for name in report:
        entries[name] = plain.journal()[name]
    assert entries.tobytes() == plain.journal().tobytes()
    assert {**plain.checkpoint().to_dict(), "journal": b""} == {**reported.checkpoint().to_dict(), "journal": b""}


def test_the_report_is_of_this_step_or_after_update_the_last(face: Face) -> None:
    scaler = face(init_scale=2.0)
    with pytest.raises(ScalerProtocolError, match="report=True"):
        scaler.gradient_numerics()  # no step yet
    grads = [np.array([2.0, 0.0], np.float32)]
    open_step(scaler).check(grads, report=True)
    scaler.update()
    assert scaler.gradient_numerics()[0].zeros == 1  # the last step's, after update()
    open_step(scaler).check(grads)  # a new step, checked without the report
    with pytest.raises(ScalerProtocolError, match="report=True"):
        scaler.gradient_numerics()


def test_none_entries_keep_their_positions(face: Face) -> None:
    scaler = open_step(face(init_scale=2.0))
    scaler.check([None, np.array([1.0], np.float32), None, np.array([0.0, 0.0], np.float32)], report=True)
    assert [(row.label, row.zeros) for row in scaler.gradient_numerics()] == [(1, 0), (3, 2)]


@pytest.mark.parametrize("report", [1, "yes", None])
def test_report_must_be_a_bool(face: Face, report: Any) -> None:
    scaler = open_step(face(init_scale=2.0))
    with pytest.raises(ConfigError, match="report"):
        scaler.check([np.ones(2, np.float32)], report=report)
    scaler.check([np.ones(2, np.float32)])  # refused before anything: the step still takes its check


def test_step_takes_the_report_too(face: Face) -> None:
    weights = np.zeros(4, np.float32)
    optimizer = SGD([weights], lr=1.0)
    scaler = open_step(face(init_scale=2.0))
    scaler.step(optimizer, [np.array([2.0, 0.0, 0.0, 4.0], np.float32)], report=True)
    (row,) = scaler.gradient_numerics()
    assert (row.amax, row.zeros) == (4.0, 2)
    assert weights.tolist() == [-1.0, 0.0, 0.0, -2.0]


def test_a_disabled_scaler_reports_at_scale_one() -> None:
    scaler = GradScaler(enabled=False)
    scaler.check([np.array([3.0, 0.0], np.float32)], report=True)
    assert scaler.gradient_numerics()[0].amax == 3.0
