"""The checkpoint file format: a checksummed msgpack document, version 2.

A file is one msgpack map with exactly four entries, always in this order::

    "format"  -> "cupy-amp.grad-scaler"
    "version" -> 2                      (an int; never a bool)
    "payload" -> {field name: value}    (nil, bool, int or float64 values)
    "crc32"   -> CRC-32 of every byte before this value, as a msgpack uint32

so the file always ends with ``0xCE`` and the four big-endian bytes of the
CRC-32. This envelope is the same in every format version, so any version can
be recognised and its checksum verified; only the payload's fields may change
from one version to the next, older ones being upgraded through
:data:`_MIGRATIONS`. Decoding reads only msgpack (no pickle, no imports or
code driven by the content), refuses anything over :data:`MAX_CHECKPOINT_BYTES`
before parsing it, keeps msgpack's length limits small so a short file cannot
make the parser allocate much, and refuses duplicate keys, non-string keys,
ext types and trailing bytes. Which values each field accepts is decided by
:class:`~cupy_amp.checkpoint.GradScalerCheckpoint`, not here.

Versions:

1. The 15 fields of a single-process scaler: ``scale``, ``growth_factor``,
   ``backoff_factor``, ``growth_interval``, ``consecutive_good_steps``,
   ``found_overflow``, ``enabled``, ``min_scale``, ``max_scale``,
   ``hysteresis``, ``hysteresis_tracker``, ``steps``, ``skipped_steps``,
   ``growths``, ``backoffs``.
2. Adds two fields for multi-process training, 17 in all:
   ``found_overflow_local`` (after ``found_overflow``: whether this process's
   own gradients overflowed) and ``remote_skipped_steps`` (last: skipped steps
   whose overflow was on another rank only). A version-1 payload must hold
   exactly the version-1 fields and is upgraded with ``found_overflow_local =
   found_overflow`` (a single process's overflow is always its own) and
   ``remote_skipped_steps = 0``.

Files are always written in the current version, :data:`FORMAT_VERSION`.

Nothing in this module touches a device.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack

from cupy_amp.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointFieldError,
    CheckpointVersionError,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_CHECKPOINT_BYTES",
    "DecodedDocument",
    "decode_document",
    "decode_fields",
    "describe_source",
    "encode_fields",
    "read_checkpoint_file",
    "write_file_atomic",
]

logger = logging.getLogger(__name__)

FORMAT_NAME = "cupy-amp.grad-scaler"
FORMAT_VERSION = 2
MAX_CHECKPOINT_BYTES = 1 << 20

# Why CRC-32: the checksum is there to catch torn writes, truncation and bit
# rot, not tampering (anyone who can edit the file can recompute any unkeyed
# hash, SHA-256 included). A 32-bit CRC detects every single-bit error and
# every burst of up to 32 bits, and misses a random corruption with
# probability 2**-32, which is ample for a file of a few hundred bytes; it is
# in the standard library (zlib) and in every language's toolbox.
_CRC_MARKER = 0xCE  # msgpack's uint32 type byte: the CRC-32 is always written with it.
_TRAILER_BYTES = 5
_ENVELOPE_ENTRIES = 4

# Versions 1 and 2 hold no arrays, binaries or exts and fewer than 20 fields; the
# limits leave a little room so that a value of the wrong kind is reported by
# field name rather than as unreadable bytes. Ext types are refused outright
# (max_ext_len stops long ones before they are read, _refuse_ext empty ones).
_UNPACK_LIMITS = {
    "max_str_len": 256,
    "max_bin_len": 256,
    "max_array_len": 16,
    "max_map_len": 32,
    "max_ext_len": 0,
}

_ENCODABLE_TYPES = (type(None), bool, int, float)
_INT_RANGE = (-(2**63), 2**64 - 1)  # what a msgpack int can hold

# The payload fields of version 1, in the order its encoder wrote them. Frozen:
# this is what a version-1 file holds, whatever later versions add.
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


def _upgrade_v1_payload(fields: dict[str, object]) -> dict[str, object]:
    """Return the version-2 fields of a version-1 payload (a new dict, in version-2 order).

    Raises:
        CheckpointFieldError: The payload does not hold exactly the version-1
            fields (one missing, or one version 1 does not have, the version-2
            fields included).
    """
    _expect_exact_fields(fields, _V1_FIELDS, version=1)
    upgraded: dict[str, object] = {}
    for name in _V1_FIELDS:
        upgraded[name] = fields[name]
        if name == "found_overflow":
            # One process: every overflow it saw was in its own gradients. A
            # non-bool found_overflow is copied as is and reported under its own
            # name by GradScalerCheckpoint, which checks found_overflow first.
            upgraded["found_overflow_local"] = fields[name]
    upgraded["remote_skipped_steps"] = 0
    return upgraded


def _expect_exact_fields(fields: Mapping[str, object], expected: tuple[str, ...], *, version: int) -> None:
    missing = [name for name in expected if name not in fields]
    unknown = sorted(repr(name) for name in fields if name not in expected)
    if missing:
        raise CheckpointFieldError(
            f"Invalid checkpoint: missing field(s) {', '.join(map(repr, missing))} of format version {version}."
        )
    if unknown:
        raise CheckpointFieldError(
            f"Invalid checkpoint: unknown field(s) {', '.join(unknown)} for format version {version}."
        )


# Payload migrations: _MIGRATIONS[v] turns the payload fields of format version
# v into those of version v + 1 (a new dict; the argument is left alone), so a
# file of any older version is read as the current one. A migration checks that
# it was given exactly version v's fields and raises CheckpointFieldError
# otherwise; the values are judged after the last migration, by
# GradScalerCheckpoint. A change to the fields means FORMAT_VERSION + 1 and an
# entry here, never an edit of what an earlier version means.
_MIGRATIONS: dict[int, Callable[[dict[str, object]], dict[str, object]]] = {1: _upgrade_v1_payload}


@dataclass(frozen=True)
class DecodedDocument:
    """A decoded checkpoint document.

    Attributes:
        version: The format version the document was written in (1 to
            :data:`FORMAT_VERSION`).
        fields: Its payload fields, upgraded to :data:`FORMAT_VERSION`.
    """

    version: int
    fields: dict[str, object]


class _Malformed(Exception):
    """Internal: the bytes are not a well-formed document (reported as CheckpointCorruptError)."""


class _FutureVersion(Exception):
    """Internal: the document's version is newer than FORMAT_VERSION (reported as CheckpointVersionError)."""

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


