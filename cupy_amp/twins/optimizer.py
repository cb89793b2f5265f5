"""The NumPy twin of ``kernels/optimizer.cuh``: what every fused optimizer's twin shares.

An optimizer's scalar state is one record (its struct in ``kernels/<kind>.cu``,
mirrored in :mod:`cupy_amp.kernel_interface`; the CuPy path keeps it in device
memory). Each optimizer's twin (:mod:`cupy_amp.twins.adamw`, :mod:`cupy_amp.twins.sgd`)
opens a step on it with :func:`open_step`, then derives the float32 constants in
float64, rounded once, and applies the step to float32 arrays in place, one
correctly rounded float32 operation at a time, in the kernel's order (NumPy
neither fuses nor flushes subnormals; the kernels use explicit PTX for both):
the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ONE", "fma32", "open_step"]

ONE = np.uint64(1)  # the step counter's increment: uint64 with uint64 is uint64 on every NumPy


def fma32(a: Any, b: Any, c: Any) -> np.ndarray:
    """Return ``a * b + c`` for float32 operands, rounded once to float32 (a fused multiply-add, as PTX's fma.rn.f32).

    The product is exact in float64; the sum is rounded to float64 "to odd"
    (to the neighbour with an odd last bit when inexact, using the exact error
    from TwoSum), which makes the final rounding to float32 the correct one.
    """
    a64, b64, c64 = (np.asarray(x, dtype=np.float32).astype(np.float64) for x in (a, b, c))
    product = a64 * b64
    total = product + c64
    virtual = total - product
    error = (product - (total - virtual)) + (c64 - virtual)
    even = (total.view(np.int64) & 1) == 0
    toward = np.where(error > 0, np.inf, -np.inf)
    return np.where((error != 0) & even, np.nextafter(total, toward), total).astype(np.float32)


def open_step(record: np.ndarray, skip: bool, factor: np.float32) -> bool:
    """Take the step's skip flag and gradient factor into ``record``; return whether the step applies."""
    record["skip"] = skip
    record["factor"] = factor
    return not skip
