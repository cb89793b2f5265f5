"""Kernel source discovery, header inlining, and importing cupy_amp without CuPy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_amp import CupyAmpError, KernelSourceNotFoundError, kernel_sources
from cupy_amp.kernel_interface import KERNEL_FILES
from cupy_amp.kernel_sources import kernel_directory, read_kernel_source

REPO = Path(__file__).resolve().parents[2]
SOURCE_KERNELS = REPO / "kernels"
HEADER = "common.cuh"
_LINE_DIRECTIVE = re.compile(r'^#line (\d+) "([^"]+)"$')


def original_lines(folder: Path, name: str) -> list[str]:
    return (folder / name).read_text(encoding="utf-8").splitlines()


def assert_line_directives_map_back(inlined: str, folder: Path) -> set[str]:
    """Check that every line of ``inlined`` is the line its ``#line`` directives name; return the files named."""
    current: tuple[str, int] | None = None
    named: set[str] = set()
    for text in inlined.splitlines():
        directive = _LINE_DIRECTIVE.match(text)
        if directive is not None:
            current = (directive[2], int(directive[1]))
            named.add(directive[2])
            continue
        assert current is not None, "the inlined source must start with a #line directive"
        file_name, number = current
        source = original_lines(folder, file_name)
        if number <= len(source):
            assert text == source[number - 1], f"{file_name}:{number}"
        else:  # only blank padding may follow a file's last line
            assert text == "", f"{file_name}:{number} is past the end of the file"
        current = (file_name, number + 1)
    return named


# Discovery


def test_kernel_directory_finds_the_source_trees_kernels() -> None:
    found = Path(str(kernel_directory()))
    assert found.resolve() == SOURCE_KERNELS
    assert all((found / name).is_file() for name in KERNEL_FILES)


def test_missing_sources_error_names_both_places_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As an installed package without its kernels folder would be: neither place holds the sources.
    package = tmp_path / "site" / "cupy_amp"
    (package / "kernels").mkdir(parents=True)  # present, but empty
    monkeypatch.setattr(kernel_sources.resources, "files", lambda name: package)
    monkeypatch.setattr(kernel_sources, "__file__", str(package / "kernel_sources.py"))
    for call in (kernel_directory, lambda: read_kernel_source("unscale_check.cu")):
        with pytest.raises(KernelSourceNotFoundError) as info:
            call()
        message = str(info.value)
        assert f"  {package / 'kernels'}\n" in message
        assert f"  {package.parent / 'kernels'}\n" in message
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, CupyAmpError)


def test_a_given_folder_is_read_instead(kernel_copy: Path) -> None:
    marked = kernel_copy / "scale_loss.cu"
    marked.write_text(marked.read_text(encoding="utf-8") + "// only in the copy\n", encoding="utf-8")
    assert "// only in the copy" in read_kernel_source("scale_loss.cu", kernel_copy)
    assert "// only in the copy" not in read_kernel_source("scale_loss.cu")


# Reading and inlining


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_read_kernel_source_inlines_the_shared_header(name: str) -> None:
    source = read_kernel_source(name)
    assert f'#include "{HEADER}"' in (SOURCE_KERNELS / name).read_text(encoding="utf-8")
    assert "#include" not in source
    assert (SOURCE_KERNELS / HEADER).read_text(encoding="utf-8").strip() in source
    header_first_line = original_lines(SOURCE_KERNELS, HEADER)[0]
    assert source.count(header_first_line) == 1  # inlined once


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_read_kernel_source_line_directives_point_at_the_original_files(name: str) -> None:
    named = assert_line_directives_map_back(read_kernel_source(name), SOURCE_KERNELS)
    includes = re.findall(r'^#include "([^"]+)"', (SOURCE_KERNELS / name).read_text(encoding="utf-8"), re.MULTILINE)
    assert named == {name, HEADER, *includes}


def test_nested_includes_are_inlined_with_their_own_line_numbers(kernel_copy: Path) -> None:
    (kernel_copy / "inner.cuh").write_text("// inner line 1\n#define CUPY_AMP_INNER 1\n", encoding="utf-8")
    header = kernel_copy / HEADER
    header.write_text('// leading\n#include "inner.cuh"\n' + header.read_text(encoding="utf-8"), encoding="utf-8")
    source = read_kernel_source("scale_loss.cu", kernel_copy)
    assert "#define CUPY_AMP_INNER 1" in source
    assert "#include" not in source
    assert assert_line_directives_map_back(source, kernel_copy) == {"scale_loss.cu", HEADER, "inner.cuh"}


