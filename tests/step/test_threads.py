"""One scaler used from several threads at once: calls are serialized, and no memory is unscaled twice.

Both faces: the lock, the claims and the re-entry refusal are the step machine's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import GRAD_SCALER, SYNC_FREE, Face, open_step

from cupy_amp import DuplicateGradientError, ScalerProtocolError
from cupy_amp.twins import unscale_check


@pytest.fixture
def slow_multiply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every in-place multiply take a while, so that two calls would overlap in time."""
    real = unscale_check.multiply

    def multiply(array: np.ndarray, factor: Any) -> None:
        time.sleep(0.02)
        real(array, factor)

    monkeypatch.setattr(unscale_check, "multiply", multiply)


def run_together(*bodies: Any) -> list[Any]:
    """Start every body at once, each in its own thread; return what each returned or raised."""
    barrier = threading.Barrier(len(bodies))
    results: list[Any] = [None] * len(bodies)

    def target(index: int) -> None:
        barrier.wait()
        try:
            results[index] = bodies[index]()
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=target, args=(index,)) for index in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


@pytest.mark.usefixtures("slow_multiply")
def test_two_threads_passing_the_same_list_divide_it_once(face: Face) -> None:
    scaler = face(init_scale=4.0, growth_interval=1000)
    grads = [np.full(3, 8.0, np.float32) for _ in range(4)]
    open_step(scaler)
    results = run_together(*[lambda: face.ok(scaler.unscale_and_check(grads))] * 2)
    assert sorted(type(result).__name__ for result in results) == ["DuplicateGradientError", "bool"]
    assert True in results
    assert all(isinstance(r, DuplicateGradientError) for r in results if r is not True)
    assert [g.tolist() for g in grads] == [[2.0] * 3] * 4  # divided once, not twice
    scaler.update()
    assert scaler.stats().steps == 1


@pytest.mark.usefixtures("slow_multiply")
def test_two_threads_with_disjoint_gradients_both_count_in_one_step(face: Face) -> None:
    scaler = face(init_scale=4.0, growth_interval=1000)
    first, second = [np.full(3, 8.0, np.float32)], [np.array([np.inf], np.float32)]
    open_step(scaler)
    results = run_together(
        lambda: face.ok(scaler.unscale_and_check(first)), lambda: face.ok(scaler.unscale_and_check(second))
    )
    # Each call answers for the step so far: the finite call says True only if it ran before the other.
    assert results[1] is False and results[0] in (True, False)
    assert scaler.had_overflow() is True
    assert scaler.nonfinite_gradients() == [0]
    scaler.update()
    assert (scaler.stats().steps, scaler.stats().skipped_steps) == (1, 1)
    assert first[0].tolist() == [2.0] * 3


@pytest.mark.usefixtures("slow_multiply")
def test_update_from_another_thread_waits_for_the_call_in_flight(face: Face) -> None:
    scaler = face(init_scale=4.0, growth_interval=1000)
    grads = [np.full(3, 8.0, np.float32) for _ in range(5)]

    def late_update() -> None:
        time.sleep(0.03)  # the call has claimed its arrays and is multiplying
        scaler.update()

    open_step(scaler)
    results = run_together(lambda: face.ok(scaler.unscale_and_check(grads)), late_update)
    assert results == [True, None]
    assert scaler.stats().steps == 1
    assert [g.tolist() for g in grads] == [[2.0] * 3] * 5


