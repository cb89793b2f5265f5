"""Every rank votes exactly once per call, whatever fails, and never contradicts its own gradients.

Ranks are threads with NumPy gradients voting through :mod:`fake_comm`; a rank
that missed a vote would make the others fail on the barrier's timeout. The
communicator's own failures and garbage answers are played by stand-ins. Every
scaler test runs on both faces.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import Face, open_step

from cupy_amp import (
    CommunicatorError,
    CupyAmpError,
    DuplicateGradientError,
    GradientTypeError,
    numpy_backend,
)
from cupy_amp.distributed import device_answer


class DeviceLost(RuntimeError):
    pass


def stats_tuple(scaler: Any) -> tuple[Any, ...]:
    stats = scaler.stats()
    return stats.scale, stats.steps, stats.skipped_steps, stats.backoffs, stats.consecutive_good_steps


def test_a_call_rejected_on_one_rank_skips_the_step_on_every_rank_alike(face: Face) -> None:
    def body(world: FakeWorld, rank: int) -> tuple[Any, ...]:
        scaler = face(init_scale=1024.0, comm=FakeVote(world, rank))
        grads: list[Any] = [np.ones(2, np.float32)]
        open_step(scaler)
        if rank == 0:
            grads.append(np.ones(2, np.int32))  # a bug in this rank's training loop
            with pytest.raises(GradientTypeError):
                scaler.unscale_and_check(grads)
            outcome = "rejected"
        else:
            outcome = face.ok(scaler.unscale_and_check(grads))
        scaler.update()  # every rank ends the step, and backs off alike
        return outcome, scaler.had_overflow(), stats_tuple(scaler)

    world = FakeWorld(2)
    (rejected, *rank0), (skipped, *rank1) = run_ranks(world, body)
    assert (rejected, skipped) == ("rejected", False)
    assert rank0 == rank1 == [True, (512.0, 1, 1, 1, 0)]
    assert [world.vote_count(rank) for rank in range(2)] == [1, 1]


def test_a_failure_after_the_gradients_were_written_votes_overflow_once(
    face: Face, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_rank = threading.local()
    real = numpy_backend._multiply

    def multiply(array: np.ndarray, factor: Any) -> None:
        if getattr(failing_rank, "armed", False):
            raise DeviceLost("the device went away half-way")
        real(array, factor)
        failing_rank.armed = getattr(failing_rank, "fail_after_first", False)

    monkeypatch.setattr(numpy_backend, "_multiply", multiply)

    def body(world: FakeWorld, rank: int) -> tuple[Any, ...]:
        scaler = face(init_scale=1024.0, comm=FakeVote(world, rank))
        grads = [np.full(2, 2048.0, np.float32), np.full(2, 2048.0, np.float32)]
        open_step(scaler)  # before arming: scale_loss multiplies too
        failing_rank.fail_after_first = rank == 0
        try:
            outcome: Any = face.ok(scaler.unscale_and_check(grads))
        except DeviceLost:
            outcome = "failed"
            failing_rank.armed = failing_rank.fail_after_first = False
        # A retry is a call of its own, refused on every rank (the memory was claimed), and votes "overflow".
        with pytest.raises(DuplicateGradientError):
            scaler.unscale_and_check(grads)
        scaler.update()
        return outcome, [g.tolist() for g in grads], stats_tuple(scaler)

    world = FakeWorld(2)
    (failed, grads0, stats0), (skipped, grads1, stats1) = run_ranks(world, body)
    assert (failed, skipped) == ("failed", False)
    assert grads0 == [[2.0, 2.0], [2048.0, 2048.0]]  # the first array unscaled once, the second never
    assert grads1 == [[2.0, 2.0], [2.0, 2.0]]
    assert stats0 == stats1 == (512.0, 1, 1, 1, 0)
    assert world.votes == [[(1, 1), (1, 1)], [(0, 1), (1, 1)]]  # one vote per call: rank 0's failure counted


class RaisingVote:
    """A communicator that fails: its collectives raise."""

    def __init__(self) -> None:
        self.calls = 0

    def reduce_max(self, flags: Any, stream: Any) -> None:
        raise AssertionError("NumPy gradients vote from the host")

    def host_vote(self, local_overflow: bool) -> bool:
        self.calls += 1
        raise ConnectionError("peer reset")


class AnsweringVote:
    """A communicator that answers whatever it was told to."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def reduce_max(self, flags: Any, stream: Any) -> None:
        raise AssertionError("NumPy gradients vote from the host")

    def host_vote(self, local_overflow: bool) -> Any:
        self.calls += 1
        return self.answer


