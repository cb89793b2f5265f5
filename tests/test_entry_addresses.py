"""entry_addresses tells tuples of the same objects from tuples of other objects."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from cupy_amp import entry_addresses


def test_readable_on_cpython() -> None:
    assert (sys.implementation.name == "cpython") == entry_addresses.available()


@pytest.mark.skipif(not entry_addresses.available(), reason="needs CPython's tuple layout")
class TestOnCPython:
    def test_addresses_are_the_ids_of_the_entries(self) -> None:
        entries = (np.ones(2), None, np.zeros(3))
        packed = entry_addresses.entry_addresses(entries)
        assert [int.from_bytes(packed[i : i + 8], sys.byteorder) for i in range(0, len(packed), 8)] == [
            id(entry) for entry in entries
        ]

    def test_same_objects_from_a_list_and_a_tuple_give_equal_addresses(self) -> None:
        arrays = [np.ones(2) for _ in range(300)]
        assert entry_addresses.entry_addresses(tuple(arrays)) == entry_addresses.entry_addresses(tuple(list(arrays)))

    @pytest.mark.parametrize("change", ["swap", "replace", "drop", "append", "copy"])
    def test_any_other_entries_give_other_addresses(self, change: str) -> None:
        arrays = [np.ones(2) for _ in range(5)]
        other = list(arrays)
        if change == "swap":
            other[1], other[3] = other[3], other[1]
        elif change == "replace":
            other[2] = np.ones(2)
        elif change == "drop":
            other.pop()
        elif change == "append":
            other.append(arrays[0])
        else:  # equal values, other objects
            other = [array.copy() for array in arrays]
        assert entry_addresses.entry_addresses(tuple(arrays)) != entry_addresses.entry_addresses(tuple(other))

    def test_empty_tuple_gives_empty_addresses(self) -> None:
        assert entry_addresses.entry_addresses(()) == b""


def test_refuses_where_the_layout_does_not_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entry_addresses, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"check available\(\) first"):
        entry_addresses.entry_addresses((1, 2))
