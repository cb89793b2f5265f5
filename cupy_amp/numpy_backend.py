"""The NumPy backend: the reference implementation of the scaler's numerics.

float16 and float32 arrays are multiplied in float32 and rounded back to
their dtype; float64 arrays in float64. Overflow means any inf/nan in the
input, checked before unscaling. Nothing here is asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cupy_amp.distributed import count_verdict, refuse_impossible_sum
from cupy_amp.errors import CommunicatorError, RanksMayDisagreeError
from cupy_amp.kernel_interface import STATS
from cupy_amp.record import StatsRecord
from cupy_amp.rule import ScalerConfig, ScalerState, inverse_scale, next_state
from cupy_amp.state import Verdict
from cupy_amp.statistics import Numerics, finish_host, host_numerics
from cupy_amp.statistics import host_sums as sums_of

__all__ = [
    "LAYOUT_FIXED",
    "NAME",
    "HostState",
    "HostStatsRecord",
    "as_array",
    "capturing",
    "location",
    "new_state",
    "prepare",
    "refuse_capture",
    "scale_loss",
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


def as_array(obj: Any) -> np.ndarray | None:
    """Return ``obj`` as a plain NumPy array (a view: subclasses are judged on their data), or None."""
    return obj.view(np.ndarray) if isinstance(obj, np.ndarray) else None


def capturing() -> bool:
    """The host records no CUDA graphs."""
    return False


def refuse_capture(what: str) -> None:
    """Nothing on the host is captured: nothing to refuse."""


def new_state(
    device: int, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int
) -> HostState:
    """Return a host state (``device`` is -1)."""
    return HostState(config, state, overflow, local, epoch)


def prepare(arrays: Sequence[np.ndarray]) -> None:
    """NumPy needs no preparation."""
    return None


def scale_loss(loss: np.ndarray, factor: np.float32) -> None:
    """Multiply ``loss`` by ``factor`` in place."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        _multiply(loss, factor)


def _multiply(array: np.ndarray, factor: np.float32) -> None:
    if array.dtype == np.float64:
        np.multiply(array, np.float64(factor), out=array)
    else:
        np.multiply(array, factor, out=array, dtype=np.float32, casting="same_kind")


class HostStatsRecord:
    """A scaler's statistics record on the host (the NumPy path's :class:`~cupy_amp.gpu.stats.DeviceStatsRecord`).

    Attributes:
        memory: The 0-d STATS record.
        norm, clip_coefficient, factor, skip: Views of its fields.
        record: Its owner: currency, readers (:class:`~cupy_amp.record.StatsRecord`).
    """

    device = -1

    def __init__(self) -> None:
        self.memory = np.zeros((), dtype=STATS)
        self.memory["skip"] = 1  # no check() has completed: nothing to apply
        self.skip = self.memory["skip"]
        self.norm, self.clip_coefficient = self.memory["norm"], self.memory["clip_coefficient"]
        self.factor = self.memory["factor"]
        self.record = StatsRecord(self.memory, -1)


