"""unscale_and_check records its step before waiting for the verdict, and undoes that if the wait fails.

The CuPy backend returns a result that is read from the device on the first
question, so the scaler does its verdict-independent bookkeeping while the
kernels run. A failure while waiting (a device error) must leave the scaler as
the call found it. Simulated here on the NumPy backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupy_amp import GradScaler, ScalerProtocolError
from cupy_amp.numpy_backend import NumpyUnscalePlan


class DeviceLost(RuntimeError):
    pass


class FailingCheck:
    def found_overflow(self) -> bool:
        raise DeviceLost("the device went away while the kernels ran")

    def local_overflow(self) -> bool:
        raise AssertionError("never reached")

    def nonfinite_positions(self) -> list[int]:
        raise AssertionError("never reached")


@pytest.fixture
def failing_read(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    switch = {"fail": False}
    real_run = NumpyUnscalePlan.run

    def run(self: NumpyUnscalePlan, arrays: Any, inv_scale: Any, vote: Any = None) -> Any:
        result = real_run(self, arrays, inv_scale, vote)
        return FailingCheck() if switch["fail"] else result

    monkeypatch.setattr(NumpyUnscalePlan, "run", run)
    return switch


def test_failed_wait_on_the_first_call_leaves_no_step_open(failing_read: dict[str, bool]) -> None:
    scaler = GradScaler(init_scale=4.0)
    grads = [np.full(3, 8.0, np.float32)]
    failing_read["fail"] = True
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check(grads)
    with pytest.raises(ScalerProtocolError):
        scaler.update()  # no step was opened
    failing_read["fail"] = False
    assert scaler.unscale_and_check([np.full(3, 8.0, np.float32)])  # not refused as a second unscale
    scaler.update()
    assert scaler.stats().steps == 1


def test_failed_wait_on_a_later_call_keeps_the_step_as_it_was(failing_read: dict[str, bool]) -> None:
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    first, second = [np.full(3, 8.0, np.float32)], [np.full(3, 8.0, np.float32)]
    assert scaler.unscale_and_check(first)
    failing_read["fail"] = True
    with pytest.raises(DeviceLost):
        scaler.unscale_and_check(second)
    failing_read["fail"] = False
    assert scaler.unscale_and_check(second)  # not refused as unscaled twice: the failed call left no record
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.growths, stats.scale) == (1, 1, 8.0)


def test_clean_update_reuses_the_successor_computed_during_the_call() -> None:
    scaler = GradScaler(init_scale=4.0, growth_interval=2)
    for expected_scale in (4.0, 8.0, 8.0, 16.0):
        assert scaler.unscale_and_check([np.ones(2, np.float32)])
        scaler.update()
        assert scaler.scale_factor() == expected_scale
    assert not scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()  # an overflow: the precomputed clean successor must not be used
    assert scaler.scale_factor() == 8.0 and scaler.stats().skipped_steps == 1
