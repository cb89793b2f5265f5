"""The update rule, walked step by step through the public API with every field asserted."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import open_step

from cupy_amp import GradScaler, GradScalerCheckpoint

SMALLEST_SCALE = float.fromhex("0x1.000008p-128")  # the smallest float32 whose float32 inverse is finite
FLOAT32_MAX = float(np.finfo(np.float32).max)


def step(scaler: GradScaler, overflow: bool) -> None:
    """Run one training step whose gradients do (or do not) hold an inf."""
    grad = np.array([1.0, np.inf if overflow else 2.0, 3.0], dtype=np.float32)
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is (not overflow)
    scaler.update()
    assert scaler.had_overflow() is overflow


def expect(
    scaler: GradScaler,
    *,
    scale: float,
    good: int,
    hysteresis: int,
    steps: int,
    skipped: int,
    growths: int,
    backoffs: int,
    enabled: bool = True,
    remote: int = 0,
    last: str = "none",
) -> None:
    """Assert every field of ``stats()`` and ``scale_factor()``.

    ``remote`` and ``last`` are ``remote_skipped_steps`` and ``last_overflow``:
    in a single process there are no remote skips, and the last overflow is
    "local" after an overflowing step, "none" otherwise.
    """
    assert scaler.stats().to_dict() == {
        "scale": scale,
        "consecutive_good_steps": good,
        "hysteresis_tracker": hysteresis,
        "enabled": enabled,
        "steps": steps,
        "skipped_steps": skipped,
        "growths": growths,
        "backoffs": backoffs,
        "remote_skipped_steps": remote,
        "last_overflow": last,
    }
    assert scaler.scale_factor() == (scale if enabled else 1.0)
    assert isinstance(scaler.stats().scale, float)


def test_defaults() -> None:
    scaler = GradScaler()
    expect(scaler, scale=65536.0, good=0, hysteresis=1, steps=0, skipped=0, growths=0, backoffs=0)
    ckpt = scaler.checkpoint()
    assert (ckpt.growth_factor, ckpt.backoff_factor, ckpt.growth_interval) == (2.0, 0.5, 2000)
    assert (ckpt.min_scale, ckpt.max_scale, ckpt.hysteresis) == (1.0, 2.0**24, 1)
    assert scaler.is_enabled() is True
    assert scaler.had_overflow() is False
    assert scaler.nonfinite_gradients() == []


def test_all_parameters_are_keywords() -> None:
    scaler = GradScaler(
        init_scale=8.0,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=1,
        enabled=True,
        min_scale=2.0,
        max_scale=512.0,
        hysteresis=2,
    )
    expect(scaler, scale=8.0, good=0, hysteresis=2, steps=0, skipped=0, growths=0, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=32.0, good=0, hysteresis=2, steps=1, skipped=0, growths=1, backoffs=0)


def test_with_params_sets_the_four_classic_parameters_and_keeps_default_clamps() -> None:
    scaler = GradScaler.with_params(1024.0, 3.0, 0.25, 2)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=0, skipped=0, growths=0, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=1024.0, good=1, hysteresis=1, steps=1, skipped=0, growths=0, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=3072.0, good=0, hysteresis=1, steps=2, skipped=0, growths=1, backoffs=0)
    step(scaler, True)
    expect(scaler, scale=768.0, good=0, hysteresis=0, steps=3, skipped=1, growths=1, backoffs=1, last="local")
    # The default clamps are kept: min_scale 1.0 floors the backoff.
    for _ in range(5):
        step(scaler, True)
    expect(scaler, scale=1.0, good=0, hysteresis=0, steps=8, skipped=6, growths=1, backoffs=6, last="local")


def test_backoff_on_overflow() -> None:
    scaler = GradScaler(init_scale=1024.0, growth_interval=3)
    step(scaler, True)
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=1, skipped=1, growths=0, backoffs=1, last="local")
    # With the hysteresis tracker already at 0, every further overflow backs off again.
    step(scaler, True)
    expect(scaler, scale=256.0, good=0, hysteresis=0, steps=2, skipped=2, growths=0, backoffs=2, last="local")


def test_overflow_resets_growth_tracker() -> None:
    scaler = GradScaler(init_scale=1024.0, growth_interval=3)
    step(scaler, False)
    step(scaler, False)
    expect(scaler, scale=1024.0, good=2, hysteresis=1, steps=2, skipped=0, growths=0, backoffs=0)
    step(scaler, True)
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=3, skipped=1, growths=0, backoffs=1, last="local")
    step(scaler, False)
    step(scaler, False)
    expect(scaler, scale=512.0, good=2, hysteresis=0, steps=5, skipped=1, growths=0, backoffs=1)
    step(scaler, False)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=6, skipped=1, growths=1, backoffs=1)


def test_growth_after_interval() -> None:
    scaler = GradScaler(init_scale=16.0, growth_interval=3)
    step(scaler, False)
    expect(scaler, scale=16.0, good=1, hysteresis=1, steps=1, skipped=0, growths=0, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=16.0, good=2, hysteresis=1, steps=2, skipped=0, growths=0, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=32.0, good=0, hysteresis=1, steps=3, skipped=0, growths=1, backoffs=0)
    step(scaler, False)
    step(scaler, False)
    step(scaler, False)
    expect(scaler, scale=64.0, good=0, hysteresis=1, steps=6, skipped=0, growths=2, backoffs=0)


def test_growth_interval_one_grows_every_clean_step() -> None:
    scaler = GradScaler(init_scale=1.0, growth_interval=1, growth_factor=2.0)
    for n in range(1, 6):
        step(scaler, False)
        expect(scaler, scale=2.0**n, good=0, hysteresis=1, steps=n, skipped=0, growths=n, backoffs=0)


def test_growth_and_backoff_products_are_rounded_to_float32() -> None:
    scaler = GradScaler(init_scale=1.0, growth_factor=1.1, backoff_factor=0.3, growth_interval=1, min_scale=None)
    step(scaler, False)
    grown = float(np.float32(1.1))
    assert grown != 1.1
    expect(scaler, scale=grown, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    step(scaler, True)
    shrunk = float(np.float32(grown * 0.3))
    expect(scaler, scale=shrunk, good=0, hysteresis=0, steps=2, skipped=1, growths=1, backoffs=1, last="local")
    assert float(np.float32(shrunk)) == shrunk


def test_hysteresis_delays_backoff() -> None:
    scaler = GradScaler(init_scale=1024.0, hysteresis=3, growth_interval=100)
    step(scaler, True)
    expect(scaler, scale=1024.0, good=0, hysteresis=2, steps=1, skipped=1, growths=0, backoffs=0, last="local")
    step(scaler, True)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=2, skipped=2, growths=0, backoffs=0, last="local")
    step(scaler, True)
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=3, skipped=3, growths=0, backoffs=1, last="local")
    step(scaler, True)
    expect(scaler, scale=256.0, good=0, hysteresis=0, steps=4, skipped=4, growths=0, backoffs=2, last="local")


def test_hysteresis_not_refilled_by_clean_steps() -> None:
    scaler = GradScaler(init_scale=1024.0, hysteresis=2, growth_interval=10)
    step(scaler, True)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=1, skipped=1, growths=0, backoffs=0, last="local")
    for n in range(1, 6):
        step(scaler, False)
        expect(scaler, scale=1024.0, good=n, hysteresis=1, steps=1 + n, skipped=1, growths=0, backoffs=0)
    step(scaler, True)
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=7, skipped=2, growths=0, backoffs=1, last="local")


def test_hysteresis_refills_only_on_growth() -> None:
    scaler = GradScaler(init_scale=1024.0, hysteresis=2, growth_interval=2)
    step(scaler, True)
    step(scaler, True)
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=2, skipped=2, growths=0, backoffs=1, last="local")
    step(scaler, False)
    expect(scaler, scale=512.0, good=1, hysteresis=0, steps=3, skipped=2, growths=0, backoffs=1)
    step(scaler, False)
    expect(scaler, scale=1024.0, good=0, hysteresis=2, steps=4, skipped=2, growths=1, backoffs=1)
    step(scaler, True)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=5, skipped=3, growths=1, backoffs=1, last="local")


def test_hysteresis_refills_even_when_growth_is_clamped_away() -> None:
    scaler = GradScaler(init_scale=64.0, max_scale=64.0, hysteresis=2, growth_interval=2)
    step(scaler, True)
    expect(scaler, scale=64.0, good=0, hysteresis=1, steps=1, skipped=1, growths=0, backoffs=0, last="local")
    step(scaler, False)
    step(scaler, False)
    # The interval was reached: tracker reset and hysteresis refilled, though the scale stayed.
    expect(scaler, scale=64.0, good=0, hysteresis=2, steps=3, skipped=1, growths=0, backoffs=0)


def test_growth_never_reaches_inf() -> None:
    scaler = GradScaler(init_scale=2.0**126, growth_factor=3.0, growth_interval=1, min_scale=None, max_scale=None)
    step(scaler, False)
    expect(scaler, scale=3.0 * 2.0**126, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    step(scaler, False)  # 9 * 2**126 does not fit float32: the scale stays
    expect(scaler, scale=3.0 * 2.0**126, good=0, hysteresis=1, steps=2, skipped=0, growths=1, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=3.0 * 2.0**126, good=0, hysteresis=1, steps=3, skipped=0, growths=1, backoffs=0)


def test_growth_to_float32_max_is_finite_and_kept() -> None:
    half_max = FLOAT32_MAX / 2.0  # exactly representable: one less in the exponent
    scaler = GradScaler(init_scale=half_max, growth_interval=1, min_scale=None, max_scale=None)
    step(scaler, False)
    expect(scaler, scale=FLOAT32_MAX, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=FLOAT32_MAX, good=0, hysteresis=1, steps=2, skipped=0, growths=1, backoffs=0)


def test_max_scale_clamps_growth() -> None:
    scaler = GradScaler(init_scale=600.0, max_scale=1000.0, growth_interval=1)
    step(scaler, False)
    expect(scaler, scale=1000.0, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=1000.0, good=0, hysteresis=1, steps=2, skipped=0, growths=1, backoffs=0)
    step(scaler, True)
    expect(scaler, scale=500.0, good=0, hysteresis=0, steps=3, skipped=1, growths=1, backoffs=1, last="local")


def test_default_max_scale_is_two_to_the_24() -> None:
    scaler = GradScaler(init_scale=2.0**23, growth_interval=1)
    step(scaler, False)
    expect(scaler, scale=2.0**24, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    step(scaler, False)
    expect(scaler, scale=2.0**24, good=0, hysteresis=1, steps=2, skipped=0, growths=1, backoffs=0)


def test_min_scale_floors_backoff() -> None:
    scaler = GradScaler(init_scale=150.0, min_scale=100.0, growth_interval=5)
    step(scaler, True)
    expect(scaler, scale=100.0, good=0, hysteresis=0, steps=1, skipped=1, growths=0, backoffs=1, last="local")
    step(scaler, True)
    expect(scaler, scale=100.0, good=0, hysteresis=0, steps=2, skipped=2, growths=0, backoffs=1, last="local")
    step(scaler, True)
    expect(scaler, scale=100.0, good=0, hysteresis=0, steps=3, skipped=3, growths=0, backoffs=1, last="local")


def test_default_min_scale_is_one() -> None:
    scaler = GradScaler(init_scale=2.0)
    step(scaler, True)
    expect(scaler, scale=1.0, good=0, hysteresis=0, steps=1, skipped=1, growths=0, backoffs=1, last="local")
    step(scaler, True)
    expect(scaler, scale=1.0, good=0, hysteresis=0, steps=2, skipped=2, growths=0, backoffs=1, last="local")


def test_min_equal_max_pins_the_scale() -> None:
    scaler = GradScaler(init_scale=8.0, min_scale=8.0, max_scale=8.0, growth_interval=1)
    step(scaler, False)
    step(scaler, True)
    step(scaler, False)
    expect(scaler, scale=8.0, good=0, hysteresis=1, steps=3, skipped=1, growths=0, backoffs=0)


def test_scale_without_floor_stops_at_the_smallest_scale_with_a_finite_inverse() -> None:
    # PyTorch's scale keeps halving to 0 and its inverse becomes inf; this one stops at SMALLEST_SCALE.
    scaler = GradScaler(init_scale=4 * SMALLEST_SCALE, min_scale=None, growth_interval=2)
    step(scaler, True)
    expect(
        scaler, scale=2 * SMALLEST_SCALE, good=0, hysteresis=0, steps=1, skipped=1, growths=0, backoffs=1, last="local"
    )
    step(scaler, True)
    expect(scaler, scale=SMALLEST_SCALE, good=0, hysteresis=0, steps=2, skipped=2, growths=0, backoffs=2, last="local")
    step(scaler, True)  # already at the bottom: no backoff counted
    expect(scaler, scale=SMALLEST_SCALE, good=0, hysteresis=0, steps=3, skipped=3, growths=0, backoffs=2, last="local")
    grad = np.array([1.0, 3.0e38, -(2.0**-100)], dtype=np.float32)
    with np.errstate(over="ignore"):
        expected = grad * np.float32(1.0 / SMALLEST_SCALE)
    open_step(scaler)
    assert scaler.unscale_and_check([grad]) is True  # finite gradients come back as the float32 products
    assert grad.tobytes() == expected.tobytes()
    scaler.update()
    step(scaler, False)
    expect(scaler, scale=2 * SMALLEST_SCALE, good=0, hysteresis=1, steps=5, skipped=3, growths=1, backoffs=2)


def test_counters_only_count_real_changes() -> None:
    scaler = GradScaler(
        init_scale=1.0,
        growth_factor=1.0 + 2.0**-30,
        backoff_factor=1.0 - 2.0**-30,
        growth_interval=1,
        min_scale=None,
    )
    step(scaler, False)  # float32(1 + 2**-30) == 1: the scale did not change
    expect(scaler, scale=1.0, good=0, hysteresis=1, steps=1, skipped=0, growths=0, backoffs=0)
    step(scaler, True)  # float32(1 - 2**-30) == 1
    expect(scaler, scale=1.0, good=0, hysteresis=0, steps=2, skipped=1, growths=0, backoffs=0, last="local")


def test_hysteresis_tracker_never_goes_below_zero() -> None:
    scaler = GradScaler(init_scale=2.0**20, hysteresis=2)
    for n in range(1, 6):
        step(scaler, True)
        expected_scale = 2.0**20 if n == 1 else 2.0 ** (20 - (n - 1))
        expect(
            scaler,
            scale=expected_scale,
            good=0,
            hysteresis=max(2 - n, 0),
            steps=n,
            skipped=n,
            growths=0,
            backoffs=max(n - 1, 0),
            last="local",
        )


def test_disabled_update_is_a_no_op() -> None:
    scaler = GradScaler(init_scale=1024.0, growth_interval=1, enabled=False)
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=0, skipped=0, growths=0, backoffs=0, enabled=False)
    assert scaler.unscale_and_check([np.array([np.inf], dtype=np.float32)]) is True
    scaler.update()
    scaler.update()
    expect(scaler, scale=1024.0, good=0, hysteresis=1, steps=0, skipped=0, growths=0, backoffs=0, enabled=False)
    scaler.set_enabled(True)
    step(scaler, False)
    expect(scaler, scale=2048.0, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0)
    scaler.set_enabled(False)
    expect(scaler, scale=2048.0, good=0, hysteresis=1, steps=1, skipped=0, growths=1, backoffs=0, enabled=False)


def test_several_checks_in_one_step_count_one_step() -> None:
    scaler = GradScaler(init_scale=1024.0, growth_interval=2)
    open_step(scaler)
    assert scaler.unscale_and_check([np.ones(2, np.float32)]) is True
    assert scaler.unscale_and_check([np.array([np.nan], np.float32)]) is False
    assert scaler.unscale_and_check([np.ones(2, np.float32)]) is False  # the step's verdict so far
    scaler.update()
    assert scaler.had_overflow() is True
    expect(scaler, scale=512.0, good=0, hysteresis=0, steps=1, skipped=1, growths=0, backoffs=1, last="local")


def test_scripted_trajectory() -> None:
    scaler = GradScaler(
        init_scale=256.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2,
        min_scale=64.0,
        max_scale=1024.0,
        hysteresis=2,
    )
    # (overflow, scale, good, hysteresis, steps, skipped, growths, backoffs)
    table = [
        (False, 256.0, 1, 2, 1, 0, 0, 0),
        (False, 512.0, 0, 2, 2, 0, 1, 0),
        (False, 512.0, 1, 2, 3, 0, 1, 0),
        (False, 1024.0, 0, 2, 4, 0, 2, 0),
        (False, 1024.0, 1, 2, 5, 0, 2, 0),
        (False, 1024.0, 0, 2, 6, 0, 2, 0),
        (True, 1024.0, 0, 1, 7, 1, 2, 0),
        (False, 1024.0, 1, 1, 8, 1, 2, 0),
        (True, 512.0, 0, 0, 9, 2, 2, 1),
        (True, 256.0, 0, 0, 10, 3, 2, 2),
        (True, 128.0, 0, 0, 11, 4, 2, 3),
        (True, 64.0, 0, 0, 12, 5, 2, 4),
        (True, 64.0, 0, 0, 13, 6, 2, 4),
        (False, 64.0, 1, 0, 14, 6, 2, 4),
        (False, 128.0, 0, 2, 15, 6, 3, 4),
        (True, 128.0, 0, 1, 16, 7, 3, 4),
    ]
    for overflow, scale, good, hysteresis, steps, skipped, growths, backoffs in table:
        step(scaler, overflow)
        expect(
            scaler,
            scale=scale,
            good=good,
            hysteresis=hysteresis,
            steps=steps,
            skipped=skipped,
            growths=growths,
            backoffs=backoffs,
            last="local" if overflow else "none",
        )


@pytest.mark.parametrize("hysteresis", [1, 2, 5])
def test_long_clean_run_counts_growths(hysteresis: int) -> None:
    scaler = GradScaler(init_scale=1.0, growth_interval=3, hysteresis=hysteresis, max_scale=None)
    for n in range(1, 31):
        step(scaler, False)
        grown = n // 3
        expect(
            scaler,
            scale=2.0**grown,
            good=n % 3,
            hysteresis=hysteresis,
            steps=n,
            skipped=0,
            growths=grown,
            backoffs=0,
        )


class ScriptedRanks:
    """A stand-in for the other ranks' votes: each vote, they report the next scripted overflow flag."""

    def __init__(self, others: list[bool]) -> None:
        self.others = list(others)

    def reduce_sum(self, values: np.ndarray, stream: object) -> None:
        assert stream is None, "NumPy gradients are summed on the host"
        values[0] += float(self.others.pop(0))  # one other rank, its scripted overflow flag


