"""Helpers shared by the test modules: bit-level comparison and reading a demo run's saved arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["assert_same_bits", "bits", "capture", "saved_arrays"]


def bits(array: Any) -> np.ndarray:
    """Return the raw bits of a NumPy or CuPy float array as unsigned integers (C order, on the host)."""
    host = np.ascontiguousarray(array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array)
    return host.view(f"u{host.itemsize}")


def assert_same_bits(actual: Any, expected: Any) -> None:
    """Assert two arrays (NumPy or CuPy, or None) have the same dtype, shape and bits, NaN payloads included."""
    if expected is None:
        assert actual is None
        return
    assert actual is not None
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(bits(actual), bits(expected))


def saved_arrays(directory: Path) -> dict[str, np.ndarray]:
    """Return every array of a demo run's state.npz."""
    with np.load(directory / "state.npz", allow_pickle=False) as npz:
        return {key: npz[key] for key in npz.files}


def capture(stream: Any, step: Any) -> Any:
    """Record ``step()`` on a CuPy ``stream`` as a CUDA graph and return the graph (the capture always ends)."""
    stream.begin_capture()
    try:
        step()
    finally:
        graph = stream.end_capture()
    return graph
