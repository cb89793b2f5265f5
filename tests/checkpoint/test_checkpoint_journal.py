"""The step journal in a checkpoint (format version 3): its layout, round trips, and every hostile journal a file
can hold, refused with an error naming 'journal' or 'journal_names'."""

from __future__ import annotations

import math
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from checkpoint_documents import (
    ACTION_NAMES,
    AT_CEILING,
    AT_FLOOR,
    BACKED_OFF,
    ENTRY_FIELDS,
    ENTRY_SIZE,
    GOLDEN_FIELDS,
    GOLDEN_JOURNAL,
    GOLDEN_NAMES,
    GOLDEN_V1,
    GOLDEN_V1_PAYLOAD,
    GOLDEN_V2,
    GOLDEN_V2_PAYLOAD,
    GOLDEN_V3,
    GREW,
    HELD,
    INF,
    KEPT,
    MAX_ENTRIES,
    MAX_NAME_LENGTH,
    MAX_NAMES,
    NAN,
    U64_MAX,
    assert_identical,
    document,
    journal_entry,
    journaled_checkpoints,
    packb,
    raw_map,
    unpack_journal,
    v1_document,
    v2_document,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_amp import GradScaler, SyncFreeGradScaler
from cupy_amp import journal as step_journal
from cupy_amp.checkpoint import MAX_CHECKPOINT_BYTES, GradScalerCheckpoint, decode_checkpoint
from cupy_amp.errors import CheckpointCorruptError, CheckpointError, CheckpointFieldError

STEPS = GOLDEN_FIELDS["steps"]  # 5_000_000_000: the golden checkpoint's, which the entries below stay within


def entry(step: int = STEPS, **changes: Any) -> bytes:
    """A valid entry of the golden checkpoint's last step (a clean one), with ``changes``."""
    return journal_entry(step, **{"scale": 32768.0, "next_scale": 32768.0, **changes})


def journal_document(journal: object = GOLDEN_JOURNAL, names: object = GOLDEN_NAMES, **changes: Any) -> bytes:
    """A version-3 document of the golden fields with this journal and these names (any msgpack values)."""
    return document(fields={**GOLDEN_FIELDS, "journal": journal, "journal_names": names, **changes})


def refused(data: bytes, error: type[CheckpointError], field: str, match: str = "") -> str:
    """Assert that ``data`` is refused with ``error``, naming ``field`` (and matching ``match``); return the message."""
    with pytest.raises(CheckpointError) as raised:
        GradScalerCheckpoint.from_bytes(data)
    message = str(raised.value)
    assert type(raised.value) is error, message
    assert re.search(rf"'{field}'", message), message
    assert re.search(match, message), message
    return message


# The layout: the tests' own spec of an entry (checkpoint_documents) against the library's


def test_the_entry_layout_is_the_formats() -> None:
    assert step_journal.ENTRY.itemsize == ENTRY_SIZE == 64
    assert step_journal.ENTRY.names == ENTRY_FIELDS
    assert dict(enumerate(ACTION_NAMES)) == step_journal.ACTIONS
    assert (step_journal.MAX_CAPACITY, step_journal.MAX_NAMES, step_journal.MAX_NAME_LENGTH) == (
        MAX_ENTRIES,
        MAX_NAMES,
        MAX_NAME_LENGTH,
    )
    # Distinct values in every field, read through the library's dtype.
    data = journal_entry(
        2**40 + 3, 0.5, 2.0, norm=3.25, clip_coefficient=0.125, culprits=7, culprit_call=5, culprit=6, local=1,
        agreed=1, action=AT_CEILING, amax=4096.0, zero_fraction=0.375, subnormal_fraction=0.0078125, amax_call=2,
        amax_position=9,
    )  # fmt: skip
    (read,) = np.frombuffer(data, dtype=step_journal.ENTRY)
    expected = (2**40 + 3, 0.5, 2.0, 3.25, 0.125, 7, 5, 6, 1, 1, AT_CEILING, 4096.0, 0.375, 0.0078125, 2, 9)
    assert read.tolist() == expected
    assert step_journal.to_bytes(np.frombuffer(data, dtype=step_journal.ENTRY)) == data


# Round trips


@given(journaled_checkpoints())
@settings(max_examples=200)
def test_round_trip_with_any_journal_is_exact_and_deterministic(checkpoint: GradScalerCheckpoint) -> None:
    data = checkpoint.to_bytes()
    decoded = GradScalerCheckpoint.from_bytes(data)
    assert decoded == checkpoint
    assert_identical(decoded, checkpoint)
    assert decoded.journal_names == checkpoint.journal_names
    assert decoded.to_bytes() == data
    assert decoded.journal_entries().tobytes() == checkpoint.journal


MOST_ENTRIES = b"".join(entry(step) for step in range(STEPS - MAX_ENTRIES + 1, STEPS + 1))


def test_a_journal_of_the_most_entries_round_trips_through_a_file(tmp_path: Path) -> None:
    names = tuple((f"{call}." + "n" * (MAX_NAME_LENGTH - 4),) * 16 for call in range(64))  # 1024 names
    checkpoint = GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal": MOST_ENTRIES, "journal_names": names})
    checkpoint.save(tmp_path / "big.ckpt")
    assert (tmp_path / "big.ckpt").stat().st_size < MAX_CHECKPOINT_BYTES
    loaded = GradScalerCheckpoint.load(tmp_path / "big.ckpt")
    assert loaded == checkpoint
    assert len(loaded.journal_entries()) == MAX_ENTRIES


def test_names_of_the_most_characters_round_trip_in_any_script() -> None:
    # 128 characters are up to 512 bytes of UTF-8: a name the constructor accepts is one a file can hold.
    names = (("\U0001f600" * MAX_NAME_LENGTH, "\u65e5" * MAX_NAME_LENGTH, "\u00e9" * MAX_NAME_LENGTH),)
    checkpoint = GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal_names": names})
    assert GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()).journal_names == names


