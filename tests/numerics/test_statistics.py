"""check(): the read-only statistics pass on the NumPy path, its call-order rules and its guard scalers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld, run_ranks
from helpers import assert_same_bits, open_step

from cupy_amp import GradScaler, SyncFreeGradScaler, dtypes
from cupy_amp.dtypes import bfloat16
from cupy_amp.errors import (
    ArgumentTypeError,
    CommunicatorError,
    ConfigError,
    GradientTypeError,
    RanksMayDisagreeError,
    ScalerProtocolError,
)

SCALERS = [GradScaler, SyncFreeGradScaler]
BF16 = bfloat16()
DTYPES: list[Any] = [np.float16, np.float32, np.float64] + ([BF16] if BF16 is not None else [])


def gradients(seed: int, dtype: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 100).astype(dtype) for shape in [(1,), (17,), (300, 7), (4097,)]]


def float64_norm(grads: list[np.ndarray], inv_scale: float) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, dtype=np.float64))) for g in grads)) * inv_scale)


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_is_the_unscaled_gradients_norm_within_one_float32_ulp(scaler_class: type, dtype: Any) -> None:
    grads = gradients(1, dtype)
    before = [g.copy() for g in grads]
    scaler = scaler_class(init_scale=512.0)
    open_step(scaler)
    stats = scaler.check(grads)
    expected = float64_norm(grads, 1 / 512)
    assert abs(float(stats.norm) - expected) <= float(np.spacing(np.float32(expected)))
    assert float(stats.clip_coefficient) == 1.0 and bool(stats.finite)
    for g, b in zip(grads, before):
        assert_same_bits(g, b)  # only read


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_the_clip_coefficient_is_max_norm_over_the_norm_plus_eps_at_most_one(
    scaler_class: type, max_norm: float
) -> None:
    grads = gradients(2, np.float32)
    scaler = scaler_class(init_scale=4.0)
    open_step(scaler)
    stats = scaler.check(grads, max_norm=max_norm)
    norm = float(stats.norm)
    assert float(stats.clip_coefficient) == np.float32(min(1.0, max_norm / (norm + 1e-6)))
    assert float(stats.record.source["factor"]) == np.float32(0.25) * np.float32(stats.clip_coefficient)


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_check_reports_every_nonfinite_gradient_and_the_step_is_skipped(scaler_class: type) -> None:
    grads = gradients(3, np.float16)
    grads[1][3] = np.inf
    grads[3][0] = np.nan
    scaler = scaler_class()
    open_step(scaler)
    stats = scaler.check({"a": grads[0], "b": grads[1], "c": grads[2], "d": grads[3]})
    assert not bool(stats.finite) and scaler.had_overflow()
    assert sorted(scaler.nonfinite_gradients()) == ["b", "d"]
    assert stats.record.source["skip"] == 1
    scaler.update()
    assert scaler.stats().skipped_steps == 1 and scaler.stats().backoffs == 1


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_check_is_the_steps_only_gradient_call(scaler_class: type) -> None:
    grads = gradients(4, np.float32)
    scaler = scaler_class()
    open_step(scaler)
    scaler.check(grads[:2])
    with pytest.raises(ScalerProtocolError, match="only gradient call"):
        scaler.check(grads[2:])
    with pytest.raises(ScalerProtocolError, match="after check"):
        scaler.unscale_and_check(grads[2:])
    scaler.update()
    open_step(scaler)
    scaler.unscale_and_check(grads[:2])
    with pytest.raises(ScalerProtocolError, match="only gradient call"):
        scaler.check(grads[2:])
    scaler.update()
    open_step(scaler)
    scaler.check(grads)  # a new step
    scaler.update()
    assert scaler.stats().steps == 3


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("max_norm", [0, -1.0, float("nan"), float("inf"), 1e39, 10**400, "1", True, 1e-45])
def test_an_invalid_max_norm_is_refused_before_anything_happens(scaler_class: type, max_norm: Any) -> None:
    scaler = scaler_class()
    open_step(scaler)
    with pytest.raises(ConfigError, match="'max_norm'"):
        scaler.check(gradients(5, np.float32), max_norm=max_norm)
    scaler.unscale_and_check(gradients(5, np.float32))  # the step was not opened


class MaxOnlyVote:
    """A transport that can only take a maximum (no reduce_sum)."""

    def reduce_max(self, flags: Any, stream: Any) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_communicator_that_cannot_sum_is_refused_when_the_scaler_is_built(scaler_class: type) -> None:
    with pytest.raises(ArgumentTypeError, match=r"a reduce_sum\(values, stream\) method, got MaxOnlyVote"):
        scaler_class(comm=MaxOnlyVote())


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_ranks_with_sharded_gradients_get_the_global_norm_and_one_verdict(scaler_class: type) -> None:
    shards = [gradients(10, np.float32), gradients(11, np.float32)]
    world = FakeWorld(2)

    def rank_body(world: FakeWorld, rank: int) -> list[tuple[float, bool, bool]]:
        scaler = scaler_class(init_scale=64.0, comm=FakeVote(world, rank))
        seen = []
        for step in range(3):
            grads = [g.copy() for g in shards[rank]]
            if step == 1 and rank == 1:
                grads[2][0, 0] = np.inf
            scale = scaler.scale_factor()
            open_step(scaler)
            stats = scaler.check(grads, max_norm=1.0)
            seen.append((float(stats.norm) * scale, bool(stats.finite), scaler.had_overflow()))
            scaler.update()
        assert scaler.stats().skipped_steps == 1
        assert scaler.stats().remote_skipped_steps == (1 if rank == 0 else 0)
        return seen

    results = run_ranks(world, rank_body)
    expected = float64_norm(shards[0] + shards[1], 1.0)  # the scales are powers of two: exact factors
    for step in (0, 2):
        for rank in (0, 1):
            norm = results[rank][step][0]
            assert abs(norm - expected) <= float(np.spacing(np.float32(expected)))
            assert results[rank][step][1:] == (True, False)
    assert [results[rank][1][1:] for rank in (0, 1)] == [(False, True), (False, True)]
    assert [len(world.sums[rank]) for rank in (0, 1)] == [3, 3]  # one all-reduce per check, per rank


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_rank_without_gradients_sends_its_own_zero_sums_every_step(scaler_class: type) -> None:
    # A check() with no gradients must still put this step's own pair (no overflow, sum 0) into the
    # all-reduce, not what the previous step's all-reduce left: that pair held the other ranks' sums (the norm
    # grew step after step) and their overflow count (one overflow made every later step skip).
    grads = gradients(13, np.float32)
    world = FakeWorld(2)

    def rank_body(world: FakeWorld, rank: int) -> list[tuple[float, bool]]:
        scaler = scaler_class(init_scale=1.0, comm=FakeVote(world, rank))
        seen = []
        for step in range(4):
            shard = [g.copy() for g in grads] if rank == 0 else []
            if step == 1 and rank == 0:
                shard[0][0] = np.inf
            open_step(scaler)
            stats = scaler.check(shard)
            seen.append((float(stats.norm), bool(stats.finite)))
            scaler.update()
        return seen

    results = run_ranks(world, rank_body)
    expected = float64_norm(grads, 1.0)
    for rank in (0, 1):
        assert [finite for _, finite in results[rank]] == [True, False, True, True], rank
        for step in (0, 2, 3):
            assert abs(results[rank][step][0] - expected) <= float(np.spacing(np.float32(expected))), (rank, step)
    assert [pair.tolist() for pair in world.sums[1]] == [[0.0, 0.0]] * 4


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_rank_whose_check_fails_still_joins_the_all_reduce_as_overflowed(scaler_class: type) -> None:
    world = FakeWorld(2)

    def rank_body(world: FakeWorld, rank: int) -> tuple[bool, int]:
        scaler = scaler_class(comm=FakeVote(world, rank))
        grads: list[Any] = gradients(12, np.float32)
        open_step(scaler)
        if rank == 1:
            grads[1] = "not an array"
            with pytest.raises(GradientTypeError):
                scaler.check(grads)
        else:
            stats = scaler.check(grads)
            assert not bool(stats.finite)
        overflow = scaler.had_overflow()
        scaler.update()
        return overflow, scaler.stats().skipped_steps

    assert run_ranks(world, rank_body) == [(True, 1), (True, 1)]
    assert world.sums[1][0].tolist() == [1.0, 0.0]


class LyingVote(FakeVote):
    """A one-rank vote whose sum answers a count of overflowed ranks that cannot be."""

    def __init__(self, count: float) -> None:
        super().__init__(FakeWorld(1), 0)
        self.count = count

    def reduce_sum(self, values: Any, stream: Any) -> None:
        values[0] = self.count


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("count", [0.5, -1.0, float("nan"), float("inf")])
def test_an_impossible_overflow_count_is_an_error_and_the_step_is_skipped(scaler_class: type, count: float) -> None:
    scaler = scaler_class(comm=LyingVote(count))
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="no such count"):
        scaler.check(gradients(13, np.float32))
    assert scaler.had_overflow()
    scaler.update()
    assert scaler.stats().skipped_steps == 1


class SumLyingVote(FakeVote):
    """A one-rank vote whose sum answers a sum of squares of its choosing, and "no rank overflowed" (or, with
    ``keep_count``, this rank's own count)."""

    def __init__(self, total: float, keep_count: bool = False) -> None:
        super().__init__(FakeWorld(1), 0)
        self.total, self.keep_count = total, keep_count

    def reduce_sum(self, values: Any, stream: Any) -> None:
        values[...] = [values[0] if self.keep_count else 0.0, self.total]


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("total", [float("nan"), 0.0, float("inf"), -1.0], ids=["nan", "below-own", "inf", "negative"])
def test_an_impossible_sum_of_squares_is_an_error_and_the_step_is_skipped(scaler_class: type, total: float) -> None:
    from cupy_amp.optim import SGD

    scaler = scaler_class(comm=SumLyingVote(total))
    grads = gradients(13, np.float32)
    weights = [np.zeros_like(g) for g in grads]
    optimizer = SGD(weights, lr=1.0)
    scaler.scale_loss(np.ones((), np.float32))
    with pytest.raises(CommunicatorError, match="sum of squares"):
        scaler.check(grads, max_norm=1.0)
    stats = state_record(scaler)
    assert int(stats["skip"]) == 1  # what an optimizer (or a captured graph) reads: nothing is applied
    assert scaler.had_overflow()
    scaler.update()
    assert scaler.stats().skipped_steps == 1 and not any(w.any() for w in weights) and optimizer.step_count == 0


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("total", [-1.0, float("-inf")])
def test_a_negative_sum_of_squares_after_an_overflow_skips_as_the_kernel_does(scaler_class: type, total: float) -> None:
    """The step overflowed, so the sum is not checked (the finishing kernel does not either): no error, a NaN norm.

    The host's finish took math.sqrt of it and raised a bare ValueError ("math domain error") out of check().
    """
    scaler = scaler_class(comm=SumLyingVote(total, keep_count=True))
    open_step(scaler)
    grads = gradients(13, np.float32)
    grads[2][5] = np.inf
    stats = scaler.check(grads, max_norm=1.0)
    assert not bool(stats.finite) and np.isnan(float(stats.norm)) and float(stats.clip_coefficient) == 1.0
    assert int(state_record(scaler)["skip"]) == 1
    scaler.update()
    assert scaler.stats().skipped_steps == 1


def state_record(scaler: Any) -> Any:
    """The host statistics record the scaler's check() writes."""
    state = scaler._state if isinstance(scaler, SyncFreeGradScaler) else scaler._scaling.default
    return state.stats.memory


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_guard_scaler_keeps_scale_one_and_still_skips(scaler_class: type) -> None:
    scaler = scaler_class.guard()
    grads = gradients(7, np.float32)
    for step in range(5):
        grads[0][0] = np.inf if step == 2 else 1.0
        stats = scaler.check(grads)
        assert abs(float(stats.norm) - float64_norm(grads, 1.0)) <= float(np.spacing(stats.norm)) or step == 2
        scaler.update()
        assert scaler.scale_factor() == 1.0
    counters = scaler.stats()
    assert (counters.skipped_steps, counters.growths, counters.backoffs) == (1, 0, 0)


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes for bfloat16")
@pytest.mark.parametrize("scaler_class", SCALERS)
def test_bfloat16_is_checked_but_never_scaled_or_unscaled(scaler_class: type) -> None:
    scaler = scaler_class.guard()
    grads = gradients(8, BF16)
    with pytest.raises(GradientTypeError, match="bfloat16 needs no loss scaling"):
        scaler.scale_loss(np.ones((), BF16))
    with pytest.raises(GradientTypeError, match="use check"):
        scaler.unscale_and_check(grads)
    grads[2][5, 1] = np.inf
    stats = scaler.check(grads)
    assert not bool(stats.finite) and scaler.nonfinite_gradients() == [2]


def test_a_disabled_scaler_takes_unscale_and_check_in_the_step_after_a_check() -> None:
    scaler = GradScaler(enabled=False)
    grads = gradients(16, np.float32)
    scaler.check(grads)
    scaler.update()
    assert scaler.unscale_and_check(grads)
    scaler.update()


def test_a_disabled_scaler_checks_without_scaling_and_records_nothing() -> None:
    scaler = GradScaler(init_scale=8.0, enabled=False)
    grads = gradients(9, np.float32)
    grads[0][0] = np.inf
    stats = scaler.check(grads, max_norm=1.0)
    assert not bool(stats.finite) and stats.record.source["skip"] == 1
    assert not scaler.had_overflow()
    scaler.update()
    assert scaler.stats().steps == 0


def test_without_ml_dtypes_float64_is_not_taken_for_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy reads a comparison with None as one with float64: a missing bfloat16 must not match it."""
    monkeypatch.setattr(dtypes, "bfloat16", lambda: None)
    assert not dtypes.is_bfloat16(np.dtype(np.float64)) and dtypes.dtype_name(np.dtype(np.float64)) == "float64"
    loss = np.ones((), np.float64)
    GradScaler(init_scale=4.0).scale_loss(loss)
    assert loss == 4.0


@pytest.mark.parametrize("failure", [RuntimeError, SystemError, ImportError])
def test_an_ml_dtypes_that_fails_to_import_means_no_bfloat16(monkeypatch: pytest.MonkeyPatch, failure: type) -> None:
    """An ml_dtypes built for NumPy 2 under NumPy 1.x raises RuntimeError/SystemError on import (a Chainer
    environment): cupy-amp must go on working without bfloat16, as when ml_dtypes is missing."""
    import builtins

    real_import = builtins.__import__

    def import_(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "ml_dtypes":
            raise failure("module compiled against NumPy C-API version 0x12")
        return real_import(name, *args, **kwargs)

    dtypes.bfloat16.cache_clear()
    monkeypatch.setattr(builtins, "__import__", import_)
    try:
        assert dtypes.bfloat16() is None
        loss = np.ones((), np.float32)
        scaler = GradScaler(init_scale=4.0)
        scaler.scale_loss(loss)
        assert scaler.unscale_and_check([np.full(3, 8.0, np.float16)]) is True
    finally:
        monkeypatch.undo()
        dtypes.bfloat16.cache_clear()


class BrokenSumVote(FakeVote):
    """A one-rank vote whose all-reduce raises (a peer reset)."""

    def __init__(self) -> None:
        super().__init__(FakeWorld(1), 0)
        self.broken = False

    def reduce_sum(self, values: Any, stream: Any) -> None:
        if self.broken:
            raise RuntimeError("peer reset")
        super().reduce_sum(values, stream)


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_after_a_failed_check_the_optimizer_does_not_apply_the_step(scaler_class: type) -> None:
    from cupy_amp.optim import SGD

    vote = BrokenSumVote()
    scaler = scaler_class(comm=vote)
    weights = [np.zeros(4, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    grads = [np.ones(4, np.float32)]
    open_step(scaler)
    stats = scaler.check(grads)
    optimizer.step(grads, stats)
    scaler.update()
    vote.broken = True
    open_step(scaler)
    with pytest.raises(CommunicatorError, match="peer reset"):
        scaler.check(grads)  # the same record as `stats`: it must now say skip
    with pytest.raises(ScalerProtocolError, match="already closed"):
        optimizer.step(grads, stats)  # the statistics of the step before
    assert int(stats.record.source["skip"]) == 1  # what a captured graph's optimizer would read
    assert optimizer.step_count == 1 and weights[0].tolist() == [-1.0 / 65536] * 4
    # A communicator that failed inside a collective is unusable (NCCL's rule): the scaler refuses from now on.
    with pytest.raises(RanksMayDisagreeError, match="interrupted inside its all-reduce"):
        scaler.had_overflow()


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_rank_failing_after_the_step_opened_still_joins_and_counts_the_overflow(
    scaler_class: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = FakeWorld(2)

    def rank_body(world: FakeWorld, rank: int) -> tuple[bool, int]:
        scaler = scaler_class(comm=FakeVote(world, rank))
        open_step(scaler)
        if rank == 0:  # something fails between opening the step and the all-reduce
            target = scaler._state if scaler_class is SyncFreeGradScaler else scaler._scaling.default
            name = "begin_step"

            def fail(*args: Any) -> None:
                raise MemoryError("out of memory")

            setattr(target, name, fail)
            with pytest.raises(MemoryError):
                scaler.check(gradients(14, np.float32))
        else:
            scaler.check(gradients(14, np.float32))
        overflow = scaler.had_overflow()
        scaler.update()
        return overflow, scaler.stats().skipped_steps

    assert run_ranks(world, rank_body) == [(True, 1), (True, 1)]


def test_a_disabled_scaler_with_a_communicator_still_gives_every_rank_the_global_norm() -> None:
    world = FakeWorld(2)
    shards = [[np.full(9, 1.0, np.float32)], [np.full(16, 1.0, np.float32)]]

    def rank_body(world: FakeWorld, rank: int) -> tuple[float, bool]:
        scaler = GradScaler(enabled=False, comm=FakeVote(world, rank))
        grads = [g.copy() for g in shards[rank]]
        stats = scaler.check(grads, max_norm=1.0)
        scaler.update()
        return float(stats.norm), bool(stats.finite)

    assert run_ranks(world, rank_body) == [(5.0, True), (5.0, True)]


def test_the_clip_threshold_is_rounded_to_float32_as_the_gpu_receives_it() -> None:
    from cupy_amp.statistics import expect_max_norm

    assert expect_max_norm(0.1) == float(np.float32(0.1)) != 0.1
    grads = [np.full(10, 1.0, np.float32)]
    scaler = GradScaler(init_scale=1.0)
    open_step(scaler)
    stats = scaler.check(grads, max_norm=0.1)
    expected = np.float32(float(np.float32(0.1)) / (float(np.float32(np.sqrt(10.0))) + 1e-6))
    assert np.float32(stats.clip_coefficient) == expected


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes for bfloat16")
def test_prepare_takes_bfloat16_gradients_for_check() -> None:
    scaler = SyncFreeGradScaler.guard()
    prepared = scaler.prepare(gradients(15, BF16))
    assert bool(scaler.check(prepared).finite)


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_a_check_rejected_with_a_communicator_marks_the_previous_record_skipped(scaler_class: type) -> None:
    from cupy_amp.optim import SGD

    scaler = scaler_class(comm=FakeVote(FakeWorld(1), 0))
    weights, grads = [np.zeros(4, np.float32)], [np.ones(4, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    open_step(scaler)
    stats = scaler.check(grads)
    optimizer.step(grads, stats)
    scaler.update()
    open_step(scaler)
    with pytest.raises(GradientTypeError):
        scaler.check(["not an array"])
    with pytest.raises(ScalerProtocolError, match="already closed"):
        optimizer.step(grads, stats)  # the statistics of the step before
    assert int(stats.record.source["skip"]) == 1  # and their record says skip (what a captured graph reads)
    assert optimizer.step_count == 1 and scaler.had_overflow()


def test_a_failure_while_marking_the_record_still_joins_the_all_reduce() -> None:
    world = FakeWorld(2)

    class Unwritable:
        def __setitem__(self, key: Any, value: Any) -> None:
            raise RuntimeError("device lost")

    def rank_body(world: FakeWorld, rank: int) -> str:
        scaler = GradScaler(comm=FakeVote(world, rank))
        open_step(scaler)
        scaler.check(gradients(17, np.float32))
        scaler.update()
        if rank == 0:
            scaler._scaling.default.stats.skip = Unwritable()
            open_step(scaler)
            with pytest.raises(RuntimeError, match="device lost"):
                scaler.check(["not an array"])
            return "failed, joined"
        open_step(scaler)
        stats = scaler.check(gradients(17, np.float32))
        return "finite" if bool(stats.finite) else "skipped"

    assert run_ranks(world, rank_body) == ["failed, joined", "skipped"]
    assert [len(sums) for sums in world.sums] == [2, 2]


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_statistics_belong_to_one_step_and_apply_once(scaler_class: type) -> None:
    from cupy_amp.optim import SGD

    scaler = scaler_class(init_scale=4.0)
    weights, grads = [np.zeros(4, np.float32)], [np.full(4, 4.0, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    with pytest.raises(TypeError):
        optimizer.step(grads)  # type: ignore[call-arg]  # the statistics are required
    scaler.scale_loss(np.ones((), np.float32))
    stats = scaler.check(grads)
    optimizer.step(grads, stats)
    with pytest.raises(ScalerProtocolError, match="already applied"):
        optimizer.step(grads, stats)
    assert weights[0].tolist() == [-1.0] * 4 and optimizer.step_count == 1
    other = SGD([np.zeros(4, np.float32)], lr=1.0)
    other.step(grads, stats)  # another optimizer (other parameters) applies the same check once too
    scaler.update()
    with pytest.raises(ScalerProtocolError, match="already closed"):
        other.step(grads, stats)
    optimizer.step(grads, None)  # None, passed explicitly: gradients no scaler touched
    assert weights[0].tolist() == [-5.0] * 4 and optimizer.step_count == 2


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_scaler_step_checks_and_applies_the_fused_update_in_one_call(scaler_class: type) -> None:
    from cupy_amp.optim import SGD

    def grads(bad: bool) -> list[np.ndarray]:
        return [np.full(2, np.inf if bad else 12.0, np.float32), np.full(3, 16.0, np.float32)]

    scaler, twin = scaler_class(init_scale=4.0), scaler_class(init_scale=4.0)
    optimizer = SGD([np.zeros(2, np.float32), np.zeros(3, np.float32)], lr=1.0, momentum=0.9)
    reference = SGD([np.zeros(2, np.float32), np.zeros(3, np.float32)], lr=1.0, momentum=0.9)
    for bad in (False, True, False):
        for one in (scaler, twin):
            one.scale_loss(np.ones((), np.float32))
        stats = scaler.step(optimizer, grads(bad), max_norm=1.0)
        expected = twin.check(grads(bad), max_norm=1.0)  # the two-call form it stands for
        reference.step(grads(bad), expected)
        assert_same_bits(np.float32(stats.norm), np.float32(expected.norm))
        assert bool(stats.finite) is not bad
        for ours, theirs in zip(optimizer.params, reference.params):
            assert_same_bits(ours, theirs)
        scaler.update()
        twin.update()
    assert optimizer.step_count == 2 and scaler.stats().skipped_steps == 1  # the overflow applied nothing
    assert float(np.abs(optimizer.params[0]).max()) > 0


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_statistics_apply_once_whatever_the_optimizer_applied_in_between(scaler_class: type) -> None:
    """A, then other statistics (or none), then A again: still refused. The optimizer remembers every
    open step it applied, not only the last one."""
    from cupy_amp.optim import SGD

    first, second = scaler_class(init_scale=1024.0), scaler_class(init_scale=2.0)
    weights, grads = [np.zeros(2, np.float32)], [np.full(2, 1024.0, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    for scaler in (first, second):
        scaler.scale_loss(np.ones((), np.float32))
    stats, others = first.check(grads), second.check([np.full(2, 2.0, np.float32)])
    optimizer.step(grads, stats)  # -1
    optimizer.step([np.zeros(2, np.float32)], None)
    with pytest.raises(ScalerProtocolError, match="already applied"):
        optimizer.step(grads, stats)
    optimizer.step([np.full(2, 2.0, np.float32)], others)  # -1: another scaler's check, once
    with pytest.raises(ScalerProtocolError, match="already applied"):
        optimizer.step(grads, stats)
    with pytest.raises(ScalerProtocolError, match="already applied"):
        optimizer.step([np.full(2, 2.0, np.float32)], others)
    assert weights[0].tolist() == [-2.0, -2.0] and optimizer.step_count == 3
    first.update()
    first.scale_loss(np.ones((), np.float32))
    optimizer.step(grads, first.check(grads))  # the next step's check applies (the scale grew not: -1)
    assert weights[0].tolist() == [-3.0, -3.0]


@pytest.mark.parametrize("scaler_class", SCALERS)
@pytest.mark.parametrize("gradients", ["generator", "mapping"])
def test_scaler_step_gives_the_optimizer_the_arrays_it_checked(gradients: str, scaler_class: type) -> None:
    """A generator is read once for both; a mapping's arrays (not its keys) go to the optimizer."""
    from cupy_amp.optim import SGD

    scaler, weights = scaler_class(init_scale=4.0), [np.zeros(2, np.float32), np.zeros(3, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    arrays = [np.full(2, 4.0, np.float32), np.full(3, 8.0, np.float32)]
    scaler.scale_loss(np.ones((), np.float32))
    given = (g for g in arrays) if gradients == "generator" else {"w": arrays[0], "b": arrays[1]}
    stats = scaler.step(optimizer, given)
    assert bool(stats.finite) and optimizer.step_count == 1
    assert weights[0].tolist() == [-1.0] * 2 and weights[1].tolist() == [-2.0] * 3


@pytest.mark.parametrize("scaler_class", SCALERS)
def test_an_optimizer_never_reads_the_record_of_a_later_step(scaler_class: type) -> None:
    """The optimizer tests that its statistics are current and reads them under the scaler's lock, so an
    update() and the next check() on another thread wait: they cannot slip in between."""
    import sys
    import threading

    from cupy_amp.optim import SGD, base

    scaler, weights = scaler_class(init_scale=1024.0), [np.zeros(2, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    grads = [np.full(2, 1024.0, np.float32)]
    scaler.scale_loss(np.ones((), np.float32))
    stats = scaler.check(grads)  # finite: this step applies lr * 1
    reading, resume = threading.Event(), threading.Event()

    def pause_before_the_read(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code is base.FusedOptimizer._host_step.__code__:
            reading.set()
            resume.wait(5)  # the other thread's update() waits for the scaler's lock meanwhile
        return None

    def apply() -> None:
        sys.settrace(pause_before_the_read)
        try:
            optimizer.step(grads, stats)
        finally:
            sys.settrace(None)

    applying = threading.Thread(target=apply)
    applying.start()
    assert reading.wait(10)

    def next_step() -> None:
        scaler.update()
        scaler.scale_loss(np.ones((), np.float32))
        scaler.check([np.array([np.inf, 0.0], np.float32)])  # the next step overflows

    later = threading.Thread(target=next_step)
    later.start()
    later.join(0.4)  # without the lock held, the next step's check() is done by now
    resume.set()
    applying.join(10)
    later.join(10)
    assert weights[0].tolist() == [-1.0, -1.0] and optimizer.step_count == 1  # this step's record, not the next


def test_two_threads_applying_the_same_statistics_apply_them_once() -> None:
    import threading

    from cupy_amp.optim import SGD

    scaler = GradScaler(init_scale=4.0)
    weights, grads = [np.zeros(4, np.float32)], [np.full(4, 4.0, np.float32)]
    optimizer = SGD(weights, lr=1.0)
    scaler.scale_loss(np.ones((), np.float32))
    stats = scaler.check(grads)
    outcomes: list[str] = []

    def apply() -> None:
        try:
            optimizer.step(grads, stats)
            outcomes.append("applied")
        except ScalerProtocolError as error:
            outcomes.append("refused" if "already applied" in str(error) else str(error))

    threads = [threading.Thread(target=apply) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(outcomes) == ["applied", "refused"]
    assert weights[0].tolist() == [-1.0] * 4 and optimizer.step_count == 1
