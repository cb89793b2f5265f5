"""The checkpoint file format: round trips, the golden file, and every way a file can be wrong."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pickle
import re
import stat
import struct
import sys
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cupy_amp import checkpoint_format
from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.checkpoint_format import FORMAT_NAME, FORMAT_VERSION, MAX_CHECKPOINT_BYTES, decode_document
from cupy_amp.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFieldError,
    CheckpointVersionError,
)

DATA = Path(__file__).parent / "data"
GOLDEN_V1 = DATA / "grad_scaler_v1.ckpt"
GOLDEN_V2 = DATA / "grad_scaler_v2.ckpt"
GOLDEN_FILES = [GOLDEN_V1, GOLDEN_V2]
U64_MAX = 2**64 - 1
F32_MAX = float(np.finfo(np.float32).max)
F32_TINIEST = float(np.finfo(np.float32).smallest_subnormal)

# The payload stored in tests/data/grad_scaler_v1.ckpt, as written by the
# version-1 encoder. Chosen so the file exercises every encoding the format
# uses: a float32 power-of-two scale, a float64 factor float32 cannot hold
# (0.8), a nil clamp, a uint64 counter.
GOLDEN_V1_PAYLOAD: dict[str, Any] = {
    "scale": 32768.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.8,
    "growth_interval": 2000,
    "consecutive_good_steps": 1234,
    "found_overflow": True,
    "enabled": True,
    "min_scale": 2.0**-14,
    "max_scale": None,
    "hysteresis": 2,
    "hysteresis_tracker": 1,
    "steps": 5_000_000_000,
    "skipped_steps": 300,
    "growths": 40,
    "backoffs": 12,
}
# What grad_scaler_v1.ckpt reads as today: the version-1 payload upgraded to
# version 2 (found_overflow_local = found_overflow, remote_skipped_steps = 0).
GOLDEN_V1_FIELDS: dict[str, Any] = {
    "scale": 32768.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.8,
    "growth_interval": 2000,
    "consecutive_good_steps": 1234,
    "found_overflow": True,
    "found_overflow_local": True,
    "enabled": True,
    "min_scale": 2.0**-14,
    "max_scale": None,
    "hysteresis": 2,
    "hysteresis_tracker": 1,
    "steps": 5_000_000_000,
    "skipped_steps": 300,
    "growths": 40,
    "backoffs": 12,
    "remote_skipped_steps": 0,
}
# The checkpoint stored in tests/data/grad_scaler_v2.ckpt: the same encodings
# as version 1, plus the version-2 fields with values a version-1 file cannot
# yield (an overflow on another rank only, three remote skips).
GOLDEN_FIELDS: dict[str, Any] = {
    "scale": 32768.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.8,
    "growth_interval": 2000,
    "consecutive_good_steps": 0,
    "found_overflow": True,
    "found_overflow_local": False,
    "enabled": True,
    "min_scale": 2.0**-14,
    "max_scale": None,
    "hysteresis": 2,
    "hysteresis_tracker": 1,
    "steps": 5_000_000_000,
    "skipped_steps": 300,
    "growths": 40,
    "backoffs": 12,
    "remote_skipped_steps": 3,
}
BOOL_FIELDS = ("found_overflow", "found_overflow_local", "enabled")
INT_FIELDS = (
    "growth_interval",
    "consecutive_good_steps",
    "hysteresis",
    "hysteresis_tracker",
    "steps",
    "skipped_steps",
    "growths",
    "backoffs",
    "remote_skipped_steps",
)
FLOAT_FIELDS = ("scale", "growth_factor", "backoff_factor", "min_scale", "max_scale")


def golden() -> GradScalerCheckpoint:
    return GradScalerCheckpoint(**GOLDEN_FIELDS)


def packb(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True, use_single_float=False)
    return packed


def raw_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A msgpack map from already-packed keys and values (so keys may repeat)."""
    header: bytes = msgpack.Packer().pack_map_header(len(pairs))
    return header + b"".join(key + value for key, value in pairs)


