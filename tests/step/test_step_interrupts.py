"""Both scalers interrupted at every line of one call: nothing divided twice, no lost or doubled step.

For every k, a KeyboardInterrupt is raised at the k-th line that runs inside
cupy_amp during one call (tests/interrupts.py), with and without a
communicator (one rank of the in-process stand-in). Afterwards:

- every gradient element was divided at most once, and a call that wrote is
  refused if passed again in the step;
- the step counts as an overflow unless the call's record was complete (then
  its verdict is the true one);
- a call joins at most one collective, and exactly one once its step opened; or, where it was interrupted
  inside its collective and cannot know whether it took part, the scaler is poisoned: it sent the poisoned
  vote (its only other collective) and refuses every later call;
- a record that says "apply" holds the step's true statistics;
- the update rule is applied exactly once per step, and GradScaler's host
  mirror agrees with the state the arrays use;
- the scaler keeps working.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fake_comm import FakeVote, FakeWorld
from helpers import open_step
from interrupts import interrupted, interrupted_twice, saves_refused_after_real_interrupts

from cupy_amp import DuplicateGradientError, GradScaler, RanksMayDisagreeError, ScalerProtocolError, SyncFreeGradScaler
from cupy_amp.distributed import POISON
from cupy_amp.state_set import StateSet
from cupy_amp.step import IDLE, INSPECTED, UNSCALED, UPDATING, Step

FACES = [GradScaler, SyncFreeGradScaler]
SCALE = 4.0
CLEAN, ONCE = 8.0, 2.0  # a gradient element before and after one division by SCALE


def new_scaler(face: type, voting: bool) -> tuple[Any, Callable[[], int]]:
    """A scaler (growing after every clean step) and a count of the collectives it joined so far (its poisoned
    vote, if it sent one, not counted)."""
    world = FakeWorld(1)
    comm = FakeVote(world, 0) if voting else None
    scaler = face(init_scale=SCALE, growth_interval=1, max_scale=2.0**10, comm=comm)
    return scaler, lambda: sum(pair[0] < POISON for pair in world.sums[0])


def poisoned(scaler: Any) -> bool:
    """Whether the scaler refuses every call as poisoned (and, if it does, that it refuses them all)."""
    try:
        scaler.stats()
    except RanksMayDisagreeError:
        for call in (scaler.update, scaler.checkpoint, scaler.scale_factor, lambda: scaler.check([])):
            with pytest.raises(RanksMayDisagreeError):
                call()
        return True
    return False


def gradients(bad: bool) -> list[np.ndarray]:
    grads = [np.full(3, CLEAN, np.float32) for _ in range(4)]
    if bad:
        grads[2][1] = np.inf
    return grads


def state_of(scaler: Any) -> Any:
    """The host state the scaler's NumPy arrays use."""
    return scaler._state if isinstance(scaler, SyncFreeGradScaler) else scaler._scaling.default


def finish_step(scaler: Any) -> None:
    """End the step if it is open (update() exactly once), then check the rule was applied once."""
    if scaler._step.phase in (UNSCALED, INSPECTED):
        overflow = bool(scaler.had_overflow())
        scaler.update()
        stats = scaler.stats()
        assert stats.steps == 1
        assert scaler.scale_factor() == (SCALE / 2 if overflow else SCALE * 2)
    assert scaler._step.phase in (IDLE, "loss scaled")
    if isinstance(scaler, GradScaler):  # the mirror and the state the arrays use are one state
        assert state_of(scaler).snapshot()[0].scale == scaler.scale_factor()
        assert state_of(scaler).snapshot()[0].steps == scaler.stats().steps


def keeps_working(scaler: Any) -> None:
    scale = scaler.scale_factor()
    loss = np.ones((), np.float32)
    scaler.scale_loss(loss)
    assert float(loss) == scale
    grads = [np.full(2, scale, np.float32)]
    assert bool(scaler.unscale_and_check(grads))
    assert grads[0].tolist() == [1.0, 1.0]
    scaler.update()


