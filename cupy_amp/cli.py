"""The ``cupy-amp`` command: look into and check scaler checkpoint files.

Subcommands::

    cupy-amp inspect FILE [--json]   print a checkpoint's fields
    cupy-amp validate FILE...        check that files are intact, valid checkpoints

Exit status: 0 on success, 1 when a file is missing, unreadable or invalid,
2 on a usage error. Errors are one line on stderr, never a traceback. Nothing
here touches a device.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.checkpoint_format import FORMAT_NAME, FORMAT_VERSION, describe_source
from cupy_amp.errors import CheckpointError

__all__ = ["main"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits after --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command: Callable[[argparse.Namespace], int] = args.command
    return command(args)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cupy-amp",
        description="Inspect and validate cupy-amp GradScaler checkpoint files.",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    inspect = subcommands.add_parser(
        "inspect",
        help="print the fields of a checkpoint file",
        description="Print every field of a checkpoint file, one per line, or as one JSON object.",
    )
    inspect.add_argument("file", metavar="FILE", help="checkpoint file written by GradScalerCheckpoint.save()")
    inspect.add_argument(
        "--json",
        action="store_true",
        help='print {"format": ..., "version": ..., "fields": {...}} as JSON; floats are exact',
    )
    inspect.set_defaults(command=_inspect)

    validate = subcommands.add_parser(
        "validate",
        help="check that checkpoint files are intact and valid",
        description="Check each file; print 'OK  FILE' for a valid one and the reason on stderr for any other. "
        "Exit status 0 when all are valid, 1 otherwise.",
    )
    validate.add_argument("files", metavar="FILE", nargs="+", help="checkpoint files to check")
    validate.set_defaults(command=_validate)
    return parser


class _Unreadable(Exception):
    """Internal: the file could not be opened or read."""


def _load(path: str) -> GradScalerCheckpoint:
    """Load a checkpoint; an OSError becomes _Unreadable with a one-line message."""
    try:
        return GradScalerCheckpoint.load(path)
    except OSError as exc:
        raise _Unreadable(f"{describe_source(path)}: cannot read: {exc.strerror or exc}.") from None


def _inspect(args: argparse.Namespace) -> int:
    try:
        checkpoint = _load(args.file)
    except (CheckpointError, _Unreadable) as exc:
        print(f"cupy-amp inspect: {exc}", file=sys.stderr)
        return EXIT_INVALID
    fields = checkpoint.to_dict()
    if args.json:
        document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "fields": fields}
        print(json.dumps(document, indent=2, allow_nan=False))
    else:
        _print_fields(args.file, fields, sys.stdout)
    return EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            _load(path)
        except (CheckpointError, _Unreadable) as exc:
            print(f"FAIL  {exc}", file=sys.stderr)
            status = EXIT_INVALID
        else:
            print(f"OK  {path}")
    return status


def _print_fields(path: str, fields: dict[str, object], out: TextIO) -> None:
    rows = [("file", path), ("format", f"{FORMAT_NAME} version {FORMAT_VERSION}")]
    rows += [(name, _format_value(name, value)) for name, value in fields.items()]
    width = max(len(name) for name, _ in rows) + 1
    for name, text in rows:
        out.write(f"{name + ':':<{width}} {text}\n")


def _format_value(name: str, value: object) -> str:
    """Format a field exactly; the scale and its clamps also as powers of two where that is short."""
    if name in _SCALE_FIELDS and isinstance(value, float):
        return _format_scale(value)
    if value is None and name in _NO_CLAMP:
        return f"None ({_NO_CLAMP[name]})"
    return repr(value)


_SCALE_FIELDS = frozenset({"scale", "min_scale", "max_scale"})
_NO_CLAMP = {"min_scale": "no floor", "max_scale": "no ceiling"}


def _format_scale(value: float) -> str:
    exact = str(int(value)) if value.is_integer() and value < 2.0**53 else repr(value)
    if value == 0:
        return exact
    mantissa, exponent = math.frexp(value)  # value == mantissa * 2**exponent with 0.5 <= mantissa < 1
    mantissa, exponent = mantissa * 2, exponent - 1
    if mantissa == 1:
        return f"{exact} (2**{exponent})"
    if (mantissa * 2**10).is_integer():  # e.g. 98304 (1.5 * 2**16); long mantissas would not help
        return f"{exact} ({mantissa!r} * 2**{exponent})"
    return exact
