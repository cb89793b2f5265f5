"""A step's claims on gradient memory: what its ``unscale_and_check`` calls unscaled, so nothing is unscaled twice."""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from typing import NamedTuple

from cupy_amp.errors import DuplicateGradientError
from cupy_amp.gradients import describe, shares_memory
from cupy_amp.state import Call, Footprint

__all__ = ["StepClaims"]


class _Claim(NamedTuple):
    footprint: Footprint
    label: Hashable
    call: int


class StepClaims:
    """The memory every ``unscale_and_check`` call of the open step unscaled, to refuse unscaling it twice.

    Holds the calls' arrays, so that no memory they cover is freed and reused
    by a new array while the step is open. The first call is kept as it is
    (the usual step has one); from the second on, claims are indexed by
    address in disjoint blocks, so each further call costs a few bisections
    per array, however many calls the step has.
    """

    def __init__(self) -> None:
        self._calls: list[Call] = []
        self._starts: list[int] = []  # block starts, sorted
        self._blocks: list[tuple[int, list[_Claim]]] = []  # (block stop, claims inside)

    def __len__(self) -> int:
        return len(self._calls)

    def with_call(self, call: Call) -> StepClaims:
        """Return these claims and ``call``'s memory, as new claims (these are left as they are).

        The step swaps the result in with one assignment, so an interrupt while
        indexing leaves the claims it had, whole.

        Raises:
            DuplicateGradientError: An array of ``call`` shares memory with one an
                earlier call of this step unscaled.
        """
        claims = StepClaims()
        claims._starts, claims._blocks = list(self._starts), list(self._blocks)  # indexing edits these lists only
        if self._calls:
            if len(self._calls) == 1:
                claims._index(self._calls[0], 0)
            claims._check(call)
            claims._index(call, len(self._calls))
        claims._calls = [*self._calls, call]
        return claims

    def _check(self, call: Call) -> None:
        for label, footprint in zip(call.labels, call.footprints):
            first = max(bisect.bisect_right(self._starts, footprint.start) - 1, 0)
            last = bisect.bisect_left(self._starts, footprint.stop)
            for stop, claims in self._blocks[first:last]:
                if stop <= footprint.start:
                    continue
                for old in claims:
                    overlapping = old.footprint.stop > footprint.start and old.footprint.start < footprint.stop
                    if overlapping and shares_memory(old.footprint, footprint):
                        raise DuplicateGradientError(
                            f"{describe(label)} shares memory with {describe(old.label)}, which an earlier "
                            f"unscale_and_check call of this step (call {old.call + 1}) already unscaled; "
                            f"unscaling it again would divide it twice. Call update() to end the step first, "
                            f"or pass each gradient to one call only."
                        )

    def _index(self, call: Call, number: int) -> None:
        for label, footprint in zip(call.labels, call.footprints):
            if footprint.stop <= footprint.start:
                continue
            start, stop = footprint.start, footprint.stop
            first = max(bisect.bisect_right(self._starts, start) - 1, 0)
            if first < len(self._blocks) and self._blocks[first][0] <= start:
                first += 1
            last = bisect.bisect_left(self._starts, stop)
            claims = [_Claim(footprint, label, number)]
            if first < last:  # merge every block the new extent touches into one
                start = min(start, self._starts[first])
                stop = max(stop, max(block_stop for block_stop, _ in self._blocks[first:last]))
                for _, merged in self._blocks[first:last]:
                    claims += merged
            self._starts[first:last] = [start]
            self._blocks[first:last] = [(stop, claims)]
