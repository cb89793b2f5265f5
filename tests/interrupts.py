"""A KeyboardInterrupt (or any action) at the k-th line that runs inside cupy_amp during one call.

A ``sys.settrace`` hook counts the line events of cupy_amp's own frames and
acts at the k-th. Lines where no signal is ever delivered are not counted: the
bare ``try:``/``else:``/``finally:`` lines, and the events CPython gives a
``with`` line when its block ends, just before each context manager's
``__exit__`` (a trace function raising there is an artifact of tracing: it can
skip the managers' exits, which no signal can).
"""

from __future__ import annotations

import functools
import linecache
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import cupy_amp

__all__ = ["interrupted", "interrupted_twice", "saves_refused_after_real_interrupts"]

PACKAGE = os.path.dirname(os.path.realpath(cupy_amp.__file__)) + os.sep  # the sources, past an editable install's links
_BARE = ("try:", "else:", "finally:")


@functools.cache
def _inside(filename: str) -> bool:
    return os.path.realpath(filename).startswith(PACKAGE)


def interrupted(
    call: Callable[[], object], k: int, action: Callable[[], None] | None = None, also: tuple[str, ...] = ()
) -> bool:
    """Run ``call()``; at the k-th counted line inside cupy_amp, run ``action`` or raise KeyboardInterrupt.

    ``also``: files (paths) whose lines count too, such as the Chainer code a step runs between ours.
    Returns whether that line was reached (False: the call ran through with fewer lines).
    """
    counted = frozenset(os.path.realpath(path) for path in also)
    seen = 0
    reached = False
    last_line: dict[Any, int] = {}  # frame -> the line of its last line event

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen, reached
        if event != "line":
            return line
        previous, last_line[frame] = last_line.get(frame, -1), frame.f_lineno
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if text in _BARE:
            return line
        if text.startswith("with ") and previous >= frame.f_lineno:
            # The block's end, before a context manager's __exit__: one event per manager when the block
            # raised (three for `with a, b, c:`), one in all when it did not. A statement on one line is
            # entered from a line above it (the line before it, or a loop's header); a header over several
            # lines also gets an event after its later lines, skipped here, where its managers are not yet
            # entered (cupy_amp has one, an np.errstate).
            return line
        seen += 1
        if seen == k:
            reached = True
            if action is None:
                raise KeyboardInterrupt  # a trace function that raises is removed: one interrupt per call
            action()
        return line

    def calls(frame: Any, event: str, arg: Any) -> Any:
        filename = frame.f_code.co_filename
        return line if _inside(filename) or (counted and os.path.realpath(filename) in counted) else None

    previous, errors = sys.gettrace(), np.geterr()
    sys.settrace(calls)
    try:
        call()
    except KeyboardInterrupt:
        if not reached:
            raise
    finally:
        sys.settrace(previous)
        np.seterr(**errors)  # an interrupted `with np.errstate(...)` would leave its settings behind
    return reached


def interrupted_twice(
    patch: Any,
    owner: type,
    method: str,
    setup: Callable[[], tuple[Any, Callable[[], object]]],
    check: Callable[[Any, str], None],
) -> tuple[int, int]:
    """Interrupt a call at its k-th line, and again at the j-th line of ``owner.method`` run after it, for
    every k and j; return (the call's lines + 1, the second interrupts that landed).

    ``setup()`` returns (an object, the call); after both interrupts, ``check(object, where)`` runs with
    ``owner.method`` as it was (the user's retry and the asserts). ``patch`` is pytest's monkeypatch. The
    second interrupt goes on out of the call, as a real one would.
    """
    original = getattr(owner, method)
    second = {"line": 0, "landed": False}

    def cut(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not second["line"]:
            return original(self, *args, **kwargs)
        result: list[Any] = []
        if interrupted(lambda: result.append(original(self, *args, **kwargs)), second["line"]):
            second["landed"] = True
            raise KeyboardInterrupt
        return result[0]  # ran through: what the method returned

    patch.setattr(owner, method, cut)
    k, seconds = 1, 0
    while True:
        second["line"] = 0
        while True:
            second["landed"] = False
            subject, call = setup()
            first_landed = interrupted(call, k)
            if not first_landed or (second["line"] and not second["landed"]):
                break  # past the call's last line, or past the method's (or no second call at this line)
            seconds += bool(second["landed"])
            with patch.context() as plain:
                plain.setattr(owner, method, original)
                check(subject, f"line {k}, {method} line {second['line']}")
            second["line"] += 1
        if not first_landed:
            return k, seconds
        k += 1


def saves_refused_after_real_interrupts(save: Callable[[], object], seconds: float = 3.0) -> tuple[int, list[str]]:
    """Call ``save()`` in a loop while real SIGALRM signals raise KeyboardInterrupt at random points; after each
    interrupt call it once more, as in an ``except KeyboardInterrupt:`` clause. Return (interrupts, the messages
    of the ScalerProtocolErrors those calls raised).

    Real signals land between any two bytecodes, where the traced sweeps do not look: inside a Python context
    manager's ``__enter__`` after its lock was taken, for one.
    """
    from cupy_amp.errors import ScalerProtocolError

    armed = False

    def handler(signum: int, frame: Any) -> None:
        if armed:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, handler)
    interrupts, refused = 0, []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                armed = True
                signal.setitimer(signal.ITIMER_REAL, 0.0002)
                for _ in range(1_000_000):  # until the signal lands: a fast save() (a few µs) must not outrun it
                    save()
                armed = False
            except KeyboardInterrupt:
                armed = False
                interrupts += 1
                try:
                    save()
                except ScalerProtocolError as error:
                    refused.append(str(error))
            finally:
                armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return interrupts, refused