def seal(body: bytes) -> bytes:
    """Append the CRC-32 trailer, as the format requires, to a body ending with the 'crc32' key."""
    return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")


def document(
    payload: bytes | None = None,
    *,
    fields: dict[str, Any] | None = None,
    format_name: bytes | None = None,
    version: bytes | None = None,
    head: list[tuple[bytes, bytes]] | None = None,
    tail: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """Build a sealed document piece by piece; anything not given is as a valid file has it."""
    if payload is None:
        payload = packb(GOLDEN_FIELDS if fields is None else fields)
    pairs = [
        (packb("format"), packb(FORMAT_NAME) if format_name is None else format_name),
        (packb("version"), packb(FORMAT_VERSION) if version is None else version),
        (packb("payload"), payload),
    ]
    if head is not None:
        pairs = head
    if tail is not None:
        pairs = pairs + tail
    body = raw_map([*pairs, (packb("crc32"), b"")])
    return seal(body)


def v1_document(fields: dict[str, Any] | None = None) -> bytes:
    """A sealed version-1 document, laid out as the version-1 encoder wrote it (default: GOLDEN_V1_PAYLOAD)."""
    return document(fields=GOLDEN_V1_PAYLOAD if fields is None else fields, version=packb(1))


def float_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def assert_identical(a: GradScalerCheckpoint, b: GradScalerCheckpoint) -> None:
    """Equal field by field, with the same types and the same float bits."""
    for name, left in a.to_dict().items():
        right = getattr(b, name)
        assert type(left) is type(right), name
        if isinstance(left, float):
            assert float_bits(left) == float_bits(right), name
        else:
            assert left == right, name


def f32(low: float, high: float = F32_MAX) -> st.SearchStrategy[float]:
    return st.floats(min_value=low, max_value=high, width=32, allow_nan=False, allow_infinity=False).map(abs)


@st.composite
def checkpoints(draw: st.DrawFn) -> GradScalerCheckpoint:
    """Any valid checkpoint: None clamps, scale 0 (only without a floor), subnormal float32 scales."""
    min_scale = draw(st.none() | f32(F32_TINIEST))
    max_scale = draw(st.none() | f32(F32_TINIEST if min_scale is None else min_scale))
    scale = draw(f32(0.0 if min_scale is None else min_scale, F32_MAX if max_scale is None else max_scale))
    growth_interval = draw(st.integers(1, U64_MAX))
    hysteresis = draw(st.integers(1, U64_MAX))
    steps = draw(st.integers(0, U64_MAX))
    skipped = draw(st.integers(0, steps))
    found_overflow = draw(st.booleans())
    return GradScalerCheckpoint(
        scale=scale,
        growth_factor=draw(st.floats(min_value=1.0, exclude_min=True, allow_nan=False, allow_infinity=False)),
        backoff_factor=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True)),
        growth_interval=growth_interval,
        consecutive_good_steps=draw(st.integers(0, growth_interval - 1)),
        found_overflow=found_overflow,
        found_overflow_local=draw(st.booleans()) if found_overflow else False,
        enabled=draw(st.booleans()),
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
        hysteresis_tracker=draw(st.integers(0, hysteresis)),
        steps=steps,
        skipped_steps=skipped,
        growths=draw(st.integers(0, steps - skipped)),
        backoffs=draw(st.integers(0, skipped)),
        remote_skipped_steps=draw(st.integers(0, skipped)),
    )


def with_fields(**changes: Any) -> GradScalerCheckpoint:
    return GradScalerCheckpoint(**{**GOLDEN_FIELDS, **changes})


# Round trips


@given(checkpoints())
@example(with_fields(scale=0.0, min_scale=None))
@example(with_fields(scale=F32_TINIEST, min_scale=None))
@example(with_fields(scale=F32_TINIEST * 3, min_scale=F32_TINIEST, max_scale=F32_TINIEST * 3))
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
    assert len(data) < 512


