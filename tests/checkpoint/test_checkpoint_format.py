"""The checkpoint file format: round trips, the golden files, the migrations, and every way bytes can be wrong."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
import sys
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from checkpoint_documents import (
    F32_MAX,
    GOLDEN_FIELDS,
    GOLDEN_FILES,
    GOLDEN_JOURNAL,
    GOLDEN_NAMES,
    GOLDEN_V1,
    GOLDEN_V1_FIELDS,
    GOLDEN_V1_PAYLOAD,
    GOLDEN_V2,
    GOLDEN_V2_FIELDS,
    GOLDEN_V2_PAYLOAD,
    GOLDEN_V3,
    SMALLEST_SCALE,
    U64_MAX,
    assert_identical,
    checkpoints,
    document,
    golden,
    packb,
    raw_map,
    seal,
    unpack_journal,
    v1_document,
    v2_document,
    with_fields,
)
from hypothesis import example, given
from hypothesis import strategies as st

from cupy_amp.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHECKPOINT_BYTES,
    GradScalerCheckpoint,
    decode_checkpoint,
)
from cupy_amp.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    CheckpointVersionError,
)


@given(checkpoints())
@example(with_fields(scale=SMALLEST_SCALE, min_scale=None))
@example(with_fields(scale=SMALLEST_SCALE * 3, min_scale=SMALLEST_SCALE, max_scale=SMALLEST_SCALE * 3))
@example(with_fields(scale=F32_MAX, min_scale=None, max_scale=None))
@example(with_fields(growth_factor=sys.float_info.max, backoff_factor=5e-324))
@example(with_fields(steps=U64_MAX, skipped_steps=U64_MAX, backoffs=U64_MAX, growths=0, remote_skipped_steps=U64_MAX))
@example(with_fields(found_overflow=False, found_overflow_local=False, remote_skipped_steps=0))
@example(with_fields(found_overflow=True, found_overflow_local=True))
def test_round_trip_is_exact_and_deterministic(checkpoint: GradScalerCheckpoint) -> None:
    data = checkpoint.to_bytes()
    decoded = GradScalerCheckpoint.from_bytes(data)
    assert decoded == checkpoint
    assert_identical(decoded, checkpoint)
    assert decoded.to_bytes() == data
    assert len(data) < 640 + len(checkpoint.journal)  # the golden examples' few names included


def test_every_float_is_written_as_float64() -> None:
    # 0x84 map header, then the payload map; floats must use 0xcb, never 0xca (float32).
    payload = msgpack.unpackb(golden().to_bytes()[:-5] + b"\x00", raw=False, use_list=False)["payload"]
    assert payload == GOLDEN_FIELDS
    for name in ("scale", "growth_factor", "backoff_factor", "min_scale"):
        marker = packb(name) + b"\xcb" + struct.pack(">d", GOLDEN_FIELDS[name])
        assert marker in golden().to_bytes(), name


def test_the_journal_is_a_bin_and_the_names_arrays_of_strings() -> None:
    data = golden().to_bytes()
    assert packb("journal") + b"\xc4" + bytes([len(GOLDEN_JOURNAL)]) + GOLDEN_JOURNAL in data  # bin 8
    names = b"\x92" + b"".join(b"\x92" + b"".join(packb(name) for name in call) for call in GOLDEN_NAMES)
    assert packb("journal_names") + names + packb("crc32") in data  # last, fixarrays of fixstrs


# The golden files. Each was written once, by the encoder of its version, and
# must never be regenerated or edited: grad_scaler_v1.ckpt by version 1,
# grad_scaler_v2.ckpt by version 2 (whose encoders no longer exist),
# grad_scaler_v3.ckpt by version 3. If the version-3 test fails, the encoder no
# longer writes version 3. Changing the format means a new FORMAT_VERSION, a
# migration from the previous version (cupy_amp.checkpoint_file._MIGRATIONS), a
# new golden file and its tests, never a regenerated one; the older golden files
# keep checking that their versions still decode.

GOLDEN_SHA256 = {
    GOLDEN_V1: "4c61e4a17341da7314c582ec61b18672e85ce78f36ff6b670dc7cb3a33a45caa",
    GOLDEN_V2: "fb4d60acd11c34f1870d6ab5e32bb0b656c1fc9569f7486e0040f0d5c673648e",
    GOLDEN_V3: "5ed4115e44dfa38081f9db2e5fb6518c8d34d70059d87a4778745a0051b6b0d3",
}


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda path: path.name)
def test_golden_files_are_unchanged(path: Path) -> None:
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GOLDEN_SHA256[path]


def test_golden_version_1_file_holds_the_version_1_payload() -> None:
    envelope = msgpack.unpackb(GOLDEN_V1.read_bytes()[:-5] + b"\x00", raw=False)
    assert envelope["version"] == 1
    assert envelope["payload"] == GOLDEN_V1_PAYLOAD
    assert list(envelope["payload"]) == list(GOLDEN_V1_PAYLOAD)


def test_decoder_reads_the_golden_version_1_file_through_the_migration() -> None:
    version, decoded = decode_checkpoint(GOLDEN_V1.read_bytes())
    assert version == 1
    assert decoded.to_dict() == GOLDEN_V1_FIELDS
    assert list(decoded.to_dict()) == list(GOLDEN_V1_FIELDS)
    loaded = GradScalerCheckpoint.load(GOLDEN_V1)
    assert loaded.to_dict() == GOLDEN_V1_FIELDS
    assert_identical(loaded, GradScalerCheckpoint(**GOLDEN_V1_FIELDS))


@pytest.mark.parametrize(
    ("path", "fields"), [(GOLDEN_V1, GOLDEN_V1_FIELDS), (GOLDEN_V2, GOLDEN_V2_FIELDS)], ids=["v1", "v2"]
)
def test_older_golden_files_are_rewritten_in_version_3(path: Path, fields: dict[str, Any]) -> None:
    upgraded = GradScalerCheckpoint.load(path).to_bytes()
    assert decode_checkpoint(upgraded)[0] == FORMAT_VERSION == 3
    assert upgraded == document(fields=fields)


def test_golden_version_2_file_holds_the_version_2_payload() -> None:
    envelope = msgpack.unpackb(GOLDEN_V2.read_bytes()[:-5] + b"\x00", raw=False)
    assert envelope["version"] == 2
    assert envelope["payload"] == GOLDEN_V2_PAYLOAD
    assert list(envelope["payload"]) == list(GOLDEN_V2_PAYLOAD)


def test_encoder_writes_the_golden_version_3_bytes() -> None:
    assert golden().to_bytes() == GOLDEN_V3.read_bytes()


def test_decoder_reads_the_golden_version_2_file_with_an_empty_journal() -> None:
    version, decoded = decode_checkpoint(GOLDEN_V2.read_bytes())
    assert version == 2
    assert decoded.to_dict() == GOLDEN_V2_FIELDS
    loaded = GradScalerCheckpoint.load(GOLDEN_V2)
    assert loaded.to_dict() == GOLDEN_V2_FIELDS
    assert list(loaded.to_dict()) == list(GOLDEN_V2_FIELDS)
    assert_identical(loaded, GradScalerCheckpoint(**GOLDEN_V2_FIELDS))
    assert (loaded.journal, loaded.journal_names, len(loaded.journal_entries())) == (b"", (), 0)


def test_decoder_reads_the_golden_version_3_file() -> None:
    version, decoded = decode_checkpoint(GOLDEN_V3.read_bytes())
    assert version == 3
    assert decoded.to_dict() == GOLDEN_FIELDS
    loaded = GradScalerCheckpoint.load(GOLDEN_V3)
    assert loaded.to_dict() == GOLDEN_FIELDS
    assert list(loaded.to_dict()) == list(GOLDEN_FIELDS)
    assert_identical(loaded, golden())
    assert loaded.journal_names == GOLDEN_NAMES
    # The entries as read, field by field against the bytes unpacked with the format's own layout.
    entries = loaded.journal_entries()
    expected = unpack_journal(GOLDEN_JOURNAL)
    assert len(entries) == len(expected) == 3
    for entry, fields in zip(entries, expected):
        for name, value in fields.items():
            assert float_bits_or_int(entry[name]) == float_bits_or_int(value), name
    assert entries["step"].tolist() == [4_999_997_999, 4_999_999_999, 5_000_000_000]


def float_bits_or_int(value: Any) -> Any:
    """A value compared so that NaN equals NaN: floats by their float32 bits, the rest as Python ints."""
    if isinstance(value, (float, np.floating)):
        return np.float32(value).tobytes()
    return int(value)


def test_test_helper_builds_the_same_bytes_as_the_encoder() -> None:
    # The hand-built documents below are only meaningful if a valid one matches the encoder, and the older
    # ones if they match the files their encoders wrote.
    assert document() == GOLDEN_V3.read_bytes()
    assert v2_document() == GOLDEN_V2.read_bytes()
    assert v1_document() == GOLDEN_V1.read_bytes()


@given(checkpoints())
def test_version_1_document_reads_as_the_single_process_checkpoint(checkpoint: GradScalerCheckpoint) -> None:
    fields = checkpoint.to_dict()
    data = v1_document({name: fields[name] for name in GOLDEN_V1_PAYLOAD})
    decoded = GradScalerCheckpoint.from_bytes(data)
    expected = dataclasses.replace(checkpoint, found_overflow_local=checkpoint.found_overflow, remote_skipped_steps=0)
    assert_identical(decoded, expected)
    assert decode_checkpoint(data)[0] == 1


@pytest.mark.parametrize("found_overflow", [False, True])
def test_version_1_overflow_is_local(found_overflow: bool) -> None:
    data = v1_document({**GOLDEN_V1_PAYLOAD, "found_overflow": found_overflow})
    decoded = GradScalerCheckpoint.from_bytes(data)
    assert decoded.found_overflow is found_overflow
    assert decoded.found_overflow_local is found_overflow
    assert decoded.remote_skipped_steps == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"found_overflow_local": True},
        {"found_overflow_local": False},
        {"remote_skipped_steps": 0},
        {"found_overflow_local": True, "remote_skipped_steps": 0},
        {"loss_scale": 1.0},
    ],
    ids=["local-true", "local-false", "remote", "both", "foreign"],
)
def test_version_1_document_with_fields_version_1_lacks_is_a_field_error(extra: dict[str, Any]) -> None:
    # Even values the migration would have produced itself: a version-1 file with them was not written by version 1.
    data = v1_document({**GOLDEN_V1_PAYLOAD, **extra})
    unknown = ", ".join(repr(name) for name in sorted(extra))
    with pytest.raises(CheckpointFieldError, match=re.escape(f"unknown field(s) {unknown} for format version 1")):
        GradScalerCheckpoint.from_bytes(data)


@pytest.mark.parametrize("name", list(GOLDEN_V1_PAYLOAD))
def test_version_1_document_missing_a_field_is_a_field_error(name: str) -> None:
    payload = {key: value for key, value in GOLDEN_V1_PAYLOAD.items() if key != name}
    with pytest.raises(CheckpointFieldError, match=re.escape(f"missing field(s) {name!r} of format version 1")):
        GradScalerCheckpoint.from_bytes(v1_document(payload))


def test_version_2_document_with_the_version_1_fields_is_a_field_error() -> None:
    with pytest.raises(CheckpointFieldError, match=r"missing field.*'found_overflow_local', 'remote_skipped_steps'"):
        GradScalerCheckpoint.from_bytes(v2_document(GOLDEN_V1_PAYLOAD))


def test_version_3_document_with_the_version_2_fields_is_a_field_error() -> None:
    # from_dict() may leave the journal out (no journal); a version-3 file may not.
    with pytest.raises(
        CheckpointFieldError, match=re.escape("missing field(s) 'journal', 'journal_names' of format version 3")
    ):
        GradScalerCheckpoint.from_bytes(document(fields=GOLDEN_V2_PAYLOAD))
    for name in ("journal", "journal_names"):
        fields = {key: value for key, value in GOLDEN_FIELDS.items() if key != name}
        with pytest.raises(CheckpointFieldError, match=re.escape(f"missing field(s) {name!r} of format version 3")):
            GradScalerCheckpoint.from_bytes(document(fields=fields))


def test_version_1_invalid_found_overflow_is_reported_under_its_own_name() -> None:
    for value in (1, None, "true"):
        with pytest.raises(CheckpointFieldError, match=r"^Invalid 'found_overflow': expected"):
            GradScalerCheckpoint.from_bytes(v1_document({**GOLDEN_V1_PAYLOAD, "found_overflow": value}))


@pytest.mark.parametrize("golden_file", GOLDEN_FILES, ids=lambda path: path.name)
def test_every_truncation_is_corrupt(golden_file: Path) -> None:
    data = golden_file.read_bytes()
    for length in range(len(data)):
        with pytest.raises(CheckpointCorruptError):
            GradScalerCheckpoint.from_bytes(data[:length])


@pytest.mark.parametrize("golden_file", GOLDEN_FILES, ids=lambda path: path.name)
def test_every_single_bit_flip_is_corrupt(golden_file: Path) -> None:
    data = golden_file.read_bytes()
    for index in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            with pytest.raises(CheckpointCorruptError):
                GradScalerCheckpoint.from_bytes(bytes(flipped))


@pytest.mark.parametrize("golden_file", GOLDEN_FILES, ids=lambda path: path.name)
@pytest.mark.parametrize(
    "extra", [b"\x00", b"\xc0", GOLDEN_V1.read_bytes(), GOLDEN_V2.read_bytes(), GOLDEN_V3.read_bytes()]
)
def test_trailing_bytes_are_corrupt(golden_file: Path, extra: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(golden_file.read_bytes() + extra)


def test_trailing_bytes_behind_a_valid_crc_are_corrupt() -> None:
    # The CRC-32 is right, but the 'crc32' value is followed by another object.
    body = raw_map([*_valid_head(), (packb("crc32"), b"")])
    data = seal(body + b"\x00")
    with pytest.raises(CheckpointCorruptError, match="unexpected bytes between"):
        GradScalerCheckpoint.from_bytes(data)


@given(st.binary(max_size=600))
def test_random_bytes_raise_only_checkpoint_errors(data: bytes) -> None:
    with pytest.raises(CheckpointError):
        GradScalerCheckpoint.from_bytes(data)


def test_a_non_bytes_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bytes"):
        GradScalerCheckpoint.from_bytes(GOLDEN_V3.read_text("latin-1"))  # type: ignore[arg-type]


def test_bytearray_and_memoryview_are_accepted() -> None:
    data = GOLDEN_V3.read_bytes()
    assert GradScalerCheckpoint.from_bytes(bytearray(data)) == golden()  # type: ignore[arg-type]
    assert GradScalerCheckpoint.from_bytes(memoryview(data)) == golden()  # type: ignore[arg-type]


def _valid_head() -> list[tuple[bytes, bytes]]:
    return [
        (packb("format"), packb(FORMAT_NAME)),
        (packb("version"), packb(FORMAT_VERSION)),
        (packb("payload"), packb(GOLDEN_FIELDS)),
    ]


INFLATED_HEADERS = {
    "map32": b"\xdf\xff\xff\xff\xff",
    "array32": b"\xdd\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff",
    "bin32": b"\xc6\xff\xff\xff\xff",
    "ext32": b"\xc9\xff\xff\xff\xff\x01",
    "map16": b"\xde\xff\xff",
    "array16": b"\xdc\xff\xff",
}


def _inflated_documents() -> list[tuple[str, bytes]]:
    cases = []
    for kind, header in INFLATED_HEADERS.items():
        filler = header + b"\x00" * 64
        cases.append((f"{kind}-payload", document(filler)))
        cases.append((f"{kind}-field", document(raw_map([(packb("scale"), filler)]))))
        cases.append((f"{kind}-version", document(version=filler)))
        cases.append((f"{kind}-top", seal(filler + packb("crc32"))))
        cases.append((f"{kind}-key", seal(b"\x84" + filler + packb("crc32"))))
    return cases


@pytest.mark.parametrize(("case", "data"), _inflated_documents(), ids=[case for case, _ in _inflated_documents()])
def test_inflated_length_headers_allocate_nothing_large(case: str, data: bytes) -> None:
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(CheckpointError):
            GradScalerCheckpoint.from_bytes(data)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{case}: peak {peak} bytes"
    assert elapsed < 2.0


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
def test_deep_nesting_is_corrupt_and_fast(opener: bytes) -> None:
    nested = opener * 100_000 + b"\xc0"
    for data in (document(nested), document(raw_map([(packb("scale"), nested)])), seal(nested)):
        started = time.perf_counter()
        with pytest.raises(CheckpointCorruptError):
            GradScalerCheckpoint.from_bytes(data)
        assert time.perf_counter() - started < 2.0


def test_duplicate_payload_key_is_corrupt() -> None:
    pairs = [(packb(name), packb(value)) for name, value in GOLDEN_FIELDS.items()]
    duplicated = raw_map([*pairs, (packb("scale"), packb(1.0))])
    with pytest.raises(CheckpointCorruptError, match="duplicate key 'scale'"):
        GradScalerCheckpoint.from_bytes(document(duplicated))


def test_duplicate_key_with_the_same_value_is_still_corrupt() -> None:
    pairs = [(packb(name), packb(value)) for name, value in GOLDEN_FIELDS.items()]
    duplicated = raw_map([*pairs, pairs[0]])
    with pytest.raises(CheckpointCorruptError, match="duplicate key"):
        GradScalerCheckpoint.from_bytes(document(duplicated))


def test_duplicate_envelope_key_is_corrupt() -> None:
    head = _valid_head()
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(document(head=[head[0], head[0], head[2]]))
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(document(head=[head[0], head[1], head[1]]))


@pytest.mark.parametrize("key", [packb(1), packb(b"scale"), packb(None), packb(1.5), b"\x91\x01"])
def test_non_string_payload_keys_are_corrupt(key: bytes) -> None:
    pairs = [(packb(name), packb(value)) for name, value in GOLDEN_FIELDS.items()]
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(document(raw_map([*pairs[1:], (key, packb(1.0))])))


@pytest.mark.parametrize("ext", [b"\xd4\x01\x00", b"\xd6\xff\x00\x00\x00\x00", b"\xc7\x00\x05"])
def test_ext_types_are_corrupt(ext: bytes) -> None:
    payload = packb({**GOLDEN_FIELDS, "scale": None})
    assert payload.startswith(b"\xde\x00\x19\xa5scale\xc0")  # map16 of 25 entries, then the first one
    with pytest.raises(CheckpointCorruptError, match="ext"):
        GradScalerCheckpoint.from_bytes(document(payload.replace(b"\xc0", ext, 1)))


def test_invalid_utf8_is_corrupt() -> None:
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(document(raw_map([(b"\xa2\xff\xfe", packb(1.0))])))


def test_over_long_string_value_is_corrupt() -> None:
    long_string = msgpack.packb("x" * 1000)
    with pytest.raises(CheckpointCorruptError, match="max_str_len"):
        GradScalerCheckpoint.from_bytes(document(raw_map([(packb("scale"), long_string)])))


@pytest.mark.parametrize(
    "format_name",
    [packb("cupy-amp.other"), packb(""), packb(None), packb(1), packb(b"cupy-amp.grad-scaler"), packb([])],
)
def test_wrong_format_name_is_corrupt(format_name: bytes) -> None:
    with pytest.raises(CheckpointCorruptError, match="not a cupy-amp checkpoint"):
        GradScalerCheckpoint.from_bytes(document(format_name=format_name))


@pytest.mark.parametrize(
    "version",
    [packb(True), packb(False), packb(0), packb(-1), packb(1.0), packb("1"), packb(None), packb([1])],
)
def test_malformed_version_is_corrupt(version: bytes) -> None:
    with pytest.raises(CheckpointCorruptError, match="'version'"):
        GradScalerCheckpoint.from_bytes(document(version=version))


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, FORMAT_VERSION + 2, 2**31, U64_MAX])
def test_future_version_asks_for_an_upgrade(version: int) -> None:
    with pytest.raises(CheckpointVersionError, match=f"format version {version}.*upgrade cupy-amp"):
        GradScalerCheckpoint.from_bytes(document(version=packb(version)))


def test_future_version_is_recognised_whatever_its_payload() -> None:
    # A later version may hold things the current one would refuse (long arrays, ext types, new keys).
    payload = packb(list(range(1000))) + b"\xd4\x01\x00"
    data = document(payload, version=packb(FORMAT_VERSION + 1))
    with pytest.raises(CheckpointVersionError):
        GradScalerCheckpoint.from_bytes(data)


@pytest.mark.parametrize("payload", [packb([]), packb(None), packb("x"), packb(1), packb(b"x")])
def test_payload_must_be_a_map(payload: bytes) -> None:
    with pytest.raises(CheckpointCorruptError, match="'payload'"):
        GradScalerCheckpoint.from_bytes(document(payload))


def test_envelope_keys_must_come_in_order() -> None:
    head = _valid_head()
    for order in ([head[1], head[0], head[2]], [head[0], head[2], head[1]]):
        with pytest.raises(CheckpointCorruptError):
            GradScalerCheckpoint.from_bytes(document(head=order))


def test_envelope_with_extra_or_missing_entries_is_corrupt() -> None:
    with pytest.raises(CheckpointCorruptError, match="4 entries"):
        GradScalerCheckpoint.from_bytes(document(tail=[(packb("note"), packb("hi"))]))
    with pytest.raises(CheckpointCorruptError, match="4 entries"):
        GradScalerCheckpoint.from_bytes(document(head=_valid_head()[:2]))


def test_checksum_written_in_another_int_encoding_is_corrupt() -> None:
    body = raw_map([*_valid_head(), (packb("crc32"), b"")])
    as_uint64 = body + b"\xcf" + zlib.crc32(body).to_bytes(8, "big")
    with pytest.raises(CheckpointCorruptError, match="CRC-32"):
        GradScalerCheckpoint.from_bytes(as_uint64)


def test_float32_encoded_values_decode_to_the_same_checkpoint() -> None:
    # The encoder never writes float32, but a float32 value holds the same number; the checksum still guards it.
    payload = msgpack.packb(GOLDEN_FIELDS, use_single_float=True)
    assert GradScalerCheckpoint.from_bytes(document(payload)).scale == GOLDEN_FIELDS["scale"]


def test_bytes_over_the_limit_are_refused_before_parsing() -> None:
    oversize = GOLDEN_V3.read_bytes() + b"\x00" * MAX_CHECKPOINT_BYTES
    with pytest.raises(CheckpointCorruptError, match="limit"):
        GradScalerCheckpoint.from_bytes(oversize)
