"""The read-only statistics pass: its result, and its NumPy reference.

``check(gradients, max_norm=...)`` on either scaler reads every gradient once,
without writing it, and yields the step's overflow verdict, which gradients
held inf/nan, and the global L2 norm of the *unscaled* gradients, with the clip
coefficient ``min(1, max_norm / (norm + 1e-6))``. The squares are summed in
float64 (no finite float16/float32 gradient can overflow the sum). On the GPU
the sum is reduced in a fixed order (the same bits on every run); on the host
NumPy sums it (within the last bit of float32 of the GPU's norm). The
optimizers of :mod:`cupy_amp.optim` read the factor ``inv_scale *
clip_coefficient`` and the skip flag from the record, on the device; its layout
is :data:`cupy_amp.kernel_interface.STATS`, and :mod:`cupy_amp.record` owns it
(and :class:`~cupy_amp.record.GradientStats`, what ``check()`` returns).

``check(gradients, report=True)`` also takes a numerics report in the same read
(:class:`GradientNumerics` per gradient, from ``scaler.gradient_numerics()``):
the largest finite magnitude, the count of zeros and of subnormals. On the GPU
a max and integer sums, in any order the same. The NumPy twins of the pass (the sums, the report, the
finished record) are in :mod:`cupy_amp.twins.grad_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from cupy_amp.errors import ConfigError
from cupy_amp.validation import is_real

__all__ = ["GradientNumerics", "expect_max_norm"]

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def expect_max_norm(max_norm: object) -> float:
    """Return ``max_norm`` rounded to float32 (what the kernels receive); 0.0 stands for None (no clipping).

    Raises:
        ConfigError: Not None and not a finite number > 0 that float32 holds as a normal number.
    """
    if max_norm is None:
        return 0.0
    try:
        value = float(max_norm) if is_real(max_norm) else math.nan  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float64
        value = math.nan
    if not _FLOAT32_TINY <= value <= _FLOAT32_MAX:
        raise ConfigError(f"Invalid 'max_norm': expected None or a finite number > 0 (float32), got {max_norm!r}.")
    return float(np.float32(value))


class GradientNumerics(NamedTuple):
    """What one gradient's values looked like in a step, from ``check(gradients, report=True)``.

    Read the values as given to ``check()``: still multiplied by the step's
    scale. A rising ``subnormal_fraction`` or ``zero_fraction`` as the scale
    falls is underflow (precision lost); an ``amax`` near the dtype's largest
    value (65504 for float16) is the gradient that will overflow first.

    Attributes:
        label: The gradient's position in the argument, or its key in a mapping.
        dtype: Its dtype.
        size: Its element count.
        amax: The largest finite magnitude (0.0 when there is none).
        zeros: The count of elements equal to 0.
        subnormals: The count of nonzero elements below the dtype's smallest normal number.
        nonfinite: Whether it held inf/nan (as ``nonfinite_gradients()`` names it).
    """

    label: Hashable
    dtype: np.dtype[Any]
    size: int
    amax: float
    zeros: int
    subnormals: int
    nonfinite: bool

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.size if self.size else 0.0

    @property
    def subnormal_fraction(self) -> float:
        return self.subnormals / self.size if self.size else 0.0
