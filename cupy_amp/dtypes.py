"""The floating-point dtypes cupy-amp handles, by name (bfloat16 needs the ``ml_dtypes`` package)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["bfloat16", "dtype_name", "is_bfloat16"]

_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


@functools.cache
def bfloat16() -> np.dtype[Any] | None:
    """Return the bfloat16 dtype of ``ml_dtypes`` (what CuPy 14 uses), or None when it cannot be imported.

    Not only when it is missing: an ml_dtypes built for NumPy 2 under NumPy 1.x (a Chainer environment)
    raises RuntimeError or SystemError on import, and then no bfloat16 array can exist either, so the
    rest of cupy-amp must go on working.
    """
    try:
        import ml_dtypes
    except Exception:  # any failure to import means "no bfloat16 here" (see above)
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
