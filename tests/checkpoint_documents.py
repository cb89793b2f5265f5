"""Checkpoint documents for the tests: the golden files' contents and builders of (hostile) msgpack bytes."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st
from reference_model import PYTORCH_RULE_FIELDS

from cupy_amp.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GradScalerCheckpoint,
)

DATA = Path(__file__).parent / "data"


GOLDEN_V1 = DATA / "grad_scaler_v1.ckpt"


GOLDEN_V2 = DATA / "grad_scaler_v2.ckpt"


GOLDEN_V3 = DATA / "grad_scaler_v3.ckpt"


GOLDEN_FILES = [GOLDEN_V1, GOLDEN_V2, GOLDEN_V3]


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


# PyTorch's rule, whose memory of the headroom rule's is all 0: what version 3 upgrades version 2 with.
GOLDEN_PYTORCH_RULE: dict[str, Any] = dict(PYTORCH_RULE_FIELDS)

# What grad_scaler_v1.ckpt reads as today: the version-1 payload upgraded to
# version 2 (found_overflow_local = found_overflow, remote_skipped_steps = 0),
# then to version 3 (an empty journal, no names).
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
    **GOLDEN_PYTORCH_RULE,
    "journal": b"",
    "journal_names": (),
}


# The payload stored in tests/data/grad_scaler_v2.ckpt, as written by the
# version-2 encoder: the same encodings as version 1, plus the version-2 fields
# with values a version-1 file cannot yield (an overflow on another rank only,
# three remote skips).
GOLDEN_V2_PAYLOAD: dict[str, Any] = {
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


# What grad_scaler_v2.ckpt reads as today: the version-2 payload upgraded to
# version 3 (an empty journal, no names).
GOLDEN_V2_FIELDS: dict[str, Any] = {**GOLDEN_V2_PAYLOAD, **GOLDEN_PYTORCH_RULE, "journal": b"", "journal_names": ()}


# A journal entry as the format specifies it (cupy_amp.journal.ENTRY), packed here with the struct module
# so that the tests do not take the layout from the code they check: step (uint64), scale, next_scale, norm,
# clip_coefficient (float32), culprits, culprit_call, culprit (int32), local, agreed, action (uint8), one zero
# byte of padding, amax, zero_fraction, subnormal_fraction (float32), amax_call, amax_position (int32), then
# four zero bytes of padding; little-endian, 64 bytes.
ENTRY_FORMAT = "<QffffiiiBBBxfffiixxxx"
ENTRY_SIZE = struct.calcsize(ENTRY_FORMAT)
ENTRY_FIELDS = (
    "step",
    "scale",
    "next_scale",
    "norm",
    "clip_coefficient",
    "culprits",
    "culprit_call",
    "culprit",
    "local",
    "agreed",
    "action",
    "amax",
    "zero_fraction",
    "subnormal_fraction",
    "amax_call",
    "amax_position",
)
# What the rule did, by its code in an entry (cupy_amp.journal.ACTIONS must agree).
KEPT, GREW, BACKED_OFF, HELD, AT_FLOOR, AT_CEILING = range(6)
ACTION_NAMES = ("kept", "grew", "backed off", "held by hysteresis", "at the floor", "at the ceiling")
NAN = float("nan")
INF = float("inf")


def journal_entry(
    step: int,
    scale: float,
    next_scale: float,
    *,
    norm: float = NAN,
    clip_coefficient: float = NAN,
    culprits: int = 0,
    culprit_call: int = -1,
    culprit: int = -1,
    local: int = 0,
    agreed: int = 0,
    action: int = KEPT,
    amax: float = NAN,
    zero_fraction: float = NAN,
    subnormal_fraction: float = NAN,
    amax_call: int = -1,
    amax_position: int = -1,
) -> bytes:
    """One journal entry's bytes (NaN norm and clip coefficient: a step without check(); NaN and -1 for the
    report's fields: a step without check(report=True))."""
    values = (step, scale, next_scale, norm, clip_coefficient, culprits, culprit_call, culprit, local, agreed, action)
    report = (amax, zero_fraction, subnormal_fraction, amax_call, amax_position)
    return struct.pack(ENTRY_FORMAT, *values, *report)


def unpack_journal(data: bytes) -> list[dict[str, Any]]:
    """The entries of a journal's bytes, each as a dict of ENTRY_FIELDS (floats as Python floats)."""
    return [dict(zip(ENTRY_FIELDS, values)) for values in struct.iter_unpack(ENTRY_FORMAT, data)]


