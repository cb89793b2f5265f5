"""The states one scaler face keeps, one per device its arrays were on, and what a step does to all of them."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from cupy_amp import numpy_backend
from cupy_amp.errors import GradientTypeError, GradientValueError, ScalerProtocolError
from cupy_amp.rule import ScalerConfig, ScalerState
from cupy_amp.state import Backend, Snapshot, State

__all__ = ["StateSet", "where"]


def where(device: int) -> str:
    """Say where a state lives, for messages."""
    return "on the host" if device < 0 else f"on device {device}"


class StateSet:
    """The states one face keeps, by device, and what a step does to all of them.

    Before any array arrives, a host state stands for the scaler (and takes
    calls without arrays). With ``one_device`` (the sync-free face) the first
    arrays fix where the state lives, once and for all.
    """

    def __init__(
        self, config: ScalerConfig, state: ScalerState, *, one_device: bool, counts: bool = True, journal: int = 0
    ) -> None:
        self.config = config
        self.counts = counts  # False for a disabled scaler's guard: its steps change nothing the user sees
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

    def close(self) -> None:
        """Close the step on every state without the rule (a disabled scaler's guard): its records say "skip"."""
        for state in self.all():
            state.stats.record.closed()
            state.skip_statistics()

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