def test_save_then_load_returns_the_same_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    for checkpoint in (
        golden(),
        with_fields(scale=0.0, min_scale=None, found_overflow=False, found_overflow_local=False),
    ):
        checkpoint.save(target)
        assert_identical(GradScalerCheckpoint.load(target), checkpoint)
        assert GradScalerCheckpoint.load(str(target)) == checkpoint
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_every_float_is_written_as_float64() -> None:
    # 0x84 map header, then the payload map; floats must use 0xcb, never 0xca (float32).
    payload = msgpack.unpackb(golden().to_bytes()[:-5] + b"\x00", raw=False)["payload"]
    assert payload == GOLDEN_FIELDS
    for name in ("scale", "growth_factor", "backoff_factor", "min_scale"):
        marker = packb(name) + b"\xcb" + struct.pack(">d", GOLDEN_FIELDS[name])
        assert marker in golden().to_bytes(), name


# The golden files. Each was written once, by the encoder of its version, and
# must never be regenerated or edited: grad_scaler_v1.ckpt by version 1 (whose
# encoder no longer exists), grad_scaler_v2.ckpt by version 2. If the version-2
# test fails, the encoder no longer writes version 2. Changing the format means
# a new FORMAT_VERSION, a migration from the previous version
# (checkpoint_format._MIGRATIONS), a new golden file and its tests, never a
# regenerated one; the older golden files keep checking that their versions
# still decode.

