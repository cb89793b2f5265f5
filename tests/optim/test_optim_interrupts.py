"""The fused optimizers interrupted at every line: a step, save or load happens whole, not at all, or is refused.

A ``sys.settrace`` hook raises KeyboardInterrupt at the k-th line that runs
inside cupy_amp during one call, for every k until the call runs through
(bare ``try:``/``else:``/``finally:`` lines are not counted: nothing runs there).
Afterwards the optimizer holds its state from before the call or the one the
call makes, or refuses to step and to save until a state is loaded; a file is
the old one or the new one; no lock is left held.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import open_step
from interrupts import interrupted, saves_refused_after_real_interrupts

from cupy_amp import GradScaler
from cupy_amp.errors import ScalerProtocolError
from cupy_amp.optim import SGD, AdamW

SHAPES = [(37, 5), (300,), (3, 3, 3)]
TORN = "was interrupted"  # the refusal after a torn call names what was interrupted
REENTRY = "same thread"

Snapshot = tuple[list[bytes], dict[str, Any]]


def make_params(dtype: Any, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in SHAPES]


def snapshot(opt: Any) -> Snapshot:
    """The parameters' bytes and the whole state (raises ScalerProtocolError if the optimizer refuses to save)."""
    return [p.tobytes() for p in opt.params], opt.state_dict()


def no_lock_left_held(opt: Any) -> None:
    """Assert another thread can still call the optimizer (it would wait forever for a lock left held)."""
    outcome: list[BaseException | None] = []

    def other() -> None:
        try:
            opt.state_dict()
            outcome.append(None)
        except ScalerProtocolError as error:
            outcome.append(error)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "another thread waits forever: the interrupted call left a lock held"
    assert outcome[0] is None or TORN in str(outcome[0])


def assert_refused_until_loaded(opt: Any, step: Callable[[], None], tmp_path: Path) -> None:
    with pytest.raises(ScalerProtocolError, match=TORN):
        step()
    with pytest.raises(ScalerProtocolError, match=TORN):
        opt.save(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


OPTIMIZERS = {
    "adamw-float16": (lambda p: AdamW(p, lr=0.01, weight_decay=0.1), np.float16),
    "sgd-momentum-float32": (lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True), np.float32),
}


class Run:
    """An optimizer after ``steps`` steps (the same every time it is made), and the gradients of its next step."""

    def __init__(self, name: str, steps: int) -> None:
        make, dtype = OPTIMIZERS[name]
        self.opt = make(make_params(dtype, 0))
        scaler = GradScaler(init_scale=2.0**8)
        for seed in range(steps):
            grads = [g * dtype(2**8) for g in make_params(dtype, 1 + seed)]
            open_step(scaler)
            self.opt.step(grads, scaler.check(grads, max_norm=5.0))
            scaler.update()
        self.grads = [g * dtype(2**8) for g in make_params(dtype, 1 + steps)]
        open_step(scaler)
        self.stats = scaler.check(self.grads, max_norm=5.0)

    def step(self) -> None:
        self.opt.step(self.grads, self.stats)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_interrupted_at_any_line_applies_to_every_parameter_or_to_none_or_is_refused(
    name: str, tmp_path: Path
) -> None:
    before = Run(name, 2)
    pre = snapshot(before.opt)
    before.opt.save(tmp_path / "pre")
    before.step()
    post = snapshot(before.opt)
    outcomes = set()
    for k in itertools.count(1):
        run = Run(name, 2)
        reached = interrupted(run.step, k)
        no_lock_left_held(run.opt)
        try:
            now = snapshot(run.opt)
        except ScalerProtocolError as error:
            assert TORN in str(error), f"line {k}: {error}"
            outcomes.add("refused")
            assert_refused_until_loaded(run.opt, run.step, tmp_path)
            for param, data in zip(run.opt.params, pre[0]):  # the parameters the state file does not hold
                param[...] = np.frombuffer(data, dtype=param.dtype).reshape(param.shape)
            run.opt.load(tmp_path / "pre")
            assert snapshot(run.opt) == pre, f"line {k}: load() did not restore the state"
            run.step()
            assert snapshot(run.opt) == post, f"line {k}: the step after load()"
        else:
            assert now in (pre, post), f"line {k}: a state that is neither the old one nor the new one"
            outcomes.add("old" if now == pre else "new")
            if now == pre:  # the step never happened: running it again gives the step's bits
                run.step()
                assert snapshot(run.opt) == post, f"line {k}: the step after an interrupted one"
        if not reached:
            break
    assert k > 100 and outcomes == {"old", "new", "refused"}


def test_a_save_interrupted_at_any_line_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    older = Run("adamw-float16", 1)
    older.opt.save(tmp_path / "state")
    old = (tmp_path / "state").read_bytes()
    run = Run("adamw-float16", 2)
    pre = snapshot(run.opt)
    run.opt.save(tmp_path / "new")
    new = (tmp_path / "new").read_bytes()
    outcomes = set()
    for k in itertools.count(1):
        (tmp_path / "state").write_bytes(old)
        reached = interrupted(lambda: run.opt.save(tmp_path / "state"), k)
        no_lock_left_held(run.opt)
        data = (tmp_path / "state").read_bytes()
        assert data in (old, new), f"line {k}: a partial file"
        outcomes.add(data == new)
        assert snapshot(run.opt) == pre, f"line {k}: saving changed the optimizer"
        if not reached:
            break
    assert k > 20 and outcomes == {False, True}


