"""A call that fails once it may have written memory still counts: as an overflow, its gradients claimed.

Failures are injected into the NumPy backend, whose arrays really are written
before the failure: an interrupt half-way through the arrays of a call, and a
device error once every array was unscaled (what the CuPy backend can meet
after its kernels ran). Whatever happened, no array may be divided twice, and
the step must be skipped. Every test runs on both faces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import Face, open_step

from cupy_amp import DuplicateGradientError, numpy_backend
from cupy_amp.twins import unscale_check


class DeviceLost(RuntimeError):
    pass


@pytest.fixture
def fail_multiply(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, BaseException], None]:
    """Make the NumPy backend raise ``error`` instead of its ``n``-th multiplication (counting from 0)."""

    def arm(n: int, error: BaseException) -> None:
        real = unscale_check.multiply
        count = [0]

        def multiply(array: np.ndarray, factor: Any) -> None:
            if count[0] == n:
                count[0] += 1
                raise error
            count[0] += 1
            real(array, factor)

        monkeypatch.setattr(unscale_check, "multiply", multiply)

    return arm


@pytest.fixture
def fail_result(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """While ``switch["error"]`` is set, a call raises it right after unscaling (and checking) all its arrays.

    Patched at ``HostState.unscale``, which both faces run (GradScaler's ``read`` of the verdict, the
    other place a device error shows, is a call the sync-free face never makes).
    """
    switch: dict[str, Any] = {"error": None}
    real = numpy_backend.HostState.unscale

    def unscale(self: numpy_backend.HostState, call: Any, number: int = 0) -> tuple[int, ...]:
        culprits = real(self, call, number)
        if switch["error"] is not None:
            raise switch["error"]
        return culprits

    monkeypatch.setattr(numpy_backend.HostState, "unscale", unscale)
    return switch


def test_interrupt_half_way_through_400_arrays_divides_none_twice(
    face: Face,
    fail_multiply: Callable[[int, BaseException], None],
) -> None:
    scaler = face(init_scale=4.0)
    grads = [np.full(3, 8.0, np.float32) for _ in range(400)]
    open_step(scaler)  # before arming: scale_loss multiplies too
    fail_multiply(200, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        scaler.unscale_and_check(grads)
    assert scaler.had_overflow() is True
    assert [float(g[0]) for g in grads] == [2.0] * 200 + [8.0] * 200
    with pytest.raises(DuplicateGradientError):  # a retry would divide the first 200 again
        scaler.unscale_and_check(grads)
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads[300:])  # untouched, but claimed by the failed call all the same
    assert [float(g[0]) for g in grads] == [2.0] * 200 + [8.0] * 200
    scaler.update()
    assert (scaler.stats().skipped_steps, scaler.scale_factor()) == (1, 2.0)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(grads)) is True  # the next step may use them again


ERRORS = [DeviceLost("the device went away while the kernels ran"), KeyboardInterrupt()]


@pytest.mark.parametrize("error", ERRORS, ids=["device-error", "interrupt"])
def test_a_failure_after_unscaling_counts_the_call_as_an_overflow(
    face: Face, fail_result: dict[str, Any], error: BaseException
) -> None:
    scaler = face(init_scale=4.0, backoff_factor=0.5)
    grads = [np.full(3, 8.0, np.float32)]
    fail_result["error"] = error
    open_step(scaler)
    with pytest.raises(type(error)):
        scaler.unscale_and_check(grads)
    fail_result["error"] = None
    assert scaler.had_overflow()
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads)  # already unscaled once: never twice
    np.testing.assert_array_equal(grads[0], np.full(3, 2.0, np.float32))
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps, stats.scale) == (1, 1, 2.0)


def test_a_failure_after_unscaling_a_later_call_keeps_the_earlier_calls_and_skips_the_step(
    face: Face, fail_result: dict[str, Any]
) -> None:
    scaler = face(init_scale=4.0, backoff_factor=0.5)
    first, second = [np.full(3, 8.0, np.float32)], [np.full(3, 8.0, np.float32)]
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check(first))
    fail_result["error"] = ERRORS[0]
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check(second)
    fail_result["error"] = None
    for gradients in (first, second):
        with pytest.raises(DuplicateGradientError):
            scaler.unscale_and_check(gradients)
    scaler.update()
    assert (scaler.stats().skipped_steps, scaler.scale_factor()) == (1, 2.0)


def test_previous_step_results_stay_until_a_new_step_records_a_call(face: Face, fail_result: dict[str, Any]) -> None:
    scaler = face(init_scale=4.0)
    open_step(scaler)
    assert not face.ok(scaler.unscale_and_check([np.array([np.inf], np.float32)]))
    scaler.update()
    assert scaler.had_overflow() and scaler.nonfinite_gradients() == [0]
    fail_result["error"] = ERRORS[0]
    open_step(scaler)
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check([np.ones(2, np.float32)])
    # The failed call opened a new step, which counts as overflowed; its culprits are unknown.
    assert scaler.had_overflow() and scaler.nonfinite_gradients() == []


class ArithmeticRefused(np.ndarray):
    """An ndarray subclass whose own arithmetic raises (as a tracing or checking wrapper might)."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise RuntimeError("this subclass refuses NumPy arithmetic")


def test_a_subclass_is_unscaled_on_its_data_never_through_its_own_arithmetic(face: Face) -> None:
    grad = np.full(4, 8.0, np.float32).view(ArithmeticRefused)
    scaler = face(init_scale=4.0)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([grad])) is True
    assert grad.view(np.ndarray).tolist() == [2.0] * 4


def test_a_masked_array_is_judged_on_its_data_inf_under_the_mask_included(face: Face) -> None:
    grad = np.ma.masked_array(np.array([1.0, np.inf, 3.0], np.float32), mask=[False, True, False])
    assert bool(np.isfinite(grad).all())  # what the mask shows
    scaler = face(init_scale=2.0)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check({"w": grad})) is False  # what the memory holds
    assert scaler.nonfinite_gradients() == ["w"]
    assert grad.data.tolist() == [0.5, np.inf, 1.5]
