"""Checkpoint documents for the tests: the golden files' contents and builders of (hostile) msgpack bytes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st

from cupy_amp.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GradScalerCheckpoint,
)

DATA = Path(__file__).parent / "data"


GOLDEN_V1 = DATA / "grad_scaler_v1.ckpt"


GOLDEN_V2 = DATA / "grad_scaler_v2.ckpt"


GOLDEN_FILES = [GOLDEN_V1, GOLDEN_V2]


U64_MAX = 2**64 - 1


F32_MAX = float(np.finfo(np.float32).max)


# The smallest scale a checkpoint may hold: the smallest float32 whose float32 inverse is finite.
SMALLEST_SCALE = float.fromhex("0x1.000008p-128")


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
    """Any valid checkpoint: None clamps, subnormal float32 scales down to the smallest with a finite inverse."""
    min_scale = draw(st.none() | f32(SMALLEST_SCALE))
    max_scale = draw(st.none() | f32(SMALLEST_SCALE if min_scale is None else min_scale))
    scale = draw(f32(SMALLEST_SCALE if min_scale is None else min_scale, F32_MAX if max_scale is None else max_scale))
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
