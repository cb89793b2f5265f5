"""Which backend (NumPy or CuPy) handles an array, and what a backend provides.

The scaler talks only to the :class:`ArrayBackend` protocol; the CuPy backend
is imported the first time a CuPy (or CUDA-array-interface) object shows up,
so ``import cupy_amp`` never imports CuPy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

__all__ = ["ArrayBackend", "OverflowCheck", "UnscalePlan", "backend_for", "byte_extent", "register_array_type"]


class OverflowCheck(Protocol):
    """The result of one fused unscale-and-check, possibly still on the device."""

    def found_overflow(self) -> bool:
        """Return the verdict: True if any element was inf/nan, on any rank when voting."""
        ...

    def local_overflow(self) -> bool:
        """Return True if this process's own arrays held inf/nan."""
        ...

    def nonfinite_positions(self) -> list[int]:
        """Return the positions, among the arrays checked, of those holding inf/nan."""
        ...


class UnscalePlan(Protocol):
    """What a backend prepared for one list of gradients, reusable while they stay the same."""

    def still_valid(self, arrays: Sequence[Any]) -> bool:
        """Return True if the plan still fits ``arrays`` (the same objects it was made for)."""
        ...

    def run(self, arrays: Sequence[Any], inv_scale: Any, vote: Any = None) -> OverflowCheck:
        """Check every array for inf/nan, then multiply it by ``inv_scale`` in place.

        With a ``vote`` (see :mod:`cupy_amp.distributed`), the local overflow flag
        is combined with every rank's before the verdict is read back.
        """
        ...


class ArrayBackend(Protocol):
    """The array operations the scaler needs, for one array library."""

    name: str

    def coerce(self, obj: Any) -> Any | None:
        """Return ``obj`` as this backend's array (zero-copy), or None if it is not one."""
        ...

    def dtype_problem(self, array: Any) -> str | None:
        """Return why ``array``'s dtype is unsupported, or None if it is supported."""
        ...

    def write_problem(self, array: Any) -> str | None:
        """Return why ``array`` cannot be written in place, or None if it can."""
        ...

    def memory_extent(self, array: Any) -> tuple[Hashable, int, int]:
        """Return (memory domain, first byte, one past the last byte) of ``array``."""
        ...

    def shares_memory(self, first: Any, second: Any) -> bool:
        """Return True if the two arrays (whose extents overlap) share an element."""
        ...

    def scale_in_place(self, loss: Any, scale: Any) -> None:
        """Multiply ``loss`` by the float32 ``scale`` in place."""
        ...

    def prepare(self, arrays: Sequence[Any]) -> UnscalePlan:
        """Prepare the fused unscale-and-check of ``arrays`` (validated, non-empty)."""
        ...


# Backends by the exact type of their own array class, registered by each backend
# module when it is imported: the per-step fast path of backend_for.
_BACKEND_OF_TYPE: dict[type, ArrayBackend] = {}


def register_array_type(kind: type, backend: ArrayBackend) -> None:
    """Let ``backend_for`` hand objects of exactly ``kind`` to ``backend`` unchanged."""
    _BACKEND_OF_TYPE[kind] = backend


def backend_for(obj: Any) -> tuple[ArrayBackend, Any] | None:
    """Return the backend for ``obj`` and ``obj`` as that backend's array, or None."""
    known = _BACKEND_OF_TYPE.get(type(obj))
    if known is not None:
        return known, obj
    from cupy_amp.numpy_backend import NUMPY_BACKEND

    array = NUMPY_BACKEND.coerce(obj)
    if array is not None:
        return NUMPY_BACKEND, array
    if _looks_like_gpu_array(obj):
        from cupy_amp.cupy_backend import cupy_backend

        backend = cupy_backend()
        array = None if backend is None else backend.coerce(obj)
        if backend is not None and array is not None:
            return backend, array
    return None


def _looks_like_gpu_array(obj: Any) -> bool:
    # Checked without importing CuPy: a CuPy array, or anything exporting the
    # CUDA array interface or DLPack (a PyTorch CUDA tensor, for instance).
    module = type(obj).__module__ or ""
    return (
        module.startswith("cupy")
        or hasattr(obj, "__cuda_array_interface__")
        or (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"))
    )


def byte_extent(start: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """Return (first byte, one past the last byte) spanned by a strided array."""
    if 0 in shape:
        return start, start
    low = high = start
    for length, stride in zip(shape, strides):
        if stride < 0:
            low += (length - 1) * stride
        else:
            high += (length - 1) * stride
    return low, high + itemsize
