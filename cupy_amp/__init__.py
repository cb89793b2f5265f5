"""cupy-amp: FP16 mixed-precision loss scaling for CuPy and NumPy arrays."""

import importlib.metadata as _metadata

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    CheckpointVersionError,
    CommunicatorError,
    ConfigError,
    CupyAmpError,
    DuplicateGradientError,
    GradientTypeError,
    GradientValueError,
    KernelSourceNotFoundError,
    RanksMayDisagreeError,
    ScalerProtocolError,
)
from cupy_amp.gradients import GradientSet
from cupy_amp.record import GradientStats
from cupy_amp.rule import SMALLEST_SCALE, GradScalerStats, ScalerConfig
from cupy_amp.scaler import GradScaler
from cupy_amp.statistics import GradientNumerics
from cupy_amp.sync_free import SyncFreeGradScaler

try:
    __version__ = _metadata.version("cupy-amp")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
del _metadata  # the namespace holds the public names alone

__all__ = [
    "SMALLEST_SCALE",
    "ArgumentTypeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFieldError",
    "CheckpointVersionError",
    "CommunicatorError",
    "ConfigError",
    "CupyAmpError",
    "DuplicateGradientError",
    "GradScaler",
    "GradScalerCheckpoint",
    "GradScalerStats",
    "GradientNumerics",
    "GradientSet",
    "GradientStats",
    "GradientTypeError",
    "GradientValueError",
    "KernelSourceNotFoundError",
    "RanksMayDisagreeError",
    "ScalerConfig",
    "ScalerProtocolError",
    "SyncFreeGradScaler",
    "__version__",
]
