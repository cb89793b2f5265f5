"""A KeyboardInterrupt (or any action) at the k-th line that runs inside cupy_amp during one call.

A ``sys.settrace`` hook counts the line events of cupy_amp's own frames and
acts at the k-th. Lines where no signal is ever delivered are not counted: the
bare ``try:``/``else:``/``finally:`` lines, and the second event CPython gives
a ``with`` line when its block ends, just before the context manager's C
``__exit__`` (a trace function raising there is an artifact of tracing).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import cupy_amp

__all__ = ["interrupted"]

PACKAGE = os.path.realpath(os.path.dirname(cupy_amp.__file__)) + os.sep
_BARE = ("try:", "else:", "finally:")


@functools.cache
def _inside(filename: str) -> bool:
    return os.path.realpath(filename).startswith(PACKAGE)


def interrupted(call: Callable[[], object], k: int, action: Callable[[], None] | None = None) -> bool:
    """Run ``call()``; at the k-th counted line inside cupy_amp, run ``action`` or raise KeyboardInterrupt.

    Returns whether that line was reached (False: the call ran through with fewer lines).
    """
    seen = 0
    reached = False
    with_visits: dict[tuple[Any, int], int] = {}  # (frame, line) -> events so far, for `with` lines

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen, reached
        if event != "line":
            return line
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if text in _BARE:
            return line
        if text.startswith("with "):
            key = (frame, frame.f_lineno)
            with_visits[key] = with_visits.get(key, 0) + 1
            if with_visits[key] % 2 == 0:  # the block's end, before __exit__
                return line
        seen += 1
        if seen == k:
            reached = True
            if action is None:
                raise KeyboardInterrupt  # a trace function that raises is removed: one interrupt per call
            action()
        return line

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return line if _inside(frame.f_code.co_filename) else None

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
