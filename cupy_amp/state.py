"""A scaler's state where its arrays are, and the backends that hold it: the State and Backend protocols, and
the validated call (:class:`Call`, its arrays' :class:`Footprint`) they run.

Two implementations follow :class:`State`: :class:`cupy_amp.twins.step_state.HostState`
(NumPy, the reference numerics) and :class:`cupy_amp.gpu.device_state.DeviceState`
(the scale, counters and flags in device memory, stepped by kernels). Every
operation but :meth:`State.read`, :meth:`State.snapshot`, :meth:`State.restore`
and :meth:`State.culprits` queues its work and returns without waiting. The two
backend modules, :mod:`cupy_amp.numpy_backend` and :mod:`cupy_amp.gpu.backend`,
follow :class:`Backend` (mypy checks each module against it).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from cupy_amp.ballot import Ballot
from cupy_amp.rule import ScalerConfig, ScalerState

if TYPE_CHECKING:
    from cupy_amp.twins.grad_stats import Numerics

__all__ = ["Backend", "Call", "Footprint", "Snapshot", "State", "Verdict"]


class Footprint(NamedTuple):
    """The memory one array may write: its element layout at an address, on a device (-1: the host).

    Addresses are compared across devices as they are: with CUDA's unified
    addressing, host and device memory never share an address.
    """

    start: int
    stop: int
    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    device: int


class Call(NamedTuple):
    """One validated ``unscale_and_check`` argument: what a backend needs to run it.

    Attributes:
        labels: For each array, its position in the argument (an int) or its key in a mapping.
        arrays: The arrays, in argument order, ``None`` entries left out.
        backend: The module that runs them (None when there are none).
        footprints: For each array, the memory it spans.
        plan: What the backend prepared for these arrays (CuPy: device tables), or None.
        cacheable: The arrays' layouts cannot change behind the same objects, so the call
            may be reused when the same objects come back.
        bfloat16: Some array is bfloat16 (read by ``check()``, never unscaled in place).
        devices: The devices the arrays are on, sorted (-1: the host).
    """

    labels: tuple[Hashable, ...]
    arrays: tuple[Any, ...]
    backend: Backend | None
    footprints: tuple[Footprint, ...]
    plan: Any
    cacheable: bool
    bfloat16: bool = False
    devices: tuple[int, ...] = ()


class Verdict(NamedTuple):
    """What a state's flags say of the open (or last) step, read on the host."""

    overflow: bool  # any rank's gradients held inf/nan (this rank's included)
    local: bool  # this rank's own gradients did
    epoch: int  # the step's number, which the per-gradient flags hold
    bad_votes: int  # steps so far whose all-reduce answer was impossible (a restore keeps the count)
    poisoned: bool = False  # an all-reduce answered a poisoned vote: the ranks may disagree
    norm: float = math.nan  # the step's finished check()'s norm (the headroom rule's signal); NaN without one


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
    def unscale(self, call: Call, number: int = 0) -> tuple[int, ...] | None: ...
    def check(
        self, call: Call, max_norm: float, voting: bool, report: bool = False, number: int = 0
    ) -> tuple[int, ...] | None: ...
    def numerics(self, plan: Any) -> list[Numerics]: ...
    def vote(self, ballot: Ballot) -> None: ...
    def vote_sums(self, ballot: Ballot) -> None: ...
    def finish_vote(self, inspected: bool, max_norm: float) -> None: ...
    def mark_overflow(self) -> None: ...
    def skip_statistics(self) -> None: ...
    def update(self, step: int | None = None) -> None: ...
    def prepare(self, call: Call) -> None: ...
    def follow(self) -> Any: ...
    def capturing(self) -> bool: ...
    def read(self) -> Verdict: ...
    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int, bool]: ...
    def new_bad_votes(self, counted: int) -> int: ...
    def restore(
        self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, reopen: bool = False
    ) -> None: ...
    def culprits(self, plan: Any, epoch: int) -> tuple[int, ...]: ...
    def journal(self) -> Any: ...
    def keep_culprits(self, count: int, first: tuple[int, int] | None) -> None: ...
    def load_journal(self, chosen: Any) -> None: ...


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
        self,
        device: int,
        config: ScalerConfig,
        state: ScalerState,
        overflow: bool,
        local: bool,
        epoch: int,
        capacity: int = 0,
    ) -> State: ...
