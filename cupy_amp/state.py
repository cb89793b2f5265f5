"""A scaler's state where its arrays are, and the backends that hold it: the State and Backend protocols.

Two implementations follow :class:`State`: :class:`cupy_amp.numpy_backend.HostState`
(NumPy, the reference numerics) and :class:`cupy_amp.cupy_backend.DeviceState`
(the scale, counters and flags in device memory, stepped by kernels). Every
operation but :meth:`State.read`, :meth:`State.snapshot`, :meth:`State.restore`
and :meth:`State.culprits` queues its work and returns without waiting. The two
backend modules, :mod:`cupy_amp.numpy_backend` and :mod:`cupy_amp.cupy_backend`,
follow :class:`Backend` (mypy checks each module against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from cupy_amp.rule import ScalerConfig, ScalerState

if TYPE_CHECKING:
    from cupy_amp.gradients import Call
    from cupy_amp.statistics import Numerics
    from cupy_amp.step import Ballot

__all__ = ["Backend", "Snapshot", "State", "Verdict"]


class Verdict(NamedTuple):
    """What a state's flags say of the open (or last) step, read on the host."""

    overflow: bool  # any rank's gradients held inf/nan (this rank's included)
    local: bool  # this rank's own gradients did
    epoch: int  # the step's number, which the per-gradient flags hold
    bad_votes: int  # steps so far whose all-reduce answer was impossible
    poisoned: bool = False  # an all-reduce answered a poisoned vote: the ranks may disagree


class Snapshot(NamedTuple):
    """A state as the host sees it: the rule's state and the last verdict."""

    state: ScalerState
    overflow: bool
    local: bool
    epoch: int


class State(Protocol):
    """A scaler's state on one device, and the operations of a step on it."""

    device: int
    finite: Any  # 0-d bool array: the step's verdict, to gate updates with
    stats: Any  # check()'s statistics record: .norm, .clip_coefficient, .factor, .skip views, .record its owner

    def scale_loss(self, loss: Any) -> None: ...
    def begin_step(self) -> None: ...
    def unscale(self, call: Call) -> tuple[int, ...] | None: ...
    def check(self, call: Call, max_norm: float, voting: bool, report: bool = False) -> tuple[int, ...] | None: ...
    def numerics(self, plan: Any) -> list[Numerics]: ...
    def vote(self, ballot: Ballot) -> None: ...
    def vote_sums(self, ballot: Ballot) -> None: ...
    def finish_vote(self, inspected: bool, max_norm: float) -> None: ...
    def mark_overflow(self) -> None: ...
    def skip_statistics(self) -> None: ...
    def update(self) -> None: ...
    def prepare(self, call: Call) -> None: ...
    def follow(self) -> Any: ...
    def read(self) -> Verdict: ...
    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int, bool]: ...
    def restore(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int) -> None: ...
    def culprits(self, plan: Any, epoch: int) -> tuple[int, ...]: ...


class Backend(Protocol):
    """What an array backend module offers: validation, placement and the state of a scaler for its arrays."""

    NAME: str  # "numpy" or "cupy", for messages
    LAYOUT_FIXED: bool  # an array's strides, dtype and memory cannot change behind the same object

    def as_array(self, obj: Any) -> Any | None: ...
    def write_problem(self, array: Any, source: Any) -> str | None: ...
    def location(self, array: Any) -> tuple[int, int]: ...
    def prepare(self, arrays: Sequence[Any]) -> Any: ...
    def capturing(self) -> bool: ...
    def refuse_capture(self, what: str) -> None: ...
    def new_state(
        self, device: int, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int
    ) -> State: ...
