"""A collective is joined at most once per call, and its outcome is never guessed (cupy_amp.step.Ballot).

Two ranks as threads over fake_comm's counting communicator. Each test fails on
commit 90b0989, where a call interrupted as its all-reduce returned joined a
second all-reduce as its vote (the ranks then paired the wrong votes), and a
call interrupted after an all-finite answer, before reading it, counted an
overflow of its own (its scale backed off while the others' grew).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import Face, open_step, refuses_every_call

from cupy_amp import GradientTypeError, GradScaler, RanksMayDisagreeError, ScalerProtocolError
from cupy_amp.optim import SGD
from cupy_amp.twins.step_state import HostState

POISON = 2.0**40


@pytest.mark.parametrize("method", ["unscale_and_check", "check"])
def test_a_ctrl_c_as_the_all_reduce_returns_joins_no_second_vote_and_every_rank_refuses(
    face: Face, method: str
) -> None:
    def body(world: FakeWorld, rank: int) -> list[float]:
        scaler = face(init_scale=4.0, growth_interval=1, comm=FakeVote(world, rank, interrupt_at=1 - rank))
        grads = [np.ones(3, np.float32)]
        open_step(scaler)
        if rank == 0:
            with pytest.raises(KeyboardInterrupt):
                getattr(scaler, method)(grads)
        else:
            getattr(scaler, method)(grads)  # the all-reduce this rank shared with rank 0 answered "clean"
            scaler.update()
            open_step(scaler)
            with pytest.raises(RanksMayDisagreeError):
                getattr(scaler, method)(grads)  # its next all-reduce meets rank 0's poisoned vote
        refuses_every_call(scaler)
        if scaler._step.poison_sender is not None:  # sent from a thread of its own: wait until it has voted
            scaler._step.poison_sender.join(10)
        return [float(pair[0]) for pair in world.sums[rank]]

    world = FakeWorld(2)
    sent0, sent1 = run_ranks(world, body)
    assert sent0 == [0.0, POISON], "rank 0 joined a second vote instead of sending the poison"
    assert sent1 == [0.0, 0.0]


@pytest.mark.parametrize("method", ["unscale_and_check", "check"])
def test_an_interrupt_reading_an_all_finite_verdict_never_lets_the_scales_diverge(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Rank 0's read of the verdict is interrupted after the all-reduce answered "all finite" (on the GPU, the
    stream synchronize inside the read: the host's longest wait). Its user catches the KeyboardInterrupt and
    trains on. The ranks' scales must agree, or every rank must refuse."""
    real_read, armed = HostState.read, [True]

    def read(self: HostState) -> Any:
        if armed and threading.current_thread().name == "rank-0":
            armed.clear()
            raise KeyboardInterrupt
        return real_read(self)

    monkeypatch.setattr(HostState, "read", read)

    def body(world: FakeWorld, rank: int) -> Any:
        threading.current_thread().name = f"rank-{rank}"
        scaler = GradScaler(init_scale=4.0, growth_interval=1, comm=FakeVote(world, rank))
        try:
            for _ in range(3):
                open_step(scaler)
                with contextlib.suppress(KeyboardInterrupt):  # the user's handler: go on with the step
                    getattr(scaler, method)([np.ones(3, np.float32)])
                scaler.update()
            return scaler.stats().scale, scaler.stats().skipped_steps
        except RanksMayDisagreeError:
            refuses_every_call(scaler)
            return "refused"

    outcomes = run_ranks(FakeWorld(2), body)
    assert not armed, "the read was never interrupted"
    assert outcomes[0] == outcomes[1], f"the ranks diverged without a word: {outcomes}"


def test_the_poisoning_rank_returns_at_once_when_no_other_rank_calls_again() -> None:
    """Rank 0 is interrupted as the last step's all-reduce returns; rank 1 finishes and never joins another
    collective. The poisoned vote is sent from a thread of its own, so rank 0's call returns at once instead
    of waiting for a collective that never comes (real NCCL has no timeout)."""

    def body(world: FakeWorld, rank: int) -> float:
        scaler = GradScaler(init_scale=4.0, comm=FakeVote(world, rank, interrupt_at=1 - rank))
        open_step(scaler)
        begin = time.monotonic()
        try:
            scaler.unscale_and_check([np.ones(3, np.float32)])
        except KeyboardInterrupt:
            assert scaler._step.broken is not None
        else:
            assert rank == 1
            scaler.update()
        return time.monotonic() - begin

    seconds = run_ranks(FakeWorld(2, timeout=3.0), body)
    assert seconds[0] < 1.0, f"rank 0 waited {seconds[0]:.1f} s to send its poisoned vote"


