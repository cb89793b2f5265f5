"""cupy-amp: FP16 mixed-precision loss scaling for CuPy and NumPy arrays."""

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.config import ScalerConfig
from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    CheckpointVersionError,
    ConfigError,
    CupyAmpError,
    DuplicateGradientError,
    GradientTypeError,
    GradientValueError,
    KernelSourceNotFoundError,
    ScalerProtocolError,
)
from cupy_amp.gradients import GradientSet
from cupy_amp.scaler import GradScaler
from cupy_amp.stats import GradScalerStats

__version__ = "0.1.0.dev0"

__all__ = [
    "ArgumentTypeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFieldError",
    "CheckpointVersionError",
    "ConfigError",
    "CupyAmpError",
    "DuplicateGradientError",
    "GradScaler",
    "GradScalerCheckpoint",
    "GradScalerStats",
    "GradientSet",
    "GradientTypeError",
    "GradientValueError",
    "KernelSourceNotFoundError",
    "ScalerConfig",
    "ScalerProtocolError",
    "__version__",
]
