"""The NumPy backend: validation and placement for NumPy arrays, over the kernels' NumPy twins.

A scaler's state for NumPy arrays is :class:`cupy_amp.twins.step_state.HostState`; its numerics
are the twins of :mod:`cupy_amp.twins` (the reference implementation). Nothing here is asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cupy_amp.rule import ScalerConfig, ScalerState
from cupy_amp.twins.step_state import HostState

__all__ = [
    "LAYOUT_FIXED",
    "NAME",
    "HostState",
    "as_array",
    "capturing",
    "location",
    "new_state",
    "prepare",
    "refuse_capture",
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
    device: int, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, capacity: int = 0
) -> HostState:
    """Return a host state (``device`` is -1) with a journal of ``capacity`` steps."""
    return HostState(config, state, overflow, local, epoch, capacity)


def prepare(arrays: Sequence[np.ndarray]) -> None:
    """NumPy needs no preparation."""
    return None
