"""The cupy-amp command line: inspect and validate."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import msgpack
import pytest
from checkpoint_documents import (
    ACTION_NAMES,
    BACKED_OFF,
    ENTRY_FIELDS,
    ENTRY_SIZE,
    GOLDEN_FIELDS,
    GOLDEN_V1,
    GOLDEN_V2,
    GOLDEN_V3,
    INF,
    KEPT,
    journal_entry,
    unpack_journal,
)

from cupy_amp.checkpoint import FORMAT_NAME, FORMAT_VERSION, GradScalerCheckpoint
from cupy_amp.cli import main
from cupy_amp.errors import CheckpointFieldError

REPO_ROOT = Path(__file__).resolve().parents[2]
FIELD_NAMES = [
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "consecutive_good_steps",
    "found_overflow",
    "found_overflow_local",
    "enabled",
    "min_scale",
    "max_scale",
    "hysteresis",
    "hysteresis_tracker",
    "steps",
    "skipped_steps",
    "growths",
    "backoffs",
    "remote_skipped_steps",
    "rule",
    "overflow_scale",
    "overflow_norm",
    "clean_scale",
    "clean_norm",
    "overflows_in_row",
    "journal",
    "journal_names",
]
SCALAR_NAMES = FIELD_NAMES[:-2]
# make()'s journal: a local overflow backed the scale off at step 83, then 17 clean steps, two of them kept here
# (one checked: a norm and a clip coefficient).
JOURNAL = b"".join(
    [
        journal_entry(
            83, 196608.0, 98304.0, culprits=2, culprit_call=0, culprit=1, local=1, agreed=1, action=BACKED_OFF
        ),
        journal_entry(99, 98304.0, 98304.0, norm=2.5, clip_coefficient=0.25, action=KEPT),
        journal_entry(100, 98304.0, 98304.0, action=KEPT),
    ]
)
NAMES = (("0", "1"), ("embed.weight",))


def make(**changes: Any) -> GradScalerCheckpoint:
    fields: dict[str, Any] = {
        "scale": 98304.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "consecutive_good_steps": 17,
        "found_overflow": False,
        "found_overflow_local": False,
        "enabled": True,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "hysteresis": 1,
        "hysteresis_tracker": 1,
        "steps": 100,
        "skipped_steps": 3,
        "growths": 0,
        "backoffs": 2,
        "remote_skipped_steps": 1,
        "journal": JOURNAL,
        "journal_names": NAMES,
        **changes,
    }
    return GradScalerCheckpoint(**fields)


def strict_json(text: str) -> Any:
    """Parse JSON, failing on what only Python's lenient JSON has (NaN, Infinity, -Infinity)."""

    def refuse(token: str) -> None:
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def expected_journal(data: bytes) -> list[dict[str, Any]]:
    """The journal as inspect --json should show it, from the bytes unpacked with the format's layout."""
    shown = []
    for entry in unpack_journal(data):
        fields: dict[str, Any] = {}
        for name, value in entry.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None if math.isnan(value) else ("inf" if value > 0 else "-inf")
            fields[name] = value
            if name == "action":
                fields["action_name"] = ACTION_NAMES[value]
        shown.append(fields)
    return shown


def checkpoint_from_json(fields: dict[str, Any]) -> GradScalerCheckpoint:
    """The checkpoint inspect --json shows: the journal's entries packed back into its bytes, the names as tuples."""

    def number(value: float | str | None) -> float:
        return math.nan if value is None else float(value)

    journal = b"".join(
        journal_entry(
            entry["step"],
            entry["scale"],
            entry["next_scale"],
            norm=number(entry["norm"]),
            clip_coefficient=number(entry["clip_coefficient"]),
            **{name: entry[name] for name in ("culprits", "culprit_call", "culprit", "local", "agreed", "action")},
            **{name: number(entry[name]) for name in ("amax", "zero_fraction", "subnormal_fraction")},
            amax_call=entry["amax_call"],
            amax_position=entry["amax_position"],
        )
        for entry in fields["journal"]
    )
    names = tuple(tuple(call) for call in fields["journal_names"])
    return GradScalerCheckpoint.from_dict({**fields, "journal": journal, "journal_names": names})


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.ckpt"
    make().save(path)
    return path


