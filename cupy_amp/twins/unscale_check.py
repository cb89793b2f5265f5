"""The NumPy twin of ``kernels/unscale_check.cu``: each gradient checked for inf/nan, then unscaled in place."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cupy_amp.twins.scale_loss import multiply

__all__ = ["unscale_check"]


def unscale_check(arrays: Sequence[np.ndarray], inverse: np.float32) -> tuple[int, ...]:
    """Check each array for inf/nan (before it is written), multiply it by ``inverse`` in place, one at a time;
    return the positions of the arrays that held inf/nan."""
    culprits = []
    # Over/underflow and inf * 0 are expected results here, not warnings.
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for position, array in enumerate(arrays):
            if not np.isfinite(array).all():
                culprits.append(position)
            multiply(array, inverse)
    return tuple(culprits)
