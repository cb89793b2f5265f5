"""unscale_and_check records its call before waiting for the verdict; a failed wait counts as an overflow.

The CuPy backend returns a result that is read from the device on the first
question, so the scaler does its verdict-independent bookkeeping while the
kernels run. If the wait fails (a device error, an interrupt), the kernels may
already have unscaled the gradients: the call must still count, so the same
gradients are refused if passed again, and the step must be skipped. Simulated
here on the NumPy backend, whose arrays really are unscaled before the failure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupy_amp import DuplicateGradientError, GradScaler, GradScalerCheckpoint
from cupy_amp.numpy_backend import NumpyUnscalePlan


class DeviceLost(RuntimeError):
    pass


class FailingCheck:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def found_overflow(self) -> bool:
        raise self.error

    def local_overflow(self) -> bool:
        raise AssertionError("never reached")

    def nonfinite_positions(self) -> list[int]:
        raise AssertionError("never reached")


@pytest.fixture
def failing_read(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    switch: dict[str, Any] = {"error": None}
    real_run = NumpyUnscalePlan.run

    def run(self: NumpyUnscalePlan, arrays: Any, inv_scale: Any, vote: Any = None) -> Any:
        result = real_run(self, arrays, inv_scale, vote)  # the arrays are unscaled, as kernels would have
        return FailingCheck(switch["error"]) if switch["error"] is not None else result

    monkeypatch.setattr(NumpyUnscalePlan, "run", run)
    return switch


ERRORS = [DeviceLost("the device went away while the kernels ran"), KeyboardInterrupt()]


@pytest.mark.parametrize("error", ERRORS, ids=["device-error", "interrupt"])
def test_failed_wait_counts_the_call_as_an_overflow(failing_read: dict[str, Any], error: BaseException) -> None:
    scaler = GradScaler(init_scale=4.0, backoff_factor=0.5)
    grads = [np.full(3, 8.0, np.float32)]
    failing_read["error"] = error
    with pytest.raises(type(error)):
        scaler.unscale_and_check(grads)
    failing_read["error"] = None
    assert scaler.had_overflow()
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads)  # already unscaled once: never twice
    np.testing.assert_array_equal(grads[0], np.full(3, 2.0, np.float32))
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps, stats.scale) == (1, 1, 2.0)


def test_failed_wait_on_a_later_call_keeps_the_earlier_calls_and_skips_the_step(failing_read: dict[str, Any]) -> None:
    scaler = GradScaler(init_scale=4.0, backoff_factor=0.5)
    first, second = [np.full(3, 8.0, np.float32)], [np.full(3, 8.0, np.float32)]
    assert scaler.unscale_and_check(first)
    failing_read["error"] = ERRORS[0]
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check(second)
    failing_read["error"] = None
    for gradients in (first, second):
        with pytest.raises(DuplicateGradientError):
            scaler.unscale_and_check(gradients)
    scaler.update()
    assert (scaler.stats().skipped_steps, scaler.scale_factor()) == (1, 2.0)


def test_previous_step_results_stay_until_a_new_step_records_a_call(failing_read: dict[str, Any]) -> None:
    scaler = GradScaler(init_scale=4.0)
    assert not scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()
    assert scaler.had_overflow() and scaler.nonfinite_gradients() == [0]
    failing_read["error"] = ERRORS[0]
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check([np.ones(2, np.float32)])
    # The failed call opened a new step, which counts as overflowed; its culprits are unknown.
    assert scaler.had_overflow() and scaler.nonfinite_gradients() == []


def test_updates_follow_the_rule_for_clean_steps_overflows_and_a_newly_loaded_configuration() -> None:
    # update() takes the successor computed during the call only for a clean step of the same
    # state and configuration; overflows and a configuration loaded in between must not reuse it.
    scaler = GradScaler(init_scale=4.0, growth_interval=2)
    for expected_scale in (4.0, 8.0, 8.0, 16.0):
        assert scaler.unscale_and_check([np.ones(2, np.float32)])
        scaler.update()
        assert scaler.scale_factor() == expected_scale
    assert not scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()
    assert scaler.scale_factor() == 8.0 and scaler.stats().skipped_steps == 1

    other = GradScaler(init_scale=8.0, growth_interval=1, growth_factor=4.0)
    scaler.load_checkpoint(GradScalerCheckpoint.from_bytes(other.checkpoint().to_bytes()))
    assert scaler.unscale_and_check([np.ones(2, np.float32)])
    scaler.update()
    assert scaler.scale_factor() == 32.0  # the loaded configuration: grows by 4 after one clean step
