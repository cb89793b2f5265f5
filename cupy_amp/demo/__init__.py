"""``cupy-amp demo``: a hand-written fp16 training loop around the loss scaler.

Modules, in the order data flows: ``options`` (flags and settings),
``device`` (NumPy or CuPy), ``data`` (the task), ``model`` (the network and
Adam, by hand), ``train`` (the loop and the scaler protocol), ``state``
(checkpoints), ``report`` (all output), ``plot`` (the optional figure) and
``command`` (the subcommand itself). Importing this package imports nothing
else: ``cupy-amp`` builds its parser from ``options`` alone, and CuPy is
imported only when the GPU is chosen.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run ``cupy-amp demo`` with ``argv`` (the arguments after ``demo``) and return the exit status."""
    from cupy_amp.demo import options
    from cupy_amp.demo.command import run

    parser = argparse.ArgumentParser(
        prog="cupy-amp demo",
        description=options.DESCRIPTION,
        epilog=options.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_arguments(parser)
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse exits after --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    return run(args, sys.stdout, sys.stderr)
