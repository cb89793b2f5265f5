"""The states one scaler face keeps, one per device its arrays were on, and what a step does to all of them.

:class:`StateSet` is a scaling lane: its steps scale, unscale and keep records.
:class:`GuardSet` is the null lane of a disabled ``GradScaler``: the same calls,
which scale nothing, unscale nothing, claim nothing and end without the rule,
so the step machine runs one path whatever the lane.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.claims import StepClaims
from cupy_amp.distributed import Communicator
from cupy_amp.errors import GradientTypeError, GradientValueError, ScalerProtocolError
from cupy_amp.rule import ScalerConfig, ScalerState
from cupy_amp.state import Backend, Call, Snapshot, State

__all__ = ["LEFT_AS_IS", "CallRecord", "GuardSet", "LossLeftAsIs", "StateSet", "where"]


def where(device: int) -> str:
    """Say where a state lives, for messages."""
    return "on the host" if device < 0 else f"on device {device}"


class CallRecord(NamedTuple):
    """One gradient call of a step, kept to answer ``nonfinite_gradients`` (it holds no array)."""

    labels: tuple[Hashable, ...]  # empty for a call that failed before its arrays were known
    plan: Any  # the call's device tables, where the per-gradient flags are
    state: State | None  # where its verdict is
    culprits: tuple[int, ...] | None  # positions known on the host; None: read from the state when asked


class StateSet:
    """The states one face keeps, by device, what a step does to all of them, and the step's call records.

    Before any array arrives, a host state stands for the scaler (and takes
    calls without arrays). With ``one_device`` (the sync-free face) the first
    arrays fix where the state lives, once and for all.
    """

    def __init__(self, config: ScalerConfig, state: ScalerState, *, one_device: bool, journal: int = 0) -> None:
        self.config = config
        self.one_device = one_device
        self.capacity = journal  # each state's journal: the steps it keeps
        self.default: State = numpy_backend.HostState(config, state, False, False, 0, journal)
        self.states: dict[int, State] = {}
        self._backend: Backend | None = None
        # What the host knows of the open (or last) step: (any overflow, this rank's own), and the same verdict
        # as a 0-d bool array for the synchronous face's statistics. That face keeps both from its reads and
        # from failures; the sync-free face reads its state instead.
        self.verdict = (False, False)
        self.norm = math.nan  # the open step's check() norm as the host read it (the headroom rule's signal)
        self.finite = np.ones((), dtype=np.bool_)
        # The open (or last) step's gradient calls: replaced, never changed in place, so readers need no lock.
        self.records: tuple[CallRecord, ...] = ()

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
            state = backend.new_state(device, self.config, *current(), self.capacity)
            if self.capacity:
                state.load_journal(self.all()[0].journal())  # the steps made before, where the scaler was
            if step_open:
                state.begin_step()
        self._backend, self.states = backend, {**self.states, device: state}  # one commit
        return state

    # What a step does through its lane: a scaling lane scales, claims and unscales; GuardSet does none of it.

    def loss_state(self, place: Callable[[], State]) -> State | LossLeftAsIs:
        """Return the state whose scale multiplies a loss: ``place()``, the state where the loss is."""
        return place()

    def unscale_devices(self, call: Call) -> tuple[int, ...]:
        """Return the devices whose states an unscale of ``call`` runs on: each of its arrays' (-1: none)."""
        return call.devices or (-1,)

    def claim(self, claims: StepClaims, call: Call) -> StepClaims:
        """Return ``claims`` with the memory an unscale of ``call`` writes (see :meth:`StepClaims.with_call`)."""
        return claims.with_call(call)

    def unscale(self, state: State, call: Call, number: int) -> tuple[int, ...] | None:
        """Queue the unscale of ``call`` (the step's call ``number``) on ``state``; return the culprits if known."""
        return state.unscale(call, number) if call.backend is not None else ()

    def unscale_collective(self, communicator: Communicator | None) -> Communicator | None:
        """Return the communicator an unscale's verdict is agreed over."""
        return communicator

    def begin(self) -> None:
        """Begin a step on every state: a new epoch, flags that say "finite"."""
        self.verdict = (False, False)
        self.norm = math.nan
        self.finite[()] = True
        for state in self.all():
            state.begin_step()

    def found(self, overflow: bool, local: bool, norm: float = math.nan) -> None:
        """Add what a read of the open step's verdict found (``norm``: its check()'s, once finished)."""
        self.verdict = (self.verdict[0] or overflow, self.verdict[1] or local)
        if not math.isnan(norm):
            self.norm = norm
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

    def update(self, after: ScalerState, step: int) -> None:
        """Apply the rule to every state; ``after`` is the state the host computed (the step's verdict applied).

        One state updates itself on its device and begins step ``step + 1``
        in the same launch (the host keeps the verdict, so nothing reads the
        closed step's flags there again). Several (gradients on several
        devices in one process) each saw only their own arrays, so they are
        set to ``after`` instead (synchronizes).
        """
        if len(self.states) <= 1:
            self.all()[0].update(step)
        else:
            self.restore(self.config, after, *self.verdict)

    def culprit_summary(self) -> tuple[int, tuple[int, int] | None]:
        """Return how many gradients the step's records hold as culprits, and the first (call, position)."""
        first = next(((number, min(r.culprits)) for number, r in enumerate(self.records) if r.culprits), None)
        return sum(len(record.culprits or ()) for record in self.records), first

    def culprit_labels(self, read: Callable[[CallRecord], tuple[int, ...]]) -> list[Hashable]:
        """Return the labels of the gradients that held inf/nan, call by call (``read`` gives a record's positions)."""
        return [record.labels[position] for record in self.records for position in read(record)]

    def capturing(self) -> bool:
        """Return whether any state's device is capturing a CUDA graph on its current stream."""
        return any(state.capturing() for state in self.all())

    def journal(self) -> np.ndarray:
        """Return the journal of the first state, oldest first (on the GPU, synchronizes)."""
        entries: np.ndarray = self.all()[0].journal()
        return entries

    def keep_culprits(self, count: int, first: tuple[int, int] | None) -> None:
        """Set every state's count and first of the open step's culprits (after a repair, from the host's reads)."""
        for state in self.all():
            state.keep_culprits(count, first)

    def load_journal(self, entries: np.ndarray) -> None:
        """Replace every state's journal by ``entries`` (sorted by step)."""
        for state in self.all():
            state.load_journal(entries)

    def restore(
        self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, reopen: bool = False
    ) -> None:
        """Replace every state's configuration and state (synchronizes on the GPU); each keeps its own epoch
        (``reopen``: the open step's, which a folded update may have moved on from)."""
        for placed in self.all():
            placed.restore(config, state, overflow, local, placed.snapshot()[3], reopen)
        self.config = config
        self.verdict = (overflow, local)
        self.finite[()] = not overflow


