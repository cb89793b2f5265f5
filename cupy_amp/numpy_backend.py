"""The NumPy backend: the reference implementation of the scaler's numerics.

float16 and float32 arrays are multiplied in float32 and rounded back to
their dtype; float64 arrays in float64. Overflow means any inf/nan in the
input, checked before unscaling.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_amp.array_backend import byte_extent, register_array_type

__all__ = ["NUMPY_BACKEND", "SUPPORTED_NUMPY_DTYPES", "NumpyBackend", "NumpyOverflowCheck", "NumpyUnscalePlan"]

SUPPORTED_NUMPY_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class NumpyOverflowCheck:
    """Per-array overflow flags, computed eagerly on the host, and the agreed verdict."""

    flags: tuple[bool, ...]
    overflow: bool

    def found_overflow(self) -> bool:
        """Return the verdict (already known: never synchronizes)."""
        return self.overflow

    def local_overflow(self) -> bool:
        """Return True if any of this process's arrays held inf/nan."""
        return any(self.flags)

    def nonfinite_positions(self) -> list[int]:
        """Return the positions of the arrays that held inf/nan."""
        return [position for position, flag in enumerate(self.flags) if flag]


class NumpyBackend:
    """Array operations on ``numpy.ndarray``."""

    name = "numpy"

    def coerce(self, obj: Any) -> np.ndarray | None:
        return obj if isinstance(obj, np.ndarray) else None

    def dtype_problem(self, array: np.ndarray) -> str | None:
        if array.dtype in SUPPORTED_NUMPY_DTYPES:
            return None
        return f"dtype {array.dtype} is not supported (expected float16, float32 or float64)"

    def write_problem(self, array: np.ndarray) -> str | None:
        return None if array.flags.writeable else "the array is read-only"

    def memory_extent(self, array: np.ndarray) -> tuple[Hashable, int, int]:
        start = array.__array_interface__["data"][0]
        return "host", *byte_extent(start, array.shape, array.strides, array.itemsize)

    def shares_memory(self, first: np.ndarray, second: np.ndarray) -> bool:
        try:
            return bool(np.shares_memory(first, second, max_work=10_000))  # type: ignore[arg-type]
        except np.exceptions.TooHardError:
            return True  # cannot prove them disjoint: treat as aliased

    def scale_in_place(self, loss: np.ndarray, scale: np.float32) -> None:
        _multiply_in_place(loss, scale)

    def prepare(self, arrays: Sequence[np.ndarray]) -> NumpyUnscalePlan:
        return NumpyUnscalePlan(tuple(array.dtype for array in arrays))


@dataclass(frozen=True)
class NumpyUnscalePlan:
    """NumPy needs no preparation; on reuse the plan re-checks what NumPy lets change in place."""

    dtypes: tuple[np.dtype, ...]

    def still_valid(self, arrays: Sequence[np.ndarray]) -> bool:
        return all(array.flags.writeable for array in arrays) and self.dtypes == tuple(a.dtype for a in arrays)

    def run(self, arrays: Sequence[np.ndarray], inv_scale: np.float32, vote: Any = None) -> NumpyOverflowCheck:
        flags = []
        for array in arrays:
            flags.append(not bool(np.isfinite(array).all()))
            _multiply_in_place(array, inv_scale)
        local = any(flags)
        return NumpyOverflowCheck(tuple(flags), vote.host_vote(local) if vote is not None else local)


def _multiply_in_place(array: np.ndarray, factor: np.float32) -> None:
    # Over/underflow and inf*0 are expected results here, not warnings.
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        if array.dtype == np.float64:
            np.multiply(array, np.float64(factor), out=array)
        else:
            np.multiply(array, factor, out=array, dtype=np.float32, casting="same_kind")


NUMPY_BACKEND = NumpyBackend()
register_array_type(np.ndarray, NUMPY_BACKEND)