@pytest.mark.parametrize(
    ("journal", "name", "count"),
    [(MOST_ENTRIES, "n" * MAX_NAME_LENGTH, 2048), (MOST_ENTRIES, "\U0001f600" * MAX_NAME_LENGTH, 512)],
    ids=["ascii", "utf8"],
)
def test_every_valid_checkpoint_can_be_saved_and_loaded(tmp_path: Path, journal: bytes, name: str, count: int) -> None:
    # The largest: a full journal and names up to their byte budget (256 KiB of UTF-8) stay under the file cap.
    names = ((name,) * 64,) * (count // 64)
    checkpoint = GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal": journal, "journal_names": names})
    checkpoint.save(tmp_path / "largest.ckpt")
    assert GradScalerCheckpoint.load(tmp_path / "largest.ckpt") == checkpoint
    with pytest.raises(CheckpointFieldError, match="bytes of names"):
        GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal": journal, "journal_names": (*names, (name,))})


def test_names_a_scaler_cannot_keep_are_left_out_or_escaped() -> None:
    # Over the budget a step's names are left out whole; a lone surrogate (no UTF-8) is escaped.
    assert step_journal.names([["x" * 200] * 4096]) == ()
    assert step_journal.names([[f"w{i}" for i in range(4097)]]) == ()
    assert step_journal.names([["a\udc80b", 3]]) == (("a\\udc80b", "3"),)


def test_steps_up_to_the_largest_count_are_compared_as_unsigned() -> None:
    journal = entry(2**63 - 1) + entry(2**63) + entry(U64_MAX)
    changes = {"steps": U64_MAX, "skipped_steps": 0, "growths": 0, "backoffs": 0, "remote_skipped_steps": 0}
    decoded = GradScalerCheckpoint.from_bytes(journal_document(journal, **changes))
    assert decoded.journal_entries()["step"].tolist() == [2**63 - 1, 2**63, U64_MAX]


# What a real scaler journals: one step is one list of gradient calls; a call is ("unscale", bad positions) or
# ("check", bad positions, max_norm), a check() being a step's only call; a bad position holds inf or NaN.
CALL = st.tuples(st.just("unscale"), st.sets(st.integers(0, 2), max_size=2), st.just(0.0))
CHECK = st.tuples(st.just("check"), st.sets(st.integers(0, 2), max_size=2), st.sampled_from([1e-3, 1.0, 1e6]))
STEP = st.one_of(st.lists(CALL, min_size=1, max_size=3), CHECK.map(lambda call: [call]))


def run_steps(scaler: Any, steps: list[list[tuple[str, set[int], float]]]) -> None:
    for number, calls in enumerate(steps):
        scaler.scale_loss(np.ones((), np.float32))
        for kind, bad, max_norm in calls:
            values = [np.full(2, 0.5, np.float32) for _ in range(3)]
            for position in bad:
                values[position][1] = np.inf if (number + position) % 2 else np.nan
            if kind == "check":
                scaler.check(values, max_norm=max_norm)
            else:
                scaler.unscale_and_check({f"w{position}": value for position, value in enumerate(values)})
        scaler.update()


@pytest.mark.parametrize("face", [GradScaler, SyncFreeGradScaler], ids=["GradScaler", "SyncFreeGradScaler"])
@given(steps=st.lists(STEP, max_size=9), capacity=st.sampled_from([0, 1, 4, 1024]))
@settings(max_examples=40, deadline=None)
def test_a_real_scalers_journal_round_trips_bit_for_bit(face: type, steps: list[Any], capacity: int) -> None:
    scaler = face(init_scale=2.0**12, growth_interval=2, hysteresis=2, journal=capacity)
    run_steps(scaler, steps)
    checkpoint = scaler.checkpoint()
    data = checkpoint.to_bytes()
    decoded = GradScalerCheckpoint.from_bytes(data)
    assert decoded == checkpoint
    assert decoded.to_bytes() == data
    assert decoded.journal_names == checkpoint.journal_names == scaler.journal_names()
    entries = decoded.journal_entries()
    assert entries.tobytes() == scaler.journal().tobytes()
    # The entries are the last steps, as they ran.
    kept = min(capacity, len(steps))
    assert entries["step"].tolist() == list(range(len(steps) - kept + 1, len(steps) + 1))
    for read, number in zip(unpack_journal(decoded.journal), range(len(steps) - kept, len(steps))):
        calls = steps[number]
        bad = [(call, min(positions)) for call, (_, positions, _) in enumerate(calls) if positions]
        assert (read["local"], read["agreed"]) == (int(bool(bad)), int(bool(bad)))
        assert read["culprits"] == sum(len(positions) for _, positions, _ in calls)
        assert (read["culprit_call"], read["culprit"]) == (bad[0] if bad else (-1, -1))
        assert read["action"] in ((BACKED_OFF, HELD, AT_FLOOR) if bad else (KEPT, GREW, AT_CEILING))
        if calls[0][0] != "check":  # no norm without check()
            assert math.isnan(read["norm"]) and math.isnan(read["clip_coefficient"])
        elif not bad:
            assert 0.0 < read["norm"] < math.inf
            assert read["clip_coefficient"] == pytest.approx(min(1.0, calls[0][2] / (read["norm"] + 1e-6)), rel=1e-6)
    assert [read["scale"] for read in unpack_journal(decoded.journal)[1:]] == [
        read["next_scale"] for read in unpack_journal(decoded.journal)[:-1]
    ]
    # A scaler that loads it keeps the same journal and checkpoints the same bytes.
    restored = face(journal=capacity)
    restored.load_checkpoint(decoded)
    assert restored.journal().tobytes() == entries.tobytes()
    assert restored.checkpoint().to_bytes() == data


def test_an_old_file_loads_with_an_empty_journal() -> None:
    for path in (GOLDEN_V1, GOLDEN_V2):
        checkpoint = GradScalerCheckpoint.load(path)
        assert len(checkpoint.journal_entries()) == 0
        assert checkpoint.journal_entries().dtype == step_journal.ENTRY
        assert (checkpoint.journal, checkpoint.journal_names) == (b"", ())
        scaler = GradScaler()
        scaler.load_checkpoint(checkpoint)
        assert len(scaler.journal()) == 0
        assert scaler.journal_names() == ()


# Hostile journals: each refused, naming the field


ENTRY_CASES: dict[str, tuple[bytes, str]] = {
    "one-byte": (b"\x00", "a whole number of 64-byte entries"),
    "short-entry": (GOLDEN_JOURNAL[:-1], "a whole number of 64-byte entries"),
    "long-entry": (GOLDEN_JOURNAL + b"\x00", "a whole number of 64-byte entries"),
    "decreasing": (entry(STEPS) + entry(STEPS - 1), "steps must increase"),
    "repeated": (entry(STEPS - 1) + entry(STEPS - 1), "steps must increase"),
    "step-zero": (entry(0), "steps must increase"),
    "zero-then-one": (entry(0) + entry(1), "steps must increase"),
    "beyond-steps": (entry(STEPS - 1) + entry(STEPS + 1), "steps must increase, from 1 to the scaler's 5000000000"),
    "u64-wrap": (entry(2**63 + 5) + entry(1), "steps must increase"),  # an int64 difference would wrap positive
    "action-6": (entry(action=6), "action must be below 6"),
    "action-255": (entry(action=255), "action must be below 6"),
    "local-2": (entry(local=2), "local and agreed 0 or 1"),
    "agreed-2": (entry(agreed=2), "local and agreed 0 or 1"),
    "call-without-position": (entry(culprits=1, culprit_call=0, culprit=-1), "both -1 or both >= 0"),
    "position-without-call": (entry(culprits=1, culprit_call=-1, culprit=0), "both -1 or both >= 0"),
    "both-below-minus-one": (entry(culprits=1, culprit_call=-2, culprit=-2), "both -1 or both >= 0"),
    "negative-culprits": (entry(culprits=-1), "culprit counts must be >= 0"),
    "scale-inf": (entry(scale=INF), "scales must be finite and positive"),
    "scale-nan": (entry(scale=NAN), "scales must be finite and positive"),
    "scale-zero": (entry(scale=0.0), "scales must be finite and positive"),
    "scale-negative-zero": (entry(scale=-0.0), "scales must be finite and positive"),
    "scale-negative": (entry(scale=-1.0), "scales must be finite and positive"),
    "next-scale-inf": (entry(next_scale=INF), "scales must be finite and positive"),
    "next-scale-nan": (entry(next_scale=NAN), "scales must be finite and positive"),
    "next-scale-zero": (entry(next_scale=0.0), "scales must be finite and positive"),
    "next-scale-negative": (entry(next_scale=-2.0), "scales must be finite and positive"),
    "padding": (entry()[:-1] + b"\x01", "padding bytes must be zero"),
    "padding-after-action": (entry()[:39] + b"\x01" + entry()[40:], "padding bytes must be zero"),
    "amax-negative": (entry(amax=-1.0, zero_fraction=0.0, subnormal_fraction=0.0), "a report's amax must be NaN"),
    "amax-inf": (entry(amax=INF, zero_fraction=0.0, subnormal_fraction=0.0), "a report's amax must be NaN"),
    "fraction-above-one": (entry(amax=1.0, zero_fraction=1.5, subnormal_fraction=0.0), "else in [0, 1]"),
    "fraction-negative": (entry(amax=1.0, zero_fraction=0.0, subnormal_fraction=-0.25), "else in [0, 1]"),
    "fraction-without-report": (entry(zero_fraction=0.5), "NaN without a report"),
    "amax-where-without-report": (entry(amax_call=0, amax_position=0), "both -1 or both >= 0"),
    "amax-call-without-position": (entry(amax=1.0, amax_call=0, amax_position=-1), "both -1 or both >= 0"),
    "amax-position-below-minus-one": (entry(amax=1.0, amax_call=-2, amax_position=-2), "both -1 or both >= 0"),
    "padding-high-bit": (GOLDEN_JOURNAL[:-1] + b"\x80", "padding bytes must be zero"),
}


@pytest.mark.parametrize(("journal", "match"), ENTRY_CASES.values(), ids=ENTRY_CASES.keys())
def test_a_journal_no_scaler_writes_is_refused_naming_the_journal(journal: bytes, match: str) -> None:
    message = refused(journal_document(journal), CheckpointFieldError, "journal", re.escape(match))
    assert message.startswith("Invalid 'journal': ")
    with pytest.raises(CheckpointFieldError, match=rf"^Invalid 'journal': .*{re.escape(match)}"):
        GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal": journal})  # the constructor judges alike


def test_several_problems_are_named_together() -> None:
    message = refused(journal_document(entry(0, action=9, scale=NAN)), CheckpointFieldError, "journal")
    for problem in ("steps must increase", "action must be below 6", "scales must be finite"):
        assert problem in message


def test_a_journal_over_the_most_entries_is_refused_in_a_file_and_at_construction() -> None:
    # 8193 entries: 524352 bytes, a file well under the 1 MiB cap; the parser's bin limit refuses it.
    journal = entry(STEPS - MAX_ENTRIES) + MOST_ENTRIES
    data = journal_document(journal)
    assert len(data) < MAX_CHECKPOINT_BYTES
    refused(data, CheckpointCorruptError, "journal", "max_bin_len")
    with pytest.raises(CheckpointFieldError, match=r"^Invalid 'journal': .*at most 8192; got 524352 bytes"):
        GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal": journal})


def test_a_journal_bin_as_large_as_a_file_may_be_is_refused() -> None:
    data = journal_document(b"\x00" * (MAX_CHECKPOINT_BYTES - 1024))
    assert len(data) <= MAX_CHECKPOINT_BYTES
    refused(data, CheckpointCorruptError, "journal", "max_bin_len")


def test_an_inflated_journal_length_is_refused_naming_the_journal() -> None:
    pairs = [(packb(name), packb(value)) for name, value in GOLDEN_FIELDS.items() if name != "journal"]
    for header in (b"\xc6\xff\xff\xff\xff", b"\xc6\x00\x0a\x00\x28", b"\xc5\xff\xff"):  # over the limit, or the data
        data = document(raw_map([*pairs, (packb("journal"), header + GOLDEN_JOURNAL)]))
        with pytest.raises(CheckpointCorruptError, match="'journal'"):
            GradScalerCheckpoint.from_bytes(data)


TYPE_CASES: dict[str, object] = {
    "str": GOLDEN_JOURNAL.decode("latin-1")[:40],
    "int": 40,
    "float": 1.0,
    "bool": True,
    "nil": None,
    "array": list(GOLDEN_JOURNAL[:40]),
    "map": {"step": 1},
}


@pytest.mark.parametrize("value", TYPE_CASES.values(), ids=TYPE_CASES.keys())
def test_a_journal_that_is_not_a_bin_is_refused(value: object) -> None:
    refused(journal_document(value), CheckpointFieldError, "journal", r"^Invalid 'journal': expected bytes, got ")


NAMES_CASES: dict[str, tuple[object, type[CheckpointError], str]] = {
    "str": ("layer.weight", CheckpointFieldError, "expected an array of arrays of strings, got str"),
    "int": (1, CheckpointFieldError, "expected an array of arrays of strings, got int"),
    "nil": (None, CheckpointFieldError, "expected an array of arrays of strings, got NoneType"),
    "bin": (b"layer.weight", CheckpointFieldError, "expected an array of arrays of strings, got bytes"),
    "map": ({"0": ["layer.weight"]}, CheckpointFieldError, "expected an array of arrays of strings, got dict"),
    "array-of-str": (["layer.weight"], CheckpointFieldError, "got an array holding a str"),
    "array-of-nil": ([None], CheckpointFieldError, "got an array holding a NoneType"),
    "int-name": ([["0", 1]], CheckpointFieldError, "expected strings, got a name of type int"),
    "bin-name": ([[b"layer.weight"]], CheckpointFieldError, "expected strings, got a name of type bytes"),
    "nil-name": ([[None]], CheckpointFieldError, "expected strings, got a name of type NoneType"),
    "nested-name": ([[["layer.weight"]]], CheckpointFieldError, "expected strings, got a name of type list"),
    "name-129": ([["x" * 129]], CheckpointFieldError, "at most 128 characters, got one of 129"),
    "name-512": ([["x" * 512]], CheckpointFieldError, "at most 128 characters, got one of 512"),
    "name-513": ([["x" * 513]], CheckpointCorruptError, "max_str_len"),  # over the parser's limit
    "4097-names-in-2-calls": (
        [["a"] * 2049, ["b"] * 2048],
        CheckpointFieldError,
        "at most 4096 names in all, got 4097",
    ),
    "4097-names-in-1-call": ([["a"] * 4097], CheckpointCorruptError, "max_array_len"),
    "4097-calls": ([[]] * 4097, CheckpointCorruptError, "max_array_len"),
}


@pytest.mark.parametrize(("names", "error", "match"), NAMES_CASES.values(), ids=NAMES_CASES.keys())
def test_names_a_file_cannot_hold_are_refused_naming_them(
    names: object, error: type[CheckpointError], match: str
) -> None:
    refused(journal_document(names=names), error, "journal_names", re.escape(match))


@pytest.mark.parametrize(
    ("names", "match"),
    [
        ((("x" * 129,),), "at most 128 characters"),
        ((("a",) * 2049, ("b",) * 2048), "at most 4096 names in all"),
        (((),) * 4097, "at most 4096 calls, got 4097"),  # the file's arrays hold no more
        ((("\udcff",),), r"expected names UTF-8 can encode, got '\\udcff'"),  # the encoder could not write it
        ("ab", "got str"),
        ([("a", 1)], "got a name of type int"),
    ],
    ids=["long", "too-many", "too-many-calls", "surrogate", "str", "int-name"],
)
def test_the_constructor_refuses_names_a_file_cannot_hold(names: object, match: str) -> None:
    with pytest.raises(CheckpointFieldError, match=rf"^Invalid 'journal_names': .*{match}"):
        GradScalerCheckpoint(**{**GOLDEN_FIELDS, "journal_names": names})


def test_the_most_names_and_calls_are_accepted() -> None:
    most = step_journal.MAX_NAMES_BYTES // MAX_NAME_LENGTH  # the longest names, up to their byte budget
    for names in ([["n" * MAX_NAME_LENGTH] * most], [[]] * MAX_NAMES, [["a"]] * MAX_NAMES):
        decoded = GradScalerCheckpoint.from_bytes(journal_document(names=names))
        assert decoded.journal_names == tuple(tuple(call) for call in names)


# The journal's fields in files of other versions


@pytest.mark.parametrize(
    "extra",
    [{"journal": b""}, {"journal_names": []}, {"journal": GOLDEN_JOURNAL, "journal_names": [["0"]]}],
    ids=["journal", "names", "both"],
)
def test_a_version_2_file_holding_journal_fields_is_refused(extra: dict[str, Any]) -> None:
    refused(v2_document({**GOLDEN_V2_PAYLOAD, **extra}), CheckpointFieldError, "journal", "for format version 2")


def test_a_version_1_file_holding_a_journal_is_refused() -> None:
    refused(v1_document({**GOLDEN_V1_PAYLOAD, "journal": b""}), CheckpointFieldError, "journal", "format version 1")


def test_a_version_2_file_reads_as_an_empty_journal_whatever_its_steps() -> None:
    version, checkpoint = decode_checkpoint(v2_document({**GOLDEN_V2_PAYLOAD, "steps": 2**64 - 1}))
    assert version == 2
    assert checkpoint.journal_entries().size == 0


def test_a_hostile_journal_in_a_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "hostile.ckpt"
    path.write_bytes(journal_document(entry(STEPS + 1)))
    with pytest.raises(CheckpointFieldError, match=rf"^checkpoint {re.escape(repr(str(path)))}: Invalid 'journal'"):
        GradScalerCheckpoint.load(path)


# Mutations of the version-3 golden file behind a recomputed CRC-32 reach the journal's checks: any outcome but a
# valid checkpoint or a CheckpointError is a bug.

JOURNAL_START = GOLDEN_V3.read_bytes().index(packb("journal"))


def reseal(data: bytes) -> bytes:
    body = data[:-5]
    return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")


def mutate(data: bytes, position: int, replacement: bytes, length: int) -> bytes:
    return reseal(data[:position] + replacement + data[position + length :])


@given(
    position=st.integers(JOURNAL_START, len(GOLDEN_V3.read_bytes()) - 6),
    replacement=st.binary(max_size=6),
    length=st.integers(0, 6),
)
@settings(max_examples=500)
def test_mutated_journals_and_names_raise_only_checkpoint_errors(
    position: int, replacement: bytes, length: int
) -> None:
    data = mutate(GOLDEN_V3.read_bytes(), position, replacement, length)
    try:
        checkpoint = GradScalerCheckpoint.from_bytes(data)
    except CheckpointError:
        return
    # Accepted: then it is valid by every rule, and re-encodes to what a valid checkpoint's bytes are.
    assert GradScalerCheckpoint.from_bytes(checkpoint.to_bytes()) == checkpoint
    assert step_journal.from_bytes(checkpoint.journal, checkpoint.steps).size == len(checkpoint.journal) // ENTRY_SIZE


def test_a_scaler_keeps_a_journal_of_steps_past_two_to_the_63() -> None:
    # Steps compare as unsigned 64-bit numbers in the ring too: past 2**63 a signed view wrapped and hid them.
    journal = entry(2**63 - 1) + entry(2**63) + entry(2**63 + 1)
    changes = {"steps": 2**63 + 1, "skipped_steps": 0, "growths": 0, "backoffs": 0, "remote_skipped_steps": 0}
    checkpoint = GradScalerCheckpoint.from_bytes(journal_document(journal, **changes))
    scaler = GradScaler(journal=4)
    scaler.load_checkpoint(checkpoint)
    assert scaler.journal()["step"].tolist() == [2**63 - 1, 2**63, 2**63 + 1]
    scaler.scale_loss(np.ones((), np.float32))
    scaler.unscale_and_check([np.ones(2, np.float32)])
    scaler.update()
    assert scaler.journal()["step"].tolist() == [2**63 - 1, 2**63, 2**63 + 1, 2**63 + 2]