@pytest.fixture
def corrupt(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.ckpt"
    path.write_bytes(GOLDEN_V1.read_bytes()[:-1])
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the console script's entry point in a fresh interpreter, as the installed `cupy-amp` would."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", "from cupy_amp.cli import main; raise SystemExit(main())", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


# inspect


def test_inspect_prints_one_aligned_line_per_field(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(good)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    names = [line.split(":", 1)[0] for line in lines]
    assert names == ["file", "format", *FIELD_NAMES]
    value_columns = {len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}
    assert len(value_columns) == 1, "values are not aligned"
    values = {name: line.split(":", 1)[1].strip() for name, line in zip(names, lines, strict=True)}
    assert values["file"] == str(good)
    assert values["format"] == f"{FORMAT_NAME} version {FORMAT_VERSION}"
    assert values["scale"] == "98304 (1.5 * 2**16)"
    assert values["max_scale"] == "16777216 (2**24)"
    assert values["min_scale"] == "1 (2**0)"
    assert values["backoff_factor"] == "0.5"
    assert values["found_overflow"] == "False"
    assert values["found_overflow_local"] == "False"
    assert values["consecutive_good_steps"] == "17"
    assert values["remote_skipped_steps"] == "1"
    assert values["journal"] == "3 steps (from step 83 to 100): 1 skipped, 1 backed off, 0 grew"
    assert values["journal_names"] == "3 names in 2 calls"


@pytest.mark.parametrize(
    ("changes", "journal", "names"),
    [
        ({"journal": b"", "journal_names": ()}, "empty", "none"),
        (
            {"journal": JOURNAL[-ENTRY_SIZE:], "journal_names": ((),)},
            "1 step (step 100): 0 skipped, 0 backed off, 0 grew",
            "0 names in 1 call",
        ),
        (
            {"journal_names": (("w",),)},
            "3 steps (from step 83 to 100): 1 skipped, 1 backed off, 0 grew",
            "1 name in 1 call",
        ),
    ],
    ids=["empty", "one", "one-name"],
)
def test_inspect_summarizes_the_journal_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, Any], journal: str, names: str
) -> None:
    path = tmp_path / "scaler.ckpt"
    make(**changes).save(path)
    assert main(["inspect", str(path)]) == 0
    values = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    assert (values["journal"], values["journal_names"]) == (journal, names)


def test_inspect_shows_the_golden_version_3_journal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(GOLDEN_V3)]) == 0
    out = capsys.readouterr().out
    values = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines()}
    assert list(values) == ["file", "format", *FIELD_NAMES]
    assert values["format"] == f"{FORMAT_NAME} version 3"
    assert values["journal"] == "3 steps (from step 4999997999 to 5000000000): 2 skipped, 1 backed off, 1 grew"
    assert values["journal_names"] == "4 names in 2 calls"
    assert "\\x" not in out and "b'" not in out  # no raw bytes


def test_inspect_shows_a_version_1_file_as_written_and_its_fields_as_read(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(GOLDEN_V1)]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in lines}
    assert list(values) == ["file", "format", *FIELD_NAMES]
    assert values["format"] == f"{FORMAT_NAME} version 1 (fields upgraded to version {FORMAT_VERSION})"
    assert values["found_overflow"] == values["found_overflow_local"] == "True"
    assert values["remote_skipped_steps"] == "0"
    assert (values["journal"], values["journal_names"]) == ("empty", "none")