# The journal of tests/data/grad_scaler_v3.ckpt: three entries of the golden checkpoint's scaler (not
# consecutive steps: the format asks only that steps increase, up to the checkpoint's), whose
# 5_000_000_000th step overflowed on another rank only (found_overflow without found_overflow_local) and was
# held by its hysteresis of 2 (tracker 1): a local overflow with three culprits, the first the fifth
# gradient of the step's second call, that backed the scale off (no check(): NaN norm); 2000 clean steps
# later a growth, in a step with check(max_norm=1.0, report=True) (its largest |g|, 1536, in the second gradient
# of the call, a quarter of the elements 0 and a sixteenth subnormal); then the remote overflow, checked (inf norm).
GOLDEN_JOURNAL = b"".join(
    [
        journal_entry(
            4_999_997_999, 32768.0, 16384.0, culprits=3, culprit_call=1, culprit=4, local=1, agreed=1, action=BACKED_OFF
        ),
        journal_entry(
            4_999_999_999,
            16384.0,
            32768.0,
            norm=0.75,
            clip_coefficient=1.0,
            action=GREW,
            amax=1536.0,
            zero_fraction=0.25,
            subnormal_fraction=0.0625,
            amax_call=0,
            amax_position=1,
        ),
        journal_entry(5_000_000_000, 32768.0, 32768.0, norm=INF, clip_coefficient=0.0, agreed=1, action=HELD),
    ]
)
# The last step's gradient names, call by call (one not ASCII: names are UTF-8 strings).
GOLDEN_NAMES = (("0", "layer.weight"), ("embed.weight", "d\u00e9codeur.bias"))


# The checkpoint stored in tests/data/grad_scaler_v3.ckpt: the version-2
# golden checkpoint's fields, with a journal of three entries and the names.
GOLDEN_FIELDS: dict[str, Any] = {
    **GOLDEN_V2_PAYLOAD,
    **GOLDEN_PYTORCH_RULE,
    "journal": GOLDEN_JOURNAL,
    "journal_names": GOLDEN_NAMES,
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
    "overflows_in_row",
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
    """Build a sealed document piece by piece; anything not given is as a valid file of the current format
    version has it (GOLDEN_FIELDS: version 3)."""
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


def v2_document(fields: dict[str, Any] | None = None) -> bytes:
    """A sealed version-2 document, laid out as the version-2 encoder wrote it (default: GOLDEN_V2_PAYLOAD)."""
    return document(fields=GOLDEN_V2_PAYLOAD if fields is None else fields, version=packb(2))


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


# The largest journal a checkpoint holds (cupy_amp.journal.MAX_CAPACITY), and the most names.
MAX_ENTRIES = 8192
MAX_NAMES = 4096
MAX_NAME_LENGTH = 128


@st.composite
def journals(draw: st.DrawFn, steps: int, max_entries: int = 8) -> bytes:
    """Any journal a scaler of ``steps`` steps may hold: increasing steps among its last MAX_ENTRIES, each
    field in its range (NaN norm and clip coefficient or a check()'s, a culprit or none)."""
    low = max(1, steps - MAX_ENTRIES + 1)
    numbers = sorted(draw(st.sets(st.integers(low, steps), max_size=max_entries))) if steps else []
    scales = st.floats(min_value=SMALLEST_SCALE, max_value=F32_MAX, width=32)
    entries = []
    for step in numbers:
        checked = draw(st.booleans())
        first = draw(st.none() | st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)))
        entries.append(
            journal_entry(
                step,
                draw(scales),
                draw(scales),
                norm=draw(st.floats(min_value=0.0, width=32)) if checked else NAN,
                clip_coefficient=draw(st.floats(0.0, 1.0, width=32)) if checked else NAN,
                culprits=0 if first is None else draw(st.integers(1, 2**31 - 1)),
                culprit_call=-1 if first is None else first[0],
                culprit=-1 if first is None else first[1],
                local=draw(st.integers(0, 1)),
                agreed=draw(st.integers(0, 1)),
                action=draw(st.integers(0, len(ACTION_NAMES) - 1)),
            )
        )
    return b"".join(entries)


def journal_names(max_calls: int = 4, max_names: int = 4) -> st.SearchStrategy[tuple[tuple[str, ...], ...]]:
    """Any names a checkpoint may hold: strings of up to MAX_NAME_LENGTH characters UTF-8 can encode."""
    name = st.text(st.characters(exclude_categories=("Cs",)), max_size=MAX_NAME_LENGTH)
    call = st.lists(name, max_size=max_names).map(tuple)
    return st.lists(call, max_size=max_calls).map(tuple)


@st.composite
def journaled_checkpoints(draw: st.DrawFn) -> GradScalerCheckpoint:
    """Any valid checkpoint (:func:`checkpoints`) with any journal and names."""
    checkpoint = draw(checkpoints())
    fields = {
        **checkpoint.to_dict(),
        "journal": draw(journals(checkpoint.steps)),
        "journal_names": draw(journal_names()),
    }
    return GradScalerCheckpoint(**fields)
