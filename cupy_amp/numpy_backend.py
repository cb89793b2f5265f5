"""The NumPy backend: the reference implementation of the scaler's numerics.

float16 and float32 arrays are multiplied in float32 and rounded back to
their dtype; float64 arrays in float64. Overflow means any inf/nan in the
input, checked before unscaling. Nothing here is asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cupy_amp.distributed import OverflowVote, cast_host_vote, host_sums, host_verdict, overflow_count_verdict
from cupy_amp.errors import CommunicatorError, ScalerProtocolError
from cupy_amp.kernel_interface import STATS
from cupy_amp.rule import ScalerConfig, ScalerState, inverse_scale, next_state
from cupy_amp.statistics import GradientStats, finish_host
from cupy_amp.statistics import host_sums as sums_of

__all__ = [
    "LAYOUT_FIXED",
    "NAME",
    "Checked",
    "HostState",
    "HostStats",
    "check",
    "location",
    "prepare",
    "scale_loss",
    "unscale",
    "write_problem",
]

NAME = "numpy"
# NumPy lets an array's strides, dtype and writability change in place: validate on every call.
LAYOUT_FIXED = False


def write_problem(array: np.ndarray, source: Any) -> str | None:
    """Return why ``array`` cannot be written in place, or None (refused as on the GPU: misaligned arrays too)."""
    if not array.flags.writeable:
        return "the array is read-only"
    if not array.flags.aligned:
        return f"its address or strides {array.strides} are not multiples of its itemsize {array.itemsize} (misaligned)"
    return None


def location(array: np.ndarray) -> tuple[int, int]:
    """Return (address of element [0, ..., 0], device): the host is device -1."""
    return array.__array_interface__["data"][0], -1


def prepare(arrays: Sequence[np.ndarray]) -> None:
    """NumPy needs no preparation."""
    return None


def scale_loss(loss: np.ndarray, factor: np.float32) -> None:
    """Multiply ``loss`` by ``factor`` in place."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        _multiply(loss, factor)


def unscale(plan: None, arrays: Sequence[np.ndarray], inverse: np.float32, voting: bool) -> Unscaled:
    """Check every array for inf/nan, then multiply it by ``inverse`` in place, one array at a time."""
    culprits = []
    # Over/underflow and inf * 0 are expected results here, not warnings.
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for position, array in enumerate(arrays):
            if not np.isfinite(array).all():
                culprits.append(position)
            _multiply(array, inverse)
    return Unscaled(tuple(culprits))


class Unscaled:
    """The outcome of one call, already known: voting is the only step left."""

    def __init__(self, culprits: tuple[int, ...]) -> None:
        self._culprits = culprits
        self._voted = False
        self._answer: object = None

    def vote(self, vote: OverflowVote) -> None:
        """Combine this rank's flag with every other rank's (a synchronizing collective)."""
        self._answer = cast_host_vote(vote, bool(self._culprits))
        self._voted = True

    def result(self) -> tuple[bool, bool | None, tuple[int, ...]]:
        """Return (this rank's overflow, the ranks' verdict or None without a vote, culprit positions).

        Raises:
            CommunicatorError: The vote's answer was not a bool.
        """
        local = bool(self._culprits)
        return local, host_verdict(self._answer, local) if self._voted else None, self._culprits

    def abandon(self) -> None:
        """Nothing is in flight on the host."""


def _multiply(array: np.ndarray, factor: np.float32) -> None:
    if array.dtype == np.float64:
        np.multiply(array, np.float64(factor), out=array)
    else:
        np.multiply(array, factor, out=array, dtype=np.float32, casting="same_kind")


def check(
    plan: None, arrays: Sequence[np.ndarray], stats: HostStats, inverse: np.float32, max_norm: float, voting: bool
) -> Checked:
    """Read the arrays' statistics into ``stats`` (finished at once without ``voting``)."""
    culprits, total = sums_of(arrays)
    checked = Checked(stats, culprits, total, inverse, max_norm)
    if not voting:
        finish_host(stats.record, total, inverse, max_norm, bool(culprits), False)
    return checked


class Checked:
    """A finished host statistics pass, or one waiting for its all-reduce."""

    def __init__(
        self, stats: HostStats, culprits: tuple[int, ...], total: float, inverse: np.float32, max_norm: float
    ) -> None:
        self._stats, self._culprits, self._total = stats, culprits, total
        self._inverse, self._max_norm = inverse, max_norm
        self._count: float | None = None

    def vote(self, vote: OverflowVote) -> None:
        """Sum (overflowed, sum of squares) over the ranks (synchronizing; raises if this rank took no part)."""
        self._count, self._total = host_sums(vote, bool(self._culprits), self._total)

    def result(self) -> tuple[bool, float | None, tuple[int, ...]]:
        """Return (this rank's overflow, the ranks' overflow count or None, culprit positions); finish the record."""
        local = bool(self._culprits)
        if self._count is not None:
            agreed = self._count != 0.0  # an impossible count (a NaN too) is the caller's to reject: skip meanwhile
            finish_host(self._stats.record, self._total, self._inverse, self._max_norm, local, agreed)
        return local, self._count, self._culprits