class _NotAScalar(Exception):
    """Internal: a payload value is a container or binary (reported as CheckpointFieldError)."""

    def __init__(self, name: str, kind: str) -> None:
        super().__init__(name, kind)
        self.name = name
        self.kind = kind


def describe_source(source: str | os.PathLike[str] | None) -> str:
    """Return how error messages name a checkpoint: ``checkpoint 'path'``, or ``checkpoint`` without a file."""
    if source is None:
        return "checkpoint"
    return f"checkpoint {os.fspath(source)!r}"


def encode_fields(fields: Mapping[str, object]) -> bytes:
    """Encode checkpoint fields as a document of the current version, :data:`FORMAT_VERSION`.

    The encoding is deterministic: maps keep the given order, ints take
    msgpack's shortest form, every float is a float64 (so a float32 scale and
    any float64 factor round-trip bit for bit) and None is nil. Validating the
    values is the caller's job (:meth:`GradScalerCheckpoint.to_bytes` passes
    only validated fields).

    Raises:
        CheckpointFieldError: A name is not a str, a value is not None, a bool,
            an int or a float, or an int does not fit in msgpack's 64 bits.
    """
    payload: dict[str, object] = {}
    for name, value in fields.items():
        if not isinstance(name, str):
            raise CheckpointFieldError(f"Invalid field name: expected a str, got {type(name).__name__}.")
        if type(value) not in _ENCODABLE_TYPES:
            raise CheckpointFieldError(
                f"Invalid {name!r}: expected None, a bool, an int or a float, got {type(value).__name__}."
            )
        if type(value) is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise CheckpointFieldError(f"Invalid {name!r}: expected an int that fits in 64 bits, got {value!r}.")
        payload[name] = value
    packer = msgpack.Packer(use_single_float=False, use_bin_type=True, strict_types=True, datetime=False)
    body = b"".join(
        [
            packer.pack_map_header(_ENVELOPE_ENTRIES),
            packer.pack("format"),
            packer.pack(FORMAT_NAME),
            packer.pack("version"),
            packer.pack(FORMAT_VERSION),
            packer.pack("payload"),
            packer.pack(payload),
            packer.pack("crc32"),
        ]
    )
    return body + bytes([_CRC_MARKER]) + zlib.crc32(body).to_bytes(4, "big")


def decode_fields(
    data: bytes | bytearray | memoryview, *, source: str | os.PathLike[str] | None = None
) -> dict[str, object]:
    """Parse a document and return its payload fields, migrated to the current version.

    The same as ``decode_document(data, source=source).fields``; see
    :func:`decode_document` for the checks and errors.
    """
    return decode_document(data, source=source).fields


