"""The numerics report against what could make it wrong: a disabled scaler, a loaded checkpoint, a failed or
interrupted check, a check of the next step racing the read, and a GPU rank without gradients."""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import Face, open_step
from interrupts import interrupted

import cupy_amp.face
from cupy_amp import GradScaler, RanksMayDisagreeError, ScalerProtocolError, SyncFreeGradScaler


def nan_first() -> np.ndarray:
    return np.array([np.nan, 1.0], np.float32)


def test_a_disabled_scaler_does_not_flag_a_finite_gradient_from_the_last_enabled_step() -> None:
    scaler = GradScaler(init_scale=2.0)
    open_step(scaler).check([nan_first()])  # an enabled step whose gradient 0 held nan
    scaler.update()
    scaler.set_enabled(False)
    scaler.check([np.array([1.0, 2.0], np.float32)], report=True)  # finite gradients, disabled
    (row,) = scaler.gradient_numerics()
    assert not row.nonfinite


def test_a_disabled_scaler_flags_a_nan_gradient() -> None:
    scaler = GradScaler(enabled=False)
    stats = scaler.check([nan_first()], report=True)
    assert not bool(stats.finite)
    (row,) = scaler.gradient_numerics()
    assert row.nonfinite


def test_a_loaded_checkpoint_ends_the_report(face: Face) -> None:
    scaler = face(init_scale=2.0)
    checkpoint = scaler.checkpoint()
    open_step(scaler).check([nan_first()], report=True)
    scaler.update()
    assert scaler.gradient_numerics()[0].nonfinite
    scaler.load_checkpoint(checkpoint)  # forgets the step's culprits: a report now would call the nan finite
    with pytest.raises(ScalerProtocolError, match="report=True"):
        scaler.gradient_numerics()


class OneRank:
    """A one-rank communicator whose sum can be made to fail or to answer garbage."""

    def __init__(self) -> None:
        self.mode = "ok"

    def reduce_sum(self, values: Any, stream: Any) -> None:
        if self.mode == "raise":
            raise RuntimeError("link down")
        if self.mode == "garbage":
            values[0] = 0.5


@pytest.mark.parametrize("mode", ["raise", "garbage"])
@pytest.mark.parametrize("cls", [GradScaler, SyncFreeGradScaler], ids=["GradScaler", "SyncFree"])
def test_a_failed_check_serves_no_report_of_the_last_step(cls: Any, mode: str) -> None:
    comm = OneRank()
    scaler = cls(init_scale=2.0, comm=comm)
    open_step(scaler).check([np.array([1.0, 0.0], np.float32)], report=True)
    scaler.update()
    comm.mode = mode
    open_step(scaler)
    with contextlib.suppress(Exception):
        scaler.check([np.array([3.0, 3.0, 3.0], np.float32), np.array([0.0], np.float32)], report=True)
    with contextlib.suppress(ScalerProtocolError, RanksMayDisagreeError):  # (a failed communicator poisons)
        rows = scaler.gradient_numerics()
        assert [(row.label, row.size) for row in rows] == [(0, 3), (1, 1)], rows  # if served, this step's


@pytest.mark.parametrize("cls", [GradScaler, SyncFreeGradScaler], ids=["GradScaler", "SyncFree"])
def test_an_interrupted_check_never_serves_the_last_steps_report_as_this_ones(cls: Any) -> None:
    k = 1
    while True:
        scaler = cls(init_scale=2.0)
        open_step(scaler).check([np.array([1.0, 0.0], np.float32)], report=True)
        scaler.update()
        open_step(scaler)
        second = [np.array([3.0, 3.0, 3.0], np.float32), np.array([np.nan], np.float32)]
        before = scaler._step.number
        try:
            reached = interrupted(lambda s=scaler, g=second: s.check(g, report=True), k)
        except KeyboardInterrupt:
            reached = True
        if not reached:
            break
        with contextlib.suppress(ScalerProtocolError):
            rows = [(row.label, row.size, row.nonfinite) for row in scaler.gradient_numerics()]
            if scaler._step.number == before:  # the step's gradient part never opened: the last step's report
                assert rows == [(0, 2, False)], k
            else:
                assert rows == [(0, 3, False), (1, 1, True)], k
        k += 1
    assert k > 20


