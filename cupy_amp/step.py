"""The step machine: the protocol of one optimizer step, written once for both scalers.

A step is ``scale_loss`` (once per loss), the backward pass, then either one
or more ``unscale_and_check`` calls on disjoint gradients or one ``check()``,
then ``update()``. :class:`Step` owns what every step shares, whichever face
drives it and wherever its state lives:

- the phase, one variable (:data:`IDLE`, :data:`SCALED`, :data:`UNSCALED`, :data:`INSPECTED`);
- the call-order rules, among them that a step opens at ``scale_loss`` (unless the scale is fixed at 1:
  :func:`scale_fixed_at_one`);
- the lock that serializes a scaler's calls, and the refusal of a call made
  from inside one of its own calls;
- the step's claims on gradient memory and its per-call records;
- the rule that a call which fails after it may have written counts as an overflow;
- exactly one join of the collective per call (:class:`Ballot`).

It drives states through the :class:`cupy_amp.state.State` protocol, one per device a face has
met (:class:`StateSet`), and never imports CuPy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.claims import StepClaims
from cupy_amp.distributed import OverflowVote
from cupy_amp.errors import ConfigError, GradientTypeError, GradientValueError, ScalerProtocolError
from cupy_amp.gradients import Call
from cupy_amp.rule import ScalerConfig, ScalerState
from cupy_amp.state import Backend, Snapshot, State

__all__ = [
    "IDLE",
    "INSPECTED",
    "SCALED",
    "UNSCALED",
    "Ballot",
    "CallRecord",
    "StateSet",
    "Step",
    "check_call",
    "scale_fixed_at_one",
    "unscale_call",
    "where",
]

T = TypeVar("T")

# Where a step stands: none open; the loss was scaled; gradients were unscaled; gradients were inspected by
# check() (read, not written: the fused optimizers unscale them). update() follows either of the last two.
IDLE, SCALED, UNSCALED, INSPECTED = "idle", "loss scaled", "gradients unscaled", "gradients inspected"

_STEP = (
    "Each optimizer step is: scale_loss(loss), backward, unscale_and_check(gradients) or check(gradients), the "
    "optimizer step if the gradients were finite, update()."
)


class CallRecord(NamedTuple):
    """One gradient call of a step, kept to answer ``nonfinite_gradients`` (it holds no array)."""

    labels: tuple[Hashable, ...]  # empty for a call that failed before its arrays were known
    plan: Any  # the call's device tables, where the per-gradient flags are
    state: State | None  # where its verdict is
    culprits: tuple[int, ...] | None  # positions known on the host; None: read from the state when asked


class Ballot:
    """One call's part in the collective: the call's communicator, joined at most once.

    Every collective of a call goes through the ballot, which stands for the
    communicator (an :class:`~cupy_amp.distributed.OverflowVote` with
    ``reduce_sum``). ``joined`` is stored in the same statement in which the
    communicator returns, so an interrupt anywhere in the code around it (the
    state's launch, the host's reading of the answer) can neither hide a join
    that happened nor let the call join again. A communicator that raises took
    no part (NCCL's contract).
    """

    __slots__ = ("joined", "vote")

    def __init__(self, vote: OverflowVote | None) -> None:
        self.vote = vote
        self.joined = vote is None  # without a communicator there is nothing to join

    def _communicator(self) -> Any:
        if self.joined or self.vote is None:
            raise ScalerProtocolError("A gradient call tried to join a second collective")  # an internal rule
        return self.vote

    def reduce_max(self, flags: Any, stream: Any) -> None:
        vote = self._communicator()
        self.joined = (vote.reduce_max(flags, stream), True)[1]

    def reduce_sum(self, values: Any, stream: Any) -> None:
        vote = self._communicator()
        self.joined = (vote.reduce_sum(values, stream), True)[1]

    def host_vote(self, local_overflow: bool) -> bool:
        vote = self._communicator()
        answer, self.joined = vote.host_vote(local_overflow), True
        return answer  # type: ignore[no-any-return]

    def join_after_failure(self, error: BaseException, collective: Callable[[Any, BaseException], None]) -> None:
        """Join as an overflowed rank if this call has not joined yet, so the other ranks do not hang."""
        if not self.joined:
            collective(self, error)


class Step:
    """One scaler's step: its phase, lock, claims and records, and the rules every call follows."""

    __slots__ = ("_lock", "_owner", "claims", "number", "phase", "records")

    def __init__(self) -> None:
        self.phase = IDLE
        self.number = 0  # counts the steps opened, so that an update() retried after an interrupt knows its step
        self.claims = StepClaims()
        self.records: tuple[CallRecord, ...] = ()  # replaced, never changed in place: readers need no lock
        self._lock = threading.Lock()
        self._owner: int | None = None

    def run(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` under the scaler's lock; a thread waits for another thread's call.

        The same thread calling in again (from a communicator's callback, a
        generator passed as gradients, a signal handler) would deadlock or
        interleave two calls' steps: that raises instead. The lock is the
        ``with`` statement's own (acquired and released in C), so no interrupt
        can leave it held; a stale owner is harmless, since it is only read
        while the lock is held.
        """
        me = threading.get_ident()
        if self._owner == me and self._lock.locked():
            raise ScalerProtocolError(
                "The scaler was called from inside one of its own calls (a communicator's callback, a generator "
                "passed as gradients, a signal handler); wait for the call in progress to return."
            )
        with self._lock:
            self._owner = me
            try:
                return operation()
            finally:
                self._owner = None

    # Call-order rules: each raises before anything changed.

    def refuse_scale_loss(self) -> None:
        """Refuse ``scale_loss`` once the step's gradients were unscaled or inspected (update() was forgotten)."""
        if self.phase in (UNSCALED, INSPECTED):
            raise ScalerProtocolError(
                "scale_loss() was called after this step's gradients were unscaled or checked, without an update() "
                f"in between: update() was forgotten. {_STEP} Without update() the scale never adapts."
            )

    def scaled(self) -> None:
        """Enter the phase of a scaled loss (after :meth:`refuse_scale_loss`)."""
        self.phase = SCALED

    def refuse_gradient_call(self, phase: str, config: ScalerConfig) -> None:
        """Refuse a gradient call of kind ``phase`` (UNSCALED or INSPECTED) where this step cannot take it.

        A step opens at ``scale_loss``: a gradient call with no ``scale_loss`` before it in the step is
        refused, unless ``config`` fixes the scale at 1 (:func:`scale_fixed_at_one`), where an unscaled loss
        seeds the same backward pass as a scaled one.
        """
        if self.phase == IDLE and not scale_fixed_at_one(config):
            name = "unscale_and_check()" if phase == UNSCALED else "check()"
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
                "GAN or a multi-task model), check all their gradients in one call and give each optimizer its "
                "share: stats = scaler.check(grads0 + grads1, max_norm=...); optimizer0.step(grads0, stats); "
                "optimizer1.step(grads1, stats); then scaler.update() once."
            )

    def require_gradients(self) -> None:
        """Refuse ``update()`` when no gradient call came since the last ``update()``."""
        if self.phase not in (UNSCALED, INSPECTED):
            raise ScalerProtocolError(
                f"update() was called without an unscale_and_check() or check() since the previous update(). {_STEP} "
                "With gradient accumulation, check the gradients and call update() once per optimizer step, after "
                "the last micro-batch, not once per micro-batch."
            )

    def require_idle(self, what: str) -> None:
        """Refuse ``what`` while a step is open."""
        if self.phase != IDLE:
            done = "scale_loss()" if self.phase == SCALED else "unscale_and_check() or check()"
            raise ScalerProtocolError(
                f"{what} in the middle of a step ({done} was called and update() was not yet): the step's loss "
                f"and gradients use the current scale. Call it before scale_loss() or after update()."
            )

    # The gradient calls.

    def gradient_call(
        self,
        phase: str,
        states: StateSet,
        ballot: Ballot,
        parse: Callable[[], tuple[Call, State]],
        run: Callable[[Call, State, Ballot], tuple[int, ...] | None],
        join_after_failure: Callable[[OverflowVote, BaseException], None],
    ) -> tuple[Call, State]:
        """Run one gradient call: validate, claim, open the step, run, record; any failure is accounted for.

        A call refused by the call-order rules (:meth:`refuse_gradient_call`:
        no ``scale_loss`` in the step, ``check()`` after another gradient
        call) changes nothing and joins nothing, with a communicator too:
        every rank refuses it alike. A call refused while validating its
        arguments changes nothing and joins nothing without a communicator;
        with one, the other ranks wait in its collective, so it counts as an
        overflow and joins as one. A call that fails once it may have
        written counts as an overflow and joins (once) if it had not. Every
        failure of a ``check()`` leaves every statistics record saying
        "skip". A refused configuration (``ConfigError``) is refused alike on
        every rank: nobody joins.
        """
        # Call-order refusals come first and join nothing, with a communicator too (as a ConfigError): every
        # rank makes the same calls in the same order, so every rank refuses the same call and none waits in
        # its collective. Joining as an overflow would count a skip and back off the scale for a step that
        # never opened (its loss was never scaled), where a refusal must change nothing.
        self.refuse_gradient_call(phase, states.config)
        try:
            call, state = parse()
            claims = self.claims if self.phase == UNSCALED else StepClaims()
            if phase == UNSCALED and states.counts:  # a disabled scaler's guard touches nothing: nothing to claim
                claims = claims.with_call(call)  # new claims: committed below, where a failure counts
        except ConfigError:
            raise
        except BaseException as error:
            try:
                if phase == INSPECTED:
                    states.skip_all()
                if ballot.vote is not None:
                    self._fail(phase, states, None, None)
            finally:
                ballot.join_after_failure(error, join_after_failure)
            raise
        culprits: tuple[int, ...] | None = ()
        try:
            if self.phase != phase:
                self._open(phase, states, claims)
            elif states.counts:
                self.claims = claims
            culprits = run(call, state, ballot)
            if states.counts:  # the call's commit: an interrupt from here on finds its record complete
                self.records = (*self.records, CallRecord(call.labels, call.plan, state, culprits))
        except BaseException as error:
            try:
                self._fail(phase, states, call, state, culprits)
            finally:
                ballot.join_after_failure(error, join_after_failure)
            raise
        return call, state

    def _open(self, phase: str, states: StateSet, claims: StepClaims) -> None:
        """Open the gradient part of the step: forget the last step's verdict; the phase changes last."""
        self.number += 1  # first: a step whose opening failed part way is still a new step
        states.begin()
        if states.counts:  # a disabled scaler's guard keeps the last step's records
            self.records, self.claims = (), claims
        self.phase = phase

    def _fail(
        self,
        phase: str,
        states: StateSet,
        call: Call | None,
        state: State | None,
        culprits: tuple[int, ...] | None = (),
    ) -> None:
        """Count a failed call as an overflow of the step, opening the step if it was not.

        Each part is done even if one before it raises (a broken device): the
        step is open, counts as an overflow on the host, and says "skip".
        """
        try:
            if self.phase != phase:
                self._open(phase, states, StepClaims())
        finally:
            self.phase = phase
            try:
                if states.counts:
                    record = (
                        CallRecord(call.labels, call.plan, state, culprits) if call else CallRecord((), None, None, ())
                    )
                    self.records = (*self.records, record)
                states.mark_overflow(state)
            finally:
                if phase == INSPECTED:
                    states.skip_all()

    def holds(self, number: int) -> bool:
        """Return whether step ``number`` is open with its gradients inspected (between check() and update())."""
        return self.number == number and self.phase == INSPECTED

    def close(self) -> None:
        """End the step (after ``update()`` applied the rule), in one assignment."""
        empty = StepClaims()
        self.claims, self.phase = empty, IDLE

    def culprit_labels(self, read: Callable[[CallRecord], tuple[int, ...]]) -> list[Hashable]:
        """Return the labels of the gradients that held inf/nan, call by call (``read`` gives a record's positions)."""
        return [record.labels[position] for record in self.records for position in read(record)]


def scale_fixed_at_one(config: ScalerConfig) -> bool:
    """Return whether ``config`` fixes the scale at 1, so that a step needs no ``scale_loss``.

    That is ``min_scale == max_scale == 1``: the scale always lies inside the clamps, so it is 1 and
    never moves. Guard scalers (``guard()``) and a disabled ``GradScaler`` (whose steps run on such a
    configuration) are these; ``min_scale=None, max_scale=1`` is not (a backoff takes the scale below 1).
    Reads the configuration only (never the state, which may be on a device).
    """
    return config.min_scale == 1.0 and config.max_scale == 1.0


def where(device: int) -> str:
    """Say where a state lives, for messages."""
    return "on the host" if device < 0 else f"on device {device}"


class StateSet:
    """The states one face keeps, by device, and what a step does to all of them.

    Before any array arrives, a host state stands for the scaler (and takes
    calls without arrays). With ``one_device`` (the sync-free face) the first
    arrays fix where the state lives, once and for all.
    """

    def __init__(self, config: ScalerConfig, state: ScalerState, *, one_device: bool, counts: bool = True) -> None:
        self.config = config
        self.counts = counts  # False for a disabled scaler's guard: its steps change nothing the user sees
        self.one_device = one_device
        self.default: State = numpy_backend.HostState(config, state, False, False, 0)
        self.states: dict[int, State] = {}
        self._backend: Backend | None = None
        # What the host knows of the open (or last) step: (any overflow, this rank's own), and the same verdict
        # as a 0-d bool array for the synchronous face's statistics. That face keeps both from its reads and
        # from failures; the sync-free face reads its state instead.
        self.verdict = (False, False)
        self.finite = np.ones((), dtype=np.bool_)

    def all(self) -> list[State]:
        """Every state, the default one first when no array has placed one yet."""
        return list(self.states.values()) if self.states else [self.default]

    def place(self, backend: Backend | None, device: int, current: Callable[[], Snapshot], step_open: bool) -> State:
        """Return the state for arrays of ``backend`` on ``device``, placing one there from ``current()`` if none is.

        ``backend`` None (a call without arrays) takes the first state.

        Raises:
            GradientTypeError: A one-device set whose state is of the other kind of array.
            GradientValueError: A one-device set whose state is on another device.
            ScalerProtocolError: The state would move to the GPU in the middle of a step.
        """
        if backend is None:
            return self.all()[0]
        state = self.states.get(device)
        if state is not None:
            return state
        if self.one_device and self._backend is not None:
            if backend is not self._backend:
                raise GradientTypeError(
                    f"This scaler's state is {where(self.all()[0].device)}, so it takes {self._backend.NAME} "
                    f"arrays; got {backend.NAME} arrays. Use one scaler per kind of array."
                )
            raise GradientValueError(
                f"This scaler's state is {where(self.all()[0].device)}; got arrays on device {device}. A sync-free "
                f"scaler works on one device (one scaler per device, with a communicator across them)."
            )
        if self.one_device and step_open and device >= 0:
            raise ScalerProtocolError(
                "This step's first gradient call had no arrays, so its verdict lives on the host; the state cannot "
                "move to the GPU in the middle of the step. Pass the GPU arrays (or call prepare(gradients)) before "
                "the step's first gradient call."
            )
        if device < 0:
            state = self.default
            state.restore(self.config, *current())
        else:
            backend.refuse_capture("the scaler's state is first placed on the GPU")
            state = backend.new_state(device, self.config, *current())
            if step_open:
                state.begin_step()
        self._backend, self.states = backend, {**self.states, device: state}  # one commit
        return state

    def begin(self) -> None:
        """Begin a step on every state: a new epoch, flags that say "finite"."""
        self.verdict = (False, False)
        self.finite[()] = True
        for state in self.all():
            state.begin_step()

    def found(self, overflow: bool, local: bool) -> None:
        """Add what a read of the open step's verdict found."""
        self.verdict = (self.verdict[0] or overflow, self.verdict[1] or local)
        self.finite[()] = not self.verdict[0]

    def mark_overflow(self, state: State | None) -> None:
        """Count the open step as this rank's overflow on ``state`` (on the first state when not known)."""
        self.found(True, True)
        (state or self.all()[0]).mark_overflow()

    def skip_all(self) -> None:
        """Make every statistics record say "skip", so that no optimizer applies the step."""
        self.finite[()] = False
        for state in self.all():
            state.skip_statistics()  # on the GPU: after the state's last work, on its device

    def update(self, after: ScalerState) -> None:
        """Apply the rule to every state; ``after`` is the state the host computed (the step's verdict applied).

        One state updates itself on its device. Several (gradients on several
        devices in one process) each saw only their own arrays, so they are
        set to ``after`` instead (synchronizes).
        """
        if len(self.states) <= 1:
            self.all()[0].update()
        else:
            self.restore(self.config, after, *self.verdict)

    def restore(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool) -> None:
        """Replace every state's configuration and state (synchronizes on the GPU); each keeps its own epoch."""
        for placed in self.all():
            placed.restore(config, state, overflow, local, placed.snapshot()[3])
        self.config = config
        self.verdict = (overflow, local)
        self.finite[()] = not overflow


def unscale_call(call: Call, state: State, ballot: Ballot) -> tuple[int, ...] | None:
    """Queue the unscale of a claimed call, then its vote and the verdict's combination."""
    culprits = state.unscale(call) if call.backend is not None else ()
    if ballot.vote is not None:
        state.vote(ballot)
        state.combine()
    return culprits


def check_call(
    call: Call, state: State, ballot: Ballot, max_norm: float, report: bool = False
) -> tuple[int, ...] | None:
    """Queue the statistics pass of a call, then (with a communicator) the all-reduce of its sums and the finish.

    A call without arrays (a rank without gradients) runs the pass too, over nothing: its record, and the
    pair a communicator sums, then hold this step's own values (no overflow, sum 0), not what the last
    step's all-reduce left there (the other ranks' sums and overflow count).
    """
    culprits = state.check(call, max_norm, ballot.vote is not None, report)
    if ballot.vote is not None:
        state.vote_sums(ballot)
        state.finish_check(max_norm)
    return culprits
