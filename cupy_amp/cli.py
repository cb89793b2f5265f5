"""The ``cupy-amp`` command: look into and check scaler checkpoints and optimizer states, or run the demo.

Subcommands::

    cupy-amp inspect FILE [--json]   print a file's fields
    cupy-amp inspect --torch FILE    print a checkpoint as PyTorch's GradScaler.state_dict(), as JSON
    cupy-amp validate FILE...        check that files are intact, valid checkpoints or optimizer states
    cupy-amp doctor FILE [--json] [--plot IMAGE]
                                     say what a checkpoint's step journal shows (cupy_amp.doctor)
    cupy-amp demo [options]          train a small fp16 classifier with the loss scaler

``inspect`` and ``validate`` take scaler checkpoints (``GradScalerCheckpoint.save``)
and optimizer state files (``AdamW.save``, ``SGD.save``). Checkpoints are read in
every format version up to the current one, with exactly the checks of
``GradScalerCheckpoint.load``; optimizer states with every check that needs no
optimizer (whether a state fits given parameters is checked by ``load``).
``inspect`` shows the version a file was written in and its fields as read (an
older checkpoint upgraded); files are never rewritten.

Exit status: 0 on success, 1 when a file is missing, unreadable or invalid (for
``demo``: when the run cannot start or fails), 2 on a usage error, 130 when
interrupted. Errors are one line on stderr, never a traceback, whatever the
file names. The demo (and CuPy) are imported only when ``demo`` runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from cupy_amp import __version__
from cupy_amp import journal as step_journal
from cupy_amp._fileio import read_file_start
from cupy_amp.checkpoint import read_checkpoint
from cupy_amp.checkpoint_file import FILE_PREFIX, FORMAT_NAME, FORMAT_VERSION
from cupy_amp.errors import CheckpointError
from cupy_amp.optim import LAYOUTS, state_file
from cupy_amp.rule import power_of_two

__all__ = ["main"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == ["demo"]:
            from cupy_amp.demo import main as demo_main  # the demo has its own parser and help

            return demo_main(arguments[1:])
        try:
            args = _parser().parse_args(arguments)
        except SystemExit as exc:  # argparse exits after --help (0) and on usage errors (2)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return args.command(args)  # type: ignore[no-any-return]
    except KeyboardInterrupt:
        _print("cupy-amp: interrupted", sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug or a broken environment: still one line, never a traceback
        _print(f"cupy-amp: unexpected error: {type(exc).__name__}: {exc}", sys.stderr)
        return EXIT_INVALID


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cupy-amp",
        description="Inspect and validate cupy-amp GradScaler checkpoints and optimizer state files, or run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"cupy-amp {__version__}")
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    inspect = subcommands.add_parser(
        "inspect",
        help="print the fields of a checkpoint file",
        description="Print every field of a checkpoint file, one per line, or as one JSON object.",
    )
    inspect.add_argument(
        "file", metavar="FILE", help="a checkpoint (GradScalerCheckpoint.save()) or an optimizer state (AdamW.save())"
    )
    inspect.add_argument(
        "--json",
        action="store_true",
        help='print {"format": ..., "version": ..., "fields": {...}} as JSON: the version the file was written in, '
        "the fields as read (an older file upgraded to the current version); floats are exact; the journal is a list "
        'of entries (NaN as null, infinities as "inf" and "-inf"), its names a list of lists',
    )
    inspect.add_argument(
        "--torch",
        action="store_true",
        help="print a scaler checkpoint as torch.amp.GradScaler.state_dict() would hold it, as JSON (load it with "
        "scaler.load_state_dict(json.load(file))); what PyTorch has no place for is named on stderr",
    )
    inspect.set_defaults(command=_inspect)

    validate = subcommands.add_parser(
        "validate",
        help="check that checkpoint files are intact and valid",
        description="Check each file; print 'OK  FILE' for a valid one and the reason on stderr for any other. "
        "Exit status 0 when all are valid, 1 otherwise.",
    )
    validate.add_argument("files", metavar="FILE", nargs="+", help="checkpoints or optimizer states to check")
    validate.set_defaults(command=_validate)

    doctor = subcommands.add_parser(
        "doctor",
        help="say what a checkpoint's step journal shows",
        description="Read the step journal a scaler checkpoint holds and say, in plain words with the evidence "
        "(steps, gradient names, scales), what it shows: a gradient that is inf/nan whatever the scale, a skip "
        "rate above 5%, a max_scale that holds the scale down, growth blocked by hysteresis, a scale at its floor, "
        "underflow risk (from check(report=True) steps), or a healthy run.",
    )
    doctor.add_argument("file", metavar="FILE", help="a scaler checkpoint (GradScalerCheckpoint.save())")
    doctor.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    doctor.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the journal (scale, skips, growths, backoffs, headroom, norm) into FILE "
        '(png, pdf, svg...; needs matplotlib: pip install "cupy-amp[demo]")',
    )
    doctor.set_defaults(command=_doctor)

    # Listed for --help; `cupy-amp demo ...` is handed to the demo's own parser before this one runs.
    subcommands.add_parser("demo", help="train a small fp16 classifier with the loss scaler (cupy-amp demo --help)")
    return parser


_ZIP_PREFIX = b"PK\x03\x04"  # a zip archive, as NumPy's .npz files are


def _load(path: str) -> tuple[str, int, dict[str, object]]:
    """Return a file's format name, version and fields, read by the reader of the kind its first bytes name.

    Raises:
        CheckpointError: The file cannot be read, is of no kind cupy-amp writes, or is not valid as its kind;
            one line naming the file, its kind and what is wrong.
    """
    try:
        start = read_file_start(path, max(len(FILE_PREFIX), len(state_file.FILE_PREFIX)), CheckpointError)
        if start.startswith(FILE_PREFIX):
            version, checkpoint = read_checkpoint(path)
            return FORMAT_NAME, version, {**checkpoint.to_dict(), "journal": checkpoint.journal_entries()}
        if start.startswith(state_file.FILE_PREFIX):
            return _load_optimizer_state(path)
    except OSError as exc:
        raise CheckpointError(f"{path!r}: cannot read: {exc.strerror or exc}.") from None
    except CheckpointError as exc:
        text = str(exc)
        raise CheckpointError(text if repr(path) in text else f"{path!r}: {text}") from None
    if start.startswith(_ZIP_PREFIX):
        raise CheckpointError(
            f"{path!r}: a zip archive (a NumPy .npz), not a cupy-amp checkpoint or optimizer state. The demo's "
            "state.npz holds a run's weights and history: continue the run with `cupy-amp demo --resume DIR`."
        )
    raise CheckpointError(
        f"{path!r}: not a cupy-amp file: it starts as neither a scaler checkpoint (a msgpack map whose first "
        f"entry is 'format': {FORMAT_NAME!r}) nor an optimizer state ('format': {state_file.STATE_FORMAT!r})."
    )


def _load_optimizer_state(path: str) -> tuple[str, int, dict[str, object]]:
    """Read and check an optimizer state file as far as no optimizer is needed."""
    try:
        # An optimizer state is as large as its parameters' buffers: without them, its own size is the bound.
        layout, record, buffers = state_file.validated(state_file.read(path, os.path.getsize(path)), LAYOUTS)
    except CheckpointError as exc:
        raise CheckpointError(f"optimizer state {path!r}: {exc}") from None
    fields: dict[str, object] = {"kind": layout.kind}
    fields.update({name: record[name].item() for name in layout.persistent})
    for name, entries in buffers.items():
        values = sum(len(data) // 4 for data in entries if data is not None)
        fields[f"buffers.{name}"] = f"{len(entries)} entries, {values} float32 values"
    return state_file.STATE_FORMAT, state_file.STATE_VERSION, fields


def _inspect(args: argparse.Namespace) -> int:
    try:
        format_name, version, fields = _load(args.file)
    except CheckpointError as exc:
        _print(f"cupy-amp inspect: {exc}", sys.stderr)
        return EXIT_INVALID
    if args.torch:
        return _print_torch_state_dict(args.file, format_name)
    if args.json:
        shown = {name: _json_value(value) for name, value in fields.items()}
        document = {"format": format_name, "version": version, "fields": shown}
        _print(json.dumps(document, indent=2, allow_nan=False), sys.stdout)
        return EXIT_OK
    upgraded = ""
    if format_name == FORMAT_NAME and version != FORMAT_VERSION:
        upgraded = f" (fields upgraded to version {FORMAT_VERSION})"
    rows = [("file", args.file), ("format", f"{format_name} version {version}{upgraded}")]
    rows += [(name, _format_value(name, value)) for name, value in fields.items()]
    width = max(len(name) for name, _ in rows) + 1
    for name, text in rows:
        _print(f"{name + ':':<{width}} {text}", sys.stdout)
    return EXIT_OK


def _print_torch_state_dict(path: str, format_name: str) -> int:
    if format_name != FORMAT_NAME:
        _print(
            f"cupy-amp inspect: --torch converts scaler checkpoints; {path!r} is an optimizer state, which has no "
            "torch.optim form here (its fields: cupy-amp inspect FILE)",
            sys.stderr,
        )
        return EXIT_INVALID
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state_dict = read_checkpoint(path)[1].to_torch_state_dict()
    for warning in caught:
        _print(f"cupy-amp inspect: note: {warning.message}", sys.stderr)
    _print(json.dumps(state_dict, indent=2), sys.stdout)
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            _load(path)
        except CheckpointError as exc:
            _print(f"FAIL  {exc}", sys.stderr)
            status = EXIT_INVALID
        else:
            _print(f"OK  {path if path.isprintable() else repr(path)}", sys.stdout)  # one line, whatever the name
    return status


def _doctor(args: argparse.Namespace) -> int:
    from cupy_amp.doctor import diagnose, plot

    try:
        _, checkpoint = read_checkpoint(args.file)
    except OSError as exc:
        _print(f"cupy-amp doctor: {args.file!r}: cannot read: {exc.strerror or exc}.", sys.stderr)
        return EXIT_INVALID
    except CheckpointError as exc:
        _print(f"cupy-amp doctor: {exc}", sys.stderr)
        return EXIT_INVALID
    findings = diagnose(checkpoint)
    if args.plot is not None:
        try:
            plot(checkpoint, args.plot)
        except (ValueError, OSError) as exc:
            _print(f"cupy-amp doctor: {exc}", sys.stderr)
            return EXIT_INVALID
    if args.json:
        rows = [finding._asdict() for finding in findings]
        _print(json.dumps(rows, indent=2, allow_nan=False), sys.stdout)
        return EXIT_OK
    for finding in findings:
        _print(f"{'PROBLEM' if finding.problem else 'OK'}  {finding.kind}: {finding.summary}", sys.stdout)
    return EXIT_OK


def _print(text: str, stream: TextIO) -> None:
    """Write one line that the stream can always encode (undecodable file names come out escaped)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(text.encode(encoding, "backslashreplace").decode(encoding) + "\n")
    stream.flush()


