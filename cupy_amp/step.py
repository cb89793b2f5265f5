"""The step machine: the protocol of one optimizer step, written once for both scalers.

A step is ``scale_loss`` (once per loss), the backward pass, then either one
or more ``unscale_and_check`` calls on disjoint gradients or one ``check()``,
then ``update()``. :class:`Step` owns what every step shares, whichever face
drives it and wherever its state lives:

- the phase, one variable (:data:`IDLE`, :data:`SCALED`, :data:`UNSCALED`, :data:`INSPECTED`,
  :data:`UPDATING`);
- the call-order rules, among them that a step opens at ``scale_loss`` (unless the scale is fixed at 1:
  :func:`scale_fixed_at_one`);
- the lock that serializes a scaler's calls, and the refusal of a call made
  from inside one of its own calls;
- the step's claims on gradient memory, and its per-call records (kept in the lane the step runs on);
- the rule that a call which fails after it may have written counts as an overflow;
- exactly one join of the collective per call (:class:`Ballot`).

It drives states through the :class:`cupy_amp.state.State` protocol, one per device a face has
met (:class:`StateSet`), and never imports CuPy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np

from cupy_amp.ballot import JOINED, JOINING, NOT_JOINED, Ballot
from cupy_amp.call_lock import CallLock
from cupy_amp.claims import StepClaims
from cupy_amp.distributed import (
    AFTER,
    INSIDE,
    OTHERS,
    Communicator,
    holds_poison,
    log_failed_join,
    poisoned_error,
    send_poison,
)
from cupy_amp.errors import (
    ConfigError,
    CupyAmpError,
    RanksMayDisagreeError,
    ScalerProtocolError,
)
from cupy_amp.gradient_call import GradientScope
from cupy_amp.rule import ScalerConfig
from cupy_amp.state import Call, State
from cupy_amp.state_set import CallRecord, StateSet

__all__ = ["IDLE", "INSPECTED", "OPEN", "SCALED", "UNSCALED", "UPDATING", "Step", "scale_fixed_at_one"]

# Where a step stands: none open; the loss was scaled; gradients were unscaled; gradients were inspected by
# check() (read, not written: the fused optimizers unscale them). update() follows either of the last two.
IDLE, SCALED, UNSCALED, INSPECTED = "idle", "loss scaled", "gradients unscaled", "gradients inspected"
UPDATING = "update begun"  # an update() that did not finish: it may have applied the rule; only update() goes on
OPEN = (UNSCALED, INSPECTED, UPDATING)  # the phases of a step whose gradient part has opened

_STEP = (
    "Each optimizer step is: scale_loss(loss), backward, unscale_and_check(gradients) or check(gradients), the "
    "optimizer step if the gradients were finite, update()."
)


_REENTRY = (
    "The scaler was called from inside one of its own calls (a communicator's callback, a generator passed as "
    "gradients, a signal handler); wait for the call in progress to return."
)


class Step:
    """One scaler's step: its phase, lock and claims, and the rules every call follows."""

    __slots__ = ("_answered", "broken", "claims", "lock", "number", "phase", "poison_sender")

    def __init__(self) -> None:
        self.phase = IDLE
        self.number = 0  # counts the steps opened, so that an update() retried after an interrupt knows its step
        self.claims = StepClaims()
        self.broken: RanksMayDisagreeError | None = None  # once set, every later call raises it
        self.poison_sender: threading.Thread | None = None  # the thread that sent this rank's poisoned vote
        self.lock = CallLock()  # one call at a time (see admit)
        self._answered: GradientScope | None = None  # the running call's gradient scope, once its collective answered

    def refuse_if_broken(self) -> None:
        """Raise the poison error once the ranks may disagree (every call of a poisoned scaler does)."""
        if self.broken is not None:
            raise self.broken

    def poison(self, error: RanksMayDisagreeError) -> None:
        """Refuse every later call with ``error`` (one assignment: the first poison stays)."""
        if self.broken is None:
            self.broken = error

    def admit(self) -> threading.Lock:
        """Admit one call of the scaler and return the lock it holds while it runs.

        Every public call is ``with step.lock.turn, step.admit():``: other
        threads' calls wait at ``turn``; a call from inside a call on this
        thread (a communicator's callback, a generator passed as gradients, a
        signal handler) raises here, as does any call of a poisoned scaler.
        Both locks are entered and left in C, so no interrupt can leave one
        held (a Python context manager in between has a window after its lock
        is taken).
        """
        self.lock.refuse_reentry(_REENTRY)
        self.refuse_if_broken()
        return self.lock.busy

    @contextlib.contextmanager
    def accounting(self) -> Iterator[None]:
        """Scope a call that checks gradients, inside :meth:`admit`: if its check answered and the call then
        fails (its result lost, or ``scaler.step``'s optimizers stopped part way), :meth:`_lost_answer`."""
        self._answered = None
        try:
            yield
        except GeneratorExit:  # closed by the collector, maybe in a later call: see gradient_call
            raise
        except BaseException as error:
            if self._answered is not None:
                self._lost_answer(self._answered, error)
            raise

    def _lost_answer(self, scope: GradientScope, error: BaseException) -> None:
        """Poison a call that completed with the verdict "apply" but raised before returning it.

        The other ranks apply the step; this rank's caller got an exception
        instead of the go-ahead, or (``scaler.step``) its optimizers were
        stopped part way. The verdict is read again (a device read
        synchronizes; one that fails counts as "apply").
        """
        try:
            verdict = scope.state.read() if scope.state is not None else None
            applies = verdict is None or not (verdict.overflow or verdict.poisoned)
        except BaseException:
            applies = True
        if applies and self.broken is None and scope.ballot.communicator is not None:
            self._poison_own(scope.ballot.communicator)
            if scope.phase == INSPECTED:
                scope.states.skip_all()  # this rank's record says "skip" (a graph replaying its optimizer alone)

    # Call-order rules: each raises before anything changed.

    def _refuse_while_updating(self, what: str) -> None:
        """Refuse ``what`` after an ``update()`` that did not finish: only ``update()`` may go on from there."""
        if self.phase == UPDATING:
            raise ScalerProtocolError(
                f"{what} was called after an update() that did not finish (it was interrupted or failed): it may "
                "have applied this step's rule already, and the step's gradients were read with the step's scale. "
                "Call update() again to end the step; it applies the rule once."
            )

    def refuse_scale_loss(self) -> None:
        """Refuse ``scale_loss`` once the step's gradients were unscaled or inspected (update() was forgotten)."""
        self._refuse_while_updating("scale_loss()")
        if self.phase in (UNSCALED, INSPECTED):
            raise ScalerProtocolError(
                "scale_loss() was called after this step's gradients were unscaled or checked, without an update() "
                f"in between: update() was forgotten. {_STEP} Without update() the scale never adapts."
            )

    def abandon(self) -> None:
        """End a step that has a scaled loss and nothing else (its backward pass failed); nothing else changes."""
        self._refuse_while_updating("abandon_step()")
        if self.phase in (UNSCALED, INSPECTED):
            raise ScalerProtocolError(
                f"abandon_step() was called after this step's gradients were {self.phase[len('gradients ') :]}: "
                "the step has a verdict to apply. Call update(), which ends it (skipped if any gradient held "
                "inf/nan, or if a gradient call failed)."
            )
        self.phase = IDLE  # SCALED changed nothing else: the last step's records and verdict stand

    def scaled(self) -> None:
        """Enter the phase of a scaled loss (after :meth:`refuse_scale_loss`)."""
        self.phase = SCALED

    def refuse_gradient_call(self, phase: str, config: ScalerConfig) -> None:
        """Refuse a gradient call of kind ``phase`` (UNSCALED or INSPECTED) where this step cannot take it.

        A step opens at ``scale_loss``: a gradient call with no ``scale_loss`` before it in the step is
        refused, unless ``config`` fixes the scale at 1 (:func:`scale_fixed_at_one`), where an unscaled loss
        seeds the same backward pass as a scaled one.
        """
        name = "unscale_and_check()" if phase == UNSCALED else "check()"
        self._refuse_while_updating(name)
        if self.phase == IDLE and not scale_fixed_at_one(config):
            raise ScalerProtocolError(
                f"{name} was called in a step that had no scale_loss(): call scaler.scale_loss(loss) before the "
                "backward pass, so that the backward pass is seeded with the scale. Gradients of a backward pass "
                "not seeded with it would come back scale times too small (1.5e-5 times their value at the "
                "default scale 65536). Where backward() seeds itself with ones (Chainer), scale the seed: "
                "loss.grad = xp.ones_like(loss.array); scaler.scale_loss(loss.grad); loss.backward(). A scaler "
                "whose scale is fixed at 1 (guard(), a disabled GradScaler) needs no scale_loss()."
            )
        if self.phase == INSPECTED and phase == UNSCALED:
            raise ScalerProtocolError(
                "unscale_and_check() was called after check() in the same step: check() already read this step's "
                "gradients (the fused optimizers unscale them); call update() to end the step."
            )
        if phase == INSPECTED and self.phase in (UNSCALED, INSPECTED):
            raise ScalerProtocolError(
                "check() was called after this step's gradients were already checked or unscaled: check() reads "
                "all of a step's gradients in one call (its norm covers them all), and is the step's only gradient "
                "call. To step several optimizers from one scaler (scaler.step(optimizer, gradients) twice, as for a "
                "GAN or a multi-task model), pass them together: scaler.step([optimizer0, optimizer1], [grads0, "
                "grads1], max_norm=...), one check over all their gradients, each optimizer applying it to its "
                "own; then scaler.update() once."
            )

    def require_gradients(self) -> None:
        """Refuse ``update()`` when no gradient call came since the last ``update()``."""
        if self.phase not in OPEN:
            raise ScalerProtocolError(
                f"update() was called without an unscale_and_check() or check() since the previous update(). {_STEP} "
                "With gradient accumulation, check the gradients and call update() once per optimizer step, after "
                "the last micro-batch, not once per micro-batch."
            )

    def require_idle(self, what: str) -> None:
        """Refuse ``what`` while a step is open."""
        if self.phase != IDLE:
            done = {SCALED: "scale_loss() was called", UPDATING: "an update() did not finish"}.get(
                self.phase, "unscale_and_check() or check() was called"
            )
            raise ScalerProtocolError(
                f"{what} in the middle of a step ({done} and update() was not yet): the step's loss "
                f"and gradients use the current scale. Call it before scale_loss() or after update()"
                + (" (after a failed backward pass, abandon_step() drops the step)." if self.phase == SCALED else ".")
            )

    # The gradient calls.

    @contextlib.contextmanager
    def gradient_call(self, phase: str, states: StateSet, communicator: Communicator | None) -> Iterator[GradientScope]:
        """Scope one gradient call: the face validates, opens, runs and records inside it; a failure is accounted for.

        A call refused by the call-order rules (:meth:`refuse_gradient_call`:
        no ``scale_loss`` in the step, ``check()`` after another gradient
        call) changes nothing and joins nothing, on every rank alike; a refused
        configuration (``ConfigError``) likewise. Any other failure, by where
        it stopped the call:

        - before the call joined its collective: the step counts as this rank's
          overflow (a call that fails once it may have written counts as one)
          and, with a communicator, the call joins as an overflowed rank so
          that nobody waits for it;
        - after it joined: the collective's answer is in hand (in device memory,
          or the host's pair), so the call finishes from it. An overflow
          verdict is the one every rank has: every rank skips. A verdict
          "apply" means the other ranks apply this step while this call's
          caller got an exception instead of the go-ahead: the ranks may
          disagree, so the scaler is poisoned (:meth:`poison`);
        - inside the collective (this rank cannot know whether it took part, nor
          what the others decided): the scaler is poisoned.

        A scaler poisoned by its own failure sends the poisoned vote once, so
        that the other ranks refuse too, from the collective they wait in or
        from their next one.

        Every failure of a ``check()`` leaves every statistics record saying "skip".
        """
        self.refuse_gradient_call(phase, states.config)
        scope = GradientScope(phase, states, Ballot(communicator))
        try:
            yield scope
        except GeneratorExit:
            # Closed by the collector: an interrupt inside contextlib's __exit__ kept the ``with`` from ending
            # here. The scaler may be in a later step by now: accounting would rewrite that one.
            raise
        except ConfigError:
            if scope.opened or scope.ballot.stage != NOT_JOINED:  # after the call started: a failure like any
                self._account(scope, RuntimeError("a configuration error after the call started"))
            raise  # refused before it started: alike on every rank, and nothing changed
        except BaseException as error:
            self._account(scope, error)
            raise

    def open_call(self, scope: GradientScope, call: Call, state: State) -> None:
        """Commit a validated call: claim its memory (an unscale) and open the step's gradient part if it is not.

        Raises:
            DuplicateGradientError: The call would unscale memory an earlier call of the step unscaled.
        """
        claims = self.claims if self.phase == UNSCALED else StepClaims()
        if scope.phase == UNSCALED:
            claims = scope.states.claim(claims, call)  # new claims: committed below, where a failure counts
        scope.call, scope.state, scope.opened = call, state, True
        if self.phase != scope.phase:
            self._open(scope.phase, scope.states, claims)
        else:
            self.claims = claims
        scope.number = len(scope.states.records)

    def record_call(self, scope: GradientScope, culprits: tuple[int, ...] | None) -> None:
        """Keep the call's record (its labels, tables, state and culprits): the call's commit, made once.

        From here a failure before the call returns is a lost result (:meth:`call` accounts for it).
        """
        scope.culprits = culprits
        states = scope.states
        if scope.call is not None and not scope.recorded:
            record = CallRecord(scope.call.labels, scope.call.plan, scope.state, culprits)
            states.records, scope.recorded = (*states.records, record), True  # one statement: kept once
        scope.recorded = True
        if scope.ballot.stage == JOINED:
            self._answered = scope

    def _account(self, scope: GradientScope, error: BaseException) -> None:
        """Account for a gradient call that ``error`` stopped, by how far it got (see :meth:`gradient_call`).

        Each part runs even if one before it raises: the step ends up open and counted as decided, the records
        say "skip" unless the call's answer decided otherwise, and the collective is joined (or the poison
        sent) as the call stood.
        """
        stage = scope.ballot.stage
        if isinstance(error, RanksMayDisagreeError):
            self.poison(error)  # the others' poisoned vote: every rank read it from the same collective
        elif stage == JOINING:
            self.poison(poisoned_error(INSIDE))
        try:
            if not (stage == JOINED and scope.opened and self._finish_from_answer(scope)):
                if scope.opened or scope.ballot.communicator is not None:
                    self._fail(scope)
                elif scope.phase == INSPECTED:
                    scope.states.skip_all()
            elif scope.phase == INSPECTED:
                scope.states.skip_all()  # a check that failed leaves "skip", whatever its answer said
        finally:
            self._join_after_failure(scope, stage, error)

    def _finish_from_answer(self, scope: GradientScope) -> bool:
        """Finish a call that failed after its collective answered; return False if the answer was refused.

        The answer is in hand (device memory, or the host's pair), so the verdict is the one every rank takes
        from it, and the call is recorded. An overflow: every rank skips, and so does this one. "Apply": the
        others apply a step this call's caller never got the go-ahead for; :meth:`call` poisons the scaler for
        it, as for any recorded call that does not return. A verdict this rank cannot read any more leaves it
        unable to know: poisoned.
        """
        state = scope.state
        assert state is not None  # an opened call has its state
        try:
            if not scope.finished:
                state.finish_vote(scope.phase == INSPECTED, scope.max_norm)
            verdict = state.read()
            scope.states.found(verdict.overflow, verdict.local)
            self.record_call(scope, scope.culprits)
        except CupyAmpError as refused:
            if isinstance(refused, RanksMayDisagreeError):
                self.poison(refused)
            return False  # the answer was refused alike on every rank: an overflow, accounted for by the caller
        except BaseException:
            self.poison(poisoned_error(AFTER))  # the others finish the step from the answer; this rank cannot
            return True
        if verdict.poisoned:
            self.poison(poisoned_error(OTHERS))
        return True  # kept as the call's record: a verdict "apply" the caller never got is poisoned by call()

    def _join_after_failure(self, scope: GradientScope, stage: str, error: BaseException) -> None:
        """Join the collective as an overflowed rank if the call never did; if it poisoned the scaler itself,
        send the poisoned vote instead.

        The poisoned vote is sent once, from the host: it completes the collective the other ranks wait in, if
        this rank never joined it, or else their next one; either way every other rank learns of it.
        """
        communicator = scope.ballot.communicator
        if communicator is None:
            return
        if self.broken is not None and self.broken.own:
            self.poison_sender = send_poison(communicator)
            return
        if stage != NOT_JOINED:
            return
        values = np.array([1.0, 0.0], dtype=np.float64)
        try:
            scope.ballot.sum(values, None)
        except BaseException as join_error:
            if scope.ballot.stage == JOINING:  # the join after the failure is itself of unknown outcome
                self.poison(poisoned_error(INSIDE))
                self.poison_sender = send_poison(communicator)
            log_failed_join(error, join_error)
            return
        if holds_poison(float(values[0])):  # another rank's poisoned vote: this rank refuses too
            self.poison(poisoned_error(OTHERS))

    def _poison_own(self, communicator: Communicator) -> None:
        """Poison the scaler for a failure after the ranks agreed to apply, and tell the other ranks."""
        self.poison(poisoned_error(AFTER))
        self.poison_sender = send_poison(communicator)

    def _open(self, phase: str, states: StateSet, claims: StepClaims) -> None:
        """Open the gradient part of the step: forget the last step's verdict; the phase changes last."""
        self.number += 1  # first: a step whose opening failed part way is still a new step
        states.begin()
        states.records, self.claims = (), claims
        self.phase = phase

    def _fail(self, scope: GradientScope) -> None:
        """Count a failed call as this rank's overflow of the step, opening the step if it was not.

        Each part is done even if one before it raises (a broken device): the
        step is open, counts as an overflow on the host, and says "skip". An
        opening cut short (the call's own, then this one's) is tried once more,
        so the states begin the step; if that fails too, the step opens on the
        host alone.
        """
        try:
            try:
                if self.phase != scope.phase:
                    self._open(scope.phase, scope.states, StepClaims())
            finally:
                if self.phase != scope.phase:
                    self._open(scope.phase, scope.states, StepClaims())
        finally:
            states = scope.states
            if self.phase != scope.phase:  # in one statement, as _open would (a number may be skipped)
                self.number, self.phase, states.records, self.claims = self.number + 1, scope.phase, (), StepClaims()
            try:
                if not scope.recorded:
                    call = scope.call
                    labels, plan = (call.labels, call.plan) if call is not None else ((), None)
                    record = CallRecord(labels, plan, scope.state, scope.culprits)
                    states.records, scope.recorded = (*states.records, record), True  # one statement: kept once
                scope.states.mark_overflow(scope.state)
            finally:
                if scope.phase == INSPECTED:
                    scope.states.skip_all()

    def updating(self) -> None:
        """Enter the phase of a begun ``update()`` (after :meth:`require_gradients`), before it changes anything."""
        self.phase = UPDATING

    def close(self) -> None:
        """End the step (after ``update()`` applied the rule), in one assignment."""
        empty = StepClaims()
        self.claims, self.phase = empty, IDLE


def scale_fixed_at_one(config: ScalerConfig) -> bool:
    """Return whether ``config`` fixes the scale at 1, so that a step needs no ``scale_loss``.

    That is ``min_scale == max_scale == 1``: the scale always lies inside the clamps, so it is 1 and
    never moves. Guard scalers (``guard()``) and a disabled ``GradScaler`` (whose steps run on such a
    configuration) are these; ``min_scale=None, max_scale=1`` is not (a backoff takes the scale below 1).
    Reads the configuration only (never the state, which may be on a device).
    """
    return config.min_scale == 1.0 and config.max_scale == 1.0
