"""Compile every kernels/*.cu through NVRTC, exactly as CuPy would at run time, without a GPU.

CuPy's public compile API needs a GPU even when an architecture is given, so
this drives ``cupy.cuda.nvrtc``'s program functions directly, with the source
and options cupy-amp gives ``cupy.RawModule`` (the struct layout checks
included) plus those CuPy adds itself (``-ftz=true``, ``-arch=sm_XX``,
``--device-as-default-execution-space``). Any error or warning fails the
check, reported as ``file:line: message``.

Usage: python tools/check_kernels.py [--arch 70 --arch 80 --arch 90] [--kernel-dir DIR]
Needs cupy-amp importable (installed, or PYTHONPATH=.), cupy (any CUDA 12/13 wheel)
and an NVRTC library (nvidia-cuda-nvrtc-cu12).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from cupy_amp.kernel_interface import KERNEL_FILES, compile_source
from cupy_amp.kernel_interface import compile_options as runtime_options
from cupy_amp.kernel_sources import kernel_directory

DEFAULT_ARCHS = ("70", "80", "90")
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
# NVRTC's own notice for sm_70, which it prints for any source; not a finding in our code.
KNOWN_TARGET_NOTICES = (
    "nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated and may be removed in a future release",
)
_DIAGNOSTIC = re.compile(
    r"^(?P<file>[^\s(]+)\((?P<line>\d+)\): (?P<kind>(?:catastrophic )?error|warning)[^:]*: (?P<text>.*)$"
)


@dataclass(frozen=True)
class CompileResult:
    """The outcome of compiling one kernel file for one architecture."""

    file: str
    arch: str
    ok: bool
    diagnostics: tuple[str, ...]


def nvrtc_problem() -> str | None:
    """Return why NVRTC cannot be used here, or None when it can."""
    try:
        from cupy.cuda import nvrtc
    except Exception as exc:  # ImportError, or CuPy failing to load its CUDA libraries
        return f"cupy.cuda.nvrtc cannot be imported ({type(exc).__name__}: {exc})"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # the NVRTC shared library is missing
        return f"no NVRTC library ({type(exc).__name__}: {exc}); install nvidia-cuda-nvrtc-cu12"
    return None


def compile_options(arch: str) -> tuple[str, ...]:
    """Return the full NVRTC option list CuPy would use for ``arch``."""
    return (*runtime_options(), *CUPY_ADDED_OPTIONS, f"-arch=sm_{arch}")


def compile_kernel(file_name: str, arch: str, directory: Path | None = None) -> CompileResult:
    """Compile one kernel file (from ``directory``, default the one cupy-amp loads) for one architecture."""
    from cupy.cuda import nvrtc

    folder = Path(str(directory if directory is not None else kernel_directory()))
    program = nvrtc.createProgram(compile_source(file_name, folder), file_name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, compile_options(arch))
            failed = False
        except nvrtc.NVRTCError:
            failed = True
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    lines = [
        line.strip()
        for line in log.splitlines()
        if line.strip() and line.strip() not in KNOWN_TARGET_NOTICES and not line.strip().startswith("Remark:")
    ]
    diagnostics = tuple(_format(line, folder) for line in lines if _is_diagnostic(line))
    if failed and not diagnostics:
        diagnostics = (f"{file_name}: compilation failed: {log.strip() or 'no log'}",)
    return CompileResult(file_name, arch, not failed and not diagnostics, diagnostics)


def _is_diagnostic(line: str) -> bool:
    return " error" in line or " warning" in line or _DIAGNOSTIC.match(line) is not None


def _format(line: str, folder: Path) -> str:
    match = _DIAGNOSTIC.match(line.strip())
    if match is None:
        return line.strip()
    return f"{folder / match['file']}:{match['line']}: {match['kind']}: {match['text']}"


def check_all(archs: tuple[str, ...] = DEFAULT_ARCHS, directory: Path | None = None) -> list[CompileResult]:
    """Compile every kernel file for every architecture."""
    return [compile_kernel(name, arch, directory) for name in KERNEL_FILES for arch in archs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arch", action="append", help="compute capability such as 90 (repeatable)")
    parser.add_argument("--kernel-dir", type=Path, help="check the sources in this folder instead")
    args = parser.parse_args(argv)
    problem = nvrtc_problem()
    if problem is not None:
        print(f"check_kernels: {problem}", file=sys.stderr)
        return 2
    from cupy.cuda import nvrtc

    folder = args.kernel_dir or Path(str(kernel_directory()))
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, kernels from {folder}")
    failures = 0
    for result in check_all(tuple(args.arch or DEFAULT_ARCHS), folder):
        status = "ok" if result.ok else "FAILED"
        print(f"{status:6} sm_{result.arch} {result.file}")
        for line in result.diagnostics:
            print(f"    {line}", file=sys.stderr)
        failures += not result.ok
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
