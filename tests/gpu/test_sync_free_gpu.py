"""SyncFreeGradScaler on a real GPU: the device rule against next_state, no waiting, CUDA graph replays."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_bits, capture, open_step

cupy = pytest.importorskip("cupy")

from cupy_amp import (  # noqa: E402
    CommunicatorError,
    GradientSet,
    GradientTypeError,
    GradScaler,
    RanksMayDisagreeError,
    ScalerProtocolError,
    SyncFreeGradScaler,
)

SPIN_SOURCE = r"""
extern "C" __global__ void cupy_amp_test_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""

# The rule's corners: the floor without min_scale (a float32 subnormal), growth into float32's maximum
# (the grown scale is inf and kept out), hysteresis, non-power-of-two factors, clamps.
RULE_CONFIGS = [
    {"init_scale": 2.0**-100, "growth_interval": 3, "backoff_factor": 0.125, "min_scale": None, "max_scale": None},
    {"init_scale": 2.0**120, "growth_interval": 1, "growth_factor": 3.5, "min_scale": None, "max_scale": None},
    {"init_scale": 1000.0, "growth_interval": 2, "growth_factor": 1.1, "backoff_factor": 0.9, "hysteresis": 3},
    {"init_scale": 2.0**16, "growth_interval": 4},
    {"init_scale": 7.0, "growth_interval": 2, "backoff_factor": 0.3, "min_scale": 0.001, "max_scale": 50.0},
]


def spin(seconds_of_cycles: int) -> None:
    cupy.RawKernel(SPIN_SOURCE, "cupy_amp_test_spin")((1,), (1,), (np.int64(seconds_of_cycles),))


@pytest.mark.parametrize("config", RULE_CONFIGS)
def test_the_device_rule_follows_next_state_over_10000_random_steps(config: dict[str, Any]) -> None:
    rng = random.Random(repr(config))
    reference, device = GradScaler(**config), SyncFreeGradScaler(**config)
    clean, broken = cupy.ones(4, cupy.float32), cupy.ones(4, cupy.float32)
    trajectory, expected = [], []
    for _ in range(10_000):
        overflow = rng.random() < 0.35
        if overflow:
            broken[2] = cupy.inf
        open_step(device, cupy).unscale_and_check([broken if overflow else clean])
        open_step(reference).unscale_and_check([np.array([np.inf if overflow else 1.0], np.float32)])
        device.update()
        reference.update()
        trajectory.append(device.scale_factor())
        expected.append(reference.stats().scale)
        clean.fill(1.0)
        broken.fill(1.0)
    assert (
        np.array(trajectory, np.float32).view(np.uint32).tolist()
        == np.array(expected, np.float32).view(np.uint32).tolist()
    )
    assert device.checkpoint().to_bytes() == reference.checkpoint().to_bytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_loss_and_gradients_match_grad_scaler_bit_for_bit(dtype: type) -> None:
    rng = np.random.default_rng(3)
    reference, sync_free = (
        GradScaler(init_scale=2.0**14, growth_interval=2),
        SyncFreeGradScaler(init_scale=2.0**14, growth_interval=2),
    )
    for step in range(12):
        host = [(rng.standard_normal(n) * 100).astype(dtype) for n in (1, 4099, 70_000)]
        if step % 3 == 1:
            host[1][4000] = np.nan
        loss = cupy.asarray(np.asarray(rng.uniform(1, 3), np.float32 if dtype == np.float16 else dtype))
        ours, theirs = loss.copy(), loss.copy()
        sync_free.scale_loss(ours)
        reference.scale_loss(theirs)
        assert_same_bits(ours, theirs)
        grads, copies = [cupy.asarray(g) for g in host], [cupy.asarray(g) for g in host]
        verdict = sync_free.unscale_and_check(grads)
        assert isinstance(verdict, cupy.ndarray) and verdict.shape == () and verdict.dtype == np.bool_
        assert bool(verdict) is reference.unscale_and_check(copies)
        for a, b in zip(grads, copies):
            assert_same_bits(a, b)
        assert sync_free.nonfinite_gradients() == reference.nonfinite_gradients()
        sync_free.update()
        reference.update()
        assert sync_free.stats() == reference.stats()