_NO_CLAMP = {"min_scale": "no floor", "max_scale": "no ceiling"}


def _format_value(name: str, value: object) -> str:
    """Format a field exactly; the scale and its clamps also as powers of two where that is short; the journal
    and its names in one line each."""
    if isinstance(value, np.ndarray):
        return _journal_summary(value)
    if name == "journal_names" and isinstance(value, tuple):
        names, calls = sum(len(call) for call in value), len(value)
        return f"{names} {_plural(names, 'name')} in {calls} {_plural(calls, 'call')}" if calls else "none"
    if value is None and name in _NO_CLAMP:
        return f"None ({_NO_CLAMP[name]})"
    if name not in ("scale", "min_scale", "max_scale") or not isinstance(value, float):
        return repr(value)
    exact = str(int(value)) if value.is_integer() and value < 2.0**53 else repr(value)
    power = power_of_two(value)
    return exact if power is None else f"{exact} ({power})"


def _plural(count: int, word: str) -> str:
    return word if count == 1 else f"{word}s"


def _journal_summary(entries: np.ndarray) -> str:
    """``N steps (from step a to b): S skipped, B backed off, G grew``, or ``empty``."""
    if len(entries) == 0:
        return "empty"
    first, last = int(entries["step"][0]), int(entries["step"][-1])
    span = f"step {first}" if len(entries) == 1 else f"from step {first} to {last}"
    skipped = int(np.count_nonzero(entries["agreed"]))
    backed_off = int(np.count_nonzero(entries["action"] == step_journal.BACKED_OFF))
    grew = int(np.count_nonzero(entries["action"] == step_journal.GREW))
    return (
        f"{len(entries)} {_plural(len(entries), 'step')} ({span}): {skipped} skipped, {backed_off} backed off, "
        f"{grew} grew"
    )


def _json_value(value: object) -> object:
    """A field as strict JSON holds it: the journal as one object per entry, its names as lists."""
    if isinstance(value, np.ndarray):
        return [_json_entry(entry) for entry in value]
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, float):
        return _json_float(value)
    return value


def _json_entry(entry: np.void) -> dict[str, object]:
    """A journal entry's fields by name (the action also by its name in cupy_amp.journal.ACTIONS)."""
    shown: dict[str, object] = {}
    for name in entry.dtype.names or ():
        value = entry[name].item()
        shown[name] = _json_float(value) if isinstance(value, float) else value
        if name == "action":
            shown["action_name"] = step_journal.ACTIONS.get(value)
    return shown


def _json_float(value: float) -> float | str | None:
    """NaN as null and the infinities as "inf" and "-inf", which strict JSON has no numbers for."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
