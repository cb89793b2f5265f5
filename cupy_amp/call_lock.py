"""One call at a time on one object: the scaler's and each optimizer's lock.

Other threads wait their turn. The same thread calling in again (from a signal
handler, a communicator's callback, a generator passed as an argument) would
wait for itself forever or interleave two calls: that raises instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from cupy_amp.errors import ScalerProtocolError

__all__ = ["CallLock"]


class CallLock:
    """Serializes the calls of one object and refuses a call from inside another on the same thread.

    Both locks are the ``with`` statements' own, acquired and released in C,
    and no other state is kept: no interrupt can leave it held or
    believing a call runs.
    """

    __slots__ = ("_busy", "_turn")

    def __init__(self) -> None:
        self._turn = threading.RLock()  # other threads wait here; this thread passes, to be refused by _busy
        self._busy = threading.Lock()  # held while a call runs

    @contextlib.contextmanager
    def held(self, reentry: str) -> Iterator[None]:
        """Hold the lock for one call.

        Raises:
            ScalerProtocolError: With the message ``reentry``, when this thread is already inside a call.
        """
        with self._turn:
            if self._busy.locked():  # only the thread holding _turn gets here: its own outer call holds _busy
                raise ScalerProtocolError(reentry)
            with self._busy:
                yield