def test_a_load_interrupted_at_any_line_leaves_the_old_state_or_the_loaded_one_or_is_refused(tmp_path: Path) -> None:
    later = Run("adamw-float16", 3)
    later.opt.save(tmp_path / "later")
    loaded = snapshot(later.opt)
    pre = snapshot(Run("adamw-float16", 1).opt)
    outcomes = set()
    for k in itertools.count(1):
        run = Run("adamw-float16", 1)
        reached = interrupted(lambda: run.opt.load(tmp_path / "later"), k)  # noqa: B023 (called at once)
        no_lock_left_held(run.opt)
        try:
            now = snapshot(run.opt)
        except ScalerProtocolError as error:
            assert TORN in str(error), f"line {k}: {error}"
            outcomes.add("refused")
            assert_refused_until_loaded(run.opt, run.step, tmp_path)
        else:
            assert now in (pre, loaded), f"line {k}: a state that is neither the old one nor the loaded one"
            outcomes.add("old" if now == pre else "loaded")
        run.opt.load(tmp_path / "later")
        assert snapshot(run.opt) == loaded, f"line {k}: the load after an interrupted one"
        if not reached:
            break
    assert k > 50 and {"old", "loaded", "refused"} <= outcomes


def test_a_call_from_inside_a_running_one_on_the_same_thread_is_refused_instead_of_waiting_forever(
    tmp_path: Path,
) -> None:
    """What a save in a Ctrl-C handler does when the signal arrives during a step: a clear error, no deadlock."""
    after = Run("adamw-float16", 2)
    after.step()
    post = snapshot(after.opt)
    nested: list[str] = []
    for k in itertools.count(1):
        run = Run("adamw-float16", 2)

        def save_now() -> None:
            try:
                run.opt.save(tmp_path / "nested")  # noqa: B023 (called during this iteration)
                nested.append("saved")
            except ScalerProtocolError as error:
                assert REENTRY in str(error)
                nested.append("refused")

        reached: list[bool] = []
        thread = threading.Thread(target=lambda r=reached, s=run.step, k=k, a=save_now: r.append(interrupted(s, k, a)))
        thread.daemon = True
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"line {k}: the nested save waits forever for the step that called it"
        assert snapshot(run.opt) == post, f"line {k}: the step did not complete"
        if not reached[0]:
            break
    assert {"saved", "refused"} <= set(nested) and nested.count("refused") > 50


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a signal in a gc callback
def test_a_real_interrupt_anywhere_leaves_no_lock_held_for_the_save_in_the_except_clause() -> None:
    # Real signals land between any two bytecodes, where the traced sweep above does not look: inside a
    # Python context manager's __enter__, after its lock was taken. The save that the re-entry error
    # recommends (in an `except KeyboardInterrupt:` clause) must never find the lock held.
    opt = SGD([np.zeros(4, np.float32)], lr=0.1)
    interrupts, refused = saves_refused_after_real_interrupts(opt.state_dict)
    assert interrupts >= 200, f"only {interrupts} interrupts landed: the test saw too few to judge"
    assert refused == []


def interrupted_entering_exit(call: Callable[[], object], k: int) -> bool:
    """Run ``call()`` with a KeyboardInterrupt as its k-th Python-level ``__exit__`` starts (a real signal is
    handled there, as a function starts: the ``with`` block is over, its cleanup not yet done); return whether
    there was a k-th."""
    seen, reached = 0, False

    def calls(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen, reached
        if event == "call" and frame.f_code.co_name == "__exit__":
            seen += 1
            if seen == k:
                reached = True
                raise KeyboardInterrupt
        return None

    sys.settrace(calls)
    try:
        call()
    except KeyboardInterrupt:
        if not reached:
            raise
    finally:
        sys.settrace(None)
    return reached


def test_an_interrupt_as_any_python_exit_starts_never_holds_the_record_nor_applies_it_twice() -> None:
    # A Python context manager around the record's read (a generator, as before) can be stopped as its __exit__
    # starts: the record's lock stayed held (the next update() waited forever) and the read was never noted (a
    # retry applied the statistics a second time). After each such point, update() (from another thread, so
    # that a lock left held shows as a wait) goes through, and a retry applies once or is refused.
    for k in itertools.count(1):
        opt = SGD([np.zeros(4, np.float32)], lr=1.0)
        scaler = open_step(GradScaler(init_scale=1.0))
        grads = [np.ones(4, np.float32)]
        stats = scaler.check(grads)
        reached = interrupted_entering_exit(lambda: opt.step(grads, stats), k)  # noqa: B023
        with contextlib.suppress(ScalerProtocolError):
            opt.step(grads, stats)  # the careful retry
        assert opt._torn is not None or opt.step_count == 1, f"exit {k}: applied {opt.step_count} times"
        other = threading.Thread(target=scaler.update, daemon=True)
        other.start()
        other.join(10)
        assert not other.is_alive(), f"exit {k}: update() waits forever: the record's lock was left held"
        if not reached:
            break