class HostState:
    """A scaler's state on the host: the reference for :class:`~cupy_amp.gpu.backend.DeviceState`.

    The same operations with the same meaning, for NumPy arrays (and for a
    scaler that has met no array yet): ``finite`` is a 0-d bool array to gate
    updates with, and :meth:`update` is :func:`~cupy_amp.rule.next_state` itself.
    Nothing here is asynchronous, so every read is immediate.
    """

    device = -1

    def __init__(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int) -> None:
        self._finite = np.ones((), dtype=np.bool_)
        self.finite = self._finite.view()  # what callers get: read-only, and always the current verdict
        self.finite.flags.writeable = False
        self.stats = HostStatsRecord()
        # The pair a gradient call sums over the ranks: (overflowed ranks, sum of squares), this rank's until the
        # all-reduce replaces it in place by the ranks' sums.
        self._pair = np.zeros(2, dtype=np.float64)
        self._own = 0.0  # this rank's own sum of squares, which the all-reduced one must contain
        self._poisoned = False  # an all-reduce answered a poisoned vote: every later step is an overflow
        self._numerics: list[Numerics] = []  # the last check(report=True)'s
        self.restore(config, state, overflow, local, epoch)

    def read(self) -> Verdict:
        """Return the step's verdict (garbage votes raise at once here: the host reads every answer)."""
        return Verdict(not bool(self._finite), self._found, self._epoch, 0, self._poisoned)

    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int, bool]:
        """Return (state, the step's verdict, this rank's own overflow, epoch, garbage votes (always 0), poisoned)."""
        return self._state, not bool(self._finite), self._found, self._epoch, 0, self._poisoned

    def restore(self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int) -> None:
        self.stats.record.closed()
        self.skip_statistics()
        self._finite[()] = not overflow
        self._config, self._state, self._found, self._epoch, self._updated = config, state, local, epoch, -1

    def scale_loss(self, loss: np.ndarray) -> None:
        scale_loss(loss, np.float32(self._state.scale))

    def begin_step(self) -> None:
        self.stats.record.closed()  # the step opens: its record says "skip" until its check() completes
        self.skip_statistics()
        self._epoch = self._epoch % (2**32 - 1) + 1
        self._finite[()] = not self._poisoned  # before _found: a reader never sees an overflow without its origin
        self._found = False

    def unscale(self, call: Any) -> tuple[int, ...]:
        """Check every array for inf/nan, then multiply it by the inverse scale in place, one at a time."""
        inverse = inverse_scale(self._state.scale)
        culprits = []
        # Over/underflow and inf * 0 are expected results here, not warnings.
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            for position, array in enumerate(call.arrays):
                if not np.isfinite(array).all():
                    culprits.append(position)
                _multiply(array, inverse)
        if culprits:
            self.mark_overflow()
        return tuple(culprits)

    def prepare(self, call: Any) -> None:
        """Nothing to set aside on the host."""

    def check(self, call: Any, max_norm: float, voting: bool, report: bool = False) -> tuple[int, ...]:
        """Read a parsed call's statistics; return the positions of the arrays that held inf/nan.

        With ``voting``, the record is finished by :meth:`vote_sums` and
        :meth:`finish_vote`; with ``report``, the numerics report is taken too (:meth:`numerics`).
        """
        if report:
            self._numerics = [host_numerics(position, array) for position, array in enumerate(call.arrays)]
        culprits, total = sums_of(call.arrays)
        if culprits:
            self.mark_overflow()
        if voting:
            self._own = total
        else:
            self._finish(total, max_norm, bool(culprits))
        return culprits

    def _finish(self, total: float, max_norm: float, overflow: bool, own: float | None = None) -> None:
        finish_host(self.stats.memory, total, inverse_scale(self._state.scale), max_norm, self._found, overflow, own)

    def numerics(self, plan: Any) -> list[Numerics]:
        """Return the numerics report of the last ``check(report=True)``."""
        return list(self._numerics)

    def vote(self, ballot: Any) -> None:
        """Join ``unscale_and_check``'s collective with this rank's pair, (overflow flag, 0) (synchronizing)."""
        self._pair = np.array([1.0 if self._found else 0.0, 0.0], dtype=np.float64)
        ballot.sum(self._pair, None)

    def vote_sums(self, ballot: Any) -> None:
        """Join ``check()``'s collective with this rank's pair, (overflow flag, sum of squares) (synchronizing)."""
        self._pair = np.array([1.0 if self._found else 0.0, self._own], dtype=np.float64)
        ballot.sum(self._pair, None)

    def finish_vote(self, inspected: bool, max_norm: float) -> None:
        """Take the verdict from the all-reduced pair (and, after a ``check()``, finish the record); idempotent.

        Raises:
            RanksMayDisagreeError: The count held a poisoned vote (the state stays poisoned: every later
                step is an overflow).
            CommunicatorError: The count of overflowed ranks was no such count, or the sum of squares no sum
                of the ranks' shares (the step counts as an overflow).
        """
        count, total = (float(value) for value in self._pair)
        try:
            agreed = count_verdict(count, self._found)
            if inspected and not agreed:  # after an overflow the sums are meaningless: the step is skipped anyway
                refuse_impossible_sum(total, self._own)
        except CommunicatorError as error:
            self._poisoned = self._poisoned or isinstance(error, RanksMayDisagreeError)
            if inspected and not total < 0.0:  # the record as far as it can be made (no square root of < 0)
                self._finish(total, max_norm, True, self._own)
            self._finite[()] = False
            self.skip_statistics()
            raise
        if inspected:
            self._finish(total, max_norm, agreed, self._own)
        if agreed or self._poisoned:
            self._finite[()] = False

    def mark_overflow(self) -> None:
        """Count the open step as this rank's overflow; its statistics record too says skip."""
        self._found = True
        self._finite[()] = False
        self.skip_statistics()

    def skip_statistics(self) -> None:
        """Make the statistics record say "skip"."""
        self.stats.skip[...] = 1

    def update(self) -> None:
        """Close the step (its record says "skip"), applying the rule once: a retry after an interrupted
        ``update()`` changes nothing more."""
        self.stats.record.closed()
        self.skip_statistics()
        if self._updated != self._epoch and not self._poisoned:  # poisoned: the ranks may disagree, decide nothing
            after = next_state(self._config, self._state, not bool(self._finite), self._found)
            self._state, self._updated = after, self._epoch

    def follow(self) -> None:
        """Nothing to order on the host."""

    def culprits(self, plan: Any, epoch: int) -> tuple[int, ...]:
        """The host knows every call's culprits at once (the step keeps them): nothing to read."""
        return ()