def test_a_steady_state_step_never_waits_for_the_gpu() -> None:
    scaler = SyncFreeGradScaler(init_scale=2.0**10)
    grads = [cupy.ones(1 << 20, cupy.float16) for _ in range(8)]
    params = [cupy.zeros(1 << 20, cupy.float32) for _ in range(8)]
    prepared = scaler.prepare(grads)
    loss = cupy.ones((), cupy.float32)
    for _ in range(2):  # warm: every kernel compiled and loaded
        scaler.scale_loss(loss)
        scaler.unscale_and_check(prepared)
        scaler.apply_if_finite(params, grads)
        scaler.update()
    cupy.cuda.get_current_stream().synchronize()
    done = cupy.cuda.Event()
    spin(2_000_000_000)  # about a second on an H200
    done.record()
    start = time.perf_counter()
    for _ in range(10):
        scaler.scale_loss(loss)
        scaler.unscale_and_check(prepared)
        scaler.apply_if_finite(params, grads)
        scaler.update()
    elapsed = time.perf_counter() - start
    still_spinning = not done.done
    assert still_spinning and elapsed < 0.2, (still_spinning, elapsed)
    cupy.cuda.get_current_stream().synchronize()
    assert scaler.stats().steps == 12


def test_a_captured_step_replays_bit_identically_to_the_same_step_run_eagerly() -> None:
    """fp16 gradients of fp32 master weights, every buffer preallocated (no allocation inside the step)."""
    rng = np.random.default_rng(11)
    batches = [rng.standard_normal((64, 32)).astype(np.float16) for _ in range(40)]
    for poisoned in (5, 6, 17, 30):
        batches[poisoned][3, 4] = np.inf

    def run(captured: bool) -> tuple[np.ndarray, list[dict[str, Any]]]:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            master = cupy.asarray(np.random.default_rng(0).standard_normal(32).astype(np.float32))
            weights = master.astype(cupy.float16)
            batch = cupy.empty((64, 32), cupy.float16)
            seed = cupy.empty((), cupy.float32)
            grad = cupy.empty(32, cupy.float16)
            step_update = cupy.empty(32, cupy.float32)
            updated = cupy.empty_like(master)
            learning_rate = cupy.full((), 0.01, cupy.float32)
            scaler = SyncFreeGradScaler(init_scale=2.0**8, growth_interval=5)
            prepared = scaler.prepare([grad])

            def step() -> None:
                seed.fill(1.0)
                scaler.scale_loss(seed)  # the backward pass's seed: d(scaled loss) / d(loss)
                cupy.sum(batch, axis=0, out=grad)
                cupy.multiply(grad, weights, out=grad)
                cupy.multiply(grad, seed, out=grad)  # the scaled gradient, as a backward pass gives it
                scaler.unscale_and_check(prepared)
                cupy.multiply(grad, learning_rate, out=step_update)
                cupy.subtract(master, step_update, out=updated)
                scaler.apply_if_finite([master], [updated])
                cupy.copyto(weights, master, casting="same_kind")
                scaler.update()

            batch.set(batches[0])
            step()  # warm-up, eager in both runs
            graph = capture(stream, step) if captured else None
            stats = []
            for data in batches[1:]:
                batch.set(data, stream=stream)
                if graph is not None:
                    graph.launch(stream)
                else:
                    step()
                stats.append(scaler.stats().to_dict())
            return cupy.asnumpy(master), stats

    eager_master, eager_stats = run(captured=False)
    graph_master, graph_stats = run(captured=True)
    assert graph_stats == eager_stats
    assert eager_stats[-1]["skipped_steps"] >= 4 and eager_stats[-1]["growths"] > 0
    assert_same_bits(graph_master, eager_master)


def test_a_checkpoint_loaded_after_capture_reaches_the_replays() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        grad = cupy.full(8, 64.0, cupy.float32)
        scaler = SyncFreeGradScaler(init_scale=2.0, growth_interval=1000)
        prepared = scaler.prepare([grad])
        loss = cupy.ones((), cupy.float32)  # allocated before the capture
        scaler.scale_loss(loss)
        scaler.unscale_and_check(prepared)
        scaler.update()
        graph = capture(stream, lambda: (scaler.scale_loss(loss), scaler.unscale_and_check(prepared), scaler.update()))
        other = GradScaler(init_scale=16.0, growth_interval=1000)
        scaler.load_checkpoint(other.checkpoint())
        grad.fill(64.0)
        graph.launch(stream)
        assert cupy.asnumpy(grad).tolist() == [4.0] * 8  # divided by the loaded scale, 16
        assert scaler.stats().steps == 1


