"""Recognise a gradient argument seen in an earlier step, to skip redoing its setup.

Training loops pass the same gradient arrays every step. When every entry of
a list, tuple or dict is identical (the same objects, in the same order,
under the same keys) to a call seen before, the earlier validation and the
backend's prepared launch plan (for CuPy: device tables) are reused. Entries
are held through weak references, so the cache never keeps a gradient alive.

Lists are compared as vectors of entry addresses (see
:mod:`cupy_amp.entry_addresses`) rather than entry by entry in Python. A
weak-reference callback marks a record dead as soon as any recorded entry is
freed (before its address can be reused), so equal addresses on a live record
mean the very same objects.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from cupy_amp import entry_addresses
from cupy_amp.array_backend import ArrayBackend, UnscalePlan
from cupy_amp.gradients import GradientBatch, GradientSet

__all__ = ["PreparedCall", "PreparedCallCache"]


# Marks a prepared call made for a GradientSet (its one reference is to the set itself).
_SET_KEY = ("<GradientSet>",)


def _none_ref() -> None:
    return None


@dataclass(frozen=True)
class PreparedCall:
    """A validated gradient argument and the backend's plan for it."""

    labels: tuple[Hashable, ...]
    backend: ArrayBackend
    plan: UnscalePlan
    keys: tuple[Hashable, ...] | None
    refs: tuple[Any, ...]
    none_count: int
    alive: list[bool]  # set to [False] by a weak-reference callback when any entry dies
    addresses: bytes | None = None  # every entry's address, when compared that way

    def matches(self, keys: tuple[Hashable, ...] | None, entries: tuple[Any, ...]) -> bool:
        """Return True if ``entries`` (and ``keys``) are exactly the ones this call was prepared for."""
        # A dead weak reference gives None, which must not pass for a None entry, and a dead
        # entry's address may be reused: hence `alive`.
        if not self.alive[0] or len(entries) != len(self.refs) or keys != self.keys:
            return False
        if self.addresses is not None:
            return entry_addresses.entry_addresses(entries) == self.addresses
        return all(map(operator.is_, entries, [ref() for ref in self.refs]))


class PreparedCallCache:
    """The few most recent gradient arguments (one per optimizer, say) and their plans."""

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._calls: list[PreparedCall] = []

    def lookup(self, gradients: Any) -> tuple[PreparedCall, tuple[Any, ...]] | None:
        """Return the prepared call and its arrays if ``gradients`` was seen before, else None."""
        if type(gradients) is GradientSet:
            return self._lookup_set(gradients)
        split = _split(gradients)
        if split is None:
            return None
        keys, values = split
        entries = tuple(values)  # no copy when already a tuple
        for index, prepared in enumerate(self._calls):
            if prepared.matches(keys, entries):
                arrays = tuple(v for v in entries if v is not None) if prepared.none_count else entries
                return self._hit(index, arrays)
        return None

    def _lookup_set(self, gradients: GradientSet) -> tuple[PreparedCall, tuple[Any, ...]] | None:
        # A GradientSet is immutable: the same object means the same arrays, checked in O(1).
        for index, prepared in enumerate(self._calls):
            if prepared.keys == _SET_KEY and prepared.refs[0]() is gradients:
                return self._hit(index, gradients.batch.arrays)
        return None

    def _hit(self, index: int, arrays: tuple[Any, ...]) -> tuple[PreparedCall, tuple[Any, ...]] | None:
        """Return the prepared call at ``index`` (moved to the front) if its plan still fits ``arrays``."""
        prepared = self._calls.pop(index)
        if not prepared.plan.still_valid(arrays):
            return None
        self._calls.insert(0, prepared)
        return prepared, arrays

    def store(self, gradients: Any, batch: GradientBatch, plan: UnscalePlan) -> PreparedCall | None:
        """Remember a freshly validated call, when its argument can be recognised later."""
        if type(gradients) is GradientSet and batch.native and batch.backend is not None:
            prepared = PreparedCall(batch.labels, batch.backend, plan, _SET_KEY, (weakref.ref(gradients),), 0, [True])
            self._remember(prepared)
            return prepared
        split = _split(gradients)
        if split is None or not batch.native or batch.backend is None:
            return None  # a wrapped foreign array may change its memory behind the same object
        keys, values = split
        alive = [True]

        def entry_died(_: object) -> None:
            alive[0] = False

        prepared = PreparedCall(
            labels=batch.labels,
            backend=batch.backend,
            plan=plan,
            keys=keys,
            refs=tuple(_none_ref if v is None else weakref.ref(v, entry_died) for v in values),
            none_count=sum(v is None for v in values),
            alive=alive,
            # One memcmp per lookup where the interpreter allows it, else entry by entry (~40 ns each).
            addresses=entry_addresses.entry_addresses(tuple(values)) if entry_addresses.available() else None,
        )
        self._remember(prepared)
        return prepared

    def _remember(self, prepared: PreparedCall) -> None:
        self._calls.insert(0, prepared)
        del self._calls[self._capacity :]

    def clear(self) -> None:
        """Forget every prepared call."""
        self._calls.clear()


def _split(gradients: Any) -> tuple[tuple[Hashable, ...] | None, Any] | None:
    kind = type(gradients)
    if kind is list or kind is tuple:
        return None, gradients
    if kind is dict:
        return tuple(gradients), tuple(gradients.values())
    return None
