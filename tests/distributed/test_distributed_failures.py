"""Every rank joins exactly one all-reduce per call, whatever fails, and never contradicts its own gradients.

Ranks are threads with NumPy gradients summing through :mod:`fake_comm`; a rank
that missed a collective would make the others fail on the barrier's timeout.
The communicator's own failures and garbage answers are played by stand-ins.
Every scaler test runs on both faces.
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
    RanksMayDisagreeError,
)
from cupy_amp.distributed import POISON, count_verdict
from cupy_amp.twins import unscale_check


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
    real = unscale_check.multiply

    def multiply(array: np.ndarray, factor: Any) -> None:
        if getattr(failing_rank, "armed", False):
            raise DeviceLost("the device went away half-way")
        real(array, factor)
        failing_rank.armed = getattr(failing_rank, "fail_after_first", False)

    monkeypatch.setattr(unscale_check, "multiply", multiply)

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
    # One all-reduce per call, (own flag, ranks with inf/nan): rank 0's failure counted, then both refused retries.
    assert world.votes == [[(1, 1), (1, 2)], [(0, 1), (1, 2)]]


class RaisingVote:
    """A communicator that fails: its all-reduces raise."""

    def __init__(self) -> None:
        self.calls = 0

    def reduce_sum(self, values: Any, stream: Any) -> None:
        self.calls += 1
        raise ConnectionError("peer reset")


class AnsweringVote:
    """A communicator that answers a count of overflowed ranks of its choosing (and a sum of 0)."""

    def __init__(self, count: Any) -> None:
        self.count = count
        self.calls = 0

    def reduce_sum(self, values: Any, stream: Any) -> None:
        self.calls += 1
        values[...] = [self.count, 0.0]


def test_a_communicator_that_raises_poisons_the_scaler(face: Face) -> None:
    """NCCL's rule: a communicator that failed inside a collective is unusable; the ranks may disagree now."""
    vote = RaisingVote()
    scaler = face(init_scale=4.0, comm=vote)
    grads = [np.full(2, 8.0, np.float32)]
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="peer reset") as info:
        scaler.unscale_and_check(grads)
    assert isinstance(info.value.__cause__, ConnectionError)
    assert isinstance(info.value, RuntimeError)
    # The call cannot know whether it took part: no second join, but the poisoned vote, sent once (and failing).
    assert vote.calls == 2
    for call in (scaler.had_overflow, scaler.update, scaler.stats, lambda: scaler.unscale_and_check(grads)):
        with pytest.raises(RanksMayDisagreeError, match="Restore every rank from the last checkpoint"):
            call()
    assert vote.calls == 2
    assert grads[0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("count", [float("nan"), -1.0, 0.5, float("inf"), POISON * 2.0**21, 1e300])
def test_an_answer_that_is_no_count_of_ranks_is_a_communicator_error(face: Face, count: float) -> None:
    vote = AnsweringVote(count)
    scaler = face(init_scale=4.0, comm=vote)
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="no such count"):
        scaler.unscale_and_check([np.full(2, 8.0, np.float32)])
    assert vote.calls == 1
    assert scaler.had_overflow() is True  # every rank got the same garbage, so every rank skips: they agree
    scaler.update()
    assert scaler.stats().skipped_steps == 1


def test_a_rank_whose_gradients_hold_inf_never_reports_a_finite_step(face: Face) -> None:
    scaler = face(init_scale=4.0, comm=AnsweringVote(1.0))  # one rank overflowed: this one
    open_step(scaler)
    assert face.ok(scaler.unscale_and_check({"w": np.array([1.0, np.inf], np.float32)})) is False
    assert scaler.nonfinite_gradients() == ["w"]
    assert scaler.stats().last_overflow == "local"
    # Every call answers for the step so far: a clean call after the overflow still says "skip".
    assert face.ok(scaler.unscale_and_check([np.ones(2, np.float32)])) is False
    assert scaler.nonfinite_gradients() == ["w"]
    # An answer of 0 ranks, below this rank's own overflow, is no sum of the ranks' flags: an error, and a skip.
    scaler.update()
    scaler = face(init_scale=4.0, comm=AnsweringVote(0.0))
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="no such count"):
        scaler.unscale_and_check({"w": np.array([1.0, np.inf], np.float32)})
    assert scaler.had_overflow() is True


def test_an_error_of_the_join_after_a_failure_does_not_hide_the_original_error(face: Face) -> None:
    vote = RaisingVote()
    scaler = face(init_scale=4.0, comm=vote)
    open_step(scaler)
    with pytest.raises(GradientTypeError, match="int32") as info:
        scaler.unscale_and_check([np.ones(2, np.int32)])
    assert isinstance(info.value, CupyAmpError)
    assert any("joining the all-reduce after this failure failed" in note for note in info.value.__notes__)
    # That join's outcome is unknown too: the scaler refuses from now on, rather than guess, and tries to
    # tell the other ranks (a thread of its own sends the poisoned vote; here it fails too, and is logged).
    assert scaler._step.poison_sender is not None
    scaler._step.poison_sender.join(5.0)
    assert vote.calls == 2
    with pytest.raises(RanksMayDisagreeError):
        scaler.update()


@pytest.mark.parametrize(
    ("count", "local", "verdict"), [(0.0, False, False), (3.0, False, True), (1.0, True, True), (7.0, True, True)]
)
def test_a_summed_count_is_read_as_the_ranks_that_overflowed(count: float, local: bool, verdict: bool) -> None:
    assert count_verdict(count, local) is verdict


@pytest.mark.parametrize(("count", "local"), [(0.0, True), (1.5, False), (-1.0, False), (float("nan"), False)])
def test_a_count_below_this_ranks_own_flag_or_not_whole_is_a_communicator_error(count: float, local: bool) -> None:
    with pytest.raises(CommunicatorError, match="no such count"):
        count_verdict(count, local)


@pytest.mark.parametrize("others", [0.0, 1.0, 5.0, POISON, 3.0 * POISON + 2.0], ids=["0", "1", "5", "two", "four"])
def test_a_poisoned_count_is_the_poison_error(others: float) -> None:
    """One poisoned vote, or several in one collective (one Ctrl-C reaching several processes)."""
    with pytest.raises(RanksMayDisagreeError, match="Another rank's gradient call failed"):
        count_verdict(POISON + others, False)
