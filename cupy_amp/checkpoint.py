"""GradScalerCheckpoint: the scaler's complete state as a validated value, and its file format.

A file (format version 2) is one msgpack map with exactly four entries, in this order::

    "format"  -> "cupy-amp.grad-scaler"
    "version" -> 2                      (an int; never a bool)
    "payload" -> {field name: value}    (nil, bool, int or float64 values)
    "crc32"   -> CRC-32 of every byte before this value, as a msgpack uint32

so a file always ends with ``0xCE`` and the four big-endian bytes of the
CRC-32. The envelope is the same in every version, so any version is
recognised and its checksum verified; only the payload changes, an older one
being upgraded by :data:`_MIGRATIONS`. Reading checks the size cap, the
envelope's start and the CRC-32 before it parses anything, then reads msgpack
alone (no pickle, nothing driven by the content) with small length limits,
refusing ext types, duplicate or non-string keys and trailing bytes. The
values are judged by :class:`GradScalerCheckpoint`, with the scaler's own rules.

Versions:

1. The 15 fields of a single-process scaler: ``scale``, ``growth_factor``,
   ``backoff_factor``, ``growth_interval``, ``consecutive_good_steps``,
   ``found_overflow``, ``enabled``, ``min_scale``, ``max_scale``,
   ``hysteresis``, ``hysteresis_tracker``, ``steps``, ``skipped_steps``,
   ``growths``, ``backoffs``.
2. Adds ``found_overflow_local`` (after ``found_overflow``: whether this
   process's own gradients overflowed) and ``remote_skipped_steps`` (last:
   skipped steps whose overflow was on another rank only). A version-1 payload
   must hold exactly the version-1 fields; it is upgraded with
   ``found_overflow_local = found_overflow`` and ``remote_skipped_steps = 0``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from cupy_amp._fileio import file_path, read_regular_file, write_file_atomic
from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    CheckpointVersionError,
    ConfigError,
)
from cupy_amp.rule import ScalerConfig, ScalerState, expect_bool, expect_int, expect_scale

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

FORMAT_NAME = "cupy-amp.grad-scaler"
FORMAT_VERSION = 2
MAX_CHECKPOINT_BYTES = 1 << 20
TORCH_STATE_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

# Every file starts with these bytes: a map of 4 entries whose first is "format": FORMAT_NAME.
FILE_PREFIX = b"\x84" + msgpack.packb("format") + msgpack.packb(FORMAT_NAME)
_TRAILER = 5  # 0xCE, msgpack's uint32 marker, then the CRC-32
# Versions 1 and 2 hold fewer than 20 scalar fields; a little room is left so that a value
# of the wrong kind is reported by field name rather than as unreadable bytes.
_LIMITS = {"max_str_len": 256, "max_bin_len": 256, "max_array_len": 16, "max_map_len": 32, "max_ext_len": 0}
_COUNTERS = ("steps", "skipped_steps", "growths", "backoffs", "remote_skipped_steps")


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
        """Build a checkpoint from a scaler's config, state and step flags (the inverse of config() and state())."""
        return cls(
            **dataclasses.asdict(config),
            **{field.name: getattr(state, field.name) for field in dataclasses.fields(state)},
            enabled=enabled,
            found_overflow=found_overflow,
            found_overflow_local=found_overflow_local,
        )

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
        """Build a checkpoint from a mapping holding exactly the checkpoint's fields.

        Raises:
            CheckpointFieldError: A field is missing or unknown, or a value is invalid.
        """
        names = [field.name for field in dataclasses.fields(cls)]
        _expect_exactly(fields, names, "Invalid checkpoint", "field")
        return cls(**{name: fields[name] for name in names})

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
            for name, neutral in (("min_scale", None), ("max_scale", None), ("hysteresis", 1))
            if getattr(self, name) != neutral
        ]
        if lost:
            warnings.warn(
                f"PyTorch's GradScaler has no scale clamps or hysteresis: the state dict drops {', '.join(lost)}, "
                f"so PyTorch's scale will not follow this scaler's from here.",
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
        _expect_exactly(state_dict, TORCH_STATE_DICT_KEYS, "Invalid PyTorch state dict", "key")
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
            **dict.fromkeys(_COUNTERS, 0),
        )

    def to_bytes(self) -> bytes:
        """Serialize to the current format version (deterministic: equal checkpoints give equal bytes).

        Every float is stored as a float64, so the scale round-trips bit for bit.
        """
        packer = msgpack.Packer(use_single_float=False, use_bin_type=True, strict_types=True, datetime=False)
        parts = ("version", FORMAT_VERSION, "payload", self.to_dict(), "crc32")
        body: bytes = FILE_PREFIX + b"".join(packer.pack(part) for part in parts)
        return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")

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


