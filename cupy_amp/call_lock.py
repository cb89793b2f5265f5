"""One call at a time on one object: the scaler's and each optimizer's lock.

Other threads wait their turn. The same thread calling in again (from a signal
handler, a communicator's callback, a generator passed as an argument) would
wait for itself forever or interleave two calls: that raises instead.

Written at each call site as two ``with`` statements on the locks themselves::

    with lock.turn:
        lock.refuse_reentry(message)
        with lock.busy:
            ...

The locks' ``__enter__``/``__exit__`` run in C, so no interrupt can leave one
held: a Python context manager in between (a generator, a class) would have
a window after the lock is taken and before the block is entered.
"""

from __future__ import annotations

import threading

from cupy_amp.errors import ScalerProtocolError

__all__ = ["CallLock"]


class CallLock:
    """Serializes the calls of one object and refuses a call from inside another on the same thread.

    Attributes:
        turn: Reentrant: other threads wait here; this thread passes, to be refused by :meth:`refuse_reentry`.
        busy: Held while a call runs.
    """

    __slots__ = ("busy", "turn")

    def __init__(self) -> None:
        self.turn = threading.RLock()
        self.busy = threading.Lock()

    def refuse_reentry(self, message: str) -> None:
        """Raise ``ScalerProtocolError(message)`` if this thread, holding :attr:`turn`, is already inside a call.

        Only the thread holding ``turn`` gets here, so ``busy`` held means its own outer call holds it.
        """
        if self.busy.locked():
            raise ScalerProtocolError(message)
