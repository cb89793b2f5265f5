"""The CuPy backend: what the scalers ask of CuPy arrays (the :class:`cupy_amp.state.Backend` protocol).

Validation (:func:`as_array`, :func:`write_problem`), placement
(:func:`location`), the device tables of a call (:func:`prepare`, over
:mod:`cupy_amp.gpu.tables`), CUDA graph capture, and a scaler's state in
device memory (:func:`new_state`: :class:`cupy_amp.gpu.device_state.DeviceState`,
which holds the launches that step it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy

from cupy_amp.gpu.device_state import DeviceState
from cupy_amp.gpu.launch import capturing, refuse_capture
from cupy_amp.gpu.tables import GradientGroup, gradient_tables
from cupy_amp.kernel_interface import MAX_NDIM
from cupy_amp.rule import ScalerConfig, ScalerState

__all__ = [
    "LAYOUT_FIXED",
    "NAME",
    "as_array",
    "capturing",
    "location",
    "new_state",
    "prepare",
    "refuse_capture",
    "write_problem",
]

NAME = "cupy"
# A CuPy array's strides, dtype and memory are fixed for its life (a new shape keeps the same
# elements), so a call validated once stays valid while the same array objects come back.
LAYOUT_FIXED = True


def as_array(obj: Any) -> Any | None:
    """Return ``obj`` as a CuPy array (zero-copy), or None if it is not a CUDA array."""
    if isinstance(obj, cupy.ndarray):
        return obj
    try:
        if hasattr(obj, "__cuda_array_interface__"):
            return cupy.asarray(obj)
        if hasattr(obj, "__dlpack__"):
            return cupy.from_dlpack(obj)
    except Exception:  # not a CUDA array after all (a CPU DLPack tensor, one that needs grad...)
        return None
    return None


def write_problem(array: cupy.ndarray, source: Any) -> str | None:
    """Return why the kernels cannot write ``array`` in place, or None."""
    interface = getattr(source, "__cuda_array_interface__", None) if source is not array else None
    if interface is not None and interface["data"][1]:
        return f"its {type(source).__name__} exports the memory as read-only"
    itemsize = array.itemsize
    if array.data.ptr % itemsize or any(stride % itemsize for stride in array.strides):
        return (
            f"its address {array.data.ptr:#x} or strides {array.strides} are not multiples of its itemsize "
            f"{itemsize} (misaligned), which the GPU cannot access"
        )
    if array.ndim > MAX_NDIM:
        return f"it has {array.ndim} dimensions, more than the kernels' {MAX_NDIM}"
    return None


def location(array: cupy.ndarray) -> tuple[int, int]:
    """Return (address of element [0, ..., 0], device id)."""
    return array.data.ptr, array.data.device_id


def prepare(arrays: Sequence[cupy.ndarray]) -> tuple[GradientGroup, ...]:
    """Describe ``arrays`` in device tables, one per (device, dtype) group (:mod:`cupy_amp.gpu.tables`)."""
    return gradient_tables(arrays)


def new_state(
    device: int, config: ScalerConfig, state: ScalerState, overflow: bool, local: bool, epoch: int, capacity: int = 0
) -> DeviceState:
    """Return a scaler state in ``device``'s memory, with a journal of ``capacity`` steps (allocates and
    synchronizes: never inside a capture)."""
    return DeviceState(device, config, state, overflow, local, epoch, capacity)
