"""The bytes of a scaler's state file: the envelope, the CRC-32, a reader that trusts nothing, the migrations.

A file (format version 2) is one msgpack map with exactly four entries, in this order::

    "format"  -> "cupy-amp.grad-scaler"
    "version" -> 2                      (an int; never a bool)
    "payload" -> {field name: value}    (nil, bool, int or float64 values; from version 3, the rule's
                                         string, the journal's bin and its array of arrays of names)
    "crc32"   -> CRC-32 of every byte before this value, as a msgpack uint32

so a file always ends with ``0xCE`` and the four big-endian bytes of the
CRC-32. The envelope is the same in every version, so any version is
recognised and its checksum verified; only the payload changes, an older one
being upgraded by :data:`_MIGRATIONS`. Reading checks the size cap, the
envelope's start and the CRC-32 before it parses anything, then reads msgpack
alone (no pickle, nothing driven by the content) with small length limits,
refusing ext types, duplicate or non-string keys and trailing bytes. The
values are judged by :class:`~cupy_amp.checkpoint.GradScalerCheckpoint`, with the scaler's own rules.

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
3. Adds, last and in this order: ``rule`` (a string: ``"pytorch"`` or
   ``"headroom"``), the headroom rule's memory ``overflow_scale``,
   ``overflow_norm``, ``clean_scale``, ``clean_norm`` (floats) and
   ``overflows_in_row`` (an int), ``journal`` (a bin: the step journal's
   entries, oldest first, each :data:`cupy_amp.journal.ENTRY`'s little-endian
   bytes) and ``journal_names`` (an array with one array per gradient call of
   the last step, of each gradient's name as a string; empty when not kept).
   A version-2 payload is upgraded with PyTorch's rule (its memory 0), an
   empty journal and no names.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from cupy_amp.errors import ArgumentTypeError, CheckpointCorruptError, CheckpointFieldError, CheckpointVersionError

__all__ = ["FILE_PREFIX", "FORMAT_NAME", "FORMAT_VERSION", "MAX_CHECKPOINT_BYTES", "decode", "encode", "expect_exactly"]

FORMAT_NAME = "cupy-amp.grad-scaler"
FORMAT_VERSION = 3
MAX_CHECKPOINT_BYTES = 1 << 20

# Every file starts with these bytes: a map of 4 entries whose first is "format": FORMAT_NAME.
FILE_PREFIX = b"\x84" + msgpack.packb("format") + msgpack.packb(FORMAT_NAME)
_TRAILER = 5  # 0xCE, msgpack's uint32 marker, then the CRC-32
# Fewer than 32 scalar fields, a journal of at most 8192 entries of 64 bytes, and at most 4096 names of
# at most 128 characters (cupy_amp.journal), which UTF-8 writes in up to 4 bytes each; a little room is left
# so that a value of the wrong kind is reported by field name rather than as unreadable bytes.
_LIMITS = {
    "max_str_len": 128 * 4, "max_bin_len": 8192 * 64, "max_array_len": 4096, "max_map_len": 32, "max_ext_len": 0,
}  # fmt: skip
_NESTED = ("journal", "journal_names")  # the fields that are not scalars (judged by GradScalerCheckpoint)


def encode(fields: dict[str, Any]) -> bytes:
    """Return the current format version's bytes for ``fields`` (deterministic: equal fields, equal bytes).

    Every float is stored as a float64, so the scale round-trips bit for bit.
    """
    packer = msgpack.Packer(use_single_float=False, use_bin_type=True, strict_types=True, datetime=False)
    parts = ("version", FORMAT_VERSION, "payload", fields, "crc32")
    body: bytes = FILE_PREFIX + b"".join(packer.pack(part) for part in parts)
    return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")


def decode(data: bytes | bytearray | memoryview) -> tuple[int, dict[str, object]]:
    """Return the format version ``data`` was written in, and its payload upgraded to the current version's fields.

    Raises:
        CheckpointCorruptError: The bytes are not an intact state file.
        CheckpointVersionError: They were written by a newer format version.
        CheckpointFieldError: A value is not a scalar (the journal's two fields aside), a version-1 payload
            lacks or adds a field, a version-2 payload holds a journal field or a current one lacks one.
        ArgumentTypeError: ``data`` is not bytes-like (a ``TypeError``).
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
    _unpack(unpacker, "the 'payload' key", expect="payload")
    fields = _payload(unpacker)
    for name, value in fields.items():
        if name not in _NESTED and not isinstance(value, (type(None), bool, int, float, str)):
            raise CheckpointFieldError(
                f"Invalid {name!r}: expected nil, a bool, an int or a float, got {_describe(value)}."
            )
    _unpack(unpacker, "the 'crc32' key", expect="crc32")
    if unpacker.tell() != len(body):
        raise CheckpointCorruptError("unexpected bytes between the 'crc32' key and the CRC-32 at the end of the file.")
    for older in range(version, FORMAT_VERSION):
        fields = _MIGRATIONS[older](fields)
    missing = [name for name in _NESTED if name not in fields]  # a migration adds them: only a current payload lacks
    if missing:
        raise CheckpointFieldError(
            f"Invalid checkpoint: missing field(s) {', '.join(map(repr, missing))} of format version {version}."
        )
    return version, fields


def _payload(unpacker: msgpack.Unpacker) -> dict[str, object]:
    """Read the payload map entry by entry, so that a value the parser refuses (over a length limit, say) is
    reported under its field's name; a payload that is not a map is read whole, to say what it is."""
    try:
        count = unpacker.read_map_header()
    except msgpack.OutOfData as exc:
        raise CheckpointCorruptError("the data ends inside the 'payload' value: the file is truncated.") from exc
    except Exception:  # not a map header: nothing was consumed
        value = _unpack(unpacker, "the 'payload' value")
        raise CheckpointCorruptError(
            f"Invalid 'payload': expected a msgpack map of fields, got {_describe(value)}."
        ) from None
    if count > _LIMITS["max_map_len"]:  # as the parser checks every other map
        raise CheckpointCorruptError(
            f"the 'payload' value is not valid msgpack (a map of {count} entries exceeds "
            f"max_map_len({_LIMITS['max_map_len']}))."
        )
    pairs: list[tuple[object, object]] = []
    for _ in range(count):
        key = _unpack(unpacker, "a 'payload' key")
        if not isinstance(key, str):
            raise CheckpointCorruptError(f"a map key must be a string, got {_describe(key)}.")
        pairs.append((key, _unpack(unpacker, f"the {key!r} value")))
    return _map(pairs)


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
    expect_exactly(fields, _V1_FIELDS, "Invalid checkpoint", "field", version="1")
    upgraded: dict[str, object] = {}
    for name in _V1_FIELDS:
        upgraded[name] = fields[name]
        if name == "found_overflow":
            # One process: every overflow it saw was in its own gradients. A non-bool is copied as it
            # is and reported under its own name, since found_overflow is checked first.
            upgraded["found_overflow_local"] = fields[name]
    upgraded["remote_skipped_steps"] = 0
    return upgraded


def _upgrade_v2(fields: dict[str, object]) -> dict[str, object]:
    """Return the version-3 fields of a version-2 payload: PyTorch's rule, no journal and no names (its fields are
    judged later)."""
    if any(name in fields for name in _NESTED):
        raise CheckpointFieldError(
            f"Invalid checkpoint: unknown field(s) {', '.join(map(repr, _NESTED))} for format version 2."
        )
    rule = {"rule": "pytorch", "overflow_scale": 0.0, "overflow_norm": 0.0, "clean_scale": 0.0, "clean_norm": 0.0}
    return {**fields, **rule, "overflows_in_row": 0, "journal": b"", "journal_names": []}


# _MIGRATIONS[v] turns version v's payload into version v + 1's (a new dict). A change to the
# fields means FORMAT_VERSION + 1 and an entry here, never an edit of what an earlier version means.
_MIGRATIONS: dict[int, Callable[[dict[str, object]], dict[str, object]]] = {1: _upgrade_v1, 2: _upgrade_v2}


def expect_exactly(fields: Any, names: tuple[str, ...] | list[str], what: str, kind: str, version: str = "") -> None:
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