def test_overflow_on_another_rank_only_counts_a_remote_skip() -> None:
    # (this rank's gradients overflow, another rank's do) for each step.
    steps = [(False, False), (False, True), (True, False), (True, True), (False, False), (False, False)]
    ranks = ScriptedRanks([others for _, others in steps])
    scaler = GradScaler(init_scale=1024.0, growth_interval=2, hysteresis=1, comm=ranks)

    def remote_step(local: bool, others: bool) -> None:
        grad = np.array([np.inf if local else 1.0], np.float32)
        open_step(scaler)
        assert scaler.unscale_and_check([grad]) is not (local or others)
        scaler.update()
        assert scaler.had_overflow() is (local or others)
        assert scaler.nonfinite_gradients() == ([0] if local else [])

    remote_step(*steps[0])
    expect(scaler, scale=1024.0, good=1, hysteresis=1, steps=1, skipped=0, growths=0, backoffs=0)
    remote_step(*steps[1])
    expect(
        scaler, scale=512.0, good=0, hysteresis=0, steps=2, skipped=1, growths=0, backoffs=1, remote=1, last="remote"
    )
    checkpoint = scaler.checkpoint()
    assert (checkpoint.found_overflow, checkpoint.found_overflow_local, checkpoint.remote_skipped_steps) == (
        True,
        False,
        1,
    )
    remote_step(*steps[2])
    expect(scaler, scale=256.0, good=0, hysteresis=0, steps=3, skipped=2, growths=0, backoffs=2, remote=1, last="local")
    remote_step(*steps[3])
    expect(scaler, scale=128.0, good=0, hysteresis=0, steps=4, skipped=3, growths=0, backoffs=3, remote=1, last="local")
    remote_step(*steps[4])
    remote_step(*steps[5])
    expect(scaler, scale=256.0, good=0, hysteresis=1, steps=6, skipped=3, growths=1, backoffs=3, remote=1)
    assert ranks.others == []

    # The remote state survives a version-2 checkpoint file, into a scaler without a communicator.
    resumed = GradScaler()
    resumed.load_checkpoint(GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()))
    expect(
        resumed, scale=512.0, good=0, hysteresis=0, steps=2, skipped=1, growths=0, backoffs=1, remote=1, last="remote"
    )
    assert resumed.checkpoint() == checkpoint


