"""The statistics record (cupy_amp.record.StatsRecord): "skip" unless a completed check wrote "apply"; every
reader applies it once, in its step.

The record's memory is what a fused optimizer reads inside its update, and what
an optimizer step replayed from a CUDA graph reads with no Python in between. A
refusal of ``check()`` must therefore leave "skip" there, whatever refused it;
on commit 90b0989 every refusal below left the last step's "apply".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import Face, open_step
from interrupts import interrupted

from cupy_amp import ConfigError, GradientTypeError, ScalerProtocolError, SyncFreeGradScaler
from cupy_amp.optim import SGD


def record_skip(scaler: Any) -> int:
    """The skip flag in the record's memory of the state NumPy arrays use."""
    state = scaler._state if isinstance(scaler, SyncFreeGradScaler) else scaler._scaling.default
    return int(state.stats.skip)


def _no_scale_loss(scaler: Any, grads: list[np.ndarray]) -> None:
    with pytest.raises(ScalerProtocolError, match="scale_loss"):
        scaler.check(grads)


def _after_unscale_and_check(scaler: Any, grads: list[np.ndarray]) -> None:
    open_step(scaler).unscale_and_check([np.ones(2, np.float32)])
    with pytest.raises(ScalerProtocolError):
        scaler.check(grads)


def _bad_max_norm(scaler: Any, grads: list[np.ndarray]) -> None:
    with pytest.raises(ConfigError, match="max_norm"):
        open_step(scaler).check(grads, max_norm=-1.0)


def _bad_report(scaler: Any, grads: list[np.ndarray]) -> None:
    with pytest.raises(ConfigError, match="report"):
        open_step(scaler).check(grads, report="yes")


def _bad_gradients(scaler: Any, grads: list[np.ndarray]) -> None:
    with pytest.raises(GradientTypeError):
        open_step(scaler).check([np.ones(2, np.int32)])


def _interrupt_at_entry(scaler: Any, grads: list[np.ndarray]) -> None:
    assert interrupted(lambda: open_step(scaler).check(grads), 1)


REFUSALS: dict[str, Callable[[Any, list[np.ndarray]], None]] = {
    "no-scale_loss": _no_scale_loss,
    "after-unscale_and_check": _after_unscale_and_check,
    "bad-max_norm": _bad_max_norm,
    "bad-report": _bad_report,
    "bad-gradients": _bad_gradients,
    "interrupt-at-entry": _interrupt_at_entry,
}


@pytest.mark.parametrize("refusal", REFUSALS.values(), ids=REFUSALS.keys())
def test_every_refused_check_after_a_completed_step_leaves_the_record_saying_skip(
    face: Face, refusal: Callable[[Any, list[np.ndarray]], None]
) -> None:
    scaler = face(init_scale=4.0)
    weights = np.zeros(3, np.float32)
    optimizer = SGD([weights], lr=1.0)
    grads = [np.full(3, 4.0, np.float32)]
    stats = open_step(scaler).check(grads)
    assert record_skip(scaler) == 0  # a completed clean check: "apply"
    optimizer.step(grads, stats)
    scaler.update()
    refusal(scaler, grads)
    assert record_skip(scaler) == 1, "a refused check left the last step's 'apply' in the record"
    assert weights.tolist() == [-1.0] * 3


def test_the_record_says_skip_from_a_steps_opening_until_its_check_completes(face: Face) -> None:
    scaler = face(init_scale=4.0)
    assert record_skip(scaler) == 1  # no check has ever completed
    grads = [np.full(3, 4.0, np.float32)]
    open_step(scaler).check(grads)
    assert record_skip(scaler) == 0
    scaler.update()
    assert record_skip(scaler) == 1  # closed by update()
    scaler.checkpoint()
    scaler.load_checkpoint(scaler.checkpoint())
    assert record_skip(scaler) == 1


def test_several_optimizers_each_apply_one_check_once_and_only_in_its_step(face: Face) -> None:
    """The CPU twin of the two-streams test in tests/gpu/test_step_owns_gpu.py: the record's owner, not the
    optimizers, knows who applied it."""
    scaler = face(init_scale=4.0)
    w0, w1 = np.zeros(3, np.float32), np.zeros(2, np.float32)
    opt0, opt1 = SGD([w0], lr=1.0), SGD([w1], lr=1.0)
    g0, g1 = np.full(3, 4.0, np.float32), np.full(2, 8.0, np.float32)
    stats = open_step(scaler).check([g0, g1])
    opt0.step([g0], stats)
    opt1.step([g1], stats)
    with pytest.raises(ScalerProtocolError, match="already applied"):
        opt0.step([g0], stats)
    scaler.update()
    with pytest.raises(ScalerProtocolError, match="update"):
        opt1.step([g1], stats)
    assert (w0.tolist(), w1.tolist()) == ([-1.0] * 3, [-2.0] * 2)
    assert (opt0.step_count, opt1.step_count) == (1, 1)


def test_several_optimizers_have_their_gradients_checked_before_any_applies_the_step(face: Face) -> None:
    # The second optimizer's gradients do not fit it: refused before the check, so the first optimizer applies
    # nothing (it used to apply the step alone) and the step stays open for a correct retry.
    w0, w1 = np.ones(4, np.float32), np.ones(4, np.float32)
    first, second = SGD([w0], lr=0.5), SGD([w1], lr=0.5)
    scaler = open_step(face(init_scale=2.0))
    good, bad = [np.full(4, 2.0, np.float32)], [np.full(3, 2.0, np.float32)]
    with pytest.raises(GradientTypeError, match=r"gradients\[0\]: expected float32 of shape \(4,\)"):
        scaler.step([first, second], [good, bad])
    assert w0.tolist() == [1.0] * 4 and first.step_count == 0
    scaler.step([first, second], [good, [np.full(4, 2.0, np.float32)]])
    scaler.update()
    assert w0.tolist() == w1.tolist() == [0.5] * 4 and scaler.stats().steps == 1


def test_several_optimizers_refuse_before_the_check_a_torn_one_shared_memory_and_one_optimizer_twice(
    face: Face,
) -> None:
    from cupy_amp import ArgumentTypeError, GradientValueError

    w0, w1 = np.ones(4, np.float32), np.ones(4, np.float32)
    first, second = SGD([w0], lr=0.5), SGD([w1], lr=0.5)
    scaler = open_step(face(init_scale=2.0))
    good = [np.full(4, 2.0, np.float32)]
    with pytest.raises(GradientValueError, match="share memory"):
        scaler.step([first, second], [good, [w1]])  # the second's gradient is its own parameter
    with pytest.raises(ArgumentTypeError, match="same optimizer twice"):
        scaler.step([first, first], [good, [np.full(4, 2.0, np.float32)]])
    second._torn = "a step was interrupted (a stand-in)"
    with pytest.raises(ScalerProtocolError, match="was interrupted"):
        scaler.step([first, second], [good, [np.full(4, 2.0, np.float32)]])
    assert w0.tolist() == [1.0] * 4 and first.step_count == 0  # the first applied nothing each time