def test_work_a_capture_cannot_record_is_refused_with_a_clear_error() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ready = GradientSet([cupy.ones(4, cupy.float32)])
        loss = cupy.ones((), cupy.float32)
        unbound = SyncFreeGradScaler()
        with pytest.raises(ScalerProtocolError, match="first placed on the GPU"):  # by the step's scale_loss
            capture(stream, lambda: (unbound.scale_loss(loss), unbound.unscale_and_check(ready)))
        bound = SyncFreeGradScaler()
        bound.prepare(ready)
        bound.scale_loss(loss)  # the step opens before the capture
        fresh = [cupy.ones(5, cupy.float32)]
        with pytest.raises(ScalerProtocolError, match="device tables"):
            capture(stream, lambda: bound.unscale_and_check(fresh))
        strided_loss = cupy.ones(8, cupy.float32)[::2]
        with pytest.raises(ScalerProtocolError, match="layout"):
            capture(stream, lambda: bound.scale_loss(strided_loss))
        assert not stream.is_capturing()


def test_arrays_of_another_kind_are_refused_once_the_state_is_on_the_gpu() -> None:
    scaler = SyncFreeGradScaler()
    scaler.scale_loss(cupy.ones((), cupy.float32))
    with pytest.raises(GradientTypeError, match="on device"):
        scaler.unscale_and_check([np.ones(2, np.float32)])
    scaler.unscale_and_check([cupy.ones(2, cupy.float32)])
    scaler.update()


def test_the_unscale_reads_a_subnormal_scale_without_flushing_it() -> None:
    # 2**-127 is a float32 subnormal; its inverse, 2**127, must reach the kernel intact.
    scaler = SyncFreeGradScaler(init_scale=2.0**-127, min_scale=None)
    grad = cupy.asarray(np.full(4, 2.0**-127, np.float32))  # a copy: a CuPy fill kernel would flush it
    loss = cupy.full((), 4.0, cupy.float32)
    scaler.scale_loss(loss)
    assert bool(scaler.unscale_and_check([grad]))
    assert cupy.asnumpy(grad).tolist() == [1.0] * 4
    assert cupy.asnumpy(loss).tolist() == 4.0 * 2.0**-127


def test_the_state_does_not_move_to_the_gpu_in_the_middle_of_a_step() -> None:
    # Only a guard opens a step without scale_loss (whose loss would place the state), so only a guard's
    # step can begin with no arrays.
    scaler = SyncFreeGradScaler.guard()
    host_verdict = scaler.unscale_and_check([])  # a step begun with no arrays: its verdict is on the host
    with pytest.raises(ScalerProtocolError, match="in the middle of the step"):
        scaler.unscale_and_check([cupy.full(2, np.inf, cupy.float32)])
    scaler.update()  # the refused call wrote nothing: as for GradScaler, the step stands
    assert bool(host_verdict) and scaler.stats().skipped_steps == 0
    verdict = scaler.unscale_and_check([cupy.full(2, np.inf, cupy.float32)])  # the next step moves it
    assert isinstance(verdict, cupy.ndarray) and not bool(verdict)
    scaler.update()
    assert scaler.stats().skipped_steps == 1 and scaler.stats().scale == 1.0


def test_writing_into_the_verdict_does_not_change_the_rule() -> None:
    scaler = SyncFreeGradScaler(init_scale=8.0, growth_interval=1)
    verdict = open_step(scaler, cupy).unscale_and_check([cupy.full(2, np.inf, cupy.float32)])
    verdict[()] = True  # a careless in-place op on the returned array
    scaler.update()
    assert scaler.stats().scale == 4.0 and scaler.had_overflow()
    verdict = open_step(scaler, cupy).unscale_and_check([cupy.ones(2, cupy.float32)])
    verdict &= False
    scaler.update()
    assert scaler.stats().scale == 8.0 and scaler.stats().skipped_steps == 1


