"""Each GPU state's culprit flags per gradient table: made once, kept apart per state, gone with the table.

Runs without a GPU: the state's host-side bookkeeping only, with stand-ins for device memory.
"""

from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

device_state = pytest.importorskip("cupy_amp.gpu.device_state")


class Flags:
    """Stands in for a flags array (weakly referable, unlike SimpleNamespace)."""

    def __init__(self, ptr: int, size: int, dtype: Any) -> None:
        self.data, self.size, self.dtype = SimpleNamespace(ptr=ptr), size, dtype


class Memory:
    """Stands in for a table's device memory: weakly referable, with an address."""

    def __init__(self) -> None:
        self.data = SimpleNamespace(ptr=id(self))


@pytest.fixture
def bare_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[int] = []

    def zeros(count: int, dtype: Any) -> Any:
        made.append(count)
        return Flags(1000 + len(made), count, np.dtype(dtype))

    monkeypatch.setattr(device_state.cupy, "zeros", zeros)
    monkeypatch.setattr(device_state, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(device_state, "refuse_capture", lambda what: None)

    def new() -> Any:
        state = object.__new__(device_state.DeviceState)
        state.device, state._culprit_flags = 0, {}
        return state

    new.made = made  # type: ignore[attr-defined]
    return new


def group(memory: Memory, tensors: int) -> Any:
    return SimpleNamespace(table=SimpleNamespace(memory=memory, sizes=(1,) * tensors))


def test_a_state_makes_its_flags_for_a_table_once(bare_state: Any) -> None:
    state, memory = bare_state(), Memory()
    first = state._flags(group(memory, 3))
    assert state._flags(group(memory, 3)) == first and bare_state.made == [3]


def test_two_states_over_one_table_get_flags_of_their_own(bare_state: Any) -> None:
    memory = Memory()
    one, two = bare_state(), bare_state()
    assert one._flags(group(memory, 2)) != two._flags(group(memory, 2))


def test_the_flags_go_with_their_table(bare_state: Any) -> None:
    state, memory = bare_state(), Memory()
    state._flags(group(memory, 4))
    assert len(state._culprit_flags) == 1
    del memory
    gc.collect()
    assert state._culprit_flags == {}


def test_a_dead_state_leaves_nothing_behind_for_its_tables(bare_state: Any) -> None:
    import weakref

    state, memory = bare_state(), Memory()
    state._flags(group(memory, 1))
    (entry,) = state._culprit_flags.values()
    flags, owner = weakref.ref(entry[1]), weakref.ref(state)
    del state, entry
    gc.collect()
    assert owner() is None and flags() is None  # the table's callback kept neither the state nor its flags
    del memory
    gc.collect()  # and the table's death after the state's is harmless
