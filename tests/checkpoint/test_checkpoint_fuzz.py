"""Fuzzing the checkpoint decoder with Hypothesis.

Every input must either decode to a valid checkpoint or raise one of the
CheckpointError classes; nothing else (msgpack's own errors, UnicodeDecodeError,
RecursionError, TypeError...) may escape. Mutations are applied to valid
encodings, with the CRC-32 trailer left stale (the checksum must catch them) or
recomputed (so the mutated document reaches the msgpack parser and the
structure checks behind the checksum).

Set CUPY_AMP_FUZZ_EXAMPLES to run more examples per test (default 1000, about ten
seconds in all), e.g. ``CUPY_AMP_FUZZ_EXAMPLES=100000 pytest tests/checkpoint/test_checkpoint_fuzz.py``.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cupy_amp.checkpoint import FORMAT_NAME, GradScalerCheckpoint
from cupy_amp.errors import CheckpointCorruptError, CheckpointError

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=int(os.environ.get("CUPY_AMP_FUZZ_EXAMPLES", "1000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FIELDS: dict[str, Any] = {
    "scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "consecutive_good_steps": 7,
    "found_overflow": True,
    "found_overflow_local": False,
    "enabled": True,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 3,
    "hysteresis_tracker": 2,
    "steps": 100_000,
    "skipped_steps": 17,
    "growths": 5,
    "backoffs": 9,
    "remote_skipped_steps": 4,
}
# The same checkpoint as format version 1 wrote it: the fields version 2 added left out.
V1_FIELDS = {
    name: value for name, value in FIELDS.items() if name not in ("found_overflow_local", "remote_skipped_steps")
}
SEEDS = [
    GradScalerCheckpoint(**FIELDS).to_bytes(),
    GradScalerCheckpoint(**{**FIELDS, "scale": 2.0**-127, "min_scale": None, "max_scale": None}).to_bytes(),
    GradScalerCheckpoint(
        **{**FIELDS, "steps": 2**64 - 1, "skipped_steps": 2**63, "backoffs": 2**62, "remote_skipped_steps": 2**63}
    ).to_bytes(),
    # version 1, read through the migration
    (Path(__file__).resolve().parents[1] / "data" / "grad_scaler_v1.ckpt").read_bytes(),
]
# Type bytes that claim long (or maximal) lengths, for inflating a header in place.
INFLATED = [b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]
INFLATED += [b"\xde\xff\xff", b"\xdc\xff\xff", b"\xda\xff\xff", b"\xc9\xff\xff\xff\xff\x00", b"\x9f", b"\x8f"]


def reseal(data: bytes) -> bytes:
    """Recompute the CRC-32 trailer so the mutated bytes get past the checksum."""
    if len(data) < 5:
        return data
    body = data[:-5]
    return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")


def decode_or_refuse(data: bytes) -> GradScalerCheckpoint | None:
    """Return the decoded checkpoint, or None when it was refused with a CheckpointError."""
    try:
        checkpoint = GradScalerCheckpoint.from_bytes(data)
    except CheckpointError:
        return None
    # Anything accepted is a valid checkpoint that survives its own round trip.
    assert GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()) == checkpoint
    return checkpoint


Mutation = tuple[str, int, bytes]

mutations = st.tuples(
    st.sampled_from(["flip", "set", "insert", "delete", "inflate", "truncate", "duplicate"]),
    st.integers(0, 2**16),
    st.binary(min_size=1, max_size=8) | st.sampled_from(INFLATED),
)


def mutate(data: bytes, mutation: Mutation) -> bytes:
    kind, position, chunk = mutation
    at = position % (len(data) + 1)
    if kind == "flip" and data:
        at %= len(data)
        return data[:at] + bytes([data[at] ^ (1 << (chunk[0] % 8))]) + data[at + 1 :]
    if kind == "set":
        return data[:at] + chunk[:1] + data[at + 1 :]
    if kind == "insert":
        return data[:at] + chunk + data[at:]
    if kind == "delete":
        return data[:at] + data[at + len(chunk) :]
    if kind == "inflate":
        return data[:at] + chunk + data[at + 1 :]
    if kind == "truncate":
        return data[:at]
    return data[:at] + data[at : at + 32] + data[at:]  # duplicate a slice (keys, values, headers)


@FUZZ
@given(st.sampled_from(SEEDS), st.lists(mutations, min_size=1, max_size=4))
def test_mutated_encodings_without_a_new_checksum_are_corrupt(seed: bytes, changes: list[Mutation]) -> None:
    data = seed
    for change in changes:
        data = mutate(data, change)
    if data == seed:
        assert decode_or_refuse(data) is not None
        return
    with pytest.raises(CheckpointCorruptError):
        GradScalerCheckpoint.from_bytes(data)


@FUZZ
@given(st.sampled_from(SEEDS), st.lists(mutations, min_size=1, max_size=4))
def test_mutated_encodings_with_a_new_checksum_decode_or_raise_checkpoint_errors(
    seed: bytes, changes: list[Mutation]
) -> None:
    data = seed
    for change in changes:
        data = mutate(data, change)
    decode_or_refuse(reseal(data))


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_raise_checkpoint_errors(data: bytes) -> None:
    assert decode_or_refuse(data) is None
    assert decode_or_refuse(reseal(data)) is None


_PREFIX = (
    msgpack.Packer().pack_map_header(4)
    + msgpack.packb("format")
    + msgpack.packb(FORMAT_NAME)
    + msgpack.packb("version")
)


@FUZZ
@given(st.binary(max_size=1024))
def test_random_bytes_behind_a_valid_header_raise_checkpoint_errors(tail: bytes) -> None:
    decode_or_refuse(reseal(_PREFIX + tail + msgpack.packb("crc32") + b"\x00" * 5))


msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
msgpack_values = msgpack_scalars | st.recursive(
    msgpack_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(["a", "scale"]), children),
    max_leaves=6,
)


@FUZZ
@given(
    st.sampled_from([(1, V1_FIELDS), (2, FIELDS)]),
    st.dictionaries(st.sampled_from([*FIELDS, "extra", ""]), msgpack_values, max_size=4),
    st.sampled_from([None, "format", "version", "payload"]),
    msgpack_values,
)
def test_structured_documents_decode_or_raise_checkpoint_errors(
    base: tuple[int, dict[str, Any]],
    payload_changes: dict[str, object],
    envelope_key: str | None,
    envelope_value: object,
) -> None:
    version, fields = base
    envelope: dict[str, object] = {"format": FORMAT_NAME, "version": version, "payload": {**fields, **payload_changes}}
    if envelope_key is not None:
        envelope[envelope_key] = envelope_value
    packer = msgpack.Packer(use_bin_type=True, use_single_float=False)
    body = b"".join([packer.pack_map_header(4), *(packer.pack(k) + packer.pack(v) for k, v in envelope.items())])
    decode_or_refuse(reseal(body + packer.pack("crc32") + b"\x00" * 5))
