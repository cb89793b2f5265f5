"""Find the CUDA sources in ``kernels/`` and return them ready for NVRTC.

Wheels ship the folder inside the package (``cupy_amp/kernels``); a source
checkout (an editable install, or ``PYTHONPATH=.``) has it beside the package.
Local ``#include "x.cuh"`` lines are inlined textually, so a header's text is
part of CuPy's compile-cache key (headers reached through ``-I`` are not), and
``#line`` directives keep compiler messages pointing at the original files.
Needs no CuPy.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from cupy_amp.errors import KernelSourceNotFoundError

if TYPE_CHECKING:  # importlib.resources.abc from Python 3.11 on
    from importlib.abc import Traversable

__all__ = ["kernel_directory", "read_kernel_source"]

_MARKER = "common.cuh"  # the header every kernel file includes: a folder without it holds no kernels
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$')


def kernel_directory() -> Traversable:
    """Return the folder holding the kernel sources: the installed package's, else the checkout's.

    Raises:
        KernelSourceNotFoundError: Neither holds them; the message names both.
    """
    candidates = (resources.files("cupy_amp") / "kernels", Path(__file__).resolve().parent.parent / "kernels")
    for folder in candidates:
        if folder.joinpath(_MARKER).is_file():
            return folder
    searched = "\n".join(f"  {folder}" for folder in candidates)
    raise KernelSourceNotFoundError(
        f"cupy-amp's CUDA kernel sources ({_MARKER} and the .cu files beside it) were not found. Searched:\n"
        f"{searched}\nReinstall cupy-amp."
    )


def read_kernel_source(name: str, directory: Traversable | None = None) -> str:
    """Return the text of kernel file ``name`` with its local headers inlined.

    Args:
        name: A kernel file (``cupy_amp.kernel_interface.KERNEL_FILES``).
        directory: Where to read it (default: :func:`kernel_directory`); tools
            pass a copy to check.

    Raises:
        KernelSourceNotFoundError: ``name`` is no kernel file there, or a header it includes is missing.
    """
    folder = directory if directory is not None else kernel_directory()
    if not name.endswith(".cu") or not folder.joinpath(name).is_file():
        known = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".cu"))
        raise KernelSourceNotFoundError(f"Unknown kernel file {name!r}; expected one of {', '.join(known)}.")
    return _inlined(folder, name)


def _inlined(directory: Traversable, name: str) -> str:
    path = directory.joinpath(name)
    if not path.is_file():
        raise KernelSourceNotFoundError(f"{path}: kernel source not found.")
    pieces = [f'#line 1 "{name}"']
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match is None:
            pieces.append(line)
        else:
            pieces += [_inlined(directory, match.group(1)), f'#line {number + 1} "{name}"']
    return "\n".join(pieces) + "\n"