GOLDEN_SHA256 = {
    GOLDEN_V1: "4c61e4a17341da7314c582ec61b18672e85ce78f36ff6b670dc7cb3a33a45caa",
    GOLDEN_V2: "fb4d60acd11c34f1870d6ab5e32bb0b656c1fc9569f7486e0040f0d5c673648e",
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
    document = decode_document(GOLDEN_V1.read_bytes())
    assert document.version == 1
    assert document.fields == GOLDEN_V1_FIELDS
    assert list(document.fields) == list(GOLDEN_V1_FIELDS)
    loaded = GradScalerCheckpoint.load(GOLDEN_V1)
    assert loaded.to_dict() == GOLDEN_V1_FIELDS
    assert_identical(loaded, GradScalerCheckpoint(**GOLDEN_V1_FIELDS))


def test_golden_version_1_file_is_rewritten_in_version_2() -> None:
    upgraded = GradScalerCheckpoint.load(GOLDEN_V1).to_bytes()
    assert decode_document(upgraded).version == FORMAT_VERSION == 2
    assert upgraded == document(fields=GOLDEN_V1_FIELDS)


def test_encoder_writes_the_golden_version_2_bytes() -> None:
    assert golden().to_bytes() == GOLDEN_V2.read_bytes()


def test_decoder_reads_the_golden_version_2_file() -> None:
    document = decode_document(GOLDEN_V2.read_bytes())
    assert document.version == 2
    assert document.fields == GOLDEN_FIELDS
    loaded = GradScalerCheckpoint.load(GOLDEN_V2)
    assert loaded.to_dict() == GOLDEN_FIELDS
    assert list(loaded.to_dict()) == list(GOLDEN_FIELDS)
    assert_identical(loaded, golden())


def test_test_helper_builds_the_same_bytes_as_the_encoder() -> None:
    # The hand-built documents below are only meaningful if a valid one matches the encoder.
    assert document() == GOLDEN_V2.read_bytes()
    assert v1_document() == GOLDEN_V1.read_bytes()


# Version 1 files: upgraded by the migration, which accepts exactly the version-1 fields.


@given(checkpoints())
def test_version_1_document_reads_as_the_single_process_checkpoint(checkpoint: GradScalerCheckpoint) -> None:
    fields = checkpoint.to_dict()
    data = v1_document({name: fields[name] for name in GOLDEN_V1_PAYLOAD})
    decoded = GradScalerCheckpoint.from_bytes(data)
    expected = dataclasses.replace(checkpoint, found_overflow_local=checkpoint.found_overflow, remote_skipped_steps=0)
    assert_identical(decoded, expected)
    assert decode_document(data).version == 1


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


def test_version_1_field_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    path.write_bytes(v1_document({**GOLDEN_V1_PAYLOAD, "remote_skipped_steps": 0}))
    with pytest.raises(
        CheckpointFieldError,
        match=rf"^checkpoint {re.escape(repr(str(path)))}: Invalid checkpoint: unknown field\(s\) 'remote_skipped",
    ):
        GradScalerCheckpoint.load(path)


def test_version_2_document_with_the_version_1_fields_is_a_field_error() -> None:
    with pytest.raises(CheckpointFieldError, match=r"missing field.*'found_overflow_local', 'remote_skipped_steps'"):
        GradScalerCheckpoint.from_bytes(document(fields=GOLDEN_V1_PAYLOAD))


def test_version_1_invalid_found_overflow_is_reported_under_its_own_name() -> None:
    for value in (1, None, "true"):
        with pytest.raises(CheckpointFieldError, match=r"^Invalid 'found_overflow': expected"):
            GradScalerCheckpoint.from_bytes(v1_document({**GOLDEN_V1_PAYLOAD, "found_overflow": value}))


# The version-2 fields


def test_remote_overflow_is_a_valid_state() -> None:
    remote = with_fields(found_overflow=True, found_overflow_local=False)
    assert remote.found_overflow_local is False
    assert with_fields(remote_skipped_steps=GOLDEN_FIELDS["skipped_steps"]).remote_skipped_steps == 300
    assert with_fields(remote_skipped_steps=0).remote_skipped_steps == 0


def test_local_overflow_without_an_overflow_is_a_field_error() -> None:
    match = r"^Invalid 'found_overflow_local': expected False when found_overflow is False"
    with pytest.raises(CheckpointFieldError, match=match):
        with_fields(found_overflow=False, found_overflow_local=True)
    with pytest.raises(CheckpointFieldError, match=match):
        GradScalerCheckpoint.from_bytes(
            document(fields={**GOLDEN_FIELDS, "found_overflow": False, "found_overflow_local": True})
        )


@pytest.mark.parametrize("value", [301, 5_000_000_001, U64_MAX])
def test_more_remote_skips_than_skips_is_a_field_error(value: int) -> None:
    match = r"^Invalid 'remote_skipped_steps': expected an int <= skipped_steps \(300\)"
    with pytest.raises(CheckpointFieldError, match=match):
        with_fields(remote_skipped_steps=value)
    with pytest.raises(CheckpointFieldError, match=match):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "remote_skipped_steps": value}))


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("found_overflow_local", 0, "a bool"),
        ("found_overflow_local", "False", "a bool"),
        ("found_overflow_local", None, "a bool"),
        ("remote_skipped_steps", -1, "an int >= 0"),
        ("remote_skipped_steps", True, "an int >= 0"),
        ("remote_skipped_steps", 3.0, "an int >= 0"),
        ("remote_skipped_steps", "3", "an int >= 0"),
        ("remote_skipped_steps", None, "an int >= 0"),
    ],
)
def test_new_fields_of_the_wrong_type_are_field_errors(name: str, value: object, expected: str) -> None:
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected {expected}"):
        with_fields(**{name: value})


def test_new_fields_given_as_numpy_scalars_are_stored_as_python_scalars() -> None:
    checkpoint = with_fields(found_overflow_local=np.bool_(True), remote_skipped_steps=np.int64(3))
    assert type(checkpoint.found_overflow_local) is bool
    assert checkpoint.found_overflow_local is True
    assert type(checkpoint.remote_skipped_steps) is int
    assert checkpoint.remote_skipped_steps == 3
    with pytest.raises(CheckpointFieldError, match="'found_overflow_local'"):
        with_fields(found_overflow=np.bool_(False), found_overflow_local=np.bool_(True))


# The PyTorch state dict bridge

TORCH_STATE = {
    "scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 17,
}


