"""The ``cupy-amp`` command: look into and check scaler checkpoint files.

Subcommands::

    cupy-amp inspect FILE [--json]   print a checkpoint's fields
    cupy-amp validate FILE...        check that files are intact, valid checkpoints
    cupy-amp demo [options]          train a small fp16 classifier with the loss scaler

Both read every format version up to the current one. ``inspect`` shows the
version the file was written in and the fields as this cupy-amp reads them,
that is after upgrading an older file (a version-1 file shows
``found_overflow_local`` equal to ``found_overflow`` and
``remote_skipped_steps`` 0); the file itself is never rewritten.

Exit status: 0 on success, 1 when a file is missing, unreadable or invalid
(for ``demo``: when the run cannot start or fails), 2 on a usage error.
Errors are one line on stderr, never a traceback. Only ``demo`` touches a
device; its modules (and CuPy, for the GPU) are imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from cupy_amp.checkpoint import GradScalerCheckpoint
from cupy_amp.checkpoint_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    decode_document,
    describe_source,
    read_checkpoint_file,
)
from cupy_amp.demo import options as demo_options
from cupy_amp.errors import CheckpointError, CheckpointFieldError

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
        description="Inspect and validate cupy-amp GradScaler checkpoint files, or run the demo.",
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
        help='print {"format": ..., "version": ..., "fields": {...}} as JSON: the version the file was written in, '
        "the fields as read (an older file upgraded to the current version); floats are exact",
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

    demo = subcommands.add_parser(
        "demo",
        help="train a small fp16 classifier with the loss scaler, on the CPU or a GPU",
        description=demo_options.DESCRIPTION,
        epilog=demo_options.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo_options.add_arguments(demo)
    demo.set_defaults(command=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from cupy_amp.demo.command import run

    return run(args, sys.stdout, sys.stderr)


class _Unreadable(Exception):
    """Internal: the file could not be opened or read."""


def _load(path: str) -> tuple[int, GradScalerCheckpoint]:
    """Return the format version a checkpoint file was written in, and the checkpoint it holds.

    Checks exactly what :meth:`GradScalerCheckpoint.load` checks, with the same
    messages, reading the file once. An OSError becomes _Unreadable with a
    one-line message.
    """
    try:
        data = read_checkpoint_file(path)
    except OSError as exc:
        raise _Unreadable(f"{describe_source(path)}: cannot read: {exc.strerror or exc}.") from None
    document = decode_document(data, source=path)
    try:
        checkpoint = GradScalerCheckpoint.from_dict(document.fields)
    except CheckpointFieldError as exc:
        raise CheckpointFieldError(f"{describe_source(path)}: {exc}") from None
    return document.version, checkpoint


def _inspect(args: argparse.Namespace) -> int:
    try:
        version, checkpoint = _load(args.file)
    except (CheckpointError, _Unreadable) as exc:
        print(f"cupy-amp inspect: {exc}", file=sys.stderr)
        return EXIT_INVALID
    fields = checkpoint.to_dict()
    if args.json:
        document = {"format": FORMAT_NAME, "version": version, "fields": fields}
        print(json.dumps(document, indent=2, allow_nan=False))
    else:
        _print_fields(args.file, version, fields, sys.stdout)
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


def _print_fields(path: str, version: int, fields: dict[str, object], out: TextIO) -> None:
    upgraded = "" if version == FORMAT_VERSION else f" (fields upgraded to version {FORMAT_VERSION})"
    rows = [("file", path), ("format", f"{FORMAT_NAME} version {version}{upgraded}")]
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
