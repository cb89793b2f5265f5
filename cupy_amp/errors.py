"""Exception hierarchy of cupy-amp.

Every error the library raises derives from :class:`CupyAmpError` and from
the builtin exception a caller would naturally catch (``ValueError``,
``TypeError``, ``RuntimeError``), so both ``except CupyAmpError`` and the
builtin ``except`` clauses work.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFieldError",
    "CheckpointVersionError",
    "CommunicatorError",
    "ConfigError",
    "CupyAmpError",
    "DuplicateGradientError",
    "GradientTypeError",
    "GradientValueError",
    "KernelSourceNotFoundError",
    "RanksMayDisagreeError",
    "ScalerProtocolError",
]


class CupyAmpError(Exception):
    """Base class of every error raised by cupy-amp."""


class ConfigError(CupyAmpError, ValueError):
    """A scaler parameter is out of range or of the wrong kind."""


class ArgumentTypeError(CupyAmpError, TypeError):
    """An argument is of a type the call does not accept."""


class GradientTypeError(ArgumentTypeError):
    """A loss or gradient argument is not an array cupy-amp can work on."""


class GradientValueError(CupyAmpError, ValueError):
    """A loss or gradient array cannot be modified in place (read-only, aliased)."""


class ScalerProtocolError(CupyAmpError, RuntimeError):
    """The scaler's calls came in an order that would give wrong results."""


class CommunicatorError(CupyAmpError, RuntimeError):
    """The communicator failed or gave an answer that is not a vote; the step counts as an overflow."""


class RanksMayDisagreeError(CommunicatorError):
    """A rank cannot know what the others decided: every later call of the scaler, on every rank, refuses.

    Raised when a call on this rank was interrupted inside its all-reduce, or failed after the all-reduce
    answered, where the other ranks may apply a step this one did not (``own``); or when an all-reduce
    answered the poisoned vote such a rank sends (another rank's). The ranks' scales, verdicts and weights
    may differ: restore every rank from the last checkpoint, with new scalers and a new communicator.

    Attributes:
        own: Whether this rank's own call caused it (this rank then sent the poisoned vote).
    """

    own = False


class CheckpointError(CupyAmpError, ValueError):
    """A checkpoint could not be read, written or validated."""


class CheckpointCorruptError(CheckpointError):
    """The bytes are not a complete, intact cupy-amp checkpoint."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written by a format version this release cannot read."""


class CheckpointFieldError(CheckpointError):
    """A checkpoint field is missing, unknown, of the wrong type or out of range."""


class KernelSourceNotFoundError(CupyAmpError, FileNotFoundError):
    """The CUDA kernel sources could not be found in any searched location."""


class DuplicateGradientError(ScalerProtocolError, ValueError):
    """The same gradient memory would be unscaled twice in one step.

    Both a ``RuntimeError`` (unscaling twice in a step breaks the protocol) and
    a ``ValueError`` (the argument names one array twice).
    """
