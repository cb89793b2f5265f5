"""The NumPy twin of ``kernels/step_state.cu``: a scaler's state on the host and its steps.

``HostState`` holds what the device's State struct holds and does what its one-thread kernels do (a
step's begin, the vote cast and combined, an overflow marked, the rule applied once by
:func:`cupy_amp.rule.next_state`), calling the other twins for the passes over the gradients.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cupy_amp import journal
from cupy_amp.distributed import count_verdict, refuse_impossible_sum
from cupy_amp.errors import CommunicatorError, RanksMayDisagreeError
from cupy_amp.rule import ScalerConfig, ScalerState, inverse_scale, next_state
from cupy_amp.state import Verdict
from cupy_amp.twins import grad_stats
from cupy_amp.twins.grad_stats import HostStatsRecord, Numerics
from cupy_amp.twins.scale_loss import scale_loss
from cupy_amp.twins.unscale_check import unscale_check

__all__ = ["HostState"]


class HostState:
    """A scaler's state on the host: the reference for :class:`~cupy_amp.gpu.device_state.DeviceState`.

    The same operations with the same meaning, for NumPy arrays (and for a
    scaler that has met no array yet): ``finite`` is a 0-d bool array to gate
    updates with, and :meth:`update` is :func:`~cupy_amp.rule.next_state` itself.
    Nothing here is asynchronous, so every read is immediate.
    """

    device = -1

    def __init__(
        self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, capacity: int = 0
    ) -> None:
        self._journal = np.zeros(capacity, dtype=journal.ENTRY)  # the ring: step n at slot (n - 1) % capacity
        # The open step's culprits (count, first (call, position)) and last finished check, for its entry.
        self._culprits, self._checked = 0, -1
        self._first_culprit: tuple[int, int] | None = None
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
        # That check's numbers for the journal (amax, zero and subnormal fractions, call, position), taken when
        # its statistics are finished, and the epoch they belong to (kernels/grad_stats.cu: finish_stats).
        self._pending: tuple[float, float, float, int, int] | None = None
        self._report: tuple[float, float, float, int, int] = (np.nan, np.nan, np.nan, -1, -1)
        self._reported = -1
        self.restore(config, state, overflow, local, epoch)

    def read(self) -> Verdict:
        """Return the step's verdict (garbage votes raise at once here: the host reads every answer)."""
        return Verdict(not bool(self._finite), self._found, self._epoch, 0, self._poisoned, self._norm())

    def _norm(self) -> float:
        """The open step's check() norm once its statistics are finished, else NaN."""
        return float(self.stats.norm) if self._checked == self._epoch else math.nan

    def new_bad_votes(self, counted: int) -> int:
        """The host raises at every impossible answer (:meth:`finish_vote`): none is left to hand out."""
        return 0

    def snapshot(self) -> tuple[ScalerState, bool, bool, int, int, bool]:
        """Return (state, the step's verdict, this rank's own overflow, epoch, garbage votes (always 0), poisoned)."""
        return self._state, not bool(self._finite), self._found, self._epoch, 0, self._poisoned

    def restore(
        self, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, reopen: bool = False
    ) -> None:
        # ``reopen`` changes nothing here: the NumPy update() never begins the next step itself.
        self.stats.record.closed()
        self.skip_statistics()
        self._finite[()] = not overflow
        self._config, self._state, self._found, self._epoch, self._updated = config, state, local, epoch, -1
        # The open step's culprits stay (the step and its epoch do): a repair mid-step keeps them for its entry.

    def scale_loss(self, loss: np.ndarray) -> None:
        scale_loss(loss, np.float32(self._state.scale))

    def keep_culprits(self, count: int, first: tuple[int, int] | None) -> None:
        """Set the open step's culprits for its journal entry (what the host read of them, after a repair)."""
        self._culprits, self._first_culprit = count, first

    def begin_step(self) -> None:
        self.stats.record.closed()  # the step opens: its record says "skip" until its check() completes
        self.skip_statistics()
        self._epoch = self._epoch % (2**32 - 1) + 1
        self._finite[()] = not self._poisoned  # before _found: a reader never sees an overflow without its origin
        self._found = False
        self._culprits, self._first_culprit = 0, None

    def unscale(self, call: Any, number: int = 0) -> tuple[int, ...]:
        """Check every array for inf/nan, then multiply it by the inverse scale in place, one at a time.

        ``number``: the call's number in the step, for the journal's first culprit.
        """
        culprits = unscale_check(call.arrays, inverse_scale(self._state.scale))
        self._count(culprits, number)
        return culprits

    def _count(self, culprits: tuple[int, ...], number: int) -> None:
        """Count a call's culprits for the journal (the first, by call and position, kept), and the overflow."""
        if culprits:
            first = (number, min(culprits))
            self._culprits, self._first_culprit = (  # one statement: an interrupt leaves both or neither
                self._culprits + len(culprits),
                first if self._first_culprit is None else min(self._first_culprit, first),
            )
            self.mark_overflow()

    def prepare(self, call: Any) -> None:
        """Nothing to set aside on the host."""

    def check(self, call: Any, max_norm: float, voting: bool, report: bool = False, number: int = 0) -> tuple[int, ...]:
        """Read a parsed call's statistics; return the positions of the arrays that held inf/nan.

        With ``voting``, the record is finished by :meth:`vote_sums` and
        :meth:`finish_vote`; with ``report``, the numerics report is taken too (:meth:`numerics`).
        """
        self._pending = None
        if report:
            self._numerics = [grad_stats.numerics(position, array) for position, array in enumerate(call.arrays)]
            self._pending = journal.report_of(self._numerics, number)
        culprits, total = grad_stats.sums(call.arrays)
        self._count(culprits, number)
        if voting:
            self._own = total
        else:
            self._finish(total, max_norm, bool(culprits))
        return culprits

    def _finish(self, total: float, max_norm: float, overflow: bool, own: float | None = None) -> None:
        grad_stats.finish(
            self.stats.memory, total, inverse_scale(self._state.scale), max_norm, self._found, overflow, own
        )
        # Marked last, as the device writes the epochs after the numbers: an interrupt before leaves the step
        # unchecked (NaN in its entry), never checked with the last step's norm.
        if self._pending is not None:
            self._report, self._reported = self._pending, self._epoch
        self._checked = self._epoch

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

    def update(self, step: int | None = None) -> None:
        """Close the step (its record says "skip"), applying the rule once: a retry after an interrupted
        ``update()`` changes nothing more.

        ``step``: the device begins the next step in the same launch (to save
        one); here a begin costs nothing, so it stays at the step's first call.
        """
        self.stats.record.closed()
        self.skip_statistics()
        if self._updated != self._epoch and not self._poisoned:  # poisoned: the ranks may disagree, decide nothing
            before, overflow = self._state, not bool(self._finite)
            after = next_state(self._config, before, overflow, self._found, self._norm())
            if len(self._journal):  # first: an entry past the state's steps is not read, and a retry rewrites it
                self._write_journal(before, after, overflow)
            self._state, self._updated = after, self._epoch

    def _write_journal(self, before: ScalerState, after: ScalerState, overflow: bool) -> None:
        """Write the closed step's entry at its slot, as ``write_journal`` does on the device."""
        checked = self._checked == self._epoch
        call, position = self._first_culprit or (-1, -1)
        amax, zeros, subnormals, amax_call, amax_position = (
            self._report if self._reported == self._epoch else (np.nan, np.nan, np.nan, -1, -1)
        )
        self._journal[(after.steps - 1) % len(self._journal)] = (
            after.steps, before.scale, after.scale,
            self.stats.norm if checked else np.nan, self.stats.clip_coefficient if checked else np.nan,
            self._culprits, call, position, self._found, overflow,
            journal.action_of(self._config, before, after, overflow),
            amax, zeros, subnormals, amax_call, amax_position,
        )  # fmt: skip

    def journal(self) -> np.ndarray:
        """Return the journal's entries, oldest first."""
        return journal.entries(self._journal, self._state.steps)

    def load_journal(self, chosen: np.ndarray) -> None:
        """Replace the journal by ``chosen`` (entries sorted by step; the newest that fit are kept)."""
        self._journal = journal.place(len(self._journal), chosen)

    def follow(self) -> None:
        """Nothing to order on the host."""

    def capturing(self) -> bool:
        """The host records no CUDA graphs."""
        return False

    def culprits(self, plan: Any, epoch: int) -> tuple[int, ...]:
        """The host knows every call's culprits at once (the step keeps them): nothing to read."""
        return ()
