"""GradScalerCheckpoint: the scaler's complete state, validated; its bytes are :mod:`cupy_amp.checkpoint_file`."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_amp import journal as step_journal
from cupy_amp._fileio import file_path, read_regular_file, write_file_atomic
from cupy_amp.checkpoint_file import (
    FILE_PREFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHECKPOINT_BYTES,
    decode,
    encode,
    expect_exactly,
)
from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    ConfigError,
)
from cupy_amp.rule import (
    FLOAT32_MAX,
    PYTORCH,
    ScalerConfig,
    ScalerState,
    expect_scale,
)
from cupy_amp.validation import expect_bool, expect_int

__all__ = [
    "FILE_PREFIX",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_CHECKPOINT_BYTES",
    "TORCH_STATE_DICT_KEYS",
    "GradScalerCheckpoint",
    "decode_checkpoint",
    "read_checkpoint",
]

TORCH_STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_COUNTERS = ("steps", "skipped_steps", "growths", "backoffs", "remote_skipped_steps")
# The headroom rule's float32 memory (cupy_amp.rule.ScalerState): 0 (none) or a positive float32 value.
_MEMORY_FLOATS = ("overflow_scale", "overflow_norm", "clean_scale", "clean_norm")
# The fields a dict may leave out (from_dict): the journal's, and the rule's (PyTorch's, no memory).
_OPTIONAL = ("rule", *_MEMORY_FLOATS, "overflows_in_row", "journal", "journal_names")


def _memory_float(name: str, value: object) -> float:
    """Return ``value`` if it is 0 or a positive finite value float32 holds exactly."""
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_)):
        as_float = float(value)
        if as_float == 0.0 or (0.0 < as_float <= FLOAT32_MAX and float(np.float32(as_float)) == as_float):
            return as_float
    raise CheckpointFieldError(f"Invalid {name!r}: expected 0 or a positive float32 value, got {value!r}.")


@dataclass(frozen=True)
class GradScalerCheckpoint:
    """Every field needed to resume a :class:`~cupy_amp.GradScaler` bit for bit.

    Validated on construction with the scaler's own rules, plus: the scale is
    a value float32 holds exactly, inside the clamps; ``consecutive_good_steps``
    lies in ``[0, growth_interval)``; ``hysteresis_tracker`` in ``[0, hysteresis]``;
    the counters are >= 0 and consistent with each other; every integer fits
    the file format (< 2**64). Field names are those of the file format.
    """

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    consecutive_good_steps: int
    found_overflow: bool
    found_overflow_local: bool
    enabled: bool
    min_scale: float | None
    max_scale: float | None
    hysteresis: int
    hysteresis_tracker: int
    steps: int
    skipped_steps: int
    growths: int
    backoffs: int
    remote_skipped_steps: int
    rule: str = PYTORCH  # how the scale moves (cupy_amp.rule.RULES), and the headroom rule's memory:
    overflow_scale: float = 0.0
    overflow_norm: float = 0.0
    clean_scale: float = 0.0
    clean_norm: float = 0.0
    overflows_in_row: int = 0
    journal: bytes = b""  # the step journal's entries (cupy_amp.journal), oldest first
    journal_names: tuple[tuple[str, ...], ...] = ()  # the last step's gradient names, call by call

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        try:
            config = self.config()
        except ConfigError as exc:
            raise CheckpointFieldError(str(exc)) from None
        for name, value in dataclasses.asdict(config).items():
            set_field(self, name, value)
        scale = expect_scale(CheckpointFieldError, "scale", self.scale)
        if scale != self.scale:
            raise CheckpointFieldError(f"Invalid 'scale': expected a value float32 holds exactly, got {self.scale!r}.")
        config.refuse_out_of_range(scale, "scale", CheckpointFieldError)
        set_field(self, "scale", scale)
        for name in ("found_overflow", "found_overflow_local", "enabled"):
            set_field(self, name, expect_bool(CheckpointFieldError, name, getattr(self, name)))
        if self.found_overflow_local and not self.found_overflow:
            raise CheckpointFieldError(
                "Invalid 'found_overflow_local': expected False when found_overflow is False "
                "(a local overflow is an overflow), got True."
            )
        for name in ("consecutive_good_steps", "hysteresis_tracker", *_COUNTERS):
            set_field(self, name, expect_int(CheckpointFieldError, name, getattr(self, name), 0))
        _at_most(
            "consecutive_good_steps", self.consecutive_good_steps, "growth_interval - 1", config.growth_interval - 1
        )
        _at_most("hysteresis_tracker", self.hysteresis_tracker, "hysteresis", config.hysteresis)
        # Growths happen only on clean steps, backoffs and remote skips only on skipped ones.
        _at_most("skipped_steps", self.skipped_steps, "steps", self.steps)
        _at_most("growths", self.growths, "steps - skipped_steps", self.steps - self.skipped_steps)
        _at_most("backoffs", self.backoffs, "skipped_steps", self.skipped_steps)
        _at_most("remote_skipped_steps", self.remote_skipped_steps, "skipped_steps", self.skipped_steps)
        for name in _MEMORY_FLOATS:
            set_field(self, name, _memory_float(name, getattr(self, name)))
        for name in ("overflow_scale", "clean_scale"):  # scales the scaler used: inside its clamps
            if getattr(self, name):
                config.refuse_out_of_range(
                    expect_scale(CheckpointFieldError, name, getattr(self, name)), name, CheckpointFieldError
                )
        if self.overflow_scale and self.clean_scale >= self.overflow_scale:
            raise CheckpointFieldError(
                f"Invalid 'clean_scale': expected a value below overflow_scale ({self.overflow_scale!r}) (the highest "
                f"scale seen clean below the last overflow), got {self.clean_scale!r}."
            )
        in_row = expect_int(CheckpointFieldError, "overflows_in_row", self.overflows_in_row, 0)
        set_field(self, "overflows_in_row", in_row)
        _at_most("overflows_in_row", self.overflows_in_row, "skipped_steps", self.skipped_steps)
        if config.rule == PYTORCH and any(getattr(self, name) for name in (*_MEMORY_FLOATS, "overflows_in_row")):
            raise CheckpointFieldError(
                "Invalid checkpoint: the headroom rule's fields (overflow_scale, overflow_norm, clean_scale, "
                "clean_norm, overflows_in_row) must be 0 with rule='pytorch', which keeps none of them."
            )
        if not isinstance(self.journal, (bytes, bytearray)):
            raise CheckpointFieldError(f"Invalid 'journal': expected bytes, got {type(self.journal).__name__}.")
        set_field(self, "journal", bytes(self.journal))
        step_journal.from_bytes(self.journal, self.steps)  # raises on entries no scaler of these steps writes
        set_field(self, "journal_names", step_journal.expect_names(CheckpointFieldError, self.journal_names))

    @classmethod
    def capture(
        cls,
        config: ScalerConfig,
        state: ScalerState,
        *,
        enabled: bool,
        found_overflow: bool,
        found_overflow_local: bool,
        entries: np.ndarray | None = None,
        names: Any = (),
    ) -> GradScalerCheckpoint:
        """Build a checkpoint from a scaler's config, state and step flags (the inverse of config() and state()),
        with its journal's ``entries`` and the last step's gradient ``names`` (kept as :func:`cupy_amp.journal.names`
        bounds them)."""
        return cls(
            **dataclasses.asdict(config),
            **{field.name: getattr(state, field.name) for field in dataclasses.fields(state)},
            enabled=enabled,
            found_overflow=found_overflow,
            found_overflow_local=found_overflow_local,
            journal=b"" if entries is None else step_journal.to_bytes(entries),
            journal_names=step_journal.names(names),
        )

    def journal_entries(self) -> np.ndarray:
        """Return the step journal's entries, oldest first, as a NumPy structured array
        (:data:`cupy_amp.journal.ENTRY`)."""
        return step_journal.from_bytes(self.journal, self.steps)

    def config(self) -> ScalerConfig:
        """Return the scaler configuration this checkpoint carries."""
        names = [field.name for field in dataclasses.fields(ScalerConfig)]
        return ScalerConfig(**{name: getattr(self, name) for name in names})

    def state(self) -> ScalerState:
        """Return the step-to-step state this checkpoint carries."""
        return ScalerState(**{field.name: getattr(self, field.name) for field in dataclasses.fields(ScalerState)})

    def to_dict(self) -> dict[str, Any]:
        """Return every field as a plain dict of Python scalars (None for an absent clamp), in file order."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> GradScalerCheckpoint:
        """Build a checkpoint from a mapping holding exactly the checkpoint's fields (the journal's and
        the rule's may be left out: no journal, PyTorch's rule).

        Raises:
            CheckpointFieldError: A field is missing or unknown, or a value is invalid.
        """
        names = [field.name for field in dataclasses.fields(cls)]
        present = names  # a dict of an older version's fields: PyTorch's rule, no journal
        if isinstance(fields, Mapping):
            present = [name for name in names if name not in _OPTIONAL or name in fields]
        expect_exactly(fields, present, "Invalid checkpoint", "field")
        return cls(**{name: fields[name] for name in present})

    def to_torch_state_dict(self) -> dict[str, float | int]:
        """Return the five keys of ``torch.amp.GradScaler.state_dict()``.

        The scale and the growth tracker carry over exactly, so PyTorch continues
        from the same scale. PyTorch has no clamps and no hysteresis: when this
        checkpoint has them (the scaler's defaults clamp to [1, 2**24]), a
        ``UserWarning`` says what PyTorch will run without. Counters and the
        enabled flag have no place there either.
        """
        lost = [
            f"{name}={getattr(self, name)!r}"
            for name, neutral in (("min_scale", None), ("max_scale", None), ("hysteresis", 1), ("rule", PYTORCH))
            if getattr(self, name) != neutral
        ]
        if lost:
            warnings.warn(
                "PyTorch's GradScaler has no scale clamps, hysteresis or other rule: the state dict drops "
                f"{', '.join(lost)}, so PyTorch's scale will not follow this scaler's from here.",
                UserWarning,
                stacklevel=2,
            )
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.consecutive_good_steps,
        }

    @classmethod
    def from_torch_state_dict(cls, state_dict: Mapping[str, Any]) -> GradScalerCheckpoint:
        """Build a checkpoint from ``torch.amp.GradScaler.state_dict()``'s five keys.

        Needs no PyTorch import. The fields PyTorch lacks take the values that
        continue PyTorch's own trajectory: ``min_scale`` and ``max_scale`` None,
        ``hysteresis`` 1 (tracker 1), ``enabled`` True, no overflow, counters 0.

        Raises:
            CheckpointFieldError: A key is missing or unknown (an empty dict, which
                a disabled torch.amp.GradScaler returns, included), or a value is
                invalid (a scale that collapsed below 2**-128 included).
        """
        if isinstance(state_dict, Mapping) and not state_dict:
            raise CheckpointFieldError(
                "Invalid PyTorch state dict: it is empty, which is what a disabled torch.amp.GradScaler returns; "
                "there is no scale to carry over."
            )
        expect_exactly(state_dict, TORCH_STATE_DICT_KEYS, "Invalid PyTorch state dict", "key")
        counters: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)  # typed: the journal's fields follow them
        return cls(
            scale=state_dict["scale"],
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            consecutive_good_steps=state_dict["_growth_tracker"],
            found_overflow=False,
            found_overflow_local=False,
            enabled=True,
            min_scale=None,
            max_scale=None,
            hysteresis=1,
            hysteresis_tracker=1,
            **counters,
        )

    def to_bytes(self) -> bytes:
        """Serialize to the current format version (deterministic: equal checkpoints give equal bytes).

        Every float is stored as a float64, so the scale round-trips bit for bit.
        """
        fields = self.to_dict()
        fields["journal_names"] = [list(call) for call in self.journal_names]  # msgpack's arrays are lists
        return encode(fields)

    @classmethod
    def from_bytes(cls, data: bytes) -> GradScalerCheckpoint:
        """Parse and validate bytes written by :meth:`to_bytes` (any format version up to the current one).

        Raises:
            CheckpointCorruptError: The bytes are not an intact checkpoint.
            CheckpointVersionError: They were written by a newer format version.
            CheckpointFieldError: A field is missing, unknown or invalid.
            ArgumentTypeError: ``data`` is not bytes-like (a ``TypeError``).
        """
        return decode_checkpoint(data)[1]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the checkpoint to ``path`` atomically (temporary file, fsync, rename, directory fsync).

        A reader, or a process restarted after a crash at any moment, finds
        either the previous file or the new one, complete. An existing file's
        permission bits are kept.

        Raises:
            OSError: The disk write failed; the message names ``path``, which
                keeps its previous content, and no temporary file is left.
        """
        write_file_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GradScalerCheckpoint:
        """Read and validate a checkpoint file written by :meth:`save`.

        Anything but a regular file (a FIFO, a device) and files over
        :data:`MAX_CHECKPOINT_BYTES` are refused before a byte is read.
        Error messages name the file.

        Raises:
            CheckpointCorruptError: The file is not an intact checkpoint, or not a regular file.
            CheckpointVersionError: It was written by a newer format version.
            CheckpointFieldError: A field is missing, unknown or invalid.
            OSError: The file cannot be opened or read (``FileNotFoundError``
                when it does not exist); not wrapped.
        """
        return read_checkpoint(path)[1]


def _at_most(name: str, value: int, bound_name: str, bound: int) -> None:
    if value > bound:
        raise CheckpointFieldError(f"Invalid {name!r}: expected an int <= {bound_name} ({bound}), got {value!r}.")


def expect_checkpoint(value: object) -> None:
    """Raise unless ``value`` is a :class:`GradScalerCheckpoint` (what ``load_checkpoint`` takes).

    Raises:
        ArgumentTypeError: It is something else (a dict, a path...).
    """
    if not isinstance(value, GradScalerCheckpoint):
        raise ArgumentTypeError(
            f"load_checkpoint expected a GradScalerCheckpoint, got {type(value).__name__}; "
            f"read files with GradScalerCheckpoint.load(path)."
        )


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[int, GradScalerCheckpoint]:
    """Return the format version a checkpoint file was written in, and the checkpoint it holds.

    Raises what :meth:`GradScalerCheckpoint.load` raises, with the file named once in the message.
    """
    name = file_path(path)
    try:
        return decode_checkpoint(read_regular_file(name, MAX_CHECKPOINT_BYTES, CheckpointCorruptError))
    except CheckpointError as exc:
        raise type(exc)(f"checkpoint {name!r}: {exc}") from None


def decode_checkpoint(data: bytes | bytearray | memoryview) -> tuple[int, GradScalerCheckpoint]:
    """Return the format version ``data`` was written in, and the checkpoint it holds (upgraded).

    Raises what :meth:`GradScalerCheckpoint.from_bytes` raises.
    """
    version, fields = decode(data)
    return version, GradScalerCheckpoint.from_dict(fields)
