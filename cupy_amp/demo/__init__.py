"""``cupy-amp demo``: a hand-written fp16 training loop around the loss scaler.

Modules, in the order data flows: ``settings`` (flags and the settings of a
run), ``model`` (the data, the network and Adam, by hand), ``training`` (NumPy
or CuPy, and the loop with the scaler around the backward pass) and
``command`` (the subcommand: the log, the comparison, the plot, the saved
run). ``cupy-amp`` imports none of them until ``demo`` runs, and CuPy is
imported only when the GPU is chosen.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str]) -> int:
    """Run ``cupy-amp demo`` with ``argv`` (the arguments after ``demo``) and return the exit status."""
    from cupy_amp.demo import settings
    from cupy_amp.demo.command import run

    parser = argparse.ArgumentParser(
        prog="cupy-amp demo",
        description=settings.DESCRIPTION,
        epilog=settings.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(parser)
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse exits after --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args, sys.stdout, sys.stderr)
