"""GradScalerCheckpoint: the scaler's complete state as a validated value.

The msgpack file format lives in :mod:`cupy_amp.checkpoint_format`; this
module holds the fields, their validation and the PyTorch state-dict bridge.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cupy_amp import checkpoint_format
from cupy_amp.config import ScalerConfig, validate_scale_in_clamps
from cupy_amp.errors import CheckpointFieldError, ConfigError
from cupy_amp.update_rule import ScalerState, to_float32
from cupy_amp.validation import expect_bool, expect_float32, expect_int

if TYPE_CHECKING:
    import os

__all__ = ["TORCH_STATE_DICT_KEYS", "GradScalerCheckpoint"]

TORCH_STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@dataclass(frozen=True)
class GradScalerCheckpoint:
    """Every field needed to resume a :class:`~cupy_amp.GradScaler` bit for bit.

    Validated on construction with the scaler's own rules, plus: the scale must
    be a float32 value and may be 0 only when ``min_scale`` is None (a scale that
    underflowed, as PyTorch's can); ``consecutive_good_steps`` lies in
    ``[0, growth_interval)``; ``hysteresis_tracker`` in ``[0, hysteresis]``; the
    counters are >= 0 and consistent with each other.
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

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        try:
            config = self.config()
        except ConfigError as exc:
            raise CheckpointFieldError(str(exc)) from None
        for name, value in dataclasses.asdict(config).items():
            set_field(self, name, value)

        scale = expect_float32(CheckpointFieldError, "scale", self.scale, allow_zero=config.min_scale is None)
        if scale != float(self.scale):
            raise CheckpointFieldError(f"Invalid 'scale': expected a value float32 holds exactly, got {self.scale!r}.")
        if math.copysign(1.0, scale) < 0:
            # -0.0 passes ">= 0" but is no state the update rule can reach, and its inverse is -inf.
            raise CheckpointFieldError(f"Invalid 'scale': expected 0.0 or a positive float, got {scale!r}.")
        validate_scale_in_clamps(config, scale, "scale", CheckpointFieldError)
        set_field(self, "scale", scale)
        set_field(self, "found_overflow", expect_bool(CheckpointFieldError, "found_overflow", self.found_overflow))
        local = expect_bool(CheckpointFieldError, "found_overflow_local", self.found_overflow_local)
        if local and not self.found_overflow:
            raise CheckpointFieldError(
                "Invalid 'found_overflow_local': expected False when found_overflow is False "
                "(a local overflow is an overflow), got True."
            )
        set_field(self, "found_overflow_local", local)
        set_field(self, "enabled", expect_bool(CheckpointFieldError, "enabled", self.enabled))

        good = expect_int(CheckpointFieldError, "consecutive_good_steps", self.consecutive_good_steps, 0)
        if good >= config.growth_interval:
            raise CheckpointFieldError(
                f"Invalid 'consecutive_good_steps': expected an int in [0, growth_interval={config.growth_interval}), "
                f"got {good!r}."
            )
        set_field(self, "consecutive_good_steps", good)
        tracker = expect_int(CheckpointFieldError, "hysteresis_tracker", self.hysteresis_tracker, 0)
        if tracker > config.hysteresis:
            raise CheckpointFieldError(
                f"Invalid 'hysteresis_tracker': expected an int in [0, hysteresis={config.hysteresis}], "
                f"got {tracker!r}."
            )
        set_field(self, "hysteresis_tracker", tracker)
        for name in ("steps", "skipped_steps", "growths", "backoffs", "remote_skipped_steps"):
            set_field(self, name, expect_int(CheckpointFieldError, name, getattr(self, name), 0))
        self._check_counters_consistent()

    def _check_counters_consistent(self) -> None:
        # Growths happen only on clean steps and backoffs only on skipped ones.
        clean_steps = self.steps - self.skipped_steps
        if clean_steps < 0:
            raise CheckpointFieldError(
                f"Invalid 'skipped_steps': expected an int <= steps ({self.steps}), got {self.skipped_steps!r}."
            )
        if self.growths > clean_steps:
            raise CheckpointFieldError(
                f"Invalid 'growths': expected an int <= steps - skipped_steps ({clean_steps}), got {self.growths!r}."
            )
        if self.backoffs > self.skipped_steps:
            raise CheckpointFieldError(
                f"Invalid 'backoffs': expected an int <= skipped_steps ({self.skipped_steps}), got {self.backoffs!r}."
            )
        if self.remote_skipped_steps > self.skipped_steps:
            raise CheckpointFieldError(
                f"Invalid 'remote_skipped_steps': expected an int <= skipped_steps ({self.skipped_steps}), "
                f"got {self.remote_skipped_steps!r}."
            )

    @classmethod
    def capture(
        cls,
        config: ScalerConfig,
        state: ScalerState,
        *,
        enabled: bool,
        found_overflow: bool,
        found_overflow_local: bool,
    ) -> GradScalerCheckpoint:
        """Build a checkpoint from a scaler's config, its state and its step flags (the inverse of
        :meth:`config` and :meth:`state`)."""
        return cls(
            scale=state.scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
            consecutive_good_steps=state.growth_tracker,
            found_overflow=found_overflow,
            found_overflow_local=found_overflow_local,
            enabled=enabled,
            min_scale=config.min_scale,
            max_scale=config.max_scale,
            hysteresis=config.hysteresis,
            hysteresis_tracker=state.hysteresis_tracker,
            steps=state.steps,
            skipped_steps=state.skipped_steps,
            growths=state.growths,
            backoffs=state.backoffs,
            remote_skipped_steps=state.remote_skipped_steps,
        )

    def config(self) -> ScalerConfig:
        """Return the scaler configuration this checkpoint carries."""
        return ScalerConfig(
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
        )

    def state(self) -> ScalerState:
        """Return the step-to-step state this checkpoint carries."""
        return ScalerState(
            scale=self.scale,
            growth_tracker=self.consecutive_good_steps,
            hysteresis_tracker=self.hysteresis_tracker,
            steps=self.steps,
            skipped_steps=self.skipped_steps,
            growths=self.growths,
            backoffs=self.backoffs,
            remote_skipped_steps=self.remote_skipped_steps,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return every field as a plain dict of Python scalars (None for an absent clamp)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> GradScalerCheckpoint:
        """Build a checkpoint from a dict holding exactly the checkpoint's fields.

        Raises:
            CheckpointFieldError: A field is missing or unknown, or a value is invalid.
        """
        if not isinstance(fields, Mapping):
            raise CheckpointFieldError(
                f"Invalid checkpoint: expected a mapping of fields, got {type(fields).__name__}."
            )
        expected = [field.name for field in dataclasses.fields(cls)]
        missing = [name for name in expected if name not in fields]
        unknown = sorted(repr(name) for name in fields if name not in expected)
        if missing:
            raise CheckpointFieldError(f"Invalid checkpoint: missing field(s) {', '.join(map(repr, missing))}.")
        if unknown:
            raise CheckpointFieldError(f"Invalid checkpoint: unknown field(s) {', '.join(unknown)}.")
        return cls(**{name: fields[name] for name in expected})

    def to_torch_state_dict(self) -> dict[str, float | int]:
        """Return the five keys of ``torch.amp.GradScaler.state_dict()``.

        Fields PyTorch has no place for (clamps, hysteresis, counters, the
        enabled flag) are dropped; the scale and growth tracker carry over
        exactly, so PyTorch continues the run from the same scale.
        """
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
        make the trajectory continue exactly as PyTorch's would: ``min_scale``
        and ``max_scale`` None, ``hysteresis`` 1 (tracker 1), ``enabled`` True,
        ``found_overflow`` and ``found_overflow_local`` False, counters 0.

        Raises:
            CheckpointFieldError: A key is missing or unknown (an empty dict,
                which a disabled PyTorch scaler returns, included), or a value is invalid.
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointFieldError(
                f"Invalid PyTorch state dict: expected a mapping, got {type(state_dict).__name__}."
            )
        if not state_dict:
            raise CheckpointFieldError(
                "Invalid PyTorch state dict: it is empty, which is what a disabled torch.amp.GradScaler returns; "
                "there is no scale to carry over."
            )
        missing = [key for key in TORCH_STATE_DICT_KEYS if key not in state_dict]
        unknown = sorted(repr(key) for key in state_dict if key not in TORCH_STATE_DICT_KEYS)
        if missing or unknown:
            raise CheckpointFieldError(
                f"Invalid PyTorch state dict: expected exactly the keys {', '.join(TORCH_STATE_DICT_KEYS)}; "
                f"missing {missing or 'none'}, unknown {unknown or 'none'}."
            )
        scale = state_dict["scale"]
        if isinstance(scale, float) and math.isfinite(scale):
            scale_f32 = to_float32(scale)
            if scale_f32 != scale:
                raise CheckpointFieldError(f"Invalid 'scale': expected a value float32 holds exactly, got {scale!r}.")
        return cls(
            scale=scale,
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
            steps=0,
            skipped_steps=0,
            growths=0,
            backoffs=0,
            remote_skipped_steps=0,
        )

    def to_bytes(self) -> bytes:
        """Serialize to the versioned msgpack format (see :mod:`cupy_amp.checkpoint_format`).

        Deterministic: equal checkpoints give equal bytes, and every float is
        stored as a float64, so the scale round-trips bit for bit.

        Raises:
            CheckpointFieldError: A counter does not fit in msgpack's 64-bit ints.
        """
        return checkpoint_format.encode_fields(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> GradScalerCheckpoint:
        """Parse and validate bytes written by :meth:`to_bytes`.

        Raises:
            CheckpointCorruptError: The bytes are not an intact checkpoint (size,
                msgpack structure, checksum, duplicate or unknown envelope keys).
            CheckpointVersionError: They were written by a newer format version.
            CheckpointFieldError: A field is missing, unknown or invalid.
        """
        return cls._from_fields(checkpoint_format.decode_fields(data), None)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the checkpoint to ``path`` atomically (temporary file, fsync, rename, directory fsync).

        A reader, or a process restarted after a crash at any moment, finds
        either the previous file or the new one, complete.

        Raises:
            CheckpointFieldError: A counter does not fit in msgpack's 64-bit ints
                (nothing is written).
            OSError: The disk write failed; ``path`` keeps its previous content
                and no temporary file is left (see
                :func:`~cupy_amp.checkpoint_format.write_file_atomic`).
        """
        checkpoint_format.write_file_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GradScalerCheckpoint:
        """Read and validate a checkpoint file written by :meth:`save`.

        Files over :data:`~cupy_amp.checkpoint_format.MAX_CHECKPOINT_BYTES` are
        refused without being read. Error messages name the file.

        Raises:
            CheckpointCorruptError: The file is not an intact checkpoint.
            CheckpointVersionError: It was written by a newer format version.
            CheckpointFieldError: A field is missing, unknown or invalid.
            OSError: The file cannot be opened or read (``FileNotFoundError``
                when it does not exist); not wrapped.
        """
        data = checkpoint_format.read_checkpoint_file(path)
        return cls._from_fields(checkpoint_format.decode_fields(data, source=path), path)

    @classmethod
    def _from_fields(cls, fields: Mapping[str, Any], source: str | os.PathLike[str] | None) -> GradScalerCheckpoint:
        if source is None:
            return cls.from_dict(fields)
        try:
            return cls.from_dict(fields)
        except CheckpointFieldError as exc:
            raise CheckpointFieldError(f"{checkpoint_format.describe_source(source)}: {exc}") from None