def journaled_once(scaler: Any, bad: bool, where: str) -> None:
    """The journal holds the one step once, as the rule closed it (a retried or repaired update() rewrote it)."""
    (entry,) = scaler.journal()
    assert (entry["step"], entry["scale"], entry["agreed"]) == (1, SCALE, int(bad)), where
    assert entry["next_scale"] == (SCALE / 2 if bad else SCALE * 2), where
    assert (entry["culprits"], entry["culprit"]) == ((1, 2) if bad else (0, -1)), where


def sweep(attempt: Callable[[int], bool], least: int = 10) -> None:
    """Run ``attempt(k)`` for k = 1, 2, ... until the call runs through without reaching line k."""
    k = 1
    while attempt(k):
        k += 1
    assert k > least  # the sweep really went through the call's lines


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("voting", [False, True], ids=["alone", "voting"])
def test_unscale_and_check_interrupted_at_any_line(face: type, bad: bool, voting: bool) -> None:
    def attempt(k: int) -> bool:
        scaler, joins = new_scaler(face, voting)
        scaler.scale_loss(np.ones((), np.float32))
        grads = gradients(bad)
        if not interrupted(lambda: scaler.unscale_and_check(grads), k):
            return False
        values = np.concatenate(grads)
        finite = values[np.isfinite(values)]
        assert set(finite.tolist()) <= {CLEAN, ONCE}, f"line {k}: a gradient divided twice"
        wrote = bool((finite == ONCE).any())
        opened = scaler._step.phase == UNSCALED
        assert joins() <= 1, f"line {k}: joined two collectives"
        if poisoned(scaler):
            return True
        if voting and (wrote or opened):
            assert joins() == 1, f"line {k}: the call wrote (or opened the step) without joining"
        if wrote:
            assert opened
            with pytest.raises(DuplicateGradientError):
                scaler.unscale_and_check(grads)
        if opened and not scaler.had_overflow():  # counted clean: only a complete call may be
            assert not bad and (finite == ONCE).all(), f"line {k}: an unfinished call counted as clean"
        if opened and bad and (finite == ONCE).all() and scaler.nonfinite_gradients():
            assert scaler.nonfinite_gradients() == [2], f"line {k}"
        finish_step(scaler)
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("voting", [False, True], ids=["alone", "voting"])
def test_check_interrupted_at_any_line(face: type, bad: bool, voting: bool) -> None:
    reference, _ = new_scaler(face, voting)
    reference.scale_loss(np.ones((), np.float32))
    expected = reference.check(gradients(bad), max_norm=1.0)
    expected_norm = np.float32(expected.norm).tobytes()

    def attempt(k: int) -> bool:
        scaler, joins = new_scaler(face, voting)
        scaler.scale_loss(np.ones((), np.float32))
        grads = gradients(bad)
        if not interrupted(lambda: scaler.check(grads, max_norm=1.0), k):
            return False
        assert all(np.array_equal(g, h) for g, h in zip(grads, gradients(bad))), "check() wrote a gradient"
        opened = scaler._step.phase == INSPECTED
        assert joins() <= 1, f"line {k}: joined two collectives"
        if poisoned(scaler):
            return True
        if voting and opened:
            assert joins() == 1, f"line {k}: the step opened without joining"
        record = state_of(scaler).stats.memory
        if int(record["skip"]) == 0 and opened:  # a record that says "apply" is this step's, complete
            assert not bad and np.float32(record["norm"]).tobytes() == expected_norm, f"line {k}"
        if opened and not scaler.had_overflow():
            assert int(record["skip"]) == 0 and not bad, f"line {k}: counted clean but says skip"
        finish_step(scaler)
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_update_interrupted_at_any_line_applies_the_rule_once(face: type, bad: bool) -> None:
    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        scaler.scale_loss(np.ones((), np.float32))
        assert bool(scaler.unscale_and_check(gradients(bad))) is not bad
        if not interrupted(scaler.update, k):
            return False
        if scaler._step.phase != IDLE:
            scaler.update()  # the retry a user makes after an interrupted update()
        else:
            with pytest.raises(ScalerProtocolError):
                scaler.update()
        stats = scaler.stats()
        assert (stats.steps, stats.skipped_steps) == (1, int(bad)), f"line {k}"
        assert scaler.scale_factor() == (SCALE / 2 if bad else SCALE * 2), f"line {k}: the rule applied twice"
        journaled_once(scaler, bad, f"line {k}")
        finish_step(scaler)
        keeps_working(scaler)
        assert scaler.journal()["step"].tolist() == [1, 2], f"line {k}"
        return True

    sweep(attempt)