class LossLeftAsIs:
    """What the null lane gives ``scale_loss`` for a state: a loss left as it is, nothing placed or queued."""

    def scale_loss(self, loss: Any) -> None:
        """Leave ``loss`` as it is."""


LEFT_AS_IS = LossLeftAsIs()


class GuardSet(StateSet):
    """The null lane of a disabled ``GradScaler``: scale 1 for good, and steps that change nothing the user sees.

    A loss is not multiplied (and no state is placed for it), gradients are
    neither unscaled nor claimed (the same gradients may come twice), an
    unscale joins no collective and reads one verdict (it ran nothing, on any
    device), and a step ends without the rule, its statistics
    records saying "skip". ``check()`` still computes its statistics here,
    with inverse scale 1. Its call records are its own: the scaler goes on
    reporting the last enabled step's.
    """

    def loss_state(self, place: Callable[[], State]) -> State | LossLeftAsIs:
        """Place nothing: the loss is left as it is."""
        return LEFT_AS_IS

    def unscale_devices(self, call: Call) -> tuple[int, ...]:
        """Return one device, the first: the call runs nothing, and one state holds its verdict."""
        return call.devices[:1] or (-1,)

    def claim(self, claims: StepClaims, call: Call) -> StepClaims:
        """Claim nothing: nothing is written."""
        return claims

    def unscale(self, state: State, call: Call, number: int) -> tuple[int, ...] | None:
        """Unscale nothing; no gradient is known to hold inf/nan."""
        return ()

    def unscale_collective(self, communicator: Communicator | None) -> Communicator | None:
        """None: an unscale that ran nothing has nothing to agree on."""
        return None

    def update(self, after: ScalerState, step: int) -> None:
        """End the step on every state without the rule: their statistics records say "skip"."""
        for state in self.all():
            state.stats.record.closed()
            state.skip_statistics()
