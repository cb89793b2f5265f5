"""The NumPy twin of ``kernels/scale_loss.cu``: a loss multiplied by the scale in place.

float16 and float32 arrays are multiplied in float32 and rounded back to their dtype; float64 arrays in
float64 (:func:`multiply`, which the unscale uses too).
"""

from __future__ import annotations

import numpy as np

__all__ = ["multiply", "scale_loss"]


def scale_loss(loss: np.ndarray, factor: np.float32) -> None:
    """Multiply ``loss`` by ``factor`` in place."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        multiply(loss, factor)


def multiply(array: np.ndarray, factor: np.float32) -> None:
    if array.dtype == np.float64:
        np.multiply(array, np.float64(factor), out=array)
    else:
        np.multiply(array, factor, out=array, dtype=np.float32, casting="same_kind")