def test_from_torch_state_dict_fills_every_other_field() -> None:
    checkpoint = GradScalerCheckpoint.from_torch_state_dict(TORCH_STATE)
    assert checkpoint.to_dict() == {
        "scale": 65536.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "consecutive_good_steps": 17,
        "found_overflow": False,
        "found_overflow_local": False,
        "enabled": True,
        "min_scale": None,
        "max_scale": None,
        "hysteresis": 1,
        "hysteresis_tracker": 1,
        "steps": 0,
        "skipped_steps": 0,
        "growths": 0,
        "backoffs": 0,
        "remote_skipped_steps": 0,
    }
    assert checkpoint.to_torch_state_dict() == TORCH_STATE
    assert GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()) == checkpoint


@pytest.mark.parametrize(
    "state_dict",
    [{}, {**TORCH_STATE, "found_overflow_local": False}, {**TORCH_STATE, "remote_skipped_steps": 0}],
    ids=["empty", "local", "remote"],
)
def test_from_torch_state_dict_takes_exactly_the_torch_keys(state_dict: dict[str, Any]) -> None:
    with pytest.raises(CheckpointFieldError, match="PyTorch state dict"):
        GradScalerCheckpoint.from_torch_state_dict(state_dict)


# Damaged and foreign bytes


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
@pytest.mark.parametrize("extra", [b"\x00", b"\xc0", GOLDEN_V1.read_bytes(), GOLDEN_V2.read_bytes()])
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


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty", b""),
        ("pickle", pickle.dumps(GOLDEN_FIELDS)),
        ("pickle-of-checkpoint", pickle.dumps(golden())),
        ("json", json.dumps(GOLDEN_FIELDS).encode()),
        ("plain-msgpack", packb(GOLDEN_FIELDS)),
        ("nul", b"\x00" * 64),
    ],
)
def test_foreign_files_are_corrupt_and_named(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / f"{name}.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"checkpoint {str(path)!r}")):
        GradScalerCheckpoint.load(path)


def test_zip_file_is_corrupt(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("scaler.ckpt", GOLDEN_V2.read_bytes())
    path = tmp_path / "scaler.zip"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointCorruptError, match="not a cupy-amp checkpoint"):
        GradScalerCheckpoint.load(path)


def test_a_non_bytes_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bytes"):
        GradScalerCheckpoint.from_bytes(GOLDEN_V2.read_text("latin-1"))  # type: ignore[arg-type]


def test_bytearray_and_memoryview_are_accepted() -> None:
    data = GOLDEN_V2.read_bytes()
    assert GradScalerCheckpoint.from_bytes(bytearray(data)) == golden()  # type: ignore[arg-type]
    assert GradScalerCheckpoint.from_bytes(memoryview(data)) == golden()  # type: ignore[arg-type]


def test_missing_file_stays_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GradScalerCheckpoint.load(tmp_path / "absent.ckpt")


# Hostile msgpack: limits, nesting, duplicates, keys, ext types


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
    assert payload.startswith(b"\xde\x00\x11\xa5scale\xc0")  # map16 of 17 entries, then the first one
    with pytest.raises(CheckpointCorruptError, match="ext"):
        GradScalerCheckpoint.from_bytes(document(payload.replace(b"\xc0", ext, 1)))


def test_invalid_utf8_is_corrupt() -> None:
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(document(raw_map([(b"\xa2\xff\xfe", packb(1.0))])))


def test_over_long_string_value_is_corrupt() -> None:
    long_string = msgpack.packb("x" * 1000)
    with pytest.raises(CheckpointCorruptError, match="max_str_len"):
        GradScalerCheckpoint.from_bytes(document(raw_map([(packb("scale"), long_string)])))


# The envelope


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


def test_future_version_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "future.ckpt"
    path.write_bytes(document(version=packb(FORMAT_VERSION + 1)))
    with pytest.raises(CheckpointVersionError, match=re.escape(f"checkpoint {str(path)!r}")):
        GradScalerCheckpoint.load(path)


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


# Field values: the format passes them on, the checkpoint's validators judge them


def _bad_values(name: str) -> list[object]:
    if name in BOOL_FIELDS:
        return [1, 0, 1.0, "true", None]
    if name in INT_FIELDS:
        return [True, False, 1.5, float(GOLDEN_FIELDS[name]), "1", None, -1, math.nan]
    values: list[object] = [True, "2.0", math.nan, math.inf, -math.inf, -1.0, 0.0]
    if name in ("scale", "min_scale", "max_scale"):
        values.append(1e300)  # finite, but beyond float32
    if name in ("growth_factor", "backoff_factor"):
        values.append(1.0)
    return values if name in ("min_scale", "max_scale") else [*values, None]


FIELD_CASES = [(name, value) for name in GOLDEN_FIELDS for value in _bad_values(name)]


@pytest.mark.parametrize(("name", "value"), FIELD_CASES, ids=[f"{n}={v!r}" for n, v in FIELD_CASES])
def test_invalid_field_value_is_a_field_error_naming_the_field(tmp_path: Path, name: str, value: object) -> None:
    data = document(fields={**GOLDEN_FIELDS, name: value})
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected "):
        GradScalerCheckpoint.from_bytes(data)
    path = tmp_path / "bad.ckpt"
    path.write_bytes(data)
    with pytest.raises(CheckpointFieldError, match=f"^checkpoint {re.escape(repr(str(path)))}: Invalid '{name}'"):
        GradScalerCheckpoint.load(path)


V1_FIELD_CASES = [(name, value) for name in GOLDEN_V1_PAYLOAD for value in _bad_values(name)]


@pytest.mark.parametrize(("name", "value"), V1_FIELD_CASES, ids=[f"{n}={v!r}" for n, v in V1_FIELD_CASES])
def test_invalid_field_value_in_a_version_1_file_is_a_field_error_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(CheckpointFieldError, match=f"^Invalid '{name}': expected "):
        GradScalerCheckpoint.from_bytes(v1_document({**GOLDEN_V1_PAYLOAD, name: value}))


def test_field_error_names_exactly_the_bad_field() -> None:
    data = document(fields={**GOLDEN_FIELDS, "growths": True})
    with pytest.raises(CheckpointFieldError, match="Invalid 'growths': expected an int >= 0, got True"):
        GradScalerCheckpoint.from_bytes(data)


@pytest.mark.parametrize("value", [packb([1.0]), packb({"a": 1}), packb(b"\x00")])
def test_container_field_value_is_a_field_error(value: bytes) -> None:
    pairs = [(packb(name), packb(v)) for name, v in GOLDEN_FIELDS.items() if name != "enabled"]
    with pytest.raises(CheckpointFieldError, match="Invalid 'enabled'"):
        GradScalerCheckpoint.from_bytes(document(raw_map([*pairs, (packb("enabled"), value)])))


def test_missing_and_unknown_fields_are_field_errors() -> None:
    missing = {name: value for name, value in GOLDEN_FIELDS.items() if name != "hysteresis"}
    with pytest.raises(CheckpointFieldError, match=r"missing field.*'hysteresis'"):
        GradScalerCheckpoint.from_bytes(document(fields=missing))
    with pytest.raises(CheckpointFieldError, match=r"unknown field.*'loss_scale'"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "loss_scale": 1.0}))


