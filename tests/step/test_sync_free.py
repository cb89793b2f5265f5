"""SyncFreeGradScaler on the NumPy path: GradScaler's semantics, with the verdict as an array.

The NumPy path runs the same scaler code as the GPU path, with the state on the
host (numpy_backend.HostState); tests/gpu/test_sync_free_gpu.py checks the
device state against it. The protocol both faces share (call order, claims,
failures, threads, votes, checkpoints, caching, the reference model) is tested
on both in the hardening suites (the ``face`` fixture); here: what only this
face has, and the bit-for-bit comparison of the two.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import assert_same_bits, open_step

from cupy_amp import (
    ArgumentTypeError,
    ConfigError,
    GradientSet,
    GradScaler,
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
    open_step(scaler)
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
    open_step(scaler)
    scaler.unscale_and_check([np.ones(2, np.float32)])
    scaler.apply_if_finite(params, [np.full(3, 1.5, np.float32), np.full((2, 2), 2.5)])
    scaler.update()
    assert params[0].tolist() == [1.5] * 3 and params[1].tolist() == [[2.5, 2.5]] * 2
    open_step(scaler)
    scaler.unscale_and_check([np.array([np.nan], np.float32)])
    scaler.apply_if_finite(params, [np.full(3, 9.0, np.float32), np.full((2, 2), 9.0)])
    assert params[0].tolist() == [1.5] * 3 and params[1].tolist() == [[2.5, 2.5]] * 2
    with pytest.raises(ArgumentTypeError, match="as many updates as targets"):
        scaler.apply_if_finite(params, params[:1])


def test_checkpoints_move_between_the_two_scalers_and_resume_alike() -> None:
    rng = random.Random(7)
    reference = GradScaler(init_scale=8.0, growth_interval=2, hysteresis=2)
    for _ in range(5):
        open_step(reference)
        reference.unscale_and_check(random_gradients(rng, poison=rng.random() < 0.5))
        reference.update()
    sync_free = SyncFreeGradScaler(init_scale=1.0)
    sync_free.load_checkpoint(reference.checkpoint())
    assert sync_free.config == reference.config and stats_of(sync_free) == stats_of(reference)
    for _ in range(20):
        grads = random_gradients(rng, poison=rng.random() < 0.4)
        open_step(sync_free)
        open_step(reference)
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


def test_prepare_returns_a_gradient_set_the_scaler_then_takes() -> None:
    scaler = SyncFreeGradScaler(init_scale=2.0)
    grads = {"w": np.full(2, 4.0, np.float32), "b": np.array([np.inf], np.float32)}
    prepared = scaler.prepare(grads)
    assert isinstance(prepared, GradientSet) and scaler.prepare(prepared) is prepared
    open_step(scaler)
    assert not scaler.unscale_and_check(prepared)
    assert scaler.nonfinite_gradients() == ["b"]
    assert grads["w"].tolist() == [2.0, 2.0]


def test_the_verdict_handed_out_cannot_be_overwritten() -> None:
    scaler = SyncFreeGradScaler()
    open_step(scaler)
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
        open_step(scaler)
        scaler.unscale_and_check([np.ones(2, np.float32)])
        scaler.update()
        grads: list[Any] = [np.ones(2, np.int32 if bad_argument else np.float32)]
        open_step(scaler)
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