class CallbackVote:
    """A communicator whose vote runs a callback first (as a user's transport might)."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.seen: list[Any] = []

    def reduce_sum(self, values: Any, stream: Any) -> None:
        assert stream is None, "NumPy gradients are summed on the host"
        self.seen.append(self.callback())  # one rank: the sum is the rank's own pair


def test_reading_the_scaler_from_inside_its_own_call_works(face: Face) -> None:
    scaler: Any
    vote = CallbackVote(lambda: (scaler.stats().steps, scaler.had_overflow(), scaler.nonfinite_gradients()))
    scaler = face(init_scale=4.0, comm=vote)
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check([np.array([np.inf], np.float32)])) is False
    # GradScaler records the call's verdict on the host after its vote; the sync-free face keeps no host record,
    # its had_overflow() reads the state's flag, which this rank's own inf set before the vote. Neither records
    # the call's culprits before it returns.
    assert vote.seen == [(0, face is SYNC_FREE, [])]


METHODS = ["update", "checkpoint", "load_checkpoint", "unscale_and_check", "scale_loss", "abandon_step"]  # +set_enabled


@pytest.mark.parametrize(
    ("face", "method"),
    [*((face, method) for face in (GRAD_SCALER, SYNC_FREE) for method in METHODS), (GRAD_SCALER, "set_enabled")],
    ids=str,
)
def test_changing_the_scaler_from_inside_its_own_call_raises_instead_of_hanging(face: Face, method: str) -> None:
    scaler: Any
    calls = {
        "update": lambda: scaler.update(),
        "checkpoint": lambda: scaler.checkpoint(),
        "load_checkpoint": lambda: scaler.load_checkpoint(face().checkpoint()),
        "unscale_and_check": lambda: scaler.unscale_and_check([np.ones(2, np.float32)]),
        "scale_loss": lambda: scaler.scale_loss(np.ones((), np.float32)),
        "abandon_step": lambda: scaler.abandon_step(),
        "set_enabled": lambda: scaler.set_enabled(False),
    }

    def grads() -> Any:  # a generator passed as gradients runs inside the call
        yield np.ones(2, np.float32)
        calls[method]()

    scaler = face(init_scale=4.0)
    started = time.monotonic()
    open_step(scaler)
    with pytest.raises(ScalerProtocolError, match="from inside one of its own calls"):
        scaler.unscale_and_check(grads())
    assert time.monotonic() - started < 5
    assert face.ok(scaler.unscale_and_check([np.ones(2, np.float32)])) is True  # the scaler still works


@pytest.mark.parametrize("method", ["unscale_and_check", "check"])
def test_a_switch_made_before_a_call_takes_the_lock_is_the_one_the_call_sees(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Another thread's set_enabled(True) lands after a gradient call was entered, before it takes the lock.

    The call must run on the scaler as the lock finds it: enabled, with no scale_loss in the step, so it is
    refused. A call that chose its states before the lock ran on the disabled scaler's guard: the inf below
    went uncounted, and update() then grew the enabled scale after a step that had overflowed.
    """
    from cupy_amp import GradScaler
    from cupy_amp.step import Step

    scaler = GradScaler(enabled=False, growth_interval=1)
    real, armed = Step.admit, [True]

    def admit(self: Step) -> Any:
        if armed:  # the first call after this point is the gradient call below
            armed.clear()
            scaler.set_enabled(True)  # the other thread's call, served first
        return real(self)

    monkeypatch.setattr(Step, "admit", admit)
    with pytest.raises(ScalerProtocolError, match="no scale_loss"):
        getattr(scaler, method)([np.array([1.0, np.inf], np.float32)])
    assert not armed and scaler.is_enabled()
    with pytest.raises(ScalerProtocolError):
        scaler.update()  # no gradient call counted in the step
    assert scaler.stats().scale == 65536.0 and scaler.stats().growths == 0


def test_update_from_another_thread_waits_for_scaler_step_to_apply_every_optimizer(face: Face) -> None:
    # scaler.step is one call: another thread's update() cannot close the step between its check and its
    # optimizers (which left the first optimizer applied and the second refused: half a step).
    from cupy_amp.optim import SGD

    entered, release = threading.Event(), threading.Event()

    class GatedSGD(SGD):
        def step(self, gradients: Any, stats: Any = None) -> None:
            entered.set()
            assert release.wait(30)
            super().step(gradients, stats)

    params = [np.ones(4, np.float32), np.ones(4, np.float32)]
    first, second = GatedSGD([params[0]], lr=0.5), SGD([params[1]], lr=0.5)
    scaler = open_step(face(init_scale=2.0, growth_interval=1000))
    grads = [[np.full(4, 2.0, np.float32)], [np.full(4, 4.0, np.float32)]]
    outcome: dict[str, Any] = {}

    def stepping() -> None:
        try:
            outcome["step"] = scaler.step([first, second], grads)
        except Exception as error:
            outcome["step"] = error

    def updating() -> None:
        try:
            scaler.update()
            outcome["update"] = "done"
        except Exception as error:
            outcome["update"] = error

    stepper = threading.Thread(target=stepping)
    stepper.start()
    assert entered.wait(30)
    updater = threading.Thread(target=updating)
    updater.start()
    updater.join(0.3)
    blocked = updater.is_alive()  # it waits for scaler.step, which holds the scaler
    release.set()
    stepper.join(30)
    updater.join(30)
    assert not isinstance(outcome["step"], Exception), outcome["step"]
    assert blocked
    assert outcome["update"] == "done"
    assert params[0].tolist() == [0.5] * 4  # 1 - 0.5 * 2 / 2
    assert params[1].tolist() == [0.0] * 4  # 1 - 0.5 * 4 / 2: both optimizers applied the step
    assert scaler.stats().steps == 1