def test_float32_encoded_values_decode_to_the_same_checkpoint() -> None:
    # The encoder never writes float32, but a float32 value holds the same number; the checksum still guards it.
    payload = msgpack.packb(GOLDEN_FIELDS, use_single_float=True)
    assert GradScalerCheckpoint.from_bytes(document(payload)).scale == GOLDEN_FIELDS["scale"]


def test_inconsistent_counters_are_field_errors() -> None:
    for changes in (
        {"growths": 10**10},
        {"backoffs": 301},
        {"skipped_steps": 5_000_000_001},
        {"remote_skipped_steps": 301},
        {"skipped_steps": 2, "backoffs": 2},  # remote_skipped_steps 3 > 2
    ):
        with pytest.raises(CheckpointFieldError):
            GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, **changes}))


def test_scale_zero_needs_no_floor() -> None:
    zero = GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": 0.0, "min_scale": None}))
    assert zero.scale == 0.0
    with pytest.raises(CheckpointFieldError, match="'scale'"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": 0.0}))


def test_negative_zero_scale_is_refused() -> None:
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*-0\.0"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": -0.0, "min_scale": None}))


def test_scale_float32_cannot_hold_is_refused() -> None:
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*float32"):
        GradScalerCheckpoint.from_bytes(document(fields={**GOLDEN_FIELDS, "scale": 32768.1}))