def decode_document(
    data: bytes | bytearray | memoryview, *, source: str | os.PathLike[str] | None = None
) -> DecodedDocument:
    """Parse a document; return the version it was written in and its fields, migrated to the current version.

    The checks run in this order: size, envelope start (``format``), CRC-32,
    ``version``, the payload's structure, then, for an older version, that
    the payload holds exactly that version's fields (checked by its
    migration). The values themselves are checked by
    :meth:`GradScalerCheckpoint.from_dict`.

    Args:
        data: The whole document.
        source: The file the bytes came from, named in error messages.

    Raises:
        CheckpointCorruptError: The bytes are too large, not msgpack, not a
            cupy-amp checkpoint, fail the checksum, or are structured wrongly
            (missing, extra, duplicate or non-string keys, trailing bytes).
        CheckpointVersionError: The file was written by a newer format version.
        CheckpointFieldError: A payload value is a container or binary rather
            than a scalar, or an older version's payload lacks one of its
            fields or holds one it does not have.
        ArgumentTypeError: ``data`` is not a bytes-like object (a ``TypeError``).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"Expected the checkpoint as bytes, got {type(data).__name__}.")
    where = describe_source(source)
    located = "" if source is None else f"{where}: "
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > MAX_CHECKPOINT_BYTES:
        raise CheckpointCorruptError(f"{where}: {_too_large(f'{size} bytes')}")
    data = bytes(data)
    try:
        fields, version = _parse(data)
    except _Malformed as exc:
        raise CheckpointCorruptError(f"{where}: {exc}") from exc.__cause__
    except _FutureVersion as exc:
        raise CheckpointVersionError(
            f"{where}: written in format version {exc.version}, newer than this cupy-amp can read "
            f"(up to version {FORMAT_VERSION}); upgrade cupy-amp to load it."
        ) from None
    except _NotAScalar as exc:
        raise CheckpointFieldError(
            f"{located}Invalid {exc.name!r}: expected nil, a bool, an int or a float, got {exc.kind}."
        ) from None
    try:
        for older in range(version, FORMAT_VERSION):
            fields = _MIGRATIONS[older](fields)
    except CheckpointFieldError as exc:
        raise CheckpointFieldError(f"{located}{exc}") from None
    return DecodedDocument(version=version, fields=fields)


def read_checkpoint_file(path: str | os.PathLike[str]) -> bytes:
    """Return a checkpoint file's bytes, refusing files over the size limit unread.

    The size is checked with ``os.fstat`` before reading, and at most
    ``MAX_CHECKPOINT_BYTES + 1`` bytes are read, so a huge file, or one whose
    size the file system does not report (a device, a growing file), costs
    at most that much.

    Raises:
        CheckpointCorruptError: The file is larger than :data:`MAX_CHECKPOINT_BYTES`.
        OSError: The file cannot be opened or read (``FileNotFoundError`` for a
            missing file); passed through unchanged.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > MAX_CHECKPOINT_BYTES:
            raise CheckpointCorruptError(f"{describe_source(path)}: {_too_large(f'{size} bytes')}")
        data = file.read(MAX_CHECKPOINT_BYTES + 1)
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointCorruptError(
            f"{describe_source(path)}: {_too_large(f'more than {MAX_CHECKPOINT_BYTES} bytes')}"
        )
    return data