@pytest.mark.parametrize(("path", "version"), [(GOLDEN_V1, 1), (GOLDEN_V2, 2), (GOLDEN_V3, 3)], ids=["v1", "v2", "v3"])
def test_inspect_json_gives_the_version_written_and_the_fields_read(
    capsys: pytest.CaptureFixture[str], path: Path, version: int
) -> None:
    assert main(["inspect", "--json", str(path)]) == 0
    document = strict_json(capsys.readouterr().out)
    assert document["format"] == FORMAT_NAME
    assert document["version"] == version
    assert list(document["fields"]) == FIELD_NAMES
    fields = GradScalerCheckpoint.load(path).to_dict()
    assert {name: document["fields"][name] for name in SCALAR_NAMES} == {name: fields[name] for name in SCALAR_NAMES}
    assert document["fields"]["journal"] == expected_journal(fields["journal"])
    assert document["fields"]["journal_names"] == [list(call) for call in fields["journal_names"]]
    assert checkpoint_from_json(document["fields"]) == GradScalerCheckpoint.load(path)


def test_inspect_json_shows_each_journal_entry_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(GOLDEN_V3)]) == 0
    fields = strict_json(capsys.readouterr().out)["fields"]
    assert fields["journal_names"] == [["0", "layer.weight"], ["embed.weight", "d\u00e9codeur.bias"]]
    backed_off, grew, held = fields["journal"]
    for entry in (backed_off, grew, held):
        after = ENTRY_FIELDS.index("action") + 1
        assert list(entry) == [*ENTRY_FIELDS[:after], "action_name", *ENTRY_FIELDS[after:]]
    assert backed_off == {
        "step": 4_999_997_999, "scale": 32768.0, "next_scale": 16384.0, "norm": None, "clip_coefficient": None,
        "culprits": 3, "culprit_call": 1, "culprit": 4, "local": 1, "agreed": 1, "action": 2,
        "action_name": "backed off", "amax": None, "zero_fraction": None, "subnormal_fraction": None,
        "amax_call": -1, "amax_position": -1,
    }  # fmt: skip
    assert (grew["norm"], grew["clip_coefficient"], grew["action_name"]) == (0.75, 1.0, "grew")
    report = [grew[name] for name in ("amax", "zero_fraction", "subnormal_fraction", "amax_call", "amax_position")]
    assert report == [1536.0, 0.25, 0.0625, 0, 1]
    assert (held["norm"], held["clip_coefficient"], held["action_name"]) == ("inf", 0.0, "held by hysteresis")


def test_inspect_shows_a_remote_overflow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "remote.ckpt"
    make(found_overflow=True, found_overflow_local=False, remote_skipped_steps=3).save(path)
    assert main(["inspect", str(path)]) == 0
    values = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    assert values["format"] == f"{FORMAT_NAME} version {FORMAT_VERSION}"
    assert (values["found_overflow"], values["found_overflow_local"]) == ("True", "False")
    assert values["remote_skipped_steps"] == "3"


@pytest.mark.parametrize(
    ("changes", "field", "shown"),
    [
        ({"scale": 2.0**-127, "min_scale": None}, "scale", "5.877471754111438e-39 (2**-127)"),
        ({"scale": float.fromhex("0x1.000008p-128"), "min_scale": None}, "scale", "2.938737278354183e-39"),
        ({"scale": 65536.0}, "scale", "65536 (2**16)"),
        ({"scale": 1.2345600128173828}, "scale", "1.2345600128173828"),
        ({"min_scale": None}, "min_scale", "None (no floor)"),
        ({"max_scale": None}, "max_scale", "None (no ceiling)"),
    ],
)
def test_inspect_shows_scales_readably_and_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object], field: str, shown: str
) -> None:
    path = tmp_path / "scaler.ckpt"
    make(**changes).save(path)
    assert main(["inspect", str(path)]) == 0
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in capsys.readouterr().out.splitlines()}
    assert lines[field] == shown