def test_counter_beyond_64_bits_cannot_be_encoded(tmp_path: Path) -> None:
    too_big = with_fields(steps=2**64, skipped_steps=0, growths=0, backoffs=0, remote_skipped_steps=0)
    with pytest.raises(CheckpointFieldError, match=r"'steps'.*64 bits"):
        too_big.to_bytes()
    with pytest.raises(CheckpointFieldError):
        too_big.save(tmp_path / "scaler.ckpt")
    assert os.listdir(tmp_path) == []


def test_encoder_refuses_values_it_cannot_write_exactly() -> None:
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*float64"):
        checkpoint_format.encode_fields({"scale": np.float64(1.0)})
    with pytest.raises(CheckpointFieldError, match=r"'scale'.*list"):
        checkpoint_format.encode_fields({"scale": [1.0]})


# The size limit


def test_bytes_over_the_limit_are_refused_before_parsing() -> None:
    oversize = GOLDEN_V2.read_bytes() + b"\x00" * MAX_CHECKPOINT_BYTES
    with pytest.raises(CheckpointCorruptError, match="limit"):
        GradScalerCheckpoint.from_bytes(oversize)


def test_huge_sparse_file_is_refused_without_being_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.ckpt"
    with open(path, "wb") as file:
        file.write(GOLDEN_V2.read_bytes())
        file.truncate(2 * 1024**3)
    started = time.perf_counter()
    with pytest.raises(
        CheckpointCorruptError, match=re.escape(f"checkpoint {str(path)!r}: 2147483648 bytes, over the")
    ):
        GradScalerCheckpoint.load(path)
    assert time.perf_counter() - started < 1.0


def test_file_one_byte_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.ckpt"
    path.write_bytes(b"\x00" * (MAX_CHECKPOINT_BYTES + 1))
    with pytest.raises(CheckpointCorruptError, match="limit"):
        GradScalerCheckpoint.load(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_endless_file_with_no_reported_size_is_read_only_up_to_the_limit() -> None:
    # /dev/zero reports size 0 and never ends: only a bounded read terminates.
    started = time.perf_counter()
    with pytest.raises(CheckpointCorruptError, match=f"more than {MAX_CHECKPOINT_BYTES} bytes"):
        GradScalerCheckpoint.load("/dev/zero")
    assert time.perf_counter() - started < 1.0


# Atomic save


def test_save_replaces_an_existing_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    target.write_bytes(b"old")
    golden().save(target)
    assert target.read_bytes() == GOLDEN_V2.read_bytes()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_save_to_a_relative_path_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    golden().save("scaler.ckpt")
    assert GradScalerCheckpoint.load("scaler.ckpt") == golden()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_saved_file_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        golden().save(tmp_path / "scaler.ckpt")
    finally:
        os.umask(previous)
    assert (tmp_path / "scaler.ckpt").stat().st_mode & 0o777 == 0o640


def test_stray_temporary_files_do_not_affect_load_or_save(tmp_path: Path) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    stray = tmp_path / ".scaler.ckpt.tmp-0123456789abcdef"
    stray.write_bytes(GOLDEN_V2.read_bytes()[:100])
    assert GradScalerCheckpoint.load(target) == golden()
    other = with_fields(steps=5_000_000_001)
    other.save(target)
    assert GradScalerCheckpoint.load(target) == other
    assert sorted(os.listdir(tmp_path)) == [stray.name, "scaler.ckpt"]


def test_save_into_a_missing_directory_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        golden().save(tmp_path / "absent" / "scaler.ckpt")
    assert os.listdir(tmp_path) == []


def test_save_over_a_directory_fails_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "scaler.ckpt").mkdir()
    with pytest.raises(OSError):
        golden().save(tmp_path / "scaler.ckpt")
    assert os.listdir(tmp_path) == ["scaler.ckpt"]
    assert (tmp_path / "scaler.ckpt").is_dir()