def test_the_host_mirror_never_disagrees_with_the_state_the_arrays_use() -> None:
    # GradScaler answers stats() and checkpoint() from its host mirror; scale_loss and unscale_and_check use
    # the state where the arrays are (here the host's). After every update() the two are one state.
    rng = np.random.default_rng(3)
    scaler = GradScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=None, max_scale=2.0**14)
    for _ in range(60):
        grads = [np.ones(8, np.float32), np.ones(4, np.float16)]
        if rng.random() < 0.3:
            grads[int(rng.integers(2))][0] = np.inf
        scaler.scale_loss(np.ones((), np.float32))
        if rng.random() < 0.5:
            scaler.unscale_and_check(grads)
        else:
            scaler.check(grads, max_norm=1.0)
        scaler.update()
        state, overflow, local, _, _, _ = scaler._scaling.default.snapshot()
        stats = scaler.stats()
        assert (state.scale, state.consecutive_good_steps, state.hysteresis_tracker, state.steps) == (
            stats.scale, stats.consecutive_good_steps, stats.hysteresis_tracker, stats.steps,
        )  # fmt: skip
        assert (state.skipped_steps, state.growths, state.backoffs) == (
            stats.skipped_steps,
            stats.growths,
            stats.backoffs,
        )
        assert (overflow, local) == (scaler.had_overflow(), stats.last_overflow == "local")
    assert scaler.stats().skipped_steps > 0 and scaler.stats().growths > 0