def write_file_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never a mix.

    The bytes go to a temporary file ``.<name>.tmp-<random hex>`` in the same
    directory, which is flushed to disk (``os.fsync``) and then renamed over
    ``path`` (``os.replace``); the directory is then synced so the rename
    survives a power loss. A symlink at ``path`` is replaced, not followed.
    The new file's permissions follow the process umask.

    Raises:
        OSError: Writing, syncing or renaming failed. The temporary file is
            removed and ``path`` still holds its previous content (or still does
            not exist). If only the final directory sync fails, ``path``
            already holds the new content but the rename may not survive a
            power loss.
    """
    target = os.fspath(path)
    directory, name = os.path.split(target)
    directory = directory or os.curdir
    temporary = os.path.join(directory, f".{name}.tmp-{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o666)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        # Windows cannot open a directory this way; its rename needs no directory sync.
        logger.debug("Cannot open directory %r to sync it; skipping the directory sync.", directory)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot sync a directory at all; any other failure is reported.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        logger.debug("File system cannot sync directory %r: %s", directory, exc)
    finally:
        os.close(fd)


def _parse(data: bytes) -> tuple[dict[str, object], int]:
    """Return the payload fields and the format version, or raise one of the private errors."""
    if not data:
        raise _Malformed("empty (0 bytes), not a cupy-amp checkpoint.")
    # The buffer is sized to the data (the Unpacker allocates max_buffer_size up front).
    unpacker = msgpack.Unpacker(
        None,
        raw=False,
        strict_map_key=True,
        object_pairs_hook=_map_from_pairs,
        ext_hook=_refuse_ext,
        max_buffer_size=len(data),
        **_UNPACK_LIMITS,
    )
    unpacker.feed(data)
    try:
        entries = unpacker.read_map_header()
    except Exception as exc:
        raise _Malformed("not a cupy-amp checkpoint: it does not start with a msgpack map.") from exc
    format_name = _read_entry(unpacker, "format")
    if format_name != FORMAT_NAME:
        raise _Malformed(f"not a cupy-amp checkpoint: expected 'format' {FORMAT_NAME!r}, got {_describe(format_name)}.")
    if entries != _ENVELOPE_ENTRIES:
        raise _Malformed(f"expected an envelope map of {_ENVELOPE_ENTRIES} entries, got {entries}.")
    _check_crc(data)

    version = _read_entry(unpacker, "version")
    if type(version) is not int or version < 1:
        raise _Malformed(f"Invalid 'version': expected an int >= 1, got {_describe(version)}.")
    if version > FORMAT_VERSION:
        raise _FutureVersion(version)

    payload = _read_entry(unpacker, "payload")
    if not isinstance(payload, dict):
        raise _Malformed(f"Invalid 'payload': expected a msgpack map of fields, got {_describe(payload)}.")
    for name, value in payload.items():
        if not isinstance(value, (type(None), bool, int, float, str)):
            raise _NotAScalar(name, _describe(value))

    _read_key(unpacker, "crc32")
    # _check_crc found 0xCE and four bytes at the end: a value starting exactly
    # there is that uint32, and nothing can follow it.
    if unpacker.tell() != len(data) - _TRAILER_BYTES:
        raise _Malformed("unexpected bytes between the 'crc32' key and the CRC-32 at the end of the file.")
    return payload, version


def _check_crc(data: bytes) -> None:
    if len(data) < _TRAILER_BYTES or data[-_TRAILER_BYTES] != _CRC_MARKER:
        raise _Malformed("no CRC-32 at the end of the file: it is truncated or damaged.")
    stored = int.from_bytes(data[-4:], "big")
    computed = zlib.crc32(data[:-_TRAILER_BYTES])
    if stored != computed:
        raise _Malformed(
            f"CRC-32 mismatch (stored 0x{stored:08x}, computed 0x{computed:08x}): the file is truncated or damaged."
        )


def _read_entry(unpacker: msgpack.Unpacker, key: str) -> object:
    _read_key(unpacker, key)
    return _unpack_next(unpacker, f"the {key!r} value")


def _read_key(unpacker: msgpack.Unpacker, key: str) -> None:
    found = _unpack_next(unpacker, f"the {key!r} key")
    if found != key:
        raise _Malformed(f"expected the envelope key {key!r} here, got {_describe(found)}.")


def _unpack_next(unpacker: msgpack.Unpacker, what: str) -> object:
    # Every parser failure becomes _Malformed: msgpack's OutOfData and
    # BufferFull are not ValueErrors, and a bad UTF-8 string, a stack overflow
    # on deep nesting or an over-limit length each raise something different.
    try:
        return unpacker.unpack()
    except _Malformed:
        raise
    except msgpack.OutOfData as exc:
        raise _Malformed(f"the data ends inside {what}: the file is truncated.") from exc
    except Exception as exc:
        raise _Malformed(f"{what} is not valid msgpack ({type(exc).__name__}: {exc}).") from exc


def _map_from_pairs(pairs: list[tuple[object, object]]) -> dict[str, object]:
    """Build a dict from a decoded map, refusing duplicate and non-string keys."""
    result: dict[str, object] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _Malformed(f"a map key must be a string, got {_describe(key)}.")
        if key in result:
            raise _Malformed(f"duplicate key {key!r} in a map.")
        result[key] = value
    return result


def _refuse_ext(code: int, data: bytes) -> object:
    raise _Malformed(f"msgpack ext type {code} found; the format uses none.")


def _describe(value: object) -> str:
    """Describe a decoded value for a message without repr-ing a container (which could be deep)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, list):
        return "a msgpack array"
    if isinstance(value, dict):
        return "a msgpack map"
    if isinstance(value, bytes):
        return "a msgpack bin"
    return f"a {type(value).__name__}"


def _too_large(size: str) -> str:
    return f"{size}, over the {MAX_CHECKPOINT_BYTES}-byte limit for a cupy-amp checkpoint; refusing to read it."