def test_a_communicator_that_raises_is_a_communicator_error_and_the_step_is_skipped(face: Face) -> None:
    vote = RaisingVote()
    scaler = face(init_scale=4.0, comm=vote)
    grads = [np.full(2, 8.0, np.float32)]
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="peer reset") as info:
        scaler.unscale_and_check(grads)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert isinstance(info.value, RuntimeError)
    # A vote that raised took no part in the collective, so the call votes "overflow" once more (and fails again).
    assert vote.calls == 2
    assert isinstance(info.value.__context__, CommunicatorError)
    assert scaler.had_overflow() is True
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads)
    assert grads[0].tolist() == [2.0, 2.0]
    scaler.update()
    assert scaler.stats().skipped_steps == 1


@pytest.mark.parametrize("answer", [1, 0, "yes", None, np.int32(0), 0.0, [False]])
def test_an_answer_that_is_not_a_bool_is_a_communicator_error(face: Face, answer: Any) -> None:
    vote = AnsweringVote(answer)
    scaler = face(init_scale=4.0, comm=vote)
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="expected a bool"):
        scaler.unscale_and_check([np.full(2, 8.0, np.float32)])
    assert vote.calls == 1
    assert scaler.had_overflow() is True
    scaler.update()
    assert scaler.stats().skipped_steps == 1


@pytest.mark.parametrize("answer", [False, np.bool_(False)])
def test_a_rank_whose_gradients_hold_inf_never_reports_a_finite_step(face: Face, answer: Any) -> None:
    scaler = face(init_scale=4.0, comm=AnsweringVote(answer))  # the others say "all finite"
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check({"w": np.array([1.0, np.inf], np.float32)})) is False
    assert scaler.nonfinite_gradients() == ["w"]
    assert scaler.stats().last_overflow == "local"
    # Every call answers for the step so far: a clean call after the overflow still says "skip".
    assert face.ok(scaler.unscale_and_check([np.ones(2, np.float32)])) is False
    assert scaler.nonfinite_gradients() == ["w"]


def test_an_error_of_the_overflow_vote_does_not_hide_the_original_error(face: Face) -> None:
    vote = RaisingVote()
    scaler = face(init_scale=4.0, comm=vote)
    open_step(scaler)
    with pytest.raises(GradientTypeError, match="int32") as info:
        scaler.unscale_and_check([np.ones(2, np.int32)])
    assert isinstance(info.value, CupyAmpError)
    assert isinstance(info.value.__context__, CommunicatorError)
    assert vote.calls == 1
    scaler.update()  # the rank's own step counts as overflowed, as the others' would
    assert scaler.stats().skipped_steps == 1


@pytest.mark.parametrize(
    ("local", "agreed", "verdict"), [(0, 0, False), (0, 7, True), (5, 5, True), (5, 9, True)], ids=str
)
def test_a_device_vote_is_read_as_a_maximum_over_the_ranks(local: int, agreed: int, verdict: bool) -> None:
    assert device_answer(local, agreed) is verdict


@pytest.mark.parametrize(("local", "agreed"), [(5, 0), (5, 4), (0, -1)], ids=str)
def test_a_device_vote_below_this_ranks_own_flag_is_a_communicator_error(local: int, agreed: int) -> None:
    with pytest.raises(CommunicatorError, match="not a maximum"):
        device_answer(local, agreed)