def test_inspect_json_round_trips_every_field_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Floats float32 holds only just (a subnormal, the largest), NaN and both infinities in the journal.
    journal = JOURNAL + journal_entry(
        2**64 - 2, 2.0**-127, float.fromhex("0x1.fffffep+127"), norm=INF, clip_coefficient=-INF, action=5
    )
    changes = {"scale": 2.0**-127, "min_scale": None, "max_scale": None, "backoff_factor": 0.8, "steps": 2**64 - 1}
    checkpoint = make(**changes, journal=journal)
    path = tmp_path / "scaler.ckpt"
    checkpoint.save(path)
    assert main(["inspect", "--json", str(path)]) == 0
    document = strict_json(capsys.readouterr().out)
    assert document["format"] == FORMAT_NAME
    assert document["version"] == FORMAT_VERSION
    assert list(document["fields"]) == FIELD_NAMES
    fields = checkpoint.to_dict()
    for name in SCALAR_NAMES:  # exactly: the same type and value
        shown = document["fields"][name]
        assert (type(shown), shown) == (type(fields[name]), fields[name]), name
    shown_journal = document["fields"]["journal"]
    assert len(shown_journal) == 4
    for shown, expected in zip(shown_journal, expected_journal(journal)):
        assert shown == expected
    assert shown_journal[-1]["clip_coefficient"] == "-inf"
    assert shown_journal[-1]["action_name"] == "at the ceiling"
    assert document["fields"]["journal_names"] == [["0", "1"], ["embed.weight"]]
    rebuilt = checkpoint_from_json(document["fields"])
    assert rebuilt == checkpoint
    assert rebuilt.to_bytes() == path.read_bytes()


def test_inspect_json_flag_may_come_first(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(good)]) == main(["inspect", str(good), "--json"]) == 0
    first, second = capsys.readouterr().out.split("}\n{")
    assert json.loads(first + "}") == json.loads("{" + second)