def test_missing_local_header_raises_naming_it(kernel_copy: Path) -> None:
    (kernel_copy / HEADER).unlink()
    with pytest.raises(KernelSourceNotFoundError, match=re.escape(HEADER)):
        read_kernel_source("scale_loss.cu", kernel_copy)


def test_unknown_kernel_name_raises() -> None:
    with pytest.raises(KernelSourceNotFoundError, match=r"Unknown kernel file 'nope\.cu'") as info:
        read_kernel_source("nope.cu")
    for name in KERNEL_FILES:
        assert name in str(info.value)
    with pytest.raises(KernelSourceNotFoundError):
        read_kernel_source(HEADER)  # a header is not a kernel


# Importing without CuPy


NUMPY_PATH_SCRIPT = """
import sys

import numpy as np

import cupy_amp
from cupy_amp import GradientSet, GradientTypeError, GradScaler, GradScalerCheckpoint

repo = sys.argv[1]
assert cupy_amp.__file__.startswith(repo), f"cupy_amp came from {cupy_amp.__file__}, not {repo}"
scaler = GradScaler(init_scale=8.0, growth_interval=1)
loss = np.array(1.5, dtype=np.float32)
scaler.scale_loss(loss)
assert loss == 12.0, loss
grads = [np.full(4, 16.0, dtype=np.float16), None, np.full(3, 8.0, dtype=np.float64)]
assert scaler.unscale_and_check(grads) is True
assert grads[0].tolist() == [2.0] * 4 and grads[2].tolist() == [1.0] * 3, grads
scaler.update()
assert scaler.scale_factor() == 16.0
grads[0][1] = np.inf
scaler.scale_loss(np.array(1.0, dtype=np.float32))
assert scaler.unscale_and_check(grads) is False
assert scaler.nonfinite_gradients() == [0]
scaler.update()
assert scaler.scale_factor() == 8.0
named = GradientSet({"w": np.full(2, 8.0, dtype=np.float32)})
scaler.scale_loss(np.array(1.0, dtype=np.float32))
assert scaler.unscale_and_check(named) is True
assert list(named)[0].tolist() == [1.0, 1.0]
scaler.update()
restored = GradScaler()
restored.load_checkpoint(GradScalerCheckpoint.from_bytes(scaler.checkpoint().to_bytes()))
assert restored.stats() == scaler.stats()
"""


CUDA_LOOKING_SCRIPT = """
class CudaLooking:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False), "version": 3}


scaler.scale_loss(np.array(1.0, dtype=np.float32))
try:
    scaler.unscale_and_check([CudaLooking()])
except GradientTypeError as exc:
    assert "expected a NumPy or CuPy float array" in str(exc), exc
else:
    raise AssertionError("a CUDA-looking object was accepted")
"""


def run_script(tmp_path: Path, code: str, python_path: list[Path]) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter, from outside the repository, with only ``python_path`` added."""
    script = tmp_path / "script.py"
    script.write_text(code, encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(path) for path in python_path)
    return subprocess.run(
        [sys.executable, str(script), str(REPO)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_importing_cupy_amp_and_using_numpy_does_not_import_cupy(tmp_path: Path) -> None:
    code = (
        "import sys\nimport cupy_amp\n"
        "assert 'cupy' not in sys.modules, 'import cupy_amp imported cupy'\n"
        + NUMPY_PATH_SCRIPT
        + "imported = sorted(m for m in sys.modules if m == 'cupy' or m.startswith('cupy.'))\n"
        "assert not imported, imported\n"
        "print('numpy path ok')\n"
    )
    result = run_script(tmp_path, code, [REPO])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "numpy path ok"


def test_cupy_amp_works_with_numpy_when_importing_cupy_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "cupy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("cupy is blocked for this test")\n', encoding="utf-8")
    code = (
        "try:\n    import cupy\nexcept ImportError as exc:\n    assert 'blocked' in str(exc), exc\n"
        "else:\n    raise AssertionError('the blocker did not stop import cupy')\n"
        + NUMPY_PATH_SCRIPT
        + CUDA_LOOKING_SCRIPT
        + "print('numpy path ok without cupy')\n"
    )
    result = run_script(tmp_path, code, [tmp_path / "blocker", REPO])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "numpy path ok without cupy"
