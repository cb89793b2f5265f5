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
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import Face, open_step, refuses_every_call

from cupy_amp import GradScaler, RanksMayDisagreeError
from cupy_amp.numpy_backend import HostState

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