class HostStats:
    """A scaler's statistics record on the host (the NumPy path's :class:`~cupy_amp.cupy_backend.DeviceStats`)."""

    device = -1

    def __init__(self, finite: np.ndarray) -> None:
        self.record = np.zeros((), dtype=STATS)
        self.skip = self.record["skip"]
        self.result = GradientStats(self.record["norm"], self.record["clip_coefficient"], finite, self.record)


class HostState:
    """A sync-free scaler's state on the host: the reference for :class:`~cupy_amp.cupy_backend.DeviceState`.

    The same operations with the same meaning, for NumPy arrays (and for a
    scaler that has met no array yet): ``finite`` is a 0-d bool array to gate
    updates with, and :meth:`update` is :func:`~cupy_amp.rule.next_state` itself.
    """

    device = -1

    def __init__(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int) -> None:
        self._finite = np.ones((), dtype=np.bool_)
        self.finite = self._finite.view()  # what callers get: read-only, and always the current verdict
        self.finite.flags.writeable = False
        self._answer: object = None
        self.stats = HostStats(self.finite)
        self._checked: Checked | None = None  # the open step's statistics pass, if it ran check()
        self.restore(config, state, overflow, local, epoch)

    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int]:
        """Return (state, the step's verdict, this rank's own overflow, epoch, garbage votes: always 0).

        Garbage votes raise at once here: the host reads every answer.
        """
        return self._state, not bool(self._finite), self._found, self._epoch, 0

    def restore(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int) -> None:
        self._config, self._state, self._found, self._epoch = config, state, local, epoch
        self._finite[()] = not overflow

    def scale_loss(self, loss: np.ndarray) -> None:
        scale_loss(loss, np.float32(self._state.scale))

    def begin_step(self) -> None:
        self._epoch = self._epoch % (2**32 - 1) + 1
        self._finite[()] = True  # before _found: a reader never sees an overflow without its origin
        self._found = False

    def unscale(self, call: Any) -> tuple[int, ...]:
        """Unscale a parsed call's arrays; return the positions of those that held inf/nan."""
        culprits = unscale(None, call.arrays, inverse_scale(self._state.scale), False).result()[2]
        if culprits:
            self.mark_overflow()
        return culprits

    def prepare(self, call: Any) -> None:
        """Nothing to set aside on the host."""

    def check(self, call: Any, max_norm: float, voting: bool) -> tuple[int, ...]:
        """Read a parsed call's statistics; return the positions of the arrays that held inf/nan.

        With ``voting``, the record is finished by :meth:`vote_sums` and :meth:`finish_check`.
        """
        self._checked = check(None, call.arrays, self.stats, inverse_scale(self._state.scale), max_norm, voting)
        culprits = self._checked.result()[2]
        if culprits:
            self.mark_overflow()
        return culprits

    def vote_sums(self, vote: OverflowVote) -> None:
        """Sum this rank's pair over the ranks (synchronizing; raises if this rank took no part)."""
        if self._checked is None:
            raise ScalerProtocolError("vote_sums() before check()")  # an internal order, kept by the scaler
        self._checked.vote(vote)

    def finish_check(self, max_norm: float) -> None:
        """Take the all-reduced verdict and finish the record.

        Raises:
            CommunicatorError: The count of overflowed ranks was no such count (the step counts as an overflow).
        """
        if self._checked is None:
            raise ScalerProtocolError("finish_check() before check()")
        local, count, _ = self._checked.result()
        try:
            agreed = overflow_count_verdict(count if count is not None else 0.0, local)
        except CommunicatorError:
            self._finite[()] = False
            raise
        if agreed:
            self._finite[()] = False

    def vote(self, vote: OverflowVote) -> None:
        """Take part in the vote with this rank's flag (synchronizing; raises if this rank took no part)."""
        self._answer = cast_host_vote(vote, self._found)

    def combine(self) -> None:
        """Take the vote's verdict; this rank's own overflow counts whatever it says.

        Raises:
            CommunicatorError: The answer was not a bool.
        """
        answer, self._answer = self._answer, None
        if host_verdict(answer, self._found):
            self._finite[()] = False

    def mark_overflow(self) -> None:
        """Count the open step as this rank's overflow; its statistics record too says skip."""
        self._found = True
        self._finite[()] = False
        self.stats.record["skip"] = 1

    def update(self) -> None:
        self._state = next_state(self._config, self._state, not bool(self._finite), self._found)

    def follow(self) -> None:
        """Nothing to order on the host."""