@pytest.mark.parametrize("then", ["update", "another call"])
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_update_interrupted_again_inside_its_repair_applies_the_rule_once(
    bad: bool, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second Ctrl-C while update() repairs the first (it sets the states from the host mirror): for every
    # line k of update() and every line j of that repair, whatever the user does next (retry update(), or
    # first unscale more gradients of the still open step), the rule is applied once, the gradients are
    # divided by the scale the loss was multiplied by, and the state the next kernels read is the mirror's.
    # Here on the NumPy state; tests/gpu/test_lifetimes_gpu.py runs the same on a device state. Before, a
    # state left ahead of the mirror unscaled the next call's gradients with the next step's scale.
    def setup() -> tuple[Any, Callable[[], object]]:
        scaler, _ = new_scaler(GradScaler, False)
        scaler.scale_loss(np.ones((), np.float32))
        assert bool(scaler.unscale_and_check(gradients(bad))) is not bad
        return scaler, scaler.update

    def check(scaler: Any, where: str) -> None:
        if scaler._step.phase != IDLE:
            if then == "another call":
                more = [np.full(3, CLEAN, np.float32)]
                if scaler._step.phase == UPDATING:  # the rule may have been applied: only update() goes on
                    with pytest.raises(ScalerProtocolError, match="update\\(\\) that did not finish"):
                        scaler.unscale_and_check(more)
                    assert more[0].tolist() == [CLEAN] * 3, where
                else:
                    assert bool(scaler.unscale_and_check(more)) is not bad, where
                    assert more[0].tolist() == [ONCE] * 3, f"{where}: divided by another scale"
            scaler.update()  # the user's retry
        stats = scaler.stats()
        assert (stats.steps, stats.skipped_steps) == (1, int(bad)), where
        assert scaler.scale_factor() == (SCALE / 2 if bad else SCALE * 2), where
        assert scaler._scaling.all()[0].snapshot()[0] == scaler._mirror.state, where  # what kernels read
        journaled_once(scaler, bad, where)
        scaler.scale_loss(np.ones((), np.float32))
        assert bool(scaler.unscale_and_check(gradients(False))), f"{where}: the next step is not clean"

    k, seconds = interrupted_twice(monkeypatch, StateSet, "restore", setup, check)
    assert k > 10 and seconds > 20  # both sweeps went through their calls' lines


@pytest.mark.parametrize("face", FACES)
def test_a_gradient_call_interrupted_in_both_openings_of_its_step_still_opens_a_new_step(
    face: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The step's opening cut short twice, at its first line: in the call, and again in the failure
    # accounting that opens it for the call. The step was left open under the last step's number, so
    # update() found its rule applied already and the overflow the call counted was lost.
    scaler, _ = new_scaler(face, False)
    open_step(scaler, np).unscale_and_check(gradients(False))
    scaler.update()
    original, cuts = Step._open, [2]

    def cut_short(self: Step, *args: Any) -> None:
        if cuts[0]:
            cuts[0] -= 1
            raise KeyboardInterrupt  # at _open's first line
        original(self, *args)

    with monkeypatch.context() as patched:
        patched.setattr(Step, "_open", cut_short)
        scaler.scale_loss(np.ones((), np.float32))
        with pytest.raises(KeyboardInterrupt):
            scaler.unscale_and_check(gradients(False))
    assert cuts == [0] and scaler.is_step_open()
    assert scaler.nonfinite_gradients() == []  # the last step's records are not this one's
    scaler.update()
    stats = scaler.stats()
    assert (stats.steps, stats.skipped_steps, scaler.scale_factor()) == (2, 1, SCALE)
    scaler.scale_loss(np.ones((), np.float32))
    assert bool(scaler.unscale_and_check(gradients(False)))


def test_load_checkpoint_interrupted_again_inside_its_repair_leaves_the_old_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The load wrote the states and was interrupted; the repair (the states set back from the mirror) was
    # interrupted before it wrote. The next use of the states repairs them first: they never hold the
    # checkpoint's scale while the mirror holds the old one.
    scaler, _ = new_scaler(GradScaler, False)
    open_step(scaler, np).unscale_and_check(gradients(False))
    scaler.update()  # scale 8
    other = GradScaler(init_scale=2.0**10).checkpoint()
    original, calls = StateSet.restore, [0]

    def load_then_cut_repair(self: StateSet, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            original(self, *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(StateSet, "restore", load_then_cut_repair)
        with pytest.raises(KeyboardInterrupt):
            scaler.load_checkpoint(other)
    assert calls == [2] and scaler.scale_factor() == 2 * SCALE  # the mirror kept the old state
    loss, grads = np.ones((), np.float32), [np.full(3, 16.0, np.float32)]
    scaler.scale_loss(loss)
    assert float(loss) == 2 * SCALE, "the loss was scaled by the checkpoint's scale"
    assert bool(scaler.unscale_and_check(grads)) and grads[0].tolist() == [2.0] * 3
    scaler.update()
    assert scaler._scaling.all()[0].snapshot()[0] == scaler._mirror.state


@pytest.mark.parametrize("face", FACES)
def test_scale_loss_interrupted_at_any_line(face: type) -> None:
    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        loss = np.ones((), np.float32)
        if not interrupted(lambda: scaler.scale_loss(loss), k):
            return False
        assert float(loss) in (1.0, SCALE), f"line {k}"
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.parametrize("face", FACES)
def test_abandon_step_interrupted_at_any_line_leaves_the_step_scaled_or_dropped(face: type) -> None:
    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        before = scaler.checkpoint()
        scaler.scale_loss(np.ones((), np.float32))
        if not interrupted(scaler.abandon_step, k):
            return False
        scaler.abandon_step()  # the handler's retry: dropped either way
        assert scaler.checkpoint() == before, f"line {k}"
        keeps_working(scaler)
        return True

    sweep(attempt, least=5)  # a short call: its lock, its admission and one assignment


@pytest.mark.parametrize("face", FACES)
def test_load_checkpoint_interrupted_at_any_line_leaves_the_old_state_or_the_new(face: type) -> None:
    donor = face(init_scale=2.0**6, growth_interval=3, hysteresis=2)
    donor.scale_loss(np.ones((), np.float32))
    donor.unscale_and_check([np.array([np.inf], np.float32)])
    donor.update()
    new = donor.checkpoint()

    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        old = scaler.checkpoint()
        if not interrupted(lambda: scaler.load_checkpoint(new), k):
            return False
        assert scaler.checkpoint() in (old, new), f"line {k}: a mix of two checkpoints"
        finish_step(scaler)
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.parametrize("face", FACES)
def test_a_later_call_of_a_step_interrupted_at_any_line_keeps_the_earlier_claims(face: type) -> None:
    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        memory = np.full(100, CLEAN, np.float32)
        scaler.scale_loss(np.ones((), np.float32))
        for earlier in (memory[0:10], memory[40:50]):  # two calls already claimed their memory
            assert bool(scaler.unscale_and_check([earlier]))
        if not interrupted(lambda: scaler.unscale_and_check([memory[60:70], memory[20:30]]), k):
            return False
        for earlier in (memory[0:10], memory[40:50], memory[45:55]):
            with pytest.raises(DuplicateGradientError):
                scaler.unscale_and_check([earlier])
        assert set(memory.tolist()) <= {CLEAN, ONCE}, f"line {k}: divided twice"
        later = np.concatenate([memory[60:70], memory[20:30]])
        if (later == ONCE).any() and not scaler.had_overflow():
            assert (later == ONCE).all(), f"line {k}: an unfinished call counted as clean"
        finish_step(scaler)
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "inf"])
def test_a_refused_call_interrupted_at_any_line_leaves_the_scaler_usable(face: type, bad: bool) -> None:
    # A call refused inside the scaler's `with` (memory an earlier call unscaled: DuplicateGradientError) leaves
    # that line with one line event per context manager; an interrupt at any line a signal can reach still
    # releases the scaler's locks, so the next call is not taken for one made from inside a call.
    def attempt(k: int) -> bool:
        scaler, _ = new_scaler(face, False)
        scaler.scale_loss(np.ones((), np.float32))
        first = gradients(bad)
        assert bool(scaler.unscale_and_check(first)) is not bad

        def refused() -> None:
            with pytest.raises(DuplicateGradientError):
                scaler.unscale_and_check([np.full(2, CLEAN, np.float32), first[0][1:3]])

        if not interrupted(refused, k):
            return False
        assert scaler.is_step_open(), f"line {k}"
        finish_step(scaler)
        keeps_working(scaler)
        return True

    sweep(attempt)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
@pytest.mark.parametrize("face", FACES)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a signal in a gc callback
def test_a_real_interrupt_anywhere_leaves_the_scaler_free_for_the_save_in_the_except_clause(face: type) -> None:
    # Real signals land between any two bytecodes, where the traced sweeps do not look: inside a Python context
    # manager's __enter__, after its lock was taken. The checkpoint taken in an `except KeyboardInterrupt:`
    # clause must never find the scaler held.
    scaler = face()
    interrupts, refused = saves_refused_after_real_interrupts(scaler.checkpoint)
    assert interrupts >= 200, f"only {interrupts} interrupts landed: the test saw too few to judge"
    assert refused == []


@pytest.mark.parametrize("face", FACES)
def test_a_call_stopped_as_a_python_exit_starts_never_rewrites_a_later_step(face: type) -> None:
    # A KeyboardInterrupt as a generator context manager's __exit__ starts leaves the generator suspended; the
    # collector closes it later, maybe in a later step. Its failure handling must not run then: it made a later,
    # clean step an overflow (a skip, a backoff) or reopened a step that update() had closed.
    import gc

    for k in itertools.count(1):
        scaler = face(init_scale=16.0, growth_interval=1000)
        open_step(scaler)
        seen, reached = 0, False

        def calls(frame: Any, event: str, arg: Any) -> Any:
            nonlocal seen, reached
            if event == "call" and frame.f_code.co_name == "__exit__":
                seen += 1
                if seen == k:  # noqa: B023
                    reached = True
                    raise KeyboardInterrupt
            return None

        kept: list[BaseException] = []
        sys.settrace(calls)
        try:
            scaler.unscale_and_check([np.full(3, 4.0, np.float32)])
        except KeyboardInterrupt as error:
            kept.append(error)  # kept for a while (a log, a debugger): the suspended generator lives on
        finally:
            sys.settrace(None)
        with contextlib.suppress(ScalerProtocolError):
            scaler.update()  # the interrupted step ends (an interrupt inside the call counts it as an overflow)
        before = scaler.stats()
        open_step(scaler)  # a later step, clean
        assert bool(scaler.unscale_and_check([np.full(3, 4.0, np.float32)])) is True
        kept.clear()
        gc.collect()  # the interrupted call's generators are closed now
        assert not scaler.had_overflow(), f"exit {k}: the later step became an overflow"
        scaler.update()
        after = scaler.stats()
        assert (after.steps, after.skipped_steps, after.scale) == (before.steps + 1, before.skipped_steps, before.scale)
        if not reached:
            break
