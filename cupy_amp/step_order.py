"""The order of a step's calls, which both scalers enforce, and the lock that serializes their calls.

A step is ``scale_loss`` (optional, once per loss), one or more
``unscale_and_check`` calls, then ``update()``. A step is open from its first
call to ``update()``: its loss and gradients use the scale of that moment, so
nothing may change the scale or the configuration in between.
"""

from __future__ import annotations

import threading

from cupy_amp.errors import ScalerProtocolError

__all__ = ["CHECKED", "IDLE", "SCALED", "StepOrder", "refuse_after_check", "refuse_second_check"]

# Where a step stands: no step open; the loss was scaled; gradients were unscaled (update() is next).
IDLE, SCALED, CHECKED = "idle", "scaled", "checked"

_STEP = (
    "Each optimizer step is: scale_loss(loss), backward, unscale_and_check(gradients), the optimizer step "
    "if the gradients were finite, update()."
)


class StepOrder:
    """A scaler's step phase, the call-order rules, and the lock its changing calls hold (``with order:``).

    A thread waits for another thread's call to end. The same thread calling
    in again (from a communicator's callback, a generator passed as gradients,
    a signal handler) would otherwise deadlock or interleave two calls' steps:
    that raises instead. Reads of the scaler take no lock: they read immutable
    values.
    """

    __slots__ = ("_busy", "_lock", "phase")

    def __init__(self) -> None:
        self.phase = IDLE
        self._lock = threading.RLock()
        self._busy = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._busy:
            self._lock.release()
            raise ScalerProtocolError(
                "The scaler was called from inside one of its own calls (a communicator's callback, a generator "
                "passed as gradients, a signal handler); wait for the call in progress to return."
            )
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False
        self._lock.release()

    def scale_loss(self) -> None:
        """Enter the phase of a scaled loss, refusing it after unscale_and_check (update() was forgotten)."""
        self.check_scale_loss()
        self.phase = SCALED

    def check_scale_loss(self) -> None:
        """Refuse scale_loss() after unscale_and_check() without update() (changes nothing)."""
        if self.phase == CHECKED:
            raise ScalerProtocolError(
                "scale_loss() was called after unscale_and_check() without an update() in between: update() "
                f"was forgotten. {_STEP} Without update() the scale never adapts."
            )

    def require_checked(self) -> None:
        """Refuse update() when no unscale_and_check() came since the last update()."""
        if self.phase != CHECKED:
            raise ScalerProtocolError(
                f"update() was called without an unscale_and_check() since the previous update(). {_STEP} With "
                "gradient accumulation, call unscale_and_check() and update() once per optimizer step, after the "
                "last micro-batch, not once per micro-batch."
            )

    def require_no_step(self, what: str) -> None:
        """Refuse ``what`` while a step is open."""
        if self.phase != IDLE:
            done = "scale_loss()" if self.phase == SCALED else "unscale_and_check()"
            raise ScalerProtocolError(
                f"{what} in the middle of a step ({done} was called and update() was not yet): the step's loss "
                f"and gradients use the current scale. Call it before scale_loss() or after update()."
            )


def refuse_second_check(gradients_seen: bool) -> None:
    """Refuse ``check()`` when the step's gradients were already checked or unscaled.

    The norm covers the gradients of one call, so ``check()`` is a step's only gradient call.
    """
    if gradients_seen:
        raise ScalerProtocolError(
            "check() was called after this step's gradients were already checked or unscaled: check() reads all "
            "of a step's gradients in one call (its norm covers them all), and is the step's only gradient call."
        )


def refuse_after_check(checked_read_only: bool) -> None:
    """Refuse ``unscale_and_check()`` in a step whose gradients went through ``check()``."""
    if checked_read_only:
        raise ScalerProtocolError(
            "unscale_and_check() was called after check() in the same step: check() already read this step's "
            "gradients (the fused optimizers unscale them); call update() to end the step."
        )