def _fail(error: BaseException) -> Any:
    def fail(*args: object, **kwargs: object) -> Any:
        raise error

    return fail


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("fsync", OSError(errno.EIO, "Input/output error")),
        ("replace", OSError(errno.EXDEV, "Invalid cross-device link")),
        ("write", OSError(errno.ENOSPC, "No space left on device")),
        ("write", KeyboardInterrupt()),
    ],
)
def test_failed_save_keeps_the_old_file_and_removes_the_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: BaseException
) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    before = target.read_bytes()
    monkeypatch.setattr(os, function, _fail(error))
    with pytest.raises(type(error)):
        with_fields(steps=7_000_000_000).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_failure_after_a_partial_write_removes_the_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "scaler.ckpt"
    golden().save(target)
    real_write = os.write
    calls = []

    def write_then_fail(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, bytes(data)[:10])

    monkeypatch.setattr(os, "write", write_then_fail)
    with pytest.raises(OSError, match="No space"):
        with_fields(steps=7_000_000_000).save(target)
    monkeypatch.undo()
    assert target.read_bytes() == GOLDEN_V2.read_bytes()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:1]))
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert (tmp_path / "scaler.ckpt").read_bytes() == GOLDEN_V2.read_bytes()


def test_file_is_synced_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("dir-fsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync")
        real_fsync(fd)

    def replace(source: str, target: str) -> None:
        events.append("replace")
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    golden().save(tmp_path / "scaler.ckpt")
    assert events[:2] == ["fsync", "replace"]
    if os.name == "posix":
        assert events == ["fsync", "replace", "dir-fsync"]


def _fail_on_directories(monkeypatch: pytest.MonkeyPatch, error: OSError, *, on: str) -> list[int]:
    """Make os.open (on="open") or os.fsync (on="fsync") fail for directories only."""
    real_open, real_fsync = os.open, os.fsync
    directory_fds: list[int] = []

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.path.isdir(path):
            if on == "open":
                raise error
            fd = real_open(path, flags, *args, **kwargs)
            directory_fds.append(fd)
            return fd
        return real_open(path, flags, *args, **kwargs)

    def fsync(fd: int) -> None:
        if fd in directory_fds:
            raise error
        real_fsync(fd)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    return directory_fds


def test_directory_that_cannot_be_opened_is_not_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_directories(monkeypatch, PermissionError(errno.EACCES, "Permission denied"), on="open")
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert GradScalerCheckpoint.load(tmp_path / "scaler.ckpt") == golden()


def test_directory_sync_unsupported_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fds = _fail_on_directories(monkeypatch, OSError(errno.EINVAL, "Invalid argument"), on="fsync")
    golden().save(tmp_path / "scaler.ckpt")
    monkeypatch.undo()
    assert len(fds) == 1
    assert GradScalerCheckpoint.load(tmp_path / "scaler.ckpt") == golden()


def test_directory_sync_failure_is_reported_with_the_new_file_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "scaler.ckpt"
    _fail_on_directories(monkeypatch, OSError(errno.EIO, "Input/output error"), on="fsync")
    with pytest.raises(OSError, match="Input/output"):
        golden().save(target)
    monkeypatch.undo()
    assert GradScalerCheckpoint.load(target) == golden()
    assert os.listdir(tmp_path) == ["scaler.ckpt"]
