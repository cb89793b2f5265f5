"""SyncFreeGradScaler on the NumPy path: GradScaler's semantics, with the verdict as an array.

The NumPy path runs the same scaler code as the GPU path, with the state on the
host (numpy_backend.HostState); tests/gpu/test_sync_free_gpu.py checks the
device state against it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import assert_same_bits

from cupy_amp import (
    ArgumentTypeError,
    CommunicatorError,
    ConfigError,
    DuplicateGradientError,
    GradientSet,
    GradScaler,
    ScalerProtocolError,
    SyncFreeGradScaler,
    numpy_backend,
)

CONFIGS = [
    {"init_scale": 2.0**16, "growth_interval": 3},
    {"init_scale": 4.0, "growth_interval": 2, "min_scale": None, "max_scale": None, "hysteresis": 2},
    {"init_scale": 2.0**-120, "growth_interval": 1, "backoff_factor": 0.25, "min_scale": None, "max_scale": None},
    {"init_scale": 2.0**127, "growth_interval": 1, "growth_factor": 3.0, "min_scale": None, "max_scale": None},
    {"init_scale": 100.0, "growth_interval": 5, "growth_factor": 1.5, "backoff_factor": 0.7, "hysteresis": 3},
]


def random_gradients(rng: random.Random, poison: bool) -> list[np.ndarray]:
    grads = []
    for _ in range(rng.randint(1, 3)):
        values = [rng.uniform(-1e4, 1e4) for _ in range(rng.randint(1, 5))]
        grads.append(np.asarray(values, dtype=rng.choice([np.float16, np.float32])))
    if poison:
        grads[rng.randrange(len(grads))][0] = rng.choice([np.inf, -np.inf, np.nan])
    return grads


def stats_of(scaler: Any) -> dict[str, Any]:
    return dict(scaler.stats().to_dict())


@pytest.mark.parametrize("config", CONFIGS)
def test_every_step_matches_grad_scaler_bit_for_bit(config: dict[str, Any]) -> None:
    rng = random.Random(repr(config))
    reference, sync_free = GradScaler(**config), SyncFreeGradScaler(**config)
    for _ in range(600):
        loss = np.asarray(rng.uniform(0.1, 10.0), dtype=np.float32)
        theirs, ours = loss.copy(), loss.copy()
        reference.scale_loss(theirs)
        sync_free.scale_loss(ours)
        assert_same_bits(ours, theirs)
        expected = True
        for _call in range(rng.choice([1, 1, 2])):
            grads = random_gradients(rng, poison=rng.random() < 0.3)
            copies = [grad.copy() for grad in grads]
            expected = reference.unscale_and_check(copies) and expected
            verdict = sync_free.unscale_and_check(grads)
            assert bool(verdict) is expected
            for ours_grad, theirs_grad in zip(grads, copies):
                assert_same_bits(ours_grad, theirs_grad)
        assert sync_free.had_overflow() is reference.had_overflow()
        assert sync_free.nonfinite_gradients() == reference.nonfinite_gradients()
        reference.update()
        sync_free.update()
        assert stats_of(sync_free) == stats_of(reference)
    assert sync_free.checkpoint().to_bytes() == reference.checkpoint().to_bytes()


def test_the_verdict_is_one_array_valid_until_the_next_steps_first_call() -> None:
    scaler = SyncFreeGradScaler(init_scale=4.0)
    verdict = scaler.unscale_and_check([np.array([np.inf], np.float32)])
    assert isinstance(verdict, np.ndarray) and verdict.shape == () and verdict.dtype == np.bool_
    assert not verdict
    scaler.update()
    assert not verdict and scaler.had_overflow()  # still the last step's, after update()
    scaler.scale_loss(np.ones((), np.float32))
    assert not verdict  # scale_loss does not start the check
    again = scaler.unscale_and_check([np.ones(2, np.float32)])
    assert again is verdict and bool(verdict)


def test_apply_if_finite_writes_only_after_a_finite_step() -> None:
    scaler = SyncFreeGradScaler(init_scale=2.0)
    params: list[np.ndarray] = [np.zeros(3, np.float32), np.zeros((2, 2), np.float64)]
    scaler.unscale_and_check([np.ones(2, np.float32)])
    scaler.apply_if_finite(params, [np.full(3, 1.5, np.float32), np.full((2, 2), 2.5)])
    scaler.update()
    assert params[0].tolist() == [1.5] * 3 and params[1].tolist() == [[2.5, 2.5]] * 2
    scaler.unscale_and_check([np.array([np.nan], np.float32)])
    scaler.apply_if_finite(params, [np.full(3, 9.0, np.float32), np.full((2, 2), 9.0)])
    assert params[0].tolist() == [1.5] * 3 and params[1].tolist() == [[2.5, 2.5]] * 2
    with pytest.raises(ArgumentTypeError, match="as many updates as targets"):
        scaler.apply_if_finite(params, params[:1])


def test_call_order_is_enforced_as_by_grad_scaler() -> None:
    scaler = SyncFreeGradScaler()
    with pytest.raises(ScalerProtocolError, match="without an unscale_and_check"):
        scaler.update()
    scaler.scale_loss(np.ones((), np.float32))
    with pytest.raises(ScalerProtocolError, match="middle of a step"):
        scaler.checkpoint()
    with pytest.raises(ScalerProtocolError, match="middle of a step"):
        scaler.load_checkpoint(GradScaler().checkpoint())
    scaler.unscale_and_check([np.ones(1, np.float32)])
    with pytest.raises(ScalerProtocolError, match="update\\(\\) was forgotten"):
        scaler.scale_loss(np.ones((), np.float32))
    scaler.update()
    assert scaler.stats().steps == 1


def test_checkpoints_move_between_the_two_scalers_and_resume_alike() -> None:
    rng = random.Random(7)
    reference = GradScaler(init_scale=8.0, growth_interval=2, hysteresis=2)
    for _ in range(5):
        reference.unscale_and_check(random_gradients(rng, poison=rng.random() < 0.5))
        reference.update()
    sync_free = SyncFreeGradScaler(init_scale=1.0)
    sync_free.load_checkpoint(reference.checkpoint())
    assert sync_free.config == reference.config and stats_of(sync_free) == stats_of(reference)
    for _ in range(20):
        grads = random_gradients(rng, poison=rng.random() < 0.4)
        assert bool(sync_free.unscale_and_check([g.copy() for g in grads])) is reference.unscale_and_check(grads)
        sync_free.update()
        reference.update()
    assert sync_free.checkpoint().to_bytes() == reference.checkpoint().to_bytes()


def test_a_disabled_checkpoint_or_another_object_is_refused() -> None:
    scaler = SyncFreeGradScaler()
    before = scaler.stats()
    with pytest.raises(ConfigError, match="disabled scaler"):
        scaler.load_checkpoint(GradScaler(enabled=False).checkpoint())
    with pytest.raises(ArgumentTypeError, match="GradScalerCheckpoint"):
        scaler.load_checkpoint(GradScaler().checkpoint().to_dict())  # type: ignore[arg-type]
    assert scaler.stats() == before


def test_an_interrupt_half_way_counts_as_an_overflow_and_a_retry_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real, count = numpy_backend._multiply, [0]

    def multiply(array: np.ndarray, factor: Any) -> None:
        count[0] += 1
        if count[0] == 3:
            raise KeyboardInterrupt
        real(array, factor)

    monkeypatch.setattr(numpy_backend, "_multiply", multiply)
    scaler = SyncFreeGradScaler(init_scale=4.0)
    grads = [np.full(2, 8.0, np.float32) for _ in range(5)]
    with pytest.raises(KeyboardInterrupt):
        scaler.unscale_and_check(grads)
    assert scaler.had_overflow()
    with pytest.raises(DuplicateGradientError):
        scaler.unscale_and_check(grads)
    assert [g.tolist() for g in grads] == [[2.0, 2.0]] * 2 + [[8.0, 8.0]] * 3  # none divided twice
    scaler.update()
    assert scaler.stats().scale == 2.0 and scaler.stats().skipped_steps == 1


def test_prepare_returns_a_gradient_set_the_scaler_then_takes() -> None:
    scaler = SyncFreeGradScaler(init_scale=2.0)
    grads = {"w": np.full(2, 4.0, np.float32), "b": np.array([np.inf], np.float32)}
    prepared = scaler.prepare(grads)
    assert isinstance(prepared, GradientSet) and scaler.prepare(prepared) is prepared
    assert not scaler.unscale_and_check(prepared)
    assert scaler.nonfinite_gradients() == ["b"]
    assert grads["w"].tolist() == [2.0, 2.0]


def test_ranks_agree_and_a_rank_with_inf_never_steps() -> None:
    def body(world: FakeWorld, rank: int) -> tuple[Any, ...]:
        scaler = SyncFreeGradScaler(init_scale=64.0, comm=FakeVote(world, rank))
        verdicts = []
        for step in range(4):
            grads = [np.ones(2, np.float32)]
            if step % 2 and rank == 1:
                grads[0][0] = np.inf
            verdicts.append(bool(scaler.unscale_and_check(grads)))
            scaler.update()
        return tuple(verdicts), stats_of(scaler)

    world = FakeWorld(2)
    (verdicts0, stats0), (verdicts1, stats1) = run_ranks(world, body)
    assert verdicts0 == verdicts1 == (True, False, True, False)
    assert stats0["skipped_steps"] == stats1["skipped_steps"] == 2
    assert (stats0["remote_skipped_steps"], stats1["remote_skipped_steps"]) == (2, 0)
    assert [world.vote_count(rank) for rank in range(2)] == [4, 4]


class GarbageVote:
    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.votes = 0

    def reduce_max(self, flags: Any, stream: Any) -> None:
        raise AssertionError("the NumPy path votes from the host")

    def host_vote(self, local_overflow: bool) -> Any:
        self.votes += 1
        return self.answer


def test_a_garbage_answer_raises_and_counts_as_an_overflow() -> None:
    vote = GarbageVote(answer=3)
    scaler = SyncFreeGradScaler(init_scale=8.0, comm=vote)
    grads = [np.full(2, 16.0, np.float32)]
    with pytest.raises(CommunicatorError, match="answered 3"):
        scaler.unscale_and_check(grads)
    assert vote.votes == 1 and scaler.had_overflow()
    scaler.update()
    assert scaler.stats().skipped_steps == 1


def test_a_lying_answer_cannot_hide_this_ranks_own_overflow() -> None:
    scaler = SyncFreeGradScaler(init_scale=8.0, comm=GarbageVote(answer=False))
    assert not scaler.unscale_and_check([np.array([np.inf], np.float32)])
    scaler.update()
    assert scaler.stats().last_overflow == "local"


def test_the_verdict_handed_out_cannot_be_overwritten() -> None:
    scaler = SyncFreeGradScaler()
    verdict = scaler.unscale_and_check([np.array([np.inf], np.float32)])
    with pytest.raises(ValueError, match="read-only"):
        verdict[()] = True
    assert scaler.had_overflow()


class LaunchFailure(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("failing", "bad_argument"),
    [("begin_step", False), ("mark_overflow", True)],
    ids=["the step's flags cannot be reset", "a refused call cannot be marked"],
)
def test_a_failing_state_operation_still_votes_once(
    monkeypatch: pytest.MonkeyPatch, failing: str, bad_argument: bool
) -> None:
    # On the GPU these are kernel launches, which can fail (a dead context); the other ranks must not hang.
    real = getattr(numpy_backend.HostState, failing)

    def broken(self: Any) -> None:
        if getattr(self, "armed", False):
            raise LaunchFailure(failing)
        real(self)

    monkeypatch.setattr(numpy_backend.HostState, failing, broken)

    def body(world: FakeWorld, rank: int) -> tuple[Any, ...]:
        scaler = SyncFreeGradScaler(init_scale=8.0, comm=FakeVote(world, rank))
        scaler.unscale_and_check([np.ones(2, np.float32)])
        scaler.update()
        grads: list[Any] = [np.ones(2, np.int32 if bad_argument else np.float32)]
        if rank == 0:
            scaler._state.armed = True
            with pytest.raises(LaunchFailure):
                scaler.unscale_and_check(grads)
            scaler._state.armed = False
            outcome = "failed"
        else:
            outcome = bool(scaler.unscale_and_check([np.ones(2, np.float32)]))
        return outcome, world.vote_count(rank)

    world = FakeWorld(2, timeout=3.0)
    assert run_ranks(world, body) == [("failed", 2), (False, 2)]


def test_two_threads_passing_the_same_gradients_divide_them_once() -> None:
    import threading

    scaler = SyncFreeGradScaler(init_scale=2.0)
    grads = [np.full(1000, 8.0, np.float32) for _ in range(50)]
    barrier, outcomes = threading.Barrier(2), []

    def call() -> None:
        barrier.wait()
        try:
            outcomes.append(bool(scaler.unscale_and_check(grads)))
        except DuplicateGradientError:
            outcomes.append("refused")

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes, key=str) == [True, "refused"]
    assert all(grad.tolist() == [4.0] * 1000 for grad in grads)