def test_inspect_missing_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.ckpt"
    assert main(["inspect", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"cupy-amp inspect: {str(missing)!r}: cannot read: No such file or directory.\n"


def test_inspect_corrupt_file_says_why(corrupt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(corrupt)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert str(corrupt) in captured.err
    assert "truncated or damaged" in captured.err
    assert len(captured.err.splitlines()) == 1


# validate


def test_validate_good_files_of_every_version(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(good), str(GOLDEN_V1), str(GOLDEN_V2), str(GOLDEN_V3)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"OK  {good}", f"OK  {GOLDEN_V1}", f"OK  {GOLDEN_V2}", f"OK  {GOLDEN_V3}"]
    assert captured.err == ""


def test_validate_gives_the_messages_load_gives(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v1_with_v2_field = tmp_path / "v1-with-v2-field.ckpt"
    v1_with_v2_field.write_bytes(_v1_with_remote_skips())
    invalid = tmp_path / "invalid.ckpt"
    invalid.write_bytes(_with_growths_true())
    bad_journal = tmp_path / "bad-journal.ckpt"
    bad_journal.write_bytes(_with_journal_step_beyond_steps())
    assert main(["validate", str(v1_with_v2_field), str(invalid), str(bad_journal)]) == 1
    errors = capsys.readouterr().err.splitlines()
    expected = []
    for path in (v1_with_v2_field, invalid, bad_journal):
        with pytest.raises(CheckpointFieldError) as raised:
            GradScalerCheckpoint.load(path)
        expected.append(f"FAIL  {raised.value}")
    assert errors == expected
    assert "unknown field(s) 'remote_skipped_steps' for format version 1" in errors[0]
    assert errors[1].startswith(f"FAIL  checkpoint {str(invalid)!r}: Invalid 'growths'")
    assert errors[2].startswith(f"FAIL  checkpoint {str(bad_journal)!r}: Invalid 'journal': steps must increase")


def test_validate_reports_each_bad_file_on_stderr(
    tmp_path: Path, good: Path, corrupt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.ckpt"
    future = tmp_path / "future.ckpt"
    future.write_bytes(_future_version(GOLDEN_V3.read_bytes()))
    invalid = tmp_path / "invalid.ckpt"
    invalid.write_bytes(_with_growths_true())
    assert main(["validate", str(good), str(corrupt), str(missing), str(future), str(invalid), str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"OK  {good}"]
    errors = captured.err.splitlines()
    assert len(errors) == 5
    assert errors[0].startswith(f"FAIL  checkpoint {str(corrupt)!r}: ")
    assert "truncated or damaged" in errors[0]
    assert errors[1] == f"FAIL  {str(missing)!r}: cannot read: No such file or directory."
    assert "upgrade cupy-amp" in errors[2]
    assert "Invalid 'growths'" in errors[3]
    assert errors[4] == f"FAIL  {str(tmp_path)!r}: a directory, not a regular file; refusing to read it."


def test_validate_without_files_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 2
    assert "usage: cupy-amp validate" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["inspect"], ["inspect", "a", "b"], ["--bogus"]])
def test_usage_errors_exit_with_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: cupy-amp" in captured.err


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["inspect", "--help"], ["validate", "--help"]])
def test_help_exits_with_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cupy-amp")


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    assert "inspect" in out
    assert "validate" in out


# In a fresh interpreter, as the console script runs


def test_script_validate_exit_codes_and_streams(good: Path, corrupt: Path, tmp_path: Path) -> None:
    ok = run_cli("validate", str(good))
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"OK  {good}\n", "")
    bad = run_cli("validate", str(good), str(corrupt), str(tmp_path / "absent.ckpt"))
    assert bad.returncode == 1
    assert bad.stdout == f"OK  {good}\n"
    assert len(bad.stderr.splitlines()) == 2
    assert "Traceback" not in bad.stderr
    usage = run_cli("validate")
    assert usage.returncode == 2
    assert "Traceback" not in usage.stderr


def test_script_inspect_json_and_missing_file(good: Path, tmp_path: Path) -> None:
    shown = run_cli("inspect", "--json", str(good))
    assert shown.returncode == 0
    assert checkpoint_from_json(strict_json(shown.stdout)["fields"]) == make()
    missing = run_cli("inspect", str(tmp_path / "absent.ckpt"))
    assert missing.returncode == 1
    assert missing.stdout == ""
    assert "Traceback" not in missing.stderr
    assert "No such file or directory" in missing.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file names are bytes")
@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_file_names_that_are_not_utf8_never_cause_a_traceback(tmp_path: Path, encoding: str) -> None:
    # A name of arbitrary bytes, printed to a UTF-8 or even an ASCII-only terminal.
    directory = os.fsencode(tmp_path)
    good_name = directory + b"/caf\xe9-\xff\xfe.ckpt"
    make().save(os.fsdecode(good_name))
    missing_name = directory + b"/\xc3\x28-absent.ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONIOENCODING": encoding}
    command = [sys.executable, "-m", "cupy_amp"]
    runs = {
        "validate": subprocess.run([*command, "validate", good_name, missing_name], env=env, capture_output=True),
        "inspect": subprocess.run([*command, "inspect", good_name], env=env, capture_output=True),
        "inspect-missing": subprocess.run([*command, "inspect", missing_name], env=env, capture_output=True),
    }
    assert [runs[name].returncode for name in runs] == [1, 0, 1]
    for name, result in runs.items():
        assert b"Traceback" not in result.stderr, name
        assert len(result.stderr.splitlines()) == (0 if name == "inspect" else 1), name
    assert runs["validate"].stdout.startswith(b"OK  ")
    assert b"\\udcff" in runs["validate"].stdout or b"\\xff" in runs["validate"].stdout
    assert b"steps:" in runs["inspect"].stdout