class DeviceVote:
    """A communicator whose all-reduce writes ``answer`` (on the stream) as the count instead of the sum."""

    def __init__(self, answer: float) -> None:
        self.answer = answer

    def reduce_sum(self, values: Any, stream: Any) -> None:
        assert stream is not None, "a sync-free step sums on the device"
        with stream:
            values[0:1].fill(self.answer)


@pytest.mark.parametrize(
    ("answer", "own_inf"),
    [(0.5, False), (0.0, True), (-1.0, False), (float("nan"), False), (2.0**62, False)],
    ids=["fraction", "below-own", "negative", "nan", "huge"],
)
def test_a_count_no_ranks_can_add_up_to_counts_as_an_overflow_and_is_reported(answer: float, own_inf: bool) -> None:
    scaler = SyncFreeGradScaler(init_scale=8.0, comm=DeviceVote(answer))
    grad = cupy.ones(2, cupy.float32)
    if own_inf:
        grad[0] = cupy.inf  # this rank's own overflow, which the answer says nobody had
    assert not bool(open_step(scaler, cupy).unscale_and_check([grad]))
    scaler.update()
    with pytest.raises(CommunicatorError, match="impossible"):
        scaler.stats()
    stats = scaler.stats()  # reported once
    assert stats.skipped_steps == 1 and stats.scale == 4.0


def test_a_poisoned_count_freezes_the_device_state_and_the_next_read_refuses() -> None:
    """A replayed graph's all-reduce can bring another rank's poisoned vote with no Python in between: the
    device skips the step and decides nothing more (no backoff, no counters), and the host refuses from its
    next read on."""
    scaler = SyncFreeGradScaler(init_scale=8.0, growth_interval=1, comm=DeviceVote(2.0**40))
    grads = [cupy.ones(2, cupy.float32)]
    verdict = open_step(scaler, cupy).unscale_and_check(grads)
    scaler.update()  # queued: the host has not read the state
    assert not bool(verdict)
    state = scaler._state.snapshot()[0]
    assert (state.scale, state.steps, state.skipped_steps, state.backoffs) == (8.0, 0, 0, 0)
    with pytest.raises(RanksMayDisagreeError):
        scaler.stats()
    with pytest.raises(RanksMayDisagreeError):
        open_step(scaler, cupy)


def test_float64_gradients_and_losses_keep_subnormal_factors() -> None:
    # scale 2**127: the inverse, 2**-127, is a float32 subnormal that float64 arithmetic must not flush.
    for scaler_type in (GradScaler, SyncFreeGradScaler):
        device, host = scaler_type(init_scale=2.0**127, max_scale=None), GradScaler(init_scale=2.0**127, max_scale=None)
        values = np.array([3.0, -5.5, 1e300, 2.0**-1000], np.float64)
        grad = cupy.asarray(values)
        expected = values.copy()
        assert bool(open_step(device, cupy).unscale_and_check([grad])) and open_step(host).unscale_and_check([expected])
        assert_same_bits(grad, expected)
        small = scaler_type(init_scale=2.0**-127, min_scale=None)
        loss, expected_loss = cupy.full((), 3.0, cupy.float64), np.full((), 3.0, np.float64)
        small.scale_loss(loss)
        GradScaler(init_scale=2.0**-127, min_scale=None).scale_loss(expected_loss)
        assert_same_bits(loss, expected_loss)
        assert float(expected_loss) != 0.0


def test_work_on_another_stream_waits_for_the_states_last_update() -> None:
    scaler = SyncFreeGradScaler(init_scale=4.0, growth_interval=1)
    grads = scaler.prepare([cupy.ones(4, cupy.float32)])
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with second:
        open_step(scaler, cupy).unscale_and_check(grads)
        spin(200_000_000)  # about 100 ms on an H200: the update below runs late
        scaler.update()  # 4 -> 8
    with first:
        loss = cupy.ones((), cupy.float32)
        scaler.scale_loss(loss)  # must read 8, not the 4 still in memory while `second` spins
        assert float(cupy.asnumpy(loss, stream=first)) == 8.0
