"""The fused optimizers' argument checks: parameters, gradients and statistics, before any device work.

Parameters are NumPy or CuPy arrays of one kind, on one device, each with memory
of its own; a step's gradients match them one for one and share memory with
nothing the step writes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from cupy_amp.dtypes import dtype_name
from cupy_amp.errors import ArgumentTypeError, GradientTypeError, GradientValueError
from cupy_amp.gpu import loaded_cupy
from cupy_amp.record import GradientStats

__all__ = ["PARAM_DTYPES", "expect_gradients", "expect_params", "expect_stats", "refuse_shared"]

PARAM_DTYPES = ("float16", "bfloat16", "float32")


def expect_params(params: list[Any]) -> tuple[Any, int]:
    """Return (array module, device: -1 for the host) of valid parameters.

    Raises:
        GradientTypeError: Not NumPy/CuPy float16/bfloat16/float32 arrays of one kind.
        GradientValueError: Read-only, not C-contiguous, misaligned, on several devices, or sharing memory.
    """
    kinds = set()
    cupy = loaded_cupy()
    for index, p in enumerate(params):
        module = "numpy" if isinstance(p, np.ndarray) else "cupy" if cupy and isinstance(p, cupy.ndarray) else None
        if module is None:
            raise GradientTypeError(f"params[{index}]: expected a NumPy or CuPy array, got {type(p).__name__}.")
        if dtype_name(p.dtype) not in PARAM_DTYPES:
            raise GradientTypeError(
                f"params[{index}]: dtype {p.dtype} is not supported (expected float16, bfloat16 or float32)."
            )
        if not p.flags.c_contiguous or not _aligned(p) or (module == "numpy" and not p.flags.writeable):
            raise GradientValueError(f"params[{index}]: must be a writable, aligned, C-contiguous array.")
        kinds.add(module)
    if len(kinds) > 1:
        raise GradientTypeError("params mix NumPy and CuPy arrays; pass arrays of one kind.")
    if kinds == {"numpy"}:
        xp, devices = np, {-1}
    else:
        xp = cupy
        devices = {p.data.device_id for p in params}
    if len(devices) > 1:
        raise GradientValueError(f"params are on several devices {sorted(devices)}; use one optimizer per device.")
    _refuse_overlap([(_address(p), p.nbytes, f"params[{i}]") for i, p in enumerate(params)])
    return xp, devices.pop()


def expect_stats(stats: GradientStats | None, device: int) -> None:
    """Raise unless ``stats`` is None or the GradientStats of a check() on the parameters' ``device``."""
    if stats is None:
        return
    if not isinstance(stats, GradientStats):
        raise ArgumentTypeError(f"stats: expected the GradientStats of a scaler's check(), got {type(stats).__name__}.")
    if stats.device != device:
        ours, theirs = _where(device), _where(stats.device)
        raise ArgumentTypeError(
            f"stats: this optimizer's parameters are on {ours}; the check() that made these statistics ran on {theirs}."
        )


def expect_gradients(grads: list[Any], params: list[Any], device: int) -> None:
    """Raise unless ``grads`` are one array per parameter, of its type, dtype and shape, where the step reads them."""
    if len(grads) != len(params):
        raise ArgumentTypeError(f"Expected {len(params)} gradients (one per parameter), got {len(grads)}.")
    for index, (g, p) in enumerate(zip(grads, params)):
        if type(g) is not type(p):
            raise GradientTypeError(f"gradients[{index}]: expected a {type(p).__name__}, got {type(g).__name__}.")
        if g.dtype != p.dtype or g.shape != p.shape:
            raise GradientTypeError(
                f"gradients[{index}]: expected {p.dtype} of shape {p.shape} (its parameter's), got {g.dtype} of "
                f"shape {g.shape}."
            )
        if not g.flags.c_contiguous or not _aligned(g) or (device >= 0 and g.data.device_id != device):
            raise GradientValueError(
                f"gradients[{index}]: must be aligned, C-contiguous and on the parameters' device."
            )


def refuse_shared(grads: list[Any], params: list[Any], state: Iterable[list[Any]]) -> None:
    """Raise if a gradient shares memory with another or with anything the step writes."""
    ranges = [(_address(g), g.nbytes, f"gradients[{i}]") for i, g in enumerate(grads)]
    ranges += [(_address(p), p.nbytes, f"params[{i}]") for i, p in enumerate(params)]
    for buffers in state:
        ranges += [(_address(b), b.nbytes, "the optimizer's state") for b in buffers if b is not None]
    _refuse_overlap(ranges)


def _aligned(array: Any) -> bool:
    """Whether the array's address is a multiple of its itemsize (the GPU cannot load it otherwise)."""
    return _address(array) % array.itemsize == 0 and (not isinstance(array, np.ndarray) or array.flags.aligned)


def _where(device: int) -> str:
    return "the host" if device < 0 else f"device {device}"


def _address(array: Any) -> int:
    return int(array.__array_interface__["data"][0]) if isinstance(array, np.ndarray) else int(array.data.ptr)


def _refuse_overlap(ranges: list[tuple[int, int, str]]) -> None:
    """Raise if two of the (address, bytes, name) ranges overlap."""
    ordered = sorted((start, start + size, name) for start, size, name in ranges if size)
    for (_, end, name), (start, _, other) in itertools.pairwise(ordered):
        if start < end:
            raise GradientValueError(f"{name} and {other} share memory; each must have its own.")
