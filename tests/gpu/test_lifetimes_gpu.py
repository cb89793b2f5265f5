"""What a step's device work relies on stays valid: interrupted updates, graphs' tables, streams, peers' answers.

Each test here failed on the code before its fix (see the closing notes of the issue "No silent wrong
update"): a retried update applied the rule twice on the device, a replay read an optimizer table an eager
step had freed, a capture took a plain list's evictable tables, a check() on one stream rewrote the record an
optimizer on another stream had not read yet, and a garbage sum of squares from the all-reduce was applied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import capture, open_step
from interrupts import interrupted, interrupted_twice

cupy = pytest.importorskip("cupy")

from cupy_amp import CommunicatorError, GradScaler, ScalerProtocolError, SyncFreeGradScaler  # noqa: E402
from cupy_amp.gpu.device_state import DeviceState  # noqa: E402
from cupy_amp.optim import SGD  # noqa: E402
from cupy_amp.state_set import StateSet  # noqa: E402
from cupy_amp.step import IDLE, UPDATING, Step  # noqa: E402

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


def checked_step(face: type, bad: bool) -> Any:
    """A scaler (scale 4, growing every clean step) whose step checked 8.0s on the GPU (one inf if ``bad``),
    with update() still to come."""
    scaler = face(init_scale=4.0, growth_interval=1, max_scale=2.0**10)
    scaler.scale_loss(cupy.ones((), cupy.float32))
    grads = [cupy.full(3, 8.0, cupy.float32)]
    if bad:
        grads[0][1] = cupy.inf
    assert bool(scaler.unscale_and_check(grads)) is not bad
    return scaler


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_an_update_interrupted_at_any_line_applies_the_device_rule_once(face: type, bad: bool) -> None:
    # The rule runs in a kernel that update() queues: an interrupt after the launch and before the step closes
    # on the host leaves the step open, and the retry queues the kernel again. The state's record of the step
    # it last updated makes that second launch do nothing.
    k, reached = 1, True
    while reached:
        scaler = checked_step(face, bad)
        reached = interrupted(scaler.update, k)
        if scaler._step.phase != IDLE:
            scaler.update()  # the retry a user makes after an interrupted update()
        expected = 2.0 if bad else 8.0
        on_device = device_state(scaler).snapshot()[0]  # what the kernels use next, read from the device
        assert (on_device.steps, on_device.scale) == (1, expected), f"line {k}: the rule applied twice"
        assert (scaler.stats().steps, scaler.scale_factor()) == (1, expected), f"line {k}"
        assert_next_steps_see_their_own_verdicts(scaler, bad, f"line {k}")
        k += 1
    assert k > 10  # the sweep went through update()'s lines


def assert_next_steps_see_their_own_verdicts(scaler: Any, bad: bool, where: str) -> None:
    """Two more steps, one with a culprit, report their own verdicts and culprits, never the last step's.

    On the synchronous face, update()'s own launch begins the next step; after an interrupt it may be begun
    again, or not by that launch: either way the step must start from "finite" with a new epoch.
    """
    for culprit in (1, None):
        scaler.scale_loss(cupy.ones((), cupy.float32))
        grads = [cupy.full(3, 8.0, cupy.float32) for _ in range(3)]
        if culprit is not None:
            grads[culprit][0] = cupy.nan
        assert bool(scaler.unscale_and_check(grads)) is (culprit is None), where
        assert scaler.nonfinite_gradients() == ([] if culprit is None else [culprit]), where
        scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps) == (3, int(bad) + 1), where
    # The journal holds each step once, as the rule closed it (a retried or repaired update() rewrote it).
    entries = scaler.journal()
    assert entries["step"].tolist() == [1, 2, 3], where
    assert entries["agreed"].tolist() == [int(bad), 1, 0], where
    assert entries["culprits"].tolist() == [int(bad), 1, 0] and entries["culprit"].tolist()[1] == 1, where
    if isinstance(scaler, GradScaler):
        assert device_state(scaler).snapshot()[0] == scaler._mirror.state, where


@pytest.mark.parametrize("then", ["update", "another call"])
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_an_update_interrupted_again_inside_its_repair_applies_the_device_rule_once(
    bad: bool, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU twin of tests/step/test_step_interrupts.py's test of the same name: a Ctrl-C at line k of
    # update() and a second one at line j of its repair (the states set from the host mirror). The retry must
    # apply the rule once on the device too, though update()'s launch also begins the next step (its epoch
    # moves, so the rule's once-per-epoch guard cannot tell the retry; the launch's step number does).
    expected = 2.0 if bad else 8.0

    def setup() -> tuple[Any, Callable[[], object]]:
        scaler = checked_step(GradScaler, bad)
        return scaler, scaler.update

    def check(scaler: Any, where: str) -> None:
        if scaler._step.phase != IDLE:
            if then == "another call":  # refused once update() began: it may have applied the rule
                more = [cupy.full(3, 8.0, cupy.float32)]
                if scaler._step.phase == UPDATING:
                    with pytest.raises(ScalerProtocolError, match="did not finish"):
                        scaler.unscale_and_check(more)
                else:
                    assert bool(scaler.unscale_and_check(more)) is not bad, where
                    assert more[0].tolist() == [2.0] * 3, f"{where}: divided by another scale"
            scaler.update()  # the user's retry
        on_device = device_state(scaler).snapshot()[0]
        assert (on_device.steps, on_device.scale) == (1, expected), f"{where}: the rule applied twice"
        assert on_device == scaler._mirror.state, where
        assert_next_steps_see_their_own_verdicts(scaler, bad, where)

    k, seconds = interrupted_twice(monkeypatch, StateSet, "restore", setup, check)
    assert k > 10 and seconds > 20  # both sweeps went through their calls' lines


def test_a_step_whose_opening_was_cut_short_twice_after_a_folded_update_starts_clean_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # update() began step 2 in its own launch; step 2's opening was then cut short in the call and again in
    # its failure accounting. The step still opened (a new number), counted its overflow, and step 3 begins
    # from "finite": before, the host thought step 3 already begun and it inherited step 2's flag.
    scaler = GradScaler(init_scale=4.0, growth_interval=1, max_scale=2.0**10)
    open_step(scaler, cupy).unscale_and_check([cupy.full(3, 8.0, cupy.float32)])
    scaler.update()  # 8
    original, cuts = Step._open, [2]

    def cut_short(self: Step, *args: Any) -> None:
        if cuts[0]:
            cuts[0] -= 1
            raise KeyboardInterrupt
        original(self, *args)

    with monkeypatch.context() as patched:
        patched.setattr(Step, "_open", cut_short)
        scaler.scale_loss(cupy.ones((), cupy.float32))
        with pytest.raises(KeyboardInterrupt):
            scaler.unscale_and_check([cupy.full(3, 8.0, cupy.float32)])
    scaler.update()  # step 2: an overflow (its call failed), backs off to 4
    assert (scaler.stats().steps, scaler.stats().skipped_steps, scaler.scale_factor()) == (2, 1, 4.0)
    scaler.scale_loss(cupy.ones((), cupy.float32))
    assert scaler.unscale_and_check([cupy.full(3, 8.0, cupy.float32)]) is True
    assert scaler.nonfinite_gradients() == []
    scaler.update()
    assert device_state(scaler).snapshot()[0] == scaler._mirror.state and scaler.scale_factor() == 8.0


def test_a_restore_interrupted_at_any_line_never_reports_old_impossible_answers_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two impossible answers reported; then a load whose restore, and its repair's, are interrupted at line k.
    # The count of reported answers must stay true at every k: an old answer reported again in a clean step
    # fails that step after the ranks agreed to apply it, which poisons every rank.
    original, k, landed = DeviceState.restore, 1, True
    while landed:
        others = OtherRanks(0.5, 0.0)  # impossible answers until set honest
        scaler = GradScaler(init_scale=4.0, comm=others)
        saved = scaler.checkpoint()
        for _ in range(2):
            open_step(scaler, cupy)
            with pytest.raises(CommunicatorError, match="impossible"):
                scaler.unscale_and_check([cupy.ones(4, cupy.float32)])
            scaler.update()
        others.others = (0.0, 0.0)
        landed = False

        def cut(self: DeviceState, *args: Any, line: int = k) -> None:
            nonlocal landed
            if interrupted(lambda: original(self, *args), line):
                landed = True
                raise KeyboardInterrupt

        with monkeypatch.context() as patched:
            patched.setattr(DeviceState, "restore", cut)
            with contextlib.suppress(KeyboardInterrupt):
                scaler.load_checkpoint(saved)
        open_step(scaler, cupy)
        assert scaler.unscale_and_check([cupy.ones(4, cupy.float32)]) is True, f"line {k}"
        scaler.update()
        others.others = (0.5, 0.0)
        open_step(scaler, cupy)
        with pytest.raises(CommunicatorError, match=r"^1 all-reduce"):  # a new one is reported, once
            scaler.unscale_and_check([cupy.ones(4, cupy.float32)])
        scaler.update()
        k += 1
    assert k > 10


def test_update_refuses_a_capture_and_changes_nothing() -> None:
    # The synchronous face keeps its state on the host as well: a replayed update() would move the device's
    # scale behind the host's back (and its launch carries the step's number, which a capture would freeze).
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        scaler = GradScaler(init_scale=4.0, growth_interval=1)
        grads = [cupy.ones(4, cupy.float32)]
        open_step(scaler, cupy).unscale_and_check(grads)
        with pytest.raises(ScalerProtocolError, match="SyncFreeGradScaler"):
            capture(stream, scaler.update)
        stream.synchronize()
        assert scaler.is_step_open() and scaler.scale_factor() == 4.0
        scaler.update()
        assert scaler.scale_factor() == 8.0 and device_state(scaler).snapshot()[0] == scaler._mirror.state


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


@pytest.mark.parametrize(
    ("face", "restore"),
    [
        (GradScaler, "load"),
        (GradScaler, "interrupted load"),
        (GradScaler, "interrupted update"),
        (SyncFreeGradScaler, "load"),
        (SyncFreeGradScaler, "interrupted load"),
    ],
)
def test_an_impossible_answer_after_the_state_was_restored_is_reported_again(
    face: type, restore: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restore (a load, or the repair of an interrupted load or update) zeroes the device's count of impossible
    # answers; a count of those already reported, kept apart from it, hid the next ones until it was passed.
    scaler = face(init_scale=4.0, comm=OtherRanks(0.5, 0.0))  # no count of ranks: every answer is impossible
    saved = scaler.checkpoint()

    def garbage_step() -> None:
        open_step(scaler, cupy)
        grads = [cupy.ones(4, cupy.float32)]
        if face is GradScaler:
            with pytest.raises(CommunicatorError, match="impossible"):
                scaler.unscale_and_check(grads)
            scaler.update()
        else:
            assert not bool(scaler.unscale_and_check(grads))
            scaler.update()
            with pytest.raises(CommunicatorError, match="impossible"):
                scaler.stats()

    def interrupt_after(name: str, call: Any) -> None:
        original = getattr(StateSet, name)

        def then_interrupt(self: StateSet, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            raise KeyboardInterrupt

        with monkeypatch.context() as patched:
            patched.setattr(StateSet, name, then_interrupt)
            with pytest.raises(KeyboardInterrupt):
                call()

    garbage_step()
    if restore == "interrupted update":  # update() repairs the state from the host mirror, then is retried
        open_step(scaler, cupy)
        with pytest.raises(CommunicatorError, match="impossible"):
            scaler.unscale_and_check([cupy.ones(4, cupy.float32)])
        interrupt_after("update", scaler.update)
        assert scaler.is_step_open()
        scaler.update()
    else:
        garbage_step()
        if restore == "load":
            scaler.load_checkpoint(saved)
        else:
            interrupt_after("restore", lambda: scaler.load_checkpoint(saved))
    garbage_step()  # the state's count starts again from 0: this answer is new, and is reported


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
