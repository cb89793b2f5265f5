"""Find the CUDA sources in kernels/ and return them ready for NVRTC.

Searched, in order: ``$CUPY_AMP_KERNEL_DIR`` when set, the ``kernels`` folder
inside the installed package (wheels ship it there), and the ``kernels``
folder at the top of a source checkout (editable installs, ``PYTHONPATH=.``).
Local ``#include "x.cuh"`` lines are inlined textually, so a header's text
is part of CuPy's compile-cache key (headers reached through ``-I`` are not).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from cupy_amp.errors import KernelSourceNotFoundError

__all__ = ["KERNEL_FILES", "NVRTC_OPTIONS", "kernel_directory", "kernel_search_path", "read_kernel_source"]

KERNEL_FILES = ("scale_loss.cu", "unscale_check.cu")
SHARED_HEADER = "cupy_amp_common.cuh"
# Options cupy-amp passes to cupy.RawModule. CuPy adds its own on top
# (-ftz=true, -arch=sm_XX, --device-as-default-execution-space):
# tools/check_kernels.py compiles with the same set.
NVRTC_OPTIONS = ("--std=c++17",)
_PACKAGE_DIR = Path(__file__).resolve().parent
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


def kernel_search_path() -> list[Path]:
    """Return the folders searched for kernel sources, in order."""
    candidates = []
    override = os.environ.get("CUPY_AMP_KERNEL_DIR")
    if override:
        candidates.append(Path(override))
    candidates += [_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels"]
    return candidates


def kernel_directory() -> Path:
    """Return the first searched folder that holds every kernel source.

    Raises:
        KernelSourceNotFoundError: No folder holds them; the message lists every path searched.
    """
    searched = kernel_search_path()
    listing = "\n".join(f"  {folder}" for folder in searched)
    override = os.environ.get("CUPY_AMP_KERNEL_DIR")
    if override and not _holds_kernels(Path(override)):
        # An explicit choice that does not hold the sources is a mistake to report, not to route around.
        raise KernelSourceNotFoundError(
            f"CUPY_AMP_KERNEL_DIR={override!r} does not hold cupy-amp's kernel sources "
            f"({', '.join((*KERNEL_FILES, SHARED_HEADER))}); unset it to use the installed ones. "
            f"Search path:\n{listing}\n"
        )
    for folder in searched:
        if _holds_kernels(folder):
            return folder
    raise KernelSourceNotFoundError(
        f"cupy-amp's CUDA kernel sources ({', '.join(KERNEL_FILES)}) were not found. Searched:\n{listing}\n"
        "Reinstall cupy-amp, or set CUPY_AMP_KERNEL_DIR to the folder holding them."
    )


def _holds_kernels(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (*KERNEL_FILES, SHARED_HEADER))


@functools.cache
def _read_inlined(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    pieces = []
    for number, line in enumerate(lines, start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match is None:
            pieces.append(line)
            continue
        header = path.parent / match.group(1)
        if not header.is_file():
            raise KernelSourceNotFoundError(f"{path}: included header {match.group(1)!r} not found at {header}.")
        # #line keeps compiler messages pointing at the original file and line.
        pieces += [f'#line 1 "{header.name}"', _read_inlined(header), f'#line {number + 1} "{path.name}"']
    return "\n".join([f'#line 1 "{path.name}"', *pieces]) + "\n"


def read_kernel_source(name: str) -> str:
    """Return the text of kernel file ``name`` with its local headers inlined."""
    if name not in KERNEL_FILES:
        raise KernelSourceNotFoundError(f"Unknown kernel file {name!r}; expected one of {', '.join(KERNEL_FILES)}.")
    return _read_inlined(kernel_directory() / name)