def _expect_exactly(fields: Any, names: tuple[str, ...] | list[str], what: str, kind: str, version: str = "") -> None:
    """Raise CheckpointFieldError unless ``fields`` is a mapping with exactly the keys ``names``."""
    if not isinstance(fields, Mapping):
        raise CheckpointFieldError(f"{what}: expected a mapping, got {type(fields).__name__}.")
    missing = [name for name in names if name not in fields]
    unknown = sorted(repr(name) for name in fields if name not in names)
    if missing:
        of = f" of format version {version}" if version else ""
        raise CheckpointFieldError(f"{what}: missing {kind}(s) {', '.join(map(repr, missing))}{of}.")
    if unknown:
        of = f" for format version {version}" if version else ""
        raise CheckpointFieldError(f"{what}: unknown {kind}(s) {', '.join(unknown)}{of}.")


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
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"Expected the checkpoint as bytes, got {type(data).__name__}.")
    try:
        data = bytes(data)
    except ValueError as exc:  # a released memoryview
        raise ArgumentTypeError(f"Expected the checkpoint as bytes: {exc}.") from None
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointCorruptError(
            f"{len(data)} bytes, over the {MAX_CHECKPOINT_BYTES}-byte limit; refusing to read it."
        )
    if not data.startswith(FILE_PREFIX):
        raise CheckpointCorruptError(
            f"not a cupy-amp checkpoint: it does not start with a msgpack map of 4 entries whose first is "
            f"'format': {FORMAT_NAME!r}."
        )
    if len(data) < len(FILE_PREFIX) + _TRAILER or data[-_TRAILER] != 0xCE:
        raise CheckpointCorruptError("no CRC-32 at the end of the file: it is truncated or damaged.")
    stored, computed = int.from_bytes(data[-4:], "big"), zlib.crc32(data[:-_TRAILER])
    if stored != computed:
        raise CheckpointCorruptError(
            f"CRC-32 mismatch (stored 0x{stored:08x}, computed 0x{computed:08x}): the file is truncated or damaged."
        )
    body = data[len(FILE_PREFIX) : -_TRAILER]
    unpacker = msgpack.Unpacker(
        None, raw=False, strict_map_key=True, object_pairs_hook=_map, ext_hook=_no_ext, max_buffer_size=len(body),
        **_LIMITS,
    )  # fmt: skip
    unpacker.feed(body)
    version = _entry(unpacker, "version")
    if type(version) is not int or version < 1:
        raise CheckpointCorruptError(f"Invalid 'version': expected an int >= 1, got {_describe(version)}.")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"written in format version {version}, newer than this cupy-amp can read (up to version "
            f"{FORMAT_VERSION}); upgrade cupy-amp to load it."
        )
    fields = _entry(unpacker, "payload")
    if type(fields) is not dict:
        raise CheckpointCorruptError(f"Invalid 'payload': expected a msgpack map of fields, got {_describe(fields)}.")
    for name, value in fields.items():
        if not isinstance(value, (type(None), bool, int, float, str)):
            raise CheckpointFieldError(
                f"Invalid {name!r}: expected nil, a bool, an int or a float, got {_describe(value)}."
            )
    _unpack(unpacker, "the 'crc32' key", expect="crc32")
    if unpacker.tell() != len(body):
        raise CheckpointCorruptError("unexpected bytes between the 'crc32' key and the CRC-32 at the end of the file.")
    for older in range(version, FORMAT_VERSION):
        fields = _MIGRATIONS[older](fields)
    return version, GradScalerCheckpoint.from_dict(fields)


def _entry(unpacker: msgpack.Unpacker, key: str) -> object:
    _unpack(unpacker, f"the {key!r} key", expect=key)
    return _unpack(unpacker, f"the {key!r} value")


def _unpack(unpacker: msgpack.Unpacker, what: str, expect: str | None = None) -> object:
    # Every parser failure is CheckpointCorruptError: msgpack's OutOfData is not a ValueError, and a
    # bad UTF-8 string, deep nesting or an over-limit length each raise something different.
    try:
        value = unpacker.unpack()
    except CheckpointCorruptError:
        raise
    except msgpack.OutOfData as exc:
        raise CheckpointCorruptError(f"the data ends inside {what}: the file is truncated.") from exc
    except Exception as exc:
        raise CheckpointCorruptError(f"{what} is not valid msgpack ({type(exc).__name__}: {exc}).") from exc
    if expect is not None and value != expect:
        raise CheckpointCorruptError(f"expected the envelope key {expect!r} here, got {_describe(value)}.")
    return value


def _map(pairs: list[tuple[object, object]]) -> dict[str, object]:
    """Build a dict from a decoded map, refusing duplicate and non-string keys."""
    result: dict[str, object] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise CheckpointCorruptError(f"a map key must be a string, got {_describe(key)}.")
        if key in result:
            raise CheckpointCorruptError(f"duplicate key {key!r} in a map.")
        result[key] = value
    return result


def _no_ext(code: int, data: bytes) -> object:
    raise CheckpointCorruptError(f"msgpack ext type {code} found; the format uses none.")


def _describe(value: object) -> str:
    """Describe a decoded value for a message without repr-ing a container (which could be deep)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    names: dict[type, str] = {list: "a msgpack array", dict: "a msgpack map", bytes: "a msgpack bin"}
    return names.get(type(value), f"a {type(value).__name__}")


# The payload fields of version 1, in the order its encoder wrote them. Frozen: this is what a
# version-1 file holds, whatever later versions add.
_V1_FIELDS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "consecutive_good_steps",
    "found_overflow",
    "enabled",
    "min_scale",
    "max_scale",
    "hysteresis",
    "hysteresis_tracker",
    "steps",
    "skipped_steps",
    "growths",
    "backoffs",
)


def _upgrade_v1(fields: dict[str, object]) -> dict[str, object]:
    """Return the version-2 fields of a version-1 payload, in version-2 order."""
    _expect_exactly(fields, _V1_FIELDS, "Invalid checkpoint", "field", version="1")
    upgraded: dict[str, object] = {}
    for name in _V1_FIELDS:
        upgraded[name] = fields[name]
        if name == "found_overflow":
            # One process: every overflow it saw was in its own gradients. A non-bool is copied as it
            # is and reported under its own name, since found_overflow is checked first.
            upgraded["found_overflow_local"] = fields[name]
    upgraded["remote_skipped_steps"] = 0
    return upgraded


# _MIGRATIONS[v] turns version v's payload into version v + 1's (a new dict). A change to the
# fields means FORMAT_VERSION + 1 and an entry here, never an edit of what an earlier version means.
_MIGRATIONS: dict[int, Callable[[dict[str, object]], dict[str, object]]] = {1: _upgrade_v1}
