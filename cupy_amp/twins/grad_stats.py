"""The NumPy twin of ``kernels/grad_stats.cu``: the read-only statistics pass, its report, the finished record.

:func:`sums` is the pass (culprits and the float64 sum of squares), :func:`numerics` one gradient's
report, :func:`finish` the finishing kernel (norm, clip coefficient, factor, skip), and
:class:`HostStatsRecord` the record it fills, on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from cupy_amp.kernel_interface import STATS
from cupy_amp.record import StatsRecord

__all__ = ["CLIP_EPS", "HostStatsRecord", "Numerics", "finish", "numerics", "sums"]

CLIP_EPS = 1e-6  # added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does


def sums(arrays: Sequence[np.ndarray]) -> tuple[tuple[int, ...], float]:
    """Return (positions of the arrays holding inf/nan, the sum of squares of all elements in float64)."""
    culprits = []
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for position, array in enumerate(arrays):
            values = np.asarray(array, dtype=np.float64)
            if not np.isfinite(values).all():
                culprits.append(position)
            total += float(np.sum(np.square(values)))
    return tuple(culprits), total


class Numerics(NamedTuple):
    """One gradient's numerics report, by its position in the call (what a state reads back)."""

    position: int
    dtype: np.dtype[Any]
    size: int
    amax: float  # the largest finite magnitude (0.0 when there is none)
    zeros: int  # elements equal to 0 (either sign)
    subnormals: int  # elements of magnitude below the dtype's smallest normal number, and not 0


def numerics(position: int, array: np.ndarray) -> Numerics:
    """Return ``array``'s numerics report (the reference of the GPU's report pass)."""
    magnitude = np.abs(np.asarray(array).astype(np.float64)).reshape(-1)
    finite = magnitude[np.isfinite(magnitude)]
    tiny = float(_finfo(array.dtype).tiny)
    return Numerics(
        position, array.dtype, int(array.size), float(finite.max()) if finite.size else 0.0,
        int(np.count_nonzero(magnitude == 0.0)), int(np.count_nonzero((magnitude > 0.0) & (magnitude < tiny))),
    )  # fmt: skip


def _finfo(dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "f":
        return np.finfo(dtype)
    import ml_dtypes  # bfloat16: only ml_dtypes arrays get this far

    return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]


def finish(
    record: np.ndarray, total: float, inv_scale: np.float32, max_norm: float, local: bool, agreed: bool,
    own: float | None = None,
) -> None:  # fmt: skip
    """Fill a 0-d :data:`~cupy_amp.kernel_interface.STATS` record from a sum of squares, as the finishing kernel does.

    ``agreed``: another rank overflowed (from the all-reduce); ``local``: this rank's gradients did;
    ``own``: this rank's share of an all-reduced ``total`` (None: ``total`` is this rank's own).
    """
    with np.errstate(
        invalid="ignore"
    ):  # a negative sum (an all-reduce's garbage, after an overflow): NaN, as on the GPU
        norm = np.float32(np.sqrt(np.float64(total)) * np.float64(inv_scale))
    clip = np.float32(1.0)
    if max_norm > 0.0:
        quotient = max_norm / (float(norm) + CLIP_EPS)
        if quotient < 1.0:
            clip = np.float32(quotient)
    record["sum_of_squares"] = total
    record["own_sum_of_squares"] = total if own is None else own
    record["norm"] = norm
    record["clip_coefficient"] = clip
    record["factor"] = np.float32(inv_scale) * clip
    record["found"] = local
    record["skip"] = local or agreed


class HostStatsRecord:
    """A scaler's statistics record on the host (the NumPy path's :class:`~cupy_amp.gpu.stats.DeviceStatsRecord`).

    Attributes:
        memory: The 0-d STATS record.
        norm, clip_coefficient, factor, skip: Views of its fields.
        record: Its owner: currency, readers (:class:`~cupy_amp.record.StatsRecord`).
    """

    device = -1

    def __init__(self) -> None:
        self.memory = np.zeros((), dtype=STATS)
        self.memory["skip"] = 1  # no check() has completed: nothing to apply
        self.skip = self.memory["skip"]
        self.norm, self.clip_coefficient = self.memory["norm"], self.memory["clip_coefficient"]
        self.factor = self.memory["factor"]
        self.record = StatsRecord(self.memory, -1)