def test_two_poisoned_votes_in_one_collective_poison_the_third_rank() -> None:
    def body(world: FakeWorld, rank: int) -> str:
        scaler = GradScaler(init_scale=4.0, growth_interval=1, comm=FakeVote(world, rank, interrupt_at=int(rank < 2)))
        grads = [np.ones(3, np.float32)]
        open_step(scaler)
        if rank < 2:  # one Ctrl-C reaching two processes
            with pytest.raises(KeyboardInterrupt):
                scaler.unscale_and_check(grads)
            return "interrupted"
        scaler.unscale_and_check(grads)
        scaler.update()
        open_step(scaler)
        with pytest.raises(RanksMayDisagreeError):
            scaler.unscale_and_check(grads)  # 2 * POISON arrives in one collective
        refuses_every_call(scaler)
        return "refused"

    assert run_ranks(FakeWorld(3), body) == ["interrupted", "interrupted", "refused"]


def test_a_poisoned_vote_met_by_a_rejected_call_still_poisons_that_rank() -> None:
    """Rank 1's next call is rejected (an int32 gradient) and joins as an overflowed rank: the answer it gets
    holds rank 0's poisoned vote, which it must not ignore."""

    def body(world: FakeWorld, rank: int) -> str:
        scaler = GradScaler(init_scale=4.0, comm=FakeVote(world, rank, interrupt_at=1 - rank))
        open_step(scaler)
        if rank == 0:
            with pytest.raises(KeyboardInterrupt):
                scaler.unscale_and_check([np.ones(3, np.float32)])
            return "interrupted"
        scaler.unscale_and_check([np.ones(3, np.float32)])
        scaler.update()
        open_step(scaler)
        with pytest.raises(GradientTypeError):
            scaler.unscale_and_check([np.ones(3, np.int32)])
        refuses_every_call(scaler)
        return "refused"

    assert run_ranks(FakeWorld(2), body) == ["interrupted", "refused"]


def test_a_disabled_scalers_step_stopped_between_its_optimizers_poisons_whatever_the_last_enabled_step_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(1)
    scaler = GradScaler(init_scale=4.0, comm=FakeVote(world, 0))
    open_step(scaler).unscale_and_check([np.array([np.inf], np.float32)])  # the last enabled step overflowed
    scaler.update()
    scaler.set_enabled(False)
    opt0, opt1 = SGD([np.zeros(2, np.float32)], lr=1.0), SGD([np.zeros(2, np.float32)], lr=1.0)

    def stopped(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(opt1, "step", stopped)
    with pytest.raises(KeyboardInterrupt):
        scaler.step([opt0, opt1], [[np.ones(2, np.float32)], [np.ones(2, np.float32)]])
    assert opt0.step_count == 1  # opt0 applied the disabled check: the other ranks apply both
    with pytest.raises(RanksMayDisagreeError):
        scaler.update()


def test_a_second_scaler_step_in_one_step_is_refused_without_poisoning() -> None:
    scaler = GradScaler(init_scale=4.0, comm=FakeVote(FakeWorld(1), 0))
    opt0, opt1 = SGD([np.zeros(2, np.float32)], lr=1.0), SGD([np.zeros(2, np.float32)], lr=1.0)
    open_step(scaler).step(opt0, [np.ones(2, np.float32)])
    with pytest.raises(ScalerProtocolError, match=r"scaler\.step\(\[optimizer0, optimizer1\]"):
        scaler.step(opt1, [np.ones(2, np.float32)])  # PyTorch's idiom: refused, nothing changed
    scaler.update()
    assert scaler._step.broken is None and scaler.stats().steps == 1


def test_a_check_whose_verdict_read_fails_leaves_the_record_saying_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    scaler = GradScaler(init_scale=4.0, comm=FakeVote(FakeWorld(1), 0))
    real_read, armed = HostState.read, [True]

    def read(self: HostState) -> Any:
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        return real_read(self)

    monkeypatch.setattr(HostState, "read", read)
    with pytest.raises(KeyboardInterrupt):
        open_step(scaler).check([np.ones(3, np.float32)])
    assert int(scaler._scaling.default.stats.skip) == 1, "a check that failed left 'apply' in the record"
