"""The floating-point dtypes cupy-amp handles, by name (bfloat16 needs the ``ml_dtypes`` package)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["bfloat16", "dtype_name", "is_bfloat16"]

_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


@functools.cache
def bfloat16() -> np.dtype[Any] | None:
    """Return the bfloat16 dtype of ``ml_dtypes`` (what CuPy 14 uses), or None when it is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Return True for ml_dtypes' bfloat16 (never compare with ``bfloat16()`` directly: NumPy reads None as float64)."""
    bf16 = bfloat16()
    return bf16 is not None and dtype == bf16


def dtype_name(dtype: np.dtype[Any]) -> str | None:
    """Return "float16", "bfloat16", "float32" or "float64" for a supported dtype, else None."""
    name = _NAMES.get(dtype)
    if name is None and is_bfloat16(dtype):
        return "bfloat16"
    return name