def _line(frame: Any) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


@pytest.mark.parametrize("cls", [GradScaler, SyncFreeGradScaler], ids=["GradScaler", "SyncFree"])
def test_gradient_numerics_is_not_torn_by_the_next_steps_check_in_another_thread(cls: Any) -> None:
    """Step N's report, read while another thread's check(report=True) of step N+1 runs."""
    scaler = cls(init_scale=2.0)
    open_step(scaler).check([np.array([1.0, 0.0], np.float32)], report=True)
    scaler.update()
    open_step(scaler)
    second = [np.array([5.0, 5.0, 5.0], np.float32), np.array([7.0], np.float32)]
    at_read, go_on = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != cupy_amp.face.__file__:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and "nonfinite = set(" in _line(frame):  # past the step test, before the read
                at_read.set()
                go_on.wait(5)
            return local

        return local

    rows: list[Any] = []
    errors: list[BaseException] = []

    def reader() -> None:
        sys.settrace(tracer)
        try:
            rows.extend(scaler.gradient_numerics())
        except BaseException as error:
            errors.append(error)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=reader)
    thread.start()
    assert at_read.wait(5)
    checker = threading.Thread(target=lambda: scaler.check(second, report=True))
    checker.start()
    checker.join(0.5)  # it would be done by now if gradient_numerics() did not hold the scaler's lock
    go_on.set()
    thread.join(5)
    checker.join(5)
    assert not errors, errors  # IndexError: step N+1's rows under step N's labels
    assert [(row.label, row.size, row.zeros) for row in rows] == [(0, 2, 1)]  # step N's, whole
    assert [row.size for row in scaler.gradient_numerics()] == [3, 1]  # then step N+1's


def test_the_device_report_pass_over_no_gradients_reaches_the_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """check([], report=True) on a GPU state: DeviceStatsRecord.gather(plan=None, report=True).

    A call without arrays (a rank without gradients) runs the statistics pass over nothing on the state the
    scaler already has, a DeviceState once GPU arrays placed one. Run here without a GPU: only the record's
    host-side logic, with stand-ins for its device memory and its finishing launch.
    """
    device_stats = pytest.importorskip("cupy_amp.gpu.stats")
    finished: list[dict[str, Any]] = []
    record = object.__new__(device_stats.DeviceStatsRecord)
    record._grid = 4
    record._partials = SimpleNamespace(size=0, data=SimpleNamespace(ptr=0))
    # Room for the report's whole-call numbers, which are zeroed even over no gradients (the memset stands in).
    record._report = SimpleNamespace(size=3, nbytes=24, data=SimpleNamespace(ptr=4096))
    zeroed: list[tuple[int, int]] = []
    monkeypatch.setattr(
        device_stats.cupy.cuda.runtime, "memsetAsync", lambda ptr, value, size, stream: zeroed.append((ptr, size))
    )
    record.result = SimpleNamespace(stream=None)
    record.address = 0
    record._finish = lambda grid, stream, **fields: finished.append(fields)
    stream = SimpleNamespace(ptr=0)
    record.gather(None, stream, 0, lambda group: 0, 0.0, False)
    # This call raised TypeError: 'NoneType' object is not iterable (twice: the plan, then its sizes).
    record.gather(None, stream, 0, lambda group: 0, 0.0, False, report=True)
    assert len(finished) == 2 and zeroed == [(4096, 24)]
    # The finish gets the zeroed numbers of no elements (the journal: amax 0, fractions NaN), else the same.
    assert finished[1] == {**finished[0], "step_report": 4096, "elements": 0, "call": 0}
