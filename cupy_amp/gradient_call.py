"""One gradient call as the step machine sees it: its scope (how far it got) and its queued work.

:class:`GradientScope` is what :meth:`cupy_amp.step.Step.gradient_call` yields to
a face and reads back when the call fails; :func:`unscale_call` and
:func:`check_call` queue a committed call's work on its state, the collective
included.
"""

from __future__ import annotations

from cupy_amp.ballot import Ballot
from cupy_amp.state import Call, State
from cupy_amp.state_set import StateSet

__all__ = ["GradientScope", "check_call", "unscale_call"]


class GradientScope:
    """One gradient call as far as it got, for the step machine to account for a failure.

    Attributes:
        phase: UNSCALED (``unscale_and_check``) or INSPECTED (``check``).
        states: The face's states the call runs on.
        ballot: The call's part in the collective.
        call, state: The validated call and the state it runs on (set by :meth:`Step.open_call`).
        opened: Whether the call was committed (claims taken, step opened): a failure from here counts.
        finished: Whether the call's work after its collective (the verdict's combination) was queued.
        recorded: Whether the call's record was kept (once, by :meth:`Step.record_call` or a failure).
        culprits: The positions of its gradients that held inf/nan, where known on the host.
        max_norm: ``check()``'s clip threshold (0.0: none), to finish a check from its answer.
    """

    __slots__ = (
        "ballot", "call", "culprits", "finished", "max_norm", "number", "opened", "phase", "recorded", "state",
        "states",
    )  # fmt: skip

    def __init__(self, phase: str, states: StateSet, ballot: Ballot) -> None:
        self.phase, self.states, self.ballot = phase, states, ballot
        self.call: Call | None = None
        self.state: State | None = None
        self.opened = self.finished = self.recorded = False
        self.culprits: tuple[int, ...] | None = ()
        self.max_norm = 0.0
        self.number = 0  # the call's number in its step (the records before it), for the journal


def unscale_call(call: Call, state: State, scope: GradientScope) -> tuple[int, ...] | None:
    """Queue the unscale of a committed call, then (with a communicator) its vote and the verdict's combination."""
    culprits = scope.states.unscale(state, call, scope.number)
    if scope.ballot.communicator is not None:
        state.vote(scope.ballot)
        state.finish_vote(False, 0.0)
    scope.finished = True
    return culprits


def check_call(call: Call, state: State, scope: GradientScope, report: bool = False) -> tuple[int, ...] | None:
    """Queue the statistics pass of a committed call, then (with a communicator) the all-reduce of its sums and
    the finish.

    A call without arrays (a rank without gradients) runs the pass too, over nothing: its record, and the
    pair a communicator sums, then hold this step's own values (no overflow, sum 0), not what the last
    step's all-reduce left there (the other ranks' sums and overflow count).
    """
    voting = scope.ballot.communicator is not None
    culprits = state.check(call, scope.max_norm, voting, report, scope.number)
    if voting:
        state.vote_sums(scope.ballot)
        state.finish_vote(True, scope.max_norm)
    scope.finished = True
    return culprits
