"""What a step's device work relies on stays valid: interrupted updates, graphs' tables, streams, peers' answers.

Each test here failed on the code before its fix (see the closing notes of the issue "No silent wrong
update"): a retried update applied the rule twice on the device, a replay read an optimizer table an eager
step had freed, a capture took a plain list's evictable tables, a check() on one stream rewrote the record an
optimizer on another stream had not read yet, and a garbage sum of squares from the all-reduce was applied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import capture, open_step
from interrupts import interrupted

cupy = pytest.importorskip("cupy")

from cupy_amp import CommunicatorError, GradScaler, ScalerProtocolError, SyncFreeGradScaler  # noqa: E402
from cupy_amp.optim import SGD  # noqa: E402
from cupy_amp.step import IDLE  # noqa: E402

FACES = [GradScaler, SyncFreeGradScaler]

_SPIN = cupy.RawKernel(
    'extern "C" __global__ void spin(long long cycles) { long long t = clock64(); while (clock64() - t < cycles) {} }',
    "spin",
)


def device_state(scaler: Any) -> Any:
    """The one device state the scaler's CuPy arrays use."""
    if isinstance(scaler, GradScaler):
        (state,) = scaler._scaling.states.values()
        return state
    return scaler._state


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_an_update_interrupted_at_any_line_applies_the_device_rule_once(face: type, bad: bool) -> None:
    # The rule runs in a kernel that update() queues: an interrupt after the launch and before the step closes
    # on the host leaves the step open, and the retry queues the kernel again. The state's record of the step
    # it last updated makes that second launch do nothing.
    k, reached = 1, True
    while reached:
        scaler = face(init_scale=4.0, growth_interval=1, max_scale=2.0**10)
        scaler.scale_loss(cupy.ones((), cupy.float32))
        grads = [cupy.full(3, 8.0, cupy.float32)]
        if bad:
            grads[0][1] = cupy.inf
        assert bool(scaler.unscale_and_check(grads)) is not bad
        reached = interrupted(scaler.update, k)
        if scaler._step.phase != IDLE:
            scaler.update()  # the retry a user makes after an interrupted update()
        expected = 2.0 if bad else 8.0
        on_device = device_state(scaler).snapshot()[0]  # what the kernels use next, read from the device
        assert (on_device.steps, on_device.scale) == (1, expected), f"line {k}: the rule applied twice"
        assert (scaler.stats().steps, scaler.scale_factor()) == (1, expected), f"line {k}"
        k += 1
    assert k > 10  # the sweep went through update()'s lines


def test_a_replay_keeps_the_optimizer_tables_it_captured_after_an_eager_step_with_other_buffers() -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        weights = cupy.zeros(8, cupy.float32)
        captured_grad, other_grad = cupy.ones(8, cupy.float32), cupy.full(8, 2.0, cupy.float32)
        opt = SGD([weights], lr=1.0)
        opt.step([captured_grad], None)  # -1
        graph = capture(stream, lambda: opt.step([captured_grad], None))
        opt.step([other_grad], None)  # -2, with new tables
        # Whatever memory the optimizer let go of is handed out again, zeroed (a freed table would read so).
        filler = [cupy.zeros(48, cupy.uint8) for _ in range(256)]
        graph.launch(stream)  # -1, through the captured tables
        stream.synchronize()
    assert cupy.asnumpy(weights).tolist() == [-4.0] * 8
    del filler


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("call", ["unscale_and_check", "check"])
def test_a_capture_with_a_plain_list_is_refused(face: type, call: str) -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        scaler = face(init_scale=4.0)
        loss, grads = cupy.ones((), cupy.float32), [cupy.ones(16, cupy.float32)]
        scaler.scale_loss(loss)
        getattr(scaler, call)(grads)  # tables built and kernels loaded eagerly
        scaler.update()
        scaler.scale_loss(loss)
        with pytest.raises(ScalerProtocolError, match="GradientSet"):
            capture(stream, lambda: getattr(scaler, call)(grads))
        stream.synchronize()
        expected = [0.25] * 16 if call == "unscale_and_check" else [1.0] * 16  # the eager call's result, no more
        assert grads[0].tolist() == expected


@pytest.mark.parametrize("face", FACES)
def test_the_next_step_waits_for_an_optimizer_on_another_stream_to_read_the_record(face: type) -> None:
    """Step 1 overflows; its optimizer step on stream B is late (behind a long kernel). Step 2 on stream A
    rewrites the statistics record with a clean verdict: it must wait until B has read step 1's "skip"."""
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    weights, grad = cupy.zeros(1000, cupy.float32), cupy.zeros(1000, cupy.float32)
    optimizer = SGD([weights], lr=1.0)
    optimizer.step([grad], None)  # builds the tables now: building them waits for the stream, which would hide the race
    scaler = face(init_scale=1.0)
    cupy.cuda.Device().synchronize()
    with a:
        grad.fill(cupy.inf)
        stats = open_step(scaler, cupy).check([grad])
    with b:
        _SPIN((1,), (1,), (np.int64(500_000_000),))  # about a quarter of a second
        optimizer.step([grad], stats)  # must read step 1's "skip"
    with a:
        scaler.update()
        grad.fill(1.0)
        stats = open_step(scaler, cupy).check([grad])
        optimizer.step([grad], stats)
    cupy.cuda.Device().synchronize()
    assert optimizer.step_count == 2  # the warm-up and step 2
    assert cupy.asnumpy(weights).tolist() == [-1.0] * 1000