def test_a_file_name_with_a_newline_cannot_forge_an_ok_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    forged = tmp_path / "x\nOK  forged.ckpt"
    make().save(forged)
    assert main(["validate", str(forged)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out == f"OK  {str(forged)!r}\n"


def test_version_and_python_m(tmp_path: Path) -> None:
    from cupy_amp import __version__

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    shown = subprocess.run([sys.executable, "-m", "cupy_amp", "--version"], env=env, capture_output=True, text=True)
    assert (shown.returncode, shown.stdout) == (0, f"cupy-amp {__version__}\n")
    assert main(["--version"]) == 0


def test_an_unexpected_error_is_one_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch, good: Path) -> None:
    import cupy_amp.cli

    def broken(path: str) -> None:
        raise MemoryError("no more memory")

    monkeypatch.setattr(cupy_amp.cli, "read_checkpoint", broken)
    errors = io.StringIO()
    monkeypatch.setattr(sys, "stderr", errors)
    assert main(["validate", str(good)]) == 1
    assert errors.getvalue() == "cupy-amp: unexpected error: MemoryError: no more memory\n"


def _reseal(body: bytes) -> bytes:
    return body + b"\xce" + zlib.crc32(body).to_bytes(4, "big")


def _future_version(data: bytes) -> bytes:
    current = b"\xa7version" + bytes([FORMAT_VERSION])
    body = data[:-5].replace(current, b"\xa7version" + bytes([FORMAT_VERSION + 1]), 1)
    assert body != data[:-5]
    return _reseal(body)


def _with_growths_true() -> bytes:
    data = GOLDEN_V2.read_bytes()
    body = data[:-5].replace(b"\xa7growths\x28", b"\xa7growths\xc3", 1)
    assert body != data[:-5]
    return _reseal(body)


def _with_journal_step_beyond_steps() -> bytes:
    """The version-3 golden file with its last journal entry one step past the checkpoint's steps."""
    data = GOLDEN_V3.read_bytes()
    last = GOLDEN_FIELDS["steps"].to_bytes(8, "little")
    assert data[:-5].count(last) == 1
    return _reseal(data[:-5].replace(last, (GOLDEN_FIELDS["steps"] + 1).to_bytes(8, "little"), 1))


def _v1_with_remote_skips() -> bytes:
    """The version-1 golden file with a version-2 field appended to its payload (a fixmap of 15 becomes 16)."""
    data = GOLDEN_V1.read_bytes()
    assert data[:-5].count(b"\xa7payload\x8f") == 1
    body = data[:-5].replace(b"\xa7payload\x8f", b"\xa7payload\xde\x00\x10", 1)
    body = body.replace(b"\xa5crc32", msgpack.packb("remote_skipped_steps") + b"\x00\xa5crc32", 1)
    return _reseal(body)


def optimizer_state(path: Path) -> Path:
    """An AdamW state after one step: one float32 parameter (no master) and one float16 (a master)."""
    import numpy as np

    from cupy_amp.optim import AdamW

    params = [np.ones(3, np.float32), np.ones(2, np.float16)]
    optimizer = AdamW(params, lr=0.125, betas=(0.5, 0.75))
    optimizer.step([np.ones(3, np.float32), np.ones(2, np.float16)], None)
    optimizer.save(path)
    return path


def test_inspect_reads_an_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = optimizer_state(tmp_path / "adamw.state")
    assert main(["inspect", "--json", str(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["format"], shown["version"]) == ("cupy-amp.optimizer", 1)
    fields = shown["fields"]
    assert (fields["kind"], fields["step"], fields["lr"], fields["beta1_power"]) == ("adamw", 1, 0.125, 0.5)
    assert fields["buffers.master"] == "2 entries, 2 float32 values"
    assert fields["buffers.exp_avg_sq"] == "2 entries, 5 float32 values"
    assert main(["inspect", str(path)]) == 0
    assert "cupy-amp.optimizer version 1" in capsys.readouterr().out


def test_validate_checks_optimizer_states_by_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = optimizer_state(tmp_path / "good.state")
    state = msgpack.unpackb(good.read_bytes()[:-4], raw=False)
    state["buffers"]["exp_avg_sq"][0] = b"\x00\x00\x80\xbf" * 3  # -1.0: no second moment is negative
    body = msgpack.packb(state, use_bin_type=True)
    bad = tmp_path / "bad.state"
    bad.write_bytes(body + zlib.crc32(body).to_bytes(4, "big"))
    assert main(["validate", str(good), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert f"OK  {good}" in out
    assert "buffers.exp_avg_sq[0]" in err and "-1.0" in err and str(bad) in err