class OtherRanks:
    """A communicator stand-in for one GPU: the all-reduce adds the other ranks' (overflowed, sum of squares)."""

    def __init__(self, overflowed: float, sum_of_squares: float) -> None:
        self.others = (overflowed, sum_of_squares)

    def reduce_sum(self, values: Any, stream: Any) -> None:
        with stream:
            values += cupy.asarray(np.array(self.others, dtype=np.float64))


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("others", [np.nan, -20.0, np.inf, -np.inf], ids=["nan", "below-own", "inf", "negative"])
def test_a_sum_of_squares_no_ranks_can_add_up_to_skips_the_step_and_is_reported(face: type, others: float) -> None:
    # This rank's share is 16 (four ones, scaled by 2): the all-reduced sum must be at least that, and finite.
    weights = cupy.zeros(4, cupy.float32)
    optimizer = SGD([weights], lr=1.0)
    scaler = face(init_scale=2.0, comm=OtherRanks(0.0, others))
    grads = [cupy.full(4, 2.0, cupy.float32)]
    open_step(scaler, cupy)
    if face is GradScaler:
        with pytest.raises(CommunicatorError, match="sums of squares"):
            scaler.check(grads, max_norm=1.0)
    else:
        stats = scaler.check(grads, max_norm=1.0)
        assert not bool(stats.finite)
        optimizer.step(grads, stats)
        with pytest.raises(CommunicatorError, match="sums of squares"):
            scaler.stats()
    assert scaler.had_overflow()
    assert int(device_state(scaler).stats.skip) == 1  # what any optimizer reads: skip
    assert optimizer.step_count == 0 and cupy.asnumpy(weights).tolist() == [0.0] * 4


def test_a_learning_rate_set_on_another_stream_does_not_reach_a_step_queued_before() -> None:
    """A new learning rate is written after the steps already queued, whichever stream they are on."""
    s = cupy.cuda.Stream(non_blocking=True)
    weights, grad = cupy.zeros(1000, cupy.float32), cupy.ones(1000, cupy.float32)
    optimizer = SGD([weights], lr=1.0)
    optimizer.step([grad], None)  # tables built now (building them waits); weights = -1
    cupy.cuda.Device().synchronize()
    with s:
        _SPIN((1,), (1,), (np.int64(500_000_000),))  # about a quarter of a second
        optimizer.step([grad], None)  # queued with lr 1: weights = -2
    optimizer.lr = 0.0  # on the null stream, while the step above waits behind the spin
    cupy.cuda.Device().synchronize()
    assert cupy.asnumpy(weights).tolist() == [-2.0] * 1000  # the queued step kept lr 1
    with s:
        optimizer.step([grad], None)
    cupy.cuda.Device().synchronize()
    assert cupy.asnumpy(weights).tolist() == [-2.0] * 1000  # the step after the setter uses lr 0


def test_two_sync_free_scalers_over_the_same_memory_keep_their_own_culprits() -> None:
    """Both passes use one (cached) table; each state flags its culprits in flags of its own.

    They lived in the shared table, where the second scaler's pass overwrote the first's epoch, and the
    sync-free face reads culprits lazily: the first scaler then named none.
    """
    grad = cupy.ones(8, cupy.float32)
    grad[3] = cupy.inf
    first, second = SyncFreeGradScaler(init_scale=1.0), SyncFreeGradScaler(init_scale=1.0)
    open_step(first, cupy).check([grad])
    open_step(second, cupy).check([grad])  # same addresses, shape, strides: the same table
    assert first.had_overflow()
    assert first.nonfinite_gradients() == [0]
    assert second.nonfinite_gradients() == [0]


def test_two_sync_free_scalers_unscaling_the_same_memory_keep_their_own_culprits() -> None:
    grad = cupy.ones(8, cupy.float32)
    grad[5] = cupy.nan
    first, second = SyncFreeGradScaler(init_scale=1.0), SyncFreeGradScaler(init_scale=1.0)
    open_step(first, cupy).unscale_and_check([grad])
    open_step(second, cupy).unscale_and_check([grad])  # the same table; the epochs of two states
    assert first.nonfinite_gradients() == [0] and second.nonfinite_gradients() == [0]
